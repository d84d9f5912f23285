/* kernels/tile_gemm.c: the small products of the C attention's tiles, register-blocked
 * (portable C with GCC vector types): the body in tile_gemm_body.h, compiled here for
 * vectors of 8 floats (AVX2, and SSE as pairs) and in tile_gemm512.c for 16 (AVX-512);
 * smp_tile_gemm runs the widest the CPU has.
 *
 * Why not BLAS: a tile product is tens of thousands of multiply-adds (64 x 64 x 32),
 * and OpenBLAS 0.3.21 sends each through its packing path unless the CPU has its
 * small-matrix kernels (AVX-512 only): on an AVX2 Zen core 64 x 64 x 32 took 16.4 us,
 * 16 GFLOP/s where its large products reach 37. Here B's rows are read in place (every
 * tile product's right side is row-major), A's elements broadcast through any strides
 * (a transposed A is sam = 1), and a block of MR x NR outputs stays in registers for
 * the whole k loop. The linears stay with BLAS (large products, near the cores' peak).
 *
 * The same bits whichever thread runs a product: each output is one chain over k in
 * order (contracted into FMAs where the CPU has them, so CPUs of different widths may
 * differ in the last bit, as OpenBLAS's kernels do), then alpha, then + C. */
#include "tile_gemm.h"
#include "simd.h"

#include <math.h>
#include <stdatomic.h>

#define TG_VW 8
#define TG_MR 6 /* 6 x 2 accumulators: 12 of AVX2's 16 registers */
#if defined(__GNUC__) && !defined(__clang__)
#define TG_UNROLL _Pragma("GCC unroll 6")
#else
#define TG_UNROLL _Pragma("unroll")
#endif
#define TG_NAME smp_tile_gemm_v8
#define TG_ATTRS SMP_SIMD_CLONES
#include "tile_gemm_body.h"

/* the same sums one element at a time: a tail with k too long for the padded copy (both
 * widths; fmaf rounds as the vector forms' FMA does, so the widths agree here too) */
void smp_tile_gemm_scalar_tail(int M, int n0, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                        const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    for (int m = 0; m < M; m++) {
        for (int n = n0; n < N; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc = fmaf(A[m * sam + (size_t)k * sak], B[(size_t)k * ldb + n], acc); /* as the vectors' FMA */
            float *c = C + (size_t)m * ldc + n;
            *c = beta != 0.0f ? alpha * acc + *c : alpha * acc;
        }
    }
}

static int widest(void)
{
#if SMP_TILE_GEMM_512
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") ? 16 : 8;
#else
    return 8;
#endif
}

int smp_tile_gemm_w(int width, int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                    const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
#if SMP_TILE_GEMM_512
    if (width == 16) {
        smp_tile_gemm_v16(M, N, K, alpha, A, sam, sak, B, ldb, beta, C, ldc);
        return 16;
    }
#endif
    (void)width;
    smp_tile_gemm_v8(M, N, K, alpha, A, sam, sak, B, ldb, beta, C, ldc);
    return 8;
}

void smp_tile_gemm(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                   const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    static atomic_int width; /* 0 until the first call asks the CPU (any thread may: same answer) */
    int w = atomic_load_explicit(&width, memory_order_relaxed);
    if (!w) atomic_store_explicit(&width, w = widest(), memory_order_relaxed);
    smp_tile_gemm_w(w, M, N, K, alpha, A, sam, sak, B, ldb, beta, C, ldc);
}
