/* kernels/tile_gemm.c: the small products of the C attention's tiles, register-blocked
 * (portable C with GCC vector types; one variant per vector width, as simd.h says).
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

#include <string.h>

/* a * b + c as one FMA in the AVX2 and AVX-512 variants (ISO C contracts nothing) */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif
/* the vector helpers are always inlined into their variant: no vector crosses a call */
#pragma GCC diagnostic ignored "-Wpsabi"

/* MR rows x NR columns of C per block, NR as NV vectors of 8: 12 of AVX2's 16 registers */
enum { MR = 6, NV = 2, NR = 8 * NV };
/* the longest k of a block narrower than NR (its B columns copied, zero-padded) */
enum { TAIL_K_MAX = 256 };

/* the row loops unrolled, so that acc stays in registers (-O2 keeps such loops) */
#if defined(__GNUC__) && !defined(__clang__)
#define SMP_UNROLL_MR _Pragma("GCC unroll 6")
#else
#define SMP_UNROLL_MR _Pragma("unroll")
#endif

typedef float vec __attribute__((vector_size(8 * sizeof(float))));

SMP_SIMD_INLINE vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* C[0..mr)[0..NR) = beta C + alpha A B over k in [0, K); mr a constant where inlined */
SMP_SIMD_INLINE void block(int mr, int K, float alpha, const float *A, size_t sam, size_t sak,
                           const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    vec acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = (vec){0};
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb, *a = A + (size_t)k * sak;
        vec bv[NV];
        for (int v = 0; v < NV; v++)
            bv[v] = load(b + 8 * v);
        SMP_UNROLL_MR
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < NV; v++)
                acc[r][v] += a[r * sam] * bv[v];
    }
    for (int r = 0; r < mr; r++) {
        for (int v = 0; v < NV; v++) {
            vec c = alpha * acc[r][v];
            if (beta != 0.0f)
                c += load(C + r * ldc + 8 * v);
            memcpy(C + r * ldc + 8 * v, &c, sizeof c);
        }
    }
}

/* rows [0, M) of one NR-wide column block, MR rows at a time */
SMP_SIMD_INLINE void column_block(int M, int K, float alpha, const float *A, size_t sam, size_t sak,
                                  const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    int m = 0;
    for (; m + MR <= M; m += MR)
        block(MR, K, alpha, A + m * sam, sam, sak, B, ldb, beta, C + m * ldc, ldc);
    const float *a = A + m * sam;
    float *c = C + m * ldc;
    switch (M - m) { /* each a constant row count, so each keeps its rows in registers */
    case 5: block(5, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 4: block(4, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 3: block(3, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 2: block(2, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 1: block(1, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    default: break;
    }
}

/* the last w < NR columns: B's copied zero-padded, C's through a padded row of MR */
SMP_SIMD_INLINE void column_tail(int M, int w, int K, float alpha, const float *A, size_t sam, size_t sak,
                                 const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    float bp[TAIL_K_MAX * NR], cp[MR * NR];
    memset(bp, 0, (size_t)K * NR * sizeof(float));
    for (int k = 0; k < K; k++)
        memcpy(bp + k * NR, B + (size_t)k * ldb, (size_t)w * sizeof(float));
    for (int m = 0; m < M; m += MR) {
        const int mr = M - m < MR ? M - m : MR;
        for (int r = 0; r < mr; r++)
            memcpy(cp + r * NR, C + (size_t)(m + r) * ldc, (size_t)w * sizeof(float));
        column_block(mr, K, alpha, A + m * sam, sam, sak, bp, NR, beta, cp, NR);
        for (int r = 0; r < mr; r++)
            memcpy(C + (size_t)(m + r) * ldc, cp + r * NR, (size_t)w * sizeof(float));
    }
}

/* the same sums one element at a time: a tail with k too long for the padded copy */
static void scalar_tail(int M, int n0, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                        const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    for (int m = 0; m < M; m++) {
        for (int n = n0; n < N; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc += A[m * sam + (size_t)k * sak] * B[(size_t)k * ldb + n];
            float *c = C + (size_t)m * ldc + n;
            *c = beta != 0.0f ? alpha * acc + *c : alpha * acc;
        }
    }
}

SMP_SIMD_CLONES void smp_tile_gemm(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                                   const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    if (M <= 0 || N <= 0)
        return;
    int n = 0;
    for (; n + NR <= N; n += NR)
        column_block(M, K, alpha, A, sam, sak, B + n, ldb, beta, C + n, ldc);
    if (n == N)
        return;
    if (K <= TAIL_K_MAX)
        column_tail(M, N - n, K, alpha, A, sam, sak, B + n, ldb, beta, C + n, ldc);
    else
        scalar_tail(M, n, N, K, alpha, A, sam, sak, B, ldb, beta, C, ldc);
}
