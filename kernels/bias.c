/* kernels/bias.c: a bias added to every row, and its gradient (portable C).
 * The backward splits the columns between threads (one writer each) and sums each
 * column's rows in row order in double: the result is the same bits for any
 * thread count, as rmsnorm's dweight. */
#include "ops.h"

void op_bias_forward(float *out, const float *bias, int N, int C)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *y = out + (size_t)n * C;
        for (int j = 0; j < C; j++)
            y[j] += bias[j];
    }
}

void op_bias_backward(float *dbias, const float *dout, int N, int C)
{
    enum { CB = 64 };
    int nblk = (C + CB - 1) / CB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblk; b++) {
        int j0 = b * CB, j1 = j0 + CB < C ? j0 + CB : C;
        double acc[CB] = {0};
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C;
            for (int j = j0; j < j1; j++)
                acc[j - j0] += g[j];
        }
        for (int j = j0; j < j1; j++)
            dbias[j] += (float)acc[j - j0];
    }
}
