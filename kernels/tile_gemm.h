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

#endif
