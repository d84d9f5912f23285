/* train/optim.c: AdamW, the schedule, clipping (optim.h). */
#include "optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

shard_status optim_create(optim *o, const optim_hparams *h, size_t nparams)
{
    memset(o, 0, sizeof *o);
    o->h = *h;
    o->n = nparams;
    o->m = calloc(nparams ? nparams : 1, sizeof(float));
    o->v = calloc(nparams ? nparams : 1, sizeof(float));
    if (!o->m || !o->v) {
        optim_free(o);
        return shard_fail(SHARD_E_NOMEM, "out of memory for the optimizer state");
    }
    return SHARD_OK;
}

void optim_free(optim *o)
{
    if (!o) return;
    free(o->m);
    free(o->v);
    o->m = o->v = NULL;
}

float optim_lr(const optim_hparams *h, int64_t step)
{
    if (step < h->warmup) return (float)((double)h->lr * (double)(step + 1) / (double)h->warmup);
    if (!h->cosine) return h->lr;
    int64_t span = h->steps - 1 - h->warmup;
    double r = span > 0 ? (double)(step - h->warmup) / (double)span : 1.0;
    if (r > 1.0) r = 1.0;
    double c = 0.5 * (1.0 + cos(M_PI * r));
    return (float)(h->lr_min + c * ((double)h->lr - h->lr_min));
}

double optim_sumsq(const float *x, size_t n)
{
    enum { CHUNK = 1 << 16 };
    size_t nchunks = (n + CHUNK - 1) / CHUNK;
    double *part = malloc((nchunks ? nchunks : 1) * sizeof(double));
    double total = 0.0;
    if (!part) { /* sequential fallback: same order as below, chunk by chunk */
        for (size_t c = 0; c < nchunks; c++) {
            double s = 0.0;
            for (size_t i = c * CHUNK; i < n && i < (c + 1) * CHUNK; i++) s += (double)x[i] * x[i];
            total += s;
        }
        return total;
    }
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        double s = 0.0;
        size_t end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
        for (size_t i = c * CHUNK; i < end; i++) s += (double)x[i] * x[i];
        part[c] = s;
    }
    for (size_t c = 0; c < nchunks; c++) total += part[c];
    free(part);
    return total;
}

float optim_clip(float *grads, size_t n, double norm, float clip)
{
    if (clip <= 0.0f) return 1.0f;
    float coef = (float)((double)clip / (norm + 1e-6));
    if (coef < 1.0f) op_scale(grads, coef, n);
    return coef < 1.0f ? coef : 1.0f;
}

void optim_step_blocks(optim *o, model *m, float lr, const size_t *zoff, const size_t *zn)
{
    o->t++;
    size_t base = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        size_t off = m->offset[i] + zoff[i];
        float wd = m->spec[i].ndim >= 2 ? o->h.weight_decay : 0.0f;
        if (zn[i])
            op_adamw(m->params + off, m->grads + off, o->m + base, o->v + base, zn[i], lr, o->h.beta1, o->h.beta2,
                     o->h.eps, wd, (int)o->t);
        base += zn[i];
    }
}
void optim_step(optim *o, model *m, float lr)
{
    o->t++;
    for (size_t i = 0; i < m->ntensors; i++) {
        size_t off = m->offset[i];
        float wd = m->spec[i].ndim >= 2 ? o->h.weight_decay : 0.0f;
        op_adamw(m->params + off, m->grads + off, o->m + off, o->v + off, m->numel[i], lr, o->h.beta1, o->h.beta2,
                 o->h.eps, wd, (int)o->t);
    }
}
