/* kernels/attention_simt.cu: the portable attention kernels (fp32 arithmetic, fp32 or
 * bf16 storage, any hd <= 256): one warp per row and one lane per key, the tiles of
 * attention_mma.cu without tensor cores (attention_common.cuh describes both); and
 * the log-sum-exp merge of two partial results. */
#include "attention_common.cuh"

/* The shared memory of the three kernels: fp32 tiles, rows padded to hd + 1 where a
 * lane reads a row of its own.
 * Q [S_BQ][hd], K [S_BK][hd+1], V [S_BK][hd], key positions and documents [S_BK] */
__host__ __device__ inline SmemParts<5> simt_fwd_smem(int hd)
{
    return {{S_BQ * hd, S_BK * (hd + 1), S_BK * hd, S_BK, S_BK}};
}
/* Q, dout [S_BQ][hd], K, V [S_BK][hd+1], key positions and documents [S_BK] */
__host__ __device__ inline SmemParts<6> simt_dq_smem(int hd)
{
    return {{S_BQ * hd, S_BQ * hd, S_BK * (hd + 1), S_BK * (hd + 1), S_BK, S_BK}};
}
/* K, V [S_BKV][hd], Q, dout [S_BQ2][hd+1]; lse, D, query positions and documents [S_BQ2] */
__host__ __device__ inline SmemParts<8> simt_dkv_smem(int hd)
{
    return {{S_BKV * hd, S_BKV * hd, S_BQ2 * (hd + 1), S_BQ2 * (hd + 1), S_BQ2, S_BQ2, S_BQ2, S_BQ2}};
}

/* Key tile k0.. into the shared positions sKp and documents sKd (by the first S_BK threads) */
__device__ __forceinline__ void simt_load_key_toks(int *sKp, int *sKd, const int32_t *kpos, const int32_t *kdoc,
                                                   int k0, int Tk)
{
    const int t = threadIdx.x;
    if (t < S_BK) {
        sKp[t] = tok_at(kpos, k0 + t, Tk, INT_MAX);
        sKd[t] = tok_at(kdoc, k0 + t, Tk, 0);
    }
}

template <typename T, int NPL>
__global__ void __launch_bounds__(S_WARPS * 32)
    attn_fwd_simt(T *out, float *lse, const T *q, const T *k, const T *v, const int32_t *qpos, const int32_t *kpos,
                  const int32_t *qdoc, const int32_t *kdoc, int Tq, int Tk, int nh, int nkv, int hd, int window,
                  float scale)
{
    SMP_DYN_SMEM(float, sm);
    const SmemParts<5> P = simt_fwd_smem(hd);
    float *sQ = sm, *sK = sQ + P.n[0], *sV = sK + P.n[1];
    int *sKp = reinterpret_cast<int *>(sV + P.n[2]), *sKd = sKp + P.n[3];
    const int ldk = hd + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = blockIdx.x * S_BQ, h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const T *qb = q + (size_t)b * Tq * qs + (size_t)h * hd;
    const T *kb = k + (size_t)b * Tk * ks + (size_t)g * hd;
    const T *vb = v + (size_t)b * Tk * ks + (size_t)g * hd;

    qdoc = doc_row(qdoc, b, Tq);
    kdoc = doc_row(kdoc, b, Tk);
    simt_load_rows(sQ, hd, qb, qs, q0, S_BQ, Tq, hd);
    __shared__ TokRange sR[S_WARPS];
    const TokRange &qr = sR[warp];
    warp_keep(sR[warp], warp_tok_range(qpos, qdoc, q0, S_BQ, Tq));
    int qp[S_RPW], qd[S_RPW];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        int row = q0 + warp * S_RPW + i;
        qp[i] = tok_at(qpos, row, Tq, INT_MIN);
        qd[i] = tok_at(qdoc, row, Tq, 0);
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
        if (keys_hidden(kpos, kdoc, k0, S_BK, Tk, qr, window)) continue; /* same in every warp */
        __syncthreads(); /* the previous tile is consumed (and sQ written, the first time) */
        simt_load_rows2(sK, ldk, kb, sV, hd, vb, ks, k0, S_BK, Tk, hd);
        simt_load_key_toks(sKp, sKd, kpos, kdoc, k0, Tk);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < S_RPW; i++) {
            const float *qrow = sQ + (warp * S_RPW + i) * hd;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += qrow[d] * sK[lane * ldk + d];
            s *= scale;
            const bool vis = attn_visible(qp[i], sKp[lane], qd[i], sKd[lane], window);
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
            simt_acc_rows<S_BK>(o[i], p, sV, hd, hd);
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
                     const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc, int Tq,
                     int Tk, int nh, int nkv, int hd, int window, float scale)
{
    SMP_DYN_SMEM(float, sm);
    const SmemParts<6> P = simt_dq_smem(hd);
    float *sQ = sm, *sG = sQ + P.n[0], *sK = sG + P.n[1], *sV = sK + P.n[2];
    int *sKp = reinterpret_cast<int *>(sV + P.n[3]), *sKd = sKp + P.n[4];
    const int ldk = hd + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = blockIdx.x * S_BQ, h = blockIdx.y, b = blockIdx.z, g = h / (nh / nkv);
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const size_t qoff = (size_t)b * Tq * qs + (size_t)h * hd;
    const T *kb = k + (size_t)b * Tk * ks + (size_t)g * hd;
    const T *vb = v + (size_t)b * Tk * ks + (size_t)g * hd;

    qdoc = doc_row(qdoc, b, Tq);
    kdoc = doc_row(kdoc, b, Tk);
    simt_load_rows2(sQ, hd, q + qoff, sG, hd, dout + qoff, qs, q0, S_BQ, Tq, hd);
    __shared__ TokRange sR[S_WARPS];
    const TokRange &qr = sR[warp];
    warp_keep(sR[warp], warp_tok_range(qpos, qdoc, q0, S_BQ, Tq));
    int qp[S_RPW], qd[S_RPW];
    float L[S_RPW], D[S_RPW], acc[S_RPW][NPL];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int row = q0 + warp * S_RPW + i;
        qp[i] = INT_MIN; /* rows past Tq and rows with lse = -inf see nothing */
        qd[i] = tok_at(qdoc, row, Tq, 0);
        L[i] = 0.0f;
        D[i] = 0.0f;
        if (row < Tq) {
            const float Li = lse[((size_t)b * nh + h) * Tq + row];
            D[i] = simt_row_dot(dout + qoff + (size_t)row * qs, out + qoff + (size_t)row * qs, hd);
            if (Li != -INFINITY) {
                qp[i] = qpos[row];
                L[i] = Li;
            }
        }
#pragma unroll
        for (int e = 0; e < NPL; e++) acc[i][e] = 0.0f;
    }
    for (int k0 = 0; k0 < Tk; k0 += S_BK) {
        if (keys_hidden(kpos, kdoc, k0, S_BK, Tk, qr, window)) continue;
        __syncthreads();
        simt_load_rows2(sK, ldk, kb, sV, ldk, vb, ks, k0, S_BK, Tk, hd);
        simt_load_key_toks(sKp, sKd, kpos, kdoc, k0, Tk);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < S_RPW; i++) {
            const float *qrow = sQ + (warp * S_RPW + i) * hd, *gr = sG + (warp * S_RPW + i) * hd;
            float p, ds;
            if (!simt_p_ds(qp[i], sKp[lane], qd[i], sKd[lane], window, qrow, sK + lane * ldk, gr, sV + lane * ldk, hd,
                           L[i], D[i], scale, p, ds))
                continue;
            simt_acc_rows<S_BK>(acc[i], ds, sK, ldk, hd);
        }
    }
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int row = q0 + warp * S_RPW + i;
        if (row < Tq) simt_add_row(dq + qoff + (size_t)row * qs, acc[i], hd);
    }
}

template <typename T, int NPL>
__global__ void __launch_bounds__(S_WARPS * 32)
    attn_bwd_dkv_simt(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,
                      const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc, int Tq,
                      int Tk, int nh, int nkv, int hd, int window, float scale)
{
    SMP_DYN_SMEM(float, sm);
    const SmemParts<8> P = simt_dkv_smem(hd);
    float *sK = sm, *sV = sK + P.n[0], *sQ = sV + P.n[1], *sG = sQ + P.n[2];
    float *sL = sG + P.n[3], *sD = sL + P.n[4];
    int *sQp = reinterpret_cast<int *>(sD + P.n[5]), *sQd = sQp + P.n[6];
    const int ldq = hd + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int k0 = blockIdx.x * S_BKV, g = blockIdx.y, b = blockIdx.z, rep = nh / nkv;
    const size_t qs = (size_t)nh * hd, ks = (size_t)nkv * hd;
    const size_t koff = (size_t)b * Tk * ks + (size_t)g * hd;

    qdoc = doc_row(qdoc, b, Tq);
    kdoc = doc_row(kdoc, b, Tk);
    simt_load_rows2(sK, hd, k + koff, sV, hd, v + koff, ks, k0, S_BKV, Tk, hd);
    __shared__ TokRange sR[S_WARPS];
    const TokRange &kr = sR[warp];
    warp_keep(sR[warp], warp_tok_range(kpos, kdoc, k0, S_BKV, Tk));
    int kp[S_RPW], kd[S_RPW];
    float ak[S_RPW][NPL], av[S_RPW][NPL];
#pragma unroll
    for (int i = 0; i < S_RPW; i++) {
        const int key = k0 + warp * S_RPW + i;
        kp[i] = tok_at(kpos, key, Tk, INT_MAX);
        kd[i] = tok_at(kdoc, key, Tk, 0);
#pragma unroll
        for (int e = 0; e < NPL; e++) ak[i][e] = av[i][e] = 0.0f;
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const size_t qoff = (size_t)b * Tq * qs + (size_t)h * hd;
        for (int q0 = 0; q0 < Tq; q0 += S_BQ2) {
            if (queries_hidden(qpos, qdoc, q0, S_BQ2, Tq, kr, window)) continue;
            __syncthreads();
            simt_load_rows2(sQ, ldq, q + qoff, sG, ldq, dout + qoff, qs, q0, S_BQ2, Tq, hd);
            for (int r = warp; r < S_BQ2; r += S_WARPS) { /* lse, D and position per query row */
                const int row = q0 + r;
                float dd = 0.0f, Lr = -INFINITY;
                int p = INT_MIN;
                if (row < Tq) {
                    dd = simt_row_dot(dout + qoff + (size_t)row * qs, out + qoff + (size_t)row * qs, hd);
                    Lr = lse[((size_t)b * nh + h) * Tq + row];
                    p = Lr == -INFINITY ? INT_MIN : qpos[row];
                }
                if (lane == 0) {
                    sD[r] = dd;
                    sL[r] = Lr;
                    sQp[r] = p;
                    sQd[r] = tok_at(qdoc, row, Tq, 0);
                }
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < S_RPW; i++) {
                const float *krow = sK + (warp * S_RPW + i) * hd, *vr = sV + (warp * S_RPW + i) * hd;
                float p, ds;
                if (!simt_p_ds(sQp[lane], kp[i], sQd[lane], kd[i], window, krow, sQ + lane * ldq, vr, sG + lane * ldq,
                               hd, sL[lane], sD[lane], scale, p, ds))
                    continue;
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
        simt_add_row(dk + koff + (size_t)key * ks, ak[i], hd);
        simt_add_row(dv + koff + (size_t)key * ks, av[i], hd);
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
/* The instance for hd: NPL output columns per lane */
template <typename K> static K for_hd(int hd, K npl1, K npl2, K npl4, K npl8)
{
    return hd <= 32 ? npl1 : hd <= 64 ? npl2 : hd <= 128 ? npl4 : npl8;
}

template <typename T>
static cudaError_t fwd_simt(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                            cudaStream_t stream)
{
    auto kern = for_hd(s.hd, attn_fwd_simt<T, 1>, attn_fwd_simt<T, 2>, attn_fwd_simt<T, 4>, attn_fwd_simt<T, 8>);
    const size_t smem = simt_fwd_smem(s.hd).bytes();
    cudaError_t e = smp_cuda_smem_optin((const void *)kern, smem, "cuda_op_attention_forward");
    if (e != cudaSuccess) return e;
    dim3 grid((s.Tq + S_BQ - 1) / S_BQ, s.nh, s.B);
    SMP_LAUNCH(kern, grid, S_WARPS * 32, smem, stream, (T *)out, lse, (const T *)q, (const T *)k, (const T *)v, s.qpos,
               s.kpos, s.qdoc, s.kdoc, s.Tq, s.Tk, s.nh, s.nkv, s.hd, s.window, 1.0f / sqrtf((float)s.hd));
    return smp_cuda_launched("cuda_op_attention_forward");
}

template <typename T>
static cudaError_t bwd_simt(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                            const void *v, const void *out, const float *lse, const AttnShape &s, cudaStream_t stream)
{
    const float scale = 1.0f / sqrtf((float)s.hd);
    auto kq = for_hd(s.hd, attn_bwd_dq_simt<T, 1>, attn_bwd_dq_simt<T, 2>, attn_bwd_dq_simt<T, 4>,
                     attn_bwd_dq_simt<T, 8>);
    auto kkv = for_hd(s.hd, attn_bwd_dkv_simt<T, 1>, attn_bwd_dkv_simt<T, 2>, attn_bwd_dkv_simt<T, 4>,
                      attn_bwd_dkv_simt<T, 8>);
    const size_t sq = simt_dq_smem(s.hd).bytes(), skv = simt_dkv_smem(s.hd).bytes();
    cudaError_t e = smp_cuda_smem_optin((const void *)kq, sq, "cuda_op_attention_backward");
    if (e == cudaSuccess) e = smp_cuda_smem_optin((const void *)kkv, skv, "cuda_op_attention_backward");
    if (e != cudaSuccess) return e;
    if (s.Tq > 0) {
        dim3 grid((s.Tq + S_BQ - 1) / S_BQ, s.nh, s.B);
        SMP_LAUNCH(kq, grid, S_WARPS * 32, sq, stream, (T *)dq, (const T *)dout, (const T *)q, (const T *)k,
                   (const T *)v, (const T *)out, lse, s.qpos, s.kpos, s.qdoc, s.kdoc, s.Tq, s.Tk, s.nh, s.nkv, s.hd,
                   s.window, scale);
    }
    if (s.Tk > 0) {
        dim3 grid((s.Tk + S_BKV - 1) / S_BKV, s.nkv, s.B);
        SMP_LAUNCH(kkv, grid, S_WARPS * 32, skv, stream, (T *)dk, (T *)dv, (const T *)dout, (const T *)q,
                   (const T *)k, (const T *)v, (const T *)out, lse, s.qpos, s.kpos, s.qdoc, s.kdoc, s.Tq, s.Tk, s.nh,
                   s.nkv, s.hd, s.window, scale);
    }
    return smp_cuda_launched("cuda_op_attention_backward");
}

cudaError_t attn_simt_forward(void *out, float *lse, const void *q, const void *k, const void *v, const AttnShape &s,
                              cudaDataType_t dt, cudaStream_t stream)
{
    return dt == CUDA_R_32F ? fwd_simt<float>(out, lse, q, k, v, s, stream)
                            : fwd_simt<bf16>(out, lse, q, k, v, s, stream);
}

cudaError_t attn_simt_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                               const void *v, const void *out, const float *lse, const AttnShape &s,
                               cudaDataType_t dt, cudaStream_t stream)
{
    return dt == CUDA_R_32F ? bwd_simt<float>(dq, dk, dv, dout, q, k, v, out, lse, s, stream)
                            : bwd_simt<bf16>(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
}

cudaError_t attn_simt_merge(void *out, float *lse, const void *out2, const float *lse2, int T, int nh, int hd,
                            size_t rows, cudaDataType_t dt, cudaStream_t stream)
{
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
