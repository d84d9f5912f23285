/* kernels/gemm.cu: the linear layers' GEMMs through cuBLASLt (bf16, fp32, FP8).
 *
 * Row-major to cuBLASLt's column-major: a row-major [R,C] buffer is the
 * column-major C x R matrix, its transpose. So with y = x W^T (x [N,IN],
 * W [OUT,IN], y [N,OUT]):
 *   forward  y^T (OUT x N)   = W (op T on the IN x OUT buffer) . x^T (IN x N, op N)    m=OUT n=N  k=IN
 *   dgrad    dx^T (IN x N)  += W^T (IN x OUT, op N) . dy^T (OUT x N, op N)            m=IN  n=N  k=OUT
 *   wgrad    dW^T (IN x OUT) += x^T (IN x N, op N) . dy (op T on the OUT x N buffer)  m=IN  n=OUT k=N
 * FP8 on Hopper takes only TN (A transposed, B not). The forward is TN as it is;
 * for the backward the operands are transposed into the cuda_gemm's scratch:
 *   dgrad    A = (W^T as [IN,OUT] row-major), op T; B = dy [N,OUT], op N
 *   wgrad    A = (x^T as [IN,N] row-major), op T;   B = (dy^T as [OUT,N]), op N
 * Scales: cuBLASLt computes D = alpha * scale_A * scale_B * (A.B) + beta * C, so
 * the FP8 calls take each operand's dequantization factor 1/scale.
 *
 * Each distinct problem (shape, layouts, dtypes, beta, options) gets its
 * descriptors built and its algorithm chosen once by cublasLtMatmulAlgoGetHeuristic,
 * then kept in a small cache in the cuda_gemm; per call only the scale and amax
 * pointers are set on the cached descriptor. The preference asks for 16-byte
 * alignment only, so a cached algorithm fits any 16-byte aligned pointers. */
#include "cuda_common.cuh"

#include <cublasLt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GEMM_CACHE = 64 };

typedef struct {
    int ta, tb, m, n, k, lda, ldb, ldd;
    int at, bt, dt, compute;
    int beta1, fast_accum, amax, scaled;
} gemm_key;

typedef struct {
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    int used;
} gemm_entry;

enum { SCALE_SLOT = 16 }; /* bytes: the alignment cuBLASLt wants of an FP8 scale's pointer */

struct cuda_gemm {
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_bytes;
    uint8_t *scratch;
    size_t scratch_bytes;
    gemm_entry cache[GEMM_CACHE];
    int nused, evict;
    int amax_d_ok[2]; /* AMAX_D_POINTER with a bf16 [0] / fp32 [1] output: -1 unknown, 0 no, 1 yes */
    float *scales;    /* two 16-byte-aligned device slots for FP8 scales that are not (run_gemm) */
};

static cudaError_t lt_fail(cublasStatus_t st, const char *fn, const char *what)
{
    cudaError_t e;
    switch (st) {
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: e = cudaErrorNotSupported; break;
    case CUBLAS_STATUS_INVALID_VALUE: e = cudaErrorInvalidValue; break;
    case CUBLAS_STATUS_ALLOC_FAILED: e = cudaErrorMemoryAllocation; break;
    case CUBLAS_STATUS_EXECUTION_FAILED: e = cudaErrorLaunchFailure; break;
    case CUBLAS_STATUS_NOT_INITIALIZED: e = cudaErrorInitializationError; break;
    default: e = cudaErrorUnknown; break;
    }
    return smp_cuda_fail(e, fn, "%s: %s (%s)", what, cublasLtGetStatusName(st), cublasLtGetStatusString(st));
}

static void entry_destroy(gemm_entry *en)
{
    if (en->desc) cublasLtMatmulDescDestroy(en->desc);
    if (en->a) cublasLtMatrixLayoutDestroy(en->a);
    if (en->b) cublasLtMatrixLayoutDestroy(en->b);
    if (en->d) cublasLtMatrixLayoutDestroy(en->d);
    memset(en, 0, sizeof *en);
}

/* FP8 GEMMs take row counts in multiples of FP8_ROWS. A call of N rows runs its first
 * N16 = N - N % 16 rows in place and, if N is not a multiple, the last N % 16 rows
 * padded with zero rows in the scratch's tail (a row in, a row out, each up to
 * max(IN, OUT) wide); the weight gradient sums over N rows padded with zero columns. */
enum { FP8_ROWS = 16, SCRATCH_ALIGN = 256 };

static size_t al256(size_t b) { return (b + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN; }
static size_t pad16(int N) { return ((size_t)N + FP8_ROWS - 1) / FP8_ROWS * FP8_ROWS; }

/* the scratch of an FP8 call: wT [IN,OUT], xT [IN,Np], dyT [OUT,Np] (Np = N padded),
 * then the tail's input rows (fp8) and output rows (up to fp32) */
typedef struct {
    uint8_t *wT, *xT, *dyT, *tail_in;
    void *tail_out;
    size_t bytes;
} fp8_scratch;

/* offsets, not pointers, until there is a base: the size is asked for without one */
static fp8_scratch scratch_of(uint8_t *base, int N, int IN, int OUT)
{
    const size_t Np = pad16(N), D = (size_t)(IN > OUT ? IN : OUT);
    const size_t xT = al256((size_t)OUT * IN), dyT = xT + al256(Np * IN), tin = dyT + al256(Np * OUT);
    const size_t tout = tin + al256(FP8_ROWS * D);
    fp8_scratch s = {NULL, NULL, NULL, NULL, NULL, tout + al256(FP8_ROWS * D * sizeof(float))};
    if (base) {
        s.wT = base;
        s.xT = base + xT;
        s.dyT = base + dyT;
        s.tail_in = base + tin;
        s.tail_out = base + tout;
    }
    return s;
}

extern "C" size_t cuda_gemm_fp8_scratch_bytes(int N, int IN, int OUT)
{
    if (N <= 0 || IN <= 0 || OUT <= 0) return 0;
    return scratch_of(NULL, N, IN, OUT).bytes;
}

extern "C" cudaError_t cuda_gemm_create(cuda_gemm **out, size_t workspace_bytes, size_t fp8_scratch_bytes)
{
    SMP_ARG(out, "NULL pointer");
    *out = NULL;
    cuda_gemm *g = (cuda_gemm *)calloc(1, sizeof *g);
    if (!g) return smp_cuda_fail(cudaErrorMemoryAllocation, "cuda_gemm_create", "out of host memory");
    g->amax_d_ok[0] = g->amax_d_ok[1] = -1;
    g->ws_bytes = workspace_bytes ? workspace_bytes : (size_t)32 << 20;
    cudaError_t e = cudaSuccess;
    cublasStatus_t st = cublasLtCreate(&g->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        e = lt_fail(st, "cuda_gemm_create", "cublasLtCreate");
        g->lt = NULL;
        goto fail;
    }
    e = cudaMalloc(&g->ws, g->ws_bytes);
    if (e != cudaSuccess) {
        e = smp_cuda_fail(e, "cuda_gemm_create", "workspace of %zu bytes: %s", g->ws_bytes, cudaGetErrorString(e));
        g->ws = NULL;
        goto fail;
    }
    e = cudaMalloc((void **)&g->scales, 2 * SCALE_SLOT);
    if (e != cudaSuccess) {
        e = smp_cuda_fail(e, "cuda_gemm_create", "scale slots: %s", cudaGetErrorString(e));
        g->scales = NULL;
        goto fail;
    }
    if (fp8_scratch_bytes) {
        e = cudaMalloc((void **)&g->scratch, fp8_scratch_bytes);
        if (e != cudaSuccess) {
            e = smp_cuda_fail(e, "cuda_gemm_create", "fp8 scratch of %zu bytes: %s", fp8_scratch_bytes,
                              cudaGetErrorString(e));
            g->scratch = NULL;
            goto fail;
        }
        g->scratch_bytes = fp8_scratch_bytes;
    }
    *out = g;
    return cudaSuccess;
fail:
    cuda_gemm_free(g);
    return e;
}

extern "C" void cuda_gemm_free(cuda_gemm *g)
{
    if (!g) return;
    for (int i = 0; i < g->nused; i++) entry_destroy(&g->cache[i]);
    if (g->ws) cudaFree(g->ws);
    if (g->scratch) cudaFree(g->scratch);
    if (g->scales) cudaFree(g->scales);
    if (g->lt) cublasLtDestroy(g->lt);
    free(g);
}

/* One GEMM: D (m x n, ldd) = alpha * [a_scale * b_scale] * op(A) op(B) + beta * D,
 * column-major, C = D. a_scale/b_scale/amax_d only for FP8 (NULL otherwise). */
typedef struct {
    cublasOperation_t ta, tb;
    int m, n, k;
    const void *A;
    cudaDataType_t at;
    int lda;
    const void *B;
    cudaDataType_t bt;
    int ldb;
    void *D;
    cudaDataType_t dt;
    int ldd;
    float beta;
    cublasComputeType_t compute;
    const float *a_scale, *b_scale;
    float *amax_d;
    int fast_accum;
} gemm_call;

/* A gemm_call with fp32 compute, no amax and no fast accumulation; a_scale/b_scale
 * for FP8 operands */
static gemm_call gemm_of(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                         cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb, void *D,
                         cudaDataType_t dt, int ldd, float beta, const float *a_scale = NULL,
                         const float *b_scale = NULL)
{
    gemm_call c;
    memset(&c, 0, sizeof c);
    c.ta = ta; c.tb = tb; c.m = m; c.n = n; c.k = k;
    c.A = A; c.at = at; c.lda = lda; c.a_scale = a_scale;
    c.B = B; c.bt = bt; c.ldb = ldb; c.b_scale = b_scale;
    c.D = D; c.dt = dt; c.ldd = ldd;
    c.beta = beta; c.compute = CUBLAS_COMPUTE_32F;
    return c;
}

static int key_eq(const gemm_key *a, const gemm_key *b) { return memcmp(a, b, sizeof *a) == 0; }

static cublasStatus_t set_ptr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void *p)
{
    return cublasLtMatmulDescSetAttribute(desc, attr, &p, sizeof p);
}

static cublasStatus_t set_call_pointers(gemm_entry *en, const gemm_call *c)
{
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (en->key.scaled) {
        st = set_ptr(en->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, c->a_scale);
        if (st == CUBLAS_STATUS_SUCCESS) st = set_ptr(en->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, c->b_scale);
    }
    if (st == CUBLAS_STATUS_SUCCESS && en->key.amax) st = set_ptr(en->desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, c->amax_d);
    return st;
}

/* The cached entry for this call, built (and its algorithm chosen) on first use.
 * On failure returns NULL with *st set. */
static gemm_entry *entry_for(cuda_gemm *g, const gemm_call *c, cublasStatus_t *st, const char **what)
{
    gemm_key key;
    memset(&key, 0, sizeof key);
    key.ta = c->ta; key.tb = c->tb; key.m = c->m; key.n = c->n; key.k = c->k;
    key.lda = c->lda; key.ldb = c->ldb; key.ldd = c->ldd;
    key.at = c->at; key.bt = c->bt; key.dt = c->dt; key.compute = c->compute;
    key.beta1 = c->beta != 0.0f; key.fast_accum = c->fast_accum; key.amax = c->amax_d != NULL;
    key.scaled = c->a_scale != NULL;
    for (int i = 0; i < g->nused; i++)
        if (key_eq(&g->cache[i].key, &key)) return &g->cache[i];

    gemm_entry *en;
    if (g->nused < GEMM_CACHE) {
        en = &g->cache[g->nused++];
    } else { /* full: replace entries round robin */
        en = &g->cache[g->evict];
        g->evict = (g->evict + 1) % GEMM_CACHE;
        entry_destroy(en);
    }
    memset(en, 0, sizeof *en);
    en->key = key;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0;
    const uint32_t align = 16;
    const int32_t ta = c->ta, tb = c->tb;
    const int8_t fast = (int8_t)(c->fast_accum ? 1 : 0);
    *what = "cublasLtMatmulDescCreate";
    if ((*st = cublasLtMatmulDescCreate(&en->desc, c->compute, CUDA_R_32F)) != CUBLAS_STATUS_SUCCESS) goto fail;
    *what = "matmul descriptor attributes";
    if ((*st = cublasLtMatmulDescSetAttribute(en->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatmulDescSetAttribute(en->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) != CUBLAS_STATUS_SUCCESS)
        goto fail;
    if (key.scaled &&
        (*st = cublasLtMatmulDescSetAttribute(en->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast)) != CUBLAS_STATUS_SUCCESS)
        goto fail;
    if ((*st = set_call_pointers(en, c)) != CUBLAS_STATUS_SUCCESS) goto fail;
    *what = "cublasLtMatrixLayoutCreate";
    if ((*st = cublasLtMatrixLayoutCreate(&en->a, c->at, c->ta == CUBLAS_OP_N ? c->m : c->k,
                                          c->ta == CUBLAS_OP_N ? c->k : c->m, c->lda)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatrixLayoutCreate(&en->b, c->bt, c->tb == CUBLAS_OP_N ? c->k : c->n,
                                          c->tb == CUBLAS_OP_N ? c->n : c->k, c->ldb)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatrixLayoutCreate(&en->d, c->dt, c->m, c->n, c->ldd)) != CUBLAS_STATUS_SUCCESS)
        goto fail;
    *what = "matmul preference";
    if ((*st = cublasLtMatmulPreferenceCreate(&pref)) != CUBLAS_STATUS_SUCCESS) goto fail;
    if ((*st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g->ws_bytes,
                                                    sizeof g->ws_bytes)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align,
                                                    sizeof align)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align,
                                                    sizeof align)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align,
                                                    sizeof align)) != CUBLAS_STATUS_SUCCESS ||
        (*st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align,
                                                    sizeof align)) != CUBLAS_STATUS_SUCCESS)
        goto fail;
    *what = "cublasLtMatmulAlgoGetHeuristic";
    memset(&res, 0, sizeof res);
    *st = cublasLtMatmulAlgoGetHeuristic(g->lt, en->desc, en->a, en->b, en->d, en->d, pref, 1, &res, &nres);
    if (*st == CUBLAS_STATUS_SUCCESS && nres == 0) *st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (*st != CUBLAS_STATUS_SUCCESS) goto fail;
    en->algo = res.algo;
    en->used = 1;
    cublasLtMatmulPreferenceDestroy(pref);
    return en;
fail:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    entry_destroy(en); /* stays in the table as an empty key that matches nothing real */
    en->key.m = -1;
    return NULL;
}

/* cuBLASLt's FP8 GEMMs refuse scale pointers that are not 16-byte aligned: at
 * cublasLtMatmul, with CUBLAS_STATUS_NOT_SUPPORTED, after the heuristic accepted the
 * call (seen on an H200, cuBLASLt 13.0, 2026-12-04; the documentation names only the
 * matrices' pointers). The backend keeps its scales in arrays, a float a tensor, so
 * such a scale is first copied, in stream order, into one of the gemm's own slots. */
static cudaError_t align_scales(cuda_gemm *g, gemm_call *c, const char *fn, cudaStream_t stream)
{
    const float **p[2] = {&c->a_scale, &c->b_scale};
    for (int i = 0; i < 2; i++) {
        if (!*p[i] || !((uintptr_t)*p[i] & (SCALE_SLOT - 1))) continue;
        float *slot = (float *)((char *)g->scales + i * SCALE_SLOT);
        cudaError_t e = cudaMemcpyAsync(slot, *p[i], sizeof(float), cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess) return smp_cuda_fail(e, fn, "copying an FP8 scale: %s", cudaGetErrorString(e));
        *p[i] = slot;
    }
    return cudaSuccess;
}

static cudaError_t run_gemm(cuda_gemm *g, const gemm_call *call, const char *fn, cudaStream_t stream,
                            cublasStatus_t *st_out)
{
    gemm_call cc = *call, *c = &cc;
    cudaError_t ae = align_scales(g, c, fn, stream);
    if (ae != cudaSuccess) return ae;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    const char *what = "";
    gemm_entry *en = entry_for(g, c, &st, &what);
    if (st_out) *st_out = st;
    if (!en) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s for m=%d n=%d k=%d types %d,%d->%d", what, c->m, c->n, c->k, (int)c->at,
                 (int)c->bt, (int)c->dt);
        return lt_fail(st, fn, buf);
    }
    if ((st = set_call_pointers(en, c)) != CUBLAS_STATUS_SUCCESS) {
        if (st_out) *st_out = st;
        return lt_fail(st, fn, "scale/amax pointers");
    }
    const float alpha = 1.0f, beta = c->beta;
    st = cublasLtMatmul(g->lt, en->desc, &alpha, c->A, en->a, c->B, en->b, &beta, c->D, en->d, c->D, en->d, &en->algo,
                        g->ws, g->ws_bytes, stream);
    if (st_out) *st_out = st;
    if (st != CUBLAS_STATUS_SUCCESS) {
        char buf[160];
        snprintf(buf, sizeof buf, "cublasLtMatmul m=%d n=%d k=%d types %d,%d->%d", c->m, c->n, c->k, (int)c->at,
                 (int)c->bt, (int)c->dt);
        return lt_fail(st, fn, buf);
    }
    return cudaSuccess;
}

static int gemm_dt_ok(cudaDataType_t in, cudaDataType_t out)
{
    if (in == CUDA_R_32F) return out == CUDA_R_32F;
    if (in == CUDA_R_16BF) return out == CUDA_R_32F || out == CUDA_R_16BF;
    return 0;
}

extern "C" cudaError_t cuda_op_linear_forward(cuda_gemm *g, void *out, cudaDataType_t out_dt, const void *inp,
                                              const void *weight, cudaDataType_t dt, int N, int IN, int OUT,
                                              cudaStream_t stream)
{
    SMP_ARG(g, "NULL cuda_gemm");
    SMP_ARG(N >= 0 && IN > 0 && OUT > 0, "bad shape N=%d IN=%d OUT=%d", N, IN, OUT);
    SMP_ARG(gemm_dt_ok(dt, out_dt), "unsupported dtypes %d -> %d", (int)dt, (int)out_dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && inp && weight, "NULL pointer");
    SMP_ARG(smp_aligned16(out) && smp_aligned16(inp) && smp_aligned16(weight), "pointers must be 16-byte aligned");
    const gemm_call c =
        gemm_of(CUBLAS_OP_T, CUBLAS_OP_N, OUT, N, IN, weight, dt, IN, inp, dt, IN, out, out_dt, OUT, 0.0f);
    return run_gemm(g, &c, "cuda_op_linear_forward", stream, NULL);
}

extern "C" cudaError_t cuda_op_linear_backward(cuda_gemm *g, void *dinp, void *dweight, cudaDataType_t dw_dt,
                                               const void *dout, const void *inp, const void *weight, cudaDataType_t dt,
                                               int N, int IN, int OUT, cudaStream_t stream)
{
    SMP_ARG(g, "NULL cuda_gemm");
    SMP_ARG(N >= 0 && IN > 0 && OUT > 0, "bad shape N=%d IN=%d OUT=%d", N, IN, OUT);
    SMP_ARG(gemm_dt_ok(dt, dt), "unsupported dtype %d", (int)dt);
    SMP_ARG(!dweight || gemm_dt_ok(dt, dw_dt), "unsupported dtypes %d -> dweight %d", (int)dt, (int)dw_dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dout && (!dinp || weight) && (!dweight || inp), "NULL pointer");
    SMP_ARG(smp_aligned16(dout) && smp_aligned16(inp) && smp_aligned16(weight) && smp_aligned16(dinp) &&
                smp_aligned16(dweight),
            "pointers must be 16-byte aligned");
    cudaError_t e = cudaSuccess;
    if (dinp) {
        const gemm_call c =
            gemm_of(CUBLAS_OP_N, CUBLAS_OP_N, IN, N, OUT, weight, dt, IN, dout, dt, OUT, dinp, dt, IN, 1.0f);
        e = run_gemm(g, &c, "cuda_op_linear_backward (dinp)", stream, NULL);
    }
    if (e == cudaSuccess && dweight) {
        const gemm_call c =
            gemm_of(CUBLAS_OP_N, CUBLAS_OP_T, IN, OUT, N, inp, dt, IN, dout, dt, OUT, dweight, dw_dt, IN, 1.0f);
        e = run_gemm(g, &c, "cuda_op_linear_backward (dweight)", stream, NULL);
    }
    return e;
}

#define FP8_SHAPE_CHECK()                                                                                  \
    SMP_ARG(g, "NULL cuda_gemm");                                                                          \
    SMP_ARG(N > 0 && IN > 0 && OUT > 0 && IN % 16 == 0 && OUT % 16 == 0,                                   \
            "FP8 GEMMs need N > 0 and IN, OUT positive multiples of 16 (N=%d IN=%d OUT=%d)", N, IN, OUT);      \
    const size_t need = cuda_gemm_fp8_scratch_bytes(N, IN, OUT);                                          \
    SMP_ARG(g->scratch_bytes >= need, "the cuda_gemm has %zu bytes of fp8 scratch, this call needs %zu",    \
            g->scratch_bytes, need);                                                                       \
    const fp8_scratch sc = scratch_of(g->scratch, N, IN, OUT);                                             \
    const int N16 = N / FP8_ROWS * FP8_ROWS, tail = N - N16

/* rows [N16, N) of src [N, C] (fp8) into the tail's input, padded with zero rows */
static cudaError_t tail_rows_in(const fp8_scratch *sc, const uint8_t *src, int N16, int tail, int C, cudaStream_t st)
{
    cudaError_t e = cudaMemsetAsync(sc->tail_in, 0, (size_t)FP8_ROWS * C, st);
    if (e == cudaSuccess) e = cudaMemcpyAsync(sc->tail_in, src + (size_t)N16 * C, (size_t)tail * C, cudaMemcpyDeviceToDevice, st);
    return e == cudaSuccess ? e : smp_cuda_fail(e, "fp8 GEMM tail", "%s", cudaGetErrorString(e));
}

static size_t dt_bytes(cudaDataType_t dt) { return dt == CUDA_R_32F ? 4 : 2; }

extern "C" cudaError_t cuda_op_linear_forward_fp8(cuda_gemm *g, void *out, cudaDataType_t out_dt, float *out_amax,
                                                  const uint8_t *inp_q, const float *inp_sinv, const uint8_t *w_q,
                                                  const float *w_sinv, int N, int IN, int OUT, int fast_accum,
                                                  cudaStream_t stream)
{
    FP8_SHAPE_CHECK();
    SMP_ARG(out_dt == CUDA_R_16BF || out_dt == CUDA_R_32F, "out dtype %d is not CUDA_R_16BF or CUDA_R_32F", (int)out_dt);
    SMP_ARG(out && inp_q && w_q && inp_sinv && w_sinv, "NULL pointer");
    SMP_ARG(smp_aligned16(out) && smp_aligned16(inp_q) && smp_aligned16(w_q), "pointers must be 16-byte aligned");
    gemm_call c = gemm_of(CUBLAS_OP_T, CUBLAS_OP_N, OUT, N16, IN, w_q, CUDA_R_8F_E4M3, IN, inp_q, CUDA_R_8F_E4M3, IN, out,
                          out_dt, OUT, 0.0f, w_sinv, inp_sinv);
    c.fast_accum = fast_accum ? 1 : 0;
    const int oi = out_dt == CUDA_R_16BF ? 0 : 1;
    cudaError_t e = cudaSuccess;
    if (out_amax && !tail && g->amax_d_ok[oi] != 0) {
        c.amax_d = out_amax;
        cublasStatus_t st;
        e = run_gemm(g, &c, "cuda_op_linear_forward_fp8", stream, &st);
        if (e == cudaSuccess) {
            g->amax_d_ok[oi] = 1;
            return cudaSuccess;
        }
        /* cuBLASLt refuses AMAX_D for this output type: remember, and reduce below */
        if (g->amax_d_ok[oi] == 1 || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)) return e;
        g->amax_d_ok[oi] = 0;
        c.amax_d = NULL;
    }
    if (N16) e = run_gemm(g, &c, "cuda_op_linear_forward_fp8", stream, NULL);
    if (e == cudaSuccess && tail) { /* the last rows through 16 padded ones */
        e = tail_rows_in(&sc, inp_q, N16, tail, IN, stream);
        c.n = FP8_ROWS;
        c.B = sc.tail_in;
        c.D = sc.tail_out;
        if (e == cudaSuccess) e = run_gemm(g, &c, "cuda_op_linear_forward_fp8 (last rows)", stream, NULL);
        const size_t es = dt_bytes(out_dt);
        if (e == cudaSuccess &&
            (e = cudaMemcpyAsync((char *)out + (size_t)N16 * OUT * es, sc.tail_out, (size_t)tail * OUT * es,
                                 cudaMemcpyDeviceToDevice, stream)) != cudaSuccess)
            e = smp_cuda_fail(e, "cuda_op_linear_forward_fp8", "%s", cudaGetErrorString(e));
    }
    if (e != cudaSuccess || !out_amax) return e;
    return cuda_op_amax(out_amax, out, (size_t)N * OUT, out_dt, stream);
}

extern "C" cudaError_t cuda_op_linear_backward_fp8(cuda_gemm *g, void *dinp, cudaDataType_t dinp_dt, void *dweight,
                                                   cudaDataType_t dw_dt, const uint8_t *dout_q, const float *dout_sinv,
                                                   const uint8_t *inp_q, const float *inp_sinv, const uint8_t *w_q,
                                                   const float *w_sinv, int N, int IN, int OUT, cudaStream_t stream)
{
    FP8_SHAPE_CHECK();
    SMP_ARG(!dinp || dinp_dt == CUDA_R_16BF || dinp_dt == CUDA_R_32F, "dinp dtype %d", (int)dinp_dt);
    SMP_ARG(!dweight || dw_dt == CUDA_R_16BF || dw_dt == CUDA_R_32F, "dweight dtype %d", (int)dw_dt);
    SMP_ARG(dout_q && dout_sinv && (!dinp || (w_q && w_sinv)) && (!dweight || (inp_q && inp_sinv)), "NULL pointer");
    SMP_ARG(smp_aligned16(dinp) && smp_aligned16(dweight) && smp_aligned16(dout_q) && smp_aligned16(inp_q) &&
                smp_aligned16(w_q),
            "pointers must be 16-byte aligned");
    const int Np = (int)pad16(N);
    cudaError_t e;
    if (dinp) {
        if ((e = cuda_op_fp8_transpose(sc.wT, OUT, w_q, OUT, IN, stream)) != cudaSuccess) return e;
        gemm_call c = gemm_of(CUBLAS_OP_T, CUBLAS_OP_N, IN, N16, OUT, sc.wT, CUDA_R_8F_E4M3, OUT, dout_q, CUDA_R_8F_E5M2,
                              OUT, dinp, dinp_dt, IN, 1.0f, w_sinv, dout_sinv);
        if (N16 && (e = run_gemm(g, &c, "cuda_op_linear_backward_fp8 (dinp)", stream, NULL)) != cudaSuccess) return e;
        if (tail) { /* the last rows' gradient through 16 padded ones, then added */
            if ((e = tail_rows_in(&sc, dout_q, N16, tail, OUT, stream)) != cudaSuccess) return e;
            c.n = FP8_ROWS;
            c.B = sc.tail_in;
            c.D = sc.tail_out;
            c.beta = 0.0f;
            if ((e = run_gemm(g, &c, "cuda_op_linear_backward_fp8 (dinp, last rows)", stream, NULL)) != cudaSuccess)
                return e;
            void *d = (char *)dinp + (size_t)N16 * IN * dt_bytes(dinp_dt);
            if ((e = cuda_op_add(d, d, sc.tail_out, (size_t)tail * IN, dinp_dt, stream)) != cudaSuccess) return e;
        }
    }
    if (dweight) { /* a sum over the rows: zero columns pad it to Np */
        if ((e = cuda_op_fp8_transpose(sc.xT, Np, inp_q, N, IN, stream)) != cudaSuccess) return e;
        if ((e = cuda_op_fp8_transpose(sc.dyT, Np, dout_q, N, OUT, stream)) != cudaSuccess) return e;
        const gemm_call c = gemm_of(CUBLAS_OP_T, CUBLAS_OP_N, IN, OUT, Np, sc.xT, CUDA_R_8F_E4M3, Np, sc.dyT,
                                    CUDA_R_8F_E5M2, Np, dweight, dw_dt, IN, 1.0f, inp_sinv, dout_sinv);
        if ((e = run_gemm(g, &c, "cuda_op_linear_backward_fp8 (dweight)", stream, NULL)) != cudaSuccess) return e;
    }
    return cudaSuccess;
}
