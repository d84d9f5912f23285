/* kernels/ops.h: every compute op of the model, forward and backward.
 *
 * Two implementations share this contract:
 *   kernels/<op>.c   portable C (fp32, OpenMP, matmul through BLAS): the reference
 *   kernels/<op>.cu  CUDA (see ops_cuda.h), tested op by op against the C one
 *
 * Conventions (all ops):
 *   - row-major, contiguous; N = number of token rows (B*T flattened)
 *   - weights are stored as Hugging Face stores them: a linear layer's weight is
 *     [out_features, in_features], y = x @ W^T
 *   - backward functions ACCUMULATE (+=) into the gradients of inputs and weights,
 *     so that gradient accumulation over microbatches and the sum over tied or
 *     replicated uses need no extra pass. Callers zero them when starting a step.
 *   - no op allocates memory or fails: shapes are checked by the caller (train/).
 *   - outputs do not overlap inputs, except where an op says "in place".
 */
#ifndef SMP_KERNELS_OPS_H
#define SMP_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- embedding (vocab-parallel) --------------------------------------------
 * wte holds rows [vocab_start, vocab_start + vocab_local) of the table [V, H].
 * A token outside that range yields a zero row (the tp all-reduce adds the rank
 * that owns it). */
void op_embedding_forward(float *out, const int32_t *tokens, const float *wte,
                          int N, int H, int vocab_start, int vocab_local);
void op_embedding_backward(float *dwte, const float *dout, const int32_t *tokens,
                           int N, int H, int vocab_start, int vocab_local);

/* ---- linear: out[N,OUT] = inp[N,IN] @ weight[OUT,IN]^T ------------------------ */
void op_linear_forward(float *out, const float *inp, const float *weight,
                       int N, int IN, int OUT);
/* dinp[N,IN] += dout @ weight ; dweight[OUT,IN] += dout^T @ inp.
 * Either gradient pointer may be NULL to skip it. */
void op_linear_backward(float *dinp, float *dweight, const float *dout,
                        const float *inp, const float *weight, int N, int IN, int OUT);

/* ---- bias: out[N, C] += bias[C] (in place); backward dbias[C] += the sum over the
 * N rows of dout[N, C], each column's rows summed in order (the same bits for any
 * thread count). Qwen2's q/k/v projections carry one. */
void op_bias_forward(float *out, const float *bias, int N, int C);
void op_bias_backward(float *dbias, const float *dout, int N, int C);

/* ---- GPT-NeoX's fused qkv: its query_key_value linear gives, per token and head h in
 * order, [q_h, k_h, v_h] (hd each), i.e. qkv [N, nh, 3, hd]. split WRITES q, k, v
 * [N, nh, hd] each; merge, the adjoint, WRITES dqkv [N, nh, 3, hd] from dq, dk, dv
 * (the gradients are whole, so nothing accumulates). Both copy values exactly. */
void op_qkv_split(float *q, float *k, float *v, const float *qkv, int N, int nh, int hd);
void op_qkv_merge(float *dqkv, const float *dq, const float *dk, const float *dv, int N, int nh, int hd);

/* ---- Mixture of experts (Mixtral, Qwen3-MoE), fp32 -------------------------------
 * route: per token row t, probs[t,:] = softmax(logits[t,:]) [N,E]; idx[t,0..k) the k
 * experts of largest prob, descending (ties: the lower expert first); wts[t,j] =
 * probs[t, idx[t,j]], divided by their sum when renorm (transformers'
 * MixtralTopKRouter). All WRITTEN. backward WRITES dlogits [N,E] from dwts [N,k] and
 * dprobs [N,E] (the load-balancing loss's gradient; may be NULL). */
void op_moe_route(float *probs, int32_t *idx, float *wts, const float *logits, int N, int E, int k, int renorm);
void op_moe_route_backward(float *dlogits, const float *dwts, const float *dprobs, const float *probs,
                           const int32_t *idx, int N, int E, int k, int renorm);
/* xs[p,:] = x[rows[p],:] for p < M (written): the tokens of each expert, packed */
void op_moe_gather(float *xs, const float *x, const int32_t *rows, int M, int H);
/* out[t,:] = sum_{j<k} wts[t*k+j] * ys[slot[t*k+j],:] (WRITTEN, j in order). slot is a
 * permutation of 0..N*k-1: where token t's j-th expert put its row. backward WRITES
 * dys[slot[t*k+j],:] = wts[t*k+j] * dout[t,:] and dwts[t*k+j] = dot(dout[t,:], that ys row) */
void op_moe_combine(float *out, const float *ys, const float *wts, const int32_t *slot, int N, int k, int H);
void op_moe_combine_backward(float *dys, float *dwts, const float *dout, const float *ys, const float *wts,
                             const int32_t *slot, int N, int k, int H);
/* gather's adjoint for the slot layout: dx[t,:] += sum_j dxs[slot[t*k+j],:] (ACCUMULATES,
 * j in order per token: no atomics) */
void op_moe_scatter_add(float *dx, const float *dxs, const int32_t *slot, int N, int k, int H);
/* The N*k (token, choice) pairs of idx [N*k] (experts in [0, E)) grouped by expert,
 * tokens in order within each (a stable counting sort): off [E+1] (expert e's rows
 * [off[e], off[e+1]), off[E] = N*k), rows [N*k] (the token of each row) and slot
 * [N*k] (the row of pair p = t*k + j), all WRITTEN. prob_sums: sums [E] (WRITTEN) =
 * sum over t of probs[t,e], added in token order in double (the load-balancing loss's
 * P_e). Both sequential: the same numbers for any thread count, and moe.cu's. */
void op_moe_group(int32_t *off, int32_t *rows, int32_t *slot, const int32_t *idx, int N, int k, int E);
void op_moe_prob_sums(double *sums, const float *probs, int N, int E);

/* ---- RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight ------------------------
 * rstd[N] is saved for backward. backward: dinp or dweight may be NULL to skip it. */
void op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                        int N, int H, float eps);
void op_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                         const float *inp, const float *weight, const float *rstd,
                         int N, int H);

/* ---- LayerNorm (torch.nn.LayerNorm, GPT-NeoX): out = (x - mean) * rstd * weight + bias
 * with rstd = 1/sqrt(var + eps), var the biased variance of the row (as torch).
 * mean[N] and rstd[N] are written, for backward. bias may be NULL (none). backward
 * accumulates into dinp [N,H], dweight [H] and dbias [H]; any of the three may be
 * NULL to skip it. dweight and dbias: each column's rows summed in order (the same
 * bits for any thread count). */
void op_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                          const float *weight, const float *bias, int N, int H, float eps);
void op_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const float *weight, const float *mean,
                           const float *rstd, int N, int H);

/* ---- RoPE, Hugging Face rotate_half convention, optionally partial ---------------
 * Only the first rotary_dim (even, 0 <= rotary_dim <= head_dim) dims of each head
 * are rotated, rotate_half within those; the other head_dim - rotary_dim dims pass
 * through (GPT-NeoX's rotary_pct < 1: rotary_dim = int(head_dim * rotary_pct)).
 * rotary_dim == head_dim is Llama's full rotary embedding.
 * Table: cos/sin [T, rotary_dim] for the positions pos[T] (positions are explicit
 * because a context-parallel rank holds two non-adjacent chunks of a sequence).
 * inv_freq[rotary_dim/2] comes from op_rope_inv_freq(inv_freq, rotary_dim, p)
 * (rope_theta, NeoX's rotary_emb_base, and the optional rope_scaling: "llama3",
 * "yarn" or "linear"): as transformers, the frequencies of a partial rotary are those
 * of a head of rotary_dim dims, 1 / theta^(2i / rotary_dim). The table's cos and sin
 * are multiplied by scale: op_rope_scale(p), YaRN's attention factor (1 otherwise),
 * as transformers multiplies them by its attention_scaling. */
enum { OP_ROPE_DEFAULT = 0, OP_ROPE_LLAMA3 = 1, OP_ROPE_YARN = 2, OP_ROPE_LINEAR = 3 };
typedef struct {
    float theta;              /* rope_theta */
    int type;                 /* OP_ROPE_*: rope_scaling's rope_type */
    float factor;             /* llama3, yarn, linear: factor */
    float low_freq_factor;    /* llama3: low_freq_factor */
    float high_freq_factor;   /* llama3: high_freq_factor */
    float original_max_pos;   /* llama3, yarn: original_max_position_embeddings */
    float beta_fast;          /* yarn: beta_fast (0: transformers' 32) */
    float beta_slow;          /* yarn: beta_slow (0: transformers' 1) */
    int no_truncate;          /* yarn: truncate false (the ramp's ends not rounded out) */
    double attention_factor;  /* yarn: attention_factor (0: from factor, mscale, mscale_all_dim) */
    double mscale;            /* yarn: mscale (0: not given) */
    double mscale_all_dim;    /* yarn: mscale_all_dim (0: not given) */
} op_rope_params;
void op_rope_inv_freq(float *inv_freq, int rotary_dim, const op_rope_params *p);
float op_rope_scale(const op_rope_params *p);
void op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                   const float *inv_freq, int rotary_dim, float scale);
/* x: [B, T, nh, head_dim], rotated in place. backward rotates dx by -angle, in place. */
void op_rope_forward(float *x, const float *cos_t, const float *sin_t,
                     int B, int T, int nh, int head_dim, int rotary_dim);
void op_rope_backward(float *dx, const float *cos_t, const float *sin_t,
                      int B, int T, int nh, int head_dim, int rotary_dim);

/* ---- causal GQA attention with log-sum-exp ------------------------------------
 * q [B, Tq, nh, hd], k and v [B, Tk, nkv, hd] (nh a multiple of nkv; query head h
 * reads kv head h / (nh/nkv)). qpos[Tq], kpos[Tk]: absolute positions, shared by
 * the B sequences. qdoc [B, Tq], kdoc [B, Tk] (row b*T + t): per-token document ids
 * of packed sequences (callers use the position of the document's first token), or
 * NULL for both: one document per sequence. Key j is visible from query i of
 * sequence b when kpos[j] <= qpos[i], (window <= 0 or qpos[i] - kpos[j] < window)
 * (Mistral's sliding window) and (no documents or qdoc[b,i] == kdoc[b,j]).
 * Scale 1/sqrt(hd).
 * out [B, Tq, nh, hd]; lse [B, nh, Tq] = log sum_k exp(score) over visible keys
 * (-INFINITY and out = 0 when none is visible: ring attention merges such partial
 * results). */
void op_attention_forward(float *out, float *lse, const float *q, const float *k,
                          const float *v, const int32_t *qpos, const int32_t *kpos,
                          const int32_t *qdoc, const int32_t *kdoc,
                          int B, int Tq, int Tk, int nh, int nkv, int hd, int window);
/* Backward of one (q-block, kv-block) pair given the FINAL out and lse of the
 * q rows (after any ring merge), so each kv block's share is computed alone.
 * Accumulates into dq, dk, dv. */
void op_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                           const float *q, const float *k, const float *v,
                           const float *out, const float *lse,
                           const int32_t *qpos, const int32_t *kpos,
                           const int32_t *qdoc, const int32_t *kdoc,
                           int B, int Tq, int Tk, int nh, int nkv, int hd, int window);
/* Merge a partial result (out2, lse2) into (out, lse) in place, by log-sum-exp. */
void op_attention_merge(float *out, float *lse, const float *out2, const float *lse2,
                        int B, int T, int nh, int hd);

/* ---- SwiGLU: out = silu(gate) * up -------------------------------------------- */
void op_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void op_swiglu_backward(float *dgate, float *dup, const float *dout,
                        const float *gate, const float *up, size_t n);

/* ---- GELU, exact: out = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (torch's default,
 * GPT-NeoX's "gelu"). backward ACCUMULATES, as swiglu's: dinp[i] += dout[i] * gelu'(inp[i]). */
void op_gelu_forward(float *out, const float *inp, size_t n);
void op_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n);

/* ---- cross-entropy over a vocabulary shard -------------------------------------
 * logits [N, Vl] hold columns [vocab_start, vocab_start+Vl) of the full logits.
 * Step 1, per rank: row max, and the target's logit where this rank owns it (else 0).
 * Step 2, caller: all-reduce max of rowmax over the tp group.
 * Step 3, per rank: sumexp[N] = sum exp(logit - rowmax); caller all-reduces sum,
 *         and target_logit by sum. loss_n = log(sumexp) + rowmax - target_logit.
 * Targets < 0 are ignored (loss 0, no gradient).
 * No full-vocabulary logits are ever gathered. */
void op_xent_rowmax(float *rowmax, float *target_logit, const float *logits,
                    const int32_t *targets, int N, int Vl, int vocab_start);
void op_xent_sumexp(float *sumexp, const float *logits, const float *rowmax, int N, int Vl);
/* losses[N] from the reduced statistics; returns their sum over rows with target >= 0. */
double op_xent_loss(float *losses, const float *rowmax, const float *sumexp,
                    const float *target_logit, const int32_t *targets, int N);
/* dlogits[N,Vl] = scale * (softmax - onehot(target)), written (not accumulated),
 * softmax from lse = rowmax + log(sumexp). Rows with target < 0 get 0. */
void op_xent_backward(float *dlogits, const float *logits, const float *rowmax,
                      const float *sumexp, const int32_t *targets,
                      int N, int Vl, int vocab_start, float scale);

/* ---- AdamW (decoupled weight decay, bias correction), step counts from 1 ------ */
void op_adamw(float *param, const float *grad, float *m, float *v, size_t n,
              float lr, float beta1, float beta2, float eps, float weight_decay, int step);

/* ---- reductions ----------------------------------------------------------------- */
double op_sumsq(const float *x, size_t n);      /* sum of squares, for grad-norm clipping */
float op_amax(const float *x, size_t n);        /* max |x|, NaN propagates */
void op_scale(float *x, float s, size_t n);     /* x *= s */
void op_add(float *y, const float *a, const float *b, size_t n); /* y = a + b; y may be a or b */

/* ---- FP8 (E4M3 forward, E5M2 backward), TransformerEngine-style --------------
 * q = saturate(x * scale) rounded to nearest even in the format; the stored byte is
 * the format's bit pattern. dequant: x = value(q) * (1 / scale) (as libshard does).
 * amax (if not NULL) receives max |x| of the input before scaling. */
enum { OP_FP8_E4M3 = 0, OP_FP8_E5M2 = 1 };
void op_fp8_quantize(uint8_t *q, float *amax, const float *x, size_t n, float scale, int fmt);
void op_fp8_dequantize(float *x, const uint8_t *q, size_t n, float scale, int fmt);
/* dst = dequant(quant(src)): the values an FP8 GEMM sees, as fp32 (no byte buffer;
 * dst may be src) */
void op_fp8_roundtrip(float *dst, const float *src, size_t n, float scale, int fmt);
/* FP8 linear: out = dequant(quant(inp, s_in)) @ dequant(quant(W, s_w))^T, both in
 * E4M3 (the C backend emulates it exactly: quantize, dequantize, fp32 GEMM).
 * scratch: caller-provided memory of OP_LINEAR_FP8_SCRATCH_BYTES(N, IN, OUT) bytes
 * (host memory for the C backend, device memory for CUDA) for the quantized
 * operands, since no op allocates. */
#define OP_LINEAR_FP8_SCRATCH_BYTES(N, IN, OUT) \
    (((size_t)(N) + (size_t)(OUT)) * (size_t)(IN) * sizeof(float))
void op_linear_forward_fp8(float *out, const float *inp, const float *weight,
                           int N, int IN, int OUT, float s_in, float s_w, void *scratch);

#ifdef __cplusplus
}
#endif
#endif
