/* kernels/swiglu.c: SwiGLU, out = silu(gate) * up (portable C). The sigmoid's exp is
 * smp_expf, vectorized: the loops run in blocks, a block per call of a helper
 * compiled for each vector width (simd.h). */
#include "ops.h"
#include "simd.h"

enum { BLOCK = 4096 };

SMP_SIMD_CLONES static void forward_block(float *out, const float *gate, const float *up, size_t n)
{
    #pragma omp simd
    for (size_t i = 0; i < n; i++)
        out[i] = gate[i] / (1.0f + smp_expf(-gate[i])) * up[i];
}

/* silu(g) = g s, s = sigmoid(g); silu'(g) = s + g s (1 - s) = s (1 + g (1 - s)) */
SMP_SIMD_CLONES static void backward_block(float *dgate, float *dup, const float *dout,
                                           const float *gate, const float *up, size_t n)
{
    #pragma omp simd
    for (size_t i = 0; i < n; i++) {
        const float g = gate[i], s = 1.0f / (1.0f + smp_expf(-g));
        dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] += dout[i] * g * s;
    }
}

static size_t block_len(size_t b, size_t n) { return n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK; }

void op_swiglu_forward(float *out, const float *gate, const float *up, size_t n)
{
    const size_t nb = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++)
        forward_block(out + b * BLOCK, gate + b * BLOCK, up + b * BLOCK, block_len(b, n));
}

void op_swiglu_backward(float *dgate, float *dup, const float *dout,
                        const float *gate, const float *up, size_t n)
{
    const size_t nb = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        const size_t o = b * BLOCK;
        backward_block(dgate + o, dup + o, dout + o, gate + o, up + o, block_len(b, n));
    }
}
