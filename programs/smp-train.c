/* smp-train: train a Llama/Mistral model from an SMP checkpoint, on one rank or many
 * (mpirun), on the C backend or the CUDA one (dev.h). See HELP below and DESIGN.md's
 * command section for the contract. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "launch.h"
#include "progress.h"
#include "ckptio.h"
#include "data.h"
#include "eval.h"
#include "fp8.h"
#include "model.h"
#include "optim.h"
#include "par.h"
#include "shard.h"
#include "state.h"

static const char HELP[] =
    "usage: smp-train --ckpt CKPT|RUN_DIR --data TOKENS --save-dir RUN_DIR [options]\n"
    "\n"
    "Train a Llama/Mistral model from an SMP checkpoint, on CPUs (C backend) or GPUs.\n"
    "A run folder's `latest` names its newest checkpoint; a checkpoint with a training\n"
    "state resumes that run bit for bit (its settings are the defaults; flags given\n"
    "here override them).\n"
    "\n"
    "  --ckpt CKPT|RUN_DIR       checkpoint, or run folder (its `latest`)\n"
    "  --data TOKENS             llm.c token files: comma-separated paths or globs\n"
    "  --val-data TOKENS         validation tokens: val_loss in the log\n"
    "  --val-every N             validate every N steps (default: when saving)\n"
    "  --val-batches N           validation batches of B/M sequences (default 8)\n"
    "  --save-dir RUN_DIR        where step-NNNNNN/ checkpoints and `latest` go\n"
    "  --layout L                pp=P,tp=T,cp=C,dp=D (P*T*C*D ranks under mpirun; default\n"
    "                            dp=<ranks>); cp: each sequence in 2C chunks, ring attention\n"
    "  --stages S                layers per pipeline stage: \"auto\" or \"2,1,...\" (default: the\n"
    "                            checkpoint's when it has pp stages, else auto)\n"
    "  --sequence-parallel       with tp > 1: norms, residual stream and embedding output split\n"
    "                            over the tp ranks by token (reduce-scatter / all-gather\n"
    "                            instead of all-reduce); B/dp/M x S/cp must divide by tp\n"
    "  --steps N                 optimizer steps of the run (required for a new run)\n"
    "  --batch B                 sequences per step (default 8)\n"
    "  --microbatches M          gradient accumulation: B/M sequences at a time (default 1);\n"
    "                            with pp > 1 the microbatches of the 1F1B schedule\n"
    "  --seq S                   tokens per sequence (default 256, at most max_position_embeddings)\n"
    "  --lr X                    peak learning rate (default 3e-4)\n"
    "  --warmup N                linear warmup steps (default 0)\n"
    "  --lr-min X                final learning rate of the cosine (default lr/10)\n"
    "  --schedule cosine|constant\n"
    "  --seed N                  shuffle the sequences by N (default: sequential order)\n"
    "  --clip X                  global gradient-norm clipping (default 1.0; 0: off)\n"
    "  --weight-decay X          AdamW decoupled weight decay of matrices (default 0.1)\n"
    "  --beta1 X --beta2 X --eps X   AdamW (defaults 0.9, 0.95, 1e-8)\n"
    "  --max-bad K               stop after K non-finite steps in a row (default 5)\n"
    "  --fp8 off|delayed|current FP8 recipe of the blocks' linear layers (default off)\n"
    "  --fp8-history N           delayed scaling: amax history length (default 1024)\n"
    "  --fp8-margin M            scale = fp8_max / amax / 2^M (default 0)\n"
    "  --backend cpu|cuda        where the model runs (default cpu): cuda = one GPU per rank\n"
    "                            (the local rank's), collectives over NCCL; loads\n"
    "                            libshard's libsmp_cuda.so (SMP_CUDA_LIB overrides the path)\n"
    "  --dtype fp32|bf16         compute dtype (default: fp32 on cpu, bf16 on cuda): bf16\n"
    "                            keeps parameters and activations in bf16 and the fp32\n"
    "                            master weights in the (ZeRO-1 sharded) optimizer state\n"
    "  --recompute none|attention|full  activation recomputation (default none): attention\n"
    "                            recomputes each layer's attention half in backward, full\n"
    "                            the whole layer from its input (memory printed at start)\n"
    "  --save-every N            checkpoint every N steps (and always at the end)\n"
    "  --keep K                  keep the newest K checkpoints (default 0: all)\n"
    "  --compress none|zstd|zstd:N  shard file compression (default zstd, level 3)\n"
    "  --log FILE.jsonl          one JSON object per step (appended)\n"
    "  --stop-at STEP            save and stop once STEP steps are done (the schedule\n"
    "                            still spans --steps)\n"
    "  --dump-grads DIR          compute the next step's gradients, write them to\n"
    "                            DIR/grads.safetensors (fp32, unclipped) and exit\n"
    "  --inject-nan STEPS        testing aid: make the loss of these steps (1-based,\n"
    "                            comma-separated) NaN\n"
    "  --inject-fail RANK:STEP   testing aid: rank RANK fails with an error in the middle of\n"
    "                            step STEP (1-based; after its backward pass)\n"
    "\n"
    "SIGTERM or SIGINT: finish the current step, save a checkpoint, exit 0.\n"
    "The log's loss is the mean over the step's B*S target tokens.\n";

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* ---------------------------------------------------------------- options */
enum {
    O_CKPT, O_DATA, O_VAL_DATA, O_VAL_EVERY, O_VAL_BATCHES, O_SAVE_DIR, O_LAYOUT, O_STEPS, O_BATCH, O_MICRO, O_SEQ,
    O_LR, O_WARMUP, O_LR_MIN, O_SCHEDULE, O_SEED, O_CLIP, O_WD, O_BETA1, O_BETA2, O_EPS, O_MAX_BAD, O_FP8,
    O_FP8_HIST, O_FP8_MARGIN, O_BACKEND, O_SAVE_EVERY, O_KEEP, O_COMPRESS, O_LOG, O_STOP_AT, O_DUMP_GRADS,
    O_INJECT_NAN, O_INJECT_FAIL, O_STAGES, O_DTYPE, O_RECOMPUTE, O_COUNT
};
static const char *OPT_NAMES[O_COUNT] = {
    "--ckpt", "--data", "--val-data", "--val-every", "--val-batches", "--save-dir", "--layout", "--steps", "--batch",
    "--microbatches", "--seq", "--lr", "--warmup", "--lr-min", "--schedule", "--seed", "--clip", "--weight-decay",
    "--beta1", "--beta2", "--eps", "--max-bad", "--fp8", "--fp8-history", "--fp8-margin", "--backend",
    "--save-every", "--keep", "--compress", "--log", "--stop-at", "--dump-grads", "--inject-nan",
    "--inject-fail", "--stages", "--dtype", "--recompute"};

typedef struct {
    const char *v[O_COUNT];
} options;

/* integer option in [lo, hi]; returns 0 or an exit code */
static int opt_int(const options *o, int k, int64_t lo, int64_t hi, int64_t *out)
{
    if (!o->v[k]) return 0;
    char *end;
    errno = 0;
    long long x = strtoll(o->v[k], &end, 10);
    if (errno || end == o->v[k] || *end || x < lo || x > hi)
        return cli_usage("%s must be an integer in %lld..%lld, got \"%s\"", OPT_NAMES[k], (long long)lo, (long long)hi,
                         o->v[k]);
    *out = x;
    return 0;
}

static int opt_float(const options *o, int k, double lo, double hi, float *out)
{
    if (!o->v[k]) return 0;
    char *end;
    double x = strtod(o->v[k], &end);
    if (end == o->v[k] || *end || !(x >= lo && x <= hi))
        return cli_usage("%s must be a number in [%g, %g], got \"%s\"", OPT_NAMES[k], lo, hi, o->v[k]);
    *out = (float)x;
    return 0;
}

/* ----------------------------------------------------------------- the run */

static char *state_json(const run_cfg *c, const data_set *ds, const fp8_state *f8, double elapsed)
{
    json_t *files = json_array();
    for (int i = 0; i < ds->nfiles; i++) json_array_append_new(files, json_string(ds->files[i].path));
    json_t *t = json_object();
    json_object_set_new(t, "step", json_integer(c->step));
    json_object_set_new(t, "tokens", json_integer((json_int_t)c->tokens));
    json_object_set_new(t, "data_position", json_integer(c->position));
    json_object_set_new(t, "optimizer_step", json_integer(c->opt_step));
    json_object_set_new(t, "batch", json_integer(c->batch));
    json_object_set_new(t, "microbatches", json_integer(c->micro));
    json_object_set_new(t, "seq", json_integer(c->seq));
    json_object_set_new(t, "schedule", json_pack("{s:s,s:f,s:f,s:I,s:I}", "kind", c->cosine ? "cosine" : "constant",
                                                 "lr", (double)c->lr, "lr_min", (double)c->lr_min, "warmup",
                                                 (json_int_t)c->warmup, "steps", (json_int_t)c->steps));
    json_object_set_new(t, "optimizer", json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:s}", "name", "adamw", "beta1",
                                                  (double)c->beta1, "beta2", (double)c->beta2, "eps", (double)c->eps,
                                                  "weight_decay", (double)c->wd, "clip", (double)c->clip,
                                                  "weight_decay_applies_to", "matrices"));
    json_object_set_new(t, "data", json_pack("{s:o,s:I,s:o,s:s}", "files", files, "sequences", (json_int_t)ds->nseq,
                                             "seed", c->shuffle ? json_integer((json_int_t)c->seed) : json_null(),
                                             "order", c->shuffle ? "shuffled" : "sequential"));
    /* the only randomness of a run is the data order: epoch e's permutation comes
     * from a generator seeded by (seed, e), so (seed, position) is the whole state */
    json_object_set_new(t, "rng", json_pack("{s:s,s:o,s:I}", "generator", "xoshiro256** seeded by splitmix64(seed, epoch)",
                                            "seed", c->shuffle ? json_integer((json_int_t)c->seed) : json_null(),
                                            "epoch", (json_int_t)(ds->nseq ? (uint64_t)c->position / ds->nseq : 0)));
    json_object_set_new(t, "fp8", json_pack("{s:s,s:I,s:f,s:s}", "mode", fp8_mode_name(c->fp8), "history",
                                            (json_int_t)c->fp8_hist, "margin", (double)c->fp8_margin, "tensors",
                                            f8 ? "fp8/fp8.amax_history, fp8/fp8.scale" : "none"));
    json_object_set_new(t, "max_bad_steps", json_integer(c->max_bad));
    json_object_set_new(t, "elapsed_s", json_real(elapsed));
    char *text = json_dumps(t, JSON_COMPACT | JSON_REAL_PRECISION(17));
    json_decref(t);
    return text;
}

static void log_num(FILE *f, const char *key, double v, const char *fmt)
{
    fprintf(f, ",\"%s\":", key);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

static void fmt_eta(char *buf, size_t cap, double s)
{
    if (!(s >= 0) || s > 1e7) snprintf(buf, cap, "--");
    else if (s >= 3600) snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
    else snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
}

static int parse_steps_list(const char *text, int64_t **out, int *n)
{
    *out = NULL;
    *n = 0;
    if (!text) return 0;
    const char *p = text;
    while (*p) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1) return cli_usage("--inject-nan takes step numbers (>= 1) separated by commas");
        int64_t *q = realloc(*out, (size_t)(*n + 1) * sizeof *q);
        if (!q) return cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory"));
        *out = q;
        (*out)[(*n)++] = v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return cli_usage("--inject-nan takes step numbers (>= 1) separated by commas");
    }
    return 0;
}

static shard_status load_fp8(shard_ckpt *c, fp8_state *f)
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

static shard_status dump_grads(const char *dir, const model *m, double loss)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return shard_fail(SHARD_E_IO, "%s: cannot create: %s", dir, strerror(errno));
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

static int train_main(int argc, char **argv, par_ctx *P);

/* the sequences of microbatch mb of a step: this replica's, from `first` on */
typedef struct {
    data_set *ds;
    uint64_t first;
    int rows;
    const model *m; /* context parallelism: this rank's tokens of each sequence */
} step_data;

static shard_status fill_step(void *ctx, int mb, int32_t *in, int32_t *tg)
{
    step_data *sd = ctx;
    shard_status s = data_fill(sd->ds, sd->first + (uint64_t)mb * (uint64_t)sd->rows, sd->rows, in, tg);
    if (!s) par_cp_select(sd->m, sd->rows, in, tg);
    return s;
}

int main(int argc, char **argv)
{
    cli_init("smp-train");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    return launch_ranks(argc, argv, train_main);
}

static int train_main(int argc, char **argv, par_ctx *P)
{
    options o = {{0}};
    int seqpar = 0; /* --sequence-parallel: a flag, no value */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sequence-parallel")) {
            seqpar = 1;
            continue;
        }
        int k = 0;
        while (k < O_COUNT && strcmp(argv[i], OPT_NAMES[k])) k++;
        if (k == O_COUNT) return cli_usage("unknown option %s", argv[i]);
        if (i + 1 >= argc) return cli_usage("%s needs a value", argv[i]);
        o.v[k] = argv[++i];
    }
    if (!o.v[O_CKPT] || !o.v[O_DATA]) return cli_usage("--ckpt and --data are required");
    if (!o.v[O_SAVE_DIR] && !o.v[O_DUMP_GRADS]) return cli_usage("--save-dir is required");
    shard_layout lay = {1, 1, 1, P->size};
    if (o.v[O_LAYOUT]) {
        shard_status s = shard_layout_parse(o.v[O_LAYOUT], &lay);
        if (s) return cli_usage("--layout: %s", shard_errmsg());
    }
    if (shard_layout_size(&lay) != P->size) {
        char lb[64];
        return cli_usage("--layout %s is a parallel layout of %d ranks, but %d processes run (start them with "
                         "mpirun -np %d)",
                         shard_layout_format(&lay, lb, sizeof lb), shard_layout_size(&lay), P->size,
                         shard_layout_size(&lay));
    }
    if (P->size > 1 && o.v[O_DUMP_GRADS]) return cli_usage("--dump-grads runs on one rank");
    const int me0 = P->rank == 0;
    const char *backend = o.v[O_BACKEND] ? o.v[O_BACKEND] : "cpu";
    if (strcmp(backend, "cpu") && strcmp(backend, "cuda"))
        return cli_usage("--backend must be cpu or cuda, got \"%s\"", backend);
    const int on_cuda = !strcmp(backend, "cuda");
    shard_dtype cdt = on_cuda ? SHARD_DT_BF16 : SHARD_DT_F32;
    if (o.v[O_DTYPE]) {
        if (!strcmp(o.v[O_DTYPE], "fp32")) cdt = SHARD_DT_F32;
        else if (!strcmp(o.v[O_DTYPE], "bf16")) cdt = SHARD_DT_BF16;
        else return cli_usage("--dtype must be fp32 or bf16, got \"%s\"", o.v[O_DTYPE]);
        if (cdt == SHARD_DT_BF16 && !on_cuda)
            return cli_usage("--dtype bf16 needs --backend cuda (the C backend computes in fp32)");
    }
    recompute_mode rcm = RECOMPUTE_NONE;
    if (o.v[O_RECOMPUTE]) {
        if (!strcmp(o.v[O_RECOMPUTE], "none")) rcm = RECOMPUTE_NONE;
        else if (!strcmp(o.v[O_RECOMPUTE], "attention")) rcm = RECOMPUTE_ATTENTION;
        else if (!strcmp(o.v[O_RECOMPUTE], "full")) rcm = RECOMPUTE_FULL;
        else return cli_usage("--recompute must be none, attention or full, got \"%s\"", o.v[O_RECOMPUTE]);
    }
    if (o.v[O_SCHEDULE] && strcmp(o.v[O_SCHEDULE], "cosine") && strcmp(o.v[O_SCHEDULE], "constant"))
        return cli_usage("--schedule must be cosine or constant");
    if (o.v[O_FP8] && strcmp(o.v[O_FP8], "off") && strcmp(o.v[O_FP8], "delayed") && strcmp(o.v[O_FP8], "current"))
        return cli_usage("--fp8 must be off, delayed or current");
    shard_compress comp;
    if (shard_compress_parse(o.v[O_COMPRESS] ? o.v[O_COMPRESS] : "zstd", &comp))
        return cli_usage("--compress: %s", shard_errmsg());
    /* everything the run holds, released at done: */
    int64_t *inject = NULL;
    int ninject = 0, rc, exit_code = 0;
    model m;
    memset(&m, 0, sizeof m);
    dev D;
    memset(&D, 0, sizeof D);
    shard_ckpt *ck = NULL;
    shard_dtype *pdt = NULL;
    optim opt;
    memset(&opt, 0, sizeof opt);
    data_set ds, vs;
    memset(&ds, 0, sizeof ds);
    memset(&vs, 0, sizeof vs);
    int32_t *in = NULL, *tg = NULL;
    FILE *logf = NULL;
#define OUT(code) do { exit_code = (code); goto done; } while (0)
    if ((rc = parse_steps_list(o.v[O_INJECT_NAN], &inject, &ninject))) OUT(rc);
    long long fail_rank = -1, fail_step = -1;
    if (o.v[O_INJECT_FAIL] && (sscanf(o.v[O_INJECT_FAIL], "%lld:%lld", &fail_rank, &fail_step) != 2 || fail_rank < 0 ||
                               fail_step < 1))
        OUT(cli_usage("--inject-fail takes RANK:STEP (STEP >= 1)"));

    /* the model and, when the checkpoint has one, the run it continues */
    shard_status s = dev_open(&D, backend, cdt, on_cuda ? shard_comm_local_rank() : 0);
    if (s) OUT(cli_fail(s));
    if ((s = ckptio_open_model(o.v[O_CKPT], &ck, &m, &D))) OUT(cli_fail(s));
    m.recompute = rcm;
    if ((s = shard_layout_check(&lay, &m.d))) OUT(cli_usage("--layout: %s", shard_errmsg()));
    run_cfg c = {.batch = 8, .micro = 1, .seq = 256, .lr = 3e-4f, .cosine = 1, .clip = 1.0f, .wd = 0.1f, .beta1 = 0.9f,
                 .beta2 = 0.95f, .eps = 1e-8f, .max_bad = 5, .fp8 = FP8_OFF, .fp8_hist = 1024, .val_batches = 8};
    if (m.d.max_positions > 0 && c.seq > m.d.max_positions) c.seq = m.d.max_positions;
    const char *tr = shard_ckpt_training_json(ck);
    int resumed = 0;
    if (tr) {
        if ((s = state_parse(shard_ckpt_dir(ck), tr, strlen(tr), &c))) OUT(cli_fail(s));
        resumed = 1;
    }
    /* flags override */
    int64_t v64;
#define RANGE(r) STATE_RANGE[r].lo, STATE_RANGE[r].hi /* the flags and the training state: the same ranges */
    if ((rc = opt_int(&o, O_STEPS, RANGE(R_STEPS), &c.steps)) || (rc = opt_int(&o, O_BATCH, RANGE(R_BATCH), &c.batch)) ||
        (rc = opt_int(&o, O_MICRO, RANGE(R_MICRO), &c.micro)) || (rc = opt_int(&o, O_SEQ, RANGE(R_SEQ), &c.seq)) ||
        (rc = opt_int(&o, O_WARMUP, RANGE(R_WARMUP), &c.warmup)) || (rc = opt_int(&o, O_MAX_BAD, RANGE(R_MAX_BAD), &c.max_bad)) ||
        (rc = opt_int(&o, O_FP8_HIST, RANGE(R_FP8_HIST), &c.fp8_hist)) ||
        (rc = opt_int(&o, O_SAVE_EVERY, RANGE(R_SAVE_EVERY), &c.save_every)) || (rc = opt_int(&o, O_KEEP, RANGE(R_KEEP), &c.keep)) ||
        (rc = opt_int(&o, O_VAL_EVERY, RANGE(R_VAL_EVERY), &c.val_every)) ||
        (rc = opt_int(&o, O_VAL_BATCHES, RANGE(R_VAL_BATCHES), &c.val_batches)) ||
        (rc = opt_int(&o, O_STOP_AT, RANGE(R_STOP_AT), &c.stop_at)) || (rc = opt_float(&o, O_LR, RANGE(R_LR), &c.lr)) ||
        (rc = opt_float(&o, O_CLIP, RANGE(R_CLIP), &c.clip)) || (rc = opt_float(&o, O_WD, RANGE(R_WD), &c.wd)) ||
        (rc = opt_float(&o, O_BETA1, RANGE(R_BETA1), &c.beta1)) || (rc = opt_float(&o, O_BETA2, RANGE(R_BETA2), &c.beta2)) ||
        (rc = opt_float(&o, O_EPS, RANGE(R_EPS), &c.eps)) || (rc = opt_float(&o, O_FP8_MARGIN, RANGE(R_FP8_MARGIN), &c.fp8_margin)))
        OUT(rc);
    if (o.v[O_LR_MIN]) {
        if ((rc = opt_float(&o, O_LR_MIN, RANGE(R_LR_MIN), &c.lr_min))) OUT(rc);
        c.lr_min_set = 1;
    } else if (!c.lr_min_set || o.v[O_LR]) {
        c.lr_min = c.lr / 10.0f;
    }
    if (o.v[O_SCHEDULE]) c.cosine = !strcmp(o.v[O_SCHEDULE], "cosine");
    if (o.v[O_SEED]) {
        if ((rc = opt_int(&o, O_SEED, 0, INT64_MAX, &v64))) OUT(rc); /* any seed */
        c.shuffle = 1;
        c.seed = (uint64_t)v64;
    }
    if (o.v[O_FP8]) c.fp8 = !strcmp(o.v[O_FP8], "delayed") ? FP8_DELAYED : !strcmp(o.v[O_FP8], "current") ? FP8_CURRENT : FP8_OFF;
    if (c.steps < 1) OUT(cli_usage("--steps is required for a new run"));
    if (c.fp8 == FP8_CURRENT && lay.tp > 1)
        OUT(cli_usage("--fp8 current with tp > 1: current scaling takes each tensor's amax where it is used, and "
                      "a tensor-parallel rank sees only its piece (use --fp8 delayed, whose amaxes are reduced over "
                      "all ranks)"));
    if (c.batch % ((int64_t)lay.dp * c.micro))
        OUT(cli_usage("--batch %lld is not divisible by dp %d x --microbatches %lld", (long long)c.batch, lay.dp,
                      (long long)c.micro));
    if (lay.cp > 1 && c.seq % (2 * lay.cp))
        OUT(cli_usage("--seq %lld is not divisible by 2 x cp = %d: context parallelism cuts each sequence into 2 x cp "
                      "chunks of equal length", (long long)c.seq, 2 * lay.cp));
    if ((int64_t)c.batch / c.micro * c.seq > INT32_MAX / 4) OUT(cli_usage("--batch / --microbatches * --seq is too large"));
    if (m.d.max_positions > 0 && c.seq > m.d.max_positions)
        fprintf(stderr, "smp-train: warning: --seq %lld exceeds max_position_embeddings %lld\n", (long long)c.seq,
                (long long)m.d.max_positions);
    if (resumed && c.step >= c.steps && !o.v[O_DUMP_GRADS]) {
        if (me0) printf("%s is at step %lld of %lld: nothing to do\n", shard_ckpt_dir(ck), (long long)c.step, (long long)c.steps);
        OUT(0);
    }
    const int Bm = (int)(c.batch / lay.dp / c.micro), S = (int)c.seq;
    if (seqpar && lay.tp > 1 && ((int64_t)Bm * (S / lay.cp)) % lay.tp)
        OUT(cli_usage("--sequence-parallel: a microbatch holds %lld tokens per rank (--batch / dp / --microbatches = %d "
                      "sequences of --seq / cp = %d tokens), not divisible by tp = %d: sequence parallelism splits "
                      "them over the tp ranks", (long long)Bm * (S / lay.cp), Bm, S / lay.cp, lay.tp));

    /* every input checked before the weights load: the token files, and the extra
     * files a save will carry (a bad one fails now, not at the first save) */
    if ((s = data_open(&ds, o.v[O_DATA], S, m.d.vocab))) OUT(cli_fail(s));
    data_set_order(&ds, c.shuffle, c.seed);
    if (o.v[O_VAL_DATA] && (s = data_open(&vs, o.v[O_VAL_DATA], S, m.d.vocab))) OUT(cli_fail(s));
    for (size_t i = 0; me0 && i < shard_ckpt_extra_count(ck); i++) /* rank 0 carries them */
        if ((s = shard_ckpt_check_extra(ck, i))) OUT(cli_fail(s));

    /* weights: the fp32 master copy when saved, else the parameters */
    int have_master = 0, have_p = 0, have_m = 0, have_v = 0;
    int stages[SHARD_MAX_PP];
    if (o.v[O_STAGES]) {
        if ((s = shard_stages_parse(o.v[O_STAGES], &m.d, lay.pp, stages))) OUT(cli_usage("--stages: %s", shard_errmsg()));
    } else if (shard_ckpt_layout(ck)->pp == lay.pp) {
        memcpy(stages, shard_ckpt_stages(ck), (size_t)lay.pp * sizeof *stages);
    } else if ((s = shard_stages_auto(&m.d, lay.pp, stages))) {
        OUT(cli_fail(s));
    }
    if ((s = par_setup(P, &lay, stages, (int)c.micro, &m))) OUT(cli_fail(s));
    const double t_load = now_seconds();
    shard_ckpt_set_threads(ck, ckptio_load_threads(P->size));
    if ((s = par_read_params(P, ck, &m, "optim/master", &have_master))) OUT(cli_fail(s));
    if (!have_master && (s = par_read_params(P, ck, &m, "params", &have_p))) OUT(cli_fail(s));
    if (!have_master && !have_p) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: holds no parameters", shard_ckpt_dir(ck))));
    /* the fp32 master of a saved run must be finite; a model's own NaN parameters are
     * the run's business (its steps are skipped, and it stops: --max-bad) */
    if (have_master && (s = state_check_weights(shard_ckpt_dir(ck), "optim/master", model_params_host(&m), m.nparams)))
        OUT(cli_fail(s));
    model_params_upload(&m);
    pdt = calloc(m.ntensors, sizeof *pdt);
    if (!pdt) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));
    ckptio_param_dtypes(ck, &m, pdt);
    optim_hparams h = {c.lr, c.lr_min, c.warmup, c.steps, c.cosine, c.beta1, c.beta2, c.eps, c.wd, c.clip};
    if ((s = optim_create(&opt, &h, P->zsum, &D)) || (s = optim_host(&opt))) OUT(cli_fail(s));
    if ((s = par_read_optim(P, ck, &m, "optim/exp_avg", opt.hm, &have_m)) ||
        (s = par_read_optim(P, ck, &m, "optim/exp_avg_sq", opt.hv, &have_v)) ||
        (s = state_check_moments(shard_ckpt_dir(ck), have_m ? opt.hm : NULL, have_v ? opt.hv : NULL, P->zsum)))
        OUT(cli_fail(s));
    if (opt.hmaster) par_pack_blocks(P, &m, model_params_host(&m), opt.hmaster); /* bf16: the fp32 master */
    optim_upload(&opt);
    if ((s = dev_status(&D))) OUT(cli_fail(s));
    if (resumed && c.opt_step > 0 && !(have_master && have_m && have_v))
        OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: the training state is at optimizer step %lld but the optimizer "
                                                 "state (optim/master, exp_avg, exp_avg_sq) is missing",
                                shard_ckpt_dir(ck), (long long)c.opt_step)));
    opt.t = have_m && have_v ? c.opt_step : 0;
    if (c.fp8 != FP8_OFF) {
        m.fp8 = fp8_create(c.fp8, m.L * 7, (int)c.fp8_hist, c.fp8_margin);
        if (!m.fp8) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));
        if ((s = load_fp8(ck, m.fp8))) OUT(cli_fail(s));
    }
    if ((s = ckptio_print_load(cli_name(), P->world, ck, now_seconds() - t_load))) OUT(cli_fail(s)); /* all of it read and checked */
    m.sp = seqpar;
    if (on_cuda && c.fp8 != FP8_OFF) { /* Hopper's FP8 GEMMs take dimensions that are multiples of 16 */
        const long long dims[5] = {(long long)Bm * (S / lay.cp), m.H, m.F, (long long)m.nh * m.hd, (long long)m.nkv * m.hd};
        for (int k = 0; k < 5; k++)
            if (dims[k] % 16)
                OUT(cli_usage("--fp8 on cuda: the FP8 GEMMs need every dimension (tokens per microbatch %lld, hidden "
                              "%lld, intermediate %lld, local q %lld and kv %lld widths) to be a multiple of 16",
                              dims[0], dims[1], dims[2], dims[3], dims[4]));
    }
    if ((s = model_alloc_slots(&m, Bm, S / lay.cp, P->nslots))) OUT(cli_fail(s));
    if (m.fp8) D.ops->fp8_scales_changed(&D, m.fp8);
    if ((s = dev_status(&D))) OUT(cli_fail(s));

    if (me0 && !o.v[O_DUMP_GRADS] && (s = ckptio_prepare(o.v[O_SAVE_DIR]))) OUT(cli_fail(s));
    in = malloc((size_t)Bm * S * sizeof *in);
    tg = malloc((size_t)Bm * S * sizeof *tg);
    if (!in || !tg) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));

    if (me0 && o.v[O_LOG] && !(logf = fopen(o.v[O_LOG], "a")))
        OUT(cli_fail(shard_fail(SHARD_E_IO, "%s: cannot open: %s", o.v[O_LOG], strerror(errno))));

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND; /* a second signal ends the process the usual way */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    char cbuf[32];
    if (!o.v[O_DUMP_GRADS] && me0)
        fprintf(stderr, "smp-train: %s: %s parameters, step %lld of %lld, batch %lld x %lld tokens (%lld microbatches), %s order%s\n",
                shard_ckpt_dir(ck), cli_count(cbuf, shard_model_param_count(&m.d)), (long long)c.step, (long long)c.steps, (long long)c.batch,
                (long long)c.seq, (long long)c.micro, c.shuffle ? "shuffled" : "sequential",
                c.fp8 ? (c.fp8 == FP8_DELAYED ? ", fp8 delayed" : ", fp8 current") : "");
    if (!o.v[O_DUMP_GRADS] && me0) {
        size_t bp, bg, ba, bo = 3 * P->zsum * sizeof(float) - (opt.master ? 0 : P->zsum * sizeof(float));
        model_memory(&m, &bp, &bg, &ba);
        const char *rn[] = {"none", "attention", "full"};
        fprintf(stderr, "smp-train: backend %s (%s), %s compute; memory: %.1f MiB per rank (params %.1f, grads %.1f, "
                        "optimizer %.1f, activations %.1f MiB with --recompute %s)\n",
                backend, D.ops->describe(&D), cdt == SHARD_DT_BF16 ? "bf16" : "fp32",
                (double)(bp + bg + bo + ba) / 1048576.0, (double)bp / 1048576.0, (double)bg / 1048576.0,
                (double)bo / 1048576.0, (double)ba / 1048576.0, rn[rcm]);
    }
    if (!o.v[O_DUMP_GRADS] && me0 && seqpar && lay.tp > 1)
        fprintf(stderr, "smp-train: sequence parallel over tp = %d: %d of a microbatch's %lld tokens per rank\n", lay.tp,
                (int)((int64_t)Bm * (S / lay.cp) / lay.tp), (long long)Bm * (S / lay.cp));

    const size_t cfg_len = strlen(shard_ckpt_config_json(ck));
    const int tty = me0 && isatty(2);
    const double t_start = now_seconds();
    const float loss_scale = (float)(1.0 / ((double)c.batch * (double)c.seq));
    /* replica r takes its contiguous B/D of the step's sequences */
    const uint64_t replica_first = (uint64_t)P->g.me.dp * (uint64_t)(c.batch / lay.dp);

    int64_t bad_run = 0, saved_step = resumed ? c.step : -1;
    double ema_dt = 0.0;

    /* --dump-grads computes one step's gradients wherever the run stands */
    while ((c.step < c.steps && !(c.stop_at && c.step >= c.stop_at)) || o.v[O_DUMP_GRADS]) {
        const double t0 = now_seconds();
        model_zero_grads(&m);
        shard_comm *kinds[7] = {P->dg.tp, P->dg.cp, P->dg.pp, P->dg.dp, P->dg.dpcp, P->kvc, P->emb};
        for (int k = 0; k < 7; k++)
            if (kinds[k]) shard_comm_reset_bytes(kinds[k]);
        double lsum = 0.0;
        step_data sd = {&ds, (uint64_t)c.position + replica_first, Bm, &m};
        if ((s = par_train_step(P, &m, (int)c.micro, fill_step, &sd, in, tg, loss_scale, &lsum))) OUT(cli_fail(s));
        if (P->rank == fail_rank && c.step + 1 == fail_step)
            OUT(cli_fail(shard_fail(SHARD_E_IO, "rank %d: injected failure (--inject-fail) in step %lld", P->rank,
                                    (long long)c.step + 1)));
        /* the sum over the replicas' sequences and (cp) over each sequence's parts */
        if (P->ndp > 1 && (s = par_allreduce_f64(P, P->g.dpcp, &lsum, 1, SHARD_OP_SUM))) OUT(cli_fail(s));
        /* the loss, computed on the last stage, to every stage (rank 0 logs it) */
        if (lay.pp > 1 && (s = shard_comm_broadcast(P->g.pp, &lsum, 1, SHARD_DT_F64, lay.pp - 1))) OUT(cli_fail(s));
        double loss = lsum / ((double)c.batch * (double)c.seq);
        for (int k = 0; k < ninject; k++)
            if (inject[k] == c.step + 1) loss = NAN;
        double sumsq;
        if ((s = par_reduce_grads(P, &m, &sumsq))) OUT(cli_fail(s));
        const double norm = sqrt(sumsq);
        if (o.v[O_DUMP_GRADS]) {
            if ((s = dump_grads(o.v[O_DUMP_GRADS], &m, loss))) OUT(cli_fail(s));
            printf("step %lld: loss %.9g, gradients in %s/grads.safetensors\n", (long long)c.step + 1, loss, o.v[O_DUMP_GRADS]);
            OUT(0);
        }
        const float lr = optim_lr(&opt.h, c.step);
        const int bad = !isfinite(loss) || !isfinite(norm);
        /* delayed scaling: every rank's amaxes of the step (the activations and
         * gradients of its sequences) reduced to the max over all, as one rank sees */
        if (m.fp8) D.ops->fp8_collect(&D, m.fp8); /* the device's amaxes of the step, into step_amax */
        if (m.fp8 && P->size > 1 &&
            (s = shard_comm_allreduce(P->world, m.fp8->step_amax, (size_t)m.fp8->nlin * FP8_ROLES, SHARD_DT_F32,
                                      SHARD_OP_MAX)))
            OUT(cli_fail(s));
        c.step++;
        c.position += c.batch;
        c.tokens += (uint64_t)c.batch * (uint64_t)c.seq;
        if (bad) {
            bad_run++;
            if (m.fp8) {
                fp8_step_end(m.fp8, 1);
                D.ops->fp8_scales_changed(&D, m.fp8);
            }
            if (me0) fprintf(stderr, "%ssmp-train: warning: step %lld: loss %g, gradient norm %g: not finite; step skipped (%lld in a row)\n",
                    tty ? "\r\033[K" : "", (long long)c.step, loss, norm, (long long)bad_run);
        } else {
            bad_run = 0;
            if ((s = par_update(P, &m, &opt, norm, lr))) OUT(cli_fail(s));
            c.opt_step = opt.t;
            if (m.fp8) {
                fp8_step_end(m.fp8, 0);
                D.ops->fp8_scales_changed(&D, m.fp8);
            }
        }
        const double t1 = now_seconds(), dt = t1 - t0;
        const double tps = (double)c.batch * c.seq / (dt > 0 ? dt : 1e-9);
        double val = NAN;
        /* periodic saves wait for a good step; skipped steps leave the weights as
         * they were, so the end of the run (or a signal) saves in any case */
        if (P->size > 1) stop_requested = par_any(P, stop_requested);
        int do_save = (!bad_run && c.save_every && c.step % c.save_every == 0) || stop_requested ||
                      c.step == c.steps || (c.stop_at && c.step >= c.stop_at);
        if (vs.nfiles && !bad_run &&
            ((c.val_every && c.step % c.val_every == 0) || (!c.val_every && do_save) || c.step == c.steps)) {
            uint64_t nt;
            int64_t nb = c.val_batches;
            if ((uint64_t)nb * Bm > vs.nseq) nb = (int64_t)(vs.nseq / (uint64_t)Bm);
            if (m.fp8) m.fp8->frozen = 1; /* validation leaves the FP8 history alone */
            if (nb > 0 && lay.pp == 1 && lay.cp == 1) {
                double vsum;
                if ((s = eval_loss_sum(&m, &vs, Bm, nb, in, tg, &vsum, &nt))) OUT(cli_fail(s));
                val = vsum / (double)nt;
            }
            if (m.comm_err) OUT(cli_fail(m.comm_err));
            if ((s = dev_status(&D))) OUT(cli_fail(s));
            if (nb > 0 && (lay.pp > 1 || lay.cp > 1)) {
                /* through the pipeline (the sum from the last stage), each cp rank on its tokens */
                double vsum = 0.0, one;
                for (int64_t i = 0; i < nb; i++) {
                    if ((s = data_fill_sequential(&vs, (uint64_t)i * (uint64_t)Bm, Bm, in, tg))) OUT(cli_fail(s));
                    par_cp_select(&m, Bm, in, tg);
                    if ((s = par_forward(P, &m, in, tg, &one))) OUT(cli_fail(s));
                    vsum += one;
                }
                if (lay.cp > 1 && (s = par_allreduce_f64(P, P->g.cp, &vsum, 1, SHARD_OP_SUM))) OUT(cli_fail(s));
                if (lay.pp > 1 && (s = shard_comm_broadcast(P->g.pp, &vsum, 1, SHARD_DT_F64, lay.pp - 1))) OUT(cli_fail(s));
                val = vsum / ((double)nb * (double)Bm * (double)S);
            }
            if (m.fp8) m.fp8->frozen = 0;
        }
        if (logf) {
            fprintf(logf, "{\"step\":%lld", (long long)c.step);
            log_num(logf, "loss", loss, "%.17g");
            log_num(logf, "lr", lr, "%.9g");
            log_num(logf, "grad_norm", norm, "%.17g");
            log_num(logf, "tokens_per_s", tps, "%.1f");
            log_num(logf, "elapsed_s", t1 - t_start, "%.3f");
            fprintf(logf, ",\"tokens\":%llu,\"skipped\":%s", (unsigned long long)c.tokens, bad ? "true" : "false");
            /* bytes this rank sent in the step, by kind (tp: the tensor-parallel all-reduces
             * (with --sequence-parallel the reduce-scatters and all-gathers, and the norm
             * weight gradients' all-reduce) and the kv-head groups' gradient sums; dp: the ZeRO-1 collectives over the
             * dp*cp group and the loss all-reduce over it; cp: the ring attention's K/V
             * passes (with dK/dV in backward), and with validation its loss all-reduce) */
            if (P->size > 1) {
                uint64_t b[7];
                for (int k = 0; k < 7; k++) b[k] = kinds[k] ? shard_comm_bytes(kinds[k]) : 0;
                fprintf(logf, ",\"bytes_tp\":%llu,\"bytes_cp\":%llu,\"bytes_pp\":%llu,\"bytes_dp\":%llu",
                        (unsigned long long)(b[0] + b[5]), (unsigned long long)b[1], (unsigned long long)(b[2] + b[6]),
                        (unsigned long long)(b[3] + b[4]));
            }
            if (!isnan(val)) log_num(logf, "val_loss", val, "%.17g");
            fputs("}\n", logf);
            fflush(logf);
        }
        if (tty) {
            ema_dt = ema_dt > 0 ? 0.9 * ema_dt + 0.1 * dt : dt;
            char eta[32];
            fmt_eta(eta, sizeof eta, ema_dt * (double)(c.steps - c.step));
            fprintf(stderr, "\r\033[Kstep %lld/%lld  loss %.4f  lr %.3g  %.0f tok/s  ETA %s", (long long)c.step,
                    (long long)c.steps, loss, lr, tps, eta);
            if (!isnan(val)) fprintf(stderr, "  val %.4f", val);
        }
        if (bad_run >= c.max_bad) {
            if (tty) fputc('\n', stderr);
            char last[64] = "none in this run";
            if (saved_step >= 0) snprintf(last, sizeof last, "step %lld", (long long)saved_step);
            if (me0) fprintf(stderr, "smp-train: error: %lld steps in a row had a non-finite loss or gradient (the last at step %lld); "
                            "stopping without saving (last checkpoint: %s)\n",
                    (long long)bad_run, (long long)c.step, last);
            exit_code = 1;
            break;
        }
        if (do_save) {
            char *tj = state_json(&c, &ds, m.fp8, c.elapsed_before + (now_seconds() - t_start));
            if (!tj) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));
            ckptio_save_args sa_ = {o.v[O_SAVE_DIR], c.step, shard_ckpt_config_json(ck), cfg_len, ck, pdt, comp, tj};
            model_params_download(&m); /* the host copies that the checkpoint writes (CUDA) */
            optim_download(&opt);
            if ((s = dev_status(&D))) OUT(cli_fail(s));
            s = P->size > 1 ? ckptio_save_par(&sa_, &m, &opt, P) : ckptio_save(&sa_, &m, &opt);
            free(tj);
            if (s) {
                if (tty) fputc('\n', stderr);
                OUT(cli_fail(s));
            }
            saved_step = c.step;
            if (me0) ckptio_prune(o.v[O_SAVE_DIR], (int)c.keep);
        }
        if (stop_requested) {
            if (tty) fputc('\n', stderr);
            if (me0) fprintf(stderr, "smp-train: stopped by a signal after step %lld; saved %s/step-%06lld\n", (long long)c.step,
                    o.v[O_SAVE_DIR], (long long)c.step);
            break;
        }
    }
    if (tty && exit_code == 0 && !stop_requested) fputc('\n', stderr);
    if (exit_code == 0 && !stop_requested && me0)
        fprintf(stderr, "smp-train: step %lld of %lld, %s tokens seen; checkpoint %s/step-%06lld\n", (long long)c.step,
                (long long)c.steps, cli_count(cbuf, c.tokens), o.v[O_SAVE_DIR], (long long)saved_step);
done:
    if (logf) fclose(logf);
    free(in);
    free(tg);
    free(pdt);
    free(inject);
    data_close(&ds);
    data_close(&vs);
    optim_free(&opt);
    model_free(&m);
    par_release(P);
    dev_close(&D);
    shard_ckpt_close(ck);
    return exit_code;
}
