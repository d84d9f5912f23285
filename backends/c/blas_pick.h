/* backends/c/blas_pick.h: OpenBLAS's kernels, checked against the CPU at start-up. */
#ifndef SMP_BLAS_PICK_H
#define SMP_BLAS_PICK_H

/* The widest vectors (bits) this CPU and its OS give: 512 (AVX-512 F, BW, DQ, VL), 256
 * (AVX2 and FMA) or 128. */
int blas_cpu_width(void);
/* The OpenBLAS kernels to ask for when OpenBLAS picked `picked` (its core name) on a CPU
 * of vector width cpu_width: "SkylakeX" or "Haswell" when `picked` is a known core of
 * narrower vectors, else NULL (the pick stands; unknown names too). */
const char *blas_better_kernels(const char *picked, int cpu_width);
/* The main()s of the commands that compute (smp-train, smp-eval), first thing: when
 * OPENBLAS_CORETYPE is unset and OpenBLAS picked narrower kernels than the CPU has,
 * start the process again (execv) with OPENBLAS_CORETYPE set. Returns when nothing is
 * to be done, or the exec failed. */
void blas_pick_kernels(char **argv);

#endif
