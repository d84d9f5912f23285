/* train/lanes.h: a rank's microbatch split over its CPU threads.
 *
 * On the C backend each op spreads over the threads by itself, and a small model's
 * ops are short: the threads meet at the end of every op (hundreds a step), and
 * OpenBLAS splits products that fit one core. Lanes split the microbatch instead:
 * lane i runs sequences [i R, (i+1) R) of it (R = rows / lanes), forward and backward,
 * on one thread, on a model of its own over the rank's parameters (shared, only read
 * during the passes) with its own activations and gradients; at the end of the step
 * the lanes' gradients are added into the rank's, lane by lane in order. The bits
 * depend on the lane count (a sum of lane sums), never on the thread count: lanes run
 * one after another where there are fewer threads. A run saves its lane count in its
 * training state and a resumed run keeps it (docs/TRAINING.md, "Lanes").
 *
 * Lanes take the C backend, pp = tp = cp = 1 and no expert parallelism, a dense model
 * and FP8 off (lanes_refusal); data parallelism is fine (each rank its lanes). */
#ifndef SMP_TRAIN_LANES_H
#define SMP_TRAIN_LANES_H

#include <stdint.h>

#include "model.h"
#include "par.h"
#include "shard.h"

enum { LANES_MAX = 1024 };

typedef struct {
    int n;      /* lanes; 1: the rank's model alone */
    int rows;   /* sequences of a microbatch per lane */
    model **m;  /* [n]: m[0] the rank's model, the others lanes over its parameters */
} lanes;

/* Why n lanes cannot run a rank's microbatches of `rows` sequences of model m under
 * layout l (the message), or NULL when they can. */
const char *lanes_refusal(const model *m, const shard_layout *l, int rows, int n);
/* The lane count a new run takes: the threads (OpenMP's), where they divide the rows,
 * lanes_refusal has nothing against it and the extra lanes' gradient copies take at
 * most an eighth of the machine's memory; else 1. */
int lanes_auto(const model *m, const shard_layout *l, int rows);

/* ln over m (localized, its parameters in place, no activations yet): n - 1 lanes
 * made over m's parameters, then every lane's activations for rows / n sequences of T
 * tokens (m's included). n = 1: model_alloc_slots(m, rows, T, nslots) alone. */
shard_status lanes_open(lanes *ln, model *m, int n, int rows, int T, int nslots);
/* the single lane of model m, whose activations hold `rows` sequences (smp-eval) */
lanes lanes_single(model **m, int rows);
void lanes_close(lanes *ln);

/* One optimizer step's passes over M microbatches: fill (par.h) puts microbatch mb's
 * rows in in/tg, each lane takes its part (par_take_batch), forward and backward;
 * the loss sum in *lsum (the lanes' in order); the gradients, which the caller zeroed
 * in m[0], end in m[0]'s. n = 1: par_train_step's one-stage schedule. */
shard_status lanes_train_step(lanes *ln, par_ctx *p, int M, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg,
                              float loss_scale, double *lsum);
/* The forward of one microbatch in in/tg (rows x T, whole sequences): each lane's
 * part; the loss sum (the lanes' in order) and the counted targets in *tokens. */
double lanes_forward(lanes *ln, int32_t *in, int32_t *tg, uint64_t *tokens);
/* bytes of the lanes beyond m[0]'s (gradients, activations) */
void lanes_memory(const lanes *ln, size_t *grads, size_t *acts);

#endif
