/* kernels/rmsnorm.c: RMSNorm as Llama's LlamaRMSNorm (portable C).
 * Row reductions are summed in double: H is up to ~16k and the result feeds
 * every later layer, so the extra precision is cheap insurance. */
#include "ops.h"

#include <math.h>

void op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                        int N, int H, float eps)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * H;
        float *y = out + (size_t)n * H;
        double ss = 0.0;
        for (int j = 0; j < H; j++)
            ss += (double)x[j] * x[j];
        float r = (float)(1.0 / sqrt(ss / H + (double)eps));
        for (int j = 0; j < H; j++)
            y[j] = x[j] * r * weight[j];
        rstd[n] = r;
    }
}

/* y_j = w_j x_j r with r = (mean(x^2) + eps)^-1/2 and dr/dx_i = -r^3 x_i / H, so
 * dx_i = r * (w_i g_i - x_i * r^2 * mean_j(w_j g_j x_j)). */
void op_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                         const float *inp, const float *weight, const float *rstd,
                         int N, int H)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * H, *g = dout + (size_t)n * H;
        float *dx = dinp + (size_t)n * H;
        float r = rstd[n];
        double dot = 0.0;
        for (int j = 0; j < H; j++)
            dot += (double)weight[j] * g[j] * x[j];
        float c = (float)(dot / H) * r * r;
        for (int j = 0; j < H; j++)
            dx[j] += r * (weight[j] * g[j] - x[j] * c);
    }
    /* dweight sums over all N rows: threads split the columns (one writer each)
     * and sum a column block in double before adding it once */
    enum { CB = 64 };
    int nblk = (H + CB - 1) / CB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblk; b++) {
        int j0 = b * CB, j1 = j0 + CB < H ? j0 + CB : H;
        double acc[CB] = {0};
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * H, *g = dout + (size_t)n * H;
            float r = rstd[n];
            for (int j = j0; j < j1; j++)
                acc[j - j0] += (double)(g[j] * x[j] * r);
        }
        for (int j = j0; j < j1; j++)
            dweight[j] += (float)acc[j - j0];
    }
}
