/* kernels/qkv.cu: GPT-NeoX's fused qkv [N, nh, 3, hd] split into q, k, v [N, nh, hd]
 * and the adjoint merge (CUDA). A permutation, so the dtype matters only through its
 * size: the kernel moves units U of the storage (16-byte int4 when a head's hd values
 * fill whole units and the pointers are aligned, else one element), indexed by the
 * packed tensor's unit e = ((n * nh + h) * 3 + part) * hdu + j, in a grid-stride
 * loop: reads (split) or writes (merge) of the packed tensor are coalesced. */
#include "cuda_common.cuh"

enum { QKV_THREADS = 256 };

/* MERGE: packed[e] = part[o] (q, k, v are read), else part[o] = packed[e] */
template <typename U, bool MERGE>
__global__ void qkv_kernel(U *packed, U *q, U *k, U *v, size_t n, int hdu)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t blk = e / (size_t)hdu, row = blk / 3;
        const int part = (int)(blk - row * 3);
        U *t = part == 0 ? q : part == 1 ? k : v;
        const size_t o = row * hdu + (e - blk * hdu);
        if (MERGE)
            packed[e] = t[o];
        else
            t[o] = packed[e];
    }
}

/* the const inputs are cast away here only: the kernel reads what MERGE says it reads */
template <typename U, bool MERGE>
static void qkv_launch(const void *packed, const void *q, const void *k, const void *v, size_t n, int hdu,
                       cudaStream_t stream)
{
    const int sms = smp_cuda_sm_count();
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 1024);
    auto kern = qkv_kernel<U, MERGE>;
    SMP_LAUNCH(kern, smp_blocks(n, QKV_THREADS, cap), QKV_THREADS, 0, stream, (U *)packed, (U *)q, (U *)k, (U *)v,
               n, hdu);
}

/* picks the unit: 16 bytes when every head's block and pointer allows, else one element */
template <bool MERGE>
static cudaError_t qkv_run(const void *packed, const void *q, const void *k, const void *v, int N, int nh, int hd,
                           cudaDataType_t dt, cudaStream_t stream, const char *fn)
{
    const size_t es = dt == CUDA_R_32F ? 4 : 2, bytes = (size_t)hd * es, n = (size_t)N * nh * 3 * hd;
    if (bytes % 16 == 0 && smp_aligned16(packed) && smp_aligned16(q) && smp_aligned16(k) && smp_aligned16(v))
        qkv_launch<int4, MERGE>(packed, q, k, v, n * es / 16, (int)(bytes / 16), stream);
    else if (es == 4)
        qkv_launch<uint32_t, MERGE>(packed, q, k, v, n, hd, stream);
    else
        qkv_launch<uint16_t, MERGE>(packed, q, k, v, n, hd, stream);
    return smp_cuda_launched(fn);
}

extern "C" cudaError_t cuda_op_qkv_split(void *q, void *k, void *v, const void *qkv, int N, int nh, int hd,
                                         cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && nh > 0 && hd > 0, "bad shape N=%d nh=%d hd=%d", N, nh, hd);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(q && k && v && qkv, "NULL pointer");
    return qkv_run<false>(qkv, q, k, v, N, nh, hd, dt, stream, "cuda_op_qkv_split");
}

extern "C" cudaError_t cuda_op_qkv_merge(void *dqkv, const void *dq, const void *dk, const void *dv, int N, int nh,
                                         int hd, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && nh > 0 && hd > 0, "bad shape N=%d nh=%d hd=%d", N, nh, hd);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dqkv && dq && dk && dv, "NULL pointer");
    return qkv_run<true>(dqkv, dq, dk, dv, N, nh, hd, dt, stream, "cuda_op_qkv_merge");
}
