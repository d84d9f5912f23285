/* kernels/xent.c: cross-entropy over a vocabulary shard (portable C).
 *
 * Each tp rank holds logits columns [vocab_start, vocab_start + Vl). The loss needs
 * three per-row statistics, each reduced over the tp group by the caller between
 * the steps (see ops.h): the row max, sum exp(logit - max), and the target's logit.
 * Sums run in double: Vl is tens of thousands of columns. The exps are of logits less
 * their row's max or log-sum-exp (<= 0): smp_expf_shifted's, vectorized (a row's sum
 * then adds in vector lanes: fixed for a CPU, any threads). */
#include "ops.h"
#include "simd.h"

#include <math.h>

static inline int owns(int32_t t, int vocab_start, int Vl)
{
    return t >= vocab_start && t - vocab_start < Vl;
}

/* a row's max, in vector lanes (the scalar loop's chain of compares was 0.5% of a 1 x
 * 4096 step); exact in any order, and a NaN never wins, as in that loop */
SMP_SIMD_CLONES static float row_max(const float *x, int Vl)
{
    float m = -INFINITY;
    #pragma omp simd reduction(max : m)
    for (int j = 0; j < Vl; j++)
        m = x[j] > m ? x[j] : m;
    return m;
}

void op_xent_rowmax(float *rowmax, float *target_logit, const float *logits,
                    const int32_t *targets, int N, int Vl, int vocab_start)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vl;
        rowmax[n] = row_max(x, Vl);
        int32_t t = targets[n];
        /* 0 where another rank owns the target: the tp sum then gives its logit */
        target_logit[n] = owns(t, vocab_start, Vl) ? x[t - vocab_start] : 0.0f;
    }
}

SMP_SIMD_CLONES static double row_sumexp(const float *x, float m, int Vl)
{
    const smp_exp_bounds eb = smp_exp_bounds_opaque();
    double s = 0.0;
    #pragma omp simd reduction(+ : s)
    for (int j = 0; j < Vl; j++)
        s += smp_expf_shifted(x[j] - m, eb);
    return s;
}

/* dx = scale softmax(x) for one row */
SMP_SIMD_CLONES static void row_softmax(float *dx, const float *x, float lse, float scale, int Vl)
{
    const smp_exp_bounds eb = smp_exp_bounds_opaque();
    #pragma omp simd
    for (int j = 0; j < Vl; j++)
        dx[j] = scale * smp_expf_shifted(x[j] - lse, eb);
}

void op_xent_sumexp(float *sumexp, const float *logits, const float *rowmax, int N, int Vl)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vl;
        sumexp[n] = (float)row_sumexp(x, rowmax[n], Vl);
    }
}

double op_xent_loss(float *losses, const float *rowmax, const float *sumexp,
                    const float *target_logit, const int32_t *targets, int N)
{
    double total = 0.0;
    #pragma omp parallel for reduction(+ : total) schedule(static)
    for (int n = 0; n < N; n++) {
        if (targets[n] < 0) {
            losses[n] = 0.0f;
            continue;
        }
        double l = log((double)sumexp[n]) + rowmax[n] - target_logit[n];
        losses[n] = (float)l;
        total += l;
    }
    return total;
}

void op_xent_backward(float *dlogits, const float *logits, const float *rowmax,
                      const float *sumexp, const int32_t *targets,
                      int N, int Vl, int vocab_start, float scale)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vl;
        float *dx = dlogits + (size_t)n * Vl;
        const int32_t t = targets[n];
        if (t < 0) {
            for (int j = 0; j < Vl; j++)
                dx[j] = 0.0f;
            continue;
        }
        row_softmax(dx, x, rowmax[n] + logf(sumexp[n]), scale, Vl);
        if (owns(t, vocab_start, Vl))
            dx[t - vocab_start] -= scale;
    }
}
