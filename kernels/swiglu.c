/* kernels/swiglu.c: SwiGLU, out = silu(gate) * up (portable C). */
#include "ops.h"

#include <math.h>

void op_swiglu_forward(float *out, const float *gate, const float *up, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* silu(g) = g s, s = sigmoid(g); silu'(g) = s + g s (1 - s) = s (1 + g (1 - s)) */
void op_swiglu_backward(float *dgate, float *dup, const float *dout,
                        const float *gate, const float *up, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        float s = 1.0f / (1.0f + expf(-g));
        dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] += dout[i] * g * s;
    }
}
