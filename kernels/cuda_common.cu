/* kernels/cuda_common.cu: error messages and device queries of the CUDA ops. */
#include "cuda_common.cuh"

#include <stdarg.h>
#include <stdio.h>

static thread_local char smp_cuda_msg[1024];

extern "C" const char *cuda_op_errmsg(void) { return smp_cuda_msg; }

cudaError_t smp_cuda_fail(cudaError_t err, const char *fn, const char *fmt, ...)
{
    int n = snprintf(smp_cuda_msg, sizeof smp_cuda_msg, "%s: ", fn);
    if (n < 0 || (size_t)n >= sizeof smp_cuda_msg) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(smp_cuda_msg + n, sizeof smp_cuda_msg - (size_t)n, fmt, ap);
    va_end(ap);
    return err;
}

cudaError_t smp_cuda_launched(const char *fn)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return smp_cuda_fail(e, fn, "kernel launch failed: %s", cudaGetErrorString(e));
    return cudaSuccess;
}

int smp_cuda_sm_count(void)
{
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    return n;
}

cudaError_t smp_cuda_smem_optin(const void *kernel, size_t bytes, const char *fn)
{
    if (bytes <= 48 * 1024) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e != cudaSuccess)
        return smp_cuda_fail(e, fn, "cannot raise the shared memory limit to %zu bytes: %s", bytes,
                             cudaGetErrorString(e));
    return cudaSuccess;
}
