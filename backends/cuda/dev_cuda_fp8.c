/* backends/cuda/dev_cuda_fp8.c: the FP8 linear layers of the CUDA backend (train/fp8.h's
 * recipe, as train/fp8.c emulates it on the C backend), on cuBLASLt's FP8 GEMMs.
 *
 * The host fp8_state keeps the recipe (scales, amax history, mode); the device
 * keeps copies: scale and 1/scale per (layer, role), and the max amax of each over
 * the step's calls, which fp8_collect folds into the state's step_amax. No call
 * waits for the device: the amaxes are reduced, folded and (current scaling) turned
 * into scales by small kernels, and the GEMMs read the scales from device memory.
 *
 *   forward:  x_q = e4m3(inp * s_in), w_q = e4m3(w * s_w); out = x_q @ w_q^T / s_in / s_w
 *   backward: g_q = e5m2(dout * s_g), x_q and w_q again with the forward's scales;
 *             dinp += g_q @ w_q / s_g / s_w, dw (fp32) += g_q^T @ x_q / s_g / s_in
 * delayed: the scales are the host's (fp8_scales_changed uploads them) and each
 *          call's amax is recorded (the quantize accumulates it into the step's slot
 *          itself: no reset and no fold kernel a call); current: a tensor's scale
 *          comes from its own amax first (amax, scale update, quantize); frozen
 *          (validation): the same, but nothing is recorded and current scales are
 *          not kept. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dev_cuda.h"
#include "fp8.h"

/* The 1/scale a GEMM reads sit 16 bytes apart: cuBLASLt's FP8 GEMMs refuse scale
 * pointers that are not 16-byte aligned, and kernels/gemm.cu copies such a scale into
 * an aligned slot first, an extra device copy for each operand of each call. */
enum { SI_STRIDE = 4 };

struct cu_fp8 {
    const fp8_state *owner; /* the state the scalars below mirror */
    int n;                  /* nlin * FP8_ROLES */
    float *scale, *amax;    /* device [n] */
    float *sinv;            /* device [n * SI_STRIDE]: 1/scale of k at k * SI_STRIDE */
    float *tmp;             /* device: a call's 1/scale [FP8_ROLES * SI_STRIDE], amax and scale [FP8_ROLES] */
    uint8_t *inp_q, *w_q, *dout_q;
    int resN, resD;         /* the reservation: N rows, layers up to resD x resD */
};

static float *sinv_at(const cu_fp8 *f, int k) { return f->sinv + (size_t)k * SI_STRIDE; }
static float *tmp_sinv(const cu_fp8 *f, int role) { return f->tmp + role * SI_STRIDE; }
static float *tmp_amax(const cu_fp8 *f, int role) { return f->tmp + FP8_ROLES * SI_STRIDE + role; }
static float *tmp_scale(const cu_fp8 *f, int role) { return f->tmp + FP8_ROLES * (SI_STRIDE + 1) + role; }

void cu_fp8_free(dev *d)
{
    cu_fp8 *f = cu_of(d)->fp8;
    if (!f) return;
    cudaFree(f->scale); cudaFree(f->sinv); cudaFree(f->amax); cudaFree(f->tmp);
    cudaFree(f->inp_q); cudaFree(f->w_q); cudaFree(f->dout_q);
    free(f);
    cu_of(d)->fp8 = NULL;
}

static void *dalloc(dev *d, size_t bytes)
{
    void *p = NULL;
    if (d->err) return NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        dev_fail(d, SHARD_E_NOMEM, "out of device memory for the FP8 buffers (%zu bytes)", bytes);
        return NULL;
    }
    return p;
}

/* host scales -> device scale and 1/scale (as the C recipe dequantizes: 1 / scale) */
static void upload_scales(dev *d, cu_fp8 *f, const fp8_state *s)
{
    float *h = calloc((size_t)f->n * (1 + SI_STRIDE) + 1, sizeof(float));
    if (!h) {
        dev_fail(d, SHARD_E_NOMEM, "out of host memory");
        return;
    }
    for (int i = 0; i < f->n; i++) {
        h[i] = s->scale[i];
        h[f->n + (size_t)i * SI_STRIDE] = 1.0f / s->scale[i];
    }
    cu_rt(d, cudaMemcpyAsync(f->scale, h, (size_t)f->n * sizeof(float), cudaMemcpyHostToDevice, cu_of(d)->st),
          "cudaMemcpyAsync");
    cu_rt(d, cudaMemcpyAsync(f->sinv, h + f->n, (size_t)f->n * SI_STRIDE * sizeof(float), cudaMemcpyHostToDevice,
                             cu_of(d)->st),
          "cudaMemcpyAsync");
    cu_wait(d, NULL, "cudaStreamSynchronize"); /* h is pageable and freed now */
    free(h);
}

/* The device copies of s's scalars, (re)made when s is not the state they mirror. */
static cu_fp8 *state_of(dev *d, const fp8_state *s)
{
    cu_impl *c = cu_of(d);
    if (!c->fp8 && !(c->fp8 = calloc(1, sizeof *c->fp8))) {
        dev_fail(d, SHARD_E_NOMEM, "out of host memory");
        return NULL;
    }
    cu_fp8 *f = c->fp8;
    const int n = s->nlin * FP8_ROLES;
    if (f->owner == s && f->n == n) return f;
    cudaFree(f->scale); cudaFree(f->sinv); cudaFree(f->amax);
    f->scale = f->sinv = f->amax = NULL;
    f->owner = NULL;
    f->scale = dalloc(d, (size_t)n * sizeof(float));
    f->sinv = dalloc(d, (size_t)n * SI_STRIDE * sizeof(float));
    f->amax = dalloc(d, (size_t)n * sizeof(float));
    if (!f->tmp) f->tmp = dalloc(d, FP8_ROLES * (SI_STRIDE + 2) * sizeof(float));
    if (d->err) return NULL;
    f->n = n;
    f->owner = s;
    cu_rt(d, cudaMemsetAsync(f->amax, 0, (size_t)n * sizeof(float), c->st), "cudaMemsetAsync");
    upload_scales(d, f, s);
    return d->err ? NULL : f;
}

shard_status cu_fp8_reserve(dev *d, fp8_state *s, int N, int maxdim)
{
    cu_impl *c = cu_of(d);
    cu_fp8 *f = state_of(d, s);
    if (!f) return dev_status(d);
    if (N > f->resN || maxdim > f->resD) {
        const int rn = N > f->resN ? N : f->resN, rd = maxdim > f->resD ? maxdim : f->resD;
        cudaFree(f->inp_q); cudaFree(f->w_q); cudaFree(f->dout_q);
        f->inp_q = dalloc(d, (size_t)rn * rd);
        f->w_q = dalloc(d, (size_t)rd * rd);
        f->dout_q = dalloc(d, (size_t)rn * rd);
        f->resN = d->err ? 0 : rn;
        f->resD = d->err ? 0 : rd;
    }
    /* the backward GEMMs transpose their operands into the cuda_gemm's scratch */
    const size_t need = cuda_gemm_fp8_scratch_bytes(f->resN, f->resD, f->resD);
    if (!d->err && need > c->gemm_fp8_bytes) {
        cuda_gemm_free(c->gemm); /* waits for the device */
        c->gemm = NULL;
        c->gemm_fp8_bytes = 0;
        cu_op(d, cuda_gemm_create(&c->gemm, 0, need));
        if (!d->err) c->gemm_fp8_bytes = need;
    }
    return dev_status(d);
}

/* A layer's shape must fit the reservation and cuBLASLt's FP8 rules. */
static cu_fp8 *check(dev *d, fp8_state *s, int idx, int N, int IN, int OUT)
{
    if (d->err) return NULL;
    cu_fp8 *f = state_of(d, s);
    if (!f) return NULL;
    if (idx < 0 || idx >= s->nlin) {
        dev_fail(d, SHARD_E_INTERNAL, "fp8 linear layer %d: the state has %d", idx, s->nlin);
        return NULL;
    }
    if (IN % 16 || OUT % 16 || N <= 0 || IN <= 0 || OUT <= 0) { /* any rows: gemm.cu pads the last ones */
        dev_fail(d, SHARD_E_UNSUPPORTED,
                 "fp8 linear layer %d: N=%d (rows), IN=%d, OUT=%d: FP8 GEMMs need IN and OUT positive multiples of 16",
                 idx, N, IN, OUT);
        return NULL;
    }
    if (N > f->resN || IN > f->resD || OUT > f->resD) {
        dev_fail(d, SHARD_E_INTERNAL, "fp8 linear layer %d: N=%d IN=%d OUT=%d exceeds fp8_reserve's N=%d maxdim=%d",
                 idx, N, IN, OUT, f->resN, f->resD);
        return NULL;
    }
    return f;
}

/* Quantize x[n] (role of layer idx) into q by the recipe; returns the device
 * 1/scale the GEMM is to use. */
static const float *quantize(dev *d, cu_fp8 *f, const fp8_state *s, int idx, int role, uint8_t *q, const void *x,
                             size_t n)
{
    cudaStream_t st = cu_of(d)->st;
    const int k = idx * FP8_ROLES + role, fmt = role == FP8_ROLE_GRAD ? OP_FP8_E5M2 : OP_FP8_E4M3;
    float *amax = tmp_amax(f, role), *sc = f->scale + k, *si = sinv_at(f, k);
    if (s->mode == FP8_CURRENT) {
        cu_op(d, cuda_op_amax(amax, x, n, cu_dt(d), st));
        if (s->frozen) { /* a scale for this call only */
            float *tsc = tmp_scale(f, role);
            cu_rt(d, cudaMemcpyAsync(tsc, sc, sizeof(float), cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
            sc = tsc;
            si = tmp_sinv(f, role);
        }
        cu_op(d, cuda_op_fp8_scale_update(sc, si, amax, 1, fmt, s->margin, st));
        cu_op(d, cuda_op_fp8_quantize(q, NULL, x, n, sc, fmt, cu_dt(d), st));
        if (!s->frozen) cu_op(d, cuda_op_fp8_amax_fold(f->amax + k, amax, 1, st));
    } else if (s->frozen) {
        cu_op(d, cuda_op_fp8_quantize(q, NULL, x, n, sc, fmt, cu_dt(d), st));
    } else {
        cu_op(d, cuda_op_fp8_quantize_acc(q, f->amax + k, x, n, sc, fmt, cu_dt(d), st));
    }
    return si;
}

void cu_fp8_linear_forward(dev *d, fp8_state *s, int idx, void *out, const void *inp, const void *w, int N, int IN,
                           int OUT)
{
    cu_fp8 *f = check(d, s, idx, N, IN, OUT);
    if (!f) return;
    const float *si_in = quantize(d, f, s, idx, FP8_ROLE_INPUT, f->inp_q, inp, (size_t)N * IN);
    const float *si_w = quantize(d, f, s, idx, FP8_ROLE_WEIGHT, f->w_q, w, (size_t)OUT * IN);
    cu_op(d, cuda_op_linear_forward_fp8(cu_of(d)->gemm, out, cu_dt(d), NULL, f->inp_q, si_in, f->w_q, si_w, N, IN,
                                        OUT, 0, cu_of(d)->st));
}

void cu_fp8_linear_backward(dev *d, fp8_state *s, int idx, void *dinp, float *dw, const void *dout, const void *inp,
                            const void *w, int N, int IN, int OUT)
{
    cu_fp8 *f = check(d, s, idx, N, IN, OUT);
    if (!f || (!dinp && !dw)) return;
    cudaStream_t st = cu_of(d)->st;
    const int k = idx * FP8_ROLES;
    const float *si_g = quantize(d, f, s, idx, FP8_ROLE_GRAD, f->dout_q, dout, (size_t)N * OUT);
    /* the operands again, with the forward's scales (current scaling set them) */
    if (dw)
        cu_op(d, cuda_op_fp8_quantize(f->inp_q, NULL, inp, (size_t)N * IN, f->scale + k + FP8_ROLE_INPUT,
                                      OP_FP8_E4M3, cu_dt(d), st));
    if (dinp)
        cu_op(d, cuda_op_fp8_quantize(f->w_q, NULL, w, (size_t)OUT * IN, f->scale + k + FP8_ROLE_WEIGHT, OP_FP8_E4M3,
                                      cu_dt(d), st));
    cu_op(d, cuda_op_linear_backward_fp8(cu_of(d)->gemm, dinp, cu_dt(d), dw, CUDA_R_32F, f->dout_q, si_g, f->inp_q,
                                         sinv_at(f, k + FP8_ROLE_INPUT), f->w_q, sinv_at(f, k + FP8_ROLE_WEIGHT), N, IN,
                                         OUT, st));
}

void cu_fp8_collect(dev *d, fp8_state *s)
{
    cu_fp8 *f = d->err ? NULL : state_of(d, s);
    if (!f) return;
    cudaStream_t st = cu_of(d)->st;
    float *h = malloc((size_t)f->n * 2 * sizeof(float) + 1);
    if (!h) {
        dev_fail(d, SHARD_E_NOMEM, "out of host memory");
        return;
    }
    cu_rt(d, cudaMemcpyAsync(h, f->amax, (size_t)f->n * sizeof(float), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
    cu_rt(d, cudaMemcpyAsync(h + f->n, f->scale, (size_t)f->n * sizeof(float), cudaMemcpyDeviceToHost, st),
          "cudaMemcpyAsync");
    cu_rt(d, cudaMemsetAsync(f->amax, 0, (size_t)f->n * sizeof(float), st), "cudaMemsetAsync");
    cu_wait(d, NULL, "cudaStreamSynchronize");
    if (!d->err)
        for (int i = 0; i < f->n; i++) {
            const float a = h[i];
            float *sa = &s->step_amax[i];
            if (a > *sa || isnan(a)) *sa = isnan(*sa) ? *sa : a; /* fp8.c's rule */
            if (s->mode == FP8_CURRENT) s->scale[i] = h[f->n + i]; /* the host state follows */
        }
    free(h);
}

void cu_fp8_scales_changed(dev *d, fp8_state *s)
{
    cu_fp8 *f = d->err ? NULL : state_of(d, s);
    if (f) upload_scales(d, f, s);
}
