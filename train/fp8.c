/* train/fp8.c: the FP8 recipe (see fp8.h), emulated on the C backend. */
#include "fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f

const char *fp8_mode_name(fp8_mode m)
{
    return m == FP8_DELAYED ? "delayed" : m == FP8_CURRENT ? "current" : "off";
}

fp8_state *fp8_create(fp8_mode mode, int nlin, int hist_len, float margin)
{
    fp8_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->mode = mode;
    s->nlin = nlin;
    s->hist_len = hist_len < 1 ? 1 : hist_len;
    s->margin = margin;
    s->hist = calloc((size_t)nlin * FP8_ROLES * s->hist_len + 1, sizeof(float));
    s->scale = calloc((size_t)nlin * FP8_ROLES + 1, sizeof(float));
    s->step_amax = calloc((size_t)nlin * FP8_ROLES + 1, sizeof(float));
    if (!s->hist || !s->scale || !s->step_amax) {
        fp8_free(s);
        return NULL;
    }
    for (int i = 0; i < nlin * FP8_ROLES; i++) s->scale[i] = 1.0f;
    return s;
}

void fp8_free(fp8_state *s)
{
    if (!s) return;
    free(s->hist); free(s->scale); free(s->step_amax); free(s->scratch); free(s->qbuf);
    free(s);
}

shard_status fp8_reserve(fp8_state *s, size_t floats, size_t bytes)
{
    if (floats > s->scratch_cap) {
        float *p = realloc(s->scratch, floats * sizeof(float));
        if (!p) return shard_fail(SHARD_E_NOMEM, "out of memory for the FP8 scratch");
        s->scratch = p;
        s->scratch_cap = floats;
    }
    if (bytes > s->qbuf_cap) {
        uint8_t *p = realloc(s->qbuf, bytes);
        if (!p) return shard_fail(SHARD_E_NOMEM, "out of memory for the FP8 scratch");
        s->qbuf = p;
        s->qbuf_cap = bytes;
    }
    return SHARD_OK;
}

static float fmt_max(int role)
{
    return role == FP8_ROLE_GRAD ? E5M2_MAX : E4M3_MAX;
}

/* TransformerEngine's scale update: fp8_max / amax / 2^margin, kept when the amax
 * is 0 or not finite */
static float scale_from(float amax, float prev, int role, float margin)
{
    if (!(amax > 0.0f) || !isfinite(amax)) return prev;
    float sc = (float)((double)fmt_max(role) / amax / pow(2.0, margin));
    return isfinite(sc) && sc > 0.0f ? sc : prev;
}

static float *scratch(fp8_state *s, size_t n)
{
    if (n > s->scratch_cap) {
        float *p = realloc(s->scratch, n * sizeof(float));
        if (!p) abort(); /* unreachable: fp8_reserve sized it for the largest layer */
        s->scratch = p;
        s->scratch_cap = n;
    }
    return s->scratch;
}

/* The scale of (idx, role) for tensor x of n elements, recording its amax for the
 * step. */
static float use_scale(fp8_state *s, int idx, int role, const float *x, size_t n)
{
    float amax = op_amax(x, n);
    if (s->frozen) /* validation: the same scales, no trace in the step's amaxes */
        return s->mode == FP8_CURRENT ? scale_from(amax, s->scale[idx * FP8_ROLES + role], role, s->margin)
                                      : s->scale[idx * FP8_ROLES + role];
    float *sa = &s->step_amax[idx * FP8_ROLES + role];
    if (amax > *sa || isnan(amax)) *sa = isnan(*sa) ? *sa : amax;
    float *sc = &s->scale[idx * FP8_ROLES + role];
    if (s->mode == FP8_CURRENT) *sc = scale_from(amax, *sc, role, s->margin);
    return *sc;
}

static void roundtrip(fp8_state *s, float *dst, const float *src, size_t n, float scale, int fmt)
{
    if (n > s->qbuf_cap) {
        uint8_t *p = realloc(s->qbuf, n);
        if (!p) abort(); /* unreachable, as above */
        s->qbuf = p;
        s->qbuf_cap = n;
    }
    op_fp8_quantize(s->qbuf, NULL, src, n, scale, fmt);
    op_fp8_dequantize(dst, s->qbuf, n, scale, fmt);
}

void fp8_linear_forward(fp8_state *s, int idx, float *out, const float *inp, const float *w, int N, int IN, int OUT)
{
    size_t ni = (size_t)N * IN, nw = (size_t)OUT * IN;
    float s_in = use_scale(s, idx, FP8_ROLE_INPUT, inp, ni);
    float s_w = use_scale(s, idx, FP8_ROLE_WEIGHT, w, nw);
    void *buf = scratch(s, OP_LINEAR_FP8_SCRATCH_BYTES(N, IN, OUT) / sizeof(float));
    op_linear_forward_fp8(out, inp, w, N, IN, OUT, s_in, s_w, buf);
}

void fp8_linear_backward(fp8_state *s, int idx, float *dinp, float *dw, const float *dout, const float *inp,
                         const float *w, int N, int IN, int OUT)
{
    size_t ng = (size_t)N * OUT, ni = (size_t)N * IN, nw = (size_t)OUT * IN;
    float s_g = use_scale(s, idx, FP8_ROLE_GRAD, dout, ng);
    /* the forward's scales (current scaling recomputes the same ones) */
    float s_in = s->scale[idx * FP8_ROLES + FP8_ROLE_INPUT], s_w = s->scale[idx * FP8_ROLES + FP8_ROLE_WEIGHT];
    float *g = scratch(s, ng + ni + nw), *xi = g + ng, *wq = xi + ni;
    roundtrip(s, g, dout, ng, s_g, OP_FP8_E5M2);
    roundtrip(s, xi, inp, ni, s_in, OP_FP8_E4M3);
    roundtrip(s, wq, w, nw, s_w, OP_FP8_E4M3);
    op_linear_backward(dinp, dw, g, xi, wq, N, IN, OUT);
}

void fp8_step_end(fp8_state *s, int discard)
{
    int n = s->nlin * FP8_ROLES;
    if (!discard) {
        for (int i = 0; i < n; i++) {
            float *h = s->hist + (size_t)i * s->hist_len;
            memmove(h + 1, h, (size_t)(s->hist_len - 1) * sizeof(float));
            h[0] = s->step_amax[i];
            if (s->mode == FP8_DELAYED) {
                float mx = 0.0f;
                for (int k = 0; k < s->hist_len; k++) mx = h[k] > mx ? h[k] : mx;
                s->scale[i] = scale_from(mx, s->scale[i], i % FP8_ROLES, s->margin);
            }
        }
    }
    memset(s->step_amax, 0, (size_t)n * sizeof(float));
}
