/* train/ckptio.c: checkpoints and run folders (ckptio.h). */
#include "ckptio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fp8.h"
#include "prefault.h"
#include "state.h"

static char *join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

shard_status ckptio_open_model(shard_comm *world, const char *path, shard_ckpt **out, model *m, dev *d)
{
    shard_status s = shard_ckpt_open_any_on(world, path, out);
    if (s) return s;
    s = model_create(m, shard_ckpt_model(*out), d);
    if (s) {
        shard_ckpt_close(*out);
        *out = NULL;
    }
    return s;
}

size_t ckptio_group_count(shard_ckpt *c, const model *m, const char *group)
{
    size_t found = 0;
    for (size_t i = 0; i < m->ntensors; i++) found += shard_ckpt_find(c, group, m->spec[i].name) >= 0;
    return found;
}

shard_status ckptio_group_tensor(shard_ckpt *c, const char *group, const shard_tensor_spec *t, long *k)
{
    *k = shard_ckpt_find(c, group, t->name);
    if (*k < 0) return shard_fail(SHARD_E_INVALID, "%s: group %s lacks tensor \"%s\"", shard_ckpt_dir(c), group, t->name);
    const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(c, (size_t)*k);
    int same = ct->ndim == t->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = ct->shape[d] == t->shape[d];
    if (!same)
        return shard_fail(SHARD_E_INVALID, "%s: %s/%s has a shape other than the model's", shard_ckpt_dir(c), group,
                          t->name);
    return SHARD_OK;
}

shard_status ckptio_read_group(shard_ckpt *c, const model *m, const char *group, float *dst, int *present)
{
    *present = ckptio_group_count(c, m, group) > 0;
    if (!*present) return SHARD_OK;
    const prefault_span all = {dst, m->nparams * sizeof(float)}; /* every tensor is read whole */
    prefault_spans(&all, 1, ckptio_load_threads(1));
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        long k;
        shard_status s = ckptio_group_tensor(c, group, t, &k);
        if (s) return s;
        shard_box box = {.ndim = t->ndim};
        for (int d = 0; d < t->ndim; d++) box.len[d] = t->shape[d];
        if ((s = shard_ckpt_read(c, (size_t)k, &box, dst + m->offset[i], SHARD_DT_F32))) return s;
    }
    return SHARD_OK;
}

int ckptio_load_threads(int world_size)
{
    const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    long local = ls ? strtol(ls, NULL, 10) : world_size, cores = sysconf(_SC_NPROCESSORS_ONLN);
    long t = cores / (local > 0 ? local : 1);
    return t < 1 ? 1 : t > 16 ? 16 : (int)t;
}

shard_status ckptio_print_load(const char *cmd, shard_comm *world, const shard_ckpt *c, double seconds, uint64_t moved)
{
    uint64_t bytes[2] = {shard_ckpt_bytes_read(c), moved};
    shard_status s = SHARD_OK;
    if (world && shard_comm_size(world) > 1 &&
        ((s = shard_comm_allreduce(world, &seconds, 1, SHARD_DT_F64, SHARD_OP_MAX)) ||
         (s = shard_comm_allreduce(world, bytes, 2, SHARD_DT_U64, SHARD_OP_SUM))))
        return s;
    char between[64] = "";
    if (bytes[1]) snprintf(between, sizeof between, ", %llu bytes between the ranks", (unsigned long long)bytes[1]);
    if (!world || shard_comm_rank(world) == 0)
        fprintf(stderr, "%s: loaded %s: %llu bytes in %.3f s (%.2f GB/s)%s\n", cmd, shard_ckpt_dir(c),
                (unsigned long long)bytes[0], seconds, seconds > 0 ? (double)bytes[0] / seconds / 1e9 : 0.0, between);
    return SHARD_OK;
}

/* run_dir/step-NNNNNN (malloc'd; NULL when out of memory) */
static char *step_path(const char *run_dir, long long step)
{
    char name[64];
    snprintf(name, sizeof name, "step-%06lld", step);
    return join(run_dir, name);
}

void ckptio_print_save(const char *run_dir, long long step, double seconds)
{
    char *dir = step_path(run_dir, step);
    if (!dir) return; /* a report only */
    const uint64_t bytes = shard_tree_bytes(dir);
    fprintf(stderr, "smp-train: saved %s: %llu bytes in %.3f s (%.2f GB/s)\n", dir, (unsigned long long)bytes, seconds,
            seconds > 0 ? (double)bytes / seconds / 1e9 : 0.0);
    free(dir);
}

void ckptio_param_dtypes(shard_ckpt *c, const model *m, shard_dtype *dts)
{
    for (size_t i = 0; i < m->ntensors; i++) {
        long k = shard_ckpt_find(c, "params", m->spec[i].name);
        dts[i] = k >= 0 ? shard_ckpt_tensor_at(c, (size_t)k)->dtype : SHARD_DT_F32;
    }
}

shard_status ckptio_read_fp8(shard_ckpt *c, fp8_state *f)
{
    long h = shard_ckpt_find(c, "fp8", "fp8.amax_history"), sc = shard_ckpt_find(c, "fp8", "fp8.scale");
    if (h < 0 || sc < 0) return SHARD_OK; /* none saved: fresh scaling state */
    const shard_ckpt_tensor *th = shard_ckpt_tensor_at(c, (size_t)h), *ts = shard_ckpt_tensor_at(c, (size_t)sc);
    int64_t rows = (int64_t)f->nlin * FP8_ROLES;
    if (th->ndim != 2 || th->shape[0] != rows || th->shape[1] != f->hist_len || ts->ndim != 1 || ts->shape[0] != rows) {
        fprintf(stderr, "smp-train: warning: %s: the saved FP8 scaling state has another shape (history length?); "
                        "starting a fresh one\n", shard_ckpt_dir(c));
        return SHARD_OK;
    }
    shard_box bh = {.ndim = 2, .len = {rows, f->hist_len}}, bs = {.ndim = 1, .len = {rows}};
    shard_status s = shard_ckpt_read(c, (size_t)h, &bh, f->hist, SHARD_DT_F32);
    if (!s) s = shard_ckpt_read(c, (size_t)sc, &bs, f->scale, SHARD_DT_F32);
    if (!s) s = state_check_fp8(shard_ckpt_dir(c), f->hist, (size_t)(rows * f->hist_len), f->scale, (size_t)rows);
    return s;
}

/* mkdir -p: 0 when dir exists (as a folder) afterwards */
static int mkdir_p(const char *dir)
{
    char *p = strdup(dir);
    if (!p) return -1;
    for (char *q = p + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            free(p);
            return -1;
        }
        *q = '/';
    }
    int rc = mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
    free(p);
    struct stat st;
    if (!rc && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
        errno = ENOTDIR;
        rc = -1;
    }
    return rc;
}

shard_status ckptio_write_grads(const char *dir, const model *m, double loss)
{
    if (mkdir_p(dir) != 0) return shard_fail(SHARD_E_IO, "%s: cannot create: %s", dir, strerror(errno)); /* with its parents */
    char path[4096];
    snprintf(path, sizeof path, "%s/grads.safetensors", dir);
    shard_st_writer *w;
    shard_status s = shard_st_writer_create(path, &w);
    if (s) return s;
    char lbuf[64];
    snprintf(lbuf, sizeof lbuf, "%.17g", loss);
    s = shard_st_writer_metadata(w, "loss", lbuf);
    for (size_t i = 0; i < m->ntensors && !s; i++)
        s = shard_st_writer_declare(w, m->spec[i].name, SHARD_DT_F32, m->spec[i].ndim, m->spec[i].shape);
    float *g = m->grads, *host = NULL;
    if (!s && m->dev->cuda) { /* to the host first */
        host = malloc((m->nparams ? m->nparams : 1) * sizeof(float));
        if (!host) s = shard_fail(SHARD_E_NOMEM, "out of memory");
        else m->dev->ops->download(m->dev, host, m->grads, m->nparams * sizeof(float));
        g = host;
    }
    for (size_t i = 0; i < m->ntensors && !s; i++)
        s = shard_st_writer_write(w, g + m->offset[i], m->numel[i] * sizeof(float));
    free(host);
    if (s) {
        shard_st_writer_abort(w);
        return s;
    }
    return shard_st_writer_finish(w);
}

/* the parameters on the host: the model's own array on the C backend, else the
 * copy model_params_download made */
static const float *host_params(const model *m)
{
    return m->dev->cuda ? m->hparams : (const float *)m->params;
}

static shard_status write_latest(const char *run_dir, const char *name)
{
    char *tmp = join(run_dir, ".latest.tmp"), *lat = join(run_dir, "latest");
    shard_status s = SHARD_OK;
    if (!tmp || !lat) {
        s = shard_fail(SHARD_E_NOMEM, "out of memory");
        goto out;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        s = shard_fail(SHARD_E_IO, "%s: cannot create: %s", tmp, strerror(errno));
        goto out;
    }
    char line[300];
    int n = snprintf(line, sizeof line, "%s\n", name);
    if (write(fd, line, (size_t)n) != n || fsync(fd) != 0) {
        s = shard_fail(SHARD_E_IO, "%s: write failed: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto out;
    }
    close(fd);
    if (rename(tmp, lat) != 0) {
        s = shard_fail(SHARD_E_IO, "%s: cannot rename to %s: %s", tmp, lat, strerror(errno));
        unlink(tmp);
        goto out;
    }
    s = shard_fsync_dir(run_dir);
out:
    free(tmp);
    free(lat);
    return s;
}

static shard_status write_fp8(shard_h5_writer *hw, const fp8_state *f)
{
    int64_t rows = (int64_t)f->nlin * FP8_ROLES;
    int64_t hs[2] = {rows, f->hist_len}, ss[1] = {rows};
    shard_box hb = {.ndim = 2, .len = {rows, f->hist_len}}, sb = {.ndim = 1, .len = {rows}};
    shard_status s = shard_h5_write_local(hw, "fp8", "fp8.amax_history", SHARD_DT_F32, 2, hs, &hb, f->hist, SHARD_DT_F32);
    if (!s) s = shard_h5_write_local(hw, "fp8", "fp8.scale", SHARD_DT_F32, 1, ss, &sb, f->scale, SHARD_DT_F32);
    return s;
}

/* The lock's holder, written into the lock file: "pid 123 on host h" */
static void lock_holder(int fd, char *buf, size_t cap)
{
    ssize_t n = pread(fd, buf, cap - 1, 0);
    buf[n > 0 ? n : 0] = 0;
    for (char *c = buf; *c; c++)
        if (*c == '\n' || (unsigned char)*c < 32) *c = 0;
    if (!buf[0]) snprintf(buf, cap, "another process");
}

static int is_step_staging(const char *name, void *ctx)
{
    (void)ctx;
    return !strncmp(name, ".tmp-step-", 10) && shard_is_staging_name(name, NULL);
}

/* The staging folders of saves that never committed (the run killed mid-save: SIGKILL,
 * a lost node, a job's time limit), each often a whole checkpoint's size and hidden:
 * only the lock's holder saves step folders here, so while this process holds the lock
 * they are garbage. Removed, each with a note. */
static void sweep_staging(const char *run_dir)
{
    char **names = NULL;
    size_t n = 0;
    if (shard_list_dir(run_dir, is_step_staging, NULL, &names, &n)) return; /* best effort */
    for (size_t i = 0; i < n; i++) {
        char *p = join(run_dir, names[i]);
        struct stat st;
        if (p && lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) {
            const double mib = (double)shard_remove_tree(p) / (1 << 20);
            fprintf(stderr, "smp-train: note: %s: removed, the staging folder of a save that did not finish "
                            "(%.1f MiB)\n", p, mib);
        }
        free(p);
    }
    shard_free_names(names, n);
}

shard_status ckptio_prepare(const char *run_dir, int *lock_fd)
{
    *lock_fd = -1;
    if (mkdir_p(run_dir) != 0)
        return shard_fail(SHARD_E_IO, "%s: cannot create the run folder: %s", run_dir, strerror(errno));
    char *path = join(run_dir, ".lock");
    if (!path) return shard_fail(SHARD_E_NOMEM, "out of memory");
    /* no links, no waiting on a FIFO; a file only */
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    struct stat st;
    shard_status s = SHARD_OK;
    int locked = 0;
    if (fd < 0 && errno == ELOOP)
        s = shard_fail(SHARD_E_INVALID, "%s: the run folder's lock is a symbolic link (refused)", path);
    else if (fd < 0 || fstat(fd, &st) != 0)
        s = shard_fail(SHARD_E_IO, "%s: cannot open the run folder's lock: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        s = shard_fail(SHARD_E_INVALID, "%s: the run folder's lock is not a regular file", path);
    else if (!(locked = flock(fd, LOCK_EX | LOCK_NB) == 0) && errno == EWOULDBLOCK) {
        char who[128];
        lock_holder(fd, who, sizeof who);
        s = shard_fail(SHARD_E_USAGE, "%s: another smp-train is saving into this run folder (%s)", run_dir, who);
    } else { /* locked, or a file system without flock: the run goes on */
        char who[128], host[64] = "?";
        gethostname(host, sizeof host - 1);
        const int n = snprintf(who, sizeof who, "pid %ld on host %s\n", (long)getpid(), host);
        if (ftruncate(fd, 0) == 0) (void)!pwrite(fd, who, (size_t)n, 0); /* a hint for the message above */
        *lock_fd = fd;
        fd = -1;
        if (locked) sweep_staging(run_dir); /* without flock another run may be saving */
    }
    if (fd >= 0) close(fd);
    free(path);
    return s;
}

shard_status ckptio_check_shared(const char *run_dir, par_ctx *p)
{
    if (p->size == 1) return SHARD_OK;
    char buf[4096 + 256] = {0}; /* rank 0's run folder, then its lock's text */
    shard_status s = SHARD_OK;
    char *lock = NULL, *text = NULL;
    size_t len;
    if (p->rank == 0) {
        snprintf(buf, 4096, "%s", run_dir);
        if (!(lock = join(run_dir, ".lock"))) s = shard_fail(SHARD_E_NOMEM, "out of memory");
        if (!s && !shard_read_file_in(lock, 255, 1, &text, &len)) memcpy(buf + 4096, text, len);
    }
    if (!s) s = shard_comm_broadcast(p->world, buf, sizeof buf, SHARD_DT_U8, 0);
    if (!s && p->rank != 0) {
        if (!(lock = join(buf, ".lock"))) s = shard_fail(SHARD_E_NOMEM, "out of memory");
        else if (shard_read_file_in(lock, 255, 1, &text, &len) || strcmp(text, buf + 4096))
            s = shard_fail(SHARD_E_USAGE, "%s: rank %d does not see the run folder that rank 0 made (its .lock, "
                           "written by rank 0, is %s there): --save-dir must be on a file system every rank shares "
                           "(each save writes every rank's part into it)", buf, p->rank, text ? "another" : "missing");
    }
    free(lock);
    free(text);
    return shard_comm_agree(p->world, s, "another rank does not see the run folder", NULL);
}

static shard_status write_rank_file(const ckptio_save_args *a, const model *m, const optim *o, par_ctx *p,
                                    const char *staging)
{
    const float *hp = host_params(m);
    if (!hp || !o->hm) return shard_fail(SHARD_E_INTERNAL, "checkpoint: the host copies of the state are missing");
    int any = p->rank == 0 && m->fp8;
    for (size_t i = 0; i < m->ntensors; i++)
        any |= (p->pp[i].holds && p->pp[i].writes && m->numel[i]) || (p->op[i].writes && p->zn[i]);
    if (!any) return SHARD_OK;
    char name[64];
    snprintf(name, sizeof name, "shard-%05d.h5", p->rank);
    char *path = join(staging, name);
    if (!path) return shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_h5_writer *hw;
    shard_status s = shard_h5_create(path, a->compress, &hw);
    free(path);
    if (s) return s;
    for (size_t i = 0; !s && i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        if (p->pp[i].holds && p->pp[i].writes && m->numel[i])
            s = shard_h5_write_local(hw, "params", t->name, a->param_dtypes ? a->param_dtypes[i] : SHARD_DT_F32, t->ndim,
                                     t->shape, &p->pp[i].box, hp + m->offset[i], SHARD_DT_F32);
    }
    const char *groups[3] = {"optim/master", "optim/exp_avg", "optim/exp_avg_sq"};
    for (int g = 0; g < 3 && !s; g++) {
        size_t base = 0;
        for (size_t i = 0; !s && i < m->ntensors; i++) {
            const shard_tensor_spec *t = &m->spec[i];
            const float *src = g == 0 ? (o->hmaster ? o->hmaster + base : hp + m->offset[i] + p->zoff[i])
                                      : (g == 1 ? o->hm : o->hv) + base;
            if (p->op[i].writes && p->zn[i])
                s = shard_h5_write_local(hw, groups[g], t->name, SHARD_DT_F32, t->ndim, t->shape, &p->op[i].box, src,
                                         SHARD_DT_F32);
            base += p->zn[i];
        }
    }
    if (!s && p->rank == 0 && m->fp8) s = write_fp8(hw, m->fp8);
    if (s) shard_h5_abort(hw);
    else s = shard_h5_close(hw);
    return s;
}

/* every rank learns whether any failed (libshard's agreement, its own message kept) */
static shard_status agree(par_ctx *p, shard_status mine)
{
    return shard_comm_agree(p->world, mine, "another rank failed to write its part of the checkpoint", NULL);
}

shard_status ckptio_save(const ckptio_save_args *a, const model *m, const optim *o, par_ctx *p)
{
    char name[64];
    snprintf(name, sizeof name, "step-%06lld", (long long)a->step);
    char staging[4096];
    memset(staging, 0, sizeof staging);
    shard_ckpt_writer *cw = NULL;
    shard_status s = SHARD_OK;
    char *final_dir = join(a->run_dir, name);
    if (!final_dir) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    if (p->rank == 0 && !s) {
        if (mkdir_p(a->run_dir) != 0)
            s = shard_fail(SHARD_E_IO, "%s: cannot create the run folder: %s", a->run_dir, strerror(errno));
        if (!s) s = shard_ckpt_begin(final_dir, &cw);
        if (!s) snprintf(staging, sizeof staging, "%s", shard_ckpt_staging(cw));
    }
    s = agree(p, s);
    if (!s) s = shard_comm_broadcast(p->world, staging, sizeof staging, SHARD_DT_U8, 0);
    if (!s) s = agree(p, write_rank_file(a, m, o, p, staging));
    if (p->rank == 0) { /* the extra files, the manifest, latest */
        if (!s && a->src) s = shard_ckpt_carry_extras(cw, a->src);
        if (!s) {
            s = shard_ckpt_commit(cw, a->config_json, a->config_len, &m->d, &p->l, p->stages, a->training_json, 1);
            if (!s) cw = NULL; /* a successful commit frees the writer; on failure abort removes the staging */
        }
        if (!s) s = write_latest(a->run_dir, name);
        if (cw) shard_ckpt_abort(cw);
    }
    s = agree(p, s);
    free(final_dir);
    return s;
}

void ckptio_follow(const char *run_dir, long long step, shard_ckpt **carry)
{
    char *dir = step_path(run_dir, step);
    shard_ckpt *c = NULL;
    if (dir && !shard_ckpt_open(dir, &c)) {
        shard_ckpt_close(*carry);
        *carry = c;
    } /* else (it was just committed): the one before stays */
    free(dir);
}

static int step_of(const char *name, long long *step)
{
    if (strncmp(name, "step-", 5)) return 0;
    const char *p = name + 5;
    if (!*p) return 0;
    for (const char *q = p; *q; q++)
        if (*q < '0' || *q > '9') return 0;
    *step = atoll(p);
    return 1;
}

typedef struct {
    long long step;
    struct timespec committed; /* its smp.json's mtime: written last, by the commit */
} step_dir;

static int by_commit(const void *a, const void *b)
{
    const step_dir *x = a, *y = b;
    if (x->committed.tv_sec != y->committed.tv_sec) return x->committed.tv_sec < y->committed.tv_sec ? -1 : 1;
    if (x->committed.tv_nsec != y->committed.tv_nsec) return x->committed.tv_nsec < y->committed.tv_nsec ? -1 : 1;
    return x->step < y->step ? -1 : x->step > y->step;
}

/* The old step folder p removed (its tree, or the link itself when it is a symbolic link,
 * never what it points at; a warning if it is still there), unless a reader has it open
 * (shard_ckpt_open's shared flock on its smp.json): then 0, left for a later save. Under
 * the exclusive lock it is first renamed out of the way (a reader finds it gone, not half
 * removed) to a staging name, which the next run sweeps if this one is killed midway. */
static int remove_step(const char *p)
{
    char *mp = join(p, "smp.json");
    int fd = mp ? open(mp, O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK) : -1; /* NFS locks want write access */
    if (fd < 0 && mp) fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    free(mp);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
        close(fd);
        return 0;
    }
    char *trash = shard_staging_path(p);
    const char *q = trash && rename(p, trash) == 0 ? trash : p;
    errno = 0;
    shard_remove_tree(q);
    int e = errno;
    struct stat st;
    if (lstat(q, &st) == 0)
        fprintf(stderr, "smp-train: warning: %s: could not remove an old checkpoint: %s\n", q, strerror(e ? e : EEXIST));
    if (fd >= 0) close(fd);
    free(trash);
    return 1;
}

/* whether held already names step; else it does now (when there is room) */
static int said_held(ckptio_held *held, long long step)
{
    for (int i = 0; i < held->n; i++)
        if (held->step[i] == step) return 1;
    if (held->n < (int)(sizeof held->step / sizeof held->step[0])) held->step[held->n++] = step;
    return 0;
}

/* Keep the `keep` checkpoints committed last (a run resumed from an older step saves
 * lower step numbers than the ones it abandoned), and always the one latest names. */
void ckptio_prune(const char *run_dir, int keep, ckptio_held *held)
{
    if (keep <= 0) return;
    char *lat = join(run_dir, "latest"), *latest = NULL;
    size_t len;
    if (!lat || shard_read_file_in(lat, 4096, 1, &latest, &len)) latest = NULL;
    else latest[strcspn(latest, "\r\n")] = 0;
    free(lat);
    DIR *d = opendir(run_dir);
    step_dir *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        long long st;
        if (!step_of(e->d_name, &st)) continue;
        char *m = join(run_dir, e->d_name), *man = m ? join(m, "smp.json") : NULL;
        struct stat sb;
        int whole = man && lstat(man, &sb) == 0;
        free(m);
        free(man);
        if (!whole) continue; /* not a committed checkpoint: not ours to judge */
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            step_dir *p = realloc(steps, cap * sizeof *p);
            if (!p) break;
            steps = p;
        }
        steps[n++] = (step_dir){st, sb.st_mtim};
    }
    if (d) closedir(d);
    if (n > (size_t)keep) {
        qsort(steps, n, sizeof *steps, by_commit);
        for (size_t i = 0; i + (size_t)keep < n; i++) {
            char name[64];
            snprintf(name, sizeof name, "step-%06lld", steps[i].step);
            if (latest && !strcmp(name, latest)) continue; /* what a resume needs */
            char *p = join(run_dir, name);
            if (p && !remove_step(p) && !said_held(held, steps[i].step))
                fprintf(stderr, "smp-train: note: %s: kept for now, another process is reading it; a later save "
                                "prunes it (--keep)\n", p);
            free(p);
        }
    }
    free(steps);
    free(latest);
}
