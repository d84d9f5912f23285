/* kernels/ops_cuda.h: the CUDA backend of kernels/ops.h, op for op.
 *
 * Every function here runs the op of the same name in ops.h on device memory,
 * enqueued on `stream`, and is tested against the C one (tests/gpu/parity.c).
 * Plain C API (callable from C and C++); link with the kernels' static library,
 * cublasLt and cudart.
 *
 * Conventions (in addition to ops.h's: row-major, [out,in] weights, backward
 * ACCUMULATES into gradients unless a function says "written"):
 *   - Pointers are device pointers. Tensors whose storage dtype is chosen by the
 *     caller are `void *` and take `cudaDataType_t dt`: CUDA_R_32F or CUDA_R_16BF
 *     (bf16 storage, fp32 arithmetic inside). The same dt applies to every `void *`
 *     tensor of the call unless the argument list names another dtype.
 *   - Small per-row statistics (mean, rstd, lse, rowmax, sumexp, target_logit,
 *     losses), the RoPE tables, parameter gradients of rmsnorm, layernorm, embedding
 *     and bias, and the optimizer state are fp32 (`float *`).
 *   - Scalars that recipes compute on the device (fp8 scales, amax) are passed as
 *     device pointers, so that no step needs a host synchronization.
 *   - Every function returns cudaSuccess or an error code and never exits: bad
 *     arguments give cudaErrorInvalidValue (nothing is launched); a failed launch or
 *     library call gives its error. cuda_op_errmsg() then holds a message naming
 *     the function and the problem (per thread). Kernel faults surface later, at the
 *     next synchronizing call, as with any CUDA code.
 *   - No function allocates device memory, except cuda_gemm_create.
 *   - Results are deterministic run to run except where noted (embedding backward
 *     and the dweight / dbias of rmsnorm and layernorm use fp32 atomics across rows).
 */
#ifndef SMP_KERNELS_OPS_CUDA_H
#define SMP_KERNELS_OPS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <library_types.h>

#include "ops.h" /* OP_FP8_E4M3, OP_FP8_E5M2, op_rope_params */

#ifdef __cplusplus
extern "C" {
#endif

/* The calling thread's message for the last failure of a cuda_op_* / cuda_gemm_*
 * function ("" if none). */
const char *cuda_op_errmsg(void);

/* ---- embedding (vocab-parallel) -------------------------------------------------
 * out [N,H] (dt), wte [vocab_local,H] (dt); tokens outside the shard give 0 rows.
 * backward: dwte (fp32) += dout (dt) rows, atomically (tokens repeat). */
cudaError_t cuda_op_embedding_forward(void *out, const int32_t *tokens, const void *wte,
                                      int N, int H, int vocab_start, int vocab_local,
                                      cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_embedding_backward(float *dwte, const void *dout, const int32_t *tokens,
                                       int N, int H, int vocab_start, int vocab_local,
                                       cudaDataType_t dt, cudaStream_t stream);

/* ---- bias --------------------------------------------------------------------------
 * out [N,C] (dt) += bias [C] (dt), in place, fp32 arithmetic. backward: dbias [C]
 * (fp32, accumulated) += the column sums of dout [N,C] (dt); deterministic (no
 * atomics: one thread per column and row slice, the slices added in a fixed order). */
cudaError_t cuda_op_bias_forward(void *out, const void *bias, int N, int C, cudaDataType_t dt,
                                 cudaStream_t stream);
cudaError_t cuda_op_bias_backward(float *dbias, const void *dout, int N, int C, cudaDataType_t dt,
                                  cudaStream_t stream);

/* ---- GPT-NeoX's fused qkv ------------------------------------------------------------
 * split: qkv [N, nh, 3, hd] (dt) -> q, k, v [N, nh, hd] (dt), written; merge, the
 * adjoint: dqkv [N, nh, 3, hd] (dt, written) from dq, dk, dv. Exact copies (a
 * permutation: bf16 values are not converted). */
cudaError_t cuda_op_qkv_split(void *q, void *k, void *v, const void *qkv, int N, int nh, int hd,
                              cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_qkv_merge(void *dqkv, const void *dq, const void *dk, const void *dv, int N, int nh,
                              int hd, cudaDataType_t dt, cudaStream_t stream);

/* ---- Mixture of experts (Mixtral, Qwen3-MoE) -----------------------------------------
 * route: logits [N,E] (dt) -> probs [N,E] (fp32), idx [N,k] (int32), wts [N,k] (fp32),
 * all written; the same top-k and tie rule as op_moe_route (1 <= k <= E <= 1024,
 * k <= 32). backward: dlogits [N,E] (dt, written) from dwts [N,k] and dprobs [N,E]
 * (fp32; dprobs may be NULL). One warp per token row, fp32 arithmetic.
 * gather: xs [M,H] (dt, written) = x[rows[p]] rows, copied exactly. combine: out [N,H]
 * (dt, written) = sum_j wts[t,j] ys[slot[t,j]] (ys dt); backward writes dys (dt) and
 * dwts (fp32); scatter_add: dx [N,H] (dt) += sum_j dxs[slot[t,j]]. One block per
 * token, j in order: deterministic, no atomics. */
cudaError_t cuda_op_moe_route(float *probs, int32_t *idx, float *wts, const void *logits, int N, int E, int k,
                              int renorm, cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_moe_route_backward(void *dlogits, const float *dwts, const float *dprobs, const float *probs,
                                       const int32_t *idx, int N, int E, int k, int renorm, cudaDataType_t dt,
                                       cudaStream_t stream);
cudaError_t cuda_op_moe_gather(void *xs, const void *x, const int32_t *rows, int M, int H, cudaDataType_t dt,
                               cudaStream_t stream);
cudaError_t cuda_op_moe_combine(void *out, const void *ys, const float *wts, const int32_t *slot, int N, int k,
                                int H, cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_moe_combine_backward(void *dys, float *dwts, const void *dout, const void *ys, const float *wts,
                                         const int32_t *slot, int N, int k, int H, cudaDataType_t dt,
                                         cudaStream_t stream);
cudaError_t cuda_op_moe_scatter_add(void *dx, const void *dxs, const int32_t *slot, int N, int k, int H,
                                    cudaDataType_t dt, cudaStream_t stream);
/* group: op_moe_group on the device (off [E+1], rows, slot [N*k] written; idx [N*k]
 * in [0, E), E <= 1024), the same rows; scratch: cuda_op_moe_group_scratch(N, k, E)
 * bytes of device memory. prob_sums: sums [E] (double, written) as op_moe_prob_sums,
 * the same bits. */
size_t cuda_op_moe_group_scratch(int N, int k, int E);
cudaError_t cuda_op_moe_group(int32_t *off, int32_t *rows, int32_t *slot, int32_t *scratch, const int32_t *idx,
                              int N, int k, int E, cudaStream_t stream);
cudaError_t cuda_op_moe_prob_sums(double *sums, const float *probs, int N, int E, cudaStream_t stream);

/* ---- RMSNorm ----------------------------------------------------------------------
 * out, inp, weight, dinp, dout: dt. rstd [N] fp32 (written). dweight [H] fp32
 * (accumulated); dinp or dweight may be NULL to skip it. */
cudaError_t cuda_op_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *weight,
                                    int N, int H, float eps, cudaDataType_t dt,
                                    cudaStream_t stream);
cudaError_t cuda_op_rmsnorm_backward(void *dinp, float *dweight, const void *dout,
                                     const void *inp, const void *weight, const float *rstd,
                                     int N, int H, cudaDataType_t dt, cudaStream_t stream);

/* ---- LayerNorm (torch.nn.LayerNorm) ---------------------------------------------------
 * out, inp, weight, bias, dinp, dout: dt; bias may be NULL (none). mean, rstd [N] fp32
 * (written). dweight, dbias [H] fp32 (accumulated, atomically across blocks as
 * rmsnorm's dweight); any of dinp, dweight, dbias may be NULL to skip it. */
cudaError_t cuda_op_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                      const void *weight, const void *bias, int N, int H, float eps,
                                      cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_layernorm_backward(void *dinp, float *dweight, float *dbias, const void *dout,
                                       const void *inp, const void *weight, const float *mean,
                                       const float *rstd, int N, int H, cudaDataType_t dt,
                                       cudaStream_t stream);

/* ---- RoPE (HF rotate_half, optionally partial as GPT-NeoX's) -------------------------
 * cos_t/sin_t [T, rotary_dim] fp32 from pos[T] (device) and inv_freq[rotary_dim/2]
 * (device; compute it on the host with op_rope_inv_freq and copy it), times scale
 * (op_rope_scale: YaRN's attention factor, else 1). x: dt,
 * [B,T,nh,head_dim], its first rotary_dim dims of each head rotated in place (the
 * rest untouched); rotary_dim even, 0 <= rotary_dim <= head_dim. */
cudaError_t cuda_op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                               const float *inv_freq, int rotary_dim, float scale, cudaStream_t stream);
cudaError_t cuda_op_rope_forward(void *x, const float *cos_t, const float *sin_t,
                                 int B, int T, int nh, int head_dim, int rotary_dim,
                                 cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_rope_backward(void *dx, const float *cos_t, const float *sin_t,
                                  int B, int T, int nh, int head_dim, int rotary_dim,
                                  cudaDataType_t dt, cudaStream_t stream);

/* ---- causal GQA attention with log-sum-exp (flash style) ----------------------------
 * As ops.h: q/out [B,Tq,nh,hd], k/v [B,Tk,nkv,hd] (dt), lse [B,nh,Tq] fp32,
 * qpos[Tq]/kpos[Tk] device int32, qdoc[B,Tq]/kdoc[B,Tk] device int32 document ids
 * or NULL for both, window <= 0 for none. No S x S matrix is ever
 * stored. bf16 with hd in {32, 64, 128} and 16-byte aligned tensors runs on the
 * tensor cores (mma.sync); every other case (fp32, other hd up to 256) runs a
 * portable fp32 kernel. hd <= 256. Backward: dq, dk, dv accumulated (dt), needs
 * the FINAL out and lse; deterministic (no atomics) in its default, split form (a dq
 * kernel and a dk/dv kernel). The fused forms (the tensor-core kernels only:
 * SMP_CUDA_ATTN_BWD=fused or fused-8x16 in the environment, or
 * cuda_op_attention_set_backward_form(1 or 2)) compute all three in one kernel of 4 or
 * 8 warps and add dq's parts in fp32 with atomics: dq's last bits vary from run to
 * run. scratch:
 * device memory of cuda_op_attention_scratch(B, Tq, Tk, nh, hd) bytes, 16-byte
 * aligned, any contents, used in stream order (the tensor-core kernels' per-call
 * tables: ~16 bytes a query row a head, 8 a key; in the fused form also the fp32 dq,
 * 4 bytes an element): size it after picking the form. The tensor-core forward's
 * blocks come in three shapes, warps x query rows a warp (SMP_CUDA_ATTN_FWD=8x16, the
 * default, 4x16 or 4x32; or cuda_op_attention_set_forward_shape(0, 1 or 2)): the same
 * results, another occupancy and shared-memory traffic. */
int cuda_op_attention_backward_form(void);
void cuda_op_attention_set_backward_form(int form);
const char *cuda_op_attention_backward_form_name(int form);
int cuda_op_attention_forward_shape(void);
void cuda_op_attention_set_forward_shape(int shape);
const char *cuda_op_attention_forward_shape_name(int shape);
const char *cuda_op_attention_env_error(void); /* NULL, or what is wrong with those variables */
size_t cuda_op_attention_scratch(int B, int Tq, int Tk, int nh, int hd);
cudaError_t cuda_op_attention_forward(void *out, float *lse, const void *q, const void *k,
                                      const void *v, const int32_t *qpos, const int32_t *kpos,
                                      const int32_t *qdoc, const int32_t *kdoc,
                                      int B, int Tq, int Tk, int nh, int nkv, int hd, int window,
                                      void *scratch, cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_attention_backward(void *dq, void *dk, void *dv, const void *dout,
                                       const void *q, const void *k, const void *v,
                                       const void *out, const float *lse,
                                       const int32_t *qpos, const int32_t *kpos,
                                       const int32_t *qdoc, const int32_t *kdoc,
                                       int B, int Tq, int Tk, int nh, int nkv, int hd, int window,
                                       void *scratch, cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_attention_merge(void *out, float *lse, const void *out2, const float *lse2,
                                    int B, int T, int nh, int hd, cudaDataType_t dt,
                                    cudaStream_t stream);

/* ---- SwiGLU --------------------------------------------------------------------------- */
cudaError_t cuda_op_swiglu_forward(void *out, const void *gate, const void *up, size_t n,
                                   cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_swiglu_backward(void *dgate, void *dup, const void *dout, const void *gate,
                                    const void *up, size_t n, cudaDataType_t dt,
                                    cudaStream_t stream);

/* ---- GELU, exact (erf) ------------------------------------------------------------------
 * out = gelu(inp) (written); backward: dinp += dout * gelu'(inp) (accumulated). */
cudaError_t cuda_op_gelu_forward(void *out, const void *inp, size_t n, cudaDataType_t dt,
                                 cudaStream_t stream);
cudaError_t cuda_op_gelu_backward(void *dinp, const void *dout, const void *inp, size_t n,
                                  cudaDataType_t dt, cudaStream_t stream);

/* ---- cross-entropy over a vocabulary shard ---------------------------------------------
 * The steps of ops.h (rowmax -> tp all-reduce max -> sumexp -> tp all-reduce sums ->
 * loss), logits [N,Vl] in dt, statistics fp32 [N] (written). */
cudaError_t cuda_op_xent_rowmax(float *rowmax, float *target_logit, const void *logits,
                                const int32_t *targets, int N, int Vl, int vocab_start,
                                cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_xent_sumexp(float *sumexp, const void *logits, const float *rowmax,
                                int N, int Vl, cudaDataType_t dt, cudaStream_t stream);
/* The three statistics in ONE pass over the logits (online max, as flash attention
 * does): for a rank that holds the whole vocabulary (tp = 1), it replaces rowmax +
 * sumexp. */
cudaError_t cuda_op_xent_stats(float *rowmax, float *sumexp, float *target_logit,
                               const void *logits, const int32_t *targets, int N, int Vl,
                               int vocab_start, cudaDataType_t dt, cudaStream_t stream);
/* losses[N] (written); *loss_sum (device double, may be NULL) = their sum over rows
 * with target >= 0, summed in a fixed order. */
cudaError_t cuda_op_xent_loss(float *losses, double *loss_sum, const float *rowmax,
                              const float *sumexp, const float *target_logit,
                              const int32_t *targets, int N, cudaStream_t stream);
/* dlogits [N,Vl] (dt, WRITTEN) = scale * (softmax - onehot). dlogits may be the
 * logits buffer itself (in place), so the logits need no second buffer. */
cudaError_t cuda_op_xent_backward(void *dlogits, const void *logits, const float *rowmax,
                                  const float *sumexp, const int32_t *targets, int N, int Vl,
                                  int vocab_start, float scale, cudaDataType_t dt,
                                  cudaStream_t stream);

/* ---- AdamW (torch.optim.AdamW), fused ---------------------------------------------------
 * param (fp32 master), grad, m, v: fp32 [n]. param_bf16 (may be NULL): also
 * written with the updated parameters rounded to bf16 (the compute copy). */
cudaError_t cuda_op_adamw(float *param, const float *grad, float *m, float *v,
                          void *param_bf16, size_t n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, int step, cudaStream_t stream);

/* ---- reductions (x in dt) ------------------------------------------------------------------
 * *out is a device scalar, WRITTEN. sumsq sums in double, in a fixed order (the same
 * bits run to run on one GPU); its calls must not run on two streams at once (the
 * blocks' partial sums live in one device array). amax: NaN propagates. */
cudaError_t cuda_op_sumsq(double *out, const void *x, size_t n, cudaDataType_t dt,
                          cudaStream_t stream);
cudaError_t cuda_op_amax(float *out, const void *x, size_t n, cudaDataType_t dt,
                         cudaStream_t stream);
cudaError_t cuda_op_scale(void *x, float s, size_t n, cudaDataType_t dt, cudaStream_t stream);
/* y = a + b (all three in dt, fp32 arithmetic); y may be a or b. */
cudaError_t cuda_op_add(void *y, const void *a, const void *b, size_t n, cudaDataType_t dt,
                        cudaStream_t stream);

/* ---- FP8 ----------------------------------------------------------------------------------
 * q[i] = fp8(clamp(x[i] * scale, -max, max)), RNE, NaN kept NaN with its sign: bit
 * for bit libshard's shard_fp8_quantize. fmt: OP_FP8_E4M3 or OP_FP8_E5M2. scale:
 * device float. amax (device, may be NULL): WRITTEN with max |x| (NaN propagates).
 * dequantize: x = fp8_value * (1 / scale). */
cudaError_t cuda_op_fp8_quantize(uint8_t *q, float *amax, const void *x, size_t n,
                                 const float *scale, int fmt, cudaDataType_t dt,
                                 cudaStream_t stream);
/* As cuda_op_fp8_quantize, but amax (not NULL) ACCUMULATES: amax = max(amax, max |x|),
 * a NaN on either side giving NaN, the rule of cuda_op_fp8_amax_fold; amax must hold
 * 0 to start, or what this op or the fold left there (a value >= 0, or a NaN with its
 * sign clear). The delayed recipe records each call straight into its step's slot this
 * way: no reset and no fold kernel a call. */
cudaError_t cuda_op_fp8_quantize_acc(uint8_t *q, float *amax, const void *x, size_t n, const float *scale, int fmt,
                                     cudaDataType_t dt, cudaStream_t stream);
cudaError_t cuda_op_fp8_dequantize(void *x, const uint8_t *q, size_t n, const float *scale,
                                   int fmt, cudaDataType_t dt, cudaStream_t stream);
/* The recipe's bookkeeping on the device (train/fp8.h), on n scalars at once.
 * amax_fold: acc[i] = max(acc[i], amax[i]), where a NaN amax wins and a NaN acc
 * stays (the step is then skipped). scale_update (current scaling): scale[i] =
 * fmt_max / amax[i] / 2^margin (computed in double), kept as it is when amax[i] is
 * 0 or not finite; sinv[i] (may be NULL) = 1 / scale[i]. */
cudaError_t cuda_op_fp8_amax_fold(float *acc, const float *amax, int n, cudaStream_t stream);
cudaError_t cuda_op_fp8_scale_update(float *scale, float *sinv, const float *amax, int n, int fmt,
                                     float margin, cudaStream_t stream);
/* dst [cols, ld] = src [rows, cols]^T, bytes (the layout FP8 GEMMs need); ld >= rows,
 * dst's columns rows..ld-1 zero (an FP8 GEMM's sum over rows padded to 16). */
cudaError_t cuda_op_fp8_transpose(uint8_t *dst, int ld, const uint8_t *src, int rows, int cols,
                                  cudaStream_t stream);

/* ---- GEMMs through cuBLASLt ------------------------------------------------------------------
 * A cuda_gemm holds the cuBLASLt handle, its workspace, the scratch for the FP8
 * backward transposes, and the algorithms chosen per shape and dtype (cached; the
 * first call of a shape runs the heuristic). One cuda_gemm per thread; its calls
 * on different streams must not overlap (they share the workspace).
 * workspace_bytes: 0 for the default 32 MiB. fp8_scratch_bytes: the largest
 * cuda_gemm_fp8_scratch_bytes() of the FP8 backward calls to come (0 if none). */
typedef struct cuda_gemm cuda_gemm;
cudaError_t cuda_gemm_create(cuda_gemm **g, size_t workspace_bytes, size_t fp8_scratch_bytes);
void cuda_gemm_free(cuda_gemm *g); /* NULL is fine; synchronizes the device */
size_t cuda_gemm_fp8_scratch_bytes(int N, int IN, int OUT);

/* out[N,OUT] = inp[N,IN] @ weight[OUT,IN]^T, written. inp, weight: dt (CUDA_R_32F
 * or CUDA_R_16BF); out: out_dt (CUDA_R_32F or CUDA_R_16BF; fp32 inputs need fp32
 * out). fp32 runs in full fp32 (no TF32); bf16 accumulates in fp32. */
cudaError_t cuda_op_linear_forward(cuda_gemm *g, void *out, cudaDataType_t out_dt,
                                   const void *inp, const void *weight, cudaDataType_t dt,
                                   int N, int IN, int OUT, cudaStream_t stream);
/* dinp[N,IN] += dout @ weight (dinp in dt); dweight[OUT,IN] += dout^T @ inp
 * (dweight in dw_dt: CUDA_R_32F or CUDA_R_16BF). Either may be NULL. */
cudaError_t cuda_op_linear_backward(cuda_gemm *g, void *dinp, void *dweight,
                                    cudaDataType_t dw_dt, const void *dout, const void *inp,
                                    const void *weight, cudaDataType_t dt, int N, int IN,
                                    int OUT, cudaStream_t stream);

/* FP8 linear (TransformerEngine recipe). Operands are quantized tensors in their
 * natural row-major layouts: inp_q [N,IN] E4M3, w_q [OUT,IN] E4M3, dout_q [N,OUT]
 * E5M2; *_sinv are device floats holding 1/scale of each (the dequantization
 * factor). IN, OUT multiples of 16, N any (the rows past a multiple of 16 go
 * through zero-padded rows in the scratch: cuda_gemm_fp8_scratch_bytes(N, IN, OUT)
 * of it, forward too); pointers 16-byte aligned.
 *
 * forward: out[N,OUT] = (inp_q @ w_q^T) * inp_sinv * w_sinv, WRITTEN, out_dt
 * CUDA_R_16BF or CUDA_R_32F; out_amax (device, may be NULL) = max |out|, from
 * cuBLASLt's AMAX_D where it supports it for this output type, else from a
 * reduction kernel. fast_accum: cuBLASLt's FP8 fast accumulation (forward only). */
cudaError_t cuda_op_linear_forward_fp8(cuda_gemm *g, void *out, cudaDataType_t out_dt,
                                       float *out_amax, const uint8_t *inp_q,
                                       const float *inp_sinv, const uint8_t *w_q,
                                       const float *w_sinv, int N, int IN, int OUT,
                                       int fast_accum, cudaStream_t stream);
/* backward: dinp[N,IN] += (dout_q @ w_q) * dout_sinv * w_sinv (dinp_dt),
 * dweight[OUT,IN] += (dout_q^T @ inp_q) * dout_sinv * inp_sinv (dw_dt); either may
 * be NULL. Hopper's FP8 GEMMs take only the TN layout, so the operands are
 * transposed into the cuda_gemm's scratch first (see cuda_gemm_fp8_scratch_bytes). */
cudaError_t cuda_op_linear_backward_fp8(cuda_gemm *g, void *dinp, cudaDataType_t dinp_dt,
                                        void *dweight, cudaDataType_t dw_dt,
                                        const uint8_t *dout_q, const float *dout_sinv,
                                        const uint8_t *inp_q, const float *inp_sinv,
                                        const uint8_t *w_q, const float *w_sinv,
                                        int N, int IN, int OUT, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
