/* kernels/tile_gemm_body.h: the register-blocked tile product at one vector width,
 * included once by each width's file (tile_gemm.c: 8 floats, tile_gemm512.c: 16), which
 * defines TG_VW (floats a vector), TG_MR (rows a block), TG_UNROLL (the row loop's
 * unroll pragma), TG_NAME and TG_ATTRS (the entry point and its attributes). The sums
 * are the same whatever the width: each output element is its own lane, one chain
 * over k in order. */
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

/* MR rows x NR columns of C per block, NR as NV vectors of VW floats; a block of one
 * vector (nv 1) takes the last VW columns where fewer than NR are left */
enum { MR = TG_MR, NV = 2, VW = TG_VW, NR = VW * NV };
/* the longest k of a block narrower than VW (its B columns copied, zero-padded) */
enum { TAIL_K_MAX = 256 };

typedef float vec __attribute__((vector_size(VW * sizeof(float))));

SMP_SIMD_INLINE vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* C[0..mr)[0..nv VW) = beta C + alpha A B over k in [0, K); mr, nv constants where inlined */
SMP_SIMD_INLINE void block(int mr, int nv, int K, float alpha, const float *A, size_t sam, size_t sak,
                           const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    vec acc[MR][NV];
    /* set-up and store unrolled as the k loop's rows are: left as loops, GCC keeps acc on
     * the stack and stores it through memory (a quarter of a product of k 16, by hand) */
    TG_UNROLL
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = (vec){0};
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb, *a = A + (size_t)k * sak;
        vec bv[NV];
        for (int v = 0; v < nv; v++)
            bv[v] = load(b + VW * v);
        TG_UNROLL
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++)
                acc[r][v] += a[r * sam] * bv[v];
    }
    TG_UNROLL
    for (int r = 0; r < mr; r++) {
        for (int v = 0; v < nv; v++) {
            vec c = alpha * acc[r][v];
            if (beta != 0.0f)
                c += load(C + r * ldc + VW * v);
            memcpy(C + r * ldc + VW * v, &c, sizeof c);
        }
    }
}

/* rows [0, M) of one column block of nv vectors, MR rows at a time */
SMP_SIMD_INLINE void column_block(int M, int nv, int K, float alpha, const float *A, size_t sam, size_t sak,
                                  const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    int m = 0;
    for (; m + MR <= M; m += MR)
        block(MR, nv, K, alpha, A + m * sam, sam, sak, B, ldb, beta, C + m * ldc, ldc);
    const float *a = A + m * sam;
    float *c = C + m * ldc;
    switch (M - m) { /* each a constant row count, so each keeps its rows in registers */
#if TG_MR > 7
    case 7: block(7, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 6: block(6, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
#endif
    case 5: block(5, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 4: block(4, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 3: block(3, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 2: block(2, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    case 1: block(1, nv, K, alpha, a, sam, sak, B, ldb, beta, c, ldc); break;
    default: break;
    }
}

/* the last w < VW columns: B's copied zero-padded, C's through a padded row of MR */
SMP_SIMD_INLINE void column_tail(int M, int w, int K, float alpha, const float *A, size_t sam, size_t sak,
                                 const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    float bp[TAIL_K_MAX * VW], cp[MR * VW];
    memset(bp, 0, (size_t)K * VW * sizeof(float));
    for (int k = 0; k < K; k++)
        memcpy(bp + k * VW, B + (size_t)k * ldb, (size_t)w * sizeof(float));
    for (int m = 0; m < M; m += MR) {
        const int mr = M - m < MR ? M - m : MR;
        for (int r = 0; r < mr; r++)
            memcpy(cp + r * VW, C + (size_t)(m + r) * ldc, (size_t)w * sizeof(float));
        column_block(mr, 1, K, alpha, A + m * sam, sam, sak, bp, VW, beta, cp, VW);
        for (int r = 0; r < mr; r++)
            memcpy(C + (size_t)(m + r) * ldc, cp + r * VW, (size_t)w * sizeof(float));
    }
}

TG_ATTRS void TG_NAME(int M, int N, int K, float alpha, const float *A, size_t sam, size_t sak,
                      const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    if (M <= 0 || N <= 0)
        return;
    int n = 0;
    for (; n + NR <= N; n += NR)
        column_block(M, NV, K, alpha, A, sam, sak, B + n, ldb, beta, C + n, ldc);
    for (; n + VW <= N; n += VW) /* a head dim of 16 at 16 floats: no padded copy */
        column_block(M, 1, K, alpha, A, sam, sak, B + n, ldb, beta, C + n, ldc);
    if (n == N)
        return;
    if (K <= TAIL_K_MAX)
        column_tail(M, N - n, K, alpha, A, sam, sak, B + n, ldb, beta, C + n, ldc);
    else
        smp_tile_gemm_scalar_tail(M, n, N, K, alpha, A, sam, sak, B, ldb, beta, C, ldc);
}
