/* train/optim.c: AdamW, the schedule, clipping (optim.h). */
#include "optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

shard_status optim_create(optim *o, const optim_hparams *h, size_t nparams, dev *d)
{
    memset(o, 0, sizeof *o);
    o->h = *h;
    o->n = nparams;
    o->dev = d;
    const size_t bytes = (nparams ? nparams : 1) * sizeof(float);
    o->m = d->ops->alloc(d, bytes);
    o->v = d->ops->alloc(d, bytes);
    if (d->dt != SHARD_DT_F32) o->master = d->ops->alloc(d, bytes);
    if (!o->m || !o->v || (d->dt != SHARD_DT_F32 && !o->master)) {
        optim_free(o);
        return shard_fail(SHARD_E_NOMEM, "out of memory for the optimizer state (%zu elements)", nparams);
    }
    return SHARD_OK;
}

void optim_free(optim *o)
{
    if (!o || !o->dev) return;
    dev *d = o->dev;
    d->ops->release(d, o->m);
    d->ops->release(d, o->v);
    d->ops->release(d, o->master);
    if (d->cuda) { /* else they are m, v and master themselves */
        free(o->hm);
        free(o->hv);
        free(o->hmaster);
    }
    o->m = o->v = o->master = o->hm = o->hv = o->hmaster = NULL;
}

shard_status optim_host(optim *o, int moments)
{
    if (!o->dev->cuda) {
        o->hm = o->m, o->hv = o->v, o->hmaster = o->master;
        return SHARD_OK;
    }
    const size_t n = o->n ? o->n : 1;
    if (moments && !o->hm) o->hm = calloc(n, sizeof(float));
    if (moments && !o->hv) o->hv = calloc(n, sizeof(float));
    if (o->master && !o->hmaster) o->hmaster = calloc(n, sizeof(float));
    if ((moments && (!o->hm || !o->hv)) || (o->master && !o->hmaster))
        return shard_fail(SHARD_E_NOMEM, "out of host memory for the optimizer state");
    return SHARD_OK;
}

void optim_download(optim *o)
{
    if (!o->dev->cuda || optim_host(o, 1)) return;
    dev *d = o->dev;
    d->ops->download(d, o->hm, o->m, o->n * sizeof(float));
    d->ops->download(d, o->hv, o->v, o->n * sizeof(float));
    if (o->master) d->ops->download(d, o->hmaster, o->master, o->n * sizeof(float));
}

void optim_upload(optim *o)
{
    if (!o->dev->cuda) return;
    dev *d = o->dev;
    if (o->hm) d->ops->upload(d, o->m, o->hm, o->n * sizeof(float));
    if (o->hv) d->ops->upload(d, o->v, o->hv, o->n * sizeof(float));
    if (o->master && o->hmaster) d->ops->upload(d, o->master, o->hmaster, o->n * sizeof(float));
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

float optim_clip_coef(double norm, float clip)
{
    if (clip <= 0.0f) return 1.0f;
    float coef = (float)((double)clip / (norm + 1e-6));
    return coef < 1.0f ? coef : 1.0f;
}

float optim_clip(float *grads, size_t n, double norm, float clip)
{
    float coef = optim_clip_coef(norm, clip);
    if (coef < 1.0f) op_scale(grads, coef, n);
    return coef;
}

/* AdamW of tensor i's elements [off, off + n) of the model, the optimizer state at base */
static void update(optim *o, model *m, size_t i, size_t off, size_t n, size_t base, float lr)
{
    dev *d = o->dev;
    float wd = m->spec[i].ndim >= 2 ? o->h.weight_decay : 0.0f;
    void *param = dev_at(d, m->params, off);
    float *master = o->master ? o->master + base : (float *)param; /* fp32: the parameters are the master */
    d->ops->adamw(d, master, m->grads + off, o->m + base, o->v + base, o->master ? param : NULL, n, lr, o->h.beta1,
                  o->h.beta2, o->h.eps, wd, (int)o->t);
}

void optim_step_blocks(optim *o, model *m, float lr, const size_t *zoff, const size_t *zn)
{
    o->t++;
    size_t base = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        if (zn[i]) update(o, m, i, m->offset[i] + zoff[i], zn[i], base, lr);
        base += zn[i];
    }
}
void optim_step(optim *o, model *m, float lr)
{
    o->t++;
    for (size_t i = 0; i < m->ntensors; i++) update(o, m, i, m->offset[i], m->numel[i], m->offset[i], lr);
}
