/* backends/cuda/dev_cuda.c: the CUDA backend of dev.h: device memory, one stream, the ops
 * of kernels/ops_cuda.h with activations and compute parameters in d->dt (fp32 or
 * bf16) and parameter gradients, statistics and optimizer state in fp32. Built
 * into libsmp_cuda.so (see dev_cuda.h), which smp-train loads for --backend cuda;
 * with -DSMP_CUDA_EMU the same file builds against the CPU emulator
 * (scons variant=emu). FP8 is in dev_cuda_fp8.c, communicators in
 * dev_cuda_comm.c. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dev_cuda.h"

/* ------------------------------------------------------------------ failures
 * (recorded by dev_fail, backends/dev_err.c) */
static shard_status code_of(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? SHARD_E_NOMEM : e == cudaErrorInvalidValue ? SHARD_E_USAGE : SHARD_E_IO;
}

void cu_op(dev *d, cudaError_t e)
{
    if (e != cudaSuccess) dev_fail(d, code_of(e), "%s", cuda_op_errmsg());
}

void cu_rt(dev *d, cudaError_t e, const char *what)
{
    if (e != cudaSuccess) dev_fail(d, code_of(e), "%s: %s", what, cudaGetErrorString(e));
}

#define ST (cu_of(d)->st)
#define DT (cu_dt(d))

/* ------------------------------------------------------------------ waiting */
shard_status cu_comm_watch(dev *d, shard_comm *nccl)
{
    cu_impl *c = cu_of(d);
    shard_comm **a = realloc(c->comms, (size_t)(c->ncomms + 1) * sizeof *a);
    if (!a) return shard_fail(SHARD_E_NOMEM, "out of memory");
    a[c->ncomms++] = nccl;
    c->comms = a;
    return SHARD_OK;
}

void cu_comm_unwatch(dev *d, shard_comm *nccl)
{
    cu_impl *c = cu_of(d);
    for (int i = 0; i < c->ncomms; i++)
        if (c->comms[i] == nccl) {
            c->comms[i] = c->comms[--c->ncomms];
            return;
        }
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* a failed NCCL call: which communicator hangs is unknown, so all are aborted (on a
 * GPU, an aborted communicator's kernels end, and the stream with them) */
static int comms_failed(dev *d, double waited)
{
    cu_impl *c = cu_of(d);
    for (int i = 0; i < c->ncomms; i++) {
        shard_status s = shard_comm_nccl_check(c->comms[i], waited);
        if (!s) continue;
        dev_fail(d, s, "%s", shard_errmsg());
        for (int j = 0; j < c->ncomms; j++) shard_comm_nccl_abort(c->comms[j], d->errmsg);
        return 1;
    }
    return 0;
}

void cu_wait(dev *d, cudaEvent_t ev, const char *what)
{
    cu_impl *c = cu_of(d);
    if (!c->ncomms) {
        cu_rt(d, ev ? cudaEventSynchronize(ev) : cudaStreamSynchronize(c->st), what);
        return;
    }
    const double t0 = now_s();
    double next = t0; /* NCCL's error states every millisecond: the query is the cheap part */
    while (!d->err) {
        cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(c->st);
        if (e != cudaErrorNotReady) {
            cu_rt(d, e, what);
            return;
        }
        const double t = now_s();
        if (t >= next) {
            if (comms_failed(d, t - t0)) return;
            next = t + 1e-3;
        }
        sched_yield();
    }
}

/* ------------------------------------------------------------------ device */
static void cu_fini(dev *d)
{
    cu_impl *c = cu_of(d);
    if (!c) return;
    if (c->st) cu_wait(d, NULL, "cudaStreamSynchronize");
    free(c->comms); /* (freed before the backend: dev_cuda_comm.c) */
    cu_fp8_free(d);
    cuda_gemm_free(c->gemm);
    cudaFree(c->d_sum);
    cudaFree(c->scratch);
    for (int i = 0; i < CU_STAGE_SLOTS; i++)
        if (c->stage_ev[i]) cudaEventDestroy(c->stage_ev[i]);
    if (c->stage) cudaFreeHost(c->stage);
    if (c->st) cudaStreamDestroy(c->st);
    free(c);
    d->impl = NULL;
}

static shard_status cu_init(dev *d, int device)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return shard_fail(SHARD_E_IO, "no CUDA device%s%s", e != cudaSuccess ? ": " : "", /* the machine: exit 1 */
                          e != cudaSuccess ? cudaGetErrorString(e) : "");
    if (device < 0 || device >= n)
        return shard_fail(SHARD_E_USAGE, "CUDA device %d: this machine has %d (0..%d)", device, n, n - 1);
    if (d->dt != SHARD_DT_F32 && d->dt != SHARD_DT_BF16)
        return shard_fail(SHARD_E_USAGE, "the CUDA backend computes in fp32 or bf16, not %s", shard_dtype_name(d->dt));
    const char *form_error = cuda_op_attention_env_error();
    if (form_error) return shard_fail(SHARD_E_USAGE, "%s", form_error);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return shard_fail(SHARD_E_IO, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    cu_impl *c = calloc(1, sizeof *c);
    if (!c) return shard_fail(SHARD_E_NOMEM, "out of memory");
    d->impl = c;
    d->cuda = 1;
    d->device = device;
    cu_rt(d, cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    if (!d->err) cu_op(d, cuda_gemm_create(&c->gemm, 0, 0)); /* FP8 scratch: fp8_reserve */
    if (!d->err) cu_rt(d, cudaMalloc((void **)&c->d_sum, sizeof(double)), "cudaMalloc");
    if (!d->err) cu_rt(d, cudaMallocHost((void **)&c->stage, (size_t)CU_STAGE_SLOTS * CU_STAGE_BYTES), "cudaMallocHost");
    for (int i = 0; i < CU_STAGE_SLOTS && !d->err; i++)
        cu_rt(d, cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (d->err) {
        shard_status s = dev_status(d);
        cu_fini(d);
        return s;
    }
    struct cudaDeviceProp p;
    /* the attention kernels' forms, where not the defaults (SMP_CUDA_ATTN_BWD, _FWD) */
    char note[64];
    const int shape = cuda_op_attention_forward_shape(), form = cuda_op_attention_backward_form();
    snprintf(note, sizeof note, "%s%s%s%s", form ? "; attention backward " : "",
             form ? cuda_op_attention_backward_form_name(form) : "", shape ? "; attention forward " : "",
             shape ? cuda_op_attention_forward_shape_name(shape) : "");
    if (cudaGetDeviceProperties(&p, device) == cudaSuccess)
        snprintf(c->desc, sizeof c->desc, "%.150s, %.1f GiB (device %d%s)", p.name,
                 (double)p.totalGlobalMem / (1 << 30), device, note);
    else
        snprintf(c->desc, sizeof c->desc, "CUDA device %d%s", device, note);
    return SHARD_OK;
}

static const char *cu_describe(dev *d) { return cu_of(d)->desc; }

static size_t cu_mem_used(dev *d)
{
    (void)d;
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
    return total - free_b;
}

/* ------------------------------------------------------------------ memory */
static void *cu_alloc(dev *d, size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: the device stays usable */
        dev_fail(d, SHARD_E_NOMEM, "out of device memory: cudaMalloc of %zu bytes: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    cu_rt(d, cudaMemsetAsync(p, 0, bytes, ST), "cudaMemsetAsync");
    return p;
}

static void cu_release(dev *d, void *p)
{
    if (p) cu_rt(d, cudaFree(p), "cudaFree");
}

static void cu_zero(dev *d, void *p, size_t bytes)
{
    if (bytes) cu_rt(d, cudaMemsetAsync(p, 0, bytes, ST), "cudaMemsetAsync");
}

static void cu_copy(dev *d, void *dst, const void *src, size_t bytes)
{
    if (bytes && dst != src) cu_rt(d, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ST), "cudaMemcpyAsync");
}

/* The caller may reuse `host` as soon as this returns. Small uploads (tokens,
 * positions) go through a ring of pinned slots, so that they do not wait for the
 * work queued before them, only for the upload that last used the slot; larger
 * ones (initial weights) are copied and waited for. */
static void cu_upload(dev *d, void *dst, const void *host, size_t bytes)
{
    cu_impl *c = cu_of(d);
    if (!bytes) return;
    if (bytes <= CU_STAGE_BYTES) {
        const int i = c->stage_next;
        c->stage_next = (i + 1) % CU_STAGE_SLOTS;
        unsigned char *slot = c->stage + (size_t)i * CU_STAGE_BYTES;
        cu_wait(d, c->stage_ev[i], "cudaEventSynchronize");
        memcpy(slot, host, bytes);
        cu_rt(d, cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, c->st), "cudaMemcpyAsync");
        cu_rt(d, cudaEventRecord(c->stage_ev[i], c->st), "cudaEventRecord");
        return;
    }
    cu_rt(d, cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c->st), "cudaMemcpyAsync");
    cu_wait(d, NULL, "cudaStreamSynchronize");
}

static void cu_download(dev *d, void *host, const void *src, size_t bytes)
{
    if (!bytes) return;
    cu_rt(d, cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, ST), "cudaMemcpyAsync");
    cu_wait(d, NULL, "cudaStreamSynchronize");
}

static shard_status cu_sync(dev *d)
{
    cu_wait(d, NULL, "cudaStreamSynchronize");
    cu_rt(d, cudaGetLastError(), "a kernel");
    return d->err;
}

/* ------------------------------------------------------------------ the model's ops */
static void cu_embedding_forward(dev *d, void *out, const int32_t *tokens, const void *wte, int N, int H, int vs, int vl)
{
    cu_op(d, cuda_op_embedding_forward(out, tokens, wte, N, H, vs, vl, DT, ST));
}
static void cu_embedding_backward(dev *d, float *dwte, const void *dout, const int32_t *tokens, int N, int H, int vs,
                                  int vl)
{
    cu_op(d, cuda_op_embedding_backward(dwte, dout, tokens, N, H, vs, vl, DT, ST));
}
static void cu_linear_forward(dev *d, void *out, const void *inp, const void *w, int N, int IN, int OUT)
{
    cu_op(d, cuda_op_linear_forward(cu_of(d)->gemm, out, DT, inp, w, DT, N, IN, OUT, ST));
}
static void cu_linear_backward(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w, int N,
                               int IN, int OUT)
{
    /* the weight gradient accumulates in fp32 whatever the compute dtype */
    cu_op(d, cuda_op_linear_backward(cu_of(d)->gemm, dinp, dw, CUDA_R_32F, dout, inp, w, DT, N, IN, OUT, ST));
}
static void cu_bias_forward(dev *d, void *out, const void *bias, int N, int C)
{
    cu_op(d, cuda_op_bias_forward(out, bias, N, C, DT, ST));
}
static void cu_bias_backward(dev *d, float *dbias, const void *dout, int N, int C)
{
    cu_op(d, cuda_op_bias_backward(dbias, dout, N, C, DT, ST));
}
static void cu_qkv_split(dev *d, void *q, void *k, void *v, const void *qkv, int N, int nh, int hd)
{
    cu_op(d, cuda_op_qkv_split(q, k, v, qkv, N, nh, hd, DT, ST));
}
static void cu_qkv_merge(dev *d, void *dqkv, const void *dq, const void *dk, const void *dv, int N, int nh, int hd)
{
    cu_op(d, cuda_op_qkv_merge(dqkv, dq, dk, dv, N, nh, hd, DT, ST));
}
static void cu_moe_route(dev *d, float *probs, int32_t *idx, float *wts, const void *logits, int N, int E, int k,
                         int renorm)
{
    cu_op(d, cuda_op_moe_route(probs, idx, wts, logits, N, E, k, renorm, DT, ST));
}
static void cu_moe_route_backward(dev *d, void *dlogits, const float *dwts, const float *dprobs, const float *probs,
                                  const int32_t *idx, int N, int E, int k, int renorm)
{
    cu_op(d, cuda_op_moe_route_backward(dlogits, dwts, dprobs, probs, idx, N, E, k, renorm, DT, ST));
}
static void cu_moe_gather(dev *d, void *xs, const void *x, const int32_t *rows, int M, int H)
{
    cu_op(d, cuda_op_moe_gather(xs, x, rows, M, H, DT, ST));
}
static void cu_moe_combine(dev *d, void *out, const void *ys, const float *wts, const int32_t *slot, int N, int k,
                           int H)
{
    cu_op(d, cuda_op_moe_combine(out, ys, wts, slot, N, k, H, DT, ST));
}
static void cu_moe_combine_backward(dev *d, void *dys, float *dwts, const void *dout, const void *ys, const float *wts,
                                    const int32_t *slot, int N, int k, int H)
{
    cu_op(d, cuda_op_moe_combine_backward(dys, dwts, dout, ys, wts, slot, N, k, H, DT, ST));
}
static void cu_moe_scatter_add(dev *d, void *dx, const void *dxs, const int32_t *slot, int N, int k, int H)
{
    cu_op(d, cuda_op_moe_scatter_add(dx, dxs, slot, N, k, H, DT, ST));
}
/* the ops' scratch, grown to `bytes` (NULL after a failure, recorded): one buffer,
 * since the stream orders its users; `what` names the op in the error */
static void *cu_scratch(dev *d, size_t bytes, const char *what)
{
    cu_impl *c = cu_of(d);
    if (bytes > c->scratch_bytes) {
        cu_wait(d, NULL, "cudaStreamSynchronize"); /* the old buffer may still be in use */
        cudaFree(c->scratch);
        c->scratch = NULL;
        c->scratch_bytes = 0;
        if (cudaMalloc(&c->scratch, bytes) != cudaSuccess) {
            (void)cudaGetLastError();
            c->scratch = NULL;
            dev_fail(d, SHARD_E_NOMEM, "out of device memory for %s's scratch (%zu bytes)", what, bytes);
        } else {
            c->scratch_bytes = bytes;
        }
    }
    return d->err ? NULL : c->scratch;
}
/* grouped on the device; only the E + 1 offsets come to the host (the GEMMs' sizes) */
static void cu_moe_group(dev *d, int32_t *off, int32_t *rows, int32_t *slot, const int32_t *idx, int N, int k, int E)
{
    const size_t ob = ((size_t)(E + 1) * sizeof(int32_t) + 255) / 256 * 256;
    int32_t *doff = cu_scratch(d, ob + cuda_op_moe_group_scratch(N, k, E), "the experts' grouping");
    if (!doff) return;
    cu_op(d, cuda_op_moe_group(doff, rows, slot, (int32_t *)((char *)doff + ob), idx, N, k, E, ST));
    cu_download(d, off, doff, (size_t)(E + 1) * sizeof(int32_t));
}
static void cu_moe_prob_sums(dev *d, double *sums, const float *probs, int N, int E)
{
    double *ds = cu_scratch(d, (size_t)E * sizeof(double), "the experts' grouping");
    if (!ds) return;
    cu_op(d, cuda_op_moe_prob_sums(ds, probs, N, E, ST));
    cu_download(d, sums, ds, (size_t)E * sizeof(double));
}
static void cu_rmsnorm_forward(dev *d, void *out, float *rstd, const void *inp, const void *w, int N, int H, float eps)
{
    cu_op(d, cuda_op_rmsnorm_forward(out, rstd, inp, w, N, H, eps, DT, ST));
}
static void cu_rmsnorm_backward(dev *d, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                                const float *rstd, int N, int H)
{
    cu_op(d, cuda_op_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, H, DT, ST));
}
static void cu_layernorm_forward(dev *d, void *out, float *mean, float *rstd, const void *inp, const void *w,
                                 const void *b, int N, int H, float eps)
{
    cu_op(d, cuda_op_layernorm_forward(out, mean, rstd, inp, w, b, N, H, eps, DT, ST));
}
static void cu_layernorm_backward(dev *d, void *dinp, float *dw, float *db, const void *dout, const void *inp,
                                  const void *w, const float *mean, const float *rstd, int N, int H)
{
    cu_op(d, cuda_op_layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, H, DT, ST));
}
static void cu_rope_table(dev *d, float *cos_t, float *sin_t, const int32_t *pos, int T, const float *inv_freq, int rd, float scale)
{
    cu_op(d, cuda_op_rope_table(cos_t, sin_t, pos, T, inv_freq, rd, scale, ST));
}
static void cu_rope_forward(dev *d, void *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                            int rd)
{
    cu_op(d, cuda_op_rope_forward(x, cos_t, sin_t, B, T, nh, hd, rd, DT, ST));
}
static void cu_rope_backward(dev *d, void *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                             int rd)
{
    cu_op(d, cuda_op_rope_backward(dx, cos_t, sin_t, B, T, nh, hd, rd, DT, ST));
}
static void cu_attention_forward(dev *d, void *out, float *lse, const void *q, const void *k, const void *v,
                                 const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                                 const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv,
                                 int hd, int window)
{
    void *scratch = cu_scratch(d, cuda_op_attention_scratch(B, Tq, Tk, nh, hd), "attention");
    if (scratch)
        cu_op(d, cuda_op_attention_forward(out, lse, q, k, v, qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh, nkv, hd, window,
                                           scratch, DT, ST));
}
static void cu_attention_backward(dev *d, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                                  const void *v, const void *out, const float *lse, const int32_t *qpos,
                                  const int32_t *kpos, const int32_t *qdoc, const int32_t *kdoc, int B, int Tq, int Tk,
                                  int nh, int nkv, int hd, int window)
{
    void *scratch = cu_scratch(d, cuda_op_attention_scratch(B, Tq, Tk, nh, hd), "attention");
    if (scratch)
        cu_op(d, cuda_op_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, qpos, kpos, qdoc, kdoc, B, Tq, Tk, nh,
                                            nkv, hd, window, scratch, DT, ST));
}
static void cu_attention_merge(dev *d, void *out, float *lse, const void *out2, const float *lse2, int B, int T,
                               int nh, int hd)
{
    cu_op(d, cuda_op_attention_merge(out, lse, out2, lse2, B, T, nh, hd, DT, ST));
}
static void cu_swiglu_forward(dev *d, void *out, const void *gate, const void *up, size_t n)
{
    cu_op(d, cuda_op_swiglu_forward(out, gate, up, n, DT, ST));
}
static void cu_swiglu_backward(dev *d, void *dgate, void *dup, const void *dout, const void *gate, const void *up,
                               size_t n)
{
    cu_op(d, cuda_op_swiglu_backward(dgate, dup, dout, gate, up, n, DT, ST));
}
static void cu_gelu_forward(dev *d, void *out, const void *inp, size_t n)
{
    cu_op(d, cuda_op_gelu_forward(out, inp, n, DT, ST));
}
static void cu_gelu_backward(dev *d, void *dinp, const void *dout, const void *inp, size_t n)
{
    cu_op(d, cuda_op_gelu_backward(dinp, dout, inp, n, DT, ST));
}
static void cu_add(dev *d, void *y, const void *a, const void *b, size_t n)
{
    cu_op(d, cuda_op_add(y, a, b, n, DT, ST));
}
static void cu_xent_rowmax(dev *d, float *rowmax, float *target_logit, const void *logits, const int32_t *targets,
                           int N, int Vl, int vs)
{
    cu_op(d, cuda_op_xent_rowmax(rowmax, target_logit, logits, targets, N, Vl, vs, DT, ST));
}
static void cu_xent_sumexp(dev *d, float *sumexp, const void *logits, const float *rowmax, int N, int Vl)
{
    cu_op(d, cuda_op_xent_sumexp(sumexp, logits, rowmax, N, Vl, DT, ST));
}
/* a device double written by the work before it, read back (waits) */
static double read_sum(dev *d)
{
    double v = 0.0;
    cu_download(d, &v, cu_of(d)->d_sum, sizeof v);
    return d->err ? 0.0 : v;
}
static double cu_xent_loss(dev *d, float *losses, const float *rowmax, const float *sumexp, const float *target_logit,
                           const int32_t *targets, int N)
{
    cu_op(d, cuda_op_xent_loss(losses, cu_of(d)->d_sum, rowmax, sumexp, target_logit, targets, N, ST));
    return read_sum(d);
}
static void cu_xent_backward(dev *d, void *dlogits, const void *logits, const float *rowmax, const float *sumexp,
                             const int32_t *targets, int N, int Vl, int vs, float scale)
{
    cu_op(d, cuda_op_xent_backward(dlogits, logits, rowmax, sumexp, targets, N, Vl, vs, scale, DT, ST));
}

/* ------------------------------------------------------------------ optimizer */
static double cu_sumsq(dev *d, const float *x, size_t n)
{
    cu_op(d, cuda_op_sumsq(cu_of(d)->d_sum, x, n, CUDA_R_32F, ST));
    return read_sum(d);
}
static void cu_scale(dev *d, float *x, float s, size_t n)
{
    cu_op(d, cuda_op_scale(x, s, n, CUDA_R_32F, ST));
}
static void cu_adamw(dev *d, float *master, const float *grad, float *m, float *v, void *param, size_t n, float lr,
                     float beta1, float beta2, float eps, float wd, int step)
{
    /* bf16: the kernel writes the compute copy as it goes; fp32: a copy after */
    void *pb = d->dt == SHARD_DT_BF16 ? param : NULL;
    cu_op(d, cuda_op_adamw(master, grad, m, v, pb, n, lr, beta1, beta2, eps, wd, step, ST));
    if (!pb && param && param != master) cu_copy(d, param, master, n * sizeof(float));
}

static const dev_ops CU_OPS = {
    .abi = DEV_ABI, .name = "cuda", .init = cu_init, .fini = cu_fini, .describe = cu_describe,
    .mem_used = cu_mem_used, .comm_for = cu_comm_for, .alloc = cu_alloc, .release = cu_release, .zero = cu_zero,
    .copy = cu_copy, .upload = cu_upload, .download = cu_download, .sync = cu_sync,
    .embedding_forward = cu_embedding_forward, .embedding_backward = cu_embedding_backward,
    .linear_forward = cu_linear_forward, .linear_backward = cu_linear_backward,
    .bias_forward = cu_bias_forward, .bias_backward = cu_bias_backward,
    .qkv_split = cu_qkv_split, .qkv_merge = cu_qkv_merge,
    .moe_route = cu_moe_route, .moe_route_backward = cu_moe_route_backward, .moe_gather = cu_moe_gather,
    .moe_combine = cu_moe_combine, .moe_combine_backward = cu_moe_combine_backward,
    .moe_scatter_add = cu_moe_scatter_add, .moe_group = cu_moe_group, .moe_prob_sums = cu_moe_prob_sums,
    .rmsnorm_forward = cu_rmsnorm_forward, .rmsnorm_backward = cu_rmsnorm_backward,
    .layernorm_forward = cu_layernorm_forward, .layernorm_backward = cu_layernorm_backward,
    .rope_table = cu_rope_table, .rope_forward = cu_rope_forward, .rope_backward = cu_rope_backward,
    .attention_forward = cu_attention_forward, .attention_backward = cu_attention_backward,
    .attention_merge = cu_attention_merge, .swiglu_forward = cu_swiglu_forward,
    .swiglu_backward = cu_swiglu_backward, .gelu_forward = cu_gelu_forward, .gelu_backward = cu_gelu_backward,
    .add = cu_add, .xent_rowmax = cu_xent_rowmax,
    .xent_sumexp = cu_xent_sumexp, .xent_loss = cu_xent_loss, .xent_backward = cu_xent_backward,
    .sumsq = cu_sumsq, .scale = cu_scale, .adamw = cu_adamw,
    .fp8_reserve = cu_fp8_reserve, .fp8_linear_forward = cu_fp8_linear_forward,
    .fp8_linear_backward = cu_fp8_linear_backward, .fp8_collect = cu_fp8_collect,
    .fp8_scales_changed = cu_fp8_scales_changed,
};

/* The library's one exported symbol (DEV_CUDA_ENTRY; the rest is hidden). */
__attribute__((visibility("default"))) const dev_ops *smp_dev_cuda_ops(void);
const dev_ops *smp_dev_cuda_ops(void)
{
    return &CU_OPS;
}
