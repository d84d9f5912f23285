/* train/loop.h: a training run: what it holds (the backend, the model, the optimizer,
 * the data, the checkpoint it started from), how it is set up from the checkpoint,
 * and its loop of optimizer steps:
 *
 *   loop_open      backend, checkpoint, model; the configuration: defaults, then the
 *                  checkpoint's training state (the caller then sets the flags and
 *                  checks them: runcfg.h);
 *   loop_load      the token files, the parallel layout, the weights and optimizer
 *                  state (every rank its pieces), the activations, the run folder and
 *                  the log;
 *   loop_run       the steps until --steps or --stop-at, a signal (a->stop), or --max-bad
 *                  non-finite steps in a row; saves at --save-every, at the end and
 *                  on a signal; or loop_dump_grads: one step's gradients to a file;
 *   loop_close     releases it all.
 *
 * A step (loop_step): zero the gradients, the forward and backward passes of the
 * microbatches (lanes_train_step: par_train_step, or the lanes'), the loss summed
 * over the replicas and to every stage, the gradients reduced (global norm), FP8 amaxes reduced over all ranks, the
 * update (or the step skipped when the loss or the norm is not finite), then the
 * validation (loop_validate) and whether to save. Failures are returned as the
 * status with libshard's message; what the run says about itself (warnings, the
 * signal, --max-bad) it prints on rank 0's stderr. */
#ifndef SMP_TRAIN_LOOP_H
#define SMP_TRAIN_LOOP_H

#include <signal.h>
#include <stdint.h>

#include "ckptio.h"
#include "data.h"
#include "dev.h"
#include "lanes.h"
#include "model.h"
#include "optim.h"
#include "par.h"
#include "shard.h"
#include "state.h"
#include "steplog.h"

/* What the command line gives a run beyond run_cfg's settings. */
typedef struct {
    const char *ckpt, *data, *val_data, *save_dir, *log, *stages;
    int log_fd;                    /* a --log FIFO, opened before the load (-1: opened at the run's start) */
    const char *dump_grads;        /* --dump-grads DIR, or NULL */
    const char *loss_mask, *val_loss_mask; /* --loss-mask, --val-loss-mask FILES, or NULL */
    int documents;                 /* --documents: packed documents ended by doc_sep */
    int32_t doc_sep;
    const char *backend;           /* "cpu" or "cuda" */
    shard_dtype dtype;
    recompute_mode recompute;
    shard_layout layout;
    int seqpar;                    /* --sequence-parallel */
    shard_compress compress;
    const int64_t *inject_nan;     /* --inject-nan: steps (1-based) whose loss becomes NaN */
    int ninject;
    long long fail_rank, fail_step; /* --inject-fail (-1: none) */
    long long signal_rank, signal_step; /* --inject-signal (-1: none) */
    volatile sig_atomic_t *stop;   /* set by a signal: save and stop after the step */
    double (*now)(void);           /* a monotonic clock, in seconds */
    /* rank 0, around the check of the token files and the checkpoint's load (NULL:
     * none): the command's progress line, label, and count(arg) the bytes done */
    void (*watch_start)(void *ctx, const char *label, uint64_t (*count)(const void *), const void *arg);
    void (*watch_end)(void *ctx);
    void *watch_ctx;
} loop_args;

typedef struct {
    par_ctx *P;
    const loop_args *a;
    run_cfg c;
    int resumed;                   /* the checkpoint had a training state */
    int64_t position_saved;        /* its data position, before another --seq re-expressed it */
    int usage;                     /* 1: the failure returned is the command line's (a usage error) */
    /* what the run holds (loop_close releases it) */
    dev D;
    shard_ckpt *ck;
    shard_ckpt *carry;             /* rank 0, once it has saved: the newest checkpoint saved
                                    * (ckptio_follow), whose extra/ files the next save carries */
    ckptio_held held;              /* rank 0: the old steps a reader held at a save, said once */
    model m;
    lanes ln;                      /* the microbatch's lanes (m and those over its parameters) */
    optim opt;
    data_set ds, vs;               /* training, validation (vs.nfiles 0: none) */
    shard_dtype *pdt;              /* the stored dtype of each parameter, which saves keep */
    int32_t *in, *tg;              /* one microbatch's inputs and targets [Bm * S] */
    steplog log;
    int Bm, S;                     /* a microbatch: Bm sequences of S tokens (each cp rank keeps S / cp) */
    /* the loop */
    double t_start;
    int64_t bad_run;               /* non-finite steps in a row */
    int lock_fd;                   /* rank 0: the run folder's lock (ckptio_prepare), -1: none */
    int64_t saved_step;            /* the last checkpoint's step (the one resumed from), -1: none */
    int stopping;                  /* a signal asked to stop, as of this step's agreement (loop_step) */
} train_run;

typedef enum { LOOP_DONE, LOOP_STOPPED, LOOP_BAD } loop_end;

/* r is zeroed first; a is kept (it must outlive r). */
shard_status loop_open(train_run *r, par_ctx *P, const loop_args *a);
/* The checkpoint (its fingerprint) and the settings of every rank against rank 0's
 * (shard_agree_check), before anything that depends on them: a rank with another checkpoint
 * could otherwise find its run over and end while the others wait for it. The token
 * files are compared in loop_load, once read. SHARD_E_USAGE for a setting. */
shard_status loop_agree(train_run *r);
shard_status loop_load(train_run *r);
void loop_close(train_run *r);

/* One optimizer step (see above): its results in *res; *save: the step is to be saved. */
shard_status loop_step(train_run *r, step_result *res, int *save);
/* The validation loss (*val; left as it is when the validation set holds no whole
 * batch): over val_batches sequential batches, the model alone when pp = cp = 1
 * (eval_loss_sum), else through the pipeline, each cp rank on its tokens. */
shard_status loop_validate(train_run *r, double *val);
shard_status loop_run(train_run *r, loop_end *end);
/* --dump-grads: one step's gradients (no update) into the folder, the loss on stdout. */
shard_status loop_dump_grads(train_run *r);

#endif
