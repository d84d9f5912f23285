/* kernels/reduce.c: reductions for gradient clipping and FP8 scaling, scaling and
 * addition (portable C). */
#include "ops.h"

#include <math.h>

double op_sumsq(const float *x, size_t n)
{
    /* double: the squared norm of billions of gradients loses digits in float */
    double s = 0.0;
    #pragma omp parallel for reduction(+ : s) schedule(static)
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return s;
}

float op_amax(const float *x, size_t n)
{
    /* not reduction(max:): fmaxf-style max drops NaN, and a NaN amax must
     * reach the FP8 recipe so that the step is skipped, not silently scaled */
    float result = 0.0f;
    #pragma omp parallel
    {
        float mx = 0.0f;
        #pragma omp for schedule(static) nowait
        for (size_t i = 0; i < n; i++) {
            float a = fabsf(x[i]);
            if (a > mx || isnan(a)) /* once NaN, mx stays NaN: a > NaN is false */
                mx = a;
        }
        #pragma omp critical
        if (mx > result || isnan(mx))
            result = isnan(result) ? result : mx;
    }
    return result;
}

void op_scale(float *x, float s, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

void op_add(float *y, const float *a, const float *b, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        y[i] = a[i] + b[i];
}
