/* backends/dev.h, internal (no API outside smp's own programs and tests): the
 * interface every backend implements: where the model's tensors live and its ops
 * run: the C backend (backends/c/)
 * (host memory, kernels/ops.h, fp32) or the CUDA backend (backends/cuda/: device memory,
 * kernels/ops_cuda.h, fp32 or bf16 storage).
 *
 * model.c, par.c, optim.c and ckptio.c are written once over this table; each
 * backend fills it. The CUDA one lives in a shared library of its own
 * (build/lib/libsmp_cuda.so, backends/cuda/) that smp-train loads only for
 * --backend cuda, so that a build with CUDA still trains on machines without a
 * GPU, and the same smp-train can load the CPU emulator's build of it
 * (tests/gpu/emu; SMP_CUDA_LIB=path) to test the CUDA backend without a GPU.
 *
 * Conventions:
 *   - `void *` tensors are in d->dt (SHARD_DT_F32, or SHARD_DT_BF16 on CUDA), the
 *     activations and the compute copy of the parameters; `float *` tensors are
 *     fp32: gradients of the parameters (always fp32, accumulated), per-row
 *     statistics (rstd, lse, rowmax, sumexp, losses), RoPE tables, optimizer state
 *     and the fp32 master weights.
 *   - int32 arrays (tokens, targets, positions) are in the backend's memory too:
 *     upload them with ->upload.
 *   - Ops enqueue and return nothing; the first failure (a launch, a library call,
 *     an allocation) is kept in d->err with its message in d->errmsg and later ops
 *     still run (with wrong numbers), like the model's comm_err: the caller checks
 *     dev_status() where a step ends. Functions that return a host value (sumsq,
 *     xent_loss, download) wait for the work before them.
 *   - The semantics of each op are those of the op of the same name in
 *     kernels/ops.h (backward accumulates, etc.).
 */
#ifndef SMP_TRAIN_DEV_H
#define SMP_TRAIN_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "shard.h"

typedef struct dev dev;
typedef struct dev_ops dev_ops;
typedef struct fp8_state fp8_state;

struct dev {
    const dev_ops *ops;
    shard_dtype dt;          /* activations and compute parameters */
    size_t es;               /* bytes per element of dt */
    int cuda;                /* 1: device memory (host code must not dereference it) */
    int device;              /* CUDA device index */
    shard_status err;        /* first failure, SHARD_OK if none */
    char errmsg[512];
    void *impl;              /* the backend's own state (streams, cuBLASLt, scratch) */
};

/* The name of the entry point libsmp_cuda.so exports: const dev_ops *NAME(void). */
#define DEV_CUDA_ENTRY "smp_dev_cuda_ops"
#define DEV_ABI 6

struct dev_ops {
    int abi;                 /* DEV_ABI: a library built for another table is refused */
    const char *name;        /* "cpu", "cuda" */
    /* device: CUDA device index (ignored by the C backend). d->dt is set. */
    shard_status (*init)(dev *d, int device);
    void (*fini)(dev *d);
    /* a one-line description of the device ("NVIDIA H200, 139.8 GiB"), for the log */
    const char *(*describe)(dev *d);
    /* bytes of device memory in use (0 when unknown) */
    size_t (*mem_used)(dev *d);

    /* The communicator for tensors in this backend's memory over the ranks of
     * `host` (an MPI or self communicator): `host` itself where MPI can move them
     * (C backend, the CPU emulator), else a new NCCL communicator bootstrapped over
     * `host` (*owned = 1: the caller frees it). */
    shard_status (*comm_for)(dev *d, shard_comm *host, shard_comm **out, int *owned);

    /* ---- memory */
    void *(*alloc)(dev *d, size_t bytes);      /* zeroed; NULL (and d->err) when out of memory */
    void (*release)(dev *d, void *p);          /* NULL is fine */
    void (*zero)(dev *d, void *p, size_t bytes);
    void (*copy)(dev *d, void *dst, const void *src, size_t bytes);          /* both in the backend */
    void (*upload)(dev *d, void *dst, const void *host, size_t bytes);       /* host -> backend */
    void (*download)(dev *d, void *host, const void *src, size_t bytes);     /* backend -> host, waits */
    shard_status (*sync)(dev *d);              /* waits for all work; returns d->err */

    /* ---- the model's ops (kernels/ops.h) */
    void (*embedding_forward)(dev *d, void *out, const int32_t *tokens, const void *wte, int N, int H,
                              int vocab_start, int vocab_local);
    void (*embedding_backward)(dev *d, float *dwte, const void *dout, const int32_t *tokens, int N, int H,
                               int vocab_start, int vocab_local);
    /* out (dt) = inp @ w^T; backward: dinp (dt) += dout @ w, dw (fp32) += dout^T @ inp; either may be NULL */
    void (*linear_forward)(dev *d, void *out, const void *inp, const void *w, int N, int IN, int OUT);
    void (*linear_backward)(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w, int N,
                            int IN, int OUT);
    /* out (dt) [N,C] += bias (dt) [C]; backward: dbias (fp32) [C] += the column sums of dout (dt) */
    void (*bias_forward)(dev *d, void *out, const void *bias, int N, int C);
    void (*bias_backward)(dev *d, float *dbias, const void *dout, int N, int C);
    /* GPT-NeoX's fused qkv [N, nh, 3, hd] -> q, k, v [N, nh, hd] each (written); merge: the adjoint (written) */
    void (*qkv_split)(dev *d, void *q, void *k, void *v, const void *qkv, int N, int nh, int hd);
    void (*qkv_merge)(dev *d, void *dqkv, const void *dq, const void *dk, const void *dv, int N, int nh, int hd);
    /* Mixture of experts (Mixtral, Qwen3-MoE): softmax + top-k routing of logits (dt) [N,E] into probs (fp32
     * [N,E]), idx (int32 [N,k]) and wts (fp32 [N,k], renormalized when renorm); backward writes dlogits (dt) from
     * dwts and dprobs (fp32, may be NULL). gather: xs[p] = x[rows[p]] (dt); combine: out[t] = sum_j wts[t,j]
     * ys[slot[t,j]] (written); its backward writes dys and dwts (fp32); scatter_add: dx[t] += sum_j dxs[slot[t,j]] */
    void (*moe_route)(dev *d, float *probs, int32_t *idx, float *wts, const void *logits, int N, int E, int k, int renorm);
    void (*moe_route_backward)(dev *d, void *dlogits, const float *dwts, const float *dprobs, const float *probs,
                               const int32_t *idx, int N, int E, int k, int renorm);
    void (*moe_gather)(dev *d, void *xs, const void *x, const int32_t *rows, int M, int H);
    void (*moe_combine)(dev *d, void *out, const void *ys, const float *wts, const int32_t *slot, int N, int k, int H);
    void (*moe_combine_backward)(dev *d, void *dys, float *dwts, const void *dout, const void *ys, const float *wts,
                                 const int32_t *slot, int N, int k, int H);
    void (*moe_scatter_add)(dev *d, void *dx, const void *dxs, const int32_t *slot, int N, int k, int H);
    /* the (token, choice) pairs of idx (int32 [N*k]) grouped by expert into rows and slot (int32 [N*k]), tokens
     * in order within each expert (op_moe_group), and off (HOST int32 [E+1]: the experts' first rows, which size
     * their GEMMs); prob_sums: sums (HOST double [E]) = the column sums of probs (fp32 [N,E]) in token order */
    void (*moe_group)(dev *d, int32_t *off, int32_t *rows, int32_t *slot, const int32_t *idx, int N, int k, int E);
    void (*moe_prob_sums)(dev *d, double *sums, const float *probs, int N, int E);
    void (*rmsnorm_forward)(dev *d, void *out, float *rstd, const void *inp, const void *w, int N, int H, float eps);
    void (*rmsnorm_backward)(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                             const float *rstd, int N, int H);
    /* LayerNorm with bias (b may be NULL); mean, rstd fp32 [N]; backward: dw, db fp32 [H] */
    void (*layernorm_forward)(dev *d, void *out, float *mean, float *rstd, const void *inp, const void *w,
                              const void *b, int N, int H, float eps);
    void (*layernorm_backward)(dev *d, void *dinp, float *dw, float *db, const void *dout, const void *inp,
                               const void *w, const float *mean, const float *rstd, int N, int H);
    /* pos: backend int32 [T]; inv_freq: backend fp32 [rd/2]; tables [T, rd]. x: [B, T, nh, hd], its first
     * rd (the rotary dim, even, <= hd) dims of each head rotated */
    void (*rope_table)(dev *d, float *cos_t, float *sin_t, const int32_t *pos, int T, const float *inv_freq, int rd, float scale);
    void (*rope_forward)(dev *d, void *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                         int rd);
    void (*rope_backward)(dev *d, void *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                          int rd);
    void (*attention_forward)(dev *d, void *out, float *lse, const void *q, const void *k, const void *v,
                              const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc,
                              int B, int Tq, int Tk, int nh, int nkv, int hd, int window);
    void (*attention_backward)(dev *d, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                               const void *v, const void *out, const float *lse, const int32_t *qpos,
                               const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc, int B, int Tq, int Tk,
                               int nh, int nkv, int hd, int window);
    void (*attention_merge)(dev *d, void *out, float *lse, const void *out2, const float *lse2, int B, int T, int nh,
                            int hd);
    void (*swiglu_forward)(dev *d, void *out, const void *gate, const void *up, size_t n);
    void (*swiglu_backward)(dev *d, void *dgate, void *dup, const void *dout, const void *gate, const void *up,
                            size_t n);
    /* exact GELU; backward accumulates into dinp */
    void (*gelu_forward)(dev *d, void *out, const void *inp, size_t n);
    void (*gelu_backward)(dev *d, void *dinp, const void *dout, const void *inp, size_t n);
    /* y = a + b (dt); y may be a or b */
    void (*add)(dev *d, void *y, const void *a, const void *b, size_t n);
    void (*xent_rowmax)(dev *d, float *rowmax, float *target_logit, const void *logits, const int32_t *targets, int N,
                        int Vl, int vocab_start);
    void (*xent_sumexp)(dev *d, float *sumexp, const void *logits, const float *rowmax, int N, int Vl);
    /* losses[N] written; returns their sum over rows with target >= 0, in row order
     * on the C backend (the same bits for any thread count); waits */
    double (*xent_loss)(dev *d, float *losses, const float *rowmax, const float *sumexp, const float *target_logit,
                        const int32_t *targets, int N);
    /* dlogits (dt) written; may be the logits buffer itself */
    void (*xent_backward)(dev *d, void *dlogits, const void *logits, const float *rowmax, const float *sumexp,
                          const int32_t *targets, int N, int Vl, int vocab_start, float scale);

    /* ---- optimizer (fp32) */
    double (*sumsq)(dev *d, const float *x, size_t n);   /* waits */
    void (*scale)(dev *d, float *x, float s, size_t n);
    /* AdamW on the fp32 master; param (dt, may be NULL) also gets the updated values
     * in the compute dtype (bf16 compute copy) */
    void (*adamw)(dev *d, float *master, const float *grad, float *m, float *v, void *param, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int step);

    /* ---- FP8 linear layers (train/fp8.h's recipe; the state's scales and history
     * are on the host, the backend keeps device copies as it needs) */
    shard_status (*fp8_reserve)(dev *d, fp8_state *s, int N, int maxdim);
    void (*fp8_linear_forward)(dev *d, fp8_state *s, int idx, void *out, const void *inp, const void *w, int N,
                               int IN, int OUT);
    void (*fp8_linear_backward)(dev *d, fp8_state *s, int idx, void *dinp, float *dw, const void *dout,
                                const void *inp, const void *w, int N, int IN, int OUT);
    /* after an optimizer step, before fp8_step_end: fold the backend's record of
     * the step's amaxes into s->step_amax (host) */
    void (*fp8_collect)(dev *d, fp8_state *s);
    /* after fp8_step_end changed the host scales */
    void (*fp8_scales_changed)(dev *d, fp8_state *s);
};

/* The C backend's table (dev_c.c). */
const dev_ops *dev_c_ops(void);
/* Make a backend: "cpu" or "cuda" (loads libsmp_cuda.so: SMP_CUDA_LIB, else next to
 * libshard.so's folder build/lib, else the loader's path). dt: SHARD_DT_F32 or
 * SHARD_DT_BF16 (CUDA only). */
shard_status dev_open(dev *d, const char *backend, shard_dtype dt, int device);
void dev_close(dev *d);
/* d->err (SHARD_OK when every op so far succeeded); sets shard_errmsg to d->errmsg
 * ("<name> backend: ..."). dev_status and dev_fail are dev_err.c's, built into
 * every backend. */
shard_status dev_status(dev *d);
/* Record a failure (first one wins) */
void dev_fail(dev *d, shard_status s, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Helpers over the table */
static inline void *dev_at(const dev *d, void *p, size_t elems) { return (char *)p + elems * d->es; }
static inline const void *dev_cat(const dev *d, const void *p, size_t elems) { return (const char *)p + elems * d->es; }
/* host fp32 [n] -> backend dt; backend dt -> host fp32 (staging through a host buffer) */
void dev_upload_f32(dev *d, void *dst, const float *host, size_t n);
void dev_download_f32(dev *d, float *host, const void *src, size_t n);

#endif
