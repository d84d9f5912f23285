/* kernels/norm.cuh (internal to kernels/): the row normalization RMSNorm and LayerNorm
 * share on CUDA (kernels/layernorm.cu), as kernels/norm.h is for C: mean == NULL
 * leaves the rows uncentered (RMSNorm's arithmetic to the bit), bias == NULL adds
 * none. Arguments are checked by the callers (the cuda_op_* functions); fn names the
 * op in the error message. backward: any of dinp, dweight, dbias may be NULL. */
#ifndef SMP_KERNELS_NORM_CUH
#define SMP_KERNELS_NORM_CUH

#include "cuda_common.cuh"

/* the largest H whose dweight (and dbias) the backward keeps in shared memory */
static inline bool smp_norm_smem_ok(int H, bool with_bias)
{
    return (size_t)H * sizeof(float) * (with_bias ? 2 : 1) <= 200 * 1024;
}
cudaError_t smp_norm_forward(void *out, float *mean, float *rstd, const void *inp, const void *weight,
                             const void *bias, int N, int H, float eps, cudaDataType_t dt, cudaStream_t stream,
                             const char *fn);
cudaError_t smp_norm_backward(void *dinp, float *dweight, float *dbias, const void *dout, const void *inp,
                              const void *weight, const float *mean, const float *rstd, int N, int H,
                              cudaDataType_t dt, cudaStream_t stream, const char *fn);

#endif
