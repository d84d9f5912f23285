/* kernels/gelu.c: GELU, exact (erf) form, as torch.nn.functional.gelu's default and
 * GPT-NeoX's hidden_act "gelu" (portable C). */
#include "ops.h"

#include <math.h>

/* Phi(x) = (1 + erf(x / sqrt 2)) / 2 */
static inline float gelu_cdf(float x) { return 0.5f * (1.0f + erff(x * 0.70710678118654752f)); }

void op_gelu_forward(float *out, const float *inp, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        out[i] = x * gelu_cdf(x);
    }
}

/* gelu(x) = x Phi(x); gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi) */
void op_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n)
{
    const float inv_sqrt_2pi = 0.3989422804014327f;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        dinp[i] += dout[i] * (gelu_cdf(x) + x * (inv_sqrt_2pi * expf(-0.5f * x * x)));
    }
}
