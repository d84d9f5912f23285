/* kernels/bias.cu: a bias added to every row, and its gradient (CUDA).
 * forward: element-wise over [N, C], 16-byte accesses when C and the pointers
 * allow, grid-stride loops.
 * backward: one block (BIAS_WARPS warps) per 32 columns; lane l of every warp owns column l of the
 * tile (a warp reads 32 consecutive values of a row: coalesced), warp w sums rows
 * w, w + BIAS_WARPS, ... in order, and one thread adds the warps' sums in warp
 * order. The partition depends only on C, so the result is the same bits run to
 * run and for any GPU; no atomics, no scratch. */
#include "cuda_common.cuh"

enum { BIAS_THREADS = 256, BIAS_COLS = 32, BIAS_WARPS = 16 };

template <typename T, bool VEC>
__global__ void bias_forward_kernel(T *out, const T *bias, size_t n, int C)
{
    constexpr int V = VEC ? Pack<T>::N : 1; /* VEC: C % V == 0, so a pack never wraps a row */
    const size_t nv = n / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        const size_t e = i * V;
        const int j = (int)(e % (size_t)C);
        if (VEC) {
            Pack<T> o = ld_pack(out + e), b = ld_pack(bias + j);
            for (int k = 0; k < V; k++) o.v[k] = from_f<T>(to_f(o.v[k]) + to_f(b.v[k]));
            st_pack(out + e, o);
        } else {
            st_f(out + e, ld_f(out + e) + ld_f(bias + j));
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(BIAS_COLS *BIAS_WARPS) bias_backward_kernel(float *dbias, const T *dout, int N,
                                                                             int C)
{
    __shared__ float part[BIAS_WARPS][BIAS_COLS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = blockIdx.x * BIAS_COLS + lane;
    float acc = 0.0f;
    if (j < C) {
        const T *g = dout + j;
#pragma unroll 4
        for (int n = w; n < N; n += BIAS_WARPS) acc += ld_f(g + (size_t)n * C);
    }
    part[w][lane] = acc;
    __syncthreads();
    if (w == 0 && j < C) {
        float s = 0.0f;
        for (int k = 0; k < BIAS_WARPS; k++) s += part[k][lane];
        dbias[j] += s;
    }
}

template <typename T>
static cudaError_t bias_forward(void *out, const void *bias, int N, int C, cudaStream_t stream)
{
    const size_t n = (size_t)N * C;
    const int sms = smp_cuda_sm_count();
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 1024);
    if (C % Pack<T>::N == 0 && smp_aligned16(out) && smp_aligned16(bias)) {
        auto k = bias_forward_kernel<T, true>;
        SMP_LAUNCH(k, smp_blocks(n / Pack<T>::N, BIAS_THREADS, cap), BIAS_THREADS, 0, stream, (T *)out,
                   (const T *)bias, n, C);
    } else {
        auto k = bias_forward_kernel<T, false>;
        SMP_LAUNCH(k, smp_blocks(n, BIAS_THREADS, cap), BIAS_THREADS, 0, stream, (T *)out, (const T *)bias, n, C);
    }
    return smp_cuda_launched("cuda_op_bias_forward");
}

template <typename T>
static cudaError_t bias_backward(float *dbias, const void *dout, int N, int C, cudaStream_t stream)
{
    auto k = bias_backward_kernel<T>;
    SMP_LAUNCH(k, (unsigned)((C + BIAS_COLS - 1) / BIAS_COLS), BIAS_COLS * BIAS_WARPS, 0, stream, dbias,
               (const T *)dout, N, C);
    return smp_cuda_launched("cuda_op_bias_backward");
}

extern "C" cudaError_t cuda_op_bias_forward(void *out, const void *bias, int N, int C, cudaDataType_t dt,
                                            cudaStream_t stream)
{
    SMP_ARG(N >= 0 && C > 0, "bad shape N=%d C=%d", N, C);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && bias, "NULL pointer");
    return dt == CUDA_R_32F ? bias_forward<float>(out, bias, N, C, stream)
                            : bias_forward<bf16>(out, bias, N, C, stream);
}

extern "C" cudaError_t cuda_op_bias_backward(float *dbias, const void *dout, int N, int C, cudaDataType_t dt,
                                             cudaStream_t stream)
{
    SMP_ARG(N >= 0 && C > 0, "bad shape N=%d C=%d", N, C);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dbias && dout, "NULL pointer");
    return dt == CUDA_R_32F ? bias_backward<float>(dbias, dout, N, C, stream)
                            : bias_backward<bf16>(dbias, dout, N, C, stream);
}
