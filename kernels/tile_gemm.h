/* kernels/tile_gemm.h: the register-blocked small product of the C attention's tiles
 * (kernels/tile_gemm.c). */
#ifndef SMP_KERNELS_TILE_GEMM_H
#define SMP_KERNELS_TILE_GEMM_H

#include <stddef.h>

/* C[M][N] (row stride ldc) = beta C + alpha sum_k A(m,k) B[k][n] for k in [0, K), where
 * A(m,k) = A[m * sam + k * sak] (a transposed A: sam = 1) and B is row-major with row
 * stride ldb; beta 0 (C is not read) or 1. K = 0 gives beta C. */
void smp_tile_gemm(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                   const float *B, size_t ldb, float beta, float *C, size_t ldc);
/* The same at a given vector width: 8, or 16 (AVX-512 CPUs only; where the build has no
 * 16-float form, 8); returns the width it ran. The bits are the same at both: tests
 * compare them. */
int smp_tile_gemm_w(int width, int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                    const float *B, size_t ldb, float beta, float *C, size_t ldc);

/* The widths' own forms and their shared scalar tail (tile_gemm_body.h). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(SMP_NO_SIMD_CLONES)
#define SMP_TILE_GEMM_512 1
void smp_tile_gemm_v16(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                       const float *B, size_t ldb, float beta, float *C, size_t ldc);
#else
#define SMP_TILE_GEMM_512 0
#endif
void smp_tile_gemm_v8(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                      const float *B, size_t ldb, float beta, float *C, size_t ldc);
void smp_tile_gemm_scalar_tail(int M, int n0, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                               const float *B, size_t ldb, float beta, float *C, size_t ldc);

#endif
