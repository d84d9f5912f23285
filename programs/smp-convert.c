/* smp-convert: Hugging Face weights -> SMP checkpoint (hf2smp), and any SMP layout
 * -> any other (reshard). Both are the same loop: for every rank of the target
 * layout and every tensor, the piece that rank writes is copied out of the source
 * (a mapped safetensors tensor, or the planner reading the stored pieces). */
#include "cli.h"
#include "launch.h"
#include "progress.h"
#include "shard.h"
#include "init.h"

#include <mpi.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

static const char HELP[] =
    "usage: smp-convert hf2smp  --in HF_DIR --out CKPT --layout pp=P,tp=T[,cp=C][,dp=D]\n"
    "                           [--stages auto|8,8,7,9] [--dtype keep|bf16|fp32] [--compress zstd[:N]|none]\n"
    "                           [--threads N] [--no-fsync]\n"
    "       smp-convert reshard --in CKPT --out CKPT2 --layout ... [--stages ...] [--dtype ...] [--compress ...]\n"
    "       smp-convert init    --config config.json --out CKPT --layout ... [--seed N] [--dtype ...] [...]\n"
    "\n"
    "hf2smp   shard a Hugging Face model folder (config.json, safetensors weights, tokenizer\n"
    "         and other files) into an SMP checkpoint laid out for pp x tp x cp x dp ranks.\n"
    "reshard  turn a checkpoint of any layout into one of another layout.\n"
    "init     a new model from a config.json, initialized as transformers does (normal\n"
    "         weights with std initializer_range, norms at one), the same in every layout.\n"
    "\n"
    "--threads N  worker threads that convert, shuffle and compress chunks (default: cores, <= 16)\n"
    "--no-fsync   do not fsync (nor start writeback of) the files and folders written: the\n"
    "             output still appears only when whole, but is not yet safe from a power loss\n"
    "             or an OS crash. For scratch disks, outputs made durable by a later `sync`,\n"
    "             and benchmarks that compare with a plain `cp` (which does not fsync).\n"
    "\n"
    "The output appears only when whole (written under a temporary name, then renamed);\n"
    "by default every file and folder is fsynced before the rename, and the parent after.\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

typedef struct {
    const char *in, *out, *layout, *stages, *dtype, *compress, *threads, *seed_text;
    int no_fsync;
} args;

/* hf2smp: read the rows of a sub-box straight from the safetensors file with
 * pread (the page cache copies once into the chunk buffer: no page faults of a
 * mapping, no second copy); converting dtype where asked. */
typedef struct {
    int fd;
    const shard_st_tensor *st;
    const int64_t *gshape;
    int ndim;
} file_source;

static shard_status read_at(int fd, void *dst, size_t n, uint64_t off)
{
    char *d = dst;
    while (n) {
        ssize_t r = pread(fd, d, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return shard_fail(SHARD_E_IO, "read failed: %s", r < 0 ? strerror(errno) : "file shrank");
        d += r; n -= (size_t)r; off += (uint64_t)r;
    }
    return SHARD_OK;
}

/* The source files of hf2smp, each opened once for the whole conversion. */
typedef struct {
    const char *dir;
    size_t n;
    const char *names[4096];
    int fds[4096];
} file_cache;

static shard_status cached_fd(file_cache *fc, const char *name, int *fd)
{
    for (size_t i = 0; i < fc->n; i++)
        if (!strcmp(fc->names[i], name)) { *fd = fc->fds[i]; return SHARD_OK; }
    if (fc->n == sizeof fc->fds / sizeof fc->fds[0]) return shard_fail(SHARD_E_UNSUPPORTED, "%s: more than 4096 weight files", fc->dir);
    char *p = malloc(strlen(fc->dir) + strlen(name) + 2);
    sprintf(p, "%s/%s", fc->dir, name);
    uint64_t size;
    shard_status s = shard_open_regular(p, 0, fd, &size);
    free(p);
    if (!s) { fc->names[fc->n] = name; fc->fds[fc->n++] = *fd; }
    return s;
}

static void close_cache(file_cache *fc)
{
    for (size_t i = 0; i < fc->n; i++) close(fc->fds[i]);
    fc->n = 0;
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
            s = read_at(fs->fd, out, n * ses, off);
        } else { /* through a small buffer, converting */
            s = SHARD_OK;
            for (size_t done = 0; done < n && !s;) {
                size_t k = (n - done) * ses < sizeof tmp ? n - done : sizeof tmp / ses;
                if (!(s = read_at(fs->fd, tmp, k * ses, off + done * ses))) s = shard_convert(out + done * des, dt, tmp, fs->st->dtype, k);
                done += k;
            }
        }
        if (s) return s;
        r += run;
    }
    return SHARD_OK;
}

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

/* shard_h5_write_pieces reports each chunk written */
static void progress_done(void *arg, uint64_t bytes) { progress_add(arg, bytes); }

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

typedef struct {
    shard_weights *w; /* hf2smp */
    shard_ckpt *c;    /* reshard */
    int init;         /* init: random weights */
    uint64_t seed;
    int64_t pad_token; /* init: the embedding row left at zero, or -1 */
} source;

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static shard_dtype pick_dtype(const char *how, shard_dtype src)
{
    if (!strcmp(how, "bf16")) return SHARD_DT_BF16;
    if (!strcmp(how, "fp32")) return SHARD_DT_F32;
    return src;
}



/* One tensor to write: a model tensor of group params, an optimizer group's copy of
 * one, or (reshard) a tensor of the fp8 group, written whole by rank 0. */
typedef struct {
    const char *group;
    shard_tensor_spec spec; /* name and shape (role unused for fp8) */
    size_t src_index;       /* reshard: the source tensor */
    shard_dtype src_dt;
    const char *src_file;   /* hf2smp: the safetensors file holding the tensor */
} job;

static job *make_jobs(const source *src, const shard_model_desc *d, size_t *n)
{
    const size_t nt = shard_model_tensor_count(d);
    size_t cap = nt + (src->c ? shard_ckpt_tensor_count(src->c) : 0);
    job *j = calloc(cap + 1, sizeof *j);
    if (!j) return NULL;
    *n = 0;
    if (!src->c) {
        for (size_t i = 0; i < nt; i++) {
            j[*n].group = "params";
            shard_model_tensor(d, i, &j[*n].spec);
            j[*n].src_dt = SHARD_DT_F32;
            if (src->w) {
                const shard_st_tensor *st = shard_weights_find(src->w, j[*n].spec.name);
                size_t wi = 0;
                while (shard_weights_at(src->w, wi) != st) wi++;
                j[*n].src_dt = st->dtype;
                j[*n].src_file = shard_weights_file_of(src->w, wi);
            }
            (*n)++;
        }
        return j;
    }
    /* every tensor of the source, in the model's order within each group */
    static const char *groups[] = {"params", "optim/master", "optim/exp_avg", "optim/exp_avg_sq", NULL};
    for (int g = 0; groups[g]; g++)
        for (size_t i = 0; i < nt; i++) {
            shard_tensor_spec sp;
            shard_model_tensor(d, i, &sp);
            long ci = shard_ckpt_find(src->c, groups[g], sp.name);
            if (ci < 0) continue; /* validated at open: params are complete */
            j[*n] = (job){groups[g], sp, (size_t)ci, shard_ckpt_tensor_at(src->c, (size_t)ci)->dtype, NULL};
            (*n)++;
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
    return j;
}

static shard_status piece_for(const shard_model_desc *d, const shard_layout *l, const int *stages, const job *jb, int rank,
                              shard_piece *pc)
{
    if (!strcmp(jb->group, "params")) return shard_partition(d, l, stages, &jb->spec, rank, pc);
    if (!strncmp(jb->group, "optim/", 6)) return shard_partition_optim(d, l, stages, &jb->spec, rank, pc);
    /* fp8 scaling state: small, replicated; rank 0 stores it whole */
    memset(pc, 0, sizeof *pc);
    pc->holds = 1;
    pc->writes = rank == 0;
    pc->box.ndim = jb->spec.ndim;
    for (int k = 0; k < jb->spec.ndim; k++) pc->box.len[k] = jb->spec.shape[k];
    return SHARD_OK;
}

static shard_dtype job_dtype(const args *a, const job *jb)
{
    return strcmp(jb->group, "params") ? jb->src_dt : pick_dtype(a->dtype, jb->src_dt);
}

/* Under mpirun the output ranks are split over the processes (rank r is written by
 * process r mod size); process 0 makes the staging folder and commits. Without
 * mpirun there is no MPI at all (no singleton start-up cost). */
static int g_me = 0, g_procs = 1;
static int g_secondhand = 0; /* this process failed only because another one did */
#define CONFIG_MAX (16u << 20) /* as libshard's config reader */

/* Every process learns whether any failed; returns the first failure's status. */
static shard_status agree(shard_status mine)
{
    if (g_procs == 1) return mine;
    int v = (int)mine, worst = 0;
    MPI_Allreduce(&v, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!mine && worst) {
        g_secondhand = 1;
        return shard_fail((shard_status)worst, "another process failed");
    }
    return mine;
}

static shard_status convert(const args *a, const source *src, const shard_model_desc *d, const char *config, size_t config_len,
                            const char *extra_dir)
{
    shard_layout l;
    shard_compress comp;
    int stages[SHARD_MAX_PP];
    shard_status s;
    if ((s = shard_layout_parse(a->layout, &l)) || (s = shard_layout_check(&l, d)) ||
        (s = shard_stages_parse(a->stages, d, l.pp, stages)) || (s = shard_compress_parse(a->compress, &comp)))
        return s;
    comp.threads = atoi(a->threads);
    comp.no_fsync = a->no_fsync;
    const shard_write_opts wopts = {a->no_fsync};
    struct stat ost;
    if (stat(a->out, &ost) == 0) return shard_fail(SHARD_E_USAGE, "%s: already exists (refusing to replace it)", a->out);
    const int nranks = shard_layout_size(&l);
    /* the jobs: the model's tensors (params), and for reshard every other group the
     * source holds (optimizer state, fp8 scaling state) */
    size_t nj = 0;
    job *jobs = make_jobs(src, d, &nj);
    if (!jobs) return shard_fail(SHARD_E_NOMEM, "out of memory");
    uint64_t total = 0;
    shard_piece pc;
    for (int r = g_me; r < nranks && !s; r += g_procs)
        for (size_t i = 0; i < nj && !s; i++) {
            if ((s = piece_for(d, &l, stages, &jobs[i], r, &pc))) break;
            if (pc.holds && pc.writes) total += shard_box_numel(&pc.box) * shard_dtype_size(job_dtype(a, &jobs[i]));
        }
    shard_ckpt_writer *cw = NULL;
    char staging[4096] = "";
    if (!s && g_me == 0) {
        s = shard_ckpt_begin_opts(a->out, &wopts, &cw);
        if (!s) snprintf(staging, sizeof staging, "%s", shard_ckpt_staging(cw));
    }
    if ((s = agree(s))) { free(jobs); shard_ckpt_abort(cw); return s; }
    if (g_procs > 1) MPI_Bcast(staging, sizeof staging, MPI_CHAR, 0, MPI_COMM_WORLD);
    progress pg;
    progress_start(&pg, "writing", total);
    static file_cache cache; /* 64 KiB: not on the stack */
    file_cache *files = &cache;
    files->dir = a->in;
    files->n = 0;
    /* This process's output ranks, G at a time (G: the worker threads): their pieces go
     * out as one stream (shard_h5_write_pieces), piece i of each of the G files, then
     * piece i+1, ... (each file gets its pieces in the jobs' order, as if written
     * alone); the G files are then closed together, in parallel threads, while the next
     * G are written. A close computes the file's checksum (and fsyncs): that work is
     * spread over the cores, not left to one of them at the end. */
    enum { GROUP_MAX = 16 };
    const int G = comp.threads < GROUP_MAX ? comp.threads : GROUP_MAX;
    closer cl[GROUP_MAX];
    memset(cl, 0, sizeof cl);
    typedef union { file_source f; ckpt_source c; init_tensor i; } piece_source;
    shard_h5_piece *pieces = calloc(nj * (size_t)G + 1, sizeof *pieces);
    piece_source *srcs = calloc(nj * (size_t)G + 1, sizeof *srcs);
    if (!pieces || !srcs) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    for (int r0 = g_me; r0 < nranks && !s; r0 += G * g_procs) {
        shard_h5_writer *hw[GROUP_MAX] = {NULL};
        size_t np = 0;
        for (size_t i = 0; i < nj && !s; i++)
            for (int k = 0; k < G && !s && r0 + k * g_procs < nranks; k++) {
                const int r = r0 + k * g_procs;
                const job *jb = &jobs[i];
                if ((s = piece_for(d, &l, stages, jb, r, &pc))) break;
                if (!pc.holds || !pc.writes || shard_box_numel(&pc.box) == 0) continue;
                if (!hw[k]) {
                    char *p = malloc(strlen(staging) + 80);
                    sprintf(p, "%s/shard-%05d.h5", staging, r);
                    s = shard_h5_create(p, comp, &hw[k]);
                    free(p);
                    if (s) break;
                }
                const shard_tensor_spec *t = &jb->spec;
                shard_h5_piece *x = &pieces[np];
                piece_source *ps = &srcs[np++];
                *x = (shard_h5_piece){hw[k], jb->group, t->name, job_dtype(a, jb), t->ndim, t->shape, pc.box, NULL, ps};
                if (src->init) {
                    ps->i = (init_tensor){t, src->seed, name_hash(t->name), d->initializer_range,
                                          t->role == SHARD_T_NORM_ATTN || t->role == SHARD_T_NORM_MLP || t->role == SHARD_T_NORM_FINAL,
                                          t->role == SHARD_T_EMBED ? src->pad_token : -1};
                    x->fill = init_fill;
                } else if (src->w) {
                    ps->f = (file_source){-1, shard_weights_find(src->w, t->name), t->shape, t->ndim};
                    s = cached_fd(files, jb->src_file, &ps->f.fd);
                    x->fill = fill_from_file;
                } else {
                    /* the planner assembles this piece chunk by chunk from the stored ones */
                    ps->c = (ckpt_source){src->c, jb->src_index};
                    x->fill = fill_from_ckpt;
                }
            }
        if (!s) s = shard_h5_write_pieces(pieces, np, progress_done, &pg);
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
    close_cache(files);
    free(jobs);
    progress_end(&pg);
    s = agree(s);
    if (g_me != 0) return s; /* process 0 copies the extra files and commits */
    /* the model folder's other files travel with the checkpoint */
    if (!s && extra_dir) {
        DIR *dir = opendir(extra_dir);
        struct dirent *e;
        while (!s && dir && (e = readdir(dir))) {
            const char *n = e->d_name;
            size_t len = strlen(n);
            if (n[0] == '.' || !strcmp(n, "config.json") || !strcmp(n, "model.safetensors.index.json") ||
                (len > 12 && !strcmp(n + len - 12, ".safetensors")))
                continue;
            char *p = malloc(strlen(extra_dir) + len + 2);
            sprintf(p, "%s/%s", extra_dir, n);
            struct stat st;
            if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) s = shard_ckpt_add_extra(cw, p, n);
            free(p);
        }
        if (dir) closedir(dir);
    }
    if (!s && src->c) {
        for (size_t i = 0; i < shard_ckpt_extra_count(src->c) && !s; i++) s = shard_ckpt_carry_extra(cw, src->c, i);
    }
    const char *training = src->c ? shard_ckpt_training_json(src->c) : NULL; /* a training run moves with its state */
    if (!s && (s = shard_ckpt_commit(cw, config, config_len, d, &l, stages, training, 0)) == SHARD_OK) cw = NULL;
    shard_ckpt_abort(cw); /* NULL after a successful commit */
    return s;
}

static int parse_args(int argc, char **argv, args *a)
{
    static char ncpu[16];
    snprintf(ncpu, sizeof ncpu, "%d", cli_default_threads());
    *a = (args){NULL, NULL, NULL, "auto", "keep", "zstd", ncpu, NULL, 0};
    for (int i = 2; i < argc; i++) {
        const char **slot = NULL;
        if (!strcmp(argv[i], "--in")) slot = &a->in;
        else if (!strcmp(argv[i], "--out")) slot = &a->out;
        else if (!strcmp(argv[i], "--layout")) slot = &a->layout;
        else if (!strcmp(argv[i], "--stages")) slot = &a->stages;
        else if (!strcmp(argv[i], "--dtype")) slot = &a->dtype;
        else if (!strcmp(argv[i], "--compress")) slot = &a->compress;
        else if (!strcmp(argv[i], "--threads")) slot = &a->threads;
        else if (!strcmp(argv[i], "--seed") && !strcmp(argv[1], "init")) slot = &a->seed_text;
        else if (!strcmp(argv[i], "--config") && !strcmp(argv[1], "init")) slot = &a->in;
        else if (!strcmp(argv[i], "--no-fsync")) { a->no_fsync = 1; continue; }
        else return cli_usage("unknown option %s", argv[i]);
        if (i + 1 >= argc) return cli_usage("%s needs a value", argv[i]);
        *slot = argv[++i];
    }
    if (!a->in || !a->out || !a->layout)
        return cli_usage(!strcmp(argv[1], "init") ? "--config, --out and --layout are required" : "--in, --out and --layout are required");
    if (strcmp(a->dtype, "keep") && strcmp(a->dtype, "bf16") && strcmp(a->dtype, "fp32")) return cli_usage("--dtype must be keep, bf16 or fp32");
    if (!cli_parse_threads(a->threads)) return cli_usage("--threads must be an integer in 1..64");
    return 0;
}

static int run_command(int argc, char **argv, args *ap);

int main(int argc, char **argv)
{
    cli_init("smp-convert");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    if (argc < 2) return cli_usage("missing subcommand (hf2smp, reshard or init)");
    args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    if (launched_by_mpirun()) {
        MPI_Init(&argc, &argv);
        MPI_Comm_rank(MPI_COMM_WORLD, &g_me);
        MPI_Comm_size(MPI_COMM_WORLD, &g_procs);
    }
    if (g_procs > 1) cli_defer(); /* one error line for the run, below */
    rc = run_command(argc, argv, &a);
    if (g_procs > 1) {
        /* the lowest process that failed first-hand prints its line; everyone ends with its code */
        int mine = rc && !g_secondhand ? g_me : g_procs, first = g_procs;
        MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        cli_deferred(first == g_me);
        if (first < g_procs) MPI_Bcast(&rc, 1, MPI_INT, first, MPI_COMM_WORLD);
        else MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD); /* the commit happened on process 0 */
    }
    if (g_procs > 1 || launched_by_mpirun()) MPI_Finalize();
    return rc;
}

static int run_command(int argc, char **argv, args *ap)
{
    args a = *ap;
    (void)argc;
    int rc = 0;
    shard_status s;
    double t0 = now_seconds();
    if (!strcmp(argv[1], "init")) {
        if (!a.seed_text) a.seed_text = "0";
        char *end;
        unsigned long long seed = strtoull(a.seed_text, &end, 10);
        if (*end || !a.seed_text[0]) return cli_usage("--seed must be a non-negative integer");
        shard_model_desc d;
        char *text;
        size_t len;
        /* read once: what is parsed is exactly what the checkpoint stores */
        if ((s = shard_read_file(a.in, CONFIG_MAX, &text, &len))) return cli_fail(s);
        if ((s = shard_config_parse(text, len, a.in, &d))) { free(text); return cli_fail(s); }
        source src = {.init = 1, .seed = seed, .pad_token = d.pad_token_id}; /* transformers zeroes that row */
        if (!strcmp(a.dtype, "keep")) a.dtype = d.torch_dtype == SHARD_DT_BF16 ? "bf16" : "fp32";
        s = convert(&a, &src, &d, text, len, NULL);
        free(text);
    } else if (!strcmp(argv[1], "hf2smp")) {
        char cfg[4096];
        snprintf(cfg, sizeof cfg, "%s/config.json", a.in);
        shard_model_desc d;
        source src = {0};
        char *text;
        size_t len;
        if ((s = shard_read_file(cfg, CONFIG_MAX, &text, &len))) return cli_fail(s);
        if ((s = shard_config_parse(text, len, cfg, &d)) || (s = shard_weights_open(a.in, &src.w)) ||
            (s = shard_model_check_weights(&d, src.w, a.in))) {
            free(text);
            shard_weights_close(src.w);
            return cli_fail(s);
        }
        s = convert(&a, &src, &d, text, len, a.in);
        free(text);
        shard_weights_close(src.w);
    } else if (!strcmp(argv[1], "reshard")) {
        source src = {0};
        if ((s = shard_ckpt_open(a.in, &src.c))) return cli_fail(s);
        const char *cfg = shard_ckpt_config_json(src.c);
        s = convert(&a, &src, shard_ckpt_model(src.c), cfg, strlen(cfg), NULL);
        shard_ckpt_close(src.c);
    } else {
        return cli_usage("unknown subcommand \"%s\" (hf2smp, reshard or init)", argv[1]);
    }
    if (s) return cli_fail(s);
    if (g_me == 0) fprintf(stderr, "%s: %s written in %.2fs%s\n", cli_name(), a.out, now_seconds() - t0, g_procs > 1 ? " (several processes)" : "");
    return rc;
}
