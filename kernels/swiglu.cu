/* kernels/swiglu.cu: SwiGLU, out = silu(gate) * up (CUDA). Element-wise, 16-byte
 * accesses when the pointers allow, grid-stride loops. */
#include "cuda_common.cuh"

__device__ __forceinline__ float sigmoidf_(float g) { return 1.0f / (1.0f + expf(-g)); }

struct SwiGLU {
    __device__ float operator()(float g, float u) const { return g * sigmoidf_(g) * u; }
};

template <typename T>
__device__ __forceinline__ void swiglu_bwd1(T *dgate, T *dup, const T *dout, const T *gate, const T *up, size_t i)
{
    float g = ld_f(gate + i), u = ld_f(up + i), d = ld_f(dout + i);
    float s = sigmoidf_(g);
    st_f(dgate + i, ld_f(dgate + i) + d * u * s * (1.0f + g * (1.0f - s)));
    st_f(dup + i, ld_f(dup + i) + d * g * s);
}

template <typename T, bool VEC>
__global__ void swiglu_backward_kernel(T *dgate, T *dup, const T *dout, const T *gate, const T *up, size_t n)
{
    constexpr int V = VEC ? Pack<T>::N : 1;
    const size_t nv = n / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            Pack<T> g = ld_pack(gate + i * V), u = ld_pack(up + i * V), d = ld_pack(dout + i * V);
            Pack<T> dg = ld_pack(dgate + i * V), du = ld_pack(dup + i * V);
            for (int e = 0; e < V; e++) {
                float gv = to_f(g.v[e]), uv = to_f(u.v[e]), dv = to_f(d.v[e]);
                float s = sigmoidf_(gv);
                dg.v[e] = from_f<T>(to_f(dg.v[e]) + dv * uv * s * (1.0f + gv * (1.0f - s)));
                du.v[e] = from_f<T>(to_f(du.v[e]) + dv * gv * s);
            }
            st_pack(dgate + i * V, dg);
            st_pack(dup + i * V, du);
        } else {
            swiglu_bwd1(dgate, dup, dout, gate, up, i);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) swiglu_bwd1(dgate, dup, dout, gate, up, i);
}

static unsigned ew_grid(size_t n, int V)
{
    int sms = smp_cuda_sm_count();
    return smp_blocks((n + V - 1) / V, 256, (unsigned)(sms > 0 ? sms * 8 : 1024));
}

template <typename T>
static cudaError_t swiglu_backward(void *dgate, void *dup, const void *dout, const void *gate, const void *up,
                                   size_t n, cudaStream_t stream)
{
    const bool vec = smp_aligned16(dgate) && smp_aligned16(dup) && smp_aligned16(dout) && smp_aligned16(gate) &&
                     smp_aligned16(up);
    if (vec) {
        auto k = swiglu_backward_kernel<T, true>;
        SMP_LAUNCH(k, ew_grid(n, Pack<T>::N), 256, 0, stream, (T *)dgate, (T *)dup, (const T *)dout,
                   (const T *)gate, (const T *)up, n);
    } else {
        auto k = swiglu_backward_kernel<T, false>;
        SMP_LAUNCH(k, ew_grid(n, 1), 256, 0, stream, (T *)dgate, (T *)dup, (const T *)dout, (const T *)gate,
                   (const T *)up, n);
    }
    return smp_cuda_launched("cuda_op_swiglu_backward");
}

extern "C" cudaError_t cuda_op_swiglu_forward(void *out, const void *gate, const void *up, size_t n,
                                              cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(out && gate && up, "NULL pointer");
    return dt == CUDA_R_32F ? map2_launch<float>(out, gate, up, n, SwiGLU(), stream, "cuda_op_swiglu_forward")
                            : map2_launch<bf16>(out, gate, up, n, SwiGLU(), stream, "cuda_op_swiglu_forward");
}

extern "C" cudaError_t cuda_op_swiglu_backward(void *dgate, void *dup, const void *dout, const void *gate,
                                               const void *up, size_t n, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(dgate && dup && dout && gate && up, "NULL pointer");
    return dt == CUDA_R_32F ? swiglu_backward<float>(dgate, dup, dout, gate, up, n, stream)
                            : swiglu_backward<bf16>(dgate, dup, dout, gate, up, n, stream);
}
