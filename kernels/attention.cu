/* kernels/attention.cu: causal GQA attention with log-sum-exp, flash style (CUDA):
 * the entry points of kernels/ops_cuda.h. They check the arguments and pick the
 * kernels: the tensor-core ones (attention_mma.cu) for bf16 with hd 32, 64 or 128
 * and 16-byte aligned tensors, the portable fp32 ones (attention_simt.cu) otherwise.
 * attention_common.cuh describes both. */
#include "attention_common.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ATTN_ARGS_CHECK()                                                                                         \
    SMP_ARG(B >= 0 && Tq >= 0 && Tk >= 0 && nh > 0 && nkv > 0 && nh % nkv == 0 && hd > 0 && hd <= 256,          \
            "bad shape B=%d Tq=%d Tk=%d nh=%d nkv=%d hd=%d (nh a multiple of nkv, hd <= 256)", B, Tq, Tk, nh, nkv, \
            hd);                                                                                                  \
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);                                \
    SMP_ARG(B <= 65535 && nh <= 65535, "B=%d or nh=%d exceeds the grid", B, nh);                                \
    SMP_ARG(Tq <= INT_MAX - ATTN_PAD && Tk <= INT_MAX - ATTN_PAD, "Tq=%d or Tk=%d too large", Tq, Tk)

/* the kernels' forms: -1 until the first call reads the environment (docs/TRAINING.md) */
static int bwd_form = -1, fwd_shape = -1;
static const char *const BWD_FORMS[] = {"split", "fused", "fused-8x16", NULL}, *const FWD_SHAPES[] = {"8x16", "4x16", "4x32", NULL};

/* the index of var's value among names (NULL-ended), -1 when it is none of them, 0
 * when var is unset */
static int env_index(const char *var, const char *const *names)
{
    const char *e = getenv(var);
    for (int i = 0; e && names[i]; i++)
        if (strcmp(e, names[i]) == 0) return i;
    return e ? -1 : 0;
}

/* *slot, or (the first time) var's form: the default where it names none
 * (cuda_op_attention_env_error says so to the programs) */
static int choice(int *slot, const char *var, const char *const *names)
{
    int v = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (v < 0) {
        v = env_index(var, names);
        if (v < 0) v = 0;
        __atomic_store_n(slot, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* a form or shape's index in names (n of them), 0 when out of range */
static int in_range(int v, int n) { return v >= 0 && v < n ? v : 0; }
enum { N_BWD_FORMS = sizeof BWD_FORMS / sizeof *BWD_FORMS - 1, N_FWD_SHAPES = sizeof FWD_SHAPES / sizeof *FWD_SHAPES - 1 };

extern "C" int cuda_op_attention_backward_form(void) { return choice(&bwd_form, "SMP_CUDA_ATTN_BWD", BWD_FORMS); }
extern "C" void cuda_op_attention_set_backward_form(int form)
{
    __atomic_store_n(&bwd_form, in_range(form, N_BWD_FORMS), __ATOMIC_RELAXED);
}
extern "C" const char *cuda_op_attention_backward_form_name(int form) { return BWD_FORMS[in_range(form, N_BWD_FORMS)]; }
extern "C" int cuda_op_attention_forward_shape(void) { return choice(&fwd_shape, "SMP_CUDA_ATTN_FWD", FWD_SHAPES); }
extern "C" void cuda_op_attention_set_forward_shape(int shape)
{
    __atomic_store_n(&fwd_shape, in_range(shape, N_FWD_SHAPES), __ATOMIC_RELAXED);
}
extern "C" const char *cuda_op_attention_forward_shape_name(int shape) { return FWD_SHAPES[in_range(shape, N_FWD_SHAPES)]; }

/* NULL, or what is wrong with SMP_CUDA_ATTN_BWD / SMP_CUDA_ATTN_FWD (a value that is
 * none of the names would otherwise fall back to the default unseen) */
extern "C" const char *cuda_op_attention_env_error(void)
{
    static char msg[160];
    const char *const vars[] = {"SMP_CUDA_ATTN_BWD", "SMP_CUDA_ATTN_FWD"};
    const char *const *names[] = {BWD_FORMS, FWD_SHAPES};
    for (int v = 0; v < 2; v++)
        if (env_index(vars[v], names[v]) < 0) {
            int n = snprintf(msg, sizeof msg, "%s=%.40s: not", vars[v], getenv(vars[v]));
            for (int i = 0; names[v][i] && n < (int)sizeof msg; i++) /* every name of its table */
                n += snprintf(msg + n, sizeof msg - (size_t)n, "%s %s", i == 0 ? "" : names[v][i + 1] ? "," : " or", names[v][i]);
            return msg;
        }
    return NULL;
}

extern "C" size_t cuda_op_attention_scratch(int B, int Tq, int Tk, int nh, int hd)
{
    if (B <= 0 || Tq <= 0 || Tk < 0 || nh <= 0 || hd <= 0 || Tq > INT_MAX - ATTN_PAD || Tk > INT_MAX - ATTN_PAD)
        return 16;
    const bool fused = cuda_op_attention_backward_form() != 0 && (hd == 32 || hd == 64 || hd == 128);
    return attn_scratch_layout(B, Tq, Tk, nh, true, fused ? hd : 0).bytes;
}

/* the tensor-core kernels: bf16, hd 32/64/128, every pointer (the scratch too) 16-byte aligned */
static bool use_mma(cudaDataType_t dt, int hd, const void *a, const void *b, const void *c, const void *d,
                    const void *e, const void *f)
{
    if (dt != CUDA_R_16BF || !(hd == 32 || hd == 64 || hd == 128)) return false;
    return smp_aligned16(a) && smp_aligned16(b) && smp_aligned16(c) && smp_aligned16(d) && smp_aligned16(e) &&
           smp_aligned16(f);
}

extern "C" cudaError_t cuda_op_attention_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                                 const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                                                 const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv, int hd,
                                                 int window, void *scratch, cudaDataType_t dt,
                                                 cudaStream_t stream)
{
    ATTN_ARGS_CHECK();
    if (B == 0 || Tq == 0) return cudaSuccess;
    SMP_ARG(out && lse && q && qpos && scratch && (Tk == 0 || (k && v && kpos)), "NULL pointer");
    SMP_ARG(!qdoc == !kdoc, "qdoc and kdoc are both given or both NULL");
    const AttnShape s = {B, Tq, Tk, nh, nkv, hd, window, qpos, kpos, qdoc, kdoc, scratch, 0,
                         cuda_op_attention_forward_shape()};
    if (use_mma(dt, hd, out, q, k, v, scratch, q)) return attn_mma_forward(out, lse, q, k, v, s, stream);
    return attn_simt_forward(out, lse, q, k, v, s, dt, stream);
}

extern "C" cudaError_t cuda_op_attention_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                                  const void *k, const void *v, const void *out, const float *lse,
                                                  const int32_t *qpos, const int32_t *kpos, const int32_t *qdoc,
                                                  const int32_t *kdoc, int B, int Tq, int Tk, int nh, int nkv, int hd,
                                                  int window, void *scratch, cudaDataType_t dt,
                                                  cudaStream_t stream)
{
    ATTN_ARGS_CHECK();
    if (B == 0 || Tq == 0 || Tk == 0) return cudaSuccess;
    SMP_ARG(dq && dk && dv && dout && q && k && v && out && lse && qpos && kpos && scratch, "NULL pointer");
    SMP_ARG(!qdoc == !kdoc, "qdoc and kdoc are both given or both NULL");
    const AttnShape s = {B, Tq, Tk, nh, nkv, hd, window, qpos, kpos, qdoc, kdoc, scratch,
                         cuda_op_attention_backward_form(), 0};
    if (use_mma(dt, hd, dq, dk, dv, dout, q, k) && use_mma(dt, hd, v, out, scratch, q, q, q))
        return attn_mma_backward(dq, dk, dv, dout, q, k, v, out, lse, s, stream);
    return attn_simt_backward(dq, dk, dv, dout, q, k, v, out, lse, s, dt, stream);
}

extern "C" cudaError_t cuda_op_attention_merge(void *out, float *lse, const void *out2, const float *lse2, int B, int T,
                                               int nh, int hd, cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(B >= 0 && T >= 0 && nh > 0 && hd > 0, "bad shape B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
    SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)dt);
    const size_t rows = (size_t)B * T * nh;
    if (rows == 0) return cudaSuccess;
    SMP_ARG(out && lse && out2 && lse2, "NULL pointer");
    return attn_simt_merge(out, lse, out2, lse2, T, nh, hd, rows, dt, stream);
}
