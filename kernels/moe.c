/* kernels/moe.c: Mixture-of-Experts routing, token dispatch and combine (portable C).
 * Routing is transformers' MixtralTopKRouter: softmax of the router logits in fp32,
 * the top k experts by probability (ties: the lower expert first), their weights
 * renormalized to sum 1 when asked. Dispatch (gather) and combine move whole rows;
 * every reduction runs in a fixed order per row, so the results are the same bits
 * for any thread count. */
#include "ops.h"

#include <math.h>

/* p[0..E) = softmax(z) with the max subtracted */
static void softmax_row(float *p, const float *z, int E)
{
    float m = z[0], s = 0.0f;
    for (int e = 1; e < E; e++) m = fmaxf(m, z[e]);
    for (int e = 0; e < E; e++) s += p[e] = expf(z[e] - m);
    for (int e = 0; e < E; e++) p[e] /= s;
}

/* what top-k ranks by: the prob, a NaN (from NaN logits) below every number, so that
 * idx stays a valid expert whatever the logits (moe.cu ranks the same) */
static float rank_key(float p) { return p >= 0.0f ? p : -0.5f; }

/* the k largest of p in descending order: strict > keeps the lower index on a tie */
static void topk_row(int32_t *idx, const float *p, int E, int k)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int m = 0; m < j && !taken; m++) taken = idx[m] == e;
            if (!taken && (best < 0 || rank_key(p[e]) > rank_key(p[best]))) best = e;
        }
        idx[j] = best;
    }
}

void op_moe_route(float *probs, int32_t *idx, float *wts, const float *logits, int N, int E, int k, int renorm)
{
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *p = probs + (size_t)t * E, *w = wts + (size_t)t * k;
        int32_t *ix = idx + (size_t)t * k;
        softmax_row(p, logits + (size_t)t * E, E);
        topk_row(ix, p, E, k);
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w[j] = p[ix[j]];
        if (renorm)
            for (int j = 0; j < k; j++) w[j] /= s;
    }
}

/* one row: g (the probs' gradient, E values) += what the top-k weights pass on */
static void route_dprobs(float *g, const float *dw, const float *p, const int32_t *ix, int k, int renorm)
{
    if (!renorm) {
        for (int j = 0; j < k; j++) g[ix[j]] += dw[j];
        return;
    }
    float s = 0.0f, dot = 0.0f;
    for (int j = 0; j < k; j++) s += p[ix[j]];
    for (int j = 0; j < k; j++) dot += dw[j] * (p[ix[j]] / s);
    for (int j = 0; j < k; j++) g[ix[j]] += (dw[j] - dot) / s;
}

void op_moe_route_backward(float *dlogits, const float *dwts, const float *dprobs, const float *probs,
                           const int32_t *idx, int N, int E, int k, int renorm)
{
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *g = dlogits + (size_t)t * E; /* the probs' gradient first, then the logits' */
        const float *p = probs + (size_t)t * E;
        for (int e = 0; e < E; e++) g[e] = dprobs ? dprobs[(size_t)t * E + e] : 0.0f;
        route_dprobs(g, dwts + (size_t)t * k, p, idx + (size_t)t * k, k, renorm);
        float dot = 0.0f;
        for (int e = 0; e < E; e++) dot += p[e] * g[e];
        for (int e = 0; e < E; e++) g[e] = p[e] * (g[e] - dot);
    }
}

void op_moe_gather(float *xs, const float *x, const int32_t *rows, int M, int H)
{
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < M; r++) {
        const float *src = x + (size_t)rows[r] * H;
        float *dst = xs + (size_t)r * H;
        for (int h = 0; h < H; h++) dst[h] = src[h];
    }
}

void op_moe_combine(float *out, const float *ys, const float *wts, const int32_t *slot, int N, int k, int H)
{
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *o = out + (size_t)t * H;
        for (int h = 0; h < H; h++) o[h] = 0.0f;
        for (int j = 0; j < k; j++) {
            const float w = wts[(size_t)t * k + j], *y = ys + (size_t)slot[(size_t)t * k + j] * H;
            for (int h = 0; h < H; h++) o[h] += w * y[h];
        }
    }
}

void op_moe_combine_backward(float *dys, float *dwts, const float *dout, const float *ys, const float *wts,
                             const int32_t *slot, int N, int k, int H)
{
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float *g = dout + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const size_t tj = (size_t)t * k + j, r = (size_t)slot[tj] * H;
            const float w = wts[tj], *y = ys + r;
            float *dy = dys + r, dot = 0.0f;
            for (int h = 0; h < H; h++) {
                dy[h] = w * g[h];
                dot += g[h] * y[h];
            }
            dwts[tj] = dot;
        }
    }
}

void op_moe_scatter_add(float *dx, const float *dxs, const int32_t *slot, int N, int k, int H)
{
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *d = dx + (size_t)t * H;
        const int32_t *sl = slot + (size_t)t * k;
        for (int h = 0; h < H; h++) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s += dxs[(size_t)sl[j] * H + h];
            d[h] += s;
        }
    }
}

void op_moe_group(int32_t *off, int32_t *rows, int32_t *slot, const int32_t *idx, int N, int k, int E)
{
    const int Nk = N * k;
    for (int e = 0; e <= E; e++) off[e] = 0;
    for (int p = 0; p < Nk; p++) off[idx[p] + 1]++;
    for (int e = 0; e < E; e++) off[e + 1] += off[e];
    /* off[e] is expert e's next free row while placing: after it, expert e's end, which
     * the shift below turns back into the starts */
    for (int p = 0; p < Nk; p++) { /* p = t*k + j, in token order */
        const int r = off[idx[p]]++;
        rows[r] = p / k;
        slot[p] = r;
    }
    for (int e = E; e > 0; e--) off[e] = off[e - 1];
    off[0] = 0;
}

void op_moe_prob_sums(double *sums, const float *probs, int N, int E)
{
    for (int e = 0; e < E; e++) sums[e] = 0.0;
    for (int t = 0; t < N; t++)
        for (int e = 0; e < E; e++) sums[e] += probs[(size_t)t * E + e];
}
