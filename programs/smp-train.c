/* smp-train: train a model of a supported family from an SMP checkpoint, on one rank or many
 * (mpirun), on the C backend or the CUDA one (dev.h). See HELP below and DESIGN.md's
 * command section for the contract. The command line is read here; the run itself
 * is train/'s: runcfg.h (its configuration), loop.h (the run and its steps),
 * steplog.h (what each step reports), ckptio.h (the checkpoints). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "c/blas_pick.h"
#include "cli.h"
#include "launch.h"
#include "loop.h"
#include "opts.h"
#include "progress.h"
#include "runcfg.h"
#include "shard.h"
#include "state.h"

static const char HELP[] =
    "usage: smp-train --ckpt CKPT|RUN_DIR --data TOKENS --save-dir RUN_DIR [options]\n"
    "\n"
    "Train a model of a supported family (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX, Mixtral,\n"
    "Qwen3-MoE) from an SMP checkpoint, on CPUs (C backend) or GPUs.\n"
    "A run folder's `latest` names its newest checkpoint; a checkpoint with a training\n"
    "state resumes that run bit for bit (its settings are the defaults; flags given\n"
    "here override them).\n"
    "\n"
    "  --ckpt CKPT|RUN_DIR       checkpoint, or run folder (its `latest`)\n"
    "  --data TOKENS             llm.c token files: comma-separated paths or globs\n"
    "  --val-data TOKENS         validation tokens: val_loss in the log\n"
    "  --val-every N             validate every N steps (default: when saving)\n"
    "  --val-batches N           validation batches of B/M sequences (default 8)\n"
    "  --save-dir RUN_DIR        where step-NNNNNN/ checkpoints and `latest` go (one run at a\n"
    "                            time: a second one saving there is refused)\n"
    "  --layout L                pp=P,tp=T,cp=C,dp=D (P*T*C*D ranks under mpirun; default\n"
    "                            dp=<ranks>); cp: each sequence in 2C chunks, ring attention\n"
    "  --stages S                layers per pipeline stage: \"auto\" or \"2,1,...\" (default: the\n"
    "                            checkpoint's when it has pp stages, else auto)\n"
    "  --read-together auto|yes|no  the ranks load the checkpoint together: each chunk read\n"
    "                            by one rank, an all-to-all hands every rank its part (auto,\n"
    "                            the default: yes when the ranks span several hosts)\n"
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
    "  --lanes N|auto            C backend: each microbatch's sequences split over N lanes,\n"
    "                            a thread each, with their own activations and gradients\n"
    "                            (summed in order: the bits depend on N, not on the threads);\n"
    "                            auto (a new run's default): the threads where they divide\n"
    "                            the sequences, the layout is pp=tp=cp=1 and the extra\n"
    "                            gradient copies fit an eighth of the memory; resumed runs\n"
    "                            keep their count\n"
    "  --logits-chunk N|auto     tokens whose logits (a row of the vocabulary each) are\n"
    "                            computed and turned into their gradient at a time (auto,\n"
    "                            a new run's default: all of a microbatch's while they fit\n"
    "                            256 MiB, 1 GiB on cuda, else chunks of 128-token multiples\n"
    "                            that do); resumed runs keep theirs\n"
    "  --save-every N            checkpoint every N steps (and always at the end)\n"
    "  --keep K                  keep the newest K checkpoints (default 0: all)\n"
    "  --compress none|zstd|zstd:N  shard file compression (default zstd: level 1 tuned for numbers)\n"
    "  --log FILE.jsonl          one JSON object per step (appended)\n"
    "  --stop-at STEP            save and stop once STEP steps are done (the schedule\n"
    "                            still spans --steps)\n"
    "  --dump-grads DIR          compute the next step's gradients, write them to\n"
    "                            DIR/grads.safetensors (fp32, unclipped) and exit\n"
    "  --documents               the tokens are documents each ended by a separator token:\n"
    "                            attention stays inside a document (every layout), RoPE\n"
    "                            positions restart at each, a document's first token is not\n"
    "                            a target (docs/TRAINING.md \"Fine-tuning\")\n"
    "  --doc-sep ID              the separator (default: the config's eos_token_id)\n"
    "  --loss-mask FILES         one loss mask file per --data file, in the same order\n"
    "                            (magic 20241201; a byte per token, 0: not a target;\n"
    "                            tools/prepare_sft.py writes them)\n"
    "  --val-loss-mask FILES     the same for --val-data\n"
    "  --inject-nan STEPS        testing aid: make the loss of these steps (1-based,\n"
    "                            comma-separated) NaN\n"
    "  --inject-fail RANK:STEP   testing aid: rank RANK fails with an error in the middle of\n"
    "                            step STEP (1-based; after its backward pass)\n"
    "  --inject-signal RANK:STEP testing aid: rank RANK sends itself SIGTERM once step STEP\n"
    "                            is logged (after the ranks agreed whether to stop there)\n"
    "\n"
    "SIGTERM, SIGINT or SIGHUP: finish the current step, save a checkpoint, exit 0.\n"
    "The log's loss is the mean over the step's counted targets (all B*S without\n"
    "--documents and --loss-mask; `targets` in the log); a step with none makes no\n"
    "update and logs \"loss\": null.\n";

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    stop_requested = 1;
}

/* ---------------------------------------------------------------- options */
enum {
    O_CKPT, O_DATA, O_VAL_DATA, O_VAL_EVERY, O_VAL_BATCHES, O_SAVE_DIR, O_LAYOUT, O_STEPS, O_BATCH, O_MICRO, O_SEQ,
    O_LR, O_WARMUP, O_LR_MIN, O_SCHEDULE, O_SEED, O_CLIP, O_WD, O_BETA1, O_BETA2, O_EPS, O_MAX_BAD, O_FP8,
    O_FP8_HIST, O_FP8_MARGIN, O_BACKEND, O_SAVE_EVERY, O_KEEP, O_COMPRESS, O_LOG, O_STOP_AT, O_DUMP_GRADS,
    O_INJECT_NAN, O_INJECT_FAIL, O_INJECT_SIGNAL, O_STAGES, O_DTYPE, O_RECOMPUTE, O_SEQPAR, O_DOCS, O_DOC_SEP, O_MASK, O_VAL_MASK,
    O_TOGETHER, O_LANES, O_LOGITS_CHUNK, O_COUNT
};
static const cli_opt OPTS[O_COUNT] = {
    [O_CKPT] = {"--ckpt", 0}, [O_DATA] = {"--data", 0}, [O_VAL_DATA] = {"--val-data", 0},
    [O_VAL_EVERY] = {"--val-every", 0}, [O_VAL_BATCHES] = {"--val-batches", 0}, [O_SAVE_DIR] = {"--save-dir", 0},
    [O_LAYOUT] = {"--layout", 0}, [O_STEPS] = {"--steps", 0}, [O_BATCH] = {"--batch", 0},
    [O_MICRO] = {"--microbatches", 0}, [O_SEQ] = {"--seq", 0}, [O_LR] = {"--lr", 0}, [O_WARMUP] = {"--warmup", 0},
    [O_LR_MIN] = {"--lr-min", 0}, [O_SCHEDULE] = {"--schedule", 0}, [O_SEED] = {"--seed", 0},
    [O_CLIP] = {"--clip", 0}, [O_WD] = {"--weight-decay", 0}, [O_BETA1] = {"--beta1", 0},
    [O_BETA2] = {"--beta2", 0}, [O_EPS] = {"--eps", 0}, [O_MAX_BAD] = {"--max-bad", 0}, [O_FP8] = {"--fp8", 0},
    [O_FP8_HIST] = {"--fp8-history", 0}, [O_FP8_MARGIN] = {"--fp8-margin", 0}, [O_BACKEND] = {"--backend", 0},
    [O_SAVE_EVERY] = {"--save-every", 0}, [O_KEEP] = {"--keep", 0}, [O_COMPRESS] = {"--compress", 0},
    [O_LOG] = {"--log", 0}, [O_STOP_AT] = {"--stop-at", 0}, [O_DUMP_GRADS] = {"--dump-grads", 0},
    [O_INJECT_NAN] = {"--inject-nan", 0}, [O_INJECT_FAIL] = {"--inject-fail", 0},
    [O_INJECT_SIGNAL] = {"--inject-signal", 0}, [O_STAGES] = {"--stages", 0},
    [O_DTYPE] = {"--dtype", 0}, [O_RECOMPUTE] = {"--recompute", 0}, [O_SEQPAR] = {"--sequence-parallel", 1},
    [O_DOCS] = {"--documents", 1}, [O_DOC_SEP] = {"--doc-sep", 0}, [O_MASK] = {"--loss-mask", 0},
    [O_VAL_MASK] = {"--val-loss-mask", 0}, [O_TOGETHER] = {"--read-together", 0}, [O_LANES] = {"--lanes", 0},
    [O_LOGITS_CHUNK] = {"--logits-chunk", 0},
};
/* the words of the choices, in the order of the values they stand for */
static const char *const BACKENDS[] = {"cpu", "cuda", NULL};
static const char *const DTYPES[] = {"fp32", "bf16", NULL};
static const char *const RECOMPUTE[] = {"none", "attention", "full", NULL}; /* recompute_mode */
static const char *const SCHEDULES[] = {"constant", "cosine", NULL};         /* run_cfg.cosine */
static const char *const FP8_MODES[] = {"off", "delayed", "current", NULL};  /* fp8_mode */

/* The command line: the options' values (NULL: not given) and what they say */
typedef struct {
    const char *v[O_COUNT];
    loop_args a;
    int schedule, fp8; /* index in SCHEDULES / FP8_MODES, -1: not given */
    int64_t *inject;   /* --inject-nan's steps (a.inject_nan) */
} train_cmd;

static int word(const char *text, const char *const *words)
{
    for (int k = 0; text && words[k]; k++)
        if (!strcmp(text, words[k])) return k;
    return -1;
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

/* a testing aid's RANK:STEP (absent: left as it is) */
static int rank_step(const char *opt, const char *text, long long *rank, long long *step)
{
    if (text && (sscanf(text, "%lld:%lld", rank, step) != 2 || *rank < 0 || *step < 1))
        return cli_usage("%s takes RANK:STEP (STEP >= 1)", opt);
    return 0;
}

static int check_output(const char *opt, const char *path, shard_out_kind kind)
{
    shard_status s = path ? shard_check_output(path, kind) : SHARD_OK;
    return !s ? 0 : s == SHARD_E_USAGE ? cli_usage("%s %s", opt, shard_errmsg()) : cli_fail(s);
}

static progress_watch load_watch; /* rank 0's "loading" line on a terminal */

/* What the options say beyond run_cfg's numbers, checked before anything is opened. */
static int read_args(train_cmd *t, par_ctx *P)
{
    const char **v = t->v;
    loop_args *a = &t->a;
    int backend = 0, dtype = -1, rcm = RECOMPUTE_NONE, rc;
    if (!v[O_CKPT] || !v[O_DATA]) return cli_usage("--ckpt and --data are required");
    if (!v[O_SAVE_DIR] && !v[O_DUMP_GRADS]) return cli_usage("--save-dir is required");
    /* the outputs, before anything is loaded */
    if ((rc = check_output("--save-dir", v[O_SAVE_DIR], SHARD_OUT_DIR)) || (rc = check_output("--log", v[O_LOG], SHARD_OUT_FILE)) ||
        (rc = check_output("--dump-grads", v[O_DUMP_GRADS], SHARD_OUT_DIR)))
        return rc;
    struct stat st;
    *a = (loop_args){.ckpt = v[O_CKPT], .data = v[O_DATA], .val_data = v[O_VAL_DATA], .save_dir = v[O_SAVE_DIR],
                     .log = v[O_LOG], .stages = v[O_STAGES], .dump_grads = v[O_DUMP_GRADS], .seqpar = !!v[O_SEQPAR],
                     .loss_mask = v[O_MASK], .val_loss_mask = v[O_VAL_MASK], .documents = !!v[O_DOCS],
                     .layout = {1, 1, 1, P->size}, .fail_rank = -1, .fail_step = -1,
                     .signal_rank = -1, .signal_step = -1, .stop = &stop_requested,
                     .now = now_seconds, .log_fd = -1, .watch_start = progress_watch_begin,
                     .watch_end = progress_watch_erase, .watch_ctx = &load_watch};
    if (P->rank == 0 && a->log && stat(a->log, &st) == 0 && S_ISFIFO(st.st_mode)) {
        /* a FIFO: opened before the load and kept, so that one nobody reads is refused at once
         * (a probe that closed it again would end a monitor such as `cat`) */
        if ((a->log_fd = open(a->log, O_WRONLY | O_APPEND | O_CLOEXEC | O_NONBLOCK)) < 0) {
            if (errno == ENXIO) return cli_usage("--log %s: a FIFO that nobody reads", a->log);
            return cli_fail(shard_fail(SHARD_E_IO, "%s: cannot open: %s", a->log, strerror(errno)));
        }
    }
    if (v[O_LAYOUT] && shard_layout_parse(v[O_LAYOUT], &a->layout)) return cli_usage("--layout: %s", shard_errmsg());
    if (shard_layout_size(&a->layout) != P->size) {
        char lb[64];
        return cli_usage("--layout %s is a parallel layout of %d ranks, but %d processes run (start them with "
                         "mpirun -np %d)",
                         shard_layout_format(&a->layout, lb, sizeof lb), shard_layout_size(&a->layout), P->size,
                         shard_layout_size(&a->layout));
    }
    if (P->size > 1 && v[O_DUMP_GRADS]) return cli_usage("--dump-grads runs on one rank");
    if ((rc = launch_read_together(v[O_TOGETHER], P))) return rc;
    if (v[O_DOC_SEP] && !v[O_DOCS]) return cli_usage("--doc-sep is given without --documents");
    if (v[O_VAL_MASK] && !v[O_VAL_DATA]) return cli_usage("--val-loss-mask is given without --val-data");
    if ((rc = cli_choice("--backend", v[O_BACKEND], BACKENDS, &backend)) ||
        (rc = cli_choice("--dtype", v[O_DTYPE], DTYPES, &dtype)))
        return rc;
    a->backend = BACKENDS[backend];
    a->dtype = dtype == 1 || (dtype < 0 && backend == 1) ? SHARD_DT_BF16 : SHARD_DT_F32; /* bf16 on cuda */
    if (dtype == 1 && backend == 0) return cli_usage("--dtype bf16 needs --backend cuda (the C backend computes in fp32)");
    if ((rc = cli_choice("--recompute", v[O_RECOMPUTE], RECOMPUTE, &rcm))) return rc;
    a->recompute = (recompute_mode)rcm;
    if (v[O_SCHEDULE] && (t->schedule = word(v[O_SCHEDULE], SCHEDULES)) < 0)
        return cli_usage("--schedule must be cosine or constant");
    if (v[O_FP8] && (t->fp8 = word(v[O_FP8], FP8_MODES)) < 0) return cli_usage("--fp8 must be off, delayed or current");
    if (shard_compress_parse(v[O_COMPRESS] ? v[O_COMPRESS] : "zstd", &a->compress))
        return cli_usage("--compress: %s", shard_errmsg());
    if ((rc = parse_steps_list(v[O_INJECT_NAN], &t->inject, &a->ninject))) return rc;
    a->inject_nan = t->inject;
    if ((rc = rank_step("--inject-fail", v[O_INJECT_FAIL], &a->fail_rank, &a->fail_step)) ||
        (rc = rank_step("--inject-signal", v[O_INJECT_SIGNAL], &a->signal_rank, &a->signal_step)))
        return rc;
    return 0;
}

/* The flags over the defaults and the checkpoint's training state: the same ranges. */
static int apply_flags(const train_cmd *t, run_cfg *c)
{
    const char *const *v = t->v;
    int rc;
#define INT(o, r, out) (rc = cli_int(OPTS[o].name, v[o], (int64_t)STATE_RANGE[r].lo, (int64_t)STATE_RANGE[r].hi, out))
#define NUM(o, r, out) (rc = cli_float(OPTS[o].name, v[o], STATE_RANGE[r].lo, STATE_RANGE[r].hi, out))
    if (INT(O_STEPS, R_STEPS, &c->steps) || INT(O_BATCH, R_BATCH, &c->batch) || INT(O_MICRO, R_MICRO, &c->micro) ||
        INT(O_SEQ, R_SEQ, &c->seq) || INT(O_WARMUP, R_WARMUP, &c->warmup) || INT(O_MAX_BAD, R_MAX_BAD, &c->max_bad) ||
        INT(O_FP8_HIST, R_FP8_HIST, &c->fp8_hist) || INT(O_SAVE_EVERY, R_SAVE_EVERY, &c->save_every) ||
        INT(O_KEEP, R_KEEP, &c->keep) || INT(O_VAL_EVERY, R_VAL_EVERY, &c->val_every) ||
        INT(O_VAL_BATCHES, R_VAL_BATCHES, &c->val_batches) || INT(O_STOP_AT, R_STOP_AT, &c->stop_at) ||
        NUM(O_LR, R_LR, &c->lr) || NUM(O_CLIP, R_CLIP, &c->clip) || NUM(O_WD, R_WD, &c->wd) ||
        NUM(O_BETA1, R_BETA1, &c->beta1) || NUM(O_BETA2, R_BETA2, &c->beta2) || NUM(O_EPS, R_EPS, &c->eps) ||
        NUM(O_FP8_MARGIN, R_FP8_MARGIN, &c->fp8_margin))
        return rc;
    runcfg_flags f = {.has_lr = !!v[O_LR], .has_lr_min = !!v[O_LR_MIN], .schedule = t->schedule,
                      .has_seed = !!v[O_SEED], .fp8 = t->fp8, .lanes = !v[O_LANES] ? -1 : 0,
                      .logits_chunk = !v[O_LOGITS_CHUNK] ? -1 : 0};
    int64_t seed = 0;
    if (NUM(O_LR_MIN, R_LR_MIN, &f.lr_min) || (rc = cli_int("--seed", v[O_SEED], 0, INT64_MAX, &seed))) return rc;
    if (v[O_LANES] && strcmp(v[O_LANES], "auto") && INT(O_LANES, R_LANES, &f.lanes)) return rc;
    if (v[O_LOGITS_CHUNK] && strcmp(v[O_LOGITS_CHUNK], "auto") && INT(O_LOGITS_CHUNK, R_LOGITS_CHUNK, &f.logits_chunk))
        return rc;
#undef INT
#undef NUM
    f.seed = (uint64_t)seed; /* any seed */
    runcfg_merge(c, &f);
    return 0;
}

/* A resumed run whose flags change its learning-rate schedule (a longer run, another
 * --lr): allowed, as any flag given again, but said once with the rate it goes on at. */
static void note_schedule_change(const run_cfg *was, const run_cfg *now)
{
    char what[256] = "";
    size_t n = 0;
#define CHANGED(cond, ...) \
    if ((cond) && n < sizeof what) n += (size_t)snprintf(what + n, sizeof what - n, __VA_ARGS__)
    CHANGED(was->steps != now->steps, ", --steps %lld (was %lld)", (long long)now->steps, (long long)was->steps);
    CHANGED(was->lr != now->lr, ", --lr %g (was %g)", (double)now->lr, (double)was->lr);
    CHANGED(was->lr_min != now->lr_min, ", --lr-min %g (was %g)", (double)now->lr_min, (double)was->lr_min);
    CHANGED(was->warmup != now->warmup, ", --warmup %lld (was %lld)", (long long)now->warmup, (long long)was->warmup);
    CHANGED(was->cosine != now->cosine, ", --schedule %s (was %s)", now->cosine ? "cosine" : "constant",
            was->cosine ? "cosine" : "constant");
#undef CHANGED
    if (!n) return;
    const optim_hparams a = runcfg_hparams(was), b = runcfg_hparams(now);
    fprintf(stderr, "smp-train: note: the run's learning-rate schedule changes at step %lld%s: its rate there "
                    "%g, was %g\n", (long long)now->step, what, (double)optim_lr(&b, now->step),
            (double)optim_lr(&a, now->step));
}

/* a failure of the run's set-up: the command line's (with the usage hint) or not */
static int set_up_failed(const train_run *r, shard_status s)
{
    return r->usage ? cli_usage("%s", shard_errmsg()) : cli_fail(s);
}

/* The run from the checkpoint, its configuration checked, everything loaded; *done:
 * the checkpoint's run is already over (nothing to do). */
static int set_up(train_run *r, train_cmd *t, par_ctx *P, int *done)
{
    shard_status s = loop_open(r, P, &t->a);
    if (s) return set_up_failed(r, s);
    const run_cfg was = r->c; /* the resumed run's, before the flags */
    int rc = apply_flags(t, &r->c);
    if (rc) return rc;
    int64_t sep = -1;
    if (t->a.documents && ((rc = cli_int("--doc-sep", t->v[O_DOC_SEP], 0, r->m.d.vocab - 1, &sep)) ||
                           (s = runcfg_doc_sep(&r->m.d, sep, &t->a.doc_sep))))
        return rc ? rc : cli_usage("%s", shard_errmsg());
    if ((s = loop_agree(r))) return s == SHARD_E_USAGE ? cli_usage("%s", shard_errmsg()) : cli_fail(s);
    if ((s = runcfg_check(&r->c, &t->a.layout))) return cli_usage("%s", shard_errmsg());
    const run_cfg *c = &r->c;
    const int over = c->step >= c->steps, stopped = c->stop_at && c->step >= c->stop_at;
    if (r->resumed && (over || stopped) && !t->a.dump_grads) { /* before the load */
        if (P->rank == 0 && over)
            printf("%s is at step %lld of %lld: nothing to do\n", shard_ckpt_dir(r->ck), (long long)c->step,
                   (long long)c->steps);
        else if (P->rank == 0)
            printf("%s is at step %lld, --stop-at %lld: nothing to do\n", shard_ckpt_dir(r->ck), (long long)c->step,
                   (long long)c->stop_at);
        *done = 1;
        return 0;
    }
    if ((s = runcfg_check_sp(&r->c, &t->a.layout, t->a.seqpar))) return cli_usage("%s", shard_errmsg());
    if (r->resumed && P->rank == 0) note_schedule_change(&was, &r->c);
    return (s = loop_load(r)) ? set_up_failed(r, s) : 0;
}

/* 1 when a and b name one file (the same inode), or the same path where one is gone */
static int same_file(const char *a, const char *b)
{
    struct stat x, y;
    if (stat(a, &x) == 0 && stat(b, &y) == 0) return x.st_dev == y.st_dev && x.st_ino == y.st_ino;
    return !strcmp(a, b);
}

/* A resumed run given other token files than it trained on goes on at its data position
 * in the new ones: allowed (a new stage of training), but said, once. */
static void note_new_data(const train_run *r)
{
    const json_t *data = json_object_get(json_object_get(shard_ckpt_manifest_json(r->ck), "training"), "data");
    const json_t *was = json_object_get(data, "files"), *fp = json_object_get(data, "fingerprint");
    if (!r->resumed || !json_is_array(was)) return;
    int same = (int)json_array_size(was) == r->ds.nfiles;
    for (int i = 0; same && i < r->ds.nfiles; i++) {
        const char *p = json_string_value(json_array_get(was, (size_t)i));
        same = p && same_file(p, r->ds.files[i].path);
    }
    char now[32];
    /* a state before fingerprints has none; one before 2026-12-07 another kind: not compared */
    const size_t kind = strlen(DATA_FINGERPRINT_KIND ":");
    if (same && json_is_string(fp) && !strncmp(json_string_value(fp), DATA_FINGERPRINT_KIND ":", kind) &&
        strcmp(json_string_value(fp), data_fingerprint_text(&r->ds, now)))
        fprintf(stderr, "smp-train: note: --data holds other bytes than when the run trained on it (the same files, "
                        "changed since); it goes on at data position %lld in them\n", (long long)r->c.position);
    if (same) return;
    const char *first = json_string_value(json_array_get(was, 0));
    fprintf(stderr, "smp-train: note: --data is not what the run trained on (%s%s); it goes on at data position %lld "
                    "in the new files\n", first ? first : "?", json_array_size(was) > 1 ? ", ..." : "",
            (long long)r->c.position);
}

/* Token files a resumed run finds as it checked them (training.data.checked): not read
 * again, said (the start that skips a data set's reading should say why it was quick). */
static void note_seen_data(const train_run *r)
{
    int n = 0;
    for (int i = 0; i < r->ds.nfiles; i++) n += r->ds.files[i].seen;
    for (int i = 0; i < r->vs.nfiles; i++) n += r->vs.files[i].seen;
    char b[32];
    if (n)
        fprintf(stderr, "smp-train: %d of %d token files as the run checked them (inode, size and times unchanged): "
                        "%s not read again\n", n, r->ds.nfiles + r->vs.nfiles,
                cli_bytes(b, (double)(data_seen_bytes(&r->ds) + data_seen_bytes(&r->vs))));
}

/* A validation file that is also a training file: its loss is no validation, said once. */
static void note_val_in_data(const train_run *r)
{
    for (int i = 0; i < r->vs.nfiles; i++)
        for (int j = 0; j < r->ds.nfiles; j++)
            if (same_file(r->vs.files[i].path, r->ds.files[j].path)) {
                fprintf(stderr, "smp-train: note: --val-data %s is also in --data: val_loss is measured on training "
                                "tokens\n", r->vs.files[i].path);
                return;
            }
}

/* "shuffled by seed N" or "sequential" */
static const char *order_name(char *buf, size_t n, int shuffle, uint64_t seed)
{
    if (shuffle) snprintf(buf, n, "shuffled by seed %llu", (unsigned long long)seed);
    else snprintf(buf, n, "sequential");
    return buf;
}

/* A resumed run given another --seq or order than it trained with: where it goes on in
 * the data (loop.c re-expressed the position of another --seq), said once. */
static void note_data_order(const train_run *r)
{
    const run_cfg *c = &r->c;
    if (!r->resumed) return;
    if (c->seq != c->saved.seq)
        fprintf(stderr, "smp-train: note: --seq %lld is not the run's %lld: its data position %lld becomes %lld (%s)\n",
                (long long)c->seq, (long long)c->saved.seq, (long long)r->position_saved, (long long)c->position,
                c->shuffle || c->saved.shuffle ? "the same fraction of its epoch"
                                               : "the same point of the data: no target is trained on twice");
    if (c->shuffle == c->saved.shuffle && (!c->shuffle || c->seed == c->saved.seed)) return;
    char now[48], was[48];
    const uint64_t n = r->ds.nseq, p = (uint64_t)c->position;
    fprintf(stderr, "smp-train: note: the data order is %s, the run's was %s: it changes at data position %lld (epoch "
                    "%llu)%s\n", order_name(now, sizeof now, c->shuffle, c->seed),
            order_name(was, sizeof was, c->saved.shuffle, c->saved.seed), (long long)p, (unsigned long long)(p / n),
            p % n ? ", so the rest of this epoch may repeat sequences already trained on and leave out others" : "");
}

/* A schedule that does not do what its flags suggest (two flags swapped, most often):
 * said once, then run as given (as torch's schedulers would). */
static void note_schedule(const run_cfg *c)
{
    if (c->warmup > c->steps) /* optim_lr of the last step, (steps - 1) + 1 of warmup */
        fprintf(stderr, "smp-train: note: --warmup %lld is longer than the run's %lld steps: the learning rate rises "
                        "all run long and ends at %g, below --lr %g\n", (long long)c->warmup, (long long)c->steps,
                (double)(float)((double)c->lr * (double)c->steps / (double)c->warmup), (double)c->lr);
    if (c->cosine && c->lr_min > c->lr)
        fprintf(stderr, "smp-train: note: --lr-min %g is above --lr %g: after the warmup the cosine schedule rises "
                        "to it\n", (double)c->lr_min, (double)c->lr);
}

/* rank 0's first lines: the run, the backend and the memory, sequence parallelism */
static void print_start(train_run *r)
{
    const run_cfg *c = &r->c;
    const par_ctx *P = r->P;
    const loop_args *a = r->a;
    char cbuf[32];
    fprintf(stderr, "smp-train: %s: %s parameters, step %lld of %lld, batch %lld x %lld tokens (%lld microbatches), %s order%s\n",
            shard_ckpt_dir(r->ck), cli_count(cbuf, shard_model_param_count(&r->m.d)), (long long)c->step,
            (long long)c->steps, (long long)c->batch, (long long)c->seq, (long long)c->micro,
            c->shuffle ? "shuffled" : "sequential", c->fp8 ? (c->fp8 == FP8_DELAYED ? ", fp8 delayed" : ", fp8 current") : "");
    size_t bp, bg, ba, lg, la, bo = 3 * P->zsum * sizeof(float) - (r->opt.master ? 0 : P->zsum * sizeof(float));
    model_memory(&r->m, &bp, &bg, &ba);
    lanes_memory(&r->ln, &lg, &la);
    bg += lg;
    ba += la;
    if (r->ln.n > 1)
        fprintf(stderr, "smp-train: %d lanes of %d sequence%s each (--lanes), a thread each\n", r->ln.n, r->ln.rows,
                r->ln.rows == 1 ? "" : "s");
    fprintf(stderr, "smp-train: backend %s (%s), %s compute; memory: %.1f MiB per rank (params %.1f, grads %.1f, "
                    "optimizer %.1f, activations %.1f MiB with --recompute %s)\n",
            a->backend, r->D.ops->describe(&r->D), a->dtype == SHARD_DT_BF16 ? "bf16" : "fp32",
            (double)(bp + bg + bo + ba) / 1048576.0, (double)bp / 1048576.0, (double)bg / 1048576.0,
            (double)bo / 1048576.0, (double)ba / 1048576.0, RECOMPUTE[a->recompute]);
    if (a->documents || a->loss_mask) {
        char docs[64] = "";
        if (a->documents) snprintf(docs, sizeof docs, "documents ended by token %d%s", (int)a->doc_sep, a->loss_mask ? ", " : "");
        fprintf(stderr, "smp-train: fine-tuning: %s%s; the loss is the mean over the counted targets\n", docs,
                a->loss_mask ? "loss masks" : "");
    }
    if (a->seqpar && a->layout.tp > 1)
        fprintf(stderr, "smp-train: sequence parallel over tp = %d: %d of a microbatch's %lld tokens per rank\n",
                a->layout.tp, (int)((int64_t)r->Bm * (r->S / a->layout.cp) / a->layout.tp),
                (long long)r->Bm * (r->S / a->layout.cp));
}

/* The steps (or --dump-grads), then rank 0's last line. */
static int train(train_run *r)
{
    const int me0 = r->P->rank == 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND; /* a second signal ends the process the usual way */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL); /* a closed terminal: saved, not lost since the last save */
    /* a --log FIFO whose reader went away: EPIPE, a warning, the run goes on (steplog.c) */
    signal(SIGPIPE, SIG_IGN);
    shard_status s;
    if (me0) {
        note_new_data(r); /* where it goes on in the data: the gradients dumped are that step's */
        note_data_order(r);
        note_val_in_data(r);
        note_seen_data(r);
        note_schedule(&r->c);
        runcfg_warn_positions("smp-train", r->c.seq, &r->m.d);
    }
    if (r->a->dump_grads) return (s = loop_dump_grads(r)) ? cli_fail(s) : 0;
    if (me0) print_start(r);
    loop_end end;
    if ((s = loop_run(r, &end))) return cli_fail(s);
    if (end == LOOP_BAD) return 1;
    if (end == LOOP_STOPPED || stop_requested) return 0;
    steplog_end_line(&r->log);
    char cbuf[32];
    if (me0)
        fprintf(stderr, "smp-train: step %lld of %lld, %s tokens seen; checkpoint %s/step-%06lld\n",
                (long long)r->c.step, (long long)r->c.steps, cli_count(cbuf, r->c.tokens), r->a->save_dir,
                (long long)r->saved_step);
    return 0;
}

static int train_main(int argc, char **argv, par_ctx *P)
{
    train_cmd t = {.schedule = -1, .fp8 = -1};
    int rc = cli_parse(argc, argv, 1, OPTS, O_COUNT, t.v, NULL, 0, NULL);
    if (!rc) rc = read_args(&t, P);
    if (!rc) {
        train_run r;
        int done = 0;
        rc = set_up(&r, &t, P, &done);
        if (!rc && !done) rc = train(&r);
        shard_status s = steplog_finish(&r.log);
        if (!rc && s) rc = cli_fail(s);
        loop_close(&r);
    }
    free(t.inject);
    return rc;
}

int main(int argc, char **argv)
{
    cli_init("smp-train");
    blas_pick_kernels(argv); /* first: it may start the process again */
    if (cli_std_flags(argc, argv, HELP)) return 0;
    return launch_ranks(argc, argv, train_main);
}
