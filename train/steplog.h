/* train/steplog.h: what smp-train reports of each step: one JSON object per line in
 * the --log file (rank 0; appended) and the progress line on a terminal (rank 0's
 * stderr, redrawn in place). */
#ifndef SMP_TRAIN_STEPLOG_H
#define SMP_TRAIN_STEPLOG_H

#include <stdint.h>
#include <stdio.h>

#include "par.h"
#include "shard.h"

/* The communicators whose bytes a log line reports, by the kind it reports them
 * under (the device groups: NCCL ones on CUDA). */
typedef struct {
    shard_comm *tp, *kv;  /* tp: the tensor-parallel collectives (with --sequence-parallel the
                           * reduce-scatters and all-gathers, and the norm weight
                           * gradients' all-reduce); the kv-head groups' gradient sums */
    shard_comm *cp;       /* the ring attention's K/V passes (with dK/dV in backward), and
                           * with validation its loss all-reduce */
    shard_comm *pp, *emb; /* the pipeline's activations and gradients; the tied
                           * embeddings' sum over the first and last stage */
    shard_comm *dp, *dpcp; /* the ZeRO-1 collectives over dp*cp and the loss all-reduce */
    shard_comm *ep, *erep; /* expert parallelism: the tokens' all-to-all (and the counts' on the host
                            * communicator, not counted: E ints a layer); the experts' ZeRO-1 group */
} step_comms;

/* Bytes this rank sent in the step, by kind: bytes_tp, bytes_cp, bytes_pp, bytes_dp,
 * bytes_ep (with expert parallelism). */
typedef struct {
    uint64_t tp, cp, pp, dp, ep;
} step_bytes;

/* One optimizer step, as reported. */
typedef struct {
    int64_t step;          /* steps done, this one included */
    uint64_t tokens;       /* tokens seen by the run */
    double loss;           /* the mean over the step's counted targets (NaN: none) */
    uint64_t targets;      /* the step's counted targets (B*S without documents or masks) */
    double grad_norm;
    float lr;
    int skipped;           /* the loss or the norm was not finite: no update */
    int empty;             /* no counted target: no update (loss null) */
    double seconds;        /* the step's passes and update (not the validation) */
    double tokens_per_s;
    double elapsed;        /* since the run started in this process */
    double val_loss;       /* NaN when the step did not validate */
    double aux_loss;       /* a mixture of experts' load-balancing loss over the step (model_aux_loss); NaN: dense */
    step_bytes bytes;
} step_result;

typedef struct {
    FILE *f;               /* the --log file, or NULL */
    const char *path;      /* its name */
    int lost_errno;        /* a step's line was not written: why (0: none was lost) */
    int64_t lost;          /* the first such step */
    int tty;               /* the progress line is drawn */
    int drawn;             /* and not ended yet */
    int bytes;             /* more than one rank: the bytes by kind are logged */
    double ema_dt;         /* the ETA's smoothed step time */
    step_comms comms;
} steplog;

/* path: the --log file (NULL: none), fd: it opened already (-1: not yet); tty: draw the progress line; P: the run's ranks
 * (more than one: the log has the bytes by kind). */
shard_status steplog_open(steplog *l, const char *path, int fd, int tty, const par_ctx *P);
void steplog_close(steplog *l);
/* At the run's end: closes the log; an error if a step's line was not written (a full
 * disk, a monitor that stopped reading): the run went on, warned once, without it. */
shard_status steplog_finish(steplog *l);
/* At the start of a step: the byte counters of the communicators to 0. */
void steplog_reset_bytes(const steplog *l);
/* The bytes this rank sent since steplog_reset_bytes. */
step_bytes steplog_bytes(const steplog *l);
/* The step's log line and progress line (`steps`: of the run, for the ETA). */
void steplog_step(steplog *l, const step_result *r, int64_t steps);
/* Before a message of its own: what ends the progress line ("\n" on a terminal while
 * one is drawn, else nothing). steplog_clear: what a warning starts with to print over it. */
void steplog_end_line(steplog *l);
const char *steplog_clear(const steplog *l);

#endif
