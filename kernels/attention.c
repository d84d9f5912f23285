/* kernels/attention.c: causal grouped-query attention with log-sum-exp, its
 * backward for one (q-block, kv-block) pair, and the log-sum-exp merge
 * (portable C).
 *
 * Blocked as flash attention is: a tile of QT queries against a tile of KT keys at a
 * time, an online softmax per tile, and tiles that no (query, key) pair of can see
 * (causal, window, documents) skipped whole. Each tile product is one small GEMM on
 * the tensors in place (tile_gemm.c, register-blocked; B's rows read as they lie,
 * which is why the products are arranged so that no B is transposed). No score
 * matrix: a task's scratch is two QT x KT tiles and its query tile transposed (q; the
 * backward's dout too, and q, dout, dq packed: 64 KiB each; the forward's out rows
 * packed, 8 KiB) on its stack, and in the backward a run of keys' k, v, dk and dv rows
 * packed, up to 4 MiB a running task (malloc; where that fails, the rows are used in
 * place, with the same results). The exp is a polynomial the compiler vectorizes
 * (smp_expf_shifted, simd.h). Layouts: q/out [B, Tq, nh, hd], k/v [B, Tk, nkv, hd],
 * lse [B, nh, Tq].
 *
 * Bit-identical across thread counts: every output row is summed by one task in a
 * fixed order over the other side's tiles (forward: a query tile; backward: a whole
 * kv head, or, with fewer heads than the threads can share, a query tile for dq and
 * a key tile for dk/dv, adding in the same order); the threads only pick which tasks
 * they run. */
/* the softmax's exps (smp_expf_shifted) as FMAs in the AVX2 and AVX-512 variants,
 * as the tile products already are: results differ from the SSE variant's in the last
 * bits, not between thread counts. Before simd.h, so that the exps themselves are defined
 * under it, not only the functions it is inlined into. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#endif

#include "ops.h"
#include "simd.h"
#include "tile_gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef SMP_NO_BLAS
#include <cblas.h>
#endif

/* queries x keys per tile: the score tiles stay in L1; KT is the row loops' fixed
 * trip count, so the compiler vectorizes them without an epilogue */
enum { QT = 64, KT = 64 };
/* the largest head dim whose query tile the forward transposes on its stack (64 KiB) */
enum { QT_HD_MAX = 256 };
/* the largest whose out rows it adds up packed: St, Qt and those rows fill L1's 32 KiB
 * (Zen 2, 2 threads, 4096 tokens, forward: hd 32 93 -> 86 ms packed; hd 64 143 -> 147;
 * at 256 tokens, hd 32, 4.6 -> 4.9 ms, so only from 8 key tiles on) */
enum { O_HD_MAX = 32 };

typedef struct { int32_t lo, hi; } range;

/* One call's shape; row_at gives the offset of row t of head h of batch b in a
 * [B, T, heads, hd] tensor. */
typedef struct {
    int B, Tq, Tk, nh, nkv, hd, window;
    int group;   /* nh / nkv: query head h reads kv head h / group */
    float scale; /* 1 / sqrt(hd) */
    const int32_t *qpos, *kpos;
    const int32_t *qdoc, *kdoc; /* [B, Tq], [B, Tk], or NULL: one document */
    /* each tile's range of positions (qr, kr) and documents (qdr, kdr: [B][tiles]), made
     * once a call (shape_ranges): the tasks ask of every (query tile, key tile) pair,
     * half of them out of sight, whether it sees anything. NULL: taken from the rows. */
    range *qr, *kr, *qdr, *kdr;
} attn_shape;

static attn_shape shape_of(const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                           const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv,
                           int hd, int window)
{
    attn_shape s = {B, Tq, Tk, nh, nkv, hd, window, nh / nkv, 1.0f / sqrtf((float)hd),
                    qpos, kpos, qdoc, kdoc, NULL, NULL, NULL, NULL};
    return s;
}

static inline size_t row_at(const attn_shape *s, int b, int T, int t, int heads, int h)
{
    return (((size_t)b * T + t) * heads + h) * s->hd;
}

static inline int imin(int a, int b) { return a < b ? a : b; }

/* ---- which tiles to compute -------------------------------------------------------- */

static range range_of(const int32_t *x, int n)
{
    range r = {x[0], x[0]};
    for (int t = 1; t < n; t++) {
        r.lo = x[t] < r.lo ? x[t] : r.lo;
        r.hi = x[t] > r.hi ? x[t] : r.hi;
    }
    return r;
}

/* x's rows [start, start + n), a tile of `step` rows: from the table where there is one */
static range tile_range(const range *tab, const int32_t *x, int start, int n, int step)
{
    return tab && start % step == 0 ? tab[start / step] : range_of(x + start, n);
}

/* tab[b * tiles + i] = the range of x's row tile i in sequence b (x: [B, T]) */
static void ranges_fill(range *tab, const int32_t *x, int B, int T, int step)
{
    const int tiles = (T + step - 1) / step;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < tiles; i++)
            tab[(size_t)b * tiles + i] = range_of(x + (size_t)b * T + i * step, imin(step, T - i * step));
}

/* s's tables (one block, freed by shape_ranges_free); none where malloc fails */
static void shape_ranges(attn_shape *s)
{
    const int nq = (s->Tq + QT - 1) / QT, nk = (s->Tk + KT - 1) / KT, docs = s->qdoc != NULL;
    range *tab = malloc((size_t)(nq + nk) * (1 + (docs ? s->B : 0)) * sizeof(range));
    if (!tab)
        return;
    s->qr = tab, s->kr = tab + nq;
    ranges_fill(s->qr, s->qpos, 1, s->Tq, QT);
    ranges_fill(s->kr, s->kpos, 1, s->Tk, KT);
    if (docs) {
        s->qdr = s->kr + nk, s->kdr = s->qdr + (size_t)s->B * nq;
        ranges_fill(s->qdr, s->qdoc, s->B, s->Tq, QT);
        ranges_fill(s->kdr, s->kdoc, s->B, s->Tk, KT);
    }
}

static void shape_ranges_free(attn_shape *s)
{
    free(s->qr);
}

/* A tile of queries [i0, i0 + ni) x keys [j0, j0 + nj) */
typedef struct { int b, i0, ni, j0, nj; } tile;
enum { SEES_NONE, SEES_SOME, SEES_ALL };

/* From the tile's position and document ranges alone: can no pair meet, or every
 * pair? (positions need not be sorted: ranges bound them either way) */
static int tile_sees(const attn_shape *s, const tile *t)
{
    const range qp = tile_range(s->qr, s->qpos, t->i0, t->ni, QT);
    const range kp = tile_range(s->kr, s->kpos, t->j0, t->nj, KT);
    const int w = s->window;
    if (kp.lo > qp.hi || (w > 0 && (int64_t)qp.lo - kp.hi >= w))
        return SEES_NONE;
    int all = kp.hi <= qp.lo && (w <= 0 || (int64_t)qp.hi - kp.lo < w);
    if (s->qdoc) {
        const int nq = (s->Tq + QT - 1) / QT, nk = (s->Tk + KT - 1) / KT;
        const range qd = tile_range(s->qdr ? s->qdr + (size_t)t->b * nq : NULL,
                                    s->qdoc + (size_t)t->b * s->Tq, t->i0, t->ni, QT);
        const range kd = tile_range(s->kdr ? s->kdr + (size_t)t->b * nk : NULL,
                                    s->kdoc + (size_t)t->b * s->Tk, t->j0, t->nj, KT);
        if (qd.hi < kd.lo || kd.hi < qd.lo)
            return SEES_NONE;
        all = all && qd.lo == qd.hi && kd.lo == kd.hi;
    }
    return all ? SEES_ALL : SEES_SOME;
}

/* Moves t on, from its current start on one side (keys, or queries), to the next tile
 * that starts before `end` and that some pair of can see: its class, or SEES_NONE */
static int next_tile_before(const attn_shape *s, tile *t, int keys, int end)
{
    int *start = keys ? &t->j0 : &t->i0, *n = keys ? &t->nj : &t->ni;
    const int T = keys ? s->Tk : s->Tq, step = keys ? KT : QT;
    for (; *start < end; *start += step) {
        *n = imin(step, T - *start);
        const int sees = tile_sees(s, t);
        if (sees != SEES_NONE)
            return sees;
    }
    return SEES_NONE;
}

/* ... to the end of that side */
static int next_tile(const attn_shape *s, tile *t, int keys)
{
    return next_tile_before(s, t, keys, keys ? s->Tk : s->Tq);
}

/* -inf in St [KT][QT] (keys as rows) where key j is hidden from query i (key j is
 * visible from query i when kpos <= qpos, within the window, in the same document), a
 * vector of queries at a time (the scalar form, a test per score, was 40% of the
 * backward's tile_probs at 8 x 256), and in the lanes past the tile's queries; rows past
 * its keys untouched. qpos - kpos in unsigned arithmetic: exact where kpos <= qpos,
 * whatever the positions. */
SMP_SIMD_CLONES static void mask_tile(const attn_shape *s, const tile *t, int sees, float *St)
{
    const int32_t *qp = s->qpos + t->i0;
    const int32_t *qd = s->qdoc ? s->qdoc + (size_t)t->b * s->Tq + t->i0 : NULL;
    const uint32_t span = s->window > 0 ? (uint32_t)s->window - 1u : UINT32_MAX; /* most qp - kp seen */
    for (int r = 0; r < t->nj; r++) {
        float *row = St + (size_t)r * QT;
        for (int c = t->ni; c < QT; c++)
            row[c] = -INFINITY;
        if (sees == SEES_ALL)
            continue;
        const int32_t kp = s->kpos[t->j0 + r];
        if (qd) {
            const int32_t doc = s->kdoc[(size_t)t->b * s->Tk + t->j0 + r];
            #pragma omp simd
            for (int c = 0; c < t->ni; c++)
                row[c] = kp <= qp[c] && (uint32_t)qp[c] - (uint32_t)kp <= span && qd[c] == doc ? row[c] : -INFINITY;
        } else {
            #pragma omp simd
            for (int c = 0; c < t->ni; c++)
                row[c] = kp <= qp[c] && (uint32_t)qp[c] - (uint32_t)kp <= span ? row[c] : -INFINITY;
        }
    }
}

/* ---- tile arithmetic --------------------------------------------------------------- */

/* C[M][N] = alpha op(A) B + beta C, op(A) = A or A^T (ta), beta 0 or 1: the
 * register-blocked tile product (tile_gemm.c; OpenBLAS's packing path ran these 2x
 * slower on AVX2); B^T (tb) only in the hd > QT_HD_MAX forward, through BLAS */
static void gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A,
                 size_t lda, const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    if (!tb) {
        smp_tile_gemm(M, N, K, alpha, A, ta ? 1 : lda, ta ? lda : 1, B, ldb, beta, C, ldc);
        return;
    }
#ifndef SMP_NO_BLAS
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, CblasTrans,
                M, N, K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
#else
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc += (ta ? A[k * lda + i] : A[i * lda + k]) * B[j * ldb + k];
            float *c = C + i * ldc + j;
            *c = beta == 0.0f ? alpha * acc : *c + alpha * acc;
        }
    }
#endif
}

/* parallel over (b, head, tile) triples; causal tasks are unequal, so dynamic */
typedef void (*task_fn)(const attn_shape *s, const void *args, int b, int h, int tile);

static void for_tasks(int B, int heads, int ntiles, task_fn fn, const attn_shape *s,
                      const void *args)
{
    #pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < ntiles; t++)
                fn(s, args, b, h, t);
}

/* Xt [hd][QT] = the tile's rows of X (queries x hd, row stride xs) transposed, lanes past
 * the tile's queries 0: once per query tile, so that the key-major products below are
 * plain (nn) ones */
static void transpose_rows(const attn_shape *s, const tile *t, const float *x, size_t xs, float *Xt)
{
    for (int d = 0; d < s->hd; d++) {
        float *row = Xt + (size_t)d * QT;
        for (int i = 0; i < t->ni; i++)
            row[i] = x[(size_t)i * xs + d];
        for (int i = t->ni; i < QT; i++)
            row[i] = 0.0f;
    }
}

/* n rows of hd floats, `stride` apart */
typedef struct { const float *p; size_t stride; } rows;

/* Rows [0, n) of x (row stride xs) copied together into buf [n][hd], where the scratch
 * holds them (hd <= QT_HD_MAX; else x in place). In place, a tile's rows lie a row of
 * every head apart (512 B and up, a power of two), so they fall on a few of L1's sets
 * and evict each other. */
static rows packed(const attn_shape *s, const float *x, size_t xs, int n, float *buf)
{
    if (s->hd > QT_HD_MAX)
        return (rows){x, xs};
    for (int r = 0; r < n; r++)
        memcpy(buf + (size_t)r * s->hd, x + (size_t)r * xs, (size_t)s->hd * sizeof(float));
    return (rows){buf, (size_t)s->hd};
}

/* packed()'s rows copied back to x, where they were packed */
static void unpack(const attn_shape *s, rows r, float *x, size_t xs, int n)
{
    if (r.p == x)
        return;
    for (int i = 0; i < n; i++)
        memcpy(x + (size_t)i * xs, r.p + (size_t)i * r.stride, (size_t)s->hd * sizeof(float));
}

/* Ct [KT][QT] = alpha Y X^T for the tile's keys (rows of Y, e.g. k or v) and queries (rows
 * of X, e.g. q or dout): from Xt when the caller transposed X (plain: hd <= QT_HD_MAX),
 * else from X itself (X^T as B: BLAS's nt product) */
static void keys_by_queries(const attn_shape *s, const tile *t, float alpha, rows y,
                            const float *x, const float *Xt, float *Ct)
{
    const size_t qs = (size_t)s->nh * s->hd;
    if (Xt)
        gemm(0, 0, t->nj, t->ni, s->hd, alpha, y.p, y.stride, Xt, QT, 0.0f, Ct, QT);
    else
        gemm(0, 1, t->nj, t->ni, s->hd, alpha, y.p, y.stride, x, qs, 0.0f, Ct, QT);
}

/* ---- forward ----------------------------------------------------------------------- */

typedef struct {
    float *out, *lse;
    const float *q, *k, *v;
} fwd_args;

/* The forward works on the TRANSPOSED score tile St [KT][QT] (keys as rows, queries as
 * columns): every per-query reduction (the max, the sum) then runs down the rows, a
 * vector of QT queries at a time, where the row form reduced across each row's lanes
 * (GCC's epilogue of that, through the stack, was 40% of the forward); St comes from
 * K Q^T, and P v from the transposed product P^T^T v. Lanes past the tile's queries
 * hold -inf scores and stay inert (m -inf, l 0). */

/* The online softmax of one key tile: m, l the running max and sum of exp(s - m) per
 * query; the out rows o hold the running sum of p v, rescaled here to the new max.
 * The masked scores St become P^T (0 in queries that have seen nothing yet). */
SMP_SIMD_CLONES static void fwd_softmax(const attn_shape *s, const tile *t, float *St, float *m, float *l,
                                        float *o, size_t os)
{
    float mx[QT], sub[QT], sum[QT];
    for (int i = 0; i < QT; i++)
        mx[i] = m[i], sum[i] = 0.0f;
    for (int j = 0; j < t->nj; j++) {
        const float *row = St + (size_t)j * QT;
        #pragma omp simd
        for (int i = 0; i < QT; i++)
            mx[i] = row[i] > mx[i] ? row[i] : mx[i];
    }
    #pragma omp simd
    for (int i = 0; i < QT; i++) /* nothing visible yet: exp(-inf - 0) = 0 */
        sub[i] = mx[i] == -INFINITY ? 0.0f : mx[i];
    const smp_exp_bounds eb = smp_exp_bounds_opaque();
    for (int j = 0; j < t->nj; j++) {
        float *row = St + (size_t)j * QT;
        #pragma omp simd
        for (int i = 0; i < QT; i++) {
            row[i] = smp_expf_shifted(row[i] - sub[i], eb);
            sum[i] += row[i];
        }
    }
    for (int i = 0; i < t->ni; i++) {
        if (mx[i] > m[i]) { /* new max: rescale what was summed so far (0 at first) */
            const float corr = smp_expf_shifted(m[i] - mx[i], eb);
            l[i] *= corr;
            for (int d = 0; d < s->hd; d++)
                o[i * os + d] *= corr;
            m[i] = mx[i];
        }
        l[i] += sum[i];
    }
}

static void fwd_task(const attn_shape *s, const void *args, int b, int h, int qt)
{
    const fwd_args *a = args;
    const int hd = s->hd, kvh = h / s->group;
    const size_t qs = (size_t)s->nh * hd, ks = (size_t)s->nkv * hd;
    tile t = {b, qt * QT, imin(QT, s->Tq - qt * QT), 0, 0};
    const size_t q0 = row_at(s, b, s->Tq, t.i0, s->nh, h);
    float St[KT * QT], m[QT], l[QT], Qt[QT_HD_MAX * QT], Op[QT * O_HD_MAX];
    for (int i = 0; i < QT; i++)
        m[i] = -INFINITY, l[i] = 0.0f;
    /* the tile's out rows add up packed where St, Qt and they fit L1's 32 KiB (hd <=
     * O_HD_MAX) and there are 8 key tiles or more (in place they lie a row of every head
     * apart and evict each other), then go out scaled */
    const rows orow = hd <= O_HD_MAX && s->Tk >= 8 * KT ? (rows){Op, (size_t)hd} : (rows){a->out + q0, qs};
    float *o = (float *)orow.p;
    for (int i = 0; i < t.ni; i++)
        memset(o + i * orow.stride, 0, (size_t)hd * sizeof(float));
    const float *tq = hd <= QT_HD_MAX ? Qt : NULL; /* the tile's queries transposed once */
    if (tq)
        transpose_rows(s, &t, a->q + q0, qs, Qt);
    for (int sees; (sees = next_tile(s, &t, 1)) != SEES_NONE; t.j0 += KT) {
        const size_t kv0 = row_at(s, b, s->Tk, t.j0, s->nkv, kvh);
        keys_by_queries(s, &t, s->scale, (rows){a->k + kv0, ks}, a->q + q0, tq, St);
        mask_tile(s, &t, sees, St);
        fwd_softmax(s, &t, St, m, l, o, orow.stride);
        gemm(1, 0, t.ni, hd, t.nj, 1.0f, St, QT, a->v + kv0, ks, 1.0f, o, orow.stride); /* o += P v */
    }
    for (int i = 0; i < t.ni; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f; /* nothing visible: out 0 */
        float *out = a->out + q0 + i * qs;
        for (int d = 0; d < hd; d++)
            out[d] = o[i * orow.stride + d] * inv;
        a->lse[((size_t)b * s->nh + h) * s->Tq + t.i0 + i] =
            l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
    }
}

void op_attention_forward(float *out, float *lse, const float *q, const float *k,
                          const float *v, const int32_t *qpos, const int32_t *kpos,
                          const int32_t *qdoc, const int32_t *kdoc,
                          int B, int Tq, int Tk, int nh, int nkv, int hd, int window)
{
    attn_shape s = shape_of(qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
    shape_ranges(&s);
    const fwd_args a = {out, lse, q, k, v};
    for_tasks(B, nh, (Tq + QT - 1) / QT, fwd_task, &s, &a);
    shape_ranges_free(&s);
}

/* ---- backward ---------------------------------------------------------------------- */

typedef struct {
    float *dq, *dk, *dv;
    const float *dout, *q, *k, *v, *out, *lse;
} bwd_args;

/* With P = exp(S - lse) (the softmax of the FINAL, merged row, so each kv block's
 * share is exact on its own) and D_i = dout_i . out_i = sum_j P_ij dP_ij:
 *   dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i)
 * The backward works key-major, as the forward does: Pt, dSt [KT][QT] (keys as rows),
 * from K Q^T and V dout^T against the query tile's q and dout transposed once (plain
 * products), so that dv += Pt dout and dk += scale dSt q are plain products too and
 * only dq += scale dSt^T k has a transposed A (broadcast through strides: no cost in
 * tile_gemm; the query-major form needed B^T in two products per tile). */

/* A query tile's side of the backward: its rows' lse, D_i = dout_i . out_i (once per
 * query tile, not per key tile), and q, dout transposed (NULL: hd > QT_HD_MAX). Rows
 * with lse = -inf saw no key anywhere: subtracting +inf makes their P and dS 0; so do
 * the lanes past the tile's queries. */
typedef struct {
    float L[QT], D[QT];
    const float *qt, *dot;
    rows qr, dor;     /* q, dout packed (packed(): the B of dk's and dv's products) */
    float *dq;        /* where the tile's dq rows add up: dQp (dq_open), or dq in place */
    size_t dqs;
    float Qt[QT_HD_MAX * QT], dOt[QT_HD_MAX * QT], Qp[QT * QT_HD_MAX], dOp[QT * QT_HD_MAX],
        dQp[QT * QT_HD_MAX];
} qside;

static void qside_of(const attn_shape *s, const bwd_args *a, const tile *t, int h, size_t q0, qside *q)
{
    const size_t qs = (size_t)s->nh * s->hd;
    for (int i = 0; i < QT; i++)
        q->L[i] = INFINITY, q->D[i] = 0.0f;
    for (int i = 0; i < t->ni; i++) {
        const float L = a->lse[((size_t)t->b * s->nh + h) * s->Tq + t->i0 + i];
        const float *g = a->dout + q0 + i * qs, *o = a->out + q0 + i * qs;
        float acc = 0.0f;
        for (int d = 0; d < s->hd; d++)
            acc += g[d] * o[d];
        q->L[i] = L == -INFINITY ? INFINITY : L, q->D[i] = acc;
    }
    q->qr = packed(s, a->q + q0, qs, t->ni, q->Qp);
    q->dor = packed(s, a->dout + q0, qs, t->ni, q->dOp);
    q->qt = q->dot = NULL;
    if (s->hd <= QT_HD_MAX) { /* from the packed rows (in place, the column-wise reads of
                                 * rows a row of every head apart missed L1: 8 x 256
                                 * backward 8.9 -> 8.6 ms this way) */
        transpose_rows(s, t, q->qr.p, q->qr.stride, q->Qt);
        transpose_rows(s, t, q->dor.p, q->dor.stride, q->dOt);
        q->qt = q->Qt, q->dot = q->dOt;
    }
}

/* A run of keys of one kv head, the key tiles of a task's inner loops: their k and v
 * rows (read by every query tile) and dk, dv rows (added to) packed, as q's and dq's
 * are, in a buffer of the task's (4 parts: k, v, dk, dv), or in place where it could not
 * be had (the same bits either way) */
enum { KV_RUN_FLOATS = 1 << 20 }; /* 4 MiB a task at most */
typedef struct {
    float *buf;  /* the parts, or NULL: rows in place */
    size_t part; /* floats a part */
    int k0, n;   /* the run's keys [k0, k0 + n) */
    size_t kv0;  /* offset of row k0 of the task's kv head */
    rows k, v, dk, dv; /* row 0: key k0 */
} kside;

/* keys a run of the one-pass form holds: whole key tiles, as many as KV_RUN_FLOATS
 * holds, all keys at most. Each run makes its query tiles' qside again, so the longer
 * the better (Zen 2, 2 threads, 4096 tokens, backward at hd 32: runs of 512 keys 185 ms,
 * 1024 171, 2048 164; at hd 128, runs of 128 keys were slower than none) */
static int kside_keys(const attn_shape *s)
{
    const int n = s->hd > 0 ? KV_RUN_FLOATS / 4 / s->hd / KT * KT : s->Tk; /* hd 0: nothing to pack */
    return n < KT ? KT : n < s->Tk ? n : s->Tk;
}

static void kside_init(const attn_shape *s, int keys, kside *ks)
{
    ks->part = (size_t)keys * s->hd;
    ks->buf = s->hd <= QT_HD_MAX ? malloc(4 * ks->part * sizeof(float)) : NULL;
}

/* part i's rows: x's n rows packed, or x in place */
static rows kv_rows(const attn_shape *s, const kside *ks, int i, const float *x, size_t xs, int n)
{
    return ks->buf ? packed(s, x, xs, n, ks->buf + i * ks->part) : (rows){x, xs};
}

static void kside_open(const attn_shape *s, const bwd_args *a, int b, int g, int k0, int n, kside *ks)
{
    const size_t stride = (size_t)s->nkv * s->hd;
    ks->k0 = k0, ks->n = n, ks->kv0 = row_at(s, b, s->Tk, k0, s->nkv, g);
    ks->k = kv_rows(s, ks, 0, a->k + ks->kv0, stride, n);
    ks->v = kv_rows(s, ks, 1, a->v + ks->kv0, stride, n);
    ks->dk = kv_rows(s, ks, 2, a->dk + ks->kv0, stride, n);
    ks->dv = kv_rows(s, ks, 3, a->dv + ks->kv0, stride, n);
}

static void kside_close(const attn_shape *s, const bwd_args *a, const kside *ks)
{
    const size_t stride = (size_t)s->nkv * s->hd;
    unpack(s, ks->dk, a->dk + ks->kv0, stride, ks->n);
    unpack(s, ks->dv, a->dv + ks->kv0, stride, ks->n);
}

/* Pt and dSt of the tile (rows past its keys untouched, lanes past its queries 0), from
 * its keys' rows k and v */
SMP_SIMD_CLONES static void tile_probs(const attn_shape *s, const bwd_args *a, const tile *t, int sees,
                                       size_t q0, rows k, rows v, const qside *q, float *Pt, float *dSt)
{
    keys_by_queries(s, t, s->scale, k, a->q + q0, q->qt, Pt);
    mask_tile(s, t, sees, Pt);
    keys_by_queries(s, t, 1.0f, v, a->dout + q0, q->dot, dSt);
    const smp_exp_bounds eb = smp_exp_bounds_opaque();
    for (int j = 0; j < t->nj; j++) {
        float *p = Pt + (size_t)j * QT, *ds = dSt + (size_t)j * QT;
        #pragma omp simd
        for (int i = 0; i < QT; i++) {
            p[i] = smp_expf_shifted(p[i] - q->L[i], eb);
            ds[i] = i < t->ni ? p[i] * (ds[i] - q->D[i]) : 0.0f;
        }
    }
}

/* The tile's dq rows, packed as q's are while the key tiles add to them (copied in and
 * back out: the same sums in the same order) */
static void dq_open(const attn_shape *s, const bwd_args *a, const tile *t, size_t q0, qside *q)
{
    const size_t qs = (size_t)s->nh * s->hd;
    const rows r = packed(s, a->dq + q0, qs, t->ni, q->dQp);
    q->dq = (float *)r.p, q->dqs = r.stride;
}

static void dq_close(const attn_shape *s, const bwd_args *a, const tile *t, size_t q0, const qside *q)
{
    unpack(s, (rows){q->dq, q->dqs}, a->dq + q0, (size_t)s->nh * s->hd, t->ni);
}

/* dq_i += scale sum_j dS_ij k_j for the tile's queries, from its keys' rows k */
static void add_dq(const attn_shape *s, const tile *t, qside *q, rows k, const float *dSt)
{
    gemm(1, 0, t->ni, s->hd, t->nj, s->scale, dSt, QT, k.p, k.stride, 1.0f, q->dq, q->dqs);
}

/* rows r from row j on */
static inline rows rows_from(rows r, int j) { return (rows){r.p + (size_t)j * r.stride, r.stride}; }

/* dk_j += scale sum_i dS_ij q_i, dv_j += sum_i P_ij dout_i for the tile's keys (rows of
 * the run ks) */
static void add_dkv(const attn_shape *s, const tile *t, const qside *q, const kside *ks, const float *Pt,
                    const float *dSt)
{
    const rows dk = rows_from(ks->dk, t->j0 - ks->k0), dv = rows_from(ks->dv, t->j0 - ks->k0);
    gemm(0, 0, t->nj, s->hd, t->ni, s->scale, dSt, QT, q->qr.p, q->qr.stride, 1.0f, (float *)dk.p, dk.stride);
    gemm(0, 0, t->nj, s->hd, t->ni, 1.0f, Pt, QT, q->dor.p, q->dor.stride, 1.0f, (float *)dv.p, dv.stride);
}

/* Two-pass form, one: dq of a query tile, over the key tiles in order */
static void dq_task(const attn_shape *s, const void *args, int b, int h, int qt)
{
    const bwd_args *a = args;
    tile t = {b, qt * QT, imin(QT, s->Tq - qt * QT), 0, 0};
    const size_t q0 = row_at(s, b, s->Tq, t.i0, s->nh, h);
    float Pt[KT * QT], dSt[KT * QT];
    qside q;
    qside_of(s, a, &t, h, q0, &q);
    dq_open(s, a, &t, q0, &q);
    for (int sees; (sees = next_tile(s, &t, 1)) != SEES_NONE; t.j0 += KT) {
        const size_t kv0 = row_at(s, b, s->Tk, t.j0, s->nkv, h / s->group), ks = (size_t)s->nkv * s->hd;
        const rows k = {a->k + kv0, ks};
        tile_probs(s, a, &t, sees, q0, k, (rows){a->v + kv0, ks}, &q, Pt, dSt);
        add_dq(s, &t, &q, k, dSt);
    }
    dq_close(s, a, &t, q0, &q);
}

/* Two-pass form, two: dk, dv of a key tile, over the group's heads and their query
 * tiles in order */
static void dkv_task(const attn_shape *s, const void *args, int b, int g, int kt)
{
    const bwd_args *a = args;
    tile t = {b, 0, 0, kt * KT, imin(KT, s->Tk - kt * KT)};
    float Pt[KT * QT], dSt[KT * QT];
    qside q;
    kside ks;
    kside_init(s, KT, &ks);
    kside_open(s, a, b, g, t.j0, t.nj, &ks);
    for (int h = g * s->group; h < (g + 1) * s->group; h++) {
        t.i0 = 0;
        for (int sees; (sees = next_tile(s, &t, 0)) != SEES_NONE; t.i0 += QT) {
            const size_t q0 = row_at(s, b, s->Tq, t.i0, s->nh, h);
            qside_of(s, a, &t, h, q0, &q);
            tile_probs(s, a, &t, sees, q0, ks.k, ks.v, &q, Pt, dSt);
            add_dkv(s, &t, &q, &ks, Pt, dSt);
        }
    }
    kside_close(s, a, &ks);
    free(ks.buf);
}

/* One-pass form: a whole kv head g of sequence b, P and dS computed once per tile. Its
 * task owns dk, dv of g and dq of the group's heads. It takes the keys a run at a time
 * (kside: their k, v, dk, dv rows packed; in place they lie a row of every kv head apart
 * and evict each other), and in each run the group's query heads, their query tiles, then
 * the run's key tiles, in order: every row adds its tiles in the order of the two-pass
 * form (dq's over the runs' key tiles in turn), so the bits are the same. */
static void bwd_head_task(const attn_shape *s, const void *args, int b, int g, int unused)
{
    const bwd_args *a = args;
    float Pt[KT * QT], dSt[KT * QT];
    qside q;
    kside ks;
    const int keys = kside_keys(s);
    kside_init(s, keys, &ks);
    const int run = ks.buf ? keys : s->Tk; /* in place, runs would only cost */
    for (int k0 = 0; k0 < s->Tk; k0 += run) {
        const int k1 = imin(k0 + run, s->Tk);
        kside_open(s, a, b, g, k0, k1 - k0, &ks);
        for (int h = g * s->group; h < (g + 1) * s->group; h++) {
            for (int i0 = 0; i0 < s->Tq; i0 += QT) {
                tile t = {b, i0, imin(QT, s->Tq - i0), k0, 0};
                int sees = next_tile_before(s, &t, 1, k1);
                if (sees == SEES_NONE) /* no key of the run: no qside to make */
                    continue;
                const size_t q0 = row_at(s, b, s->Tq, t.i0, s->nh, h);
                qside_of(s, a, &t, h, q0, &q);
                dq_open(s, a, &t, q0, &q);
                for (; sees != SEES_NONE; t.j0 += KT, sees = next_tile_before(s, &t, 1, k1)) {
                    const rows k = rows_from(ks.k, t.j0 - k0), v = rows_from(ks.v, t.j0 - k0);
                    tile_probs(s, a, &t, sees, q0, k, v, &q, Pt, dSt);
                    add_dq(s, &t, &q, k, dSt);
                    add_dkv(s, &t, &q, &ks, Pt, dSt);
                }
                dq_close(s, a, &t, q0, &q);
            }
        }
        kside_close(s, a, &ks);
    }
    free(ks.buf);
}

static int omp_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* One pass computes each tile's P and dS once (the two-pass form twice), but has only
 * B * nkv tasks: taken when they spread evenly over the threads. Both forms give the
 * same bits, so the choice (by thread count) changes no result. */
void op_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                           const float *q, const float *k, const float *v,
                           const float *out, const float *lse,
                           const int32_t *qpos, const int32_t *kpos,
                           const int32_t *qdoc, const int32_t *kdoc,
                           int B, int Tq, int Tk, int nh, int nkv, int hd, int window)
{
    attn_shape s = shape_of(qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window);
    shape_ranges(&s);
    const bwd_args a = {dq, dk, dv, dout, q, k, v, out, lse};
    const int tasks = B * nkv, threads = omp_threads();
    if (tasks % threads == 0 || tasks >= 4 * threads) {
        for_tasks(B, nkv, 1, bwd_head_task, &s, &a);
    } else {
        for_tasks(B, nh, (Tq + QT - 1) / QT, dq_task, &s, &a);
        for_tasks(B, nkv, (Tk + KT - 1) / KT, dkv_task, &s, &a);
    }
    shape_ranges_free(&s);
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
