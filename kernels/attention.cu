/* kernels/attention.cu: causal GQA attention with log-sum-exp, flash style (CUDA).
 *
 * Contract: kernels/ops.h (op_attention_*), reference: kernels/attention.c.
 * q/out [B,Tq,nh,hd], k/v [B,Tk,nkv,hd], lse [B,nh,Tq]; query head h reads kv
 * head h / (nh/nkv); key j is visible from query i when kpos[j] <= qpos[i] and
 * (window <= 0 or qpos[i] - kpos[j] < window).
 *
 * Two implementations, one contract:
 *  - tensor cores (bf16, hd 32/64/128): FlashAttention-2's scheme with mma.sync
 *    m16n8k16. Forward: a block of 8 warps owns 128 query rows (16 per warp, Q
 *    held in registers), walks the key tiles of 64 (K and V double-buffered in
 *    shared memory by cp.async), keeps the running max and sum per row (online
 *    softmax) and the output in fp32 registers; P goes from the accumulators to the
 *    next mma's A operand in registers. Backward: two kernels, so that every
 *    gradient row has one writer and nothing needs atomics or scratch memory: one
 *    per query tile for dq (recomputing P and dP), one per key tile for dk and dv
 *    (recomputing P^T and dP^T, looping over the query heads of its kv group).
 *    D_i = dout_i . out_i is computed on the fly from out and dout.
 *  - portable fp32 (any storage dtype, hd <= 256): the same tiling in plain fp32
 *    arithmetic, one warp per row and one lane per key; used for fp32 storage (the
 *    parity tests against C) and for head sizes the tensor-core kernels lack.
 * Tiles are skipped when no (query, key) pair in them can be visible, from the
 * min/max of the positions in the tile: correct for any positions, and the causal
 * triangle and the sliding-window band for sorted ones. No S x S matrix exists. */
#include "cuda_common.cuh"

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ bool attn_visible(int qp, int kp, int window)
{
    return kp <= qp && (window <= 0 || (long long)qp - kp < window);
}
/* No pair (query in [qmin,qmax], key in [kmin,kmax]) can be visible. */
__device__ __forceinline__ bool attn_skip(int qmin, int qmax, int kmin, int kmax, int window)
{
    return kmin > qmax || (window > 0 && (long long)qmin - kmax >= window);
}
/* Every pair is visible. */
__device__ __forceinline__ bool attn_full(int qmin, int qmax, int kmin, int kmax, int window)
{
    return kmax <= qmin && (window <= 0 || (long long)qmax - kmin < window);
}
/* min and max of pos[i0 .. i0+n) restricted to i < T, over a warp (n <= 64);
 * (INT_MAX, INT_MIN) when empty. */
__device__ __forceinline__ void warp_pos_range(const int32_t *pos, int i0, int n, int T, int &pmin, int &pmax)
{
    const int lane = threadIdx.x & 31;
    int mn = INT_MAX, mx = INT_MIN;
    for (int r = lane; r < n; r += 32) {
        int i = i0 + r;
        if (i < T) {
            int p = pos[i];
            mn = imin(mn, p);
            mx = imax(mx, p);
        }
    }
    pmin = warp_min_i(mn);
    pmax = warp_max_i(mx);
}

/* ============================================================ portable fp32 */
enum { S_WARPS = 4, S_RPW = 4, S_BQ = S_WARPS * S_RPW, S_BK = 32 };

template <typename T, int NPL>
__global__ void __launch_bounds__(S_WARPS * 32)
    attn_fwd_simt(T *out, float *lse, const T *q, const T *k, const T *v, const int32_t *qpos, const int32_t *kpos,
                  int Tq, int Tk, int nh, int nkv, int hd, int window, float scale)
{
    SMP_DYN_SMEM(float, sm);
    const int ldk = hd + 1;
    float *sQ = sm;                 /* [S_BQ][hd] */
    float *sK = sQ + S_BQ * hd;     /* [S_BK][hd+1] */
    float *sV = sK + S_BK * ldk;    /* [S_BK][hd] */
    int *sKp = reinterpret_cast<int *>(sV + S_BK * hd);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = blockIdx.x * S_BQ, h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const T *qb = q + (size_t)b * Tq * qs + (size_t)h * hd;
    const T *kb = k + (size_t)b * Tk * ks + (size_t)g * hd;
    const T *vb = v + (size_t)b * Tk * ks + (size_t)g * hd;

    for (int i = tid; i < S_BQ * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, row = q0 + r;
        sQ[i] = row < Tq ? to_f(qb[(size_t)row * qs + d]) : 0.0f;
    }
    int qmin, qmax;
    warp_pos_range(qpos, q0, S_BQ, Tq, qmin, qmax);
    int qp[S_RPW];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        int row = q0 + warp * S_RPW + i;
        qp[i] = row < Tq ? qpos[row] : INT_MIN;
    }
    float o[S_RPW][NPL], m[S_RPW], l[S_RPW];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < NPL; e++) o[i][e] = 0.0f;
    }
    for (int k0 = 0; k0 < Tk; k0 += S_BK) {
        int kmin, kmax;
        warp_pos_range(kpos, k0, S_BK, Tk, kmin, kmax);
        if (attn_skip(qmin, qmax, kmin, kmax, window)) continue; /* same in every warp */
        __syncthreads(); /* the previous tile is consumed (and sQ written, the first time) */
        for (int i = tid; i < S_BK * hd; i += blockDim.x) {
            int r = i / hd, d = i % hd, key = k0 + r;
            bool ok = key < Tk;
            sK[r * ldk + d] = ok ? to_f(kb[(size_t)key * ks + d]) : 0.0f;
            sV[r * hd + d] = ok ? to_f(vb[(size_t)key * ks + d]) : 0.0f;
        }
        if (tid < S_BK) sKp[tid] = k0 + tid < Tk ? kpos[k0 + tid] : INT_MAX;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < S_RPW; i++) {
            const float *qr = sQ + (warp * S_RPW + i) * hd;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += qr[d] * sK[lane * ldk + d];
            s *= scale;
            const bool vis = attn_visible(qp[i], sKp[lane], window);
            s = vis ? s : -INFINITY;
            const float mt = warp_max(s);
            if (mt == -INFINITY) continue; /* nothing visible for this row here (warp-uniform) */
            const float mn = fmaxf(m[i], mt);
            const float alpha = expf(m[i] - mn); /* 0 when m was -inf */
            const float p = vis ? expf(s - mn) : 0.0f;
            l[i] = l[i] * alpha + warp_sum(p);
            m[i] = mn;
#pragma unroll
            for (int e = 0; e < NPL; e++) o[i][e] *= alpha;
            for (int c = 0; c < S_BK; c++) {
                const float pc = __shfl_sync(0xffffffffu, p, c);
                const float *vr = sV + c * hd;
#pragma unroll
                for (int e = 0; e < NPL; e++) {
                    int d = lane + 32 * e;
                    if (d < hd) o[i][e] += pc * vr[d];
                }
            }
        }
    }
    T *ob = out + (size_t)b * Tq * qs + (size_t)h * hd;
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int row = q0 + warp * S_RPW + i;
        if (row >= Tq) continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int e = 0; e < NPL; e++) {
            int d = lane + 32 * e;
            if (d < hd) ob[(size_t)row * qs + d] = from_f<T>(o[i][e] * inv);
        }
        if (lane == 0) lse[((size_t)b * nh + h) * Tq + row] = l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
    }
}

template <typename T, int NPL>
__global__ void __launch_bounds__(S_WARPS * 32)
    attn_bwd_dq_simt(T *dq, const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,
                     const int32_t *qpos, const int32_t *kpos, int Tq, int Tk, int nh, int nkv, int hd, int window,
                     float scale)
{
    SMP_DYN_SMEM(float, sm);
    const int ldk = hd + 1;
    float *sQ = sm;                /* [S_BQ][hd] */
    float *sG = sQ + S_BQ * hd;    /* [S_BQ][hd] dout */
    float *sK = sG + S_BQ * hd;    /* [S_BK][hd+1] */
    float *sV = sK + S_BK * ldk;   /* [S_BK][hd+1] */
    int *sKp = reinterpret_cast<int *>(sV + S_BK * ldk);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = blockIdx.x * S_BQ, h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const size_t qoff = (size_t)b * Tq * qs + (size_t)h * hd;
    const T *kb = k + (size_t)b * Tk * ks + (size_t)g * hd;
    const T *vb = v + (size_t)b * Tk * ks + (size_t)g * hd;

    for (int i = tid; i < S_BQ * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, row = q0 + r;
        bool ok = row < Tq;
        sQ[i] = ok ? to_f(q[qoff + (size_t)row * qs + d]) : 0.0f;
        sG[i] = ok ? to_f(dout[qoff + (size_t)row * qs + d]) : 0.0f;
    }
    int qmin, qmax;
    warp_pos_range(qpos, q0, S_BQ, Tq, qmin, qmax);
    int qp[S_RPW];
    float L[S_RPW], D[S_RPW], acc[S_RPW][NPL];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int row = q0 + warp * S_RPW + i;
        qp[i] = INT_MIN; /* rows past Tq and rows with lse = -inf see nothing */
        L[i] = 0.0f;
        D[i] = 0.0f;
        if (row < Tq) {
            const float Li = lse[((size_t)b * nh + h) * Tq + row];
            float dd = 0.0f;
            for (int d = lane; d < hd; d += 32)
                dd += to_f(dout[qoff + (size_t)row * qs + d]) * to_f(out[qoff + (size_t)row * qs + d]);
            D[i] = warp_sum(dd);
            if (Li != -INFINITY) {
                qp[i] = qpos[row];
                L[i] = Li;
            }
        }
#pragma unroll
        for (int e = 0; e < NPL; e++) acc[i][e] = 0.0f;
    }
    for (int k0 = 0; k0 < Tk; k0 += S_BK) {
        int kmin, kmax;
        warp_pos_range(kpos, k0, S_BK, Tk, kmin, kmax);
        if (attn_skip(qmin, qmax, kmin, kmax, window)) continue;
        __syncthreads();
        for (int i = tid; i < S_BK * hd; i += blockDim.x) {
            int r = i / hd, d = i % hd, key = k0 + r;
            bool ok = key < Tk;
            sK[r * ldk + d] = ok ? to_f(kb[(size_t)key * ks + d]) : 0.0f;
            sV[r * ldk + d] = ok ? to_f(vb[(size_t)key * ks + d]) : 0.0f;
        }
        if (tid < S_BK) sKp[tid] = k0 + tid < Tk ? kpos[k0 + tid] : INT_MAX;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < S_RPW; i++) {
            const bool vis = attn_visible(qp[i], sKp[lane], window);
            if (!__any_sync(0xffffffffu, vis)) continue;
            const float *qr = sQ + (warp * S_RPW + i) * hd, *gr = sG + (warp * S_RPW + i) * hd;
            float s = 0.0f, dp = 0.0f;
            for (int d = 0; d < hd; d++) {
                s += qr[d] * sK[lane * ldk + d];
                dp += gr[d] * sV[lane * ldk + d];
            }
            const float p = vis ? expf(s * scale - L[i]) : 0.0f;
            const float ds = p * (dp - D[i]) * scale;
            for (int c = 0; c < S_BK; c++) {
                const float dc = __shfl_sync(0xffffffffu, ds, c);
                const float *kr = sK + c * ldk;
#pragma unroll
                for (int e = 0; e < NPL; e++) {
                    int d = lane + 32 * e;
                    if (d < hd) acc[i][e] += dc * kr[d];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int row = q0 + warp * S_RPW + i;
        if (row >= Tq) continue;
        T *dr = dq + qoff + (size_t)row * qs;
#pragma unroll
        for (int e = 0; e < NPL; e++) {
            int d = lane + 32 * e;
            if (d < hd) dr[d] = from_f<T>(to_f(dr[d]) + acc[i][e]);
        }
    }
}

enum { S_BKV = S_WARPS * S_RPW, S_BQ2 = 32 };

template <typename T, int NPL>
__global__ void __launch_bounds__(S_WARPS * 32)
    attn_bwd_dkv_simt(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,
                      const int32_t *qpos, const int32_t *kpos, int Tq, int Tk, int nh, int nkv, int hd, int window,
                      float scale)
{
    SMP_DYN_SMEM(float, sm);
    const int ldq = hd + 1;
    float *sK = sm;                  /* [S_BKV][hd] this block's keys */
    float *sV = sK + S_BKV * hd;     /* [S_BKV][hd] */
    float *sQ = sV + S_BKV * hd;     /* [S_BQ2][hd+1] */
    float *sG = sQ + S_BQ2 * ldq;    /* [S_BQ2][hd+1] dout */
    float *sL = sG + S_BQ2 * ldq;    /* [S_BQ2] lse */
    float *sD = sL + S_BQ2;          /* [S_BQ2] D */
    int *sQp = reinterpret_cast<int *>(sD + S_BQ2);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int k0 = blockIdx.x * S_BKV, g = blockIdx.y, b = blockIdx.z, rep = nh / nkv;
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const size_t koff = (size_t)b * Tk * ks + (size_t)g * hd;

    for (int i = tid; i < S_BKV * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, key = k0 + r;
        bool ok = key < Tk;
        sK[i] = ok ? to_f(k[koff + (size_t)key * ks + d]) : 0.0f;
        sV[i] = ok ? to_f(v[koff + (size_t)key * ks + d]) : 0.0f;
    }
    int kmin, kmax;
    warp_pos_range(kpos, k0, S_BKV, Tk, kmin, kmax);
    int kp[S_RPW];
    float ak[S_RPW][NPL], av[S_RPW][NPL];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int key = k0 + warp * S_RPW + i;
        kp[i] = key < Tk ? kpos[key] : INT_MAX;
#pragma unroll
        for (int e = 0; e < NPL; e++) ak[i][e] = av[i][e] = 0.0f;
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const size_t qoff = (size_t)b * Tq * qs + (size_t)h * hd;
        for (int q0 = 0; q0 < Tq; q0 += S_BQ2) {
            int qmin, qmax;
            warp_pos_range(qpos, q0, S_BQ2, Tq, qmin, qmax);
            if (attn_skip(qmin, qmax, kmin, kmax, window)) continue;
            __syncthreads();
            for (int i = tid; i < S_BQ2 * hd; i += blockDim.x) {
                int r = i / hd, d = i % hd, row = q0 + r;
                bool ok = row < Tq;
                sQ[r * ldq + d] = ok ? to_f(q[qoff + (size_t)row * qs + d]) : 0.0f;
                sG[r * ldq + d] = ok ? to_f(dout[qoff + (size_t)row * qs + d]) : 0.0f;
            }
            for (int r = warp; r < S_BQ2; r += S_WARPS) { /* lse, D and position per query row */
                const int row = q0 + r;
                float dd = 0.0f, Lr = -INFINITY;
                int p = INT_MIN;
                if (row < Tq) {
                    for (int d = lane; d < hd; d += 32)
                        dd += to_f(dout[qoff + (size_t)row * qs + d]) * to_f(out[qoff + (size_t)row * qs + d]);
                    Lr = lse[((size_t)b * nh + h) * Tq + row];
                    p = Lr == -INFINITY ? INT_MIN : qpos[row];
                }
                dd = warp_sum(dd);
                if (lane == 0) {
                    sD[r] = dd;
                    sL[r] = Lr;
                    sQp[r] = p;
                }
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < S_RPW; i++) {
                const bool vis = attn_visible(sQp[lane], kp[i], window);
                if (!__any_sync(0xffffffffu, vis)) continue;
                const float *kr = sK + (warp * S_RPW + i) * hd, *vr = sV + (warp * S_RPW + i) * hd;
                float s = 0.0f, dp = 0.0f;
                for (int d = 0; d < hd; d++) {
                    s += kr[d] * sQ[lane * ldq + d];
                    dp += vr[d] * sG[lane * ldq + d];
                }
                const float p = vis ? expf(s * scale - sL[lane]) : 0.0f;
                const float ds = p * (dp - sD[lane]) * scale;
                for (int c = 0; c < S_BQ2; c++) {
                    const float pc = __shfl_sync(0xffffffffu, p, c), dc = __shfl_sync(0xffffffffu, ds, c);
                    const float *gr = sG + c * ldq, *qr = sQ + c * ldq;
#pragma unroll
                    for (int e = 0; e < NPL; e++) {
                        int d = lane + 32 * e;
                        if (d < hd) {
                            av[i][e] += pc * gr[d];
                            ak[i][e] += dc * qr[d];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int key = k0 + warp * S_RPW + i;
        if (key >= Tk) continue;
        T *dkr = dk + koff + (size_t)key * ks, *dvr = dv + koff + (size_t)key * ks;
#pragma unroll
        for (int e = 0; e < NPL; e++) {
            int d = lane + 32 * e;
            if (d < hd) {
                dkr[d] = from_f<T>(to_f(dkr[d]) + ak[i][e]);
                dvr[d] = from_f<T>(to_f(dvr[d]) + av[i][e]);
            }
        }
    }
}

/* ============================================================ tensor cores */
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

enum { F_WARPS = 8, F_BQ = F_WARPS * 16, F_BK = 64 };

template <int HD> constexpr size_t fwd_mma_smem()
{
    return (size_t)(F_BQ + 4 * F_BK) * (HD + 8) * sizeof(bf16) + 2 * F_BK * sizeof(int);
}

template <int HD>
__global__ void __launch_bounds__(F_WARPS * 32, 1)
    attn_fwd_mma(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *qpos,
                 const int32_t *kpos, int Tq, int Tk, int nh, int nkv, int window, float scale_log2)
{
    constexpr int LD = HD + 8, NT = F_BK / 8, KS = HD / 16, DT = HD / 8, NTHR = F_WARPS * 32;
    SMP_DYN_SMEM(bf16, smem);
    bf16 *sQ = smem;                 /* [F_BQ][LD] */
    bf16 *sK = sQ + F_BQ * LD;       /* [2][F_BK][LD] */
    bf16 *sV = sK + 2 * F_BK * LD;   /* [2][F_BK][LD] */
    int *sKp = reinterpret_cast<int *>(sV + 2 * F_BK * LD); /* [2][F_BK] */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x; /* the longest rows first */
    const int h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const int q0 = qt * F_BQ;
    const size_t qs = (size_t)nh * HD, ks = (size_t)nkv * HD;
    const bf16 *qb = q + (size_t)b * Tq * qs + (size_t)h * HD;
    const bf16 *kb = k + (size_t)b * Tk * ks + (size_t)g * HD;
    const bf16 *vb = v + (size_t)b * Tk * ks + (size_t)g * HD;

    load_tile_async<HD, F_BQ>(sQ, qb, qs, q0, Tq, tid, NTHR);
    cp_async_commit();

    const int r0 = q0 + warp * 16 + gq, r1 = r0 + 8;
    const int qp0 = r0 < Tq ? qpos[r0] : INT_MIN, qp1 = r1 < Tq ? qpos[r1] : INT_MIN;
    int bqmin, bqmax, wqmin, wqmax;
    warp_pos_range(qpos, q0, F_BQ, Tq, bqmin, bqmax);
    warp_pos_range(qpos, q0 + warp * 16, 16, Tq, wqmin, wqmax);

    const int nkt = (Tk + F_BK - 1) / F_BK;
    auto next_tile = [&](int j) {
        for (; j < nkt; j++) {
            int kmin, kmax;
            warp_pos_range(kpos, j * F_BK, F_BK, Tk, kmin, kmax);
            if (!attn_skip(bqmin, bqmax, kmin, kmax, window)) break;
        }
        return j;
    };
    auto load_kv = [&](int j, int buf) {
        load_tile_async<HD, F_BK>(sK + buf * F_BK * LD, kb, ks, j * F_BK, Tk, tid, NTHR);
        load_tile_async<HD, F_BK>(sV + buf * F_BK * LD, vb, ks, j * F_BK, Tk, tid, NTHR);
        for (int r = tid; r < F_BK; r += NTHR) {
            const int key = j * F_BK + r;
            sKp[buf * F_BK + r] = key < Tk ? kpos[key] : INT_MAX;
        }
    };

    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    int j = next_tile(0);
    if (j < nkt) { /* the same in every thread */
        load_kv(j, 0);
        cp_async_commit();
        cp_async_wait<1>(); /* Q has landed */
        __syncthreads();
        uint32_t qf[KS][4];
#pragma unroll
        for (int kk = 0; kk < KS; kk++) ldmatrix_x4(qf[kk], sQ + (warp * 16) * LD + kk * 16 + frag_a_off(lane, LD));
        int buf = 0;
        while (j < nkt) {
            const int jn = next_tile(j + 1);
            if (jn < nkt) load_kv(jn, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>(); /* tile j has landed */
            __syncthreads();
            int kmin, kmax;
            warp_pos_range(kpos, j * F_BK, F_BK, Tk, kmin, kmax);
            if (!attn_skip(wqmin, wqmax, kmin, kmax, window)) {
                const bool full = (j + 1) * F_BK <= Tk && attn_full(wqmin, wqmax, kmin, kmax, window);
                const bf16 *cK = sK + buf * F_BK * LD, *cV = sV + buf * F_BK * LD;
                const int *cKp = sKp + buf * F_BK;
                float s[NT][4];
#pragma unroll
                for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt += 2) {
                        uint32_t kf[4];
                        ldmatrix_x4(kf, cK + (nt * 8) * LD + kk * 16 + frag_bn_off(lane, LD));
                        mma_bf16_16816(s[nt], qf[kk], kf);
                        mma_bf16_16816(s[nt + 1], qf[kk], kf + 2);
                    }
                }
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float a = s[nt][e] * scale_log2, c = s[nt][2 + e] * scale_log2;
                        if (!full) {
                            const int kp = cKp[nt * 8 + tq * 2 + e];
                            if (!attn_visible(qp0, kp, window)) a = -INFINITY;
                            if (!attn_visible(qp1, kp, window)) c = -INFINITY;
                        }
                        s[nt][e] = a;
                        s[nt][2 + e] = c;
                        mx0 = fmaxf(mx0, a);
                        mx1 = fmaxf(mx1, c);
                    }
                }
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
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
#pragma unroll
                for (int kk = 0; kk < F_BK / 16; kk++) {
                    uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                      pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                      pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                    for (int dt = 0; dt < DT; dt += 2) {
                        uint32_t vf[4];
                        ldmatrix_x4_trans(vf, cV + (kk * 16) * LD + dt * 8 + frag_bt_off(lane, LD));
                        mma_bf16_16816(o[dt], pa, vf);
                        mma_bf16_16816(o[dt + 1], pa, vf + 2);
                    }
                }
            }
            __syncthreads(); /* buf is consumed before it is refilled */
            buf ^= 1;
            j = jn;
        }
    }
    cp_async_wait<0>();
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    bf16 *ob = out + (size_t)b * Tq * qs + (size_t)h * HD;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + tq * 2;
        if (r0 < Tq)
            *reinterpret_cast<uint32_t *>(ob + (size_t)r0 * qs + col) = pack_bf16x2(o[dt][0] * inv0, o[dt][1] * inv0);
        if (r1 < Tq)
            *reinterpret_cast<uint32_t *>(ob + (size_t)r1 * qs + col) = pack_bf16x2(o[dt][2] * inv1, o[dt][3] * inv1);
    }
    if (tq == 0) {
        float *lb = lse + ((size_t)b * nh + h) * Tq;
        if (r0 < Tq) lb[r0] = l0 > 0.0f ? (m0 + log2f(l0)) * LN2_F : -INFINITY;
        if (r1 < Tq) lb[r1] = l1 > 0.0f ? (m1 + log2f(l1)) * LN2_F : -INFINITY;
    }
}

/* ---- backward, dq: a block of 4 warps owns 64 query rows of one head */
enum { BQ_WARPS = 4, BQ_BQ = BQ_WARPS * 16 };
template <int HD> struct DqCfg { static constexpr int BK = HD >= 128 ? 32 : 64; };
template <int HD> constexpr size_t dq_mma_smem()
{
    return (size_t)(2 * BQ_BQ + 4 * DqCfg<HD>::BK) * (HD + 8) * sizeof(bf16) + 2 * DqCfg<HD>::BK * sizeof(int);
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

template <int HD>
__global__ void __launch_bounds__(BQ_WARPS * 32)
    attn_bwd_dq_mma(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *out,
                    const float *lse, const int32_t *qpos, const int32_t *kpos, int Tq, int Tk, int nh, int nkv,
                    int window, float scale, float scale_log2)
{
    constexpr int BK = DqCfg<HD>::BK, LD = HD + 8, NT = BK / 8, KS = HD / 16, DT = HD / 8, NTHR = BQ_WARPS * 32;
    SMP_DYN_SMEM(bf16, smem);
    bf16 *sQ = smem;                 /* [BQ_BQ][LD] */
    bf16 *sG = sQ + BQ_BQ * LD;      /* [BQ_BQ][LD] dout */
    bf16 *sK = sG + BQ_BQ * LD;      /* [2][BK][LD] */
    bf16 *sV = sK + 2 * BK * LD;     /* [2][BK][LD] */
    int *sKp = reinterpret_cast<int *>(sV + 2 * BK * LD);
    __shared__ float sDr[BQ_BQ];
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
    for (int r = warp * 16; r < warp * 16 + 16; r++) { /* D of this warp's rows */
        const int row = q0 + r;
        float d = row < Tq ? row_dot_warp<HD>(dout + qoff + (size_t)row * qs, out + qoff + (size_t)row * qs) : 0.0f;
        if (lane == 0) sDr[r] = d;
    }
    __syncwarp();
    const int r0 = q0 + warp * 16 + gq, r1 = r0 + 8;
    const float *lrow = lse + ((size_t)b * nh + h) * Tq;
    const float L0 = lse_log2(lrow, r0, Tq), L1 = lse_log2(lrow, r1, Tq);
    const float D0 = sDr[warp * 16 + gq], D1 = sDr[warp * 16 + gq + 8];
    const int qp0 = (r0 < Tq && L0 != INFINITY) ? qpos[r0] : INT_MIN;
    const int qp1 = (r1 < Tq && L1 != INFINITY) ? qpos[r1] : INT_MIN;
    int bqmin, bqmax, wqmin, wqmax;
    warp_pos_range(qpos, q0, BQ_BQ, Tq, bqmin, bqmax);
    warp_pos_range(qpos, q0 + warp * 16, 16, Tq, wqmin, wqmax);

    const int nkt = (Tk + BK - 1) / BK;
    auto next_tile = [&](int j) {
        for (; j < nkt; j++) {
            int kmin, kmax;
            warp_pos_range(kpos, j * BK, BK, Tk, kmin, kmax);
            if (!attn_skip(bqmin, bqmax, kmin, kmax, window)) break;
        }
        return j;
    };
    auto load_kv = [&](int j, int buf) {
        load_tile_async<HD, BK>(sK + buf * BK * LD, kb, ks, j * BK, Tk, tid, NTHR);
        load_tile_async<HD, BK>(sV + buf * BK * LD, vb, ks, j * BK, Tk, tid, NTHR);
        for (int r = tid; r < BK; r += NTHR) {
            const int key = j * BK + r;
            sKp[buf * BK + r] = key < Tk ? kpos[key] : INT_MAX;
        }
    };

    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    int j = next_tile(0);
    if (j < nkt) {
        load_kv(j, 0);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        uint32_t qf[KS][4], gf[KS][4];
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            ldmatrix_x4(qf[kk], sQ + (warp * 16) * LD + kk * 16 + frag_a_off(lane, LD));
            ldmatrix_x4(gf[kk], sG + (warp * 16) * LD + kk * 16 + frag_a_off(lane, LD));
        }
        int buf = 0;
        while (j < nkt) {
            const int jn = next_tile(j + 1);
            if (jn < nkt) load_kv(jn, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            int kmin, kmax;
            warp_pos_range(kpos, j * BK, BK, Tk, kmin, kmax);
            if (!attn_skip(wqmin, wqmax, kmin, kmax, window)) {
                const bf16 *cK = sK + buf * BK * LD, *cV = sV + buf * BK * LD;
                const int *cKp = sKp + buf * BK;
                float s[NT][4], dp[NT][4];
#pragma unroll
                for (int i = 0; i < NT; i++)
                    s[i][0] = s[i][1] = s[i][2] = s[i][3] = dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt += 2) {
                        uint32_t kf[4], vf[4];
                        ldmatrix_x4(kf, cK + (nt * 8) * LD + kk * 16 + frag_bn_off(lane, LD));
                        ldmatrix_x4(vf, cV + (nt * 8) * LD + kk * 16 + frag_bn_off(lane, LD));
                        mma_bf16_16816(s[nt], qf[kk], kf);
                        mma_bf16_16816(s[nt + 1], qf[kk], kf + 2);
                        mma_bf16_16816(dp[nt], gf[kk], vf);
                        mma_bf16_16816(dp[nt + 1], gf[kk], vf + 2);
                    }
                }
                /* dS = P (dP - D), P = exp2(s * scale_log2 - L), 0 where not visible */
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int kp = cKp[nt * 8 + tq * 2 + e];
                        const float p0 = attn_visible(qp0, kp, window) ? exp2f(s[nt][e] * scale_log2 - L0) : 0.0f;
                        const float p1 = attn_visible(qp1, kp, window) ? exp2f(s[nt][2 + e] * scale_log2 - L1) : 0.0f;
                        s[nt][e] = p0 * (dp[nt][e] - D0);
                        s[nt][2 + e] = p1 * (dp[nt][2 + e] - D1);
                    }
                }
                /* dQ += dS K */
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    uint32_t da[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                      pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                      pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                    for (int dt = 0; dt < DT; dt += 2) {
                        uint32_t kf[4];
                        ldmatrix_x4_trans(kf, cK + (kk * 16) * LD + dt * 8 + frag_bt_off(lane, LD));
                        mma_bf16_16816(acc[dt], da, kf);
                        mma_bf16_16816(acc[dt + 1], da, kf + 2);
                    }
                }
            }
            __syncthreads();
            buf ^= 1;
            j = jn;
        }
    }
    cp_async_wait<0>();
    bf16 *db = dq + qoff;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + tq * 2;
        if (r0 < Tq) {
            __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(db + (size_t)r0 * qs + col);
            float2 x = __bfloat1622float2(*p);
            *p = __floats2bfloat162_rn(x.x + scale * acc[dt][0], x.y + scale * acc[dt][1]);
        }
        if (r1 < Tq) {
            __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(db + (size_t)r1 * qs + col);
            float2 x = __bfloat1622float2(*p);
            *p = __floats2bfloat162_rn(x.x + scale * acc[dt][2], x.y + scale * acc[dt][3]);
        }
    }
}

/* ---- backward, dk and dv: a block of 4 warps owns 64 keys of one kv head */
enum { BK_WARPS = 4, BK_BKV = BK_WARPS * 16 };
template <int HD> struct DkvCfg { static constexpr int BQ = HD >= 128 ? 32 : 64; };
template <int HD> constexpr size_t dkv_mma_smem()
{
    return (size_t)(2 * BK_BKV + 4 * DkvCfg<HD>::BQ) * (HD + 8) * sizeof(bf16) + 2 * DkvCfg<HD>::BQ * 3 * sizeof(float);
}

template <int HD>
__global__ void __launch_bounds__(BK_WARPS * 32)
    attn_bwd_dkv_mma(bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                     const bf16 *out, const float *lse, const int32_t *qpos, const int32_t *kpos, int Tq, int Tk,
                     int nh, int nkv, int window, float scale, float scale_log2)
{
    constexpr int BQ = DkvCfg<HD>::BQ, LD = HD + 8, NT = BQ / 8, KS = HD / 16, DT = HD / 8, NTHR = BK_WARPS * 32;
    SMP_DYN_SMEM(bf16, smem);
    bf16 *sK = smem;                  /* [BK_BKV][LD] this block's keys */
    bf16 *sV = sK + BK_BKV * LD;      /* [BK_BKV][LD] */
    bf16 *sQ = sV + BK_BKV * LD;      /* [2][BQ][LD] */
    bf16 *sG = sQ + 2 * BQ * LD;      /* [2][BQ][LD] dout */
    float *sL = reinterpret_cast<float *>(sG + 2 * BQ * LD); /* [2][BQ] lse (log2 units, +inf: none) */
    float *sD = sL + 2 * BQ;                                 /* [2][BQ] */
    int *sQp = reinterpret_cast<int *>(sD + 2 * BQ);         /* [2][BQ] */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int k0 = blockIdx.x * BK_BKV, g = blockIdx.y, b = blockIdx.z, rep = nh / nkv;
    const size_t qs = (size_t)nh * HD, ks = (size_t)nkv * HD;
    const size_t koff = (size_t)b * Tk * ks + (size_t)g * HD;

    load_tile_async<HD, BK_BKV>(sK, k + koff, ks, k0, Tk, tid, NTHR);
    load_tile_async<HD, BK_BKV>(sV, v + koff, ks, k0, Tk, tid, NTHR);
    cp_async_commit();

    const int kr0 = k0 + warp * 16 + gq, kr1 = kr0 + 8;
    const int kp0 = kr0 < Tk ? kpos[kr0] : INT_MAX, kp1 = kr1 < Tk ? kpos[kr1] : INT_MAX;
    int bkmin, bkmax, wkmin, wkmax;
    warp_pos_range(kpos, k0, BK_BKV, Tk, bkmin, bkmax);
    warp_pos_range(kpos, k0 + warp * 16, 16, Tk, wkmin, wkmax);

    const int nqt = (Tq + BQ - 1) / BQ, nitems = rep * nqt;
    /* item i: query head g*rep + i/nqt, query tile i%nqt */
    auto next_item = [&](int i) {
        for (; i < nitems; i++) {
            int qmin, qmax;
            warp_pos_range(qpos, (i % nqt) * BQ, BQ, Tq, qmin, qmax);
            if (!attn_skip(qmin, qmax, bkmin, bkmax, window)) break;
        }
        return i;
    };
    auto load_q = [&](int i, int buf) {
        const int h = g * rep + i / nqt, qt0 = (i % nqt) * BQ;
        const size_t qoff = (size_t)b * Tq * qs + (size_t)h * HD;
        load_tile_async<HD, BQ>(sQ + buf * BQ * LD, q + qoff, qs, qt0, Tq, tid, NTHR);
        load_tile_async<HD, BQ>(sG + buf * BQ * LD, dout + qoff, qs, qt0, Tq, tid, NTHR);
        const float *lrow = lse + ((size_t)b * nh + h) * Tq;
        for (int r = warp; r < BQ; r += BK_WARPS) {
            const int row = qt0 + r;
            const float d =
                row < Tq ? row_dot_warp<HD>(dout + qoff + (size_t)row * qs, out + qoff + (size_t)row * qs) : 0.0f;
            if (lane == 0) {
                const float L = lse_log2(lrow, row, Tq);
                sD[buf * BQ + r] = d;
                sL[buf * BQ + r] = L;
                sQp[buf * BQ + r] = (row < Tq && L != INFINITY) ? qpos[row] : INT_MIN;
            }
        }
    };

    float ak[DT][4], av[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) ak[i][0] = ak[i][1] = ak[i][2] = ak[i][3] = av[i][0] = av[i][1] = av[i][2] = av[i][3] = 0.0f;

    int it = next_item(0);
    if (it < nitems) {
        load_q(it, 0);
        cp_async_commit();
        int buf = 0;
        while (it < nitems) {
            const int in = next_item(it + 1);
            if (in < nitems) load_q(in, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>(); /* K, V and item it have landed */
            __syncthreads();
            int qmin, qmax;
            warp_pos_range(qpos, (it % nqt) * BQ, BQ, Tq, qmin, qmax);
            if (!attn_skip(qmin, qmax, wkmin, wkmax, window)) {
                const bf16 *cQ = sQ + buf * BQ * LD, *cG = sG + buf * BQ * LD;
                const float *cL = sL + buf * BQ, *cD = sD + buf * BQ;
                const int *cQp = sQp + buf * BQ;
                float s[NT][4], dp[NT][4];
#pragma unroll
                for (int i = 0; i < NT; i++)
                    s[i][0] = s[i][1] = s[i][2] = s[i][3] = dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
                /* S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x BQ queries) */
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
                    uint32_t kf[4], vf[4];
                    ldmatrix_x4(kf, sK + (warp * 16) * LD + kk * 16 + frag_a_off(lane, LD));
                    ldmatrix_x4(vf, sV + (warp * 16) * LD + kk * 16 + frag_a_off(lane, LD));
#pragma unroll
                    for (int nt = 0; nt < NT; nt += 2) {
                        uint32_t qf[4], gf[4];
                        ldmatrix_x4(qf, cQ + (nt * 8) * LD + kk * 16 + frag_bn_off(lane, LD));
                        ldmatrix_x4(gf, cG + (nt * 8) * LD + kk * 16 + frag_bn_off(lane, LD));
                        mma_bf16_16816(s[nt], kf, qf);
                        mma_bf16_16816(s[nt + 1], kf, qf + 2);
                        mma_bf16_16816(dp[nt], vf, gf);
                        mma_bf16_16816(dp[nt + 1], vf, gf + 2);
                    }
                }
                /* P^T and dS^T = P^T (dP^T - D) in place of s and dp */
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int c = nt * 8 + tq * 2 + e;
                        const int qp = cQp[c];
                        const float L = cL[c], D = cD[c];
                        const float p0 = attn_visible(qp, kp0, window) ? exp2f(s[nt][e] * scale_log2 - L) : 0.0f;
                        const float p1 = attn_visible(qp, kp1, window) ? exp2f(s[nt][2 + e] * scale_log2 - L) : 0.0f;
                        s[nt][e] = p0;
                        s[nt][2 + e] = p1;
                        dp[nt][e] = p0 * (dp[nt][e] - D);
                        dp[nt][2 + e] = p1 * (dp[nt][2 + e] - D);
                    }
                }
                /* dV += P^T dO, dK += dS^T Q */
#pragma unroll
                for (int kk = 0; kk < BQ / 16; kk++) {
                    uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                      pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                      pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                    uint32_t da[4] = {pack_bf16x2(dp[2 * kk][0], dp[2 * kk][1]), pack_bf16x2(dp[2 * kk][2], dp[2 * kk][3]),
                                      pack_bf16x2(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                      pack_bf16x2(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
                    for (int dt = 0; dt < DT; dt += 2) {
                        uint32_t gf[4], qf[4];
                        ldmatrix_x4_trans(gf, cG + (kk * 16) * LD + dt * 8 + frag_bt_off(lane, LD));
                        ldmatrix_x4_trans(qf, cQ + (kk * 16) * LD + dt * 8 + frag_bt_off(lane, LD));
                        mma_bf16_16816(av[dt], pa, gf);
                        mma_bf16_16816(av[dt + 1], pa, gf + 2);
                        mma_bf16_16816(ak[dt], da, qf);
                        mma_bf16_16816(ak[dt + 1], da, qf + 2);
                    }
                }
            }
            __syncthreads();
            buf ^= 1;
            it = in;
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + tq * 2;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int key = hr ? kr1 : kr0;
            if (key >= Tk) continue;
            __nv_bfloat162 *pk = reinterpret_cast<__nv_bfloat162 *>(dk + koff + (size_t)key * ks + col);
            __nv_bfloat162 *pv = reinterpret_cast<__nv_bfloat162 *>(dv + koff + (size_t)key * ks + col);
            float2 xk = __bfloat1622float2(*pk), xv = __bfloat1622float2(*pv);
            *pk = __floats2bfloat162_rn(xk.x + scale * ak[dt][2 * hr], xk.y + scale * ak[dt][2 * hr + 1]);
            *pv = __floats2bfloat162_rn(xv.x + av[dt][2 * hr], xv.y + av[dt][2 * hr + 1]);
        }
    }
}

/* ============================================================ merge */
template <typename T>
__global__ void attn_merge_kernel(T *out, float *lse, const T *out2, const float *lse2, int Tn, int nh, int hd,
                                  size_t rows)
{
    /* one warp per (b, t, h) row */
    const size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= rows) return;
    const size_t h = w % nh, t = (w / nh) % Tn, b = w / ((size_t)nh * Tn);
    float *L1 = lse + (b * nh + h) * Tn + t;
    const float l1 = *L1, l2 = lse2[(b * nh + h) * Tn + t];
    T *o = out + w * hd;
    const T *o2 = out2 + w * hd;
    __syncwarp(); /* every lane has read *L1 before lane 0 rewrites it */
    if (l2 == -INFINITY) return; /* the other part saw no key: keep ours */
    if (l1 == -INFINITY) {
        for (int d = lane; d < hd; d += 32) o[d] = o2[d];
        if (lane == 0) *L1 = l2;
        return;
    }
    const float mx = fmaxf(l1, l2);
    const float w1 = expf(l1 - mx), w2 = expf(l2 - mx), sum = w1 + w2;
    const float a1 = w1 / sum, a2 = w2 / sum;
    for (int d = lane; d < hd; d += 32) o[d] = from_f<T>(a1 * to_f(o[d]) + a2 * to_f(o2[d]));
    if (lane == 0) *L1 = mx + logf(sum);
}

/* ============================================================ launchers */
static size_t simt_fwd_smem(int hd) { return ((size_t)S_BQ * hd + (size_t)S_BK * (hd + 1) + (size_t)S_BK * hd + S_BK) * 4; }
static size_t simt_dq_smem(int hd) { return ((size_t)2 * S_BQ * hd + (size_t)2 * S_BK * (hd + 1) + S_BK) * 4; }
static size_t simt_dkv_smem(int hd) { return ((size_t)2 * S_BKV * hd + (size_t)2 * S_BQ2 * (hd + 1) + 3 * S_BQ2) * 4; }

#define ATTN_ARGS_CHECK()                                                                                         \
    SMP_ARG(B >= 0 && Tq >= 0 && Tk >= 0 && nh > 0 && nkv > 0 && nh % nkv == 0 && hd > 0 && hd <= 256,          \
            "bad shape B=%d Tq=%d Tk=%d nh=%d nkv=%d hd=%d (nh a multiple of nkv, hd <= 256)", B, Tq, Tk, nh, nkv, \
            hd);                                                                                                  \
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);                                \
    SMP_ARG(B <= 65535 && nh <= 65535, "B=%d or nh=%d exceeds the grid", B, nh)

static int npl_for(int hd) { return hd <= 32 ? 1 : hd <= 64 ? 2 : hd <= 128 ? 4 : 8; }

template <typename T, int NPL>
static cudaError_t fwd_simt(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *qpos,
                            const int32_t *kpos, int B, int Tq, int Tk, int nh, int nkv, int hd, int window,
                            cudaStream_t stream)
{
    auto kern = attn_fwd_simt<T, NPL>;
    const size_t smem = simt_fwd_smem(hd);
    cudaError_t e = smp_cuda_smem_optin((const void *)kern, smem, "cuda_op_attention_forward");
    if (e != cudaSuccess) return e;
    dim3 grid((Tq + S_BQ - 1) / S_BQ, nh, B);
    SMP_LAUNCH(kern, grid, S_WARPS * 32, smem, stream, (T *)out, lse, (const T *)q, (const T *)k, (const T *)v, qpos,
               kpos, Tq, Tk, nh, nkv, hd, window, 1.0f / sqrtf((float)hd));
    return smp_cuda_launched("cuda_op_attention_forward");
}

template <typename T, int NPL>
static cudaError_t bwd_simt(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                            const void *v, const void *out, const float *lse, const int32_t *qpos, const int32_t *kpos,
                            int B, int Tq, int Tk, int nh, int nkv, int hd, int window, cudaStream_t stream)
{
    const float scale = 1.0f / sqrtf((float)hd);
    auto kq = attn_bwd_dq_simt<T, NPL>;
    auto kkv = attn_bwd_dkv_simt<T, NPL>;
    cudaError_t e = smp_cuda_smem_optin((const void *)kq, simt_dq_smem(hd), "cuda_op_attention_backward");
    if (e == cudaSuccess) e = smp_cuda_smem_optin((const void *)kkv, simt_dkv_smem(hd), "cuda_op_attention_backward");
    if (e != cudaSuccess) return e;
    if (Tq > 0) {
        dim3 grid((Tq + S_BQ - 1) / S_BQ, nh, B);
        SMP_LAUNCH(kq, grid, S_WARPS * 32, simt_dq_smem(hd), stream, (T *)dq, (const T *)dout, (const T *)q,
                   (const T *)k, (const T *)v, (const T *)out, lse, qpos, kpos, Tq, Tk, nh, nkv, hd, window, scale);
    }
    if (Tk > 0) {
        dim3 grid((Tk + S_BKV - 1) / S_BKV, nkv, B);
        SMP_LAUNCH(kkv, grid, S_WARPS * 32, simt_dkv_smem(hd), stream, (T *)dk, (T *)dv, (const T *)dout,
                   (const T *)q, (const T *)k, (const T *)v, (const T *)out, lse, qpos, kpos, Tq, Tk, nh, nkv, hd,
                   window, scale);
    }
    return smp_cuda_launched("cuda_op_attention_backward");
}

template <typename T>
static cudaError_t fwd_simt_any(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *qpos,
                                const int32_t *kpos, int B, int Tq, int Tk, int nh, int nkv, int hd, int window,
                                cudaStream_t stream)
{
    switch (npl_for(hd)) {
    case 1: return fwd_simt<T, 1>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    case 2: return fwd_simt<T, 2>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    case 4: return fwd_simt<T, 4>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    default: return fwd_simt<T, 8>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    }
}

template <typename T>
static cudaError_t bwd_simt_any(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                                const void *v, const void *out, const float *lse, const int32_t *qpos,
                                const int32_t *kpos, int B, int Tq, int Tk, int nh, int nkv, int hd, int window,
                                cudaStream_t stream)
{
    switch (npl_for(hd)) {
    case 1: return bwd_simt<T, 1>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    case 2: return bwd_simt<T, 2>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    case 4: return bwd_simt<T, 4>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    default: return bwd_simt<T, 8>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
    }
}

template <int HD>
static cudaError_t fwd_mma(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *qpos,
                           const int32_t *kpos, int B, int Tq, int Tk, int nh, int nkv, int window, cudaStream_t stream)
{
    auto kern = attn_fwd_mma<HD>;
    constexpr size_t smem = fwd_mma_smem<HD>();
    cudaError_t e = smp_cuda_smem_optin((const void *)kern, smem, "cuda_op_attention_forward");
    if (e != cudaSuccess) return e;
    dim3 grid((Tq + F_BQ - 1) / F_BQ, nh, B);
    SMP_LAUNCH(kern, grid, F_WARPS * 32, smem, stream, (bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k,
               (const bf16 *)v, qpos, kpos, Tq, Tk, nh, nkv, window, LOG2E_F / sqrtf((float)HD));
    return smp_cuda_launched("cuda_op_attention_forward");
}

template <int HD>
static cudaError_t bwd_mma(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k, const void *v,
                           const void *out, const float *lse, const int32_t *qpos, const int32_t *kpos, int B, int Tq,
                           int Tk, int nh, int nkv, int window, cudaStream_t stream)
{
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * LOG2E_F;
    auto kq = attn_bwd_dq_mma<HD>;
    auto kkv = attn_bwd_dkv_mma<HD>;
    constexpr size_t sq = dq_mma_smem<HD>(), skv = dkv_mma_smem<HD>();
    cudaError_t e = smp_cuda_smem_optin((const void *)kq, sq, "cuda_op_attention_backward");
    if (e == cudaSuccess) e = smp_cuda_smem_optin((const void *)kkv, skv, "cuda_op_attention_backward");
    if (e != cudaSuccess) return e;
    if (Tq > 0) {
        dim3 grid((Tq + BQ_BQ - 1) / BQ_BQ, nh, B);
        SMP_LAUNCH(kq, grid, BQ_WARPS * 32, sq, stream, (bf16 *)dq, (const bf16 *)dout, (const bf16 *)q,
                   (const bf16 *)k, (const bf16 *)v, (const bf16 *)out, lse, qpos, kpos, Tq, Tk, nh, nkv, window, scale,
                   scale_log2);
    }
    if (Tk > 0) {
        dim3 grid((Tk + BK_BKV - 1) / BK_BKV, nkv, B);
        SMP_LAUNCH(kkv, grid, BK_WARPS * 32, skv, stream, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                   (const bf16 *)k, (const bf16 *)v, (const bf16 *)out, lse, qpos, kpos, Tq, Tk, nh, nkv, window,
                   scale, scale_log2);
    }
    return smp_cuda_launched("cuda_op_attention_backward");
}

static bool use_mma(cudaDataType_t dt, int hd, const void *a, const void *b, const void *c, const void *d,
                    const void *e, const void *f)
{
    if (dt != CUDA_R_16BF || !(hd == 32 || hd == 64 || hd == 128)) return false;
    return smp_aligned16(a) && smp_aligned16(b) && smp_aligned16(c) && smp_aligned16(d) && smp_aligned16(e) &&
           smp_aligned16(f);
}

extern "C" cudaError_t cuda_op_attention_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                                 const int32_t *qpos, const int32_t *kpos, int B, int Tq, int Tk,
                                                 int nh, int nkv, int hd, int window, cudaDataType_t dt,
                                                 cudaStream_t stream)
{
    ATTN_ARGS_CHECK();
    if (B == 0 || Tq == 0) return cudaSuccess;
    SMP_ARG(out && lse && q && qpos && (Tk == 0 || (k && v && kpos)), "NULL pointer");
    SMP_ARG((Tq + S_BQ - 1) / S_BQ <= INT_MAX, "Tq=%d too large", Tq);
    if (use_mma(dt, hd, out, q, k, v, q, q)) {
        switch (hd) {
        case 32: return fwd_mma<32>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        case 64: return fwd_mma<64>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        default: return fwd_mma<128>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        }
    }
    return dt == CUDA_R_32F ? fwd_simt_any<float>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream)
                            : fwd_simt_any<bf16>(out, lse, q, k, v, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
}

extern "C" cudaError_t cuda_op_attention_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                                  const void *k, const void *v, const void *out, const float *lse,
                                                  const int32_t *qpos, const int32_t *kpos, int B, int Tq, int Tk,
                                                  int nh, int nkv, int hd, int window, cudaDataType_t dt,
                                                  cudaStream_t stream)
{
    ATTN_ARGS_CHECK();
    if (B == 0 || Tq == 0 || Tk == 0) return cudaSuccess;
    SMP_ARG(dq && dk && dv && dout && q && k && v && out && lse && qpos && kpos, "NULL pointer");
    if (use_mma(dt, hd, dq, dk, dv, dout, q, k) && use_mma(dt, hd, v, out, q, q, q, q)) {
        switch (hd) {
        case 32: return bwd_mma<32>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        case 64: return bwd_mma<64>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        default: return bwd_mma<128>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, window, stream);
        }
    }
    return dt == CUDA_R_32F
               ? bwd_simt_any<float>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream)
               : bwd_simt_any<bf16>(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, B, Tq, Tk, nh, nkv, hd, window, stream);
}

extern "C" cudaError_t cuda_op_attention_merge(void *out, float *lse, const void *out2, const float *lse2, int B, int T,
                                               int nh, int hd, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(B >= 0 && T >= 0 && nh > 0 && hd > 0, "bad shape B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    const size_t rows = (size_t)B * T * nh;
    if (rows == 0) return cudaSuccess;
    SMP_ARG(out && lse && out2 && lse2, "NULL pointer");
    const unsigned grid = (unsigned)((rows * 32 + 255) / 256);
    if (dt == CUDA_R_32F) {
        SMP_LAUNCH(attn_merge_kernel<float>, grid, 256, 0, stream, (float *)out, lse, (const float *)out2, lse2, T, nh,
                   hd, rows);
    } else {
        SMP_LAUNCH(attn_merge_kernel<bf16>, grid, 256, 0, stream, (bf16 *)out, lse, (const bf16 *)out2, lse2, T, nh, hd,
                   rows);
    }
    return smp_cuda_launched("cuda_op_attention_merge");
}
