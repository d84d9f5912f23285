/* kernels/layernorm.c: LayerNorm as torch.nn.LayerNorm (GPT-NeoX's), and the row
 * normalization it shares with RMSNorm (kernels/norm.h; rmsnorm.c calls it without
 * centering or bias). Portable C. Row reductions are summed in double: H is up to
 * ~16k and the result feeds every later layer, so the extra precision is cheap
 * insurance. The variance is taken about the mean in a second pass (no cancellation).
 * The row loops run in vector lanes (simd.h). */
#include "norm.h"
#include "ops.h"
#include "simd.h"

#include <math.h>

/* One row of the forward: its mean (when centering) and rstd; compiled per vector width
 * (simd.h), the double sums in vector lanes (a fixed order for a CPU, any threads) */
SMP_SIMD_CLONES static void forward_row(float *y, float *mean, float *rstd, const float *x,
                                        const float *weight, const float *bias, int H, float eps)
{
    double mu = 0.0;
    if (mean) {
        #pragma omp simd reduction(+ : mu)
        for (int j = 0; j < H; j++)
            mu += x[j];
        mu /= H;
    }
    double ss = 0.0;
    #pragma omp simd reduction(+ : ss)
    for (int j = 0; j < H; j++)
        ss += ((double)x[j] - mu) * ((double)x[j] - mu);
    const float r = (float)(1.0 / sqrt(ss / H + (double)eps)), m = (float)mu;
    #pragma omp simd
    for (int j = 0; j < H; j++)
        y[j] = (x[j] - m) * r * weight[j];
    if (bias) {
        #pragma omp simd
        for (int j = 0; j < H; j++)
            y[j] += bias[j];
    }
    if (mean)
        *mean = m;
    *rstd = r;
}

void norm_rows_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int N, int H, float eps)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        forward_row(out + (size_t)n * H, mean ? mean + n : NULL, rstd + n, inp + (size_t)n * H, weight, bias,
                    H, eps);
}

/* y_j = w_j xh_j (+ b_j), xh = (x - mu) r. With g' = w g:
 *   dx_i = r * (g'_i - mean_j(g'_j) - xh_i * mean_j(g'_j xh_j))
 * (the mean_j(g') term only when centering); in terms of xc = x - mu, the last term is
 * xc_i * r^2 * mean_j(g'_j xc_j), which is RMSNorm's formula when mu = 0. */
SMP_SIMD_CLONES static void backward_row(float *dx, const float *x, const float *g, const float *weight,
                                         float m, float r, int centered, int H)
{
    double dot = 0.0, sg = 0.0;
    #pragma omp simd reduction(+ : dot)
    for (int j = 0; j < H; j++)
        dot += (double)weight[j] * g[j] * (x[j] - m);
    if (centered) {
        #pragma omp simd reduction(+ : sg)
        for (int j = 0; j < H; j++)
            sg += (double)weight[j] * g[j];
    }
    const float c = (float)(dot / H) * r * r, a = (float)(sg / H);
    #pragma omp simd
    for (int j = 0; j < H; j++)
        dx[j] += r * (weight[j] * g[j] - a - (x[j] - m) * c);
}

void norm_rows_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, const float *mean, const float *rstd, int N, int H)
{
    if (dinp) {
        #pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            backward_row(dinp + (size_t)n * H, inp + (size_t)n * H, dout + (size_t)n * H, weight,
                         mean ? mean[n] : 0.0f, rstd[n], mean != NULL, H);
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
