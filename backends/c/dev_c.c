/* backends/c/dev_c.c: the C backend of dev.h: host memory, fp32, kernels/ops.h (FP8:
 * fp8_c.c). */
#include <stdlib.h>
#include <string.h>

#include "dev_c.h"
#include "ops.h"
#include "optim.h"

static shard_status c_init(dev *d, int device)
{
    d->cuda = 0;
    if (d->dt != SHARD_DT_F32) return shard_fail(SHARD_E_USAGE, "the C backend computes in fp32");
    return SHARD_OK;
}
static void c_fini(dev *d)
{
    c_impl *c = d->impl;
    if (c) free(c->fp8_scratch);
    free(c);
    d->impl = NULL;
}
static const char *c_describe(dev *d) { return "CPU (C ops, OpenMP, BLAS)"; }
static size_t c_mem_used(dev *d) { return 0; }
static shard_status c_comm_for(dev *d, shard_comm *host, shard_comm **out, int *owned)
{
    *out = host;
    *owned = 0;
    return SHARD_OK;
}

static void *c_alloc(dev *d, size_t bytes)
{
    /* No MADV_HUGEPAGE on big buffers (an earlier form asked for it, to fault 2 MiB at a
     * time while a checkpoint loads): on a VM that reports free memory to its host
     * (virtio-balloon free page reporting, which reports free blocks of 2 MiB), huge
     * pages are the ones the host has taken back, and the guest's zeroing of each then
     * faults on the host. Measured on the 2-core VM, smp-eval of a 1.5 GB checkpoint
     * into 3 GB of fp32: load 0.3-3.9 s with huge pages, 0.74-1.14 s without; 8 ranks,
     * tp=4,dp=2: 4.7-8.1 s against 1.8-2.1 s. */
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) dev_fail(d, SHARD_E_NOMEM, "out of memory (%zu bytes)", bytes);
    return p;
}
static void c_release(dev *d, void *p)
{
    free(p);
}
static void c_zero(dev *d, void *p, size_t bytes)
{
    memset(p, 0, bytes);
}
static void c_copy(dev *d, void *dst, const void *src, size_t bytes)
{
    if (dst != src) memmove(dst, src, bytes);
}
static shard_status c_sync(dev *d) { return d->err; }

static void c_embedding_forward(dev *d, void *out, const int32_t *tokens, const void *wte, int N, int H, int vs, int vl)
{
    op_embedding_forward(out, tokens, wte, N, H, vs, vl);
}
static void c_embedding_backward(dev *d, float *dwte, const void *dout, const int32_t *tokens, int N, int H, int vs,
                                 int vl)
{
    op_embedding_backward(dwte, dout, tokens, N, H, vs, vl);
}
static void c_linear_forward(dev *d, void *out, const void *inp, const void *w, int N, int IN, int OUT)
{
    op_linear_forward(out, inp, w, N, IN, OUT);
}
static void c_linear_backward(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w, int N,
                              int IN, int OUT)
{
    op_linear_backward(dinp, dw, dout, inp, w, N, IN, OUT);
}
static void c_bias_forward(dev *d, void *out, const void *bias, int N, int C)
{
    op_bias_forward(out, bias, N, C);
}
static void c_bias_backward(dev *d, float *dbias, const void *dout, int N, int C)
{
    op_bias_backward(dbias, dout, N, C);
}
static void c_qkv_split(dev *d, void *q, void *k, void *v, const void *qkv, int N, int nh, int hd)
{
    op_qkv_split(q, k, v, qkv, N, nh, hd);
}
static void c_qkv_merge(dev *d, void *dqkv, const void *dq, const void *dk, const void *dv, int N, int nh, int hd)
{
    op_qkv_merge(dqkv, dq, dk, dv, N, nh, hd);
}
static void c_moe_route(dev *d, float *probs, int32_t *idx, float *wts, const void *logits, int N, int E, int k,
                        int renorm)
{
    op_moe_route(probs, idx, wts, logits, N, E, k, renorm);
}
static void c_moe_route_backward(dev *d, void *dlogits, const float *dwts, const float *dprobs, const float *probs,
                                 const int32_t *idx, int N, int E, int k, int renorm)
{
    op_moe_route_backward(dlogits, dwts, dprobs, probs, idx, N, E, k, renorm);
}
static void c_moe_gather(dev *d, void *xs, const void *x, const int32_t *rows, int M, int H)
{
    op_moe_gather(xs, x, rows, M, H);
}
static void c_moe_combine(dev *d, void *out, const void *ys, const float *wts, const int32_t *slot, int N, int k, int H)
{
    op_moe_combine(out, ys, wts, slot, N, k, H);
}
static void c_moe_combine_backward(dev *d, void *dys, float *dwts, const void *dout, const void *ys, const float *wts,
                                   const int32_t *slot, int N, int k, int H)
{
    op_moe_combine_backward(dys, dwts, dout, ys, wts, slot, N, k, H);
}
static void c_moe_scatter_add(dev *d, void *dx, const void *dxs, const int32_t *slot, int N, int k, int H)
{
    op_moe_scatter_add(dx, dxs, slot, N, k, H);
}
static void c_moe_group(dev *d, int32_t *off, int32_t *rows, int32_t *slot, const int32_t *idx, int N, int k, int E)
{
    op_moe_group(off, rows, slot, idx, N, k, E);
}
static void c_moe_prob_sums(dev *d, double *sums, const float *probs, int N, int E)
{
    op_moe_prob_sums(sums, probs, N, E);
}
static void c_rmsnorm_forward(dev *d, void *out, float *rstd, const void *inp, const void *w, int N, int H, float eps)
{
    op_rmsnorm_forward(out, rstd, inp, w, N, H, eps);
}
static void c_rmsnorm_backward(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                               const float *rstd, int N, int H)
{
    op_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, H);
}
static void c_layernorm_forward(dev *d, void *out, float *mean, float *rstd, const void *inp, const void *w,
                                const void *b, int N, int H, float eps)
{
    op_layernorm_forward(out, mean, rstd, inp, w, b, N, H, eps);
}
static void c_layernorm_backward(dev *d, void *dinp, float *dw, float *db, const void *dout, const void *inp,
                                 const void *w, const float *mean, const float *rstd, int N, int H)
{
    op_layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, H);
}
static void c_rope_table(dev *d, float *cos_t, float *sin_t, const int32_t *pos, int T, const float *inv_freq, int rd, float scale)
{
    op_rope_table(cos_t, sin_t, pos, T, inv_freq, rd, scale);
}
static void c_rope_forward(dev *d, void *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                           int rd)
{
    op_rope_forward(x, cos_t, sin_t, B, T, nh, hd, rd);
}
static void c_rope_backward(dev *d, void *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                            int rd)
{
    op_rope_backward(dx, cos_t, sin_t, B, T, nh, hd, rd);
}
static void c_attention_forward(dev *d, void *out, float *lse, const void *q, const void *k, const void *v,
                                const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                                const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv,
                                int hd, int window)
{
    op_attention_forward(out, lse, q, k, v, qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
}
static void c_attention_backward(dev *d, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                                 const void *v, const void *out, const float *lse, const int32_t *qpos,
                                 const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc, int B, int Tq, int Tk,
                                 int nh, int nkv, int hd, int window)
{
    op_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
}
static void c_attention_merge(dev *d, void *out, float *lse, const void *out2, const float *lse2, int B, int T, int nh,
                              int hd)
{
    op_attention_merge(out, lse, out2, lse2, B, T, nh, hd);
}
static void c_swiglu_forward(dev *d, void *out, const void *gate, const void *up, size_t n)
{
    op_swiglu_forward(out, gate, up, n);
}
static void c_swiglu_backward(dev *d, void *dgate, void *dup, const void *dout, const void *gate, const void *up,
                              size_t n)
{
    op_swiglu_backward(dgate, dup, dout, gate, up, n);
}
static void c_gelu_forward(dev *d, void *out, const void *inp, size_t n)
{
    op_gelu_forward(out, inp, n);
}
static void c_gelu_backward(dev *d, void *dinp, const void *dout, const void *inp, size_t n)
{
    op_gelu_backward(dinp, dout, inp, n);
}
static void c_add(dev *d, void *y, const void *a, const void *b, size_t n)
{
    op_add(y, a, b, n);
}
static void c_xent_rowmax(dev *d, float *rowmax, float *target_logit, const void *logits, const int32_t *targets, int N,
                          int Vl, int vs)
{
    op_xent_rowmax(rowmax, target_logit, logits, targets, N, Vl, vs);
}
static void c_xent_sumexp(dev *d, float *sumexp, const void *logits, const float *rowmax, int N, int Vl)
{
    op_xent_sumexp(sumexp, logits, rowmax, N, Vl);
}
static double c_xent_loss(dev *d, float *losses, const float *rowmax, const float *sumexp, const float *target_logit,
                          const int32_t *targets, int N)
{
    op_xent_loss(losses, rowmax, sumexp, target_logit, targets, N);
    double sum = 0.0; /* in row order: the same bits for any thread count */
    for (int n = 0; n < N; n++)
        if (targets[n] >= 0) sum += losses[n];
    return sum;
}
static void c_xent_backward(dev *d, void *dlogits, const void *logits, const float *rowmax, const float *sumexp,
                            const int32_t *targets, int N, int Vl, int vs, float scale)
{
    op_xent_backward(dlogits, logits, rowmax, sumexp, targets, N, Vl, vs, scale);
}
static double c_sumsq(dev *d, const float *x, size_t n)
{
    return optim_sumsq(x, n);
}
static void c_scale(dev *d, float *x, float s, size_t n)
{
    op_scale(x, s, n);
}
static void c_adamw(dev *d, float *master, const float *grad, float *m, float *v, void *param, size_t n, float lr,
                    float beta1, float beta2, float eps, float wd, int step)
{
    op_adamw(master, grad, m, v, n, lr, beta1, beta2, eps, wd, step);
    if (param && param != master) memcpy(param, master, n * sizeof(float));
}
static void c_fp8_nothing(dev *d, fp8_state *s) {} /* the C recipe works on the host state directly */

static const dev_ops C_OPS = {
    .abi = DEV_ABI, .name = "cpu", .init = c_init, .fini = c_fini, .describe = c_describe, .mem_used = c_mem_used,
    .comm_for = c_comm_for, .alloc = c_alloc, .release = c_release, .zero = c_zero, .copy = c_copy,
    .upload = c_copy, .download = c_copy, .sync = c_sync,
    .embedding_forward = c_embedding_forward, .embedding_backward = c_embedding_backward,
    .linear_forward = c_linear_forward, .linear_backward = c_linear_backward,
    .bias_forward = c_bias_forward, .bias_backward = c_bias_backward,
    .qkv_split = c_qkv_split, .qkv_merge = c_qkv_merge,
    .moe_route = c_moe_route, .moe_route_backward = c_moe_route_backward, .moe_gather = c_moe_gather,
    .moe_combine = c_moe_combine, .moe_combine_backward = c_moe_combine_backward,
    .moe_scatter_add = c_moe_scatter_add, .moe_group = c_moe_group, .moe_prob_sums = c_moe_prob_sums,
    .rmsnorm_forward = c_rmsnorm_forward, .rmsnorm_backward = c_rmsnorm_backward,
    .layernorm_forward = c_layernorm_forward, .layernorm_backward = c_layernorm_backward,
    .rope_table = c_rope_table, .rope_forward = c_rope_forward, .rope_backward = c_rope_backward,
    .attention_forward = c_attention_forward, .attention_backward = c_attention_backward,
    .attention_merge = c_attention_merge, .swiglu_forward = c_swiglu_forward, .swiglu_backward = c_swiglu_backward,
    .gelu_forward = c_gelu_forward, .gelu_backward = c_gelu_backward,
    .add = c_add, .xent_rowmax = c_xent_rowmax, .xent_sumexp = c_xent_sumexp, .xent_loss = c_xent_loss,
    .xent_backward = c_xent_backward, .sumsq = c_sumsq, .scale = c_scale, .adamw = c_adamw,
    .fp8_reserve = c_fp8_reserve, .fp8_linear_forward = c_fp8_linear_forward, .fp8_linear_backward = c_fp8_linear_backward,
    .fp8_collect = c_fp8_nothing, .fp8_scales_changed = c_fp8_nothing,
};

const dev_ops *dev_c_ops(void)
{
    return &C_OPS;
}
