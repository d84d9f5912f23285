/* kernels/adamw.cu: fused AdamW, as torch.optim.AdamW and kernels/adamw.c (CUDA).
 * One pass: read param, grad, m, v; write param, m, v and optionally the bf16
 * compute copy of the parameters. The step-dependent constants are computed on the
 * host in double, exactly as adamw.c does. */
#include "cuda_common.cuh"

/* The step-dependent constants, and one parameter's update */
struct AdamwStep {
    float beta1, beta2, eps, decay, step_size, bc2_sqrt;
    __device__ __forceinline__ void operator()(float &p, float g, float &m, float &v) const
    {
        float mi = beta1 * m + (1.0f - beta1) * g;
        float vi = beta2 * v + (1.0f - beta2) * g * g;
        m = mi;
        v = vi;
        p = p * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
};
/* element i, one at a time */
__device__ __forceinline__ void adamw_at(size_t i, float *param, const float *grad, float *m, float *v,
                                         bf16 *param_bf16, const AdamwStep &st)
{
    float p = param[i], mm = m[i], vv = v[i];
    st(p, grad[i], mm, vv);
    param[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (param_bf16) param_bf16[i] = __float2bfloat16_rn(p);
}

template <bool VEC>
__global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, bf16 *param_bf16, size_t n,
                             float beta1, float beta2, float eps, float decay, float step_size, float bc2_sqrt)
{
    const AdamwStep st = {beta1, beta2, eps, decay, step_size, bc2_sqrt};
    constexpr int V = VEC ? 4 : 1;
    const size_t nv = n / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += (size_t)gridDim.x * blockDim.x) {
        if (VEC) {
            float4 p = reinterpret_cast<float4 *>(param)[i], g = reinterpret_cast<const float4 *>(grad)[i];
            float4 mm = reinterpret_cast<float4 *>(m)[i], vv = reinterpret_cast<float4 *>(v)[i];
            st(p.x, g.x, mm.x, vv.x);
            st(p.y, g.y, mm.y, vv.y);
            st(p.z, g.z, mm.z, vv.z);
            st(p.w, g.w, mm.w, vv.w);
            reinterpret_cast<float4 *>(param)[i] = p;
            reinterpret_cast<float4 *>(m)[i] = mm;
            reinterpret_cast<float4 *>(v)[i] = vv;
            if (param_bf16) {
                param_bf16[4 * i + 0] = __float2bfloat16_rn(p.x);
                param_bf16[4 * i + 1] = __float2bfloat16_rn(p.y);
                param_bf16[4 * i + 2] = __float2bfloat16_rn(p.z);
                param_bf16[4 * i + 3] = __float2bfloat16_rn(p.w);
            }
        } else {
            adamw_at(i, param, grad, m, v, param_bf16, st);
        }
    }
    if (VEC && blockIdx.x == 0)
        for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) adamw_at(i, param, grad, m, v, param_bf16, st);
}

extern "C" cudaError_t cuda_op_adamw(float *param, const float *grad, float *m, float *v, void *param_bf16,
                                     size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                     int step, cudaStream_t stream)
{
    SMP_ARG(step >= 1, "step=%d: steps count from 1", step);
    if (n == 0) return cudaSuccess;
    SMP_ARG(param && grad && m && v, "NULL pointer");
    const float decay = 1.0f - lr * weight_decay;
    const float step_size = (float)((double)lr / (1.0 - pow((double)beta1, step)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow((double)beta2, step));
    const bool vec = smp_aligned16(param) && smp_aligned16(grad) && smp_aligned16(m) && smp_aligned16(v);
    int sms = smp_cuda_sm_count();
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 1024);
    if (vec) {
        SMP_LAUNCH(adamw_kernel<true>, smp_blocks(n / 4, 256, cap), 256, 0, stream, param, grad, m, v,
                   (bf16 *)param_bf16, n, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    } else {
        SMP_LAUNCH(adamw_kernel<false>, smp_blocks(n, 256, cap), 256, 0, stream, param, grad, m, v,
                   (bf16 *)param_bf16, n, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    }
    return smp_cuda_launched("cuda_op_adamw");
}
