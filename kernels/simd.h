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

/* Cephes' expf's reduction, shared by both exps below: y = n ln2 + r, |r| <= ln2 / 2,
 * ln2 in two parts (n ln2_hi exact), and e^r = 1 + r + r^2 (C0 + C1 r + ... + C4 r^4):
 * a degree-6 polynomial fitted to e^r's relative error on that interval (3e-9, a
 * twentieth of a float's ulp; tools/expfit.py), where Cephes' degree 7 (C5 too, 5e-11)
 * spent one multiply-add more a value for bits a float does not keep */
#define SMP_EXP_LOG2E 1.44269504f
#define SMP_EXP_C0 4.9999994040e-01f
#define SMP_EXP_C1 1.6666521132e-01f
#define SMP_EXP_C2 4.1668388993e-02f
#define SMP_EXP_C3 8.3687109873e-03f
#define SMP_EXP_C4 1.3814608101e-03f

/* r = y - n ln2 */
SMP_SIMD_INLINE float smp_exp_reduce(float y, float n)
{
    return y - n * 0.693359375f + n * 2.12194440e-4f;
}

/* e^y for y in [-88, 88] (the callers clamp): the polynomial in Horner's form, 2^n from
 * the exponent bits (n = -127 gives 0) */
SMP_SIMD_INLINE float smp_exp_poly(float y)
{
    const float n = __builtin_floorf(y * SMP_EXP_LOG2E + 0.5f);
    const float r = smp_exp_reduce(y, n);
    float c = SMP_EXP_C4;
    c = c * r + SMP_EXP_C3;
    c = c * r + SMP_EXP_C2;
    c = c * r + SMP_EXP_C1;
    c = c * r + SMP_EXP_C0;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return (c * r * r + r + 1.0f) * two_n;
}

/* e^x in a form the compiler vectorizes (libm's expf is a call per element): within
 * 1 ulp of e^x (measured) from e^-87.33 (where floats turn subnormal) to e^88; 0 below,
 * inf above (e^88 = 1.7e38, a hair under the float limit e^88.72), NaN stays NaN. */
SMP_SIMD_INLINE float smp_expf(float x)
{
    float y = x > -87.33f ? x : -87.33f;
    y = y < 88.0f ? y : 88.0f;
    float e = smp_exp_poly(y);
    e = x < -87.33f ? 0.0f : e;
    e = x > 88.0f ? __builtin_inff() : e;
    return x == x ? e : x;
}

/* e^x for a softmax's shifted scores (x = s - max or s - lse <= 0; -inf where masked):
 * within 1 ulp of e^x from e^-87.33 to 1 (2 above, up to e^88), as smp_expf, but written
 * for a short dependency chain, which is what bounds the softmax loop on a CPU with a
 * small FP scheduler (Zen 2: a vector in smp_expf's Horner form took ~18 cycles, ~7 of
 * them to issue), and for few instructions:
 * - no select, one clamp: a max at -88 that passes a NaN through (its e is NaN too) and
 *   gives n = -127, so 2^n's bits, and e^x, are 0 (0 below about -87.7; smp_expf:
 *   -87.33; e^x there is under 1.2e-38); no clamp above, so x must be <= 88 (above,
 *   2^n's bits overflow: +inf gives NaN, x in (88.4, 128) a wrong value), which its
 *   callers' shifted scores are by construction (<= 0);
 * - n rounded by the 1.5 * 2^23 shifter, whose sum's low bits are n + 127 itself (no
 *   round, no convert): 2^n is those bits shifted into the exponent;
 * - the polynomial in Estrin's form (three levels, not five) and the last step
 *   (1 + r + r^2 p) 2^n as two FMAs.
 * The attention's softmax loop alone: 6.0 -> 4.8 ns a vector for the short chain (Zen 2,
 * 2026-12-05); a loop of exps alone 3.50 -> 2.95 ns a vector for the degree-6 polynomial
 * and the one clamp (later that day; the same accuracy, tests/unit/test_kernels.c).
 * Interleaving 2, 4 or 8 vectors' chains by hand (intrinsics) in the backward's loop
 * was slower: 4.9-7.2 ns a vector against 4.7. The
 * bound comes in as a variable (smp_exp_bounds_opaque): as a constant, GCC splits the
 * loop into a path per clamp and blends the paths' results back. */
typedef struct { float lo; } smp_exp_bounds;

/* -88, opaque to the optimizer; once, before the loop */
SMP_SIMD_INLINE smp_exp_bounds smp_exp_bounds_opaque(void)
{
    smp_exp_bounds b = {-88.0f};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __asm__("" : "+x"(b.lo));
#elif defined(__GNUC__) || defined(__clang__)
    __asm__("" : "+m"(b.lo));
#endif
    return b;
}

SMP_SIMD_INLINE float smp_expf_shifted(float x, smp_exp_bounds b)
{
    const float y = b.lo > x ? b.lo : x; /* max(-88, x); x where x is NaN */
    const float shifter = 12583039.0f; /* 1.5 * 2^23 + 127: t's last 9 bits are n + 127 */
    const float t = y * SMP_EXP_LOG2E + shifter;
    const float n = t - shifter; /* round(y / ln 2), exactly */
    const float r = smp_exp_reduce(y, n);
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits <<= 23; /* n + 127 into the exponent, the rest of t shifted out */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    const float r2 = r * r;
    const float p01 = SMP_EXP_C1 * r + SMP_EXP_C0;
    const float p23 = SMP_EXP_C3 * r + SMP_EXP_C2;
    const float p = (SMP_EXP_C4 * r2 + p23) * r2 + p01;
    return (p * r2 + r) * two_n + two_n;
}

#endif
