/* kernels/rmsnorm.cu: RMSNorm as LlamaRMSNorm (CUDA).
 * forward: one block per row. backward: a grid of about two blocks per
 * multiprocessor walks the rows; each block sums its rows' dweight in shared memory
 * (every column has one owning thread) and adds it to dweight once, atomically. */
#include "cuda_common.cuh"

enum { RMS_THREADS = 256 };

template <typename T, bool VEC>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_forward_kernel(T *out, float *rstd, const T *inp,
                                                                      const T *weight, int H, float eps)
{
    __shared__ float red[32];
    const size_t n = blockIdx.x;
    const T *x = inp + n * H;
    T *y = out + n * H;
    constexpr int V = VEC ? Pack<T>::N : 1;
    float ss = 0.0f;
    row_for_each<T, VEC>(x, H, [&](float a) { ss += a * a; });
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
        if (VEC) {
            Pack<T> p = ld_pack(x + j), w = ld_pack(weight + j), o;
            for (int e = 0; e < V; e++) o.v[e] = from_f<T>(to_f(p.v[e]) * r * to_f(w.v[e]));
            st_pack(y + j, o);
        } else {
            st_f(y + j, ld_f(x + j) * r * ld_f(weight + j));
        }
    }
    if (threadIdx.x == 0) rstd[n] = r;
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_backward_kernel(T *dinp, float *dweight, const T *dout,
                                                                       const T *inp, const T *weight,
                                                                       const float *rstd, int N, int H)
{
    __shared__ float red[32];
    SMP_DYN_SMEM(float, dw); /* [H] this block's share of dweight (if dweight) */
    constexpr int V = VEC ? Pack<T>::N : 1;
    if (dweight)
        for (int j = threadIdx.x; j < H; j += blockDim.x) dw[j] = 0.0f;
    /* dw[j] is only ever touched by the thread that owns column j below, and the
     * zeroing above used another thread mapping: order them */
    __syncthreads();
    for (int n = blockIdx.x; n < N; n += gridDim.x) {
        const T *x = inp + (size_t)n * H, *g = dout + (size_t)n * H;
        const float r = rstd[n];
        float dot = 0.0f;
        for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
            if (VEC) {
                Pack<T> px = ld_pack(x + j), pg = ld_pack(g + j), pw = ld_pack(weight + j);
                for (int e = 0; e < V; e++) {
                    float xv = to_f(px.v[e]), gv = to_f(pg.v[e]);
                    dot += to_f(pw.v[e]) * gv * xv;
                    if (dweight) dw[j + e] += gv * xv * r;
                }
            } else {
                float xv = ld_f(x + j), gv = ld_f(g + j);
                dot += ld_f(weight + j) * gv * xv;
                if (dweight) dw[j] += gv * xv * r;
            }
        }
        if (!dinp) continue;
        dot = block_sum(dot, red);
        const float c = dot / (float)H * r * r;
        T *dx = dinp + (size_t)n * H;
        for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
            if (VEC) {
                Pack<T> px = ld_pack(x + j), pg = ld_pack(g + j), pw = ld_pack(weight + j), pd = ld_pack(dx + j);
                for (int e = 0; e < V; e++)
                    pd.v[e] = from_f<T>(to_f(pd.v[e]) +
                                        r * (to_f(pw.v[e]) * to_f(pg.v[e]) - to_f(px.v[e]) * c));
                st_pack(dx + j, pd);
            } else {
                st_f(dx + j, ld_f(dx + j) + r * (ld_f(weight + j) * ld_f(g + j) - ld_f(x + j) * c));
            }
        }
    }
    if (dweight) {
        __syncthreads();
        for (int j = threadIdx.x; j < H; j += blockDim.x) atomicAdd(dweight + j, dw[j]);
    }
}

template <typename T>
static cudaError_t rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight, int N, int H,
                                   float eps, cudaStream_t stream)
{
    const bool vec = H % Pack<T>::N == 0 && smp_aligned16(out) && smp_aligned16(inp) && smp_aligned16(weight);
    if (vec) {
        auto k = rmsnorm_forward_kernel<T, true>;
        SMP_LAUNCH(k, N, RMS_THREADS, 0, stream, (T *)out, rstd, (const T *)inp, (const T *)weight, H, eps);
    } else {
        auto k = rmsnorm_forward_kernel<T, false>;
        SMP_LAUNCH(k, N, RMS_THREADS, 0, stream, (T *)out, rstd, (const T *)inp, (const T *)weight, H, eps);
    }
    return smp_cuda_launched("cuda_op_rmsnorm_forward");
}

template <typename T>
static cudaError_t rmsnorm_backward(void *dinp, float *dweight, const void *dout, const void *inp,
                                    const void *weight, const float *rstd, int N, int H, cudaStream_t stream)
{
    const bool vec = H % Pack<T>::N == 0 && smp_aligned16(dout) && smp_aligned16(inp) && smp_aligned16(weight) &&
                     (!dinp || smp_aligned16(dinp));
    const size_t smem = dweight ? (size_t)H * sizeof(float) : 0;
    int sms = smp_cuda_sm_count();
    unsigned grid = smp_blocks((size_t)N, 1, (unsigned)(sms > 0 ? 2 * sms : 264));
    auto k = vec ? rmsnorm_backward_kernel<T, true> : rmsnorm_backward_kernel<T, false>;
    cudaError_t e = smp_cuda_smem_optin((const void *)k, smem, "cuda_op_rmsnorm_backward");
    if (e != cudaSuccess) return e;
    SMP_LAUNCH(k, grid, RMS_THREADS, smem, stream, (T *)dinp, dweight, (const T *)dout, (const T *)inp,
               (const T *)weight, rstd, N, H);
    return smp_cuda_launched("cuda_op_rmsnorm_backward");
}

extern "C" cudaError_t cuda_op_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight,
                                               int N, int H, float eps, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && rstd && inp && weight, "NULL pointer");
    return dt == CUDA_R_32F ? rmsnorm_forward<float>(out, rstd, inp, weight, N, H, eps, stream)
                            : rmsnorm_forward<bf16>(out, rstd, inp, weight, N, H, eps, stream);
}

extern "C" cudaError_t cuda_op_rmsnorm_backward(void *dinp, float *dweight, const void *dout, const void *inp,
                                                const void *weight, const float *rstd, int N, int H,
                                                cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG((size_t)H * sizeof(float) <= 200 * 1024, "H=%d too large for the shared dweight buffer", H);
    if (N == 0 || (!dinp && !dweight)) return cudaSuccess;
    SMP_ARG(dout && inp && weight && rstd, "NULL pointer");
    return dt == CUDA_R_32F ? rmsnorm_backward<float>(dinp, dweight, dout, inp, weight, rstd, N, H, stream)
                            : rmsnorm_backward<bf16>(dinp, dweight, dout, inp, weight, rstd, N, H, stream);
}
