/* kernels/rmsnorm.cu: RMSNorm as LlamaRMSNorm (CUDA): the row normalization of
 * kernels/norm.cuh (layernorm.cu) without centering or bias. forward: one block per
 * row. backward: a grid of about two blocks per multiprocessor walks the rows; each
 * block sums its rows' dweight in shared memory and adds it to dweight once,
 * atomically. */
#include "norm.cuh"

extern "C" cudaError_t cuda_op_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight,
                                               int N, int H, float eps, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && rstd && inp && weight, "NULL pointer");
    return smp_norm_forward(out, NULL, rstd, inp, weight, NULL, N, H, eps, dt, stream, "cuda_op_rmsnorm_forward");
}

extern "C" cudaError_t cuda_op_rmsnorm_backward(void *dinp, float *dweight, const void *dout, const void *inp,
                                                const void *weight, const float *rstd, int N, int H,
                                                cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0, "bad shape N=%d H=%d", N, H);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(smp_norm_smem_ok(H, false), "H=%d too large for the shared dweight buffer", H);
    if (N == 0 || (!dinp && !dweight)) return cudaSuccess;
    SMP_ARG(dout && inp && weight && rstd, "NULL pointer");
    return smp_norm_backward(dinp, dweight, NULL, dout, inp, weight, NULL, rstd, N, H, dt, stream,
                             "cuda_op_rmsnorm_backward");
}
