/* train/optim.c: AdamW on the fp32 master weights, the learning-rate schedule and
 * global gradient-norm clipping.
 *
 * Schedule (step s counts from 0, `steps` in the run):
 *   warmup:   s < warmup: lr * (s + 1) / warmup
 *   cosine:   then lr_min + (lr - lr_min) * (1 + cos(pi * r)) / 2 with
 *             r = (s - warmup) / (steps - 1 - warmup), so the last step uses lr_min
 *   constant: lr after the warmup
 * Weight decay (decoupled, as torch.optim.AdamW) applies to the matrices (the
 * embedding, the head and the linear layers), not to the norms' gains.
 * Clipping is torch.nn.utils.clip_grad_norm_'s: with norm = ||all gradients||_2,
 * gradients are multiplied by clip / (norm + 1e-6) when that is below 1.
 */
#ifndef SMP_TRAIN_OPTIM_H
#define SMP_TRAIN_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "dev.h"
#include "model.h"

typedef struct {
    float lr, lr_min;
    int64_t warmup, steps;
    int cosine;            /* 0: constant after the warmup */
    float beta1, beta2, eps, weight_decay;
    float clip;            /* <= 0: no clipping */
} optim_hparams;

typedef struct {
    optim_hparams h;
    size_t n;
    dev *dev;              /* the backend holding m, v and master */
    float *m, *v;          /* Adam's moments [n] (this rank's blocks, packed in tensor order) */
    float *master;         /* fp32 master weights [n] when the compute dtype is not fp32
                              (bf16: the parameters are a bf16 copy), else NULL: the
                              fp32 parameters are the master */
    float *hm, *hv, *hmaster; /* host copies for checkpoints (optim_host) */
    int64_t t;             /* updates applied so far (AdamW's step count) */
} optim;

/* n: this rank's optimizer elements (ZeRO-1 blocks). A master copy is made when
 * d->dt is not fp32. */
shard_status optim_create(optim *o, const optim_hparams *h, size_t nparams, dev *d);
/* Host views of m, v and master for checkpoint I/O (the arrays themselves on the C
 * backend): optim_download fills them from the backend, optim_upload sends those that
 * exist. moments 0: the master's alone (a run that reads no saved moments keeps the
 * backend's zeros); optim_download makes the rest when a save needs them. */
shard_status optim_host(optim *o, int moments);
void optim_download(optim *o);
void optim_upload(optim *o);
void optim_free(optim *o);
float optim_lr(const optim_hparams *h, int64_t step);
/* Sum of squares of x in double, in a fixed order (the same bits for any thread
 * count, which a resumed run relies on). */
double optim_sumsq(const float *x, size_t n);
/* The clipping factor for a global norm (1 when no clipping applies). */
float optim_clip_coef(double norm, float clip);
/* Clip host gradients given their global norm (see above); returns the factor. */
float optim_clip(float *grads, size_t n, double norm, float clip);
/* One AdamW update of every tensor of m with learning rate lr. */
void optim_step(optim *o, model *m, float lr);
/* The same on blocks: tensor i's elements [zoff[i], zoff[i] + zn[i]) of m->params and
 * m->grads, with Adam's moments (and the master) packed in o->m, o->v in tensor
 * order (ZeRO-1). */
void optim_step_blocks(optim *o, model *m, float lr, const size_t *zoff, const size_t *zn);

#endif
