/* backends/c/blas_pick.c: OpenBLAS's kernels, checked against the CPU (blas_pick.h).
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from the CPU's model
 * number when it loads. A CPU newer than the library gets its oldest x86-64 kernels:
 * 0.3.21 (Debian 12) does not know Emerald Rapids (family 6, model 207) and runs SSE3
 * "Prescott" kernels there, several times slower than the AVX-512 ones the CPU has.
 * The pick is read from OPENBLAS_CORETYPE while the library loads, before main(), and
 * OpenBLAS has no call to change it afterwards: the one fix from inside is to start
 * the program again with the variable set. Whoever sets it keeps their choice. */
#include "blas_pick.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

char *openblas_get_corename(void);

int blas_cpu_width(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
        return 512;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 256 : 128;
}

/* OpenBLAS's x86-64 core names and the vectors their sgemm kernels use. */
static const struct { const char *name; int width; } CORES[] = {
    {"Prescott", 128}, {"Core2", 128}, {"Penryn", 128}, {"Dunnington", 128}, {"Nehalem", 128}, {"Atom", 128},
    {"Opteron", 128}, {"Opteron(SSE3)", 128}, {"Barcelona", 128}, {"Bobcat", 128}, {"Sandybridge", 128},
    {"Bulldozer", 128}, {"Piledriver", 128}, {"Steamroller", 128}, {"Excavator", 128},
    {"Haswell", 256}, {"Zen", 256}, {"SkylakeX", 512}, {"Cooperlake", 512}, {"SapphireRapids", 512},
};

const char *blas_better_kernels(const char *picked, int cpu_width)
{
    if (!picked) return NULL;
    for (size_t i = 0; i < sizeof CORES / sizeof CORES[0]; i++)
        if (!strcasecmp(picked, CORES[i].name)) {
            if (CORES[i].width >= cpu_width) return NULL;
            return cpu_width >= 512 ? "SkylakeX" : cpu_width >= 256 ? "Haswell" : NULL;
        }
    return NULL;
}

/* Silent: a bad input's one error line stays the only line (docs/TRAINING.md); the
 * --version line names the kernels in use. */
void blas_pick_kernels(char **argv)
{
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *want = blas_better_kernels(openblas_get_corename(), blas_cpu_width());
    if (!want || setenv("OPENBLAS_CORETYPE", want, 1) != 0) return;
    execv("/proc/self/exe", argv);
    /* the exec failed: run on with OpenBLAS's pick */
}
