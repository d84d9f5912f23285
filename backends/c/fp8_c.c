/* backends/c/fp8_c.c: the C backend's FP8 linear layers: train/fp8.h's recipe
 * emulated exactly: saturating quantize, dequantize (kernels/fp8.c), fp32 GEMM.
 *
 * The dequantized operands go to the backend's scratch, which fp8_reserve sizes for
 * the largest layer (model_alloc_slots calls it): the ops never allocate, and a
 * layer that does not fit is a failure recorded in the backend (dev_fail, reported
 * where the step ends), its output left as it was. */
#include <stdlib.h>

#include "dev_c.h"
#include "fp8.h"
#include "ops.h"

shard_status c_fp8_reserve(dev *d, fp8_state *s, int N, int maxdim)
{
    /* forward: (N + OUT) x IN floats; backward: N x OUT + N x IN + OUT x IN */
    const size_t D = (size_t)maxdim, floats = 2 * (size_t)N * D + D * D;
    c_impl *c = d->impl;
    if (!c && !(c = d->impl = calloc(1, sizeof *c)))
        return shard_fail(SHARD_E_NOMEM, "out of memory for the FP8 scratch");
    if (floats > c->fp8_floats) {
        float *p = realloc(c->fp8_scratch, floats * sizeof(float));
        if (!p) return shard_fail(SHARD_E_NOMEM, "out of memory for the FP8 scratch");
        c->fp8_scratch = p;
        c->fp8_floats = floats;
    }
    return SHARD_OK;
}

/* the scratch for a layer needing `floats`, or NULL (the failure recorded) */
static float *scratch(dev *d, int idx, size_t floats, int N, int IN, int OUT)
{
    const c_impl *c = d->impl;
    const size_t have = c ? c->fp8_floats : 0;
    if (c && floats <= have) return c->fp8_scratch;
    dev_fail(d, SHARD_E_INTERNAL,
             "fp8 linear layer %d: N=%d IN=%d OUT=%d needs %zu floats of scratch, fp8_reserve made %zu", idx, N, IN,
             OUT, floats, have);
    return NULL;
}

static float use_scale(fp8_state *s, int idx, int role, const float *x, size_t n)
{
    return fp8_use_scale(s, idx, role, op_amax(x, n));
}

void c_fp8_linear_forward(dev *d, fp8_state *s, int idx, void *out, const void *inp, const void *w, int N, int IN,
                          int OUT)
{
    const size_t ni = (size_t)N * IN, nw = (size_t)OUT * IN;
    float *buf = scratch(d, idx, OP_LINEAR_FP8_SCRATCH_BYTES(N, IN, OUT) / sizeof(float), N, IN, OUT);
    if (!buf) return;
    const float s_in = use_scale(s, idx, FP8_ROLE_INPUT, inp, ni);
    const float s_w = use_scale(s, idx, FP8_ROLE_WEIGHT, w, nw);
    op_linear_forward_fp8(out, inp, w, N, IN, OUT, s_in, s_w, buf);
}

void c_fp8_linear_backward(dev *d, fp8_state *s, int idx, void *dinp, float *dw, const void *dout, const void *inp,
                           const void *w, int N, int IN, int OUT)
{
    const size_t ng = (size_t)N * OUT, ni = (size_t)N * IN, nw = (size_t)OUT * IN;
    float *g = scratch(d, idx, ng + ni + nw, N, IN, OUT);
    if (!g) return;
    float *xi = g + ng, *wq = xi + ni;
    const float s_g = use_scale(s, idx, FP8_ROLE_GRAD, dout, ng);
    /* the forward's scales (current scaling recomputes the same ones) */
    const float s_in = s->scale[idx * FP8_ROLES + FP8_ROLE_INPUT], s_w = s->scale[idx * FP8_ROLES + FP8_ROLE_WEIGHT];
    op_fp8_roundtrip(g, dout, ng, s_g, OP_FP8_E5M2);
    op_fp8_roundtrip(xi, inp, ni, s_in, OP_FP8_E4M3);
    op_fp8_roundtrip(wq, w, nw, s_w, OP_FP8_E4M3);
    op_linear_backward(dinp, dw, g, xi, wq, N, IN, OUT);
}
