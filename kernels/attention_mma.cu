/* kernels/attention_mma.cu: the tensor-core attention kernels (bf16, hd 32/64/128),
 * mma.sync m16n8k16 in FlashAttention-2's scheme; attention_common.cuh describes
 * them and holds the pieces they are built from (the double-buffered tile
 * pipeline, fragment loads and packing, the tile products). */
#include "attention_common.cuh"

/* ============================================================ forward */
/* a block of W warps owns 16 W MT query rows of one head, in one of three shapes
 * (cuda_op_attention_forward_shape): 8 warps of 16 rows (the default: one block a
 * multiprocessor at hd 128, 212 registers a thread), 4 of 16 (two blocks a
 * multiprocessor, one computing while the other waits at a barrier, for twice the
 * K/V traffic from L2), 4 of 32 (FlashAttention-2's: two blocks of 128 rows) */
enum { F_BK = 64 };

/* Q [16 R][LD] (R m-tiles), K and V [2][F_BK][LD], the keys' positions and documents [2][F_BK] */
struct FwdSmem {
    int q, k, v, kt, bytes;
};
template <int HD, int R> __host__ __device__ constexpr FwdSmem fwd_smem()
{
    SmemLayout s;
    const int q = s.add<bf16>(R * 16 * (HD + 8)), k = s.add<bf16>(2 * F_BK * (HD + 8)),
              v = s.add<bf16>(2 * F_BK * (HD + 8)), kt = s.add<KeyTok>(2 * F_BK);
    return {q, k, v, kt, s.bytes};
}

/* Key tile k0.. (BK keys) into buffer buf of the [2][BK][LD] tiles sK, sV and of the
 * [2][BK] KeyToks sKt (from the sequence's ktok table), all by cp.async */
template <int HD, int BK>
__device__ __forceinline__ void load_kv_tile(bf16 *sK, bf16 *sV, KeyTok *sKt, int buf, const bf16 *kb,
                                             const bf16 *vb, size_t ks, const KeyTok *ktok, int k0, int Tk, int tid,
                                             int nthreads)
{
    constexpr int LD = HD + 8;
    load_tile_async<HD, BK>(sK + buf * BK * LD, kb, ks, k0, Tk, tid, nthreads);
    load_tile_async<HD, BK>(sV + buf * BK * LD, vb, ks, k0, Tk, tid, nthreads);
    load_rows16_async(sKt + buf * BK, ktok + k0, BK / 2, tid, nthreads);
}
/* a sequence's rows of the tables */
__device__ __forceinline__ const KeyTok *ktok_of(const AttnTables &t, int b) { return t.ktok + (size_t)b * t.Tkp; }
__device__ __forceinline__ const TokRange *kstrip_of(const AttnTables &t, int b)
{
    return t.kstrip + (size_t)b * (t.Tkp / ATTN_STRIP);
}
__device__ __forceinline__ const TokRange *qstrip_of(const AttnTables &t, int b)
{
    return t.qstrip + (size_t)b * (t.Tqp / ATTN_STRIP);
}
/* The range of the n (a multiple of 16) tokens from t0 */
__device__ __forceinline__ TokRange range_at(const TokRange *strips, int t0, int n)
{
    return strip_range(strips, t0 / ATTN_STRIP, n / ATTN_STRIP);
}

/* One key tile of the online softmax of the two rows a thread holds, r0 (accumulator
 * elements 0, 1) and r1 = r0 + 8 (elements 2, 3): the scores s (scaled to log2 units;
 * -inf where not visible, unless every pair is) become P = exp2(s - max), the running
 * max m0, m1 (log2 units) and sum l0, l1 take them in, the output o is rescaled. */
template <int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&o)[DT][4], float &m0, float &m1, float &l0,
                                               float &l1, const KeyTok *kt, int qp0, int qp1, int qd0, int qd1,
                                               bool full, int window, float scale_log2, int tq)
{
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float a = s[nt][e] * scale_log2, c = s[nt][2 + e] * scale_log2;
            if (!full) {
                const KeyTok key = kt[nt * 8 + tq * 2 + e];
                const int p = key.pos, d = key.doc;
                if (!attn_visible(qp0, p, qd0, d, window)) a = -INFINITY;
                if (!attn_visible(qp1, p, qd1, d, window)) c = -INFINITY;
            }
            s[nt][e] = a;
            s[nt][2 + e] = c;
            mx0 = fmaxf(mx0, a);
            mx1 = fmaxf(mx1, c);
        }
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s[nt][e] = exp2f(s[nt][e] - mu0);
            s[nt][2 + e] = exp2f(s[nt][2 + e] - mu1);
            rs0 += s[nt][e];
            rs1 += s[nt][2 + e];
        }
    }
    l0 = l0 * al0 + rs0;
    l1 = l1 * al1 + rs1;
#pragma unroll
    for (int i = 0; i < DT; i++) {
        o[i][0] *= al0;
        o[i][1] *= al0;
        o[i][2] *= al1;
        o[i][3] *= al1;
    }
}

/* acc[mt][n] += A_mt B_n over KSTEPS k-steps, for MT m-tiles and N n-tiles (in pairs):
 * load_a(a, mt, kk) gives m-tile mt's A fragment of k-step kk, load_b(f, kk, n) the B
 * fragments of n-tiles n, n + 1, each loaded once for all MT m-tiles */
template <int MT, int KSTEPS, int N, typename LoadA, typename LoadB>
__device__ __forceinline__ void mma_shared_b(float (&acc)[MT][N][4], LoadA load_a, LoadB load_b)
{
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) load_a(a[mt], mt, kk);
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            uint32_t f[4];
            load_b(f, kk, n);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) mma_pair(acc[mt][n], acc[mt][n + 1], a[mt], f);
        }
    }
}

/* W warps of MT m-tiles each (16 MT rows a warp, 16 W MT a block). MT = 1 keeps the
 * warp's Q fragments in registers; MT = 2 (FlashAttention-2's shape: each K and V
 * fragment a warp loads serves 32 rows, half the shared-memory reads a product)
 * loads them from shared memory at each k-step, as its accumulators fill the rest */
template <int HD, int W, int MT>
__global__ void __launch_bounds__(W * 32, 8 / W)
    attn_fwd_mma(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *qpos,
                 const int32_t *qdoc, AttnTables t, int Tq, int Tk, int nh, int nkv, int window, float scale_log2)
{
    constexpr int LD = HD + 8, NT = F_BK / 8, KS = HD / 16, DT = HD / 8, NTHR = W * 32, F_BQ = W * 16 * MT;
    constexpr FwdSmem L = fwd_smem<HD, W * MT>();
    SMP_DYN_SMEM(unsigned char, smem);
    bf16 *sQ = smem_at<bf16>(smem, L.q), *sK = smem_at<bf16>(smem, L.k), *sV = smem_at<bf16>(smem, L.v);
    KeyTok *sKt = smem_at<KeyTok>(smem, L.kt);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x; /* the longest rows first */
    const int h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const int q0 = qt * F_BQ, w0 = warp * 16 * MT; /* the warp's rows: w0.. of the block's */
    const size_t qs = (size_t)nh * HD, ks = (size_t)nkv * HD;
    const bf16 *qb = q + (size_t)b * Tq * qs + (size_t)h * HD;
    const bf16 *kb = k + (size_t)b * Tk * ks + (size_t)g * HD;
    const bf16 *vb = v + (size_t)b * Tk * ks + (size_t)g * HD;

    load_tile_async<HD, F_BQ>(sQ, qb, qs, q0, Tq, tid, NTHR);
    cp_async_commit();

    qdoc = doc_row(qdoc, b, Tq);
    int qp0[MT], qp1[MT], qd0[MT], qd1[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int r0 = q0 + w0 + mt * 16 + gq, r1 = r0 + 8;
        qp0[mt] = tok_at(qpos, r0, Tq, INT_MIN), qp1[mt] = tok_at(qpos, r1, Tq, INT_MIN);
        qd0[mt] = tok_at(qdoc, r0, Tq, 0), qd1[mt] = tok_at(qdoc, r1, Tq, 0);
    }
    const KeyTok *ktok = ktok_of(t, b);
    const TokRange *kstrip = kstrip_of(t, b);
    __shared__ TileRanges sR[W];
    const TileRanges &qr = sR[warp];
    strip_ranges(qstrip_of(t, b), q0, F_BQ, sR[warp], MT);

    float o[MT][DT][4], m0[MT], m1[MT], l0[MT], l1[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        frag_zero(o[mt]);
        m0[mt] = m1[mt] = -INFINITY;
        l0[mt] = l1[mt] = 0.0f;
    }
    uint32_t qf[MT == 1 ? KS : 1][4]; /* MT = 1: the warp's Q, kept */
    tile_pipeline(
        (Tk + F_BK - 1) / F_BK, [&](int j) { return attn_skip(qr.blk, range_at(kstrip, j * F_BK, F_BK), window); },
        [&](int j, int buf) { load_kv_tile<HD, F_BK>(sK, sV, sKt, buf, kb, vb, ks, ktok, j * F_BK, Tk, tid, NTHR); },
        [&] {
            cp_async_wait<1>(); /* Q has landed */
            __syncthreads();
            if constexpr (MT == 1) frag_ld_a_rows(qf, sQ, w0, LD, lane);
        },
        [&](int j, int buf) {
            const TokRange kr = range_at(kstrip, j * F_BK, F_BK);
            if (attn_skip(qr.wrp, kr, window)) return;
            const bool full = (j + 1) * F_BK <= Tk && attn_full(qr.wrp, kr, window);
            const bf16 *cK = sK + buf * F_BK * LD, *cV = sV + buf * F_BK * LD;
            float s[MT][NT][4];
            if constexpr (MT == 1) {
                frag_zero(s[0]);
#pragma unroll
                for (int kk = 0; kk < KS; kk++) mma_qk(kk * 16, LD, lane, qk_term(s[0], qf[kk], cK));
            } else { /* S = Q K^T, Q's fragments from shared memory */
#pragma unroll
                for (int mt = 0; mt < MT; mt++) frag_zero(s[mt]);
                mma_shared_b<MT, KS, NT>(
                    s, [&](uint32_t(&a)[4], int mt, int kk) { frag_ld_a(a, sQ, w0 + mt * 16, kk * 16, LD, lane); },
                    [&](uint32_t(&f)[4], int kk, int n) { frag_ld_bn(f, cK, n * 8, kk * 16, LD, lane); });
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                online_softmax(s[mt], o[mt], m0[mt], m1[mt], l0[mt], l1[mt], sKt + buf * F_BK, qp0[mt], qp1[mt],
                               qd0[mt], qd1[mt], full, window, scale_log2, tq);
            if constexpr (MT == 1)
                mma_pv(LD, lane, pv_term(o[0], s[0], cV));
            else /* O += P V */
                mma_shared_b<MT, NT / 2, DT>(
                    o, [&](uint32_t(&a)[4], int mt, int kk) { frag_pack_a(a, s[mt][2 * kk], s[mt][2 * kk + 1]); },
                    [&](uint32_t(&f)[4], int kk, int n) { frag_ld_bt(f, cV, kk * 16, n * 8, LD, lane); });
        });
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int r0 = q0 + w0 + mt * 16 + gq, r1 = r0 + 8;
        const float L0 = quad_sum(l0[mt]), L1 = quad_sum(l1[mt]);
        const float inv0 = L0 > 0.0f ? 1.0f / L0 : 0.0f, inv1 = L1 > 0.0f ? 1.0f / L1 : 0.0f;
        frag_store_rows(out + (size_t)b * Tq * qs + (size_t)h * HD, qs, r0, r1, Tq, o[mt], inv0, inv1, tq);
        if (tq == 0) {
            float *lb = lse + ((size_t)b * nh + h) * Tq;
            if (r0 < Tq) lb[r0] = L0 > 0.0f ? (m0[mt] + log2f(L0)) * LN2_F : -INFINITY;
            if (r1 < Tq) lb[r1] = L1 > 0.0f ? (m1[mt] + log2f(L1)) * LN2_F : -INFINITY;
        }
    }
}

/* ============================================================ backward, dq */
/* a block of 4 warps owns 64 query rows of one head */
enum { BQ_WARPS = 4, BQ_BQ = BQ_WARPS * 16 };
template <int HD> struct DqCfg { static constexpr int BK = HD >= 128 ? 32 : 64; };

/* Q and dout [BQ_BQ][LD], K and V [2][BK][LD], the keys' positions and documents [2][BK] */
struct DqSmem {
    int q, g, k, v, kt, bytes;
};
template <int HD> __host__ __device__ constexpr DqSmem dq_smem()
{
    constexpr int BK = DqCfg<HD>::BK;
    SmemLayout s;
    const int q = s.add<bf16>(BQ_BQ * (HD + 8)), g = s.add<bf16>(BQ_BQ * (HD + 8)),
              k = s.add<bf16>(2 * BK * (HD + 8)), v = s.add<bf16>(2 * BK * (HD + 8)), kt = s.add<KeyTok>(2 * BK);
    return {q, g, k, v, kt, s.bytes};
}
/* A head's planes of the qrow table, from row r0 on */
__device__ __forceinline__ QRows qrows_of(const AttnTables &t, int b, int h, int nh, int r0)
{
    const uint32_t *p = t.qrow + qrow_head(b, h, nh, t.Tqp) + r0;
    return {reinterpret_cast<const float *>(p + QR_L * t.Tqp), reinterpret_cast<const float *>(p + QR_D * t.Tqp),
            reinterpret_cast<const int *>(p + QR_POS * t.Tqp), reinterpret_cast<const int *>(p + QR_DOC * t.Tqp)};
}

/* dS = P (dP - D) in place of s, P = exp2(s * scale_log2 - L), 0 where not visible */
template <int NT>
__device__ __forceinline__ void dq_ds(float (&s)[NT][4], const float (&dp)[NT][4], const KeyTok *kt, int qp0, int qp1,
                                      int qd0, int qd1, float L0, float L1, float D0, float D1, int window,
                                      float scale_log2, int tq)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const KeyTok key = kt[nt * 8 + tq * 2 + e];
            const int p = key.pos, d = key.doc;
            const float p0 = attn_visible(qp0, p, qd0, d, window) ? exp2f(s[nt][e] * scale_log2 - L0) : 0.0f;
            const float p1 = attn_visible(qp1, p, qd1, d, window) ? exp2f(s[nt][2 + e] * scale_log2 - L1) : 0.0f;
            s[nt][e] = p0 * (dp[nt][e] - D0);
            s[nt][2 + e] = p1 * (dp[nt][2 + e] - D1);
        }
    }
}

template <int HD>
__global__ void __launch_bounds__(BQ_WARPS * 32)
    attn_bwd_dq_mma(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, AttnTables t, int Tq,
                    int Tk, int nh, int nkv, int window, float scale, float scale_log2)
{
    constexpr int BK = DqCfg<HD>::BK, LD = HD + 8, NT = BK / 8, KS = HD / 16, DT = HD / 8, NTHR = BQ_WARPS * 32;
    constexpr DqSmem L = dq_smem<HD>();
    SMP_DYN_SMEM(unsigned char, smem);
    bf16 *sQ = smem_at<bf16>(smem, L.q), *sG = smem_at<bf16>(smem, L.g);
    bf16 *sK = smem_at<bf16>(smem, L.k), *sV = smem_at<bf16>(smem, L.v);
    KeyTok *sKt = smem_at<KeyTok>(smem, L.kt);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const int q0 = qt * BQ_BQ;
    const size_t qs = (size_t)nh * HD, ks = (size_t)nkv * HD;
    const size_t qoff = (size_t)b * Tq * qs + (size_t)h * HD;
    const bf16 *kb = k + (size_t)b * Tk * ks + (size_t)g * HD;
    const bf16 *vb = v + (size_t)b * Tk * ks + (size_t)g * HD;

    load_tile_async<HD, BQ_BQ>(sQ, q + qoff, qs, q0, Tq, tid, NTHR);
    load_tile_async<HD, BQ_BQ>(sG, dout + qoff, qs, q0, Tq, tid, NTHR);
    cp_async_commit();
    const int r0 = q0 + warp * 16 + gq, r1 = r0 + 8;
    const QRows qr0 = qrows_of(t, b, h, nh, r0);
    const float L0 = qr0.L[0], L1 = qr0.L[8], D0 = qr0.D[0], D1 = qr0.D[8];
    const int qp0 = qr0.pos[0], qp1 = qr0.pos[8], qd0 = qr0.doc[0], qd1 = qr0.doc[8];
    const KeyTok *ktok = ktok_of(t, b);
    const TokRange *kstrip = kstrip_of(t, b);
    __shared__ TileRanges sR[BQ_WARPS];
    const TileRanges &qr = sR[warp];
    strip_ranges(qstrip_of(t, b), q0, BQ_BQ, sR[warp]);

    float acc[DT][4];
    frag_zero(acc);
    uint32_t qf[KS][4], gf[KS][4];
    tile_pipeline(
        (Tk + BK - 1) / BK, [&](int j) { return attn_skip(qr.blk, range_at(kstrip, j * BK, BK), window); },
        [&](int j, int buf) { load_kv_tile<HD, BK>(sK, sV, sKt, buf, kb, vb, ks, ktok, j * BK, Tk, tid, NTHR); },
        [&] {
            cp_async_wait<1>(); /* Q and dout have landed */
            __syncthreads();
            frag_ld_a_rows(qf, sQ, warp * 16, LD, lane);
            frag_ld_a_rows(gf, sG, warp * 16, LD, lane);
        },
        [&](int j, int buf) {
            if (attn_skip(qr.wrp, range_at(kstrip, j * BK, BK), window)) return;
            const bf16 *cK = sK + buf * BK * LD, *cV = sV + buf * BK * LD;
            float s[NT][4], dp[NT][4];
            frag_zero(s);
            frag_zero(dp);
#pragma unroll
            for (int kk = 0; kk < KS; kk++) /* S = Q K^T, dP = dO V^T */
                mma_qk(kk * 16, LD, lane, qk_term(s, qf[kk], cK), qk_term(dp, gf[kk], cV));
            dq_ds(s, dp, sKt + buf * BK, qp0, qp1, qd0, qd1, L0, L1, D0, D1, window, scale_log2, tq);
            mma_pv(LD, lane, pv_term(acc, s, cK)); /* dQ += dS K */
        });
    frag_add_rows(dq + qoff, qs, r0, r1, Tq, acc, scale, tq);
}

/* ============================================================ backward, dk and dv */
/* a block of KW warps owns 16 KW keys of one kv head (16 a warp) and walks the (query
 * head, query tile) items of its group: KW = 4 (64 keys: the split and fused forms) or
 * 8 (128 keys, fused-8x16: dQ's parts added once per 128 keys, Q and dout read once
 * per 128, one block a multiprocessor at hd 128). FUSED: the block also computes dQ
 * of each item, dS K over its keys, and adds it into the scratch's fp32 accumulator
 * with atomics (FlashAttention-2's backward: 5 tile products instead of the split
 * kernels' 7, without the dq kernel's second pass over the keys; the adds' order, and
 * so dQ's last bits, vary from run to run) */
/* MINB: blocks a multiprocessor must hold, registers capped to fit (below hd 128: 3,
 * at <= 170 registers, as before the tables; left to itself nvcc took 201 at hd 64) */
template <int HD> struct DkvCfg {
    static constexpr int BQ = HD >= 128 ? 32 : 64, MINB = HD >= 128 ? 2 : 3;
};

/* K and V [16 KW][LD]; Q and dout [2][BQ][LD]; the query rows' four qrow planes [2][4][BQ];
 * FUSED: dS^T [16 KW][BQ + 8] (keys x queries, bf16) */
struct DkvSmem {
    int k, v, q, g, qr, ds, bytes;
};
template <int HD, bool FUSED, int KW> __host__ __device__ constexpr DkvSmem dkv_smem()
{
    constexpr int BQ = DkvCfg<HD>::BQ;
    SmemLayout s;
    const int k = s.add<bf16>(KW * 16 * (HD + 8)), v = s.add<bf16>(KW * 16 * (HD + 8)),
              q = s.add<bf16>(2 * BQ * (HD + 8)), g = s.add<bf16>(2 * BQ * (HD + 8)), qr = s.add<uint32_t>(2 * QR_PLANES * BQ),
              ds = FUSED ? s.add<bf16>(KW * 16 * (BQ + 8)) : 0;
    return {k, v, q, g, qr, ds, s.bytes};
}

/* P^T and dS^T = P^T (dP^T - D) in place of s and dp (keys kp0, kp1 of documents
 * kd0, kd1 in this thread's rows; per query column its qrow planes' words, of planes
 * [4][BQ] from qr) */
template <int NT, int BQ>
__device__ __forceinline__ void dkv_p_ds(float (&s)[NT][4], float (&dp)[NT][4], const uint32_t *qr, int kp0, int kp1,
                                         int kd0, int kd1, int window, float scale_log2, int tq)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = nt * 8 + tq * 2 + e;
            const int p = (int)qr[QR_POS * BQ + c], d = (int)qr[QR_DOC * BQ + c];
            const float L = __uint_as_float(qr[QR_L * BQ + c]), D = __uint_as_float(qr[QR_D * BQ + c]);
            const float p0 = attn_visible(p, kp0, d, kd0, window) ? exp2f(s[nt][e] * scale_log2 - L) : 0.0f;
            const float p1 = attn_visible(p, kp1, d, kd1, window) ? exp2f(s[nt][2 + e] * scale_log2 - L) : 0.0f;
            s[nt][e] = p0;
            s[nt][2 + e] = p1;
            dp[nt][e] = p0 * (dp[nt][e] - D);
            dp[nt][2 + e] = p1 * (dp[nt][2 + e] - D);
        }
    }
}

/* A warp's 16 x 8 NT accumulator tile, rounded to bf16 as the tile products round
 * it, into rows row0.. of a shared [.][LDS] tile */
template <int NT, int LDS>
__device__ __forceinline__ void frag_to_smem(bf16 *tile, int row0, const float (&acc)[NT][4], int lane)
{
    uint32_t *r0 = reinterpret_cast<uint32_t *>(tile + (row0 + (lane >> 2)) * LDS + (lane & 3) * 2);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        r0[nt * 4] = pack_bf16x2(acc[nt][0], acc[nt][1]);
        r0[nt * 4 + 8 * LDS / 2] = pack_bf16x2(acc[nt][2], acc[nt][3]);
    }
}

/* p[0] += a, p[1] += b (8-byte aligned): one vector atomic where the GPU has it */
__device__ __forceinline__ void atomic_add2(float *p, float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2 *>(p), make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

/* dQ of an item, dS K over the block's keys: dS^T from sDs [16 KW][BQ + 8], K from
 * sK; warp w takes query rows 16 (w % WM).., columns (w / WM) HD / WN.., in parts of
 * at most 32 columns (fewer live accumulators: nvcc spilled at hd 64 with all 64), and
 * adds its tile into dst ([rows][stride] fp32, rows past `rows` left out) */
template <int HD, int BQ, int KW>
__device__ __forceinline__ void dq_tile_add(float *dst, size_t stride, int rows, const bf16 *sDs, const bf16 *sK,
                                            int warp, int lane)
{
    constexpr int WM = BQ / 16, WN = KW / WM, DTW = HD / WN / 8, CH = DTW < 4 ? DTW : 4, LD = HD + 8,
                  LDS = BQ + 8;
    static_assert(WM * WN == KW && DTW % CH == 0 && CH % 2 == 0, "the warps tile the item's dQ");
    const int m0 = (warp % WM) * 16, r0 = m0 + (lane >> 2), r1 = r0 + 8;
#pragma unroll
    for (int n0 = (warp / WM) * (HD / WN), ne = n0 + HD / WN; n0 < ne; n0 += CH * 8) {
        float acc[CH][4];
        frag_zero(acc);
#pragma unroll
        for (int kk = 0; kk < KW; kk++) {
            uint32_t a[4];
            frag_ld_at(a, sDs, m0, kk * 16, LDS, lane);
#pragma unroll
            for (int dt = 0; dt < CH; dt += 2) {
                uint32_t f[4];
                frag_ld_bt(f, sK, kk * 16, n0 + dt * 8, LD, lane);
                mma_pair(acc[dt], acc[dt + 1], a, f);
            }
        }
#pragma unroll
        for (int dt = 0; dt < CH; dt++) {
            const int col = n0 + dt * 8 + (lane & 3) * 2;
            if (r0 < rows) atomic_add2(dst + (size_t)r0 * stride + col, acc[dt][0], acc[dt][1]);
            if (r1 < rows) atomic_add2(dst + (size_t)r1 * stride + col, acc[dt][2], acc[dt][3]);
        }
    }
}

template <int HD, bool FUSED, int KW>
__global__ void __launch_bounds__(KW * 32, KW == 8 ? 1 : DkvCfg<HD>::MINB)
    attn_bwd_dkv_mma(bf16 *dk, bf16 *dv, float *dqacc, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                     AttnTables t, int Tq, int Tk, int nh, int nkv, int window, float scale, float scale_log2)
{
    constexpr int BQ = DkvCfg<HD>::BQ, LD = HD + 8, NT = BQ / 8, KS = HD / 16, DT = HD / 8, NTHR = KW * 32,
                  BKV = KW * 16;
    constexpr DkvSmem L = dkv_smem<HD, FUSED, KW>();
    SMP_DYN_SMEM(unsigned char, smem);
    bf16 *sK = smem_at<bf16>(smem, L.k), *sV = smem_at<bf16>(smem, L.v);
    bf16 *sQ = smem_at<bf16>(smem, L.q), *sG = smem_at<bf16>(smem, L.g);
    uint32_t *sQr = smem_at<uint32_t>(smem, L.qr);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int k0 = blockIdx.x * BKV, g = blockIdx.y, b = blockIdx.z, rep = nh / nkv;
    const size_t qs = (size_t)nh * HD, ks = (size_t)nkv * HD;
    const size_t koff = (size_t)b * Tk * ks + (size_t)g * HD;

    load_tile_async<HD, BKV>(sK, k + koff, ks, k0, Tk, tid, NTHR);
    load_tile_async<HD, BKV>(sV, v + koff, ks, k0, Tk, tid, NTHR);
    cp_async_commit();

    const KeyTok *ktok = ktok_of(t, b);
    const int kr0 = k0 + warp * 16 + gq, kr1 = kr0 + 8;
    const KeyTok key0 = ktok[kr0], key1 = ktok[kr1];
    const TokRange *qstrip = qstrip_of(t, b);
    __shared__ TileRanges sR[KW];
    const TileRanges &kr = sR[warp];
    strip_ranges(kstrip_of(t, b), k0, BKV, sR[warp]);

    /* item i: query head g*rep + i/nqt, query tile i%nqt */
    const int nqt = (Tq + BQ - 1) / BQ;
    auto load_q = [&](int i, int buf) {
        const int h = g * rep + i / nqt, qt0 = (i % nqt) * BQ;
        const size_t qoff = (size_t)b * Tq * qs + (size_t)h * HD;
        load_tile_async<HD, BQ>(sQ + buf * BQ * LD, q + qoff, qs, qt0, Tq, tid, NTHR);
        load_tile_async<HD, BQ>(sG + buf * BQ * LD, dout + qoff, qs, qt0, Tq, tid, NTHR);
        /* the BQ words of each plane from row qt0: BQ / 4 copies a plane, one a thread */
        const uint32_t *src = t.qrow + qrow_head(b, h, nh, t.Tqp) + qt0;
        for (int c = tid; c < BQ; c += NTHR) {
            const int plane = c / (BQ / 4), w = (c % (BQ / 4)) * 4;
            cp_async16(sQr + (buf * QR_PLANES + plane) * BQ + w, src + (size_t)plane * t.Tqp + w, true);
        }
    };

    float ak[DT][4], av[DT][4];
    frag_zero(ak);
    frag_zero(av);
    tile_pipeline(
        rep * nqt, [&](int i) { return attn_skip(range_at(qstrip, (i % nqt) * BQ, BQ), kr.blk, window); }, load_q,
        [] {}, /* K and V land with the first item */
        [&](int it, int buf) {
            /* a warp whose keys the item's queries do not see: no products (dS^T = 0) */
            const bool hidden = attn_skip(range_at(qstrip, (it % nqt) * BQ, BQ), kr.wrp, window);
            if (!FUSED && hidden) return;
            const bf16 *cQ = sQ + buf * BQ * LD, *cG = sG + buf * BQ * LD;
            float s[NT][4], dp[NT][4];
            frag_zero(s);
            frag_zero(dp);
            if (!hidden) {
#pragma unroll
                for (int kk = 0; kk < KS; kk++) { /* S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x BQ queries) */
                    uint32_t kf[4], vf[4];
                    frag_ld_a(kf, sK, warp * 16, kk * 16, LD, lane);
                    frag_ld_a(vf, sV, warp * 16, kk * 16, LD, lane);
                    mma_qk(kk * 16, LD, lane, qk_term(s, kf, cQ), qk_term(dp, vf, cG));
                }
                dkv_p_ds<NT, BQ>(s, dp, sQr + buf * QR_PLANES * BQ, key0.pos, key1.pos, key0.doc, key1.doc, window,
                                 scale_log2, tq);
                mma_pv(LD, lane, pv_term(av, s, cG), pv_term(ak, dp, cQ)); /* dV += P^T dO, dK += dS^T Q */
            }
            if constexpr (FUSED) { /* dQ += dS K: the warps' dS^T through shared memory */
                bf16 *sDs = smem_at<bf16>(smem, L.ds);
                frag_to_smem<NT, BQ + 8>(sDs, warp * 16, dp, lane);
                __syncthreads();
                const int h = g * rep + it / nqt, qt0 = (it % nqt) * BQ;
                float *dst = dqacc + ((size_t)b * Tq + qt0) * qs + (size_t)h * HD;
                dq_tile_add<HD, BQ, KW>(dst, qs, Tq - qt0, sDs, sK, warp, lane);
            }
        });
    frag_add_rows(dk + koff, ks, kr0, kr1, Tk, ak, scale, tq);
    frag_add_rows(dv + koff, ks, kr0, kr1, Tk, av, 1.0f, tq);
}

/* ============================================================ the tables */
/* grid-stride loops over n items (the grid capped; n may exceed what one launch spans) */
#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)
static dim3 stride_grid(long long n) { return dim3((unsigned)(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096)); }

__global__ void attn_prep_keys(KeyTok *ktok, const int32_t *kpos, const int32_t *kdoc, int Tk, int Tkp, int B)
{
    GRID_STRIDE(i, (long long)B * Tkp)
    {
        const int b = (int)(i / Tkp), j = (int)(i % Tkp);
        ktok[i] = {j < Tk ? kpos[j] : INT_MAX, j < Tk && kdoc ? kdoc[(size_t)b * Tk + j] : 0};
    }
}

/* the TokRange of each 16 tokens of each sequence: out [B][ns] */
__global__ void attn_prep_strips(TokRange *out, const int32_t *pos, const int32_t *doc, int T, int ns, int B)
{
    GRID_STRIDE(i, (long long)B * ns)
    {
        const int b = (int)(i / ns), st = (int)(i % ns);
        const int32_t *d = doc_row(doc, b, T);
        TokRange r = {INT_MAX, INT_MIN, d ? INT_MAX : 0, d ? INT_MIN : 0};
        for (int x = st * ATTN_STRIP; x < imin(T, (st + 1) * ATTN_STRIP); x++) {
            r.pmin = imin(r.pmin, pos[x]);
            r.pmax = imax(r.pmax, pos[x]);
            if (d) r.dmin = imin(r.dmin, d[x]), r.dmax = imax(r.dmax, d[x]);
        }
        out[i] = r;
    }
}

/* qrow [B][nh][4][Tqp]: a warp a row (8 a block; blocks (Tqp / 8, nh, B)) */
template <int HD>
__global__ void __launch_bounds__(256)
    attn_prep_rows(uint32_t *qrow, const bf16 *dout, const bf16 *out, const float *lse, const int32_t *qpos,
                   const int32_t *qdoc, int Tq, int Tqp, int nh)
{
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
    const size_t off = ((size_t)b * Tq + row) * nh * HD + (size_t)h * HD;
    const float D = row < Tq ? row_dot_warp<HD>(dout + off, out + off) : 0.0f;
    if ((threadIdx.x & 31) == 0) {
        const float L = lse_log2(lse + ((size_t)b * nh + h) * Tq, row, Tq);
        uint32_t *p = qrow + qrow_head(b, h, nh, Tqp) + row;
        p[QR_L * Tqp] = __float_as_uint(L);
        p[QR_D * Tqp] = __float_as_uint(D);
        p[QR_POS * Tqp] = (uint32_t)(L != INFINITY ? qpos[row] : INT_MIN);
        p[QR_DOC * Tqp] = (uint32_t)tok_at(doc_row(qdoc, b, Tq), row, Tq, 0);
    }
}

/* dq += scale acc, [n2] pairs (the fused backward's fp32 dQ into the bf16 gradient,
 * rounded once, as the dq kernel's frag_add_rows rounds it) */
__global__ void attn_dq_finish(bf16 *dq, const float *acc, long long n2, float scale)
{
    GRID_STRIDE(i, n2)
    {
        __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(dq) + i;
        const float2 a = reinterpret_cast<const float2 *>(acc)[i], x = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(x.x + scale * a.x, x.y + scale * a.y);
    }
}

/* The tables of a call in its scratch (qrow too when dout is given: the backward) */
template <int HD>
static AttnTables prep_tables(const AttnShape &s, const void *dout, const void *out, const float *lse,
                              cudaStream_t stream)
{
    const AttnScratchLayout l = attn_scratch_layout(s.B, s.Tq, s.Tk, s.nh, dout != nullptr, 0);
    unsigned char *base = static_cast<unsigned char *>(s.scratch);
    KeyTok *ktok = reinterpret_cast<KeyTok *>(base + l.ktok);
    TokRange *ks = reinterpret_cast<TokRange *>(base + l.kstrip), *qs = reinterpret_cast<TokRange *>(base + l.qstrip);
    uint32_t *qrow = dout ? reinterpret_cast<uint32_t *>(base + l.qrow) : nullptr;
    const long long nk = (long long)s.B * l.Tkp, nks = (long long)s.B * (l.Tkp / ATTN_STRIP),
                    nqs = (long long)s.B * (l.Tqp / ATTN_STRIP);
    if (nk > 0) {
        SMP_LAUNCH(attn_prep_keys, stride_grid(nk), 256, 0, stream, ktok, s.kpos, s.kdoc, s.Tk, l.Tkp, s.B);
        SMP_LAUNCH(attn_prep_strips, stride_grid(nks), 256, 0, stream, ks, s.kpos, s.kdoc, s.Tk, l.Tkp / ATTN_STRIP,
                   s.B);
    }
    SMP_LAUNCH(attn_prep_strips, stride_grid(nqs), 256, 0, stream, qs, s.qpos, s.qdoc, s.Tq, l.Tqp / ATTN_STRIP, s.B);
    if (dout)
        SMP_LAUNCH(attn_prep_rows<HD>, dim3(l.Tqp / 8, s.nh, s.B), 256, 0, stream, qrow, (const bf16 *)dout,
                   (const bf16 *)out, lse, s.qpos, s.qdoc, s.Tq, l.Tqp, s.nh);
    return {ktok, ks, qs, qrow, l.Tkp, l.Tqp};
}

/* ============================================================ launchers */
template <int HD, int W, int MT>
static cudaError_t fwd_mma(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                           cudaStream_t stream)
{
    auto kern = attn_fwd_mma<HD, W, MT>;
    constexpr size_t smem = fwd_smem<HD, W * MT>().bytes;
    constexpr int BQ = W * 16 * MT;
    cudaError_t e = smp_cuda_smem_optin((const void *)kern, smem, "cuda_op_attention_forward");
    if (e != cudaSuccess) return e;
    const AttnTables t = prep_tables<HD>(s, nullptr, nullptr, nullptr, stream);
    dim3 grid((s.Tq + BQ - 1) / BQ, s.nh, s.B);
    SMP_LAUNCH(kern, grid, W * 32, smem, stream, (bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v,
               s.qpos, s.qdoc, t, s.Tq, s.Tk, s.nh, s.nkv, s.window, LOG2E_F / sqrtf((float)HD));
    return smp_cuda_launched("cuda_op_attention_forward");
}
/* the shapes of cuda_op_attention_forward_shape: 8 x 16 rows, 4 x 16, 4 x 32 */
template <int HD>
static cudaError_t fwd_mma(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                           cudaStream_t stream)
{
    switch (s.fwd_shape) {
    case 1: return fwd_mma<HD, 4, 1>(out, lse, q, k, v, s, stream);
    case 2: return fwd_mma<HD, 4, 2>(out, lse, q, k, v, s, stream);
    default: return fwd_mma<HD, 8, 1>(out, lse, q, k, v, s, stream);
    }
}

template <int HD, bool FUSED, int KW>
static cudaError_t bwd_mma(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k, const void *v,
                           const void *out, const float *lse, const AttnShape &s, cudaStream_t stream)
{
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * LOG2E_F;
    auto kq = attn_bwd_dq_mma<HD>;
    auto kkv = attn_bwd_dkv_mma<HD, FUSED, KW>;
    constexpr size_t sq = dq_smem<HD>().bytes, skv = dkv_smem<HD, FUSED, KW>().bytes;
    cudaError_t e = FUSED ? cudaSuccess : smp_cuda_smem_optin((const void *)kq, sq, "cuda_op_attention_backward");
    if (e == cudaSuccess) e = smp_cuda_smem_optin((const void *)kkv, skv, "cuda_op_attention_backward");
    if (e != cudaSuccess) return e;
    const AttnTables t = prep_tables<HD>(s, dout, out, lse, stream);
    float *dqacc = nullptr;
    const long long nq = (long long)s.B * s.Tq * s.nh * HD;
    if (FUSED) {
        dqacc = reinterpret_cast<float *>(static_cast<unsigned char *>(s.scratch) +
                                          attn_scratch_layout(s.B, s.Tq, s.Tk, s.nh, true, HD).dqacc);
        e = cudaMemsetAsync(dqacc, 0, (size_t)nq * sizeof(float), stream);
        if (e != cudaSuccess) return e;
    } else {
        dim3 gq((s.Tq + BQ_BQ - 1) / BQ_BQ, s.nh, s.B);
        SMP_LAUNCH(kq, gq, BQ_WARPS * 32, sq, stream, (bf16 *)dq, (const bf16 *)dout, (const bf16 *)q, (const bf16 *)k,
                   (const bf16 *)v, t, s.Tq, s.Tk, s.nh, s.nkv, s.window, scale, scale_log2);
    }
    dim3 gkv((s.Tk + KW * 16 - 1) / (KW * 16), s.nkv, s.B);
    SMP_LAUNCH(kkv, gkv, KW * 32, skv, stream, (bf16 *)dk, (bf16 *)dv, dqacc, (const bf16 *)dout, (const bf16 *)q,
               (const bf16 *)k, (const bf16 *)v, t, s.Tq, s.Tk, s.nh, s.nkv, s.window, scale, scale_log2);
    if (FUSED) SMP_LAUNCH(attn_dq_finish, stride_grid(nq / 2), 256, 0, stream, (bf16 *)dq, dqacc, nq / 2, scale);
    return smp_cuda_launched("cuda_op_attention_backward");
}
/* the forms of cuda_op_attention_backward_form: split, fused, fused-8x16 */
template <int HD>
static cudaError_t bwd_mma(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k, const void *v,
                           const void *out, const float *lse, const AttnShape &s, cudaStream_t stream)
{
    switch (s.bwd_form) {
    case 1: return bwd_mma<HD, true, 4>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    case 2: return bwd_mma<HD, true, 8>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    default: return bwd_mma<HD, false, 4>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    }
}

cudaError_t attn_mma_forward(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                             cudaStream_t stream)
{
    switch (s.hd) {
    case 32: return fwd_mma<32>(out, lse, q, k, v, s, stream);
    case 64: return fwd_mma<64>(out, lse, q, k, v, s, stream);
    default: return fwd_mma<128>(out, lse, q, k, v, s, stream);
    }
}

cudaError_t attn_mma_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                              const void *v, const void *out, const float *lse, const AttnShape &s,
                              cudaStream_t stream)
{
    switch (s.hd) {
    case 32: return bwd_mma<32>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    case 64: return bwd_mma<64>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    default: return bwd_mma<128>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    }
}
