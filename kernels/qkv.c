/* kernels/qkv.c: GPT-NeoX's fused query_key_value output [N, nh, 3, hd] split into
 * q, k, v [N, nh, hd], and the adjoint merge (portable C). Both are permutations:
 * every value is copied, bit for bit. */
#include "ops.h"

#include <string.h>

/* rows blocks of hd floats, from src (a block every ss floats) to dst (every ds) */
static void copy_rows(float *dst, size_t ds, const float *src, size_t ss, size_t rows, int hd)
{
    #pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++)
        memcpy(dst + r * ds, src + r * ss, (size_t)hd * sizeof(float));
}

void op_qkv_split(float *q, float *k, float *v, const float *qkv, int N, int nh, int hd)
{
    const size_t rows = (size_t)N * nh, h = (size_t)hd;
    copy_rows(q, h, qkv, 3 * h, rows, hd);
    copy_rows(k, h, qkv + h, 3 * h, rows, hd);
    copy_rows(v, h, qkv + 2 * h, 3 * h, rows, hd);
}

void op_qkv_merge(float *dqkv, const float *dq, const float *dk, const float *dv, int N, int nh, int hd)
{
    const size_t rows = (size_t)N * nh, h = (size_t)hd;
    copy_rows(dqkv, 3 * h, dq, h, rows, hd);
    copy_rows(dqkv + h, 3 * h, dk, h, rows, hd);
    copy_rows(dqkv + 2 * h, 3 * h, dv, h, rows, hd);
}
