/* kernels/cuda_common.cuh: internal helpers shared by the CUDA ops (not public).
 *
 * - error reporting for the launchers (smp_cuda_fail, SMP_ARG, smp_cuda_launched)
 * - storage types: float or bf16 in memory, float in registers (ld_f / st_f, Pack)
 * - element-wise maps of two tensors (map2_launch)
 * - warp and block reductions
 * - the tensor-core and async-copy instructions the attention kernels use
 *   (mma.sync m16n8k16 bf16, ldmatrix, cp.async), each in one small function.
 *
 * SMP_CUDA_EMU: the same sources also compile with a host C++ compiler against
 * tests/gpu/emu/cuda_emu.h, a CPU emulator of the few CUDA features used here
 * (threads, barriers, shuffles, mma/ldmatrix fragments, cp.async groups). That is
 * how the kernels' index arithmetic is checked on machines without a GPU. Kernel
 * launches therefore go through SMP_LAUNCH and dynamic shared memory through
 * SMP_DYN_SMEM; nothing else in the kernels depends on the mode. */
#ifndef SMP_KERNELS_CUDA_COMMON_CUH
#define SMP_KERNELS_CUDA_COMMON_CUH

#ifdef SMP_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <stdint.h>
#include <limits.h>
#include <math.h>

#include "ops_cuda.h"

typedef __nv_bfloat16 bf16;

/* ------------------------------------------------------------------ errors */
/* Sets the thread's message "<fn>: <printf fmt...>" and returns err. */
cudaError_t smp_cuda_fail(cudaError_t err, const char *fn, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* The status of the launch(es) just made: cudaGetLastError with a message. */
cudaError_t smp_cuda_launched(const char *fn);
/* Multiprocessor count of the current device (0 if it cannot be read). */
int smp_cuda_sm_count(void);
/* Raise a kernel's dynamic shared memory limit when it needs more than 48 KiB. */
cudaError_t smp_cuda_smem_optin(const void *kernel, size_t bytes, const char *fn);

#define SMP_ARG(cond, ...)                                                     \
    do {                                                                       \
        if (!(cond))                                                           \
            return smp_cuda_fail(cudaErrorInvalidValue, __func__, __VA_ARGS__); \
    } while (0)

#define SMP_DT_OK(dt) ((dt) == CUDA_R_32F || (dt) == CUDA_R_16BF)

#ifdef SMP_CUDA_EMU
#define SMP_LAUNCH(kernel, grid, block, smem, stream, ...) \
    (emu_stream_flush(stream), emu_launch(kernel, dim3(grid), dim3(block), (size_t)(smem), __VA_ARGS__))
#define SMP_DYN_SMEM(T, name) T *name = reinterpret_cast<T *>(emu_dyn_smem())
#else
#define SMP_LAUNCH(kernel, grid, block, smem, stream, ...) \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define SMP_DYN_SMEM(T, name)                                  \
    extern __shared__ __align__(16) unsigned char smp_dyn_smem_[]; \
    T *name = reinterpret_cast<T *>(smp_dyn_smem_)
#endif

static inline int smp_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }
static inline unsigned smp_blocks(size_t work, unsigned per_block, unsigned cap)
{
    size_t b = (work + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return (unsigned)(b < cap ? b : cap);
}

/* ---------------------------------------------------------- storage types */
__device__ __forceinline__ float ld_f(const float *p) { return *p; }
__device__ __forceinline__ float ld_f(const bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st_f(float *p, float x) { *p = x; }
__device__ __forceinline__ void st_f(bf16 *p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

/* 16 bytes of T: the unit of a vectorized load or store. */
template <typename T> struct __align__(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};
template <typename T> __device__ __forceinline__ Pack<T> ld_pack(const T *p)
{
    Pack<T> r;
    *reinterpret_cast<int4 *>(&r) = *reinterpret_cast<const int4 *>(p);
    return r;
}
template <typename T> __device__ __forceinline__ void st_pack(T *p, const Pack<T> &r)
{
    *reinterpret_cast<int4 *>(p) = *reinterpret_cast<const int4 *>(&r);
}

/* f(x[j]) in fp32 for the elements of a row x[0..n) that this thread reads, in order:
 * the block's threads stride over the row, by 16-byte packs when VEC (n a multiple of
 * the pack, x aligned). F: `void(float)`, usually a lambda that accumulates. */
template <typename T, bool VEC, typename F> __device__ __forceinline__ void row_for_each(const T *x, int n, F f)
{
    constexpr int V = VEC ? Pack<T>::N : 1;
    for (int j = threadIdx.x * V; j < n; j += blockDim.x * V) {
        if (VEC) {
            Pack<T> p = ld_pack(x + j);
            for (int e = 0; e < V; e++) f(to_f(p.v[e]));
        } else {
            f(ld_f(x + j));
        }
    }
}

/* ---------------------------------------------------------- element-wise maps */
/* y[i] = f(a[i], b[i]) over n elements of T (ACC: y[i] += f(a[i], b[i])), arithmetic
 * in fp32: a grid-stride loop, in 16-byte packs when VEC (the three pointers aligned),
 * the tail that does not fill a pack in block 0. y may be a or b: each thread reads its
 * elements before writing them. F: a functor with
 * `__device__ float operator()(float, float) const`. */
template <bool ACC, typename T, typename F>
__device__ __forceinline__ void map2_one(T *y, const T *a, const T *b, size_t i, F f)
{
    const float v = f(ld_f(a + i), ld_f(b + i));
    st_f(y + i, ACC ? ld_f(y + i) + v : v);
}
template <typename T, bool VEC, bool ACC, typename F>
__global__ void map2_kernel(T *y, const T *a, const T *b, size_t n, F f)
{
    constexpr int V = VEC ? Pack<T>::N : 1;
    const size_t nv = n / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            Pack<T> p = ld_pack(a + i * V), q = ld_pack(b + i * V), o = ACC ? ld_pack(y + i * V) : p;
            for (int e = 0; e < V; e++) {
                const float v = f(to_f(p.v[e]), to_f(q.v[e]));
                o.v[e] = from_f<T>(ACC ? to_f(o.v[e]) + v : v);
            }
            st_pack(y + i * V, o);
        } else {
            map2_one<ACC>(y, a, b, i, f);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) map2_one<ACC>(y, a, b, i, f);
}
/* map2_kernel on `stream`: blocks of 256 threads, at most 8 per multiprocessor;
 * fn names the op in the error message. ACC: accumulate into y. */
template <typename T, bool ACC = false, typename F>
static inline cudaError_t map2_launch(void *y, const void *a, const void *b, size_t n, F f, cudaStream_t stream,
                                      const char *fn)
{
    const int sms = smp_cuda_sm_count();
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 1024);
    if (smp_aligned16(y) && smp_aligned16(a) && smp_aligned16(b)) {
        auto k = map2_kernel<T, true, ACC, F>;
        SMP_LAUNCH(k, smp_blocks((n + Pack<T>::N - 1) / Pack<T>::N, 256, cap), 256, 0, stream, (T *)y, (const T *)a,
                   (const T *)b, n, f);
    } else {
        auto k = map2_kernel<T, false, ACC, F>;
        SMP_LAUNCH(k, smp_blocks(n, 256, cap), 256, 0, stream, (T *)y, (const T *)a, (const T *)b, n, f);
    }
    return smp_cuda_launched(fn);
}

/* --------------------------------------------------------------- reductions */
/* op over the 32 lanes of a warp (butterfly: every lane gets the result) */
template <typename V, typename Op> __device__ __forceinline__ V warp_reduce(V x, Op op)
{
    for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
struct SumOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinIOp {
    __device__ __forceinline__ int operator()(int a, int b) const { return b < a ? b : a; }
};
struct MaxIOp {
    __device__ __forceinline__ int operator()(int a, int b) const { return b > a ? b : a; }
};
__device__ __forceinline__ float warp_sum(float x) { return warp_reduce(x, SumOp()); }
__device__ __forceinline__ double warp_sum_d(double x) { return warp_reduce(x, SumOp()); }
__device__ __forceinline__ float warp_max(float x) { return warp_reduce(x, MaxOp()); }
__device__ __forceinline__ int warp_min_i(int x) { return warp_reduce(x, MinIOp()); }
__device__ __forceinline__ int warp_max_i(int x) { return warp_reduce(x, MaxIOp()); }

/* op over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
 * the result; id is op's identity (what the missing warps give). `red` is __shared__
 * scratch of 32 values; the call begins with a barrier so that red can be reused by
 * consecutive calls. */
template <typename V, typename Op> __device__ __forceinline__ V block_reduce(V x, V *red, V id, Op op)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_reduce(x, op);
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    V y = lane < nw ? red[lane] : id;
    return warp_reduce(y, op);
}
__device__ __forceinline__ float block_sum(float x, float *red) { return block_reduce(x, red, 0.0f, SumOp()); }
__device__ __forceinline__ double block_sum_d(double x, double *red) { return block_reduce(x, red, 0.0, SumOp()); }
__device__ __forceinline__ float block_max(float x, float *red) { return block_reduce(x, red, -INFINITY, MaxOp()); }

/* max |x| through an integer atomicMax on the bits: for non-negative floats the
 * bit patterns order as the values, and a (positive) NaN's bits exceed +inf's,
 * so NaN wins, as op_amax wants. */
__device__ __forceinline__ void atomic_amax(float *dst, float a)
{
    atomicMax(reinterpret_cast<int *>(dst), __float_as_int(fabsf(a)));
}

/* ------------------------------------------------- tensor cores and async copies */
/* D += A(16x16 bf16, row) * B(16x8 bf16, col), fp32 accumulators. Fragments as in the
 * PTX ISA for mma.m16n8k16: with g = lane/4, t = lane%4,
 *   a0:(g, 2t..2t+1) a1:(g+8, 2t..) a2:(g, 2t+8..) a3:(g+8, 2t+8..)
 *   b0:(k=2t..2t+1, n=g) b1:(k=2t+8.., n=g)
 *   d0,d1:(g, 2t..2t+1) d2,d3:(g+8, 2t..2t+1) */
__device__ __forceinline__ void mma_bf16_16816(float *d, const uint32_t *a, const uint32_t *b)
{
#ifdef SMP_CUDA_EMU
    emu_mma_bf16_16816(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* Four 8x8 b16 matrices from shared memory; lane l gives the address of row l%8 of
 * matrix l/8. Without trans, r[i] of lane l holds row l/4, columns 2(l%4)..+1 of
 * matrix i; with trans, rows 2(l%4)..+1 of column l/4. */
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4_t(uint32_t *r, const void *smem_row)
{
#ifdef SMP_CUDA_EMU
    emu_ldmatrix(r, 4, TRANS, smem_row);
#else
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem_row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
#endif
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *smem_row) { ldmatrix_x4_t<false>(r, smem_row); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *smem_row)
{
    ldmatrix_x4_t<true>(r, smem_row);
}

/* 16-byte global -> shared copy, asynchronous; zero-filled when !pred (src is then
 * not read, but must still be a valid address). */
__device__ __forceinline__ void cp_async16(void *smem_dst, const void *gmem_src, bool pred)
{
#ifdef SMP_CUDA_EMU
    emu_cp_async16(smem_dst, gmem_src, pred);
#else
    uint32_t d = (uint32_t)__cvta_generic_to_shared(smem_dst);
    int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem_src), "r"(n)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit()
{
#ifdef SMP_CUDA_EMU
    emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/* Wait until at most N of this thread's committed groups are still in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
#ifdef SMP_CUDA_EMU
    emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* two floats -> one register of two bf16 (low half = first) */
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

#endif
