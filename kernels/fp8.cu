/* kernels/fp8.cu: FP8 quantize (with amax), dequantize, byte transpose, and the
 * recipe's amax and scale updates on the device (CUDA).
 *
 * Bit-exact with libshard's shard_fp8_quantize: the product x * scale is one fp32
 * multiply (no contraction), then the hardware conversion with saturation to the
 * largest finite value (__NV_SATFINITE), rounding to nearest even, which is what
 * clamp-then-round gives. NaN is handled before the multiply, because the GPU's
 * arithmetic returns a canonical NaN without the input's sign, while libshard keeps
 * the sign: NaN -> sign | 0x7f (E4M3) or sign | 0x7e (E5M2), as ml_dtypes. */
#include "cuda_common.cuh"

__device__ __forceinline__ uint8_t fp8_quantize1(float x, float scale, bool e5m2)
{
    if (isnan(x)) return (uint8_t)((signbit(x) ? 0x80 : 0x00) | (e5m2 ? 0x7e : 0x7f));
    const float y = __fmul_rn(x, scale);
    return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

__device__ __forceinline__ float fp8_value(uint8_t b, bool e5m2)
{
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, e5m2 ? __NV_E5M2 : __NV_E4M3);
    return __half2float(__half(h));
}

enum { Q_THREADS = 256, Q_E = 8 }; /* Q_E elements per thread and step: 8 output bytes */

template <typename T, bool VEC>
__global__ void __launch_bounds__(Q_THREADS) fp8_quantize_kernel(uint8_t *q, float *amax, const T *x, size_t n,
                                                                 const float *scale_p, bool e5m2)
{
    __shared__ float red[32];
    const float scale = *scale_p;
    float mx = 0.0f;
    bool nan = false;
    const size_t nv = VEC ? n / Q_E : n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            constexpr int PN = Pack<T>::N;
            float v[Q_E];
            for (int p = 0; p < Q_E / PN; p++) {
                Pack<T> pk = ld_pack(x + i * Q_E + p * PN);
                for (int e = 0; e < PN; e++) v[p * PN + e] = to_f(pk.v[e]);
            }
            union { uint2 u; uint8_t b[8]; } o;
            for (int e = 0; e < Q_E; e++) {
                float a = fabsf(v[e]);
                mx = fmaxf(mx, a);
                nan |= isnan(a);
                o.b[e] = fp8_quantize1(v[e], scale, e5m2);
            }
            *reinterpret_cast<uint2 *>(q + i * Q_E) = o.u;
        } else {
            float v = ld_f(x + i), a = fabsf(v);
            mx = fmaxf(mx, a);
            nan |= isnan(a);
            q[i] = fp8_quantize1(v, scale, e5m2);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * Q_E + threadIdx.x; i < n; i += blockDim.x) {
            float v = ld_f(x + i), a = fabsf(v);
            mx = fmaxf(mx, a);
            nan |= isnan(a);
            q[i] = fp8_quantize1(v, scale, e5m2);
        }
    if (amax) { /* uniform branch: every thread takes it or none */
        float m = block_max(mx, red);
        float anynan = block_max(nan ? 1.0f : 0.0f, red);
        if (threadIdx.x == 0) atomic_amax(amax, anynan > 0.0f ? __int_as_float(0x7fc00000) : m);
    }
}

template <typename T>
__global__ void fp8_dequantize_kernel(T *x, const uint8_t *q, size_t n, const float *scale_p, bool e5m2)
{
    const float inv = 1.0f / *scale_p; /* as shard_fp8_dequantize: value * (1 / scale) */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        st_f(x + i, fp8_value(q[i], e5m2) * inv);
}

enum { TR_TILE = 64 };
/* The byte form: any shape and alignment, a byte a load and a store. */
__global__ void fp8_transpose_kernel(uint8_t *dst, int ld, const uint8_t *src, int rows, int cols)
{
    __shared__ uint8_t tile[TR_TILE][TR_TILE + 1];
    const int r0 = blockIdx.y * TR_TILE, c0 = blockIdx.x * TR_TILE;
    const int tx = threadIdx.x, ty = threadIdx.y; /* 64 x 4 threads */
    for (int i = ty; i < TR_TILE; i += 4) {
        int r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) tile[i][tx] = src[(size_t)r * cols + c];
    }
    __syncthreads();
    for (int i = ty; i < TR_TILE; i += 4) {
        int c = c0 + i, r = r0 + tx; /* dst row c, column r */
        if (c < cols && r < ld) dst[(size_t)c * ld + r] = r < rows ? tile[tx][i] : 0; /* zero past the rows */
    }
}

/* The word form, where cols and ld are multiples of 4 and both pointers 4-byte aligned
 * (every FP8 GEMM of a Llama-shaped model): the byte form's 4-byte accesses, a quarter
 * of its instructions. A thread loads a 4 x 4 block of bytes as four words, transposes it
 * in registers (PRMT) and stores the four column words into the transposed tile; then
 * each thread copies words of the transposed tile out, a warp two dst rows of 64 bytes.
 * The load phase gives a warp 8 x 4 blocks so that its shared stores (pitch 17 words)
 * fall in 32 different banks. */
enum { TRW_PITCH = TR_TILE / 4 + 1 };
__global__ void __launch_bounds__(256) fp8_transpose_words_kernel(uint32_t *dst, int ld, const uint32_t *src, int rows,
                                                                  int cols)
{
    __shared__ uint32_t tt[TR_TILE][TRW_PITCH]; /* tt[c][b]: rows 4b..4b+3 of tile column c */
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int r0 = blockIdx.y * TR_TILE, c0 = blockIdx.x * TR_TILE;
    const int cw = cols / 4, ldw = ld / 4; /* row lengths in words */
    {
        const int bx = (lane & 7) + 8 * (warp & 1), by = (lane >> 3) + 4 * (warp >> 1);
        const int c = c0 + 4 * bx, r = r0 + 4 * by;
        uint32_t w[4];
        for (int k = 0; k < 4; k++) /* rows past `rows` load as 0: the pad of dst */
            w[k] = c < cols && r + k < rows ? src[(size_t)(r + k) * cw + c / 4] : 0u;
        const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), lo23 = __byte_perm(w[2], w[3], 0x5140);
        const uint32_t hi01 = __byte_perm(w[0], w[1], 0x7362), hi23 = __byte_perm(w[2], w[3], 0x7362);
        tt[4 * bx + 0][by] = __byte_perm(lo01, lo23, 0x5410);
        tt[4 * bx + 1][by] = __byte_perm(lo01, lo23, 0x7632);
        tt[4 * bx + 2][by] = __byte_perm(hi01, hi23, 0x5410);
        tt[4 * bx + 3][by] = __byte_perm(hi01, hi23, 0x7632);
    }
    __syncthreads();
    const int b = lane & 15, rw = r0 / 4 + b;
    for (int i = (lane >> 4) + 2 * warp; i < TR_TILE; i += 16) {
        const int c = c0 + i; /* dst row c, words rw */
        if (c < cols && rw < ldw) dst[(size_t)c * ldw + rw] = tt[i][b];
    }
}

template <typename T>
static cudaError_t quantize_run(uint8_t *q, float *amax, bool reset, const void *x, size_t n, const float *scale,
                                bool e5m2, cudaStream_t stream, const char *fn)
{
    if (amax && reset) {
        cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream);
        if (e != cudaSuccess) return smp_cuda_fail(e, fn, "cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    if (n == 0) return cudaSuccess;
    int sms = smp_cuda_sm_count();
    /* eight blocks of 256 a multiprocessor (30 registers: all fit), not four: a thread's
     * loop has one 16-byte load in flight, so occupancy is what hides the memory (the
     * kernel ran at 59% of the copy bandwidth with four, H200 2026-12-04) */
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 512);
    /* uint2 stores need 8-byte aligned q */
    const bool vec = smp_aligned16(x) && ((uintptr_t)q & 7u) == 0;
    if (vec) {
        auto k = fp8_quantize_kernel<T, true>;
        SMP_LAUNCH(k, smp_blocks(n / Q_E + 1, Q_THREADS, cap), Q_THREADS, 0, stream, q, amax, (const T *)x, n, scale,
                   e5m2);
    } else {
        auto k = fp8_quantize_kernel<T, false>;
        SMP_LAUNCH(k, smp_blocks(n, Q_THREADS, cap), Q_THREADS, 0, stream, q, amax, (const T *)x, n, scale, e5m2);
    }
    return smp_cuda_launched(fn);
}

static cudaError_t quantize_op(uint8_t *q, float *amax, bool reset, const void *x, size_t n, const float *scale,
                               int fmt, cudaDataType_t dt, cudaStream_t stream, const char *fn)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(fmt == OP_FP8_E4M3 || fmt == OP_FP8_E5M2, "fmt=%d is not OP_FP8_E4M3 or OP_FP8_E5M2", fmt);
    SMP_ARG(scale && ((q && x) || n == 0), "NULL pointer");
    const bool e5m2 = fmt == OP_FP8_E5M2;
    return dt == CUDA_R_32F ? quantize_run<float>(q, amax, reset, x, n, scale, e5m2, stream, fn)
                            : quantize_run<bf16>(q, amax, reset, x, n, scale, e5m2, stream, fn);
}

extern "C" cudaError_t cuda_op_fp8_quantize(uint8_t *q, float *amax, const void *x, size_t n, const float *scale,
                                            int fmt, cudaDataType_t dt, cudaStream_t stream)
{
    return quantize_op(q, amax, true, x, n, scale, fmt, dt, stream, "cuda_op_fp8_quantize");
}

/* The blocks' atomic max on the float's bits is the fold's rule already (|x| >= 0, and
 * NaN, 0x7fc00000 once made positive, is above every other value): accumulating into
 * the step's slot needs no reset and no fold kernel. */
extern "C" cudaError_t cuda_op_fp8_quantize_acc(uint8_t *q, float *amax, const void *x, size_t n, const float *scale,
                                                int fmt, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(amax, "NULL amax");
    return quantize_op(q, amax, false, x, n, scale, fmt, dt, stream, "cuda_op_fp8_quantize_acc");
}

extern "C" cudaError_t cuda_op_fp8_dequantize(void *x, const uint8_t *q, size_t n, const float *scale, int fmt,
                                              cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    SMP_ARG(fmt == OP_FP8_E4M3 || fmt == OP_FP8_E5M2, "fmt=%d is not OP_FP8_E4M3 or OP_FP8_E5M2", fmt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(x && q && scale, "NULL pointer");
    int sms = smp_cuda_sm_count();
    const unsigned grid = smp_blocks(n, 256, (unsigned)(sms > 0 ? sms * 8 : 1024));
    const bool e5m2 = fmt == OP_FP8_E5M2;
    if (dt == CUDA_R_32F) {
        SMP_LAUNCH(fp8_dequantize_kernel<float>, grid, 256, 0, stream, (float *)x, q, n, scale, e5m2);
    } else {
        SMP_LAUNCH(fp8_dequantize_kernel<bf16>, grid, 256, 0, stream, (bf16 *)x, q, n, scale, e5m2);
    }
    return smp_cuda_launched("cuda_op_fp8_dequantize");
}

extern "C" cudaError_t cuda_op_fp8_transpose(uint8_t *dst, int ld, const uint8_t *src, int rows, int cols,
                                             cudaStream_t stream)
{
    SMP_ARG(rows >= 0 && cols >= 0 && ld >= rows, "bad shape rows=%d cols=%d ld=%d", rows, cols, ld);
    if (ld == 0 || cols == 0) return cudaSuccess;
    SMP_ARG(dst && (src || rows == 0) && dst != src, "NULL or aliased pointers");
    SMP_ARG((ld + TR_TILE - 1) / TR_TILE <= 65535, "ld=%d too many for the grid", ld);
    dim3 grid((cols + TR_TILE - 1) / TR_TILE, (ld + TR_TILE - 1) / TR_TILE); /* y: over dst's ld, pad included */
    const bool words = cols % 4 == 0 && ld % 4 == 0 && ((uintptr_t)dst & 3u) == 0 && ((uintptr_t)src & 3u) == 0;
    if (words) {
        SMP_LAUNCH(fp8_transpose_words_kernel, grid, 256, 0, stream, (uint32_t *)dst, ld, (const uint32_t *)src, rows,
                   cols);
    } else {
        SMP_LAUNCH(fp8_transpose_kernel, grid, dim3(TR_TILE, 4), 0, stream, dst, ld, src, rows, cols);
    }
    return smp_cuda_launched("cuda_op_fp8_transpose");
}

/* ---- the recipe's scalars: a few dozen floats, one thread each */
__global__ void fp8_amax_fold_kernel(float *acc, const float *amax, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = amax[i], s = acc[i];
    if (a > s || isnan(a)) acc[i] = isnan(s) ? s : a; /* as train/fp8.c's use_scale */
}

__global__ void fp8_scale_update_kernel(float *scale, float *sinv, const float *amax, int n, float fmt_max,
                                        float margin)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = amax[i];
    float sc = scale[i];
    if (a > 0.0f && isfinite(a)) { /* as train/fp8.c's scale_from */
        const float s = (float)((double)fmt_max / a / pow(2.0, (double)margin));
        if (isfinite(s) && s > 0.0f) sc = s;
    }
    scale[i] = sc;
    if (sinv) sinv[i] = 1.0f / sc;
}

extern "C" cudaError_t cuda_op_fp8_amax_fold(float *acc, const float *amax, int n, cudaStream_t stream)
{
    SMP_ARG(n >= 0, "n=%d", n);
    if (n == 0) return cudaSuccess;
    SMP_ARG(acc && amax, "NULL pointer");
    SMP_LAUNCH(fp8_amax_fold_kernel, (unsigned)((n + 127) / 128), 128, 0, stream, acc, amax, n);
    return smp_cuda_launched("cuda_op_fp8_amax_fold");
}

extern "C" cudaError_t cuda_op_fp8_scale_update(float *scale, float *sinv, const float *amax, int n, int fmt,
                                                float margin, cudaStream_t stream)
{
    SMP_ARG(n >= 0, "n=%d", n);
    SMP_ARG(fmt == OP_FP8_E4M3 || fmt == OP_FP8_E5M2, "fmt=%d is not OP_FP8_E4M3 or OP_FP8_E5M2", fmt);
    if (n == 0) return cudaSuccess;
    SMP_ARG(scale && amax, "NULL pointer");
    const float fmt_max = fmt == OP_FP8_E5M2 ? 57344.0f : 448.0f;
    SMP_LAUNCH(fp8_scale_update_kernel, (unsigned)((n + 127) / 128), 128, 0, stream, scale, sinv, amax, n, fmt_max,
               margin);
    return smp_cuda_launched("cuda_op_fp8_scale_update");
}
