/* kernels/linear.c: y = x @ W^T and its backward (portable C).
 *
 * With BLAS (the default) every product is cblas_sgemm, one call per thread. Built with
 * -DSMP_NO_BLAS (machines without BLAS, e.g. the GPU parity runner) the same
 * products go through a small cache-blocked OpenMP GEMM below: slower, same
 * results to fp32 rounding. */
#include "ops.h"

#include <stddef.h>
#include <string.h>

#ifndef SMP_NO_BLAS
#include <cblas.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* rows (or columns) of C per part: a multiple of the sgemm kernels' unroll */
enum { SPLIT_ALIGN = 16 };
/* below this many multiply-adds one call on one thread beats a parallel region */
#define SPLIT_MIN_MACS (1 << 20)

/* C[M,N] = op(A) op(B) + beta C (beta 0 or 1), row-major, as cblas_sgemm with alpha 1.
 * With several OpenMP threads, C's longer side is cut into one part per thread, each
 * part one sgemm called from inside the parallel region, where OpenBLAS (its OpenMP
 * build, which SConstruct links) runs on the calling thread alone. OpenBLAS's own
 * threading splits these thin products (2048 tokens x 128..704 outputs x 256 inputs)
 * less well: by hand, 2 threads, 136-162 GFLOP/s its way, 160-214 this way (docs/
 * DESIGN.md, "The C backend's GEMMs"). Neither way gives the same bits for every
 * thread count (test_kernels.py, test_linear_threads). */
static void sgemm(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                  float beta, float *C, int ldc)
{
    const CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    int nt = 1;
#ifdef _OPENMP
    if (!omp_in_parallel() && (double)M * N * K >= SPLIT_MIN_MACS)
        nt = omp_get_max_threads();
#endif
    const int rows = M >= N, len = rows ? M : N;
    const int part = ((len + nt - 1) / nt + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
    if (nt <= 1 || part >= len) {
        cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const int parts = (len + part - 1) / part;
    #pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int p = 0; p < parts; p++) {
        const size_t o = (size_t)p * part;
        const int n = p == parts - 1 ? len - (int)o : part;
        if (rows) /* rows o.. of C and of op(A) */
            cblas_sgemm(CblasRowMajor, TA, TB, n, N, K, 1.0f, A + (ta ? o : o * lda), lda, B, ldb, beta,
                        C + o * ldc, ldc);
        else /* columns o.. of C and of op(B) */
            cblas_sgemm(CblasRowMajor, TA, TB, M, n, K, 1.0f, A, lda, B + (tb ? o * ldb : o), ldb, beta,
                        C + o, ldc);
    }
}

void op_linear_forward(float *out, const float *inp, const float *weight,
                       int N, int IN, int OUT)
{
    if (N <= 0 || OUT <= 0)
        return;
    if (IN <= 0) { /* empty sum; BLAS would reject lda = 0 */
        memset(out, 0, (size_t)N * OUT * sizeof(float));
        return;
    }
    sgemm(0, 1, N, OUT, IN, inp, IN, weight, IN, 0.0f, out, OUT);
}

void op_linear_backward(float *dinp, float *dweight, const float *dout,
                        const float *inp, const float *weight, int N, int IN, int OUT)
{
    if (N <= 0 || IN <= 0 || OUT <= 0) /* nothing to add; BLAS would reject lda = 0 */
        return;
    if (dinp) /* dinp[N,IN] += dout[N,OUT] @ W[OUT,IN] */
        sgemm(0, 0, N, IN, OUT, dout, OUT, weight, IN, 1.0f, dinp, IN);
    if (dweight) /* dW[OUT,IN] += dout^T @ inp[N,IN] */
        sgemm(1, 0, OUT, IN, N, dout, OUT, inp, IN, 1.0f, dweight, IN);
}

#else /* SMP_NO_BLAS */

/* C[M,N] (row stride ldc) = or += sum_k A(m,k) * B(k,n), where
 * A(m,k) = A[m*sam + k*sak] and B(k,n) = B[k*sbk + n*sbn]: the strides express
 * each transpose. A tile of B is packed into a stack buffer with rows contiguous,
 * so the inner loop is a unit-stride axpy that vectorizes whatever the layout.
 * Threads own disjoint tiles of C; the k sum of each element runs in order. */
enum { GEMM_MB = 64, GEMM_NB = 128, GEMM_KB = 64 };

static void gemm(float *C, int ldc, const float *A, size_t sam, size_t sak,
                 const float *B, size_t sbk, size_t sbn, int M, int N, int K,
                 int accumulate)
{
    int mblocks = (M + GEMM_MB - 1) / GEMM_MB, nblocks = (N + GEMM_NB - 1) / GEMM_NB;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int mb = 0; mb < mblocks; mb++) {
        for (int nb = 0; nb < nblocks; nb++) {
            float bt[GEMM_KB][GEMM_NB]; /* 32 KiB: fits any thread stack */
            int m0 = mb * GEMM_MB, m1 = m0 + GEMM_MB < M ? m0 + GEMM_MB : M;
            int n0 = nb * GEMM_NB, n1 = n0 + GEMM_NB < N ? n0 + GEMM_NB : N;
            int nn = n1 - n0;
            if (!accumulate)
                for (int m = m0; m < m1; m++)
                    memset(C + (size_t)m * ldc + n0, 0, (size_t)nn * sizeof(float));
            for (int k0 = 0; k0 < K; k0 += GEMM_KB) {
                int kk = K - k0 < GEMM_KB ? K - k0 : GEMM_KB;
                for (int k = 0; k < kk; k++)
                    for (int j = 0; j < nn; j++)
                        bt[k][j] = B[(size_t)(k0 + k) * sbk + (size_t)(n0 + j) * sbn];
                for (int m = m0; m < m1; m++) {
                    float *c = C + (size_t)m * ldc + n0;
                    for (int k = 0; k < kk; k++) {
                        float a = A[(size_t)m * sam + (size_t)(k0 + k) * sak];
                        #pragma omp simd
                        for (int j = 0; j < nn; j++)
                            c[j] += a * bt[k][j];
                    }
                }
            }
        }
    }
}

void op_linear_forward(float *out, const float *inp, const float *weight,
                       int N, int IN, int OUT)
{
    /* out[n,o] = sum_i inp[n,i] * W[o,i]: B(i,o) = W[o*IN + i] */
    gemm(out, OUT, inp, (size_t)IN, 1, weight, 1, (size_t)IN, N, OUT, IN, 0);
}

void op_linear_backward(float *dinp, float *dweight, const float *dout,
                        const float *inp, const float *weight, int N, int IN, int OUT)
{
    if (dinp) /* dinp[n,i] += sum_o dout[n,o] * W[o,i] */
        gemm(dinp, IN, dout, (size_t)OUT, 1, weight, (size_t)IN, 1, N, IN, OUT, 1);
    if (dweight) /* dW[o,i] += sum_n dout[n,o] * inp[n,i] */
        gemm(dweight, IN, dout, 1, (size_t)OUT, inp, (size_t)IN, 1, OUT, IN, N, 1);
}

#endif /* SMP_NO_BLAS */
