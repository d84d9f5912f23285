/* kernels/embedding.cu: vocab-parallel token embedding (CUDA). One block per token
 * row; 16-byte loads and stores when the rows allow them. */
#include "cuda_common.cuh"

template <typename T, bool VEC>
__global__ void embedding_forward_kernel(T *out, const int32_t *tokens, const T *wte, int H,
                                         int vocab_start, int vocab_local)
{
    const size_t n = blockIdx.x;
    const int t = tokens[n];
    const bool own = t >= vocab_start && t - vocab_start < vocab_local;
    T *o = out + n * H;
    const T *w = wte + (own ? (size_t)(t - vocab_start) * H : 0);
    if (VEC) {
        constexpr int V = Pack<T>::N;
        for (int j = threadIdx.x * V; j < H; j += blockDim.x * V) {
            Pack<T> p;
            if (own) p = ld_pack(w + j);
            else
                for (int e = 0; e < V; e++) p.v[e] = from_f<T>(0.0f);
            st_pack(o + j, p);
        }
    } else {
        for (int j = threadIdx.x; j < H; j += blockDim.x) o[j] = own ? w[j] : from_f<T>(0.0f);
    }
}

template <typename T>
__global__ void embedding_backward_kernel(float *dwte, const T *dout, const int32_t *tokens, int H,
                                          int vocab_start, int vocab_local)
{
    const size_t n = blockIdx.x;
    const int t = tokens[n];
    if (!(t >= vocab_start && t - vocab_start < vocab_local)) return;
    float *d = dwte + (size_t)(t - vocab_start) * H;
    const T *g = dout + n * H;
    for (int j = threadIdx.x; j < H; j += blockDim.x) atomicAdd(d + j, to_f(g[j]));
}

template <typename T>
static cudaError_t embedding_forward(void *out, const int32_t *tokens, const void *wte, int N, int H,
                                     int vs, int vl, cudaStream_t stream)
{
    const bool vec = H % Pack<T>::N == 0 && smp_aligned16(out) && smp_aligned16(wte);
    if (vec) {
        auto k = embedding_forward_kernel<T, true>;
        SMP_LAUNCH(k, N, 128, 0, stream, (T *)out, tokens, (const T *)wte, H, vs, vl);
    } else {
        auto k = embedding_forward_kernel<T, false>;
        SMP_LAUNCH(k, N, 128, 0, stream, (T *)out, tokens, (const T *)wte, H, vs, vl);
    }
    return smp_cuda_launched("cuda_op_embedding_forward");
}

extern "C" cudaError_t cuda_op_embedding_forward(void *out, const int32_t *tokens, const void *wte,
                                                 int N, int H, int vocab_start, int vocab_local,
                                                 cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0 && vocab_local >= 0, "bad shape N=%d H=%d vocab_local=%d", N, H, vocab_local);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && tokens && (wte || vocab_local == 0), "NULL pointer");
    return dt == CUDA_R_32F ? embedding_forward<float>(out, tokens, wte, N, H, vocab_start, vocab_local, stream)
                            : embedding_forward<bf16>(out, tokens, wte, N, H, vocab_start, vocab_local, stream);
}

extern "C" cudaError_t cuda_op_embedding_backward(float *dwte, const void *dout, const int32_t *tokens,
                                                  int N, int H, int vocab_start, int vocab_local,
                                                  cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && H > 0 && vocab_local >= 0, "bad shape N=%d H=%d vocab_local=%d", N, H, vocab_local);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    if (N == 0 || vocab_local == 0) return cudaSuccess;
    SMP_ARG(dwte && dout && tokens, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto k = embedding_backward_kernel<float>;
        SMP_LAUNCH(k, N, 256, 0, stream, dwte, (const float *)dout, tokens, H, vocab_start, vocab_local);
    } else {
        auto k = embedding_backward_kernel<bf16>;
        SMP_LAUNCH(k, N, 256, 0, stream, dwte, (const bf16 *)dout, tokens, H, vocab_start, vocab_local);
    }
    return smp_cuda_launched("cuda_op_embedding_backward");
}
