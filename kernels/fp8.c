/* kernels/fp8.c: FP8 quantization (E4M3 forward, E5M2 backward) and the emulated
 * FP8 linear layer (portable C). The element conversions are libshard's, which are
 * checked against ml_dtypes on every bit pattern; this file only splits the work
 * over threads and wires the recipe together. */
#include "ops.h"

#include <math.h>

#include "shard.h"

/* chunk of elements per task; also the size of a stack byte buffer */
enum { FP8_CHUNK = 4096 };

static shard_dtype fp8_dtype(int fmt)
{
    return fmt == OP_FP8_E5M2 ? SHARD_DT_F8_E5M2 : SHARD_DT_F8_E4M3;
}

void op_fp8_quantize(uint8_t *q, float *amax, const float *x, size_t n, float scale, int fmt)
{
    const shard_dtype dt = fp8_dtype(fmt);
    const size_t nchunks = (n + FP8_CHUNK - 1) / FP8_CHUNK;
    float result = 0.0f;
    #pragma omp parallel
    {
        float mx = 0.0f;
        #pragma omp for schedule(static) nowait
        for (size_t c = 0; c < nchunks; c++) {
            size_t off = c * FP8_CHUNK, len = n - off < FP8_CHUNK ? n - off : FP8_CHUNK;
            float a = shard_fp8_quantize(q + off, x + off, len, scale, dt);
            if (a > mx || isnan(a)) /* NaN is sticky, as in op_amax */
                mx = a;
        }
        #pragma omp critical
        if (mx > result || isnan(mx))
            result = isnan(result) ? result : mx;
    }
    if (amax)
        *amax = result;
}

void op_fp8_dequantize(float *x, const uint8_t *q, size_t n, float scale, int fmt)
{
    const shard_dtype dt = fp8_dtype(fmt);
    const size_t nchunks = (n + FP8_CHUNK - 1) / FP8_CHUNK;
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t off = c * FP8_CHUNK, len = n - off < FP8_CHUNK ? n - off : FP8_CHUNK;
        shard_fp8_dequantize(x + off, q + off, len, scale, dt);
    }
}

void op_fp8_roundtrip(float *dst, const float *src, size_t n, float scale, int fmt)
{
    const shard_dtype dt = fp8_dtype(fmt);
    const size_t nchunks = (n + FP8_CHUNK - 1) / FP8_CHUNK;
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        uint8_t buf[FP8_CHUNK];
        size_t off = c * FP8_CHUNK, len = n - off < FP8_CHUNK ? n - off : FP8_CHUNK;
        shard_fp8_quantize(buf, src + off, len, scale, dt);
        shard_fp8_dequantize(dst + off, buf, len, scale, dt);
    }
}

void op_linear_forward_fp8(float *out, const float *inp, const float *weight,
                           int N, int IN, int OUT, float s_in, float s_w, void *scratch)
{
    float *xq = scratch, *wq = xq + (size_t)N * IN;
    op_fp8_roundtrip(xq, inp, (size_t)N * IN, s_in, OP_FP8_E4M3);
    op_fp8_roundtrip(wq, weight, (size_t)OUT * IN, s_w, OP_FP8_E4M3);
    op_linear_forward(out, xq, wq, N, IN, OUT);
}
