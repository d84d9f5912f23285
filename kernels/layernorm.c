/* kernels/layernorm.c: LayerNorm as torch.nn.LayerNorm (GPT-NeoX's), and the row
 * normalization it shares with RMSNorm (kernels/norm.h; rmsnorm.c calls it without
 * centering or bias). Portable C. Row reductions are summed in double: H is up to
 * ~16k and the result feeds every later layer, so the extra precision is cheap
 * insurance. The variance is taken about the mean in a second pass (no cancellation). */
#include "norm.h"
#include "ops.h"

#include <math.h>

void norm_rows_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int N, int H, float eps)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * H;
        float *y = out + (size_t)n * H;
        double mu = 0.0;
        if (mean) {
            for (int j = 0; j < H; j++)
                mu += x[j];
            mu /= H;
        }
        double ss = 0.0;
        for (int j = 0; j < H; j++)
            ss += ((double)x[j] - mu) * ((double)x[j] - mu);
        float r = (float)(1.0 / sqrt(ss / H + (double)eps)), m = (float)mu;
        for (int j = 0; j < H; j++)
            y[j] = (x[j] - m) * r * weight[j];
        if (bias)
            for (int j = 0; j < H; j++)
                y[j] += bias[j];
        if (mean)
            mean[n] = m;
        rstd[n] = r;
    }
}

/* y_j = w_j xh_j (+ b_j), xh = (x - mu) r. With g' = w g:
 *   dx_i = r * (g'_i - mean_j(g'_j) - xh_i * mean_j(g'_j xh_j))
 * (the mean_j(g') term only when centering); in terms of xc = x - mu, the last term is
 * xc_i * r^2 * mean_j(g'_j xc_j), which is RMSNorm's formula when mu = 0. */
void norm_rows_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, const float *mean, const float *rstd, int N, int H)
{
    if (dinp) {
        #pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * H, *g = dout + (size_t)n * H;
            float *dx = dinp + (size_t)n * H;
            float r = rstd[n], m = mean ? mean[n] : 0.0f;
            double dot = 0.0, sg = 0.0;
            for (int j = 0; j < H; j++) {
                dot += (double)weight[j] * g[j] * (x[j] - m);
                if (mean)
                    sg += (double)weight[j] * g[j];
            }
            float c = (float)(dot / H) * r * r, a = (float)(sg / H);
            for (int j = 0; j < H; j++)
                dx[j] += r * (weight[j] * g[j] - a - (x[j] - m) * c);
        }
    }
    if (dbias)
        op_bias_backward(dbias, dout, N, H); /* the column sums of dout */
    if (!dweight)
        return;
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
            float r = rstd[n], m = mean ? mean[n] : 0.0f;
            for (int j = j0; j < j1; j++)
                acc[j - j0] += (double)(g[j] * (x[j] - m) * r);
        }
        for (int j = j0; j < j1; j++)
            dweight[j] += (float)acc[j - j0];
    }
}

void op_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                          const float *bias, int N, int H, float eps)
{
    norm_rows_forward(out, mean, rstd, inp, weight, bias, N, H, eps);
}

void op_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const float *weight, const float *mean,
                           const float *rstd, int N, int H)
{
    norm_rows_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, H);
}
