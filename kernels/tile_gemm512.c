/* kernels/tile_gemm512.c: the tile product (tile_gemm_body.h) for AVX-512: vectors of
 * 16 floats, blocks of 8 rows x 32 columns (16 of its 32 registers accumulate). An
 * AVX-512 core runs the 8-float form at half its width: at 1 x 4096 tokens (8 heads of
 * 32) the attention's products were half of a training step (docs/DESIGN.md). */
#include "tile_gemm.h"

#if SMP_TILE_GEMM_512
#pragma GCC target("arch=x86-64-v4")
#define TG_VW 16
#define TG_MR 8
#define TG_UNROLL _Pragma("GCC unroll 8")
#define TG_NAME smp_tile_gemm_v16
#define TG_ATTRS
#include "tile_gemm_body.h"
#else
typedef int smp_tile_gemm512_unused; /* ISO C wants a declaration in every file */
#endif
