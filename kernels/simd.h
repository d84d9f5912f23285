/* kernels/simd.h: the C kernels' wide-vector variants. The library is built for
 * x86-64-v2 (SSE4.2: runs on any x86-64 of the last 15 years); a loop that carries a
 * kernel's time is compiled once more for AVX2+FMA (x86-64-v3) and AVX-512
 * (x86-64-v4), and the loader's ifunc picks the widest this CPU has. Results stay
 * the same bits for any thread count; between CPUs of different widths a vector
 * reduction (a row's sum) may round differently. ISO C (-std=c11) contracts no a*b+c
 * into an FMA, so element-wise results are the same on every variant, but in the two
 * files that ask for FMAs (tile_gemm_body.h, attention.c: the tiles' products and exps),
 * whose AVX2 and AVX-512 variants round otherwise than their SSE one. */
#ifndef SMP_KERNELS_SIMD_H
#define SMP_KERNELS_SIMD_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SMP_NO_SIMD_CLONES)
#define SMP_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SMP_SIMD_CLONES
#endif
/* a helper of an SMP_SIMD_CLONES function: inlined into each variant, so compiled for its width */
#define SMP_SIMD_INLINE static inline __attribute__((always_inline))

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* GCC if-converts the float compares of clamps and maxima, and so vectorizes those
 * loops, only without trapping math (for the file that includes this; the kernels are
 * built without errno, SConstruct); no value changes */
#pragma GCC optimize("no-trapping-math")
#endif

/* e^x in a form the compiler vectorizes (libm's expf is a call per element). Cephes'
 * expf: x = n ln2 + r, |r| <= ln2 / 2, a polynomial for e^r, 2^n from the exponent
 * bits; within 1 ulp of e^x (measured) from e^-87.33 (where floats turn subnormal) to
 * e^88; 0 below, inf above (e^88 = 1.7e38, a hair under the float limit e^88.72),
 * NaN stays NaN. */
SMP_SIMD_INLINE float smp_expf(float x)
{
    float y = x > -87.33f ? x : -87.33f;
    y = y < 88.0f ? y : 88.0f;
    const float n = __builtin_floorf(y * 1.44269504f + 0.5f);
    const float r = y - n * 0.693359375f + n * 2.12194440e-4f;
    float c = 1.9875691500e-4f;
    c = c * r + 1.3981999507e-3f;
    c = c * r + 8.3334519073e-3f;
    c = c * r + 4.1665795894e-2f;
    c = c * r + 1.6666665459e-1f;
    c = c * r + 5.0000001201e-1f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    float e = (c * r * r + r + 1.0f) * two_n;
    e = x < -87.33f ? 0.0f : e;
    e = x > 88.0f ? __builtin_inff() : e;
    return x == x ? e : x;
}

#endif
