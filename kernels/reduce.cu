/* kernels/reduce.cu: sum of squares, max |x|, scaling and addition (CUDA).
 * A grid of a few blocks per multiprocessor reduces in registers and shared memory.
 * sumsq: each block writes its partial sum, and one block adds the partials in a
 * fixed order (no atomics), so the result is the same bits run to run on a given
 * GPU (a resumed run's gradient norm, and so its clipping, repeat exactly). amax:
 * each block's result goes in atomically, as an integer max on the float bits (exact,
 * and NaN propagates, see atomic_amax). */
#include "cuda_common.cuh"

enum { RED_THREADS = 256, SUMSQ_MAX_BLOCKS = 4096 };

/* the blocks' partial sums of cuda_op_sumsq (one call at a time: ops_cuda.h) */
__device__ double sumsq_partial[SUMSQ_MAX_BLOCKS];

template <typename T, bool VEC>
__global__ void __launch_bounds__(RED_THREADS) sumsq_kernel(const T *x, size_t n)
{
    __shared__ double red[32];
    constexpr int V = VEC ? Pack<T>::N : 1;
    const size_t nv = n / V;
    double acc = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            Pack<T> p = ld_pack(x + i * V);
            for (int e = 0; e < V; e++) { double a = to_f(p.v[e]); acc += a * a; }
        } else {
            double a = ld_f(x + i);
            acc += a * a;
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) { double a = ld_f(x + i); acc += a * a; }
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0) sumsq_partial[blockIdx.x] = acc;
}

/* one block: the partials in a fixed order (each thread a fixed stride, then the
 * block's fixed reduction tree) */
__global__ void __launch_bounds__(RED_THREADS) sumsq_final_kernel(double *out, unsigned nblocks)
{
    __shared__ double red[32];
    double acc = 0.0;
    for (unsigned i = threadIdx.x; i < nblocks; i += blockDim.x) acc += sumsq_partial[i];
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0) *out = acc;
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(RED_THREADS) amax_kernel(float *out, const T *x, size_t n)
{
    __shared__ float red[32];
    constexpr int V = VEC ? Pack<T>::N : 1;
    const size_t nv = n / V;
    float mx = 0.0f;
    bool nan = false;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            Pack<T> p = ld_pack(x + i * V);
            for (int e = 0; e < V; e++) { float a = fabsf(to_f(p.v[e])); mx = fmaxf(mx, a); nan |= isnan(a); }
        } else {
            float a = fabsf(ld_f(x + i));
            mx = fmaxf(mx, a);
            nan |= isnan(a);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) {
            float a = fabsf(ld_f(x + i));
            mx = fmaxf(mx, a);
            nan |= isnan(a);
        }
    /* fmaxf drops NaN: carry it separately and restore it at the end */
    float m = block_max(mx, red);
    float anynan = block_max(nan ? 1.0f : 0.0f, red);
    if (threadIdx.x == 0) atomic_amax(out, anynan > 0.0f ? __int_as_float(0x7fc00000) : m);
}

template <typename T, bool VEC>
__global__ void scale_kernel(T *x, float s, size_t n)
{
    constexpr int V = VEC ? Pack<T>::N : 1;
    const size_t nv = n / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            Pack<T> p = ld_pack(x + i * V);
            for (int e = 0; e < V; e++) p.v[e] = from_f<T>(to_f(p.v[e]) * s);
            st_pack(x + i * V, p);
        } else {
            st_f(x + i, ld_f(x + i) * s);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) st_f(x + i, ld_f(x + i) * s);
}

struct AddOp {
    __device__ float operator()(float a, float b) const { return a + b; }
};

static unsigned red_grid(size_t n, int V)
{
    int sms = smp_cuda_sm_count();
    return smp_blocks((n + V - 1) / V, RED_THREADS, (unsigned)(sms > 0 ? sms * 4 : 512));
}

template <typename T>
static cudaError_t sumsq_run(double *out, const void *x, size_t n, cudaStream_t stream)
{
    if (n == 0) {
        cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), stream);
        return e == cudaSuccess ? e : smp_cuda_fail(e, "cuda_op_sumsq", "cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    const bool vec = smp_aligned16(x);
    unsigned grid = red_grid(n, vec ? Pack<T>::N : 1);
    if (grid > SUMSQ_MAX_BLOCKS) grid = SUMSQ_MAX_BLOCKS; /* the loops stride over the rest */
    if (vec) {
        auto k = sumsq_kernel<T, true>;
        SMP_LAUNCH(k, grid, RED_THREADS, 0, stream, (const T *)x, n);
    } else {
        auto k = sumsq_kernel<T, false>;
        SMP_LAUNCH(k, grid, RED_THREADS, 0, stream, (const T *)x, n);
    }
    SMP_LAUNCH(sumsq_final_kernel, 1, RED_THREADS, 0, stream, out, grid);
    return smp_cuda_launched("cuda_op_sumsq");
}

template <typename T>
static cudaError_t amax_run(float *out, const void *x, size_t n, cudaStream_t stream)
{
    cudaError_t e = cudaMemsetAsync(out, 0, sizeof(float), stream);
    if (e != cudaSuccess) return smp_cuda_fail(e, "cuda_op_amax", "cudaMemsetAsync: %s", cudaGetErrorString(e));
    if (n == 0) return cudaSuccess;
    if (smp_aligned16(x)) {
        auto k = amax_kernel<T, true>;
        SMP_LAUNCH(k, red_grid(n, Pack<T>::N), RED_THREADS, 0, stream, out, (const T *)x, n);
    } else {
        auto k = amax_kernel<T, false>;
        SMP_LAUNCH(k, red_grid(n, 1), RED_THREADS, 0, stream, out, (const T *)x, n);
    }
    return smp_cuda_launched("cuda_op_amax");
}

template <typename T>
static cudaError_t scale_run(void *x, float s, size_t n, cudaStream_t stream)
{
    if (smp_aligned16(x)) {
        auto k = scale_kernel<T, true>;
        SMP_LAUNCH(k, red_grid(n, Pack<T>::N), RED_THREADS, 0, stream, (T *)x, s, n);
    } else {
        auto k = scale_kernel<T, false>;
        SMP_LAUNCH(k, red_grid(n, 1), RED_THREADS, 0, stream, (T *)x, s, n);
    }
    return smp_cuda_launched("cuda_op_scale");
}

extern "C" cudaError_t cuda_op_sumsq(double *out, const void *x, size_t n, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(out && (x || n == 0), "NULL pointer");
    return dt == CUDA_R_32F ? sumsq_run<float>(out, x, n, stream) : sumsq_run<bf16>(out, x, n, stream);
}

extern "C" cudaError_t cuda_op_amax(float *out, const void *x, size_t n, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(out && (x || n == 0), "NULL pointer");
    return dt == CUDA_R_32F ? amax_run<float>(out, x, n, stream) : amax_run<bf16>(out, x, n, stream);
}

extern "C" cudaError_t cuda_op_scale(void *x, float s, size_t n, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(x, "NULL pointer");
    return dt == CUDA_R_32F ? scale_run<float>(x, s, n, stream) : scale_run<bf16>(x, s, n, stream);
}

extern "C" cudaError_t cuda_op_add(void *y, const void *a, const void *b, size_t n, cudaDataType_t dt,
                                   cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(y && a && b, "NULL pointer");
    return dt == CUDA_R_32F ? map2_launch<float>(y, a, b, n, AddOp(), stream, "cuda_op_add")
                            : map2_launch<bf16>(y, a, b, n, AddOp(), stream, "cuda_op_add");
}
