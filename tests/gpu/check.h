/* tests/gpu/check.h: what the GPU test programs share, header-only (each program
 * includes it once: static state, static inline functions).
 *
 * parity.c and dev_check.c: the tally of their PASS / FAIL lines (check_line), the
 * relative error they compare by (rel_err) and their random numbers (splitmix64,
 * seeded with CHECK_SEED, which a program may define before including this).
 * parity.c and bench.cu: the command line (check_args) and, where the CUDA runtime's
 * header is included first, the probe for a device (check_device).
 *
 * Found next to the including file ("check.h"): no -I flag is needed, in SConstruct
 * or in tools/gpu-check. */
#ifndef SMP_TESTS_GPU_CHECK_H
#define SMP_TESTS_GPU_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* unused: bench.cu keeps only n_fail */
#define CHECK_MAYBE_UNUSED __attribute__((unused))

/* ------------------------------------------------------------ the tally */
static int n_pass CHECK_MAYBE_UNUSED, n_fail CHECK_MAYBE_UNUSED;
static char test_name[160] CHECK_MAYBE_UNUSED; /* the check running now, named in its lines */

/* one result line: PASS or FAIL, "test_name what" padded to width, the error, the
 * tolerance and note (after the tolerance; "" for none); counted in n_pass or n_fail */
static inline void check_line(int ok, int width, const char *what, double err, double tol, const char *note)
{
    char name[256];
    snprintf(name, sizeof name, "%s %s", test_name, what);
    printf("%s %-*s err %.3e tol %.1e%s\n", ok ? "PASS" : "FAIL", width, name, err, tol, note);
    fflush(stdout);
    if (ok) n_pass++;
    else n_fail++;
}

/* ||got - ref|| / ||ref|| over the finite entries of ref; a NaN or infinity in ref
 * must be matched exactly (NaN by NaN, any sign); a non-finite got elsewhere
 * (e.g. an unwritten, poisoned element) makes the error infinite. */
static inline double rel_err(const float *got, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const float r = ref[i], g = got[i];
        if (isnan(r)) {
            if (!isnan(g)) return INFINITY;
            continue;
        }
        if (isinf(r)) {
            if (g != r) return INFINITY;
            continue;
        }
        if (!isfinite(g)) return INFINITY;
        num += ((double)g - r) * ((double)g - r);
        den += (double)r * r;
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* ------------------------------------------------------------ random numbers */
#ifndef CHECK_SEED
#define CHECK_SEED 0x9e3779b97f4a7c15ull
#endif
static uint64_t rng_state CHECK_MAYBE_UNUSED = CHECK_SEED;
static inline uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float rng_uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_u64() >> 40) * (1.0 / 16777216.0));
}
static inline float rng_normal(void)
{
    double u1 = ((rng_u64() >> 11) + 1.0) * (1.0 / 9007199254740993.0), u2 = (rng_u64() >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ------------------------------------------------------------ command line, device */
/* `PROGRAM [--quick]`, with `[--only SUBSTRING]` where only is not NULL: 1, or the
 * usage on stderr and 0 (exit status 2) */
static inline int check_args(int argc, char **argv, int *quick, const char **only)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) *quick = 1;
        else if (only && !strcmp(argv[i], "--only") && i + 1 < argc) *only = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--quick]%s\n", argv[0], only ? " [--only SUBSTRING]" : "");
            return 0;
        }
    }
    return 1;
}

#ifdef CUDART_VERSION /* cuda_runtime_api.h included */
/* 1 when a CUDA device is there; else "WHO: SKIP: no CUDA device found" and 0 (exit 0) */
static inline int check_device(const char *who)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("%s: SKIP: no CUDA device found\n", who);
        return 0;
    }
    return 1;
}
#endif

#endif
