/* kernels/layernorm.cu: LayerNorm as torch.nn.LayerNorm (CUDA), and the row
 * normalization it shares with RMSNorm (kernels/norm.cuh; rmsnorm.cu calls it without
 * centering or bias). fp32 arithmetic, fp32 or bf16 storage.
 * forward: one block per row; with centering the mean is reduced first and the
 * variance about it in a second pass over the row (no cancellation).
 * backward: a grid of as many blocks as fit on the multiprocessors at once walks the
 * rows; each block sums its rows' dweight (and dbias) in shared memory (every column
 * has one owning thread) and adds it to dweight (dbias) once, atomically. A block
 * waits on its row's loads and a block reduction (two with centering) a row, so the
 * multiprocessor needs many blocks to keep memory busy (two a multiprocessor ran the
 * RMSNorm backward at 40% of the copy bandwidth on an H200, 2026-12-04); more blocks
 * cost only more atomic adds at the end. */
#include "norm.cuh"

enum { NORM_THREADS = 256 };

template <typename T, bool VEC, bool CENTER>
__global__ void __launch_bounds__(NORM_THREADS) norm_forward_kernel(T *out, float *mean, float *rstd, const T *inp,
                                                                    const T *weight, const T *bias, int H, float eps)
{
    __shared__ float red[32];
    const size_t n = blockIdx.x;
    const T *x = inp + n * H;
    T *y = out + n * H;
    constexpr int V = VEC ? Pack<T>::N : 1;
    float mu = 0.0f;
    if (CENTER) {
        float s = 0.0f;
        row_for_each<T, VEC>(x, H, [&](float a) { s += a; });
        mu = block_sum(s, red) / (float)H;
    }
    float ss = 0.0f;
    row_for_each<T, VEC>(x, H, [&](float a) { ss += (a - mu) * (a - mu); });
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
        if (VEC) {
            Pack<T> p = ld_pack(x + j), w = ld_pack(weight + j), o;
            const Pack<T> b = bias ? ld_pack(bias + j) : w;
            for (int e = 0; e < V; e++) {
                const float v = (to_f(p.v[e]) - mu) * r * to_f(w.v[e]);
                o.v[e] = from_f<T>(bias ? v + to_f(b.v[e]) : v);
            }
            st_pack(y + j, o);
        } else {
            const float v = (ld_f(x + j) - mu) * r * ld_f(weight + j);
            st_f(y + j, bias ? v + ld_f(bias + j) : v);
        }
    }
    if (threadIdx.x == 0) {
        if (CENTER) mean[n] = mu;
        rstd[n] = r;
    }
}

/* dx = r * (w g - mean_j(w g) [CENTER] - xc * r^2 * mean_j(w g xc)), xc = x - mean
 * (kernels/layernorm.c); dweight += g xc r, dbias += g */
template <typename T, bool VEC, bool CENTER>
__global__ void __launch_bounds__(NORM_THREADS)
    norm_backward_kernel(T *dinp, float *dweight, float *dbias, const T *dout, const T *inp, const T *weight,
                         const float *mean, const float *rstd, int N, int H)
{
    __shared__ float red[32];
    SMP_DYN_SMEM(float, dw); /* [H] this block's share of dweight (if dweight), then [H] of dbias (if dbias) */
    float *db = dw + (dweight ? H : 0);
    constexpr int V = VEC ? Pack<T>::N : 1;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        if (dweight) dw[j] = 0.0f;
        if (dbias) db[j] = 0.0f;
    }
    /* dw[j] and db[j] are only ever touched by the thread that owns column j below,
     * and the zeroing above used another thread mapping: order them */
    __syncthreads();
    for (int n = blockIdx.x; n < N; n += gridDim.x) {
        const T *x = inp + (size_t)n * H, *g = dout + (size_t)n * H;
        const float r = rstd[n], mu = CENTER ? mean[n] : 0.0f;
        float dot = 0.0f, sg = 0.0f;
        for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
            if (VEC) {
                Pack<T> px = ld_pack(x + j), pg = ld_pack(g + j), pw = ld_pack(weight + j);
                for (int e = 0; e < V; e++) {
                    float xc = to_f(px.v[e]) - mu, gv = to_f(pg.v[e]);
                    dot += to_f(pw.v[e]) * gv * xc;
                    if (CENTER) sg += to_f(pw.v[e]) * gv;
                    if (dweight) dw[j + e] += gv * xc * r;
                    if (dbias) db[j + e] += gv;
                }
            } else {
                float xc = ld_f(x + j) - mu, gv = ld_f(g + j);
                dot += ld_f(weight + j) * gv * xc;
                if (CENTER) sg += ld_f(weight + j) * gv;
                if (dweight) dw[j] += gv * xc * r;
                if (dbias) db[j] += gv;
            }
        }
        if (!dinp) continue;
        dot = block_sum(dot, red);
        if (CENTER) sg = block_sum(sg, red);
        const float c = dot / (float)H * r * r, a = CENTER ? sg / (float)H : 0.0f;
        T *dx = dinp + (size_t)n * H;
        for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
            if (VEC) {
                Pack<T> px = ld_pack(x + j), pg = ld_pack(g + j), pw = ld_pack(weight + j), pd = ld_pack(dx + j);
                for (int e = 0; e < V; e++)
                    pd.v[e] = from_f<T>(to_f(pd.v[e]) +
                                        r * (to_f(pw.v[e]) * to_f(pg.v[e]) - a - (to_f(px.v[e]) - mu) * c));
                st_pack(dx + j, pd);
            } else {
                st_f(dx + j, ld_f(dx + j) + r * (ld_f(weight + j) * ld_f(g + j) - a - (ld_f(x + j) - mu) * c));
            }
        }
    }
    if (dweight || dbias) {
        __syncthreads();
        for (int j = threadIdx.x; j < H; j += blockDim.x) {
            if (dweight) atomicAdd(dweight + j, dw[j]);
            if (dbias) atomicAdd(dbias + j, db[j]);
        }
    }
}

template <typename T>
static cudaError_t norm_forward(void *out, float *mean, float *rstd, const void *inp, const void *weight,
                                const void *bias, int N, int H, float eps, cudaStream_t stream, const char *fn)
{
    const bool vec = H % Pack<T>::N == 0 && smp_aligned16(out) && smp_aligned16(inp) && smp_aligned16(weight) &&
                     (!bias || smp_aligned16(bias));
    auto k = mean ? (vec ? norm_forward_kernel<T, true, true> : norm_forward_kernel<T, false, true>)
                  : (vec ? norm_forward_kernel<T, true, false> : norm_forward_kernel<T, false, false>);
    SMP_LAUNCH(k, N, NORM_THREADS, 0, stream, (T *)out, mean, rstd, (const T *)inp, (const T *)weight,
               (const T *)bias, H, eps);
    return smp_cuda_launched(fn);
}

template <typename T>
static cudaError_t norm_backward(void *dinp, float *dweight, float *dbias, const void *dout, const void *inp,
                                 const void *weight, const float *mean, const float *rstd, int N, int H,
                                 cudaStream_t stream, const char *fn)
{
    const bool vec = H % Pack<T>::N == 0 && smp_aligned16(dout) && smp_aligned16(inp) && smp_aligned16(weight) &&
                     (!dinp || smp_aligned16(dinp));
    const size_t smem = (size_t)H * sizeof(float) * ((dweight ? 1 : 0) + (dbias ? 1 : 0));
    auto k = mean ? (vec ? norm_backward_kernel<T, true, true> : norm_backward_kernel<T, false, true>)
                  : (vec ? norm_backward_kernel<T, true, false> : norm_backward_kernel<T, false, false>);
    cudaError_t e = smp_cuda_smem_optin((const void *)k, smem, fn);
    if (e != cudaSuccess) return e;
    int sms = smp_cuda_sm_count(), per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (const void *)k, NORM_THREADS, smem) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: fall back to two a multiprocessor */
        per_sm = 2;
    }
    per_sm = per_sm < 1 ? 1 : per_sm;
    unsigned grid = smp_blocks((size_t)N, 1, (unsigned)(sms > 0 ? per_sm * sms : 264));
    SMP_LAUNCH(k, grid, NORM_THREADS, smem, stream, (T *)dinp, dweight, dbias, (const T *)dout, (const T *)inp,
               (const T *)weight, mean, rstd, N, H);
    return smp_cuda_launched(fn);
}

cudaError_t smp_norm_forward(void *out, float *mean, float *rstd, const void *inp, const void *weight,
                             const void *bias, int N, int H, float eps, cudaDataType_t dt, cudaStream_t stream,
                             const char *fn)
{
    return dt == CUDA_R_32F ? norm_forward<float>(out, mean, rstd, inp, weight, bias, N, H, eps, stream, fn)
                            : norm_forward<bf16>(out, mean, rstd, inp, weight, bias, N, H, eps, stream, fn);
}

cudaError_t smp_norm_backward(void *dinp, float *dweight, float *dbias, const void *dout, const void *inp,
                              const void *weight, const float *mean, const float *rstd, int N, int H,
                              cudaDataType_t dt, cudaStream_t stream, const char *fn)
{
    return dt == CUDA_R_32F
               ? norm_backward<float>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, H, stream, fn)
               : norm_backward<bf16>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, H, stream, fn);
}

extern "C" cudaError_t cuda_op_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                                 const void *weight, const void *bias, int N, int H, float eps,
                                                 cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && mean && rstd && inp && weight, "NULL pointer");
    return smp_norm_forward(out, mean, rstd, inp, weight, bias, N, H, eps, dt, stream, "cuda_op_layernorm_forward");
}

extern "C" cudaError_t cuda_op_layernorm_backward(void *dinp, float *dweight, float *dbias, const void *dout,
                                                  const void *inp, const void *weight, const float *mean,
                                                  const float *rstd, int N, int H, cudaDataType_t dt,
                                                  cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(smp_norm_smem_ok(H, true), "H=%d too large for the shared dweight and dbias buffers", H);
    if (N == 0 || (!dinp && !dweight && !dbias)) return cudaSuccess;
    SMP_ARG(dout && inp && weight && mean && rstd, "NULL pointer");
    return smp_norm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, H, dt, stream,
                             "cuda_op_layernorm_backward");
}
