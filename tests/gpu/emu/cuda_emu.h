/* tests/gpu/emu/cuda_emu.h: a CPU emulator of the CUDA features the kernels (.cu) use,
 * so that their index arithmetic, fragment layouts, barriers and async-copy groups
 * can be checked on a machine without a GPU (scons variant=emu, tools/emu-check).
 *
 * Compiled with a host C++17 compiler and -DSMP_CUDA_EMU; kernels/cuda_common.cuh
 * includes this header instead of <cuda_runtime.h>. What it models:
 *   - a launch runs its blocks one after another; the threads of a block are
 *     cooperative fibers, switched only at synchronization points (on x86-64 by a
 *     few instructions of cuda_emu.cpp's own; under AddressSanitizer and elsewhere
 *     by ucontext), so __shared__ variables (static here) and dynamic shared memory
 *     are per block;
 *   - __syncthreads, __syncwarp and every warp-collective (shuffles, __any_sync,
 *     mma.sync, ldmatrix) are barriers over the threads (or the warp's lanes) that
 *     have not exited; collectives exchange values through per-warp slots;
 *   - mma.m16n8k16 bf16 and ldmatrix(.trans) with the PTX ISA's fragment layouts,
 *     asserting 16-byte aligned row addresses;
 *   - cp.async copies are deferred until a cp.async.wait_group that covers their
 *     group (a kernel that reads shared memory before waiting sees stale data);
 *   - dynamic shared memory and cudaMalloc'd memory start as 0xff bytes (NaN), so
 *     reads of never-written memory show;
 *   - streams, for the communicator (nccl_emu.cpp): the NCCL calls are deferred on
 *     their stream and run when that stream's order requires it (a kernel, copy or
 *     GEMM on it, a synchronization of it, a wait for an event recorded on it), so
 *     that a buffer read before the wait that covers its transfer shows stale data
 *     and one written while a transfer is in flight sends the new values. Kernels,
 *     copies and GEMMs themselves run at once.
 * What it does not model: timing, memory races between threads of a block other
 * than through missing barriers, warp divergence inside collectives (every lane of
 * a warp must reach the same collective, which the kernels guarantee anyway).
 * The runtime API and the part of cuBLASLt the kernels use are implemented in
 * cuda_emu.cpp on host memory.
 *
 * Environment: SMP_EMU_SHUFFLE=seed runs the threads of a block in a random order
 * at every round (races show as failures); SMP_EMU_SMS=n sets the multiprocessor
 * count (3); SMP_EMU_NO_DEVICE=1 reports no device; SMP_EMU_DEVICES=n reports n
 * devices (all the same host memory; for several MPI ranks on one machine); SMP_EMU_LT_AMAX_FP8_ONLY=1
 * makes the emulated cuBLASLt refuse AMAX_D for non-FP8 outputs;
 * SMP_EMU_CPASYNC=eager|barrier performs cp.async copies at issue, or at the
 * first __syncthreads after the covering wait, instead of at the wait (run all
 * three: lazy catches reads before the wait, eager buffers refilled while still
 * being read, barrier reads of other threads' copies without a barrier between;
 * barrier mode assumes a thread never reads its own copies before a barrier). */
#ifndef SMP_CUDA_EMU_H
#define SMP_CUDA_EMU_H

#ifndef SMP_CUDA_EMU
#error "cuda_emu.h is only for builds with -DSMP_CUDA_EMU"
#endif

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

/* ---- scheduling and synchronization (cuda_emu.cpp) */
void emu_run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body);
/* ---- streams: work deferred on a stream (emulated NCCL), run in order by
 * emu_stream_flush, which every kernel, copy and GEMM on that stream calls first */
void emu_stream_defer(cudaStream_t s, std::function<void()> work);
void emu_stream_flush(cudaStream_t s);
/* s never completes (a hung NCCL call, nccl_emu.cpp): queries say not ready, its work
 * stays queued, a stream made to wait for an event recorded on it (cudaStreamWaitEvent)
 * waits behind it likewise, and a host synchronization with either ends the program */
void emu_stream_stall(cudaStream_t s);
/* the stall ended (the hung call's communicator aborted: on a GPU its kernel ends),
 * for the streams waiting behind it too */
void emu_stream_release(cudaStream_t s);
/* is [p, p + n) inside one cudaMalloc'd allocation? */
bool emu_device_range(const void *p, size_t n);
void *emu_dyn_smem();
void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);
enum { EMU_SLOT = 64 }; /* bytes per lane in a warp exchange */
/* every lane passes `size` (<= EMU_SLOT) bytes; all[l * EMU_SLOT ...] receives lane l's */
void emu_warp_exchange(const void *mine, size_t size, void *all /* [32][EMU_SLOT] */);
int __any_sync(unsigned mask, int pred);
int __all_sync(unsigned mask, int pred);
void emu_mma_bf16_16816(float *d, const uint32_t *a, const uint32_t *b);
void emu_ldmatrix(uint32_t *r, int nmat, bool trans, const void *smem_row);
void emu_cp_async16(void *dst, const void *src, bool pred);
void emu_cp_async_commit();
void emu_cp_async_wait(int n);
void __threadfence();

template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args)
{
    static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
    std::tuple<P...> t(static_cast<P>(args)...);
    emu_run_grid(grid, block, smem, [&]() { std::apply(kernel, t); });
}

template <typename T> T emu_shfl(T v, int src)
{
    static_assert(sizeof(T) <= 16, "shuffle of a large type");
    unsigned char all[32][EMU_SLOT];
    emu_warp_exchange(&v, sizeof(T), all);
    T r;
    memcpy(&r, all[src & 31], sizeof(T));
    return r;
}
static inline int emu_lane() { return (int)((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int lanemask, int = 32) { return emu_shfl(v, emu_lane() ^ lanemask); }
template <typename T> T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_shfl(v, src); }
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned d, int = 32)
{
    int s = emu_lane() + (int)d;
    T r = emu_shfl(v, s & 31);
    return s < 32 ? r : v;
}

/* ---- atomics: one OS thread runs every fiber, and fibers switch only at
 * synchronization points, so plain read-modify-writes are atomic */
static inline float atomicAdd(float *p, float v) { float o = *p; *p = o + v; return o; }
static inline double atomicAdd(double *p, double v) { double o = *p; *p = o + v; return o; }
static inline unsigned atomicAdd(unsigned *p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
static inline int atomicMax(int *p, int v) { int o = *p; if (v > o) *p = v; return o; }
static inline unsigned atomicMax(unsigned *p, unsigned v) { unsigned o = *p; if (v > o) *p = v; return o; }

/* ---- device math and bit casts that host libm lacks */
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
static inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
static inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
template <typename T> static inline T __ldg(const T *p) { return *p; }
/* PRMT's default mode: selector nibble i picks byte (n & 7) of {y:x} for result byte i,
 * its sign replicated when n & 8 */
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s)
{
    const uint64_t xy = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        const unsigned n = (s >> (4 * i)) & 15u, b = (unsigned)(xy >> (8 * (n & 7))) & 0xffu;
        r |= (n & 8 ? (b & 0x80 ? 0xffu : 0u) : b) << (8 * i);
    }
    return r;
}

#endif
