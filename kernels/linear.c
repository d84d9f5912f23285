/* kernels/linear.c: y = x @ W^T and its backward (portable C).
 *
 * With BLAS (the default) every product is one cblas_sgemm. Built with
 * -DSMP_NO_BLAS (machines without BLAS, e.g. the GPU parity runner) the same
 * products go through a small cache-blocked OpenMP GEMM below: slower, same
 * results to fp32 rounding. */
#include "ops.h"

#include <stddef.h>
#include <string.h>

#ifndef SMP_NO_BLAS
#include <cblas.h>
#include <omp.h>

void op_linear_forward(float *out, const float *inp, const float *weight,
                       int N, int IN, int OUT)
{
    if (N <= 0 || OUT <= 0)
        return;
    /* out zeroed here and added to (beta 1), not beta 0: OpenBLAS zeroes C for beta 0
     * with its own store loop, then adds to it all the same (the same bits either way);
     * memset was 15% faster at 2048 x 256 -> 512 and -> 1408, even at -> 4096 (Zen 2,
     * 2 threads, by hand) */
    memset(out, 0, (size_t)N * OUT * sizeof(float));
    if (IN <= 0) /* empty sum; BLAS would reject lda = 0 */
        return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OUT, IN,
                1.0f, inp, IN, weight, IN, 1.0f, out, OUT);
}

/* dinp[N,IN] += dout[N,OUT] @ W[OUT,IN] */
static void add_dinp(float *dinp, const float *dout, const float *weight, int N, int IN, int OUT)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IN, OUT,
                1.0f, dout, OUT, weight, IN, 1.0f, dinp, IN);
}

/* dW[OUT,IN] += dout^T @ inp[N,IN] */
static void add_dweight(float *dweight, const float *dout, const float *inp, int N, int IN, int OUT)
{
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OUT, IN, N,
                1.0f, dout, OUT, inp, IN, 1.0f, dweight, IN);
}

void op_linear_backward(float *dinp, float *dweight, const float *dout,
                        const float *inp, const float *weight, int N, int IN, int OUT)
{
    if (N <= 0 || IN <= 0 || OUT <= 0) /* nothing to add; BLAS would reject lda = 0 */
        return;
    /* With two threads, the two products side by side, one a core (OpenBLAS runs
     * single-threaded inside a parallel region): its own two-thread split of each spent
     * 3-15% of the time on its threads' meeting points (Zen 2, 2048 tokens, 256 ->
     * 256..4096 and 704 -> 256, by hand: 141-163 GFLOP/s for the pair against 160-170).
     * The two have the same FLOPs. Other thread counts keep OpenBLAS's split (not
     * measured: a product per thread would leave cores idle). */
    if (dinp && dweight && omp_get_max_threads() == 2 && !omp_in_parallel()) {
        #pragma omp parallel sections num_threads(2)
        {
            #pragma omp section
            add_dinp(dinp, dout, weight, N, IN, OUT);
            #pragma omp section
            add_dweight(dweight, dout, inp, N, IN, OUT);
        }
        return;
    }
    if (dinp)
        add_dinp(dinp, dout, weight, N, IN, OUT);
    if (dweight)
        add_dweight(dweight, dout, inp, N, IN, OUT);
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
