/* convert/convert.c: hf2smp, reshard and init (convert.h). All three are the same
 * loop: for every rank of the target layout and every tensor, the piece that rank
 * writes is copied out of the source (a safetensors tensor, the planner reading the
 * stored pieces, or the initializer). */
#include "convert.h"

#include "init.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static shard_status nomem(void) { return shard_fail(SHARD_E_NOMEM, "out of memory"); }

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* ------------------------------------------------------------ the sources */
shard_status convert_open_hf(const char *dir, convert_source *src)
{
    memset(src, 0, sizeof *src);
    struct stat st;
    if (stat(dir, &st) != 0) return shard_fail(SHARD_E_INVALID, "%s: no such folder", dir);
    if (!S_ISDIR(st.st_mode))
        return shard_fail(SHARD_E_INVALID, "%s: not a folder (a model folder: config.json and its safetensors)", dir);
    char *cfg = join(dir, "config.json"), *man = join(dir, "smp.json"), *lat = join(dir, "latest");
    const int ckpt = cfg && man && lat && lstat(cfg, &st) != 0 && (lstat(man, &st) == 0 || lstat(lat, &st) == 0);
    free(man);
    free(lat);
    if (!cfg) return nomem();
    if (ckpt) { /* the mix-up the other way round */
        free(cfg);
        return shard_fail(SHARD_E_INVALID, "%s: an SMP checkpoint or run folder, not a model folder (smp-convert reshard "
                                           "changes its layout, smp-merge exports it)", dir);
    }
    shard_status s = shard_config_read(cfg, &src->model, &src->text, &src->config_len);
    free(cfg);
    if (!s) s = shard_weights_open(dir, &src->w);
    if (!s) s = shard_model_check_weights(&src->model, src->w, dir);
    if (s) { convert_source_close(src); return s; }
    src->d = &src->model;
    src->config = src->text;
    src->dir = src->path = dir;
    return SHARD_OK;
}

shard_status convert_open_ckpt(const char *dir, shard_comm *world, convert_source *src)
{
    memset(src, 0, sizeof *src);
    shard_status s = shard_ckpt_open_any_on(world, dir, &src->c);
    if (s) return s;
    src->path = dir;
    src->d = shard_ckpt_model(src->c);
    src->config = shard_ckpt_config_json(src->c);
    src->config_len = strlen(src->config);
    return SHARD_OK;
}

shard_status convert_open_init(const char *config_path, uint64_t seed, convert_source *src)
{
    memset(src, 0, sizeof *src);
    /* read once: what is parsed is exactly what the checkpoint stores */
    shard_status s = shard_config_read(config_path, &src->model, &src->text, &src->config_len);
    if (s) return s;
    src->d = &src->model;
    src->config = src->text;
    src->path = config_path;
    src->init = 1;
    src->seed = seed;
    return SHARD_OK;
}

void convert_source_close(convert_source *src)
{
    shard_weights_close(src->w);
    shard_ckpt_close(src->c);
    free(src->text);
    memset(src, 0, sizeof *src);
}

/* ------------------------------------------------------- hf2smp's reads */
/* The rows of a sub-box straight from the safetensors file with pread (the page cache
 * copies once into the chunk buffer: no page faults of a mapping, no second copy),
 * converting dtype where asked. */
typedef struct {
    int fd;
    const char *path;
    const shard_st_tensor *st;
    const int64_t *gshape;
    int ndim;
} file_source;

/* The source files of hf2smp, each opened once for the whole conversion. */
typedef struct {
    const char *dir;
    size_t n;
    const char *names[4096];
    char *paths[4096]; /* for messages */
    int fds[4096];
} file_cache;

static shard_status cached_fd(file_cache *fc, const char *name, int *fd, const char **path)
{
    for (size_t i = 0; i < fc->n; i++)
        if (!strcmp(fc->names[i], name)) { *fd = fc->fds[i]; *path = fc->paths[i]; return SHARD_OK; }
    if (fc->n == sizeof fc->fds / sizeof fc->fds[0]) return shard_fail(SHARD_E_UNSUPPORTED, "%s: more than 4096 weight files", fc->dir);
    char *p = join(fc->dir, name);
    if (!p) return nomem();
    uint64_t size;
    shard_status s = shard_open_regular(p, 0, fd, &size);
    if (s) { free(p); return s; }
    fc->names[fc->n] = name;
    fc->paths[fc->n] = p;
    fc->fds[fc->n++] = *fd;
    *path = p;
    return SHARD_OK;
}

static void close_cache(file_cache *fc)
{
    for (size_t i = 0; fc && i < fc->n; i++) { close(fc->fds[i]); free(fc->paths[i]); }
    free(fc);
}

static shard_status fill_from_file(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const file_source *fs = ctx;
    const int nd = fs->ndim;
    const size_t ses = shard_dtype_size(fs->st->dtype), des = shard_dtype_size(dt);
    const int64_t rowlen = sub->len[nd - 1];
    const uint64_t nrows = shard_box_numel(sub) / (uint64_t)rowlen;
    const int whole_rows = sub->off[nd - 1] == 0 && rowlen == fs->gshape[nd - 1];
    /* rows [r0, r1) of the sub-box that are consecutive in the file form one read */
    char tmp[1 << 16];
    int64_t idx[SHARD_MAX_DIMS];
    for (uint64_t r = 0; r < nrows;) {
        uint64_t rem = r;
        for (int k = nd - 2; k >= 0; k--) { idx[k] = sub->off[k] + (int64_t)(rem % (uint64_t)sub->len[k]); rem /= (uint64_t)sub->len[k]; }
        int64_t flat = 0;
        for (int k = 0; k < nd - 1; k++) flat = flat * fs->gshape[k] + idx[k];
        flat = flat * fs->gshape[nd - 1] + sub->off[nd - 1];
        uint64_t run = 1;
        if (whole_rows && nd >= 2) { /* the rest of this plane's rows are contiguous */
            uint64_t left = (uint64_t)(sub->len[nd - 2] - (idx[nd - 2] - sub->off[nd - 2]));
            run = left < nrows - r ? left : nrows - r;
        }
        size_t n = (size_t)(run * (uint64_t)rowlen);
        uint64_t off = fs->st->file_offset + (uint64_t)flat * ses;
        char *out = (char *)dst + (size_t)(r * (uint64_t)rowlen) * des;
        shard_status s;
        if (dt == fs->st->dtype) {
            s = shard_pread_full(fs->fd, fs->path, out, n * ses, off);
        } else { /* through a small buffer, converting */
            s = SHARD_OK;
            for (size_t done = 0; done < n && !s;) {
                size_t k = (n - done) * ses < sizeof tmp ? n - done : sizeof tmp / ses;
                s = shard_pread_full(fs->fd, fs->path, tmp, k * ses, off + done * ses);
                if (!s) s = shard_convert(out + done * des, dt, tmp, fs->st->dtype, k);
                done += k;
            }
        }
        if (s) return s;
        r += run;
    }
    return SHARD_OK;
}

/* reshard: the planner fills any sub-box of a target piece from the stored pieces */
typedef struct {
    shard_ckpt *c;
    size_t index;
} ckpt_source;

static shard_status fill_from_ckpt(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const ckpt_source *cs = ctx;
    return shard_ckpt_read(cs->c, cs->index, sub, dst, dt);
}

typedef union {
    file_source f;
    ckpt_source c;
    init_tensor i;
} piece_source;

/* ------------------------------------------------- closing in the background */
/* Closing a shard file (its checksum, and the fsync) runs in a thread of its own,
 * beside the other closes and the writing of the next files; one at a time per closer. */
typedef struct {
    pthread_t th;
    shard_h5_writer *w;
    int running;
    shard_status s;
    char msg[1024]; /* messages are per thread */
} closer;

static void *close_main(void *arg)
{
    closer *c = arg;
    c->s = shard_h5_close(c->w);
    if (c->s) snprintf(c->msg, sizeof c->msg, "%s", shard_errmsg());
    return NULL;
}

static shard_status closer_wait(closer *c)
{
    if (!c->running) return SHARD_OK;
    pthread_join(c->th, NULL);
    c->running = 0;
    return c->s ? shard_fail(c->s, "%s", c->msg) : SHARD_OK;
}

static shard_status close_in_background(closer *c, shard_h5_writer *w)
{
    shard_status s = closer_wait(c);
    if (s) { shard_h5_abort(w); return s; }
    c->w = w;
    if (pthread_create(&c->th, NULL, close_main, c) != 0) return shard_h5_close(w);
    c->running = 1;
    return SHARD_OK;
}

/* --------------------------------------------------------------- the jobs */
/* One tensor to write: a model tensor of group params, an optimizer group's copy of
 * one, or (reshard) a tensor of the fp8 group, written whole by rank 0. */
typedef struct {
    const char *group;
    shard_tensor_spec spec; /* name and shape (role unused for fp8) */
    size_t src_index;       /* reshard: the source tensor */
    shard_dtype src_dt;
    const char *src_file;   /* hf2smp: the safetensors file holding the tensor */
} job;

/* hf2smp and init: the model's tensors (params) */
static void model_jobs(const convert_source *src, job *j, size_t *n)
{
    for (size_t i = 0; i < shard_model_tensor_count(src->d); i++) {
        job *x = &j[(*n)++];
        x->group = "params";
        shard_model_tensor(src->d, i, &x->spec);
        x->src_dt = SHARD_DT_F32;
        if (src->w) {
            const shard_st_tensor *st = shard_weights_find(src->w, x->spec.name); /* checked at open */
            size_t wi = 0;
            while (shard_weights_at(src->w, wi) != st) wi++;
            x->src_dt = st->dtype;
            x->src_file = shard_weights_file_of(src->w, wi);
        }
    }
}

/* reshard: every tensor of the source, in the model's order within each group, then
 * the fp8 group's */
static void ckpt_jobs(const convert_source *src, job *j, size_t *n)
{
    static const char *groups[] = {"params", "optim/master", "optim/exp_avg", "optim/exp_avg_sq", NULL};
    const size_t nt = shard_model_tensor_count(src->d);
    for (int g = 0; groups[g]; g++)
        for (size_t i = 0; i < nt; i++) {
            shard_tensor_spec sp;
            shard_model_tensor(src->d, i, &sp);
            long ci = shard_ckpt_find(src->c, groups[g], sp.name);
            if (ci < 0) continue; /* validated at open: params are complete */
            j[(*n)++] = (job){groups[g], sp, (size_t)ci, shard_ckpt_tensor_at(src->c, (size_t)ci)->dtype, NULL};
        }
    for (size_t i = 0; i < shard_ckpt_tensor_count(src->c); i++) {
        const shard_ckpt_tensor *t = shard_ckpt_tensor_at(src->c, i);
        if (strcmp(t->group, "fp8")) continue;
        job *x = &j[(*n)++];
        x->group = "fp8";
        snprintf(x->spec.name, sizeof x->spec.name, "%s", t->name);
        x->spec.layer = -1;
        x->spec.ndim = t->ndim > 2 ? 2 : t->ndim;
        for (int k = 0; k < x->spec.ndim; k++) x->spec.shape[k] = t->shape[k];
        x->src_index = i;
        x->src_dt = t->dtype;
    }
}

static job *make_jobs(const convert_source *src, size_t *n)
{
    size_t cap = shard_model_tensor_count(src->d) + (src->c ? shard_ckpt_tensor_count(src->c) : 0);
    job *j = calloc(cap + 1, sizeof *j);
    if (!j) return NULL;
    *n = 0;
    if (src->c) ckpt_jobs(src, j, n);
    else model_jobs(src, j, n);
    return j;
}

/* ------------------------------------------------------------------ a run */
typedef struct {
    const convert_opts *o;
    const convert_source *src;
    const shard_model_desc *d;
    shard_layout l;
    int stages[SHARD_MAX_PP];
    shard_compress comp;
    int me, procs, nranks, secondhand;
    job *jobs;
    size_t nj;
    file_cache *files;
    char staging[4096];
    shard_ckpt_writer *cw; /* process 0 */
} run;

/* Every process learns whether any failed; the first failure's status. */
static shard_status agree(run *r, shard_status mine)
{
    return r->o->world ? shard_comm_agree(r->o->world, mine, "another process failed", &r->secondhand) : mine;
}

static shard_status piece_for(const run *r, const job *jb, int rank, shard_piece *pc)
{
    if (!strcmp(jb->group, "params")) return shard_partition(r->d, &r->l, r->stages, &jb->spec, rank, pc);
    if (!strncmp(jb->group, "optim/", 6)) return shard_partition_optim(r->d, &r->l, r->stages, &jb->spec, rank, pc);
    /* fp8 scaling state: small, replicated; rank 0 stores it whole */
    memset(pc, 0, sizeof *pc);
    pc->holds = 1;
    pc->writes = rank == 0;
    pc->box.ndim = jb->spec.ndim;
    for (int k = 0; k < jb->spec.ndim; k++) pc->box.len[k] = jb->spec.shape[k];
    return SHARD_OK;
}

static shard_dtype job_dtype(const run *r, const job *jb)
{
    if (strcmp(jb->group, "params")) return jb->src_dt; /* the optimizer's state and fp8's as they are */
    if (r->o->dtype != SHARD_DT_INVALID) return r->o->dtype;
    if (r->src->init) return r->d->torch_dtype == SHARD_DT_BF16 ? SHARD_DT_BF16 : SHARD_DT_F32;
    return jb->src_dt;
}

/* The layout, stages and compression asked for, the jobs; the output must be new. */
static shard_status plan(run *r)
{
    const convert_opts *o = r->o;
    shard_status s;
    if ((s = shard_layout_parse(o->layout, &r->l)) || (s = shard_layout_check(&r->l, r->d)) ||
        (s = shard_stages_parse(o->stages, r->d, r->l.pp, r->stages)) || (s = shard_compress_parse(o->compress, &r->comp)))
        return s;
    r->comp.threads = o->threads;
    r->comp.no_fsync = o->no_fsync;
    if ((s = shard_check_output(o->out, SHARD_OUT_NEW_DIR))) return s;
    r->nranks = shard_layout_size(&r->l);
    r->files = calloc(1, sizeof *r->files);
    if (!r->files || !(r->jobs = make_jobs(r->src, &r->nj))) return nomem();
    r->files->dir = r->src->dir;
    return SHARD_OK;
}

/* What the source holds: a checkpoint's manifest; a model folder's config.json and
 * weights (sampled: shard_weights_fingerprint); init's config.json. */
static shard_status source_fingerprint(const convert_source *src, uint64_t *fp)
{
    if (src->c) { *fp = shard_ckpt_fingerprint(src->c); return SHARD_OK; }
    *fp = shard_hash64(0, src->config, src->config_len);
    uint64_t w = 0;
    shard_status s = src->w ? shard_weights_fingerprint(src->w, &w) : SHARD_OK;
    *fp = shard_hash64(*fp, &w, sizeof w);
    return s;
}

/* Every process on the same source and settings as process 0 (shard_agree_check): each
 * opens the source and parses its flags itself, so a host's other copy of the model
 * folder or checkpoint, or an MPMD launch with other flags, would write a mix of them. */
static shard_status agree_inputs(run *r)
{
    if (r->procs == 1) return SHARD_OK;
    const convert_source *src = r->src;
    uint64_t fp = 0;
    shard_status s = agree(r, source_fingerprint(src, &fp));
    if (s) return s;
    const shard_agree_item fixed[] = {
        {src->c ? SHARD_AGREE_CKPT : SHARD_AGREE_MODEL, src->path, fp}, SHARD_AGREE_LAYOUT(&r->l),
        {SHARD_AGREE_INT, "--seed", src->seed}, {SHARD_AGREE_DTYPE, "--dtype", (uint64_t)r->o->dtype},
        {SHARD_AGREE_INT, "--compress (its zstd level)", (uint64_t)r->comp.zstd_level},
        {SHARD_AGREE_INT, "--compress (1: zstd, 0: zstd:N or none)", (uint64_t)r->comp.planes},
        {SHARD_AGREE_INT, "--no-fsync", (uint64_t)r->o->no_fsync},
    };
    shard_agree_item items[sizeof fixed / sizeof fixed[0] + SHARD_MAX_PP];
    memcpy(items, fixed, sizeof fixed);
    int n = (int)(sizeof fixed / sizeof fixed[0]);
    for (int k = 0; k < r->l.pp; k++)
        items[n++] = (shard_agree_item){SHARD_AGREE_INT, "--stages (a stage's layers)", (uint64_t)r->stages[k]};
    return shard_agree_check(r->o->world, items, n);
}

/* The bytes this process writes. */
static shard_status count_bytes(const run *r, uint64_t *total)
{
    shard_piece pc;
    *total = 0;
    for (int rank = r->me; rank < r->nranks; rank += r->procs)
        for (size_t i = 0; i < r->nj; i++) {
            shard_status s = piece_for(r, &r->jobs[i], rank, &pc);
            if (s) return s;
            if (pc.holds && pc.writes) *total += shard_box_numel(&pc.box) * shard_dtype_size(job_dtype(r, &r->jobs[i]));
        }
    return SHARD_OK;
}

/* Process 0 makes the staging folder; every process learns its name. */
static shard_status begin(run *r, shard_status s)
{
    if (!s && r->me == 0) {
        const shard_write_opts wo = {r->o->no_fsync};
        s = shard_ckpt_begin_opts(r->o->out, &wo, &r->cw);
        if (!s) snprintf(r->staging, sizeof r->staging, "%s", shard_ckpt_staging(r->cw));
    }
    if ((s = agree(r, s)) || r->procs == 1) return s;
    if ((s = shard_comm_broadcast(r->o->world, r->staging, sizeof r->staging, SHARD_DT_U8, 0))) return s;
    /* each process writes its shard files into it: one on a host's own disk would not */
    struct stat st;
    if (r->me != 0 && (stat(r->staging, &st) != 0 || !S_ISDIR(st.st_mode)))
        s = shard_fail(SHARD_E_USAGE, "%s: rank %d does not see the staging folder that rank 0 made (%s): --out "
                       "must be on a file system every rank shares", r->o->out, r->me, r->staging);
    return agree(r, s);
}

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Where piece x of job jb comes from. */
static shard_status set_source(run *r, const job *jb, shard_h5_piece *x, piece_source *ps)
{
    const convert_source *src = r->src;
    const shard_tensor_spec *t = &jb->spec;
    if (src->init) {
        const shard_init_rule rule = shard_role_init(t->role);
        /* transformers zeroes the padding token's embedding row */
        ps->i = (init_tensor){t, src->seed, name_hash(t->name), r->d->initializer_range, rule != SHARD_INIT_NORMAL,
                              rule == SHARD_INIT_ONES ? 1.0f : 0.0f, t->role == SHARD_T_EMBED ? r->d->pad_token_id : -1};
        x->fill = init_fill;
        return SHARD_OK;
    }
    if (src->w) {
        ps->f = (file_source){-1, NULL, shard_weights_find(src->w, t->name), t->shape, t->ndim};
        x->fill = fill_from_file;
        return cached_fd(r->files, jb->src_file, &ps->f.fd, &ps->f.path);
    }
    /* the planner assembles this piece chunk by chunk from the stored ones */
    ps->c = (ckpt_source){src->c, jb->src_index};
    x->fill = fill_from_ckpt;
    return SHARD_OK;
}

static shard_status create_shard(const run *r, int rank, shard_h5_writer **hw)
{
    char name[32];
    snprintf(name, sizeof name, "shard-%05d.h5", rank);
    char *p = join(r->staging, name);
    if (!p) return nomem();
    shard_status s = shard_h5_create(p, r->comp, hw);
    free(p);
    return s;
}

/* The pieces of output ranks r0, r0 + procs, ... (G of them): piece i of each of the
 * files, then piece i+1, ... (each file gets its pieces in the jobs' order, as if
 * written alone); a file is created with its first piece. */
static shard_status group_pieces(run *r, int r0, int G, shard_h5_writer **hw, shard_h5_piece *pieces, piece_source *srcs,
                                 size_t *np)
{
    shard_status s = SHARD_OK;
    shard_piece pc;
    for (size_t i = 0; i < r->nj && !s; i++)
        for (int k = 0; k < G && !s && r0 + k * r->procs < r->nranks; k++) {
            const int rank = r0 + k * r->procs;
            const job *jb = &r->jobs[i];
            if ((s = piece_for(r, jb, rank, &pc))) break;
            if (!pc.holds || !pc.writes || shard_box_numel(&pc.box) == 0) continue;
            if (!hw[k] && (s = create_shard(r, rank, &hw[k]))) break;
            const shard_tensor_spec *t = &jb->spec;
            shard_h5_piece *x = &pieces[*np];
            piece_source *ps = &srcs[(*np)++];
            *x = (shard_h5_piece){hw[k], jb->group, t->name, job_dtype(r, jb), t->ndim, t->shape, pc.box, NULL, ps};
            s = set_source(r, jb, x, ps);
        }
    return s;
}

/* shard_h5_write_pieces reports each chunk written */
static void chunk_done(void *arg, uint64_t bytes)
{
    const convert_progress *p = arg;
    p->add(p->ctx, bytes);
}

/* This process's output ranks, G at a time (G: the worker threads): their pieces go out
 * as one stream (shard_h5_write_pieces); the G files are then closed together, in
 * parallel threads, while the next G are written. A close computes the file's
 * checksum (and fsyncs): that work is spread over the cores, not left to one of them
 * at the end. */
static shard_status write_shards(run *r)
{
    enum { GROUP_MAX = 16 };
    const int G = r->comp.threads < 1 ? 1 : r->comp.threads < GROUP_MAX ? r->comp.threads : GROUP_MAX;
    const convert_progress *pg = &r->o->progress;
    closer cl[GROUP_MAX];
    memset(cl, 0, sizeof cl);
    shard_h5_piece *pieces = calloc(r->nj * (size_t)G + 1, sizeof *pieces);
    piece_source *srcs = calloc(r->nj * (size_t)G + 1, sizeof *srcs);
    shard_status s = pieces && srcs ? SHARD_OK : nomem();
    for (int r0 = r->me; r0 < r->nranks && !s; r0 += G * r->procs) {
        shard_h5_writer *hw[GROUP_MAX] = {NULL};
        size_t np = 0;
        s = group_pieces(r, r0, G, hw, pieces, srcs, &np);
        if (!s) s = shard_h5_write_pieces(pieces, np, pg->add ? chunk_done : NULL, (void *)pg);
        for (int k = 0; k < G; k++) {
            if (!hw[k]) continue;
            if (s) shard_h5_abort(hw[k]);
            else s = close_in_background(&cl[k], hw[k]);
        }
    }
    for (int k = 0; k < G; k++) {
        shard_status closed = closer_wait(&cl[k]);
        if (!s) s = closed;
    }
    free(pieces);
    free(srcs);
    return s;
}

/* Process 0: the extra files travel with the checkpoint (a model folder's other files,
 * a checkpoint's extras), as does a training run's state; then the commit. */
static shard_status commit(run *r)
{
    const convert_source *src = r->src;
    shard_status s = SHARD_OK;
    if (src->dir) s = shard_ckpt_add_folder_extras(r->cw, src->dir);
    if (!s && src->c) s = shard_ckpt_carry_extras(r->cw, src->c);
    const char *training = src->c ? shard_ckpt_training_json(src->c) : NULL;
    if (!s) s = shard_ckpt_commit(r->cw, src->config, src->config_len, r->d, &r->l, r->stages, training, 0);
    if (!s) r->cw = NULL; /* a successful commit frees the writer */
    return s;
}

shard_status convert_run(const convert_opts *o, const convert_source *src, int *secondhand)
{
    run r = {.o = o, .src = src, .d = src->d, .procs = 1};
    if (o->world) {
        r.me = shard_comm_rank(o->world);
        r.procs = shard_comm_size(o->world);
    }
    uint64_t total = 0;
    shard_status s = agree(&r, plan(&r));
    if (!s) s = agree_inputs(&r);
    if (!s) s = count_bytes(&r, &total);
    s = begin(&r, s); /* agreed: every process goes on, or none */
    if (!s) {
        const convert_progress *pg = &o->progress;
        if (pg->start) pg->start(pg->ctx, total);
        s = write_shards(&r);
        if (pg->end) pg->end(pg->ctx);
    }
    s = agree(&r, s);
    if (!s && r.me == 0) s = commit(&r);
    shard_ckpt_abort(r.cw); /* NULL after a commit */
    close_cache(r.files);
    free(r.jobs);
    if (secondhand) *secondhand = r.secondhand;
    return s;
}
