/* kernels/adamw.c: AdamW as torch.optim.AdamW (portable C): decoupled weight decay
 * param *= 1 - lr * wd, then the bias-corrected Adam step, in torch's order:
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
 *   param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * The scalar factors are computed in double and rounded once, as torch does with
 * its Python-float hyperparameters. */
#include "ops.h"
#include "simd.h"

#include <math.h>

/* a block of the update, compiled per vector width (simd.h); element-wise, so the same
 * bits on every width */
SMP_SIMD_CLONES static void adamw_block(float *param, const float *grad, float *m, float *v, size_t n,
                                        float beta1, float beta2, float one_m_b1, float one_m_b2,
                                        float eps, float decay, float step_size, float bc2_sqrt)
{
    #pragma omp simd
    for (size_t i = 0; i < n; i++) {
        const float g = grad[i];
        const float mi = m[i] * beta1 + one_m_b1 * g;
        const float vi = v[i] * beta2 + one_m_b2 * (g * g);
        m[i] = mi;
        v[i] = vi;
        const float denom = __builtin_sqrtf(vi) / bc2_sqrt + eps;
        param[i] = param[i] * decay - step_size * (mi / denom);
    }
}

void op_adamw(float *param, const float *grad, float *m, float *v, size_t n,
              float lr, float beta1, float beta2, float eps, float weight_decay, int step)
{
    enum { BLOCK = 8192 };
    const float decay = (float)(1.0 - (double)lr * weight_decay);
    const float one_m_b1 = (float)(1.0 - (double)beta1), one_m_b2 = (float)(1.0 - (double)beta2);
    const float step_size = (float)((double)lr / (1.0 - pow((double)beta1, step)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow((double)beta2, step));
    const size_t nb = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        const size_t o = b * BLOCK, len = n - o < BLOCK ? n - o : BLOCK;
        adamw_block(param + o, grad + o, m + o, v + o, len, beta1, beta2, one_m_b1, one_m_b2, eps, decay,
                    step_size, bc2_sqrt);
    }
}
