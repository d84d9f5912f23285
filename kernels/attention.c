/* kernels/attention.c: causal grouped-query attention with log-sum-exp, its
 * backward for one (q-block, kv-block) pair, and the log-sum-exp merge
 * (portable C).
 *
 * Straightforward loops, one query row at a time, with an online softmax over the
 * keys (as flash attention does): no score matrix and no scratch, so no op here
 * allocates. Layouts: q/out [B, Tq, nh, hd], k/v [B, Tk, nkv, hd], lse [B, nh, Tq]. */
#include "ops.h"

#include <math.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n)
{
    float s = 0.0f;
    /* lets the compiler reassociate the sum into vector lanes (~4x faster) */
    #pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++)
        s += a[d] * b[d];
    return s;
}

/* One call's shape; row_at gives the offset of row t of head h of batch b in a
 * [B, T, heads, hd] tensor. */
typedef struct {
    int B, Tq, Tk, nh, nkv, hd, window;
    int group;   /* nh / nkv: query head h reads kv head h / group */
    float scale; /* 1 / sqrt(hd) */
    const int32_t *qpos, *kpos;
    const int32_t *qdoc, *kdoc; /* [B, Tq], [B, Tk], or NULL: one document */
} attn_shape;

static attn_shape shape_of(const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                           const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv,
                           int hd, int window)
{
    attn_shape s = {B, Tq, Tk, nh, nkv, hd, window, nh / nkv, 1.0f / sqrtf((float)hd),
                    qpos, kpos, qdoc, kdoc};
    return s;
}

/* Key j is visible from query i of sequence b: causal, in the window, same document. */
static inline int visible(const attn_shape *s, int b, int i, int j)
{
    const int32_t qp = s->qpos[i], kp = s->kpos[j];
    if (s->qdoc && s->qdoc[(size_t)b * s->Tq + i] != s->kdoc[(size_t)b * s->Tk + j])
        return 0;
    return kp <= qp && (s->window <= 0 || (int64_t)qp - kp < s->window);
}

static inline size_t row_at(const attn_shape *s, int b, int T, int t, int heads, int h)
{
    return (((size_t)b * T + t) * heads + h) * s->hd;
}

/* row(s, args, b, h, i) for every query row (b, h, i), in parallel: causal rows have
 * unequal work, dynamic chunks keep the threads even. The forward and the backward's
 * dq pass are such walks. */
typedef void (*query_row_fn)(const attn_shape *s, const void *args, int b, int h, int i);

static void for_query_rows(const attn_shape *s, query_row_fn row, const void *args)
{
    const int B = s->B, nh = s->nh, Tq = s->Tq;
    #pragma omp parallel for collapse(3) schedule(dynamic, 16)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < Tq; i++)
                row(s, args, b, h, i);
}

typedef struct {
    float *out, *lse;
    const float *q, *k, *v;
} fwd_args;

static void fwd_row(const attn_shape *s, const void *args, int b, int h, int i)
{
    const fwd_args *a = args;
    const int hd = s->hd;
    const float *qi = a->q + row_at(s, b, s->Tq, i, s->nh, h);
    float *o = a->out + row_at(s, b, s->Tq, i, s->nh, h);
    const int kvh = h / s->group;
    float m = -INFINITY, l = 0.0f; /* running max and sum of exp(s - m) */
    memset(o, 0, (size_t)hd * sizeof(float)); /* o holds sum p * v */
    for (int j = 0; j < s->Tk; j++) {
        if (!visible(s, b, i, j))
            continue;
        const size_t kvoff = row_at(s, b, s->Tk, j, s->nkv, kvh);
        float sc = dot(qi, a->k + kvoff, hd) * s->scale;
        if (sc > m) { /* new max: rescale what was summed so far */
            float corr = expf(m - sc); /* 0 on the first visible key */
            l *= corr;
            for (int d = 0; d < hd; d++)
                o[d] *= corr;
            m = sc;
        }
        float p = expf(sc - m);
        l += p;
        const float *vj = a->v + kvoff;
        #pragma omp simd
        for (int d = 0; d < hd; d++)
            o[d] += p * vj[d];
    }
    float *L = a->lse + ((size_t)b * s->nh + h) * s->Tq + i;
    if (l > 0.0f) {
        float inv = 1.0f / l;
        for (int d = 0; d < hd; d++)
            o[d] *= inv;
        *L = m + logf(l);
    } else {
        *L = -INFINITY; /* nothing visible: out stays 0 */
    }
}

void op_attention_forward(float *out, float *lse, const float *q, const float *k,
                          const float *v, const int32_t *qpos, const int32_t *kpos,
                          const int32_t *qdoc, const int32_t *kdoc,
                          int B, int Tq, int Tk, int nh, int nkv, int hd, int window)
{
    const attn_shape s = shape_of(qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
    const fwd_args a = {out, lse, q, k, v};
    for_query_rows(&s, fwd_row, &a);
}

typedef struct {
    float *dq;
    const float *dout, *q, *k, *v, *out, *lse;
} bwd_args;

static void dq_row(const attn_shape *s, const void *args, int b, int h, int i)
{
    const bwd_args *a = args;
    const int hd = s->hd;
    const float L = a->lse[((size_t)b * s->nh + h) * s->Tq + i];
    if (L == -INFINITY) /* row saw no key anywhere: no gradient */
        return;
    const size_t qoff = row_at(s, b, s->Tq, i, s->nh, h);
    const float *qi = a->q + qoff, *gi = a->dout + qoff;
    float *dqi = a->dq + qoff;
    const float D = dot(gi, a->out + qoff, hd);
    const int kvh = h / s->group;
    for (int j = 0; j < s->Tk; j++) {
        if (!visible(s, b, i, j))
            continue;
        const size_t kvoff = row_at(s, b, s->Tk, j, s->nkv, kvh);
        float p = expf(dot(qi, a->k + kvoff, hd) * s->scale - L);
        float ds = p * (dot(gi, a->v + kvoff, hd) - D) * s->scale;
        const float *kj = a->k + kvoff;
        #pragma omp simd
        for (int d = 0; d < hd; d++)
            dqi[d] += ds * kj[d];
    }
}

/* With P = exp(S - lse) (the softmax of the FINAL, merged row, so each kv block's
 * share is exact on its own) and D_i = dout_i . out_i = sum_j P_ij dP_ij:
 *   dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i)
 *   dq_i += scale sum_j dS_ij k_j,  dk_j += scale sum_i dS_ij q_i,  dv_j += sum_i P_ij dout_i
 * Two passes, so that every gradient row has one writer and no atomics are needed:
 * one over query rows (dq), one over key rows (dk, dv), recomputing P. */
void op_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                           const float *q, const float *k, const float *v,
                           const float *out, const float *lse,
                           const int32_t *qpos, const int32_t *kpos,
                           const int32_t *qdoc, const int32_t *kdoc,
                           int B, int Tq, int Tk, int nh, int nkv, int hd, int window)
{
    const attn_shape s = shape_of(qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
    const bwd_args a = {dq, dout, q, k, v, out, lse};
    for_query_rows(&s, dq_row, &a);
    const float scale = s.scale;
    const int group = s.group;

    /* keys in blocks of KB, so that D_i is computed once per block, not per key */
    enum { KB = 32 };
    const int nkb = (Tk + KB - 1) / KB;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
        for (int g = 0; g < nkv; g++) {
            for (int jb = 0; jb < nkb; jb++) {
                const int j0 = jb * KB, j1 = j0 + KB < Tk ? j0 + KB : Tk;
                for (int h = g * group; h < (g + 1) * group; h++) {
                    for (int i = 0; i < Tq; i++) {
                        const float L = lse[((size_t)b * nh + h) * Tq + i];
                        if (L == -INFINITY)
                            continue;
                        const size_t qoff = row_at(&s, b, Tq, i, nh, h);
                        const float *qi = q + qoff, *gi = dout + qoff;
                        int have_D = 0;
                        float D = 0.0f;
                        for (int j = j0; j < j1; j++) {
                            if (!visible(&s, b, i, j))
                                continue;
                            if (!have_D) {
                                D = dot(gi, out + qoff, hd);
                                have_D = 1;
                            }
                            const size_t kvoff = row_at(&s, b, Tk, j, nkv, g);
                            float p = expf(dot(qi, k + kvoff, hd) * scale - L);
                            float ds = p * (dot(gi, v + kvoff, hd) - D) * scale;
                            float *dkj = dk + kvoff, *dvj = dv + kvoff;
                            #pragma omp simd
                            for (int d = 0; d < hd; d++) {
                                dkj[d] += ds * qi[d];
                                dvj[d] += p * gi[d];
                            }
                        }
                    }
                }
            }
        }
    }
}

void op_attention_merge(float *out, float *lse, const float *out2, const float *lse2,
                        int B, int T, int nh, int hd)
{
    #pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < nh; h++) {
                float *L1 = lse + ((size_t)b * nh + h) * T + t;
                const float l1 = *L1, l2 = lse2[((size_t)b * nh + h) * T + t];
                float *o = out + (((size_t)b * T + t) * nh + h) * hd;
                const float *o2 = out2 + (((size_t)b * T + t) * nh + h) * hd;
                if (l2 == -INFINITY) /* the other part saw no key: keep ours */
                    continue;
                if (l1 == -INFINITY) {
                    memcpy(o, o2, (size_t)hd * sizeof(float));
                    *L1 = l2;
                    continue;
                }
                /* out = (e^l1 out + e^l2 out2) / (e^l1 + e^l2), shifted by the max */
                const float mx = l1 > l2 ? l1 : l2;
                const float w1 = expf(l1 - mx), w2 = expf(l2 - mx), sum = w1 + w2;
                const float a1 = w1 / sum, a2 = w2 / sum;
                for (int d = 0; d < hd; d++)
                    o[d] = a1 * o[d] + a2 * o2[d];
                *L1 = mx + logf(sum);
            }
        }
    }
}
