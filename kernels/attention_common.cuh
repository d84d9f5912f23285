/* kernels/attention_common.cuh: what the attention kernels share (not public).
 *
 * Contract: kernels/ops.h (op_attention_*), reference: kernels/attention.c.
 * q/out [B,Tq,nh,hd], k/v [B,Tk,nkv,hd], lse [B,nh,Tq]; query head h reads kv
 * head h / (nh/nkv); key j is visible from query i of sequence b when kpos[j] <=
 * qpos[i], (window <= 0 or qpos[i] - kpos[j] < window) and the documents agree,
 * qdoc[b,i] == kdoc[b,j] (no documents, qdoc = kdoc = NULL, reads as document 0).
 *
 * Two implementations, one contract, one file each:
 *  - attention_mma.cu, tensor cores (bf16, hd 32/64/128): FlashAttention-2's scheme
 *    with mma.sync m16n8k16. Forward: a block of 8 warps owns 128 query rows (16 per
 *    warp, Q held in registers; or 4 warps of 16 or 32 rows: SMP_CUDA_ATTN_FWD), walks
 *    the key tiles of 64 (K and V double-buffered in shared memory by cp.async), keeps
 *    the running max and sum per row (online softmax) and the output in fp32
 *    registers; P goes from the accumulators to the next mma's A operand in
 *    registers. Backward, by default (split): two kernels, so that every gradient row
 *    has one writer and nothing needs atomics: one per query tile for dq (recomputing
 *    P and dP), one per key tile for dk and dv (recomputing P^T and dP^T, looping over
 *    the query heads of its kv group). The fused forms (SMP_CUDA_ATTN_BWD) add dq's
 *    parts from the second kernel into an fp32 copy in the scratch with atomics.
 *    Small prep kernels first tabulate, per call, what the tiles consult (each key's
 *    position and document, each 16 tokens' ranges, and for the backward each query
 *    row's lse and D_i = dout_i . out_i): a tile then copies its part with its data
 *    (cp.async) instead of waiting on scattered global loads.
 *  - attention_simt.cu, portable fp32 (any storage dtype, hd <= 256): the same
 *    tiling in plain fp32 arithmetic, one warp per row and one lane per key; used for
 *    fp32 storage (the parity tests against C) and for head sizes the tensor-core
 *    kernels lack. Also the log-sum-exp merge.
 * attention.cu checks the arguments and picks one (the launchers at the end here).
 * Tiles are skipped when no (query, key) pair in them can be visible, from the
 * min/max of the positions and of the document ids in the tile: correct for any
 * positions and ids, and the causal triangle, the sliding-window band and the
 * block diagonal of the documents for sorted ones (context-parallel shards pass
 * their global positions; a shard's two chunks are each sorted, not the pair).
 * No S x S matrix exists.
 *
 * Here: visibility, position ranges, shared-memory layouts, the SIMT tile loads;
 * for the mma kernels the fragment addressing and packing, the tile products, and
 * the double-buffered cp.async tile pipeline. */
#ifndef SMP_KERNELS_ATTENTION_COMMON_CUH
#define SMP_KERNELS_ATTENTION_COMMON_CUH

#include "cuda_common.cuh"

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

/* ------------------------------------------------------------- visibility */
__device__ __forceinline__ bool attn_visible(int qp, int kp, int qd, int kd, int window)
{
    return kp <= qp && qd == kd && (window <= 0 || (long long)qp - kp < window);
}
/* The sequence's row of a [B][T] document-id array (NULL stays NULL: no documents) */
__device__ __forceinline__ const int32_t *doc_row(const int32_t *doc, int b, int T)
{
    return doc ? doc + (size_t)b * T : nullptr;
}
/* a[i] (0 where a is NULL: the one document), `fill` where i >= T */
__device__ __forceinline__ int tok_at(const int32_t *a, int i, int T, int fill)
{
    return i >= T ? fill : a ? a[i] : 0;
}
/* The [min, max] of the positions and of the document ids of a tile's tokens
 * (positions (INT_MAX, INT_MIN) when it has none) */
struct TokRange {
    int pmin, pmax, dmin, dmax;
};
/* No pair (query of q, key of k) can be visible. */
__device__ __forceinline__ bool attn_skip(const TokRange &q, const TokRange &k, int window)
{
    return k.pmin > q.pmax || (window > 0 && (long long)q.pmin - k.pmax >= window) || k.dmin > q.dmax ||
           k.dmax < q.dmin;
}
/* Every pair is visible: one and the same document on both sides. */
__device__ __forceinline__ bool attn_full(const TokRange &q, const TokRange &k, int window)
{
    return k.pmax <= q.pmin && (window <= 0 || (long long)q.pmax - k.pmin < window) && q.dmin == q.dmax &&
           k.dmin == k.dmax && q.dmin == k.dmin;
}
/* min and max of a[i0 .. i0+n) restricted to i < T, over a warp (n <= 64);
 * (INT_MAX, INT_MIN) when empty. */
__device__ __forceinline__ void warp_int_range(const int32_t *a, int i0, int n, int T, int &amin, int &amax)
{
    const int lane = threadIdx.x & 31;
    int mn = INT_MAX, mx = INT_MIN;
    for (int r = lane; r < n; r += 32) {
        int i = i0 + r;
        if (i < T) {
            int p = a[i];
            mn = imin(mn, p);
            mx = imax(mx, p);
        }
    }
    amin = warp_min_i(mn);
    amax = warp_max_i(mx);
}
/* The TokRange of tokens [i0, i0+n) (< T) of positions pos and documents doc (a
 * sequence's row, or NULL: [0, 0]), over a warp */
__device__ __forceinline__ TokRange warp_tok_range(const int32_t *pos, const int32_t *doc, int i0, int n, int T)
{
    TokRange r = {0, 0, 0, 0};
    warp_int_range(pos, i0, n, T, r.pmin, r.pmax);
    if (doc) warp_int_range(doc, i0, n, T, r.dmin, r.dmax);
    return r;
}
/* The kernels keep the ranges of their own tile in shared memory, one copy per warp
 * (no block barrier): registers are what they lack, and a range is read once per
 * tile of the other side. A block's tile and this warp's 16-row strip of it (the
 * mma kernels). */
struct TileRanges {
    TokRange blk, wrp;
};
/* dst = r, this warp's copy in shared memory; by a warp. */
template <typename R> __device__ __forceinline__ void warp_keep(R &dst, const R &r)
{
    if ((threadIdx.x & 31) == 0) dst = r;
    __syncwarp();
}
/* No query of q sees a key of k0 .. k0+n (keys < Tk); by a warp. */
__device__ __forceinline__ bool keys_hidden(const int32_t *kpos, const int32_t *kdoc, int k0, int n, int Tk,
                                            const TokRange &q, int window)
{
    return attn_skip(q, warp_tok_range(kpos, kdoc, k0, n, Tk), window);
}
/* No query of q0 .. q0+n (queries < Tq) sees a key of k; by a warp. */
__device__ __forceinline__ bool queries_hidden(const int32_t *qpos, const int32_t *qdoc, int q0, int n, int Tq,
                                               const TokRange &k, int window)
{
    return attn_skip(warp_tok_range(qpos, qdoc, q0, n, Tq), k, window);
}

/* -------------------------------------------------- shared-memory layouts */
/* One description of a kernel's shared memory serves the kernel (where each array
 * starts) and its launcher (the size to allocate).
 * SmemLayout, for sizes known at compile time (the mma kernels): arrays appended
 * back to back, offsets in bytes, constexpr; smem_at gives the array at an offset. */
struct SmemLayout {
    int bytes = 0;
    template <typename T> __host__ __device__ constexpr int add(int n)
    {
        const int at = bytes;
        bytes += n * (int)sizeof(T);
        return at;
    }
};
template <typename T> __device__ __forceinline__ T *smem_at(unsigned char *base, int off)
{
    return reinterpret_cast<T *>(base + off);
}
/* SmemParts, for sizes known at run time (the SIMT kernels: hd): the sizes n[i] of N
 * arrays of 4-byte words, in order; the kernel chains its pointers from the base
 * (a[0] = base, a[i] = a[i-1] + n[i-1]: offsets summed at run time would cost the
 * unrolled loops their constant offsets). */
template <int N> struct SmemParts {
    int n[N];
    __host__ __device__ size_t bytes() const
    {
        size_t b = 0;
        for (int i = 0; i < N; i++) b += (size_t)n[i] * 4;
        return b;
    }
};

/* ============================================================ SIMT (fp32) */
/* a block of S_WARPS warps, S_RPW rows per warp; key tiles of S_BK (one key per lane);
 * dk/dv: S_BKV keys per block, query tiles of S_BQ2 (one query per lane) */
enum { S_WARPS = 4, S_RPW = 4, S_BQ = S_WARPS * S_RPW, S_BK = 32 };
enum { S_BKV = S_WARPS * S_RPW, S_BQ2 = 32 };

/* Rows [r0, r0+R) of a [Tn][stride] tensor (hd columns from src), as fp32, into a
 * shared tile of row stride ld; rows >= Tn are zero. By the block. */
template <typename T>
__device__ __forceinline__ void simt_load_rows(float *dst, int ld, const T *src, size_t stride, int r0, int R, int Tn,
                                               int hd)
{
    for (int i = threadIdx.x; i < R * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, row = r0 + r;
        dst[r * ld + d] = row < Tn ? to_f(src[(size_t)row * stride + d]) : 0.0f;
    }
}
/* The same rows of two tensors (K and V, Q and dout) in one pass. */
template <typename T>
__device__ __forceinline__ void simt_load_rows2(float *d1, int ld1, const T *s1, float *d2, int ld2, const T *s2,
                                                size_t stride, int r0, int R, int Tn, int hd)
{
    for (int i = threadIdx.x; i < R * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, row = r0 + r;
        bool ok = row < Tn;
        d1[r * ld1 + d] = ok ? to_f(s1[(size_t)row * stride + d]) : 0.0f;
        d2[r * ld2 + d] = ok ? to_f(s2[(size_t)row * stride + d]) : 0.0f;
    }
}
/* a . b over hd columns, by the 32 lanes of a warp (D = dout . out) */
template <typename T> __device__ __forceinline__ float simt_row_dot(const T *a, const T *b, int hd)
{
    float s = 0.0f;
    for (int d = threadIdx.x & 31; d < hd; d += 32) s += to_f(a[d]) * to_f(b[d]);
    return warp_sum(s);
}
/* P and dS of this lane's (query, key) pair (positions qp, kp, documents qd, kd),
 * from the query's row
 * q and dout row g and the key's rows k and v (hd columns): P = exp(q.k scale - L)
 * where visible, else 0; dS = P (g.v - D) scale. False, in the whole warp, when no
 * lane's pair is visible (nothing to add). */
__device__ __forceinline__ bool simt_p_ds(int qp, int kp, int qd, int kd, int window, const float *q, const float *k,
                                          const float *g, const float *v, int hd, float L, float D, float scale,
                                          float &p, float &ds)
{
    const bool vis = attn_visible(qp, kp, qd, kd, window);
    if (!__any_sync(0xffffffffu, vis)) return false;
    float s = 0.0f, dp = 0.0f;
    for (int d = 0; d < hd; d++) {
        s += q[d] * k[d];
        dp += g[d] * v[d];
    }
    p = vis ? expf(s * scale - L) : 0.0f;
    ds = p * (dp - D) * scale;
    return true;
}
/* acc[e] += sum_c w_c rows[c][d] over the N rows c of a shared tile (row stride ld):
 * w_c is lane c's w (P or dS of key c), d = lane + 32 e < hd the columns this lane
 * holds (O += P V, dQ += dS K) */
template <int N, int NPL>
__device__ __forceinline__ void simt_acc_rows(float (&acc)[NPL], float w, const float *rows, int ld, int hd)
{
    const int lane = threadIdx.x & 31;
    for (int c = 0; c < N; c++) {
        const float wc = __shfl_sync(0xffffffffu, w, c);
        const float *r = rows + c * ld;
#pragma unroll
        for (int e = 0; e < NPL; e++) {
            int d = lane + 32 * e;
            if (d < hd) acc[e] += wc * r[d];
        }
    }
}
/* dst[d] += acc[e] for the columns d = lane + 32 e < hd of a row this lane holds */
template <typename T, int NPL> __device__ __forceinline__ void simt_add_row(T *dst, const float (&acc)[NPL], int hd)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < NPL; e++) {
        const int d = lane + 32 * e;
        if (d < hd) dst[d] = from_f<T>(to_f(dst[d]) + acc[e]);
    }
}

/* ============================================================ tensor cores */
/* ---- the tables the mma kernels read instead of positions, documents, lse, out
 * Made once per call by attention_mma.cu's prep kernels in the op's scratch, so that
 * no tile waits on global loads and a warp reduction to learn what it may skip, and
 * the backward's D is computed once per row instead of once per key block:
 *   ktok  [B][Tkp]      each key's position (INT_MAX past Tk) and document (0 there),
 *                       copied into shared memory with the K and V tiles (cp.async);
 *   kstrip [B][Tkp/16], qstrip [B][Tqp/16]: the TokRange of each 16 keys / queries
 *                       (positions (INT_MAX, INT_MIN) where there are none); a tile's
 *                       range is the min/max of a few of them, cached loads;
 *   qrow  [B][nh][4][Tqp] (backward) four planes of 32-bit words a head: each query
 *                       row's lse in log2 units (+inf where no key is visible to it,
 *                       and past Tq), D = dout . out, position (INT_MIN where +inf)
 *                       and document, copied like ktok (planes, not a struct a row:
 *                       the dk/dv kernel's loop held a row's four in registers and
 *                       spilled).
 * Tkp, Tqp: Tk, Tq rounded up to ATTN_PAD, so that no tile reads past them. */
enum { ATTN_PAD = 128, ATTN_STRIP = 16 };
struct KeyTok {
    int pos, doc;
};
enum { QR_L, QR_D, QR_POS, QR_DOC, QR_PLANES };
/* where head h of sequence b starts in qrow (its four planes follow, Tqp words each) */
__host__ __device__ inline size_t qrow_head(int b, int h, int nh, int Tqp)
{
    return ((size_t)b * nh + h) * QR_PLANES * Tqp;
}
/* one head's rows: the planes of qrow */
struct QRows {
    const float *L, *D;
    const int *pos, *doc;
};
struct AttnTables {
    const KeyTok *ktok;
    const TokRange *kstrip, *qstrip;
    const uint32_t *qrow;
    int Tkp, Tqp;
};
struct AttnScratchLayout {
    size_t ktok, kstrip, qstrip, qrow, dqacc, bytes;
    int Tkp, Tqp;
};
__host__ __device__ inline size_t attn_al256(size_t n) { return (n + 255) / 256 * 256; }
/* where each table lies in the scratch (qrow only when rows; the fused backward's
 * fp32 dQ accumulator [B][Tq][nh][dq_hd] after it when dq_hd > 0) */
__host__ __device__ inline AttnScratchLayout attn_scratch_layout(int B, int Tq, int Tk, int nh, bool rows, int dq_hd)
{
    AttnScratchLayout l;
    l.Tkp = (int)(((long long)Tk + ATTN_PAD - 1) / ATTN_PAD * ATTN_PAD);
    l.Tqp = (int)(((long long)Tq + ATTN_PAD - 1) / ATTN_PAD * ATTN_PAD);
    l.ktok = 0;
    l.kstrip = l.ktok + attn_al256((size_t)B * l.Tkp * sizeof(KeyTok));
    l.qstrip = l.kstrip + attn_al256((size_t)B * (l.Tkp / ATTN_STRIP) * sizeof(TokRange));
    l.qrow = l.qstrip + attn_al256((size_t)B * (l.Tqp / ATTN_STRIP) * sizeof(TokRange));
    l.dqacc = l.qrow + (rows ? attn_al256((size_t)B * nh * QR_PLANES * l.Tqp * sizeof(uint32_t)) : 0);
    l.bytes = l.dqacc + (rows && dq_hd > 0 ? attn_al256((size_t)B * Tq * nh * dq_hd * sizeof(float)) : 0);
    return l;
}
/* The TokRange of strips i0 .. i0+n of one sequence's strip table */
__device__ __forceinline__ TokRange strip_range(const TokRange *s, int i0, int n)
{
    TokRange r = {INT_MAX, INT_MIN, INT_MAX, INT_MIN};
    for (int i = 0; i < n; i++) {
        const int4 x = __ldg(reinterpret_cast<const int4 *>(s + i0 + i));
        r.pmin = imin(r.pmin, x.x);
        r.pmax = imax(r.pmax, x.y);
        r.dmin = imin(r.dmin, x.z);
        r.dmax = imax(r.dmax, x.w);
    }
    return r;
}
/* r (this warp's) for the n tokens from t0 (a multiple of 16), from their strips,
 * warp w owning strips w m.. (m of them); by a warp */
__device__ __forceinline__ void strip_ranges(const TokRange *s, int t0, int n, TileRanges &r, int m = 1)
{
    const int i0 = t0 / ATTN_STRIP;
    warp_keep(r, {strip_range(s, i0, n / ATTN_STRIP), strip_range(s, i0 + (int)(threadIdx.x >> 5) * m, m)});
}
/* n entries of 16 bytes (or 2n of 8) from src into shared dst with cp.async; by
 * thread tid of nthreads */
__device__ __forceinline__ void load_rows16_async(void *dst, const void *src, int n, int tid, int nthreads)
{
    for (int c = tid; c < n; c += nthreads)
        cp_async16(static_cast<char *>(dst) + c * 16, static_cast<const char *>(src) + c * 16, true);
}

/* Fragment addressing (see cuda_common.cuh for the layouts), with LD the row
 * stride in elements of a shared tile (HD + 8: rows shift by 16 bytes, so the
 * eight rows of an ldmatrix hit distinct banks):
 *   A 16x16 at (row0, col0), row-major source:    row0 + (lane & 15), col0 + (lane >> 4) * 8
 *   B for n-tiles nt, nt+1 from a [n][k] source:  n0 + (lane >> 4) * 8 + (lane & 7), k0 + ((lane >> 3) & 1) * 8
 *   B for n-tiles dt, dt+1 from a [k][n] source (trans):
 *                                                 k0 + ((lane >> 3) & 1) * 8 + (lane & 7), (dt + (lane >> 4)) * 8 */
__device__ __forceinline__ int frag_a_off(int lane, int LD) { return (lane & 15) * LD + (lane >> 4) * 8; }
__device__ __forceinline__ int frag_bn_off(int lane, int LD) { return ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int frag_bt_off(int lane, int LD) { return (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8; }

/* The A fragment of rows row0.., columns col0.. of a shared [.][LD] tile */
__device__ __forceinline__ void frag_ld_a(uint32_t (&f)[4], const bf16 *tile, int row0, int col0, int LD, int lane)
{
    ldmatrix_x4(f, tile + row0 * LD + col0 + frag_a_off(lane, LD));
}
/* The KS A fragments (k-steps of 16 columns) of the 16 rows from row0 */
template <int KS>
__device__ __forceinline__ void frag_ld_a_rows(uint32_t (&f)[KS][4], const bf16 *tile, int row0, int LD, int lane)
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++) frag_ld_a(f[kk], tile, row0, kk * 16, LD, lane);
}
/* ... and from a shared [k][m] tile (A stored transposed: ldmatrix .trans; matrix
 * j = lane / 8 of the fragment holds rows m0 + 8 (j & 1), columns k0 + 8 (j >> 1)) */
__device__ __forceinline__ void frag_ld_at(uint32_t (&f)[4], const bf16 *tile, int m0, int k0, int LD, int lane)
{
    ldmatrix_x4_trans(f, tile + (k0 + (lane >> 4) * 8 + (lane & 7)) * LD + m0 + ((lane >> 3) & 1) * 8);
}
/* B fragments of the n-tiles n0/8, n0/8 + 1 at k0 from a [n][k] tile, and from a [k][n] tile */
__device__ __forceinline__ void frag_ld_bn(uint32_t (&f)[4], const bf16 *tile, int n0, int k0, int LD, int lane)
{
    ldmatrix_x4(f, tile + n0 * LD + k0 + frag_bn_off(lane, LD));
}
__device__ __forceinline__ void frag_ld_bt(uint32_t (&f)[4], const bf16 *tile, int k0, int n0, int LD, int lane)
{
    ldmatrix_x4_trans(f, tile + k0 * LD + n0 + frag_bt_off(lane, LD));
}
/* d0 += a b[0..1], d1 += a b[2..3]: the two n-tiles of one B load */
__device__ __forceinline__ void mma_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4])
{
    mma_bf16_16816(d0, a, b);
    mma_bf16_16816(d1, a, b + 2);
}

template <int N> __device__ __forceinline__ void frag_zero(float (&acc)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}
/* The A operand of k-step kk (16 x 16 bf16) from the fp32 accumulators of n-tiles
 * 2kk (lo) and 2kk + 1 (hi): P or dS into the next mma, in registers */
__device__ __forceinline__ void frag_pack_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4])
{
    a[0] = pack_bf16x2(lo[0], lo[1]);
    a[1] = pack_bf16x2(lo[2], lo[3]);
    a[2] = pack_bf16x2(hi[0], hi[1]);
    a[3] = pack_bf16x2(hi[2], hi[3]);
}

/* The tile products. Each term of a call is one product into its own accumulators;
 * the terms of one call share the loops, and their loads and mmas are issued
 * together (S = Q K^T and dP = dO V^T of the same keys in one pass).
 *
 * QkTerm: acc[nt] += a B_nt^T for the NT n-tiles of one k-step: a is a 16 x 16 A
 * fragment, B the rows n < 8 NT of a shared [n][k] tile b, columns k0..k0+16. */
template <int N> struct QkTerm {
    static constexpr int NT = N;
    float (&acc)[N][4];
    const uint32_t (&a)[4];
    const bf16 *b;
};
template <int NT>
__device__ __forceinline__ QkTerm<NT> qk_term(float (&acc)[NT][4], const uint32_t (&a)[4], const bf16 *b)
{
    return {acc, a, b};
}
/* mma_qk(k0, LD, lane, t0, ts...): the QkTerms of the k-step at column k0 */
template <typename T0, typename... Ts>
__device__ __forceinline__ void mma_qk(int k0, int LD, int lane, T0 t0, Ts... ts)
{
    constexpr int M = 1 + sizeof...(Ts);
#pragma unroll
    for (int nt = 0; nt < T0::NT; nt += 2) {
        uint32_t f[M][4];
        int i = 0;
        frag_ld_bn(f[0], t0.b, nt * 8, k0, LD, lane);
        ((++i, frag_ld_bn(f[i], ts.b, nt * 8, k0, LD, lane)), ...);
        i = 0;
        mma_pair(t0.acc[nt], t0.acc[nt + 1], t0.a, f[0]);
        ((++i, mma_pair(ts.acc[nt], ts.acc[nt + 1], ts.a, f[i])), ...);
    }
}
/* PvTerm: acc[dt] += P B, P the 16 x 8 NK accumulator tile p (rounded to bf16 as the
 * A operand, NK/2 k-steps), B the rows k < 8 NK of a shared [k][n] tile b with 8 DT
 * columns, read transposed (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q) */
template <int K, int D> struct PvTerm {
    static constexpr int NK = K, DT = D;
    float (&acc)[D][4];
    const float (&p)[K][4];
    const bf16 *b;
};
template <int NK, int DT>
__device__ __forceinline__ PvTerm<NK, DT> pv_term(float (&acc)[DT][4], const float (&p)[NK][4], const bf16 *b)
{
    return {acc, p, b};
}
/* mma_pv(LD, lane, t0, ts...): the PvTerms, over all their k-steps */
template <typename T0, typename... Ts>
__device__ __forceinline__ void mma_pv(int LD, int lane, T0 t0, Ts... ts)
{
    constexpr int M = 1 + sizeof...(Ts);
#pragma unroll
    for (int kk = 0; kk < T0::NK / 2; kk++) {
        uint32_t a[M][4];
        int i = 0;
        frag_pack_a(a[0], t0.p[2 * kk], t0.p[2 * kk + 1]);
        ((++i, frag_pack_a(a[i], ts.p[2 * kk], ts.p[2 * kk + 1])), ...);
#pragma unroll
        for (int dt = 0; dt < T0::DT; dt += 2) {
            uint32_t f[M][4];
            i = 0;
            frag_ld_bt(f[0], t0.b, kk * 16, dt * 8, LD, lane);
            ((++i, frag_ld_bt(f[i], ts.b, kk * 16, dt * 8, LD, lane)), ...);
            i = 0;
            mma_pair(t0.acc[dt], t0.acc[dt + 1], a[0], f[0]);
            ((++i, mma_pair(ts.acc[dt], ts.acc[dt + 1], a[i], f[i])), ...);
        }
    }
}

/* over the 4 lanes (t = lane % 4) that hold one accumulator row */
__device__ __forceinline__ float quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* A thread's rows r0 (elements 0, 1 of each n-tile) and r1 = r0 + 8 (elements 2, 3)
 * of a 16 x 8 DT accumulator tile, columns 8 dt + 2 tq, into a bf16 [T][stride]
 * tensor (rows >= T left out): written as acc * a0 (row r0), acc * a1 (row r1)... */
template <int DT>
__device__ __forceinline__ void frag_store_rows(bf16 *base, size_t stride, int r0, int r1, int T,
                                                const float (&acc)[DT][4], float a0, float a1, int tq)
{
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + tq * 2;
        if (r0 < T)
            *reinterpret_cast<uint32_t *>(base + (size_t)r0 * stride + col) = pack_bf16x2(acc[dt][0] * a0, acc[dt][1] * a0);
        if (r1 < T)
            *reinterpret_cast<uint32_t *>(base + (size_t)r1 * stride + col) = pack_bf16x2(acc[dt][2] * a1, acc[dt][3] * a1);
    }
}
/* ... or added: base += a * acc (the gradients accumulate) */
template <int DT>
__device__ __forceinline__ void frag_add_rows(bf16 *base, size_t stride, int r0, int r1, int T,
                                              const float (&acc)[DT][4], float a, int tq)
{
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + tq * 2;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int row = hr ? r1 : r0;
            if (row >= T) continue;
            __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(base + (size_t)row * stride + col);
            const float2 x = __bfloat1622float2(*p);
            *p = __floats2bfloat162_rn(x.x + a * acc[dt][2 * hr], x.y + a * acc[dt][2 * hr + 1]);
        }
    }
}

/* Copy rows [r0, r0+R) of a [T][stride] bf16 tensor (HD columns from base) into a
 * shared [R][LD] tile with cp.async; rows >= T are zero-filled. */
template <int HD, int R>
__device__ __forceinline__ void load_tile_async(bf16 *dst, const bf16 *base, size_t stride, int r0, int T, int tid,
                                                int nthreads)
{
    constexpr int CPR = HD / 8, LD = HD + 8;
    for (int c = tid; c < R * CPR; c += nthreads) {
        const int r = c / CPR, cc = c % CPR, row = r0 + r;
        const bool ok = row < T;
        cp_async16(dst + r * LD + cc * 8, base + (size_t)(ok ? row : 0) * stride + cc * 8, ok);
    }
}

/* lse in log2 units for the exp2 of the kernels; +inf for rows that see nothing
 * (lse = -inf) or do not exist, so that exp2(s - L) = 0 there */
__device__ __forceinline__ float lse_log2(const float *lse_row, int row, int T)
{
    if (row >= T) return INFINITY;
    const float L = lse_row[row];
    return L == -INFINITY ? INFINITY : L * LOG2E_F;
}
/* D = dout . out of one row (HD bf16 columns), by the 32 lanes of a warp */
template <int HD>
__device__ __forceinline__ float row_dot_warp(const bf16 *a, const bf16 *b)
{
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
    for (int d = lane * 2; d < HD; d += 64) {
        float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(a + d));
        float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(b + d));
        s += x.x * y.x + x.y * y.y;
    }
    return warp_sum(s);
}

/* The double-buffered cp.async pipeline of the mma kernels over the tiles i < n
 * that skip(i) does not rule out (skip gives the same in every thread of the
 * block): tile i + 1 is copied into buffer buf ^ 1 while tile i is consumed from buf.
 *   load(i, buf)  issues tile i's copies into buffer buf (committed as one group);
 *   first()       runs once, after the first tile's group is committed, before the
 *                 first body: cp_async_wait<1> + __syncthreads there make whatever
 *                 the kernel committed before the pipeline visible (Q into registers);
 *   body(i, buf)  consumes tile i, after its group has landed and a barrier; a
 *                 barrier follows, before buffer buf is refilled.
 * Every group has landed when it returns. */
template <typename Skip, typename Load, typename First, typename Body>
__device__ __forceinline__ void tile_pipeline(int n, Skip skip, Load load, First first, Body body)
{
    auto next = [&](int i) {
        for (; i < n; i++)
            if (!skip(i)) break;
        return i;
    };
    int i = next(0);
    if (i < n) { /* the same in every thread */
        load(i, 0);
        cp_async_commit();
        first();
        int buf = 0;
        while (i < n) {
            const int in = next(i + 1);
            if (in < n) load(in, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>(); /* tile i has landed */
            __syncthreads();
            body(i, buf);
            __syncthreads(); /* buf is consumed before it is refilled */
            buf ^= 1;
            i = in;
        }
    }
    cp_async_wait<0>();
}

/* ============================================================ launchers */
/* The shape of one call and what decides visibility (device pointers; qdoc, kdoc
 * [B][T] or both NULL), and its scratch; attention.cu has checked them. */
struct AttnShape {
    int B, Tq, Tk, nh, nkv, hd, window;
    const int32_t *qpos, *kpos, *qdoc, *kdoc;
    void *scratch; /* the tables of the mma kernels (cuda_op_attention_scratch bytes) */
    int bwd_form;   /* the backward: 0 split; 1 fused (dQ through the scratch's fp32
                     * accumulator), 2 fused with 8 warps a block */
    int fwd_shape;  /* the forward's block: 0 8 warps x 16 rows, 1 4 x 16, 2 4 x 32 */
};
/* attention_mma.cu: hd 32, 64 or 128, bf16, every pointer 16-byte aligned */
cudaError_t attn_mma_forward(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                             cudaStream_t stream);
cudaError_t attn_mma_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                              const void *v, const void *out, const float *lse, const AttnShape &s,
                              cudaStream_t stream);
/* attention_simt.cu: any hd <= 256, fp32 or bf16 */
cudaError_t attn_simt_forward(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                              cudaDataType_t dt, cudaStream_t stream);
cudaError_t attn_simt_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                               const void *v, const void *out, const float *lse, const AttnShape &s,
                               cudaDataType_t dt, cudaStream_t stream);
cudaError_t attn_simt_merge(void *out, float *lse, const void *out2, const float *lse2, int T, int nh, int hd,
                            size_t rows, cudaDataType_t dt, cudaStream_t stream);

#endif
