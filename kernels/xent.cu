/* kernels/xent.cu: cross-entropy over a vocabulary shard (CUDA).
 *
 * One block per row of logits for the row passes. cuda_op_xent_stats fuses the
 * three statistics into one read of the logits with an online max (each thread
 * keeps (max, sum exp(x - max)) and the block merges them). The backward writes
 * scale * (softmax - onehot) from the logits and the statistics only, so it may
 * overwrite the logits in place: no second vocabulary-sized buffer. */
#include "cuda_common.cuh"

enum { XENT_THREADS = 512 };

__device__ __forceinline__ bool xent_owns(int t, int vocab_start, int Vl)
{
    return t >= vocab_start && t - vocab_start < Vl;
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(XENT_THREADS) xent_rowmax_kernel(float *rowmax, float *target_logit, const T *logits,
                                                                   const int32_t *targets, int Vl, int vocab_start)
{
    __shared__ float red[32];
    const size_t n = blockIdx.x;
    const T *x = logits + n * Vl;
    float m = -INFINITY;
    row_for_each<T, VEC>(x, Vl, [&](float a) { m = fmaxf(m, a); });
    m = block_max(m, red);
    if (threadIdx.x == 0) {
        rowmax[n] = m;
        const int t = targets[n];
        target_logit[n] = xent_owns(t, vocab_start, Vl) ? ld_f(x + (t - vocab_start)) : 0.0f;
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(XENT_THREADS) xent_sumexp_kernel(float *sumexp, const T *logits,
                                                                   const float *rowmax, int Vl)
{
    __shared__ float red[32];
    const size_t n = blockIdx.x;
    const T *x = logits + n * Vl;
    const float m = rowmax[n];
    float s = 0.0f;
    row_for_each<T, VEC>(x, Vl, [&](float a) { s += expf(a - m); });
    s = block_sum(s, red);
    if (threadIdx.x == 0) sumexp[n] = s;
}

/* (m, s) <- (m, s) with one more value v > -inf: s = sum exp(x - m) so far */
__device__ __forceinline__ void online_add(float &m, float &s, float v)
{
    if (v > m) {
        s = s * expf(m - v) + 1.0f; /* m = -inf on the first value: s * 0 + 1 */
        m = v;
    } else {
        s += expf(v - m);
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(XENT_THREADS) xent_stats_kernel(float *rowmax, float *sumexp, float *target_logit,
                                                                  const T *logits, const int32_t *targets, int Vl,
                                                                  int vocab_start)
{
    __shared__ float red[32];
    const size_t n = blockIdx.x;
    const T *x = logits + n * Vl;
    float m = -INFINITY, s = 0.0f;
    row_for_each<T, VEC>(x, Vl, [&](float v) {
        if (v != -INFINITY) online_add(m, s, v); /* exp(-inf) adds 0 */
    });
    const float M = block_max(m, red);
    const float part = (m == -INFINITY) ? 0.0f : s * expf(m - M);
    const float S = block_sum(part, red);
    if (threadIdx.x == 0) {
        rowmax[n] = M;
        sumexp[n] = S;
        const int t = targets[n];
        target_logit[n] = xent_owns(t, vocab_start, Vl) ? ld_f(x + (t - vocab_start)) : 0.0f;
    }
}

enum { LOSS_THREADS = 1024 };
__global__ void __launch_bounds__(LOSS_THREADS) xent_loss_kernel(float *losses, double *loss_sum, const float *rowmax,
                                                                 const float *sumexp, const float *target_logit,
                                                                 const int32_t *targets, int N)
{
    __shared__ double red[32];
    double acc = 0.0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        if (targets[n] < 0) {
            losses[n] = 0.0f;
            continue;
        }
        double l = log((double)sumexp[n]) + rowmax[n] - target_logit[n];
        losses[n] = (float)l;
        acc += l;
    }
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0 && loss_sum) *loss_sum = acc;
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(XENT_THREADS) xent_backward_kernel(T *dlogits, const T *logits, const float *rowmax,
                                                                     const float *sumexp, const int32_t *targets,
                                                                     int Vl, int vocab_start, float scale)
{
    const size_t n = blockIdx.x;
    const T *x = logits + n * Vl;
    T *dx = dlogits + n * Vl;
    const int t = targets[n];
    constexpr int V = VEC ? Pack<T>::N : 1;
    if (t < 0) {
        for (int j = threadIdx.x; j < Vl; j += blockDim.x) dx[j] = from_f<T>(0.0f);
        return;
    }
    const float lse = rowmax[n] + logf(sumexp[n]);
    const int tl = xent_owns(t, vocab_start, Vl) ? t - vocab_start : -1;
    /* each element is read and written by the same thread: in-place is safe */
    for (int j = threadIdx.x * V; j < Vl; j += blockDim.x * V) {
        if (VEC) {
            Pack<T> p = ld_pack(x + j);
            for (int e = 0; e < V; e++)
                p.v[e] = from_f<T>(scale * expf(to_f(p.v[e]) - lse) - (j + e == tl ? scale : 0.0f));
            st_pack(dx + j, p);
        } else {
            st_f(dx + j, scale * expf(ld_f(x + j) - lse) - (j == tl ? scale : 0.0f));
        }
    }
}

#define XENT_CHECK(dt)                                                                          \
    SMP_ARG(N >= 0 && Vl > 0, "bad shape N=%d Vl=%d", N, Vl);                                   \
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)(dt));             \
    if (N == 0) return cudaSuccess

template <typename T>
static bool xent_vec(const void *a, const void *b, int Vl)
{
    return Vl % Pack<T>::N == 0 && smp_aligned16(a) && smp_aligned16(b);
}

extern "C" cudaError_t cuda_op_xent_rowmax(float *rowmax, float *target_logit, const void *logits,
                                           const int32_t *targets, int N, int Vl, int vocab_start, cudaDataType_t dt,
                                           cudaStream_t stream)
{
    XENT_CHECK(dt);
    SMP_ARG(rowmax && target_logit && logits && targets, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto k = xent_vec<float>(logits, logits, Vl) ? xent_rowmax_kernel<float, true> : xent_rowmax_kernel<float, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, rowmax, target_logit, (const float *)logits, targets, Vl, vocab_start);
    } else {
        auto k = xent_vec<bf16>(logits, logits, Vl) ? xent_rowmax_kernel<bf16, true> : xent_rowmax_kernel<bf16, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, rowmax, target_logit, (const bf16 *)logits, targets, Vl, vocab_start);
    }
    return smp_cuda_launched("cuda_op_xent_rowmax");
}

extern "C" cudaError_t cuda_op_xent_sumexp(float *sumexp, const void *logits, const float *rowmax, int N, int Vl,
                                           cudaDataType_t dt, cudaStream_t stream)
{
    XENT_CHECK(dt);
    SMP_ARG(sumexp && logits && rowmax, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto k = xent_vec<float>(logits, logits, Vl) ? xent_sumexp_kernel<float, true> : xent_sumexp_kernel<float, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, sumexp, (const float *)logits, rowmax, Vl);
    } else {
        auto k = xent_vec<bf16>(logits, logits, Vl) ? xent_sumexp_kernel<bf16, true> : xent_sumexp_kernel<bf16, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, sumexp, (const bf16 *)logits, rowmax, Vl);
    }
    return smp_cuda_launched("cuda_op_xent_sumexp");
}

extern "C" cudaError_t cuda_op_xent_stats(float *rowmax, float *sumexp, float *target_logit, const void *logits,
                                          const int32_t *targets, int N, int Vl, int vocab_start, cudaDataType_t dt,
                                          cudaStream_t stream)
{
    XENT_CHECK(dt);
    SMP_ARG(rowmax && sumexp && target_logit && logits && targets, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto k = xent_vec<float>(logits, logits, Vl) ? xent_stats_kernel<float, true> : xent_stats_kernel<float, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, rowmax, sumexp, target_logit, (const float *)logits, targets, Vl,
                   vocab_start);
    } else {
        auto k = xent_vec<bf16>(logits, logits, Vl) ? xent_stats_kernel<bf16, true> : xent_stats_kernel<bf16, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, rowmax, sumexp, target_logit, (const bf16 *)logits, targets, Vl,
                   vocab_start);
    }
    return smp_cuda_launched("cuda_op_xent_stats");
}

extern "C" cudaError_t cuda_op_xent_loss(float *losses, double *loss_sum, const float *rowmax, const float *sumexp,
                                         const float *target_logit, const int32_t *targets, int N, cudaStream_t stream)
{
    SMP_ARG(N >= 0, "bad shape N=%d", N);
    if (N == 0) {
        if (!loss_sum) return cudaSuccess;
        cudaError_t e = cudaMemsetAsync(loss_sum, 0, sizeof(double), stream);
        return e == cudaSuccess ? e : smp_cuda_fail(e, "cuda_op_xent_loss", "cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    SMP_ARG(losses && rowmax && sumexp && target_logit && targets, "NULL pointer");
    SMP_LAUNCH(xent_loss_kernel, 1, LOSS_THREADS, 0, stream, losses, loss_sum, rowmax, sumexp, target_logit, targets, N);
    return smp_cuda_launched("cuda_op_xent_loss");
}

extern "C" cudaError_t cuda_op_xent_backward(void *dlogits, const void *logits, const float *rowmax,
                                             const float *sumexp, const int32_t *targets, int N, int Vl,
                                             int vocab_start, float scale, cudaDataType_t dt, cudaStream_t stream)
{
    XENT_CHECK(dt);
    SMP_ARG(dlogits && logits && rowmax && sumexp && targets, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto k = xent_vec<float>(logits, dlogits, Vl) ? xent_backward_kernel<float, true>
                                                      : xent_backward_kernel<float, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, (float *)dlogits, (const float *)logits, rowmax, sumexp, targets, Vl,
                   vocab_start, scale);
    } else {
        auto k = xent_vec<bf16>(logits, dlogits, Vl) ? xent_backward_kernel<bf16, true> : xent_backward_kernel<bf16, false>;
        SMP_LAUNCH(k, N, XENT_THREADS, 0, stream, (bf16 *)dlogits, (const bf16 *)logits, rowmax, sumexp, targets, Vl,
                   vocab_start, scale);
    }
    return smp_cuda_launched("cuda_op_xent_backward");
}
