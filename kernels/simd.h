/* kernels/simd.h: the C kernels' wide-vector variants. The library is built for
 * x86-64-v2 (SSE4.2: runs on any x86-64 of the last 15 years); a loop that carries a
 * kernel's time is compiled once more for AVX2+FMA (x86-64-v3) and AVX-512
 * (x86-64-v4), and the loader's ifunc picks the widest this CPU has. Results stay
 * the same bits for any thread count; between CPUs of different widths a vector
 * reduction (a row's sum) may round differently. ISO C (-std=c11) contracts no a*b+c
 * into an FMA, so element-wise results are the same on every variant. */
#ifndef SMP_KERNELS_SIMD_H
#define SMP_KERNELS_SIMD_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SMP_NO_SIMD_CLONES)
#define SMP_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SMP_SIMD_CLONES
#endif
/* a helper of an SMP_SIMD_CLONES function: inlined into each variant, so compiled for its width */
#define SMP_SIMD_INLINE static inline __attribute__((always_inline))

#endif
