/* kernels/rope.cu: rotary position embedding, HF rotate_half convention (CUDA).
 * The table's angle is the fp32 product pos * inv_freq, as in HF and kernels/rope.c;
 * its cosine and sine are taken in double and rounded once, as rope.c does, so the
 * tables agree with the C ones to the last bit or so. A partial rotary (rotary_dim <
 * head_dim) leaves the dims past rotary_dim untouched. */
#include "cuda_common.cuh"

__global__ void rope_table_kernel(float *cos_t, float *sin_t, const int32_t *pos, int T,
                                  const float *inv_freq, int rotary_dim, float scale)
{
    const int half = rotary_dim / 2;
    const size_t total = (size_t)T * half;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t t = idx / half;
        const int i = (int)(idx % half);
        const float angle = __fmul_rn((float)pos[t], inv_freq[i]);
        /* times YaRN's attention factor in fp32 (1 otherwise), as rope.c */
        const float c = __fmul_rn((float)cos((double)angle), scale), s = __fmul_rn((float)sin((double)angle), scale);
        cos_t[t * rotary_dim + i] = c;
        cos_t[t * rotary_dim + i + half] = c;
        sin_t[t * rotary_dim + i] = s;
        sin_t[t * rotary_dim + i + half] = s;
    }
}

/* V consecutive floats of a table row: 16-byte packs when VEC (V then 4 or 8) */
template <int V, bool VEC> __device__ __forceinline__ void ld_table(float *out, const float *p)
{
    if (VEC) {
        for (int k = 0; k < V; k += 4) {
            const Pack<float> q = ld_pack(p + k);
            for (int e = 0; e < 4; e++) out[k + e] = q.v[e];
        }
    } else {
        for (int e = 0; e < V; e++) out[e] = p[e];
    }
}

/* Rows of x ((b*T + t)*nh + h, head_dim each) along blockIdx.x and threadIdx.y; a
 * row's rotated pairs (i, i + half) along threadIdx.x, V pairs a thread: 16-byte packs
 * of both halves and of the tables when VEC. Why this shape: the first form, one
 * thread a pair over a flat index, took four 64-bit divisions a pair and 2-byte
 * accesses, and ran at 29% of the copy bandwidth on an H200 (2026-12-04); here a
 * thread divides once a row, in 32 bits (rope_run refuses 2^31 rows or more, so that
 * the row index never wraps). */
template <typename T, bool BACKWARD, bool VEC>
__global__ void rope_kernel(T *x, const float *cos_t, const float *sin_t, unsigned rows, int T_, int nh,
                            int head_dim, int rotary_dim)
{
    constexpr int V = VEC ? Pack<T>::N : 1;
    const int half = rotary_dim / 2, groups = half / V;
    for (unsigned row = blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += gridDim.x * blockDim.y) {
        const unsigned t = row / (unsigned)nh % (unsigned)T_;
        T *v = x + (size_t)row * head_dim;
        const float *c = cos_t + (size_t)t * rotary_dim, *s = sin_t + (size_t)t * rotary_dim;
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            const int i = g * V;
            float x1[V], x2[V], c1[V], c2[V], s1[V], s2[V];
            Pack<T> p1, p2;
            if (VEC) {
                p1 = ld_pack(v + i), p2 = ld_pack(v + i + half);
                for (int e = 0; e < V; e++) x1[e] = to_f(p1.v[e]), x2[e] = to_f(p2.v[e]);
            } else {
                x1[0] = ld_f(v + i), x2[0] = ld_f(v + i + half);
            }
            ld_table<V, VEC>(c1, c + i), ld_table<V, VEC>(c2, c + i + half);
            ld_table<V, VEC>(s1, s + i), ld_table<V, VEC>(s2, s + i + half);
            for (int e = 0; e < V; e++) {
                const float y1 = BACKWARD ? c1[e] * x1[e] + s2[e] * x2[e] : c1[e] * x1[e] - s1[e] * x2[e];
                const float y2 = BACKWARD ? c2[e] * x2[e] - s1[e] * x1[e] : c2[e] * x2[e] + s2[e] * x1[e];
                x1[e] = y1, x2[e] = y2;
            }
            if (VEC) {
                for (int e = 0; e < V; e++) p1.v[e] = from_f<T>(x1[e]), p2.v[e] = from_f<T>(x2[e]);
                st_pack(v + i, p1), st_pack(v + i + half, p2);
            } else {
                st_f(v + i, x1[0]), st_f(v + i + half, x2[0]);
            }
        }
    }
}

template <typename E, bool BACKWARD>
static void rope_launch(void *xv, const float *cos_t, const float *sin_t, unsigned rows, int T, int nh,
                        int head_dim, int rotary_dim, cudaStream_t stream)
{
    E *x = (E *)xv;
    const int half = rotary_dim / 2;
    constexpr int N = Pack<E>::N;
    const bool vec = half % N == 0 && head_dim % N == 0 && smp_aligned16(x) && smp_aligned16(cos_t) &&
                     smp_aligned16(sin_t);
    const int groups = vec ? half / N : half;
    const unsigned tx = (unsigned)(groups < 256 ? groups : 256), ty = 256 / tx;
    const unsigned grid = smp_blocks(rows, ty, 65535u * 16);
    auto k = vec ? rope_kernel<E, BACKWARD, true> : rope_kernel<E, BACKWARD, false>;
    SMP_LAUNCH(k, grid, dim3(tx, ty), 0, stream, x, cos_t, sin_t, rows, T, nh, head_dim, rotary_dim);
}

extern "C" cudaError_t cuda_op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                                          const float *inv_freq, int rotary_dim, float scale, cudaStream_t stream)
{
    SMP_ARG(T >= 0 && rotary_dim > 0 && rotary_dim % 2 == 0, "bad shape T=%d rotary_dim=%d", T, rotary_dim);
    if (T == 0) return cudaSuccess;
    SMP_ARG(cos_t && sin_t && pos && inv_freq, "NULL pointer");
    const size_t total = (size_t)T * (rotary_dim / 2);
    SMP_LAUNCH(rope_table_kernel, smp_blocks(total, 256, 65535), 256, 0, stream, cos_t, sin_t, pos, T,
               inv_freq, rotary_dim, scale);
    return smp_cuda_launched("cuda_op_rope_table");
}

static cudaError_t rope_run(void *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int head_dim,
                            int rotary_dim, cudaDataType_t dt, bool backward, cudaStream_t stream, const char *fn)
{
    SMP_ARG(B >= 0 && T >= 0 && nh >= 0 && head_dim > 0 && rotary_dim >= 0 && rotary_dim <= head_dim &&
                rotary_dim % 2 == 0,
            "bad shape B=%d T=%d nh=%d head_dim=%d rotary_dim=%d", B, T, nh, head_dim, rotary_dim);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    const size_t rows = (size_t)B * T * nh;
    if (rows == 0 || rotary_dim == 0) return cudaSuccess;
    SMP_ARG(rows <= INT32_MAX, "%zu rows (B*T*nh) exceed the kernel's 32-bit row index", rows);
    SMP_ARG(x && cos_t && sin_t, "NULL pointer");
    auto launch = dt == CUDA_R_32F ? (backward ? rope_launch<float, true> : rope_launch<float, false>)
                                   : (backward ? rope_launch<bf16, true> : rope_launch<bf16, false>);
    launch(x, cos_t, sin_t, (unsigned)rows, T, nh, head_dim, rotary_dim, stream);
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
