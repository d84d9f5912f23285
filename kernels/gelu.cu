/* kernels/gelu.cu: GELU, exact (erf) form, as torch.nn.functional.gelu's default
 * (CUDA). Element-wise through map2_launch (cuda_common.cuh): the forward passes the
 * input as both operands (the second read hits the cache), the backward accumulates
 * dout * gelu'(inp) into dinp. Arithmetic as kernels/gelu.c. */
#include "cuda_common.cuh"

__device__ __forceinline__ float gelu_cdf(float x) { return 0.5f * (1.0f + erff(x * 0.70710678118654752f)); }

struct Gelu {
    __device__ float operator()(float x, float) const { return x * gelu_cdf(x); }
};
/* gelu'(x) = Phi(x) + x phi(x) */
struct GeluGrad {
    __device__ float operator()(float d, float x) const
    {
        return d * (gelu_cdf(x) + x * (0.3989422804014327f * expf(-0.5f * x * x)));
    }
};

extern "C" cudaError_t cuda_op_gelu_forward(void *out, const void *inp, size_t n, cudaDataType_t dt,
                                            cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(out && inp, "NULL pointer");
    return dt == CUDA_R_32F ? map2_launch<float>(out, inp, inp, n, Gelu(), stream, "cuda_op_gelu_forward")
                            : map2_launch<bf16>(out, inp, inp, n, Gelu(), stream, "cuda_op_gelu_forward");
}

extern "C" cudaError_t cuda_op_gelu_backward(void *dinp, const void *dout, const void *inp, size_t n,
                                             cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(dinp && dout && inp, "NULL pointer");
    return dt == CUDA_R_32F
               ? map2_launch<float, true>(dinp, dout, inp, n, GeluGrad(), stream, "cuda_op_gelu_backward")
               : map2_launch<bf16, true>(dinp, dout, inp, n, GeluGrad(), stream, "cuda_op_gelu_backward");
}
