/* kernels/rope.cu: rotary position embedding, HF rotate_half convention (CUDA).
 * The table's angle is the fp32 product pos * inv_freq, as in HF and kernels/rope.c;
 * its cosine and sine are taken in double and rounded once, as rope.c does, so the
 * tables agree with the C ones to the last bit or so. One thread per rotated pair; a
 * partial rotary (rotary_dim < head_dim) leaves the dims past rotary_dim untouched. */
#include "cuda_common.cuh"

__global__ void rope_table_kernel(float *cos_t, float *sin_t, const int32_t *pos, int T,
                                  const float *inv_freq, int rotary_dim)
{
    const int half = rotary_dim / 2;
    const size_t total = (size_t)T * half;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t t = idx / half;
        const int i = (int)(idx % half);
        const float angle = __fmul_rn((float)pos[t], inv_freq[i]);
        const float c = (float)cos((double)angle), s = (float)sin((double)angle);
        cos_t[t * rotary_dim + i] = c;
        cos_t[t * rotary_dim + i + half] = c;
        sin_t[t * rotary_dim + i] = s;
        sin_t[t * rotary_dim + i + half] = s;
    }
}

template <typename T, bool BACKWARD>
__global__ void rope_kernel(T *x, const float *cos_t, const float *sin_t, int T_, int nh, int head_dim,
                            int rotary_dim, size_t total)
{
    const int half = rotary_dim / 2;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const size_t row = idx / half; /* (b*T + t)*nh + h */
        const size_t t = (row / nh) % T_;
        T *v = x + row * head_dim;
        const float *c = cos_t + t * rotary_dim, *s = sin_t + t * rotary_dim;
        const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
        float y1, y2;
        if (!BACKWARD) {
            y1 = c[i] * x1 - s[i] * x2;
            y2 = c[i + half] * x2 + s[i + half] * x1;
        } else {
            y1 = c[i] * x1 + s[i + half] * x2;
            y2 = c[i + half] * x2 - s[i] * x1;
        }
        v[i] = from_f<T>(y1);
        v[i + half] = from_f<T>(y2);
    }
}

extern "C" cudaError_t cuda_op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                                          const float *inv_freq, int rotary_dim, cudaStream_t stream)
{
    SMP_ARG(T >= 0 && rotary_dim > 0 && rotary_dim % 2 == 0, "bad shape T=%d rotary_dim=%d", T, rotary_dim);
    if (T == 0) return cudaSuccess;
    SMP_ARG(cos_t && sin_t && pos && inv_freq, "NULL pointer");
    const size_t total = (size_t)T * (rotary_dim / 2);
    SMP_LAUNCH(rope_table_kernel, smp_blocks(total, 256, 65535), 256, 0, stream, cos_t, sin_t, pos, T,
               inv_freq, rotary_dim);
    return smp_cuda_launched("cuda_op_rope_table");
}

static cudaError_t rope_run(void *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int head_dim,
                            int rotary_dim, cudaDataType_t dt, bool backward, cudaStream_t stream, const char *fn)
{
    SMP_ARG(B >= 0 && T >= 0 && nh >= 0 && head_dim > 0 && rotary_dim >= 0 && rotary_dim <= head_dim &&
                rotary_dim % 2 == 0,
            "bad shape B=%d T=%d nh=%d head_dim=%d rotary_dim=%d", B, T, nh, head_dim, rotary_dim);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    const size_t total = (size_t)B * T * nh * (rotary_dim / 2);
    if (total == 0) return cudaSuccess;
    SMP_ARG(x && cos_t && sin_t, "NULL pointer");
    const unsigned grid = smp_blocks(total, 256, 65535 * 4);
    if (dt == CUDA_R_32F) {
        auto k = backward ? rope_kernel<float, true> : rope_kernel<float, false>;
        SMP_LAUNCH(k, grid, 256, 0, stream, (float *)x, cos_t, sin_t, T, nh, head_dim, rotary_dim, total);
    } else {
        auto k = backward ? rope_kernel<bf16, true> : rope_kernel<bf16, false>;
        SMP_LAUNCH(k, grid, 256, 0, stream, (bf16 *)x, cos_t, sin_t, T, nh, head_dim, rotary_dim, total);
    }
    return smp_cuda_launched(fn);
}

extern "C" cudaError_t cuda_op_rope_forward(void *x, const float *cos_t, const float *sin_t, int B, int T, int nh,
                                            int head_dim, int rotary_dim, cudaDataType_t dt, cudaStream_t stream)
{
    return rope_run(x, cos_t, sin_t, B, T, nh, head_dim, rotary_dim, dt, false, stream, "cuda_op_rope_forward");
}

extern "C" cudaError_t cuda_op_rope_backward(void *dx, const float *cos_t, const float *sin_t, int B, int T, int nh,
                                             int head_dim, int rotary_dim, cudaDataType_t dt, cudaStream_t stream)
{
    return rope_run(dx, cos_t, sin_t, B, T, nh, head_dim, rotary_dim, dt, true, stream, "cuda_op_rope_backward");
}
