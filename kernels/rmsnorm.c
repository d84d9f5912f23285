/* kernels/rmsnorm.c: RMSNorm as Llama's LlamaRMSNorm (portable C): the row
 * normalization of kernels/norm.h (layernorm.c) without centering or bias. */
#include "norm.h"
#include "ops.h"

void op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                        int N, int H, float eps)
{
    norm_rows_forward(out, NULL, rstd, inp, weight, NULL, N, H, eps);
}

/* y_j = w_j x_j r with r = (mean(x^2) + eps)^-1/2 and dr/dx_i = -r^3 x_i / H, so
 * dx_i = r * (w_i g_i - x_i * r^2 * mean_j(w_j g_j x_j)). */
void op_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                         const float *inp, const float *weight, const float *rstd,
                         int N, int H)
{
    norm_rows_backward(dinp, dweight, NULL, dout, inp, weight, NULL, rstd, N, H);
}
