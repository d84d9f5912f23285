/* tests/gpu/parity.c: every CUDA op (kernels/ops_cuda.h) against the C op it
 * mirrors (kernels/ops.h), forward and backward, fp32 and bf16 storage.
 *
 *   smp-gpu-parity [--quick] [--only SUBSTRING]
 *
 * Each check prints one line, "PASS" or "FAIL", the check's name, the relative L2
 * error ||gpu - ref|| / ||ref|| (or the count of differing bytes where the result
 * must be bit-exact) and the tolerance; the last line is "parity: N passed, M
 * failed". Exit status 0 when nothing failed. Without a CUDA device it prints
 * "parity: SKIP: no CUDA device found" and exits 0.
 *
 * Method: inputs are random and fresh for every check; for bf16 storage the inputs
 * are rounded to bf16 first and the C reference gets the same rounded values, so
 * the difference measures the GPU's arithmetic only. Outputs that an op writes are
 * poisoned (0xff bytes: NaN in fp32 and bf16) before the run, so an element left
 * unwritten fails the check; outputs an op accumulates into start from random
 * values, the same on both sides. A CUDA error fails the check that hit it; an
 * error that leaves the device unusable ends the run (with the summary line).
 *
 * --quick: small shapes only (used under the CPU emulator: tools/emu-check).
 * --only S: run only the checks whose group name contains S.
 * SMP_PARITY_MAX_TOKENS=N in the environment leaves out the attention cases with
 * more than N tokens a side (the full set on the emulator, where 4096 take hours). */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "ops.h"
#include "ops_cuda.h"
#include "shard.h"

#define F32 CUDA_R_32F
#define BF16 CUDA_R_16BF

static int quick;
static const char *only;
static cuda_gemm *gemm;

/* ------------------------------------------------------------ bookkeeping */
enum { MAX_ALLOCS = 256 };
static void *dev_allocs[MAX_ALLOCS], *host_allocs[MAX_ALLOCS];
static int n_dev, n_host;
static jmp_buf test_jmp;

static void summary_and_exit(int code)
{
    printf("parity: %d passed, %d failed\n", n_pass, n_fail);
    fflush(stdout);
    exit(code);
}

static void free_all(void)
{
    for (int i = 0; i < n_dev; i++) cudaFree(dev_allocs[i]);
    for (int i = 0; i < n_host; i++) free(host_allocs[i]);
    n_dev = n_host = 0;
}

/* A failed CUDA call: fail the current check, give up on the test (longjmp), or on
 * the whole run when the device is left in an error state. */
static void call_failed(const char *call, cudaError_t e, int line)
{
    printf("FAIL %-58s parity.c:%d %s -> %s: %s\n", test_name, line, call, cudaGetErrorString(e), cuda_op_errmsg());
    n_fail++;
    fflush(stdout);
    cudaError_t s = cudaDeviceSynchronize();
    if (s != cudaSuccess) {
        printf("FAIL %-58s the device is unusable after that (%s); stopping\n", test_name, cudaGetErrorString(s));
        n_fail++;
        summary_and_exit(1);
    }
    (void)cudaGetLastError();
    longjmp(test_jmp, 1);
}
#define CK(call)                                                      \
    do {                                                              \
        cudaError_t e_ = (call);                                      \
        if (e_ != cudaSuccess) call_failed(#call, e_, __LINE__);      \
    } while (0)
/* the GPU side of a check, then the device synchronized: its asynchronous faults
 * surface here */
#define CK_SYNC(call)                  \
    do {                               \
        CK(call);                      \
        CK(cudaDeviceSynchronize());   \
    } while (0)

static void *hmalloc(size_t bytes)
{
    if (n_host == MAX_ALLOCS) { printf("parity: too many host buffers in one test\n"); summary_and_exit(1); }
    void *p = malloc(bytes ? bytes : 1);
    if (!p) { printf("parity: out of host memory (%zu bytes)\n", bytes); summary_and_exit(1); }
    return host_allocs[n_host++] = p;
}
static float *hfloats(size_t n) { return (float *)hmalloc(n * sizeof(float)); }

/* device buffer, filled with 0xff bytes (NaN for fp32 and bf16) */
static void *dmalloc(size_t bytes)
{
    if (n_dev == MAX_ALLOCS) { printf("parity: too many device buffers in one test\n"); summary_and_exit(1); }
    void *p = NULL;
    CK(cudaMalloc(&p, bytes ? bytes : 16));
    dev_allocs[n_dev++] = p;
    CK(cudaMemset(p, 0xff, bytes ? bytes : 16));
    return p;
}
static void poison(void *d, size_t bytes) { CK(cudaMemset(d, 0xff, bytes)); }

static int selected(const char *group) { return !only || strstr(group, only); }

#define TEST_BEGIN(...)                                                  \
    snprintf(test_name, sizeof test_name, __VA_ARGS__);                  \
    if (setjmp(test_jmp)) {                                              \
        free_all();                                                      \
        return;                                                          \
    }
#define TEST_END() free_all()

/* ------------------------------------------------------------ data */
static void round_to(float *x, size_t n, cudaDataType_t dt)
{
    if (dt == BF16)
        for (size_t i = 0; i < n; i++) x[i] = shard_bf16_to_f32(shard_f32_to_bf16(x[i]));
}
/* random values rounded to dt (F32: as drawn), in x or in a new host buffer */
static void fill_normal(float *x, size_t n, float sd, cudaDataType_t dt)
{
    for (size_t i = 0; i < n; i++) x[i] = sd * rng_normal();
    round_to(x, n, dt);
}
static float *randn(size_t n, float sd, cudaDataType_t dt)
{
    float *x = hfloats(n);
    fill_normal(x, n, sd, dt);
    return x;
}
static float *randu(size_t n, float lo, float hi, cudaDataType_t dt)
{
    float *x = hfloats(n);
    for (size_t i = 0; i < n; i++) x[i] = rng_uniform(lo, hi);
    round_to(x, n, dt);
    return x;
}
static float *copy_of(const float *x, size_t n)
{
    float *y = hfloats(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}
static size_t esize(cudaDataType_t dt) { return dt == F32 ? 4 : 2; }
static const char *dtname(cudaDataType_t dt) { return dt == F32 ? "f32" : "bf16"; }

/* n values between host floats and a device buffer of dt (bf16: converted in a
 * host buffer of bf16 values); kind says which way */
static void transfer(void *dst, const void *src, size_t n, cudaDataType_t dt, enum cudaMemcpyKind kind)
{
    if (dt == F32) {
        CK(cudaMemcpy(dst, src, n * 4, kind));
        return;
    }
    const int up = kind == cudaMemcpyHostToDevice;
    uint16_t *t = (uint16_t *)malloc(n * 2 + 2);
    if (!t) { printf("parity: out of host memory\n"); summary_and_exit(1); }
    if (up)
        for (size_t i = 0; i < n; i++) t[i] = shard_f32_to_bf16(((const float *)src)[i]);
    cudaError_t e = cudaMemcpy(up ? dst : t, up ? t : src, n * 2, kind);
    if (e == cudaSuccess && !up)
        for (size_t i = 0; i < n; i++) ((float *)dst)[i] = shard_bf16_to_f32(t[i]);
    free(t);
    CK(e);
}
static void upload(void *d, const float *x, size_t n, cudaDataType_t dt) { transfer(d, x, n, dt, cudaMemcpyHostToDevice); }
static void download(float *x, const void *d, size_t n, cudaDataType_t dt) { transfer(x, d, n, dt, cudaMemcpyDeviceToHost); }
static void *to_dev(const float *x, size_t n, cudaDataType_t dt)
{
    void *d = dmalloc(n * esize(dt));
    upload(d, x, n, dt);
    return d;
}
/* x (NULL: nothing) in a new device buffer of n + 8 values of dt, off bytes into it
 * (off the 16-byte grid where off is not a multiple of 16) */
static char *to_dev_off(const float *x, size_t n, cudaDataType_t dt, size_t off)
{
    char *d = (char *)dmalloc((n + 8) * esize(dt)) + off;
    if (x) upload(d, x, n, dt);
    return d;
}
static float *from_dev(const void *d, size_t n, cudaDataType_t dt)
{
    float *x = hfloats(n);
    download(x, d, n, dt);
    return x;
}
/* bytes from the host in a new device buffer */
static void *to_dev_bytes(const void *x, size_t bytes)
{
    void *d = dmalloc(bytes);
    CK(cudaMemcpy(d, x, bytes, cudaMemcpyHostToDevice));
    return d;
}
static int32_t *to_dev_i32(const int32_t *x, size_t n) { return (int32_t *)to_dev_bytes(x, n * 4); }
static float *dev_scalar(float v) { return (float *)to_dev_bytes(&v, 4); }
/* v at float k of a fresh buffer: a scale that is not 16-byte aligned, as the CUDA
 * backend's are (one array, a float a tensor; cuBLASLt's FP8 GEMMs refuse such) */
static float *dev_scalar_at(float v, int k)
{
    float h[16] = {0};
    h[k] = v;
    return (float *)to_dev_bytes(h, sizeof h) + k;
}

/* ------------------------------------------------------------ comparison */
/* one check's line (NaN fails) */
static void report(const char *what, double err, double tol) { check_line(err <= tol, 72, what, err, tol, ""); }
static void compare(const char *what, const float *got, const float *ref, size_t n, double tol)
{
    report(what, rel_err(got, ref, n), tol);
}
/* download dev (n elements of dt) and compare with ref */
static void compare_dev(const char *what, const void *dev, cudaDataType_t dt, const float *ref, size_t n, double tol)
{
    float *got = from_dev(dev, n, dt);
    compare(what, got, ref, n, tol);
}
static double tol_of(cudaDataType_t dt) { return dt == F32 ? 1e-5 : 1e-2; }

/* ============================================================ embedding */
static void test_embedding(cudaDataType_t dt, int N, int H, int vs, int vl)
{
    TEST_BEGIN("embedding %s N=%d H=%d shard=[%d,+%d)", dtname(dt), N, H, vs, vl);
    int32_t *tok = (int32_t *)hmalloc((size_t)N * 4);
    for (int i = 0; i < N; i++) tok[i] = (int32_t)(rng_u64() % (uint64_t)(vs + vl + 20));
    float *wte = randn((size_t)vl * H, 1.0f, dt), *out_ref = hfloats((size_t)N * H);
    op_embedding_forward(out_ref, tok, wte, N, H, vs, vl);
    int32_t *d_tok = to_dev_i32(tok, N);
    void *d_wte = to_dev(wte, (size_t)vl * H, dt), *d_out = dmalloc((size_t)N * H * esize(dt));
    CK_SYNC(cuda_op_embedding_forward(d_out, d_tok, d_wte, N, H, vs, vl, dt, 0));
    compare_dev("fwd out", d_out, dt, out_ref, (size_t)N * H, 0.0);

    float *dout = randn((size_t)N * H, 1.0f, dt), *dwte = randn((size_t)vl * H, 1.0f, F32);
    void *d_dout = to_dev(dout, (size_t)N * H, dt);
    float *d_dwte = (float *)to_dev(dwte, (size_t)vl * H, F32);
    op_embedding_backward(dwte, dout, tok, N, H, vs, vl);
    CK_SYNC(cuda_op_embedding_backward(d_dwte, d_dout, d_tok, N, H, vs, vl, dt, 0));
    compare_dev("bwd dwte", d_dwte, F32, dwte, (size_t)vl * H, 1e-6);
    TEST_END();
}

/* ============================================================ bias */
/* offset: the tensors off the 16-byte grid (by one element) */
static void test_bias(cudaDataType_t dt, int N, int C, int offset)
{
    TEST_BEGIN("bias %s N=%d C=%d%s", dtname(dt), N, C, offset ? " unaligned" : "");
    const size_t n = (size_t)N * C, off = (size_t)offset * esize(dt);
    float *x = randn(n, 1.0f, dt), *b = randn(C, 1.0f, dt);
    char *d_x = to_dev_off(x, n, dt, off), *d_b = to_dev_off(b, C, dt, off);
    op_bias_forward(x, b, N, C);
    CK_SYNC(cuda_op_bias_forward(d_x, d_b, N, C, dt, 0));
    compare_dev("fwd out (in place)", d_x, dt, x, n, dt == F32 ? 0.0 : 1e-2);

    float *g = randn(n, 1.0f, dt), *db0 = randn(C, 1.0f, F32), *db = copy_of(db0, C);
    char *d_g = to_dev_off(g, n, dt, off);
    float *d_db = (float *)to_dev(db0, C, F32), *d_db2 = (float *)to_dev(db0, C, F32);
    op_bias_backward(db, g, N, C);
    CK_SYNC(cuda_op_bias_backward(d_db, d_g, N, C, dt, 0));
    compare_dev("bwd dbias (+=)", d_db, F32, db, C, 1e-5);
    /* no atomics: a second run gives the same bits */
    CK_SYNC(cuda_op_bias_backward(d_db2, d_g, N, C, dt, 0));
    float *r1 = from_dev(d_db, C, F32), *r2 = from_dev(d_db2, C, F32);
    size_t bad = 0;
    for (int j = 0; j < C; j++) bad += memcmp(&r1[j], &r2[j], 4) != 0;
    report("bwd dbias run to run (values differing)", (double)bad, 0.0);
    TEST_END();
}

/* ============================================================ qkv split / merge */
/* a permutation: exact in both dtypes. offset: the tensors off the 16-byte grid */
static void test_qkv(cudaDataType_t dt, int N, int nh, int hd, int offset)
{
    TEST_BEGIN("qkv %s N=%d nh=%d hd=%d%s", dtname(dt), N, nh, hd, offset ? " unaligned" : "");
    const size_t n = (size_t)N * nh * hd, off = (size_t)offset * esize(dt);
    float *x = randn(3 * n, 1.0f, dt), *p[3], *g[3], *dx = hfloats(3 * n);
    char *d_x = to_dev_off(x, 3 * n, dt, off), *d_p[3], *d_g[3], *d_dx = to_dev_off(NULL, 3 * n, dt, off);
    for (int i = 0; i < 3; i++) {
        p[i] = hfloats(n), g[i] = randn(n, 1.0f, dt);
        d_p[i] = to_dev_off(NULL, n, dt, off), d_g[i] = to_dev_off(g[i], n, dt, off);
    }
    op_qkv_split(p[0], p[1], p[2], x, N, nh, hd);
    CK_SYNC(cuda_op_qkv_split(d_p[0], d_p[1], d_p[2], d_x, N, nh, hd, dt, 0));
    compare_dev("split q", d_p[0], dt, p[0], n, 0.0);
    compare_dev("split k", d_p[1], dt, p[1], n, 0.0);
    compare_dev("split v", d_p[2], dt, p[2], n, 0.0);

    op_qkv_merge(dx, g[0], g[1], g[2], N, nh, hd);
    CK_SYNC(cuda_op_qkv_merge(d_dx, d_g[0], d_g[1], d_g[2], N, nh, hd, dt, 0));
    compare_dev("merge dqkv", d_dx, dt, dx, 3 * n, 0.0);
    TEST_END();
}

/* ============================================================ mixture of experts */
/* n int32 values on the device against ref: the count that differ */
static void compare_dev_i32(const char *what, const int32_t *d, const int32_t *ref, size_t n)
{
    int32_t *got = (int32_t *)hmalloc(n * 4);
    CK(cudaMemcpy(got, d, n * 4, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += got[i] != ref[i];
    report(what, (double)bad, 0.0);
}
/* a random permutation of 0..n-1 (Fisher-Yates) */
static int32_t *rand_perm(size_t n)
{
    int32_t *p = (int32_t *)hmalloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)i;
    for (size_t i = n; i > 1; i--) {
        const size_t j = (size_t)(rng_u64() % i);
        const int32_t t = p[i - 1];
        p[i - 1] = p[j], p[j] = t;
    }
    return p;
}

/* routing: the top k must be the same experts, ties included (the lower expert first;
 * ties: logits on a grid of 0.5, so that many tie exactly); the backward from the C
 * side's probs and idx */
static void test_moe_route(cudaDataType_t dt, int N, int E, int k, int renorm, int ties)
{
    TEST_BEGIN("moe route %s N=%d E=%d k=%d renorm=%d%s", dtname(dt), N, E, k, renorm, ties ? " ties" : "");
    const size_t ne = (size_t)N * E, nk = (size_t)N * k;
    float *z = randn(ne, 2.0f, dt), *p = hfloats(ne), *w = hfloats(nk), *dz = hfloats(ne);
    for (size_t i = 0; ties && i < ne; i++) z[i] = roundf(2.0f * z[i]) / 2.0f;
    int32_t *ix = (int32_t *)hmalloc(nk * 4);
    op_moe_route(p, ix, w, z, N, E, k, renorm);
    void *d_z = to_dev(z, ne, dt);
    float *d_p = (float *)dmalloc(ne * 4), *d_w = (float *)dmalloc(nk * 4);
    int32_t *d_ix = (int32_t *)dmalloc(nk * 4);
    CK_SYNC(cuda_op_moe_route(d_p, d_ix, d_w, d_z, N, E, k, renorm, dt, 0));
    compare_dev("fwd probs", d_p, F32, p, ne, 1e-5);
    compare_dev_i32("fwd idx (experts differing)", d_ix, ix, nk);
    compare_dev("fwd wts", d_w, F32, w, nk, 1e-5);

    float *gw = randn(nk, 1.0f, F32), *gp = randn(ne, 1.0f, F32);
    float *d_gw = (float *)to_dev(gw, nk, F32), *d_gp = (float *)to_dev(gp, ne, F32);
    void *d_dz = dmalloc(ne * esize(dt));
    CK(cudaMemcpy(d_p, p, ne * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ix, ix, nk * 4, cudaMemcpyHostToDevice));
    for (int with_gp = 1; with_gp >= 0; with_gp--) {
        op_moe_route_backward(dz, gw, with_gp ? gp : NULL, p, ix, N, E, k, renorm);
        poison(d_dz, ne * esize(dt));
        CK_SYNC(cuda_op_moe_route_backward(d_dz, d_gw, with_gp ? d_gp : NULL, d_p, d_ix, N, E, k, renorm, dt, 0));
        compare_dev(with_gp ? "bwd dlogits" : "bwd dlogits (dprobs NULL)", d_dz, dt, dz, ne, tol_of(dt));
    }
    TEST_END();
}

/* gather (exact), combine and its backward, scatter_add; slot a random permutation */
static void test_moe_rows(cudaDataType_t dt, int N, int k, int H)
{
    TEST_BEGIN("moe rows %s N=%d k=%d H=%d", dtname(dt), N, k, H);
    const size_t S = (size_t)N * k, nt = (size_t)N * H, ns = S * H;
    int32_t *slot = rand_perm(S), *rows = (int32_t *)hmalloc(S * 4);
    for (size_t i = 0; i < S; i++) rows[i] = (int32_t)(rng_u64() % (uint64_t)N);
    float *x = randn(nt, 1.0f, dt), *xs = hfloats(ns);
    op_moe_gather(xs, x, rows, (int)S, H);
    int32_t *d_slot = to_dev_i32(slot, S), *d_rows = to_dev_i32(rows, S);
    void *d_x = to_dev(x, nt, dt), *d_xs = dmalloc(ns * esize(dt));
    CK_SYNC(cuda_op_moe_gather(d_xs, d_x, d_rows, (int)S, H, dt, 0));
    compare_dev("gather", d_xs, dt, xs, ns, 0.0);

    float *ys = randn(ns, 1.0f, dt), *w = randn(S, 0.5f, F32), *out = hfloats(nt);
    op_moe_combine(out, ys, w, slot, N, k, H);
    void *d_ys = to_dev(ys, ns, dt), *d_out = dmalloc(nt * esize(dt));
    float *d_w = (float *)to_dev(w, S, F32);
    CK_SYNC(cuda_op_moe_combine(d_out, d_ys, d_w, d_slot, N, k, H, dt, 0));
    compare_dev("combine", d_out, dt, out, nt, tol_of(dt));

    float *g = randn(nt, 1.0f, dt), *dys = hfloats(ns), *dw = hfloats(S);
    op_moe_combine_backward(dys, dw, g, ys, w, slot, N, k, H);
    void *d_g = to_dev(g, nt, dt), *d_dys = dmalloc(ns * esize(dt));
    float *d_dw = (float *)dmalloc(S * 4);
    CK_SYNC(cuda_op_moe_combine_backward(d_dys, d_dw, d_g, d_ys, d_w, d_slot, N, k, H, dt, 0));
    compare_dev("combine bwd dys", d_dys, dt, dys, ns, tol_of(dt));
    compare_dev("combine bwd dwts", d_dw, F32, dw, S, 1e-5);

    float *dxs = randn(ns, 1.0f, dt), *dx = randn(nt, 1.0f, dt);
    void *d_dxs = to_dev(dxs, ns, dt), *d_dx = to_dev(dx, nt, dt);
    op_moe_scatter_add(dx, dxs, slot, N, k, H);
    CK_SYNC(cuda_op_moe_scatter_add(d_dx, d_dxs, d_slot, N, k, H, dt, 0));
    compare_dev("scatter_add (+=)", d_dx, dt, dx, nt, tol_of(dt));
    TEST_END();
}

/* the grouping by expert and the probability sums: the same bits as the C ops. skew:
 * every token's first choice expert 0 (one group of N rows, across chunks) */
static void test_moe_group(int N, int k, int E, int skew)
{
    TEST_BEGIN("moe group N=%d k=%d E=%d%s", N, k, E, skew ? " skewed" : "");
    const size_t S = (size_t)N * k;
    int32_t *idx = (int32_t *)hmalloc(S * 4 + 4), *off = (int32_t *)hmalloc((size_t)(E + 1) * 4);
    int32_t *rows = (int32_t *)hmalloc(S * 4 + 4), *slot = (int32_t *)hmalloc(S * 4 + 4);
    for (size_t p = 0; p < S; p++) /* repeats allowed: the sort must not care */
        idx[p] = skew && p % k == 0 ? 0 : (int32_t)(rng_u64() % (uint64_t)E);
    op_moe_group(off, rows, slot, idx, N, k, E);
    int32_t *d_idx = to_dev_i32(idx, S), *d_off = (int32_t *)dmalloc((size_t)(E + 1) * 4);
    int32_t *d_rows = (int32_t *)dmalloc(S * 4 + 4), *d_slot = (int32_t *)dmalloc(S * 4 + 4);
    int32_t *d_scr = (int32_t *)dmalloc(cuda_op_moe_group_scratch(N, k, E));
    CK_SYNC(cuda_op_moe_group(d_off, d_rows, d_slot, d_scr, d_idx, N, k, E, 0));
    int32_t *g = (int32_t *)hmalloc(S * 4 + (size_t)(E + 1) * 4 + 4);
    CK(cudaMemcpy(g, d_off, (size_t)(E + 1) * 4, cudaMemcpyDeviceToHost));
    report("off (bits)", memcmp(g, off, (size_t)(E + 1) * 4) ? INFINITY : 0.0, 0.0);
    CK(cudaMemcpy(g, d_rows, S * 4, cudaMemcpyDeviceToHost));
    report("rows (bits)", memcmp(g, rows, S * 4) ? INFINITY : 0.0, 0.0);
    CK(cudaMemcpy(g, d_slot, S * 4, cudaMemcpyDeviceToHost));
    report("slot (bits)", memcmp(g, slot, S * 4) ? INFINITY : 0.0, 0.0);

    float *probs = randn((size_t)N * E, 1.0f, F32);
    double *sums = (double *)hmalloc((size_t)E * 8), *gs = (double *)hmalloc((size_t)E * 8);
    op_moe_prob_sums(sums, probs, N, E);
    double *d_sums = (double *)dmalloc((size_t)E * 8);
    float *d_probs = (float *)to_dev(probs, (size_t)N * E, F32);
    CK_SYNC(cuda_op_moe_prob_sums(d_sums, d_probs, N, E, 0));
    CK(cudaMemcpy(gs, d_sums, (size_t)E * 8, cudaMemcpyDeviceToHost));
    report("prob sums (bits)", memcmp(gs, sums, (size_t)E * 8) ? INFINITY : 0.0, 0.0);
    TEST_END();
}

/* ============================================================ rmsnorm */
static void test_rmsnorm(cudaDataType_t dt, int N, int H)
{
    TEST_BEGIN("rmsnorm %s N=%d H=%d", dtname(dt), N, H);
    const size_t n = (size_t)N * H;
    const float eps = 1e-5f;
    float *x = randn(n, 1.0f, dt), *w = randu(H, 0.5f, 1.5f, dt), *out = hfloats(n), *rstd = hfloats(N);
    op_rmsnorm_forward(out, rstd, x, w, N, H, eps);
    void *d_x = to_dev(x, n, dt), *d_w = to_dev(w, H, dt), *d_out = dmalloc(n * esize(dt));
    float *d_rstd = (float *)dmalloc((size_t)N * 4);
    CK_SYNC(cuda_op_rmsnorm_forward(d_out, d_rstd, d_x, d_w, N, H, eps, dt, 0));
    compare_dev("fwd out", d_out, dt, out, n, tol_of(dt));
    compare_dev("fwd rstd", d_rstd, F32, rstd, N, 1e-5);

    float *g = randn(n, 1.0f, dt), *dx = randn(n, 1.0f, dt), *dw = randn(H, 1.0f, F32);
    void *d_g = to_dev(g, n, dt), *d_dx = to_dev(dx, n, dt);
    float *d_dw = (float *)to_dev(dw, H, F32);
    CK(cudaMemcpy(d_rstd, rstd, (size_t)N * 4, cudaMemcpyHostToDevice)); /* the reference's rstd */
    op_rmsnorm_backward(dx, dw, g, x, w, rstd, N, H);
    CK_SYNC(cuda_op_rmsnorm_backward(d_dx, d_dw, d_g, d_x, d_w, d_rstd, N, H, dt, 0));
    compare_dev("bwd dinp", d_dx, dt, dx, n, tol_of(dt));
    compare_dev("bwd dweight", d_dw, F32, dw, H, 1e-5);
    TEST_END();
}

/* ============================================================ layernorm */
/* shift: the rows' common offset (LayerNorm removes it; the variance is taken about
 * the mean). with_bias 0: bias NULL. */
static void test_layernorm(cudaDataType_t dt, int N, int H, float shift, int with_bias)
{
    TEST_BEGIN("layernorm %s N=%d H=%d shift=%g%s", dtname(dt), N, H, shift, with_bias ? "" : " no bias");
    const size_t n = (size_t)N * H;
    const float eps = 1e-5f;
    float *x = randn(n, 1.0f, F32), *w = randu(H, 0.5f, 1.5f, dt), *b = with_bias ? randn(H, 1.0f, dt) : NULL;
    for (size_t i = 0; i < n; i++) x[i] += shift;
    round_to(x, n, dt);
    float *out = hfloats(n), *mean = hfloats(N), *rstd = hfloats(N);
    op_layernorm_forward(out, mean, rstd, x, w, b, N, H, eps);
    void *d_x = to_dev(x, n, dt), *d_w = to_dev(w, H, dt), *d_b = b ? to_dev(b, H, dt) : NULL;
    void *d_out = dmalloc(n * esize(dt));
    float *d_mean = (float *)dmalloc((size_t)N * 4), *d_rstd = (float *)dmalloc((size_t)N * 4);
    CK_SYNC(cuda_op_layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, H, eps, dt, 0));
    compare_dev("fwd out", d_out, dt, out, n, tol_of(dt));
    compare_dev("fwd mean", d_mean, F32, mean, N, 1e-5);
    compare_dev("fwd rstd", d_rstd, F32, rstd, N, 1e-5);

    float *g = randn(n, 1.0f, dt), *dx = randn(n, 1.0f, dt), *dw = randn(H, 1.0f, F32), *db = randn(H, 1.0f, F32);
    void *d_g = to_dev(g, n, dt), *d_dx = to_dev(dx, n, dt);
    float *d_dw = (float *)to_dev(dw, H, F32), *d_db = (float *)to_dev(db, H, F32);
    CK(cudaMemcpy(d_mean, mean, (size_t)N * 4, cudaMemcpyHostToDevice)); /* the reference's statistics */
    CK(cudaMemcpy(d_rstd, rstd, (size_t)N * 4, cudaMemcpyHostToDevice));
    op_layernorm_backward(dx, dw, db, g, x, w, mean, rstd, N, H);
    CK_SYNC(cuda_op_layernorm_backward(d_dx, d_dw, d_db, d_g, d_x, d_w, d_mean, d_rstd, N, H, dt, 0));
    compare_dev("bwd dinp (+=)", d_dx, dt, dx, n, tol_of(dt));
    compare_dev("bwd dweight (+=)", d_dw, F32, dw, H, 1e-5);
    compare_dev("bwd dbias (+=)", d_db, F32, db, H, 1e-5);
    /* NULL skips a gradient: dinp alone, then the parameter gradients alone */
    op_layernorm_backward(dx, NULL, NULL, g, x, w, mean, rstd, N, H);
    CK_SYNC(cuda_op_layernorm_backward(d_dx, NULL, NULL, d_g, d_x, d_w, d_mean, d_rstd, N, H, dt, 0));
    compare_dev("bwd dinp alone", d_dx, dt, dx, n, tol_of(dt));
    op_layernorm_backward(NULL, dw, db, g, x, w, mean, rstd, N, H);
    CK_SYNC(cuda_op_layernorm_backward(NULL, d_dw, d_db, d_g, d_x, d_w, d_mean, d_rstd, N, H, dt, 0));
    compare_dev("bwd dweight alone", d_dw, F32, dw, H, 1e-5);
    compare_dev("bwd dbias alone", d_db, F32, db, H, 1e-5);
    TEST_END();
}

/* ============================================================ rope */
/* rd: the rotary dim (rd < hd: a partial rotary, GPT-NeoX's; the other dims must come
 * back untouched, bit for bit) */
static void test_rope(cudaDataType_t dt, int B, int T, int nh, int hd, int rd, int far)
{
    TEST_BEGIN("rope %s B=%d T=%d nh=%d hd=%d rd=%d%s", dtname(dt), B, T, nh, hd, rd, far ? " far positions" : "");
    /* llama3's frequencies, or (near positions) YaRN's, whose tables are scaled */
    const op_rope_params l3 = {.theta = 500000.0f, .type = OP_ROPE_LLAMA3, .factor = 8.0f, .low_freq_factor = 1.0f,
                               .high_freq_factor = 4.0f, .original_max_pos = 8192.0f},
                         yarn = {.theta = 1e6f, .type = OP_ROPE_YARN, .factor = 4.0f, .original_max_pos = 4096.0f};
    const op_rope_params p = far ? l3 : yarn;
    float *inv = hfloats(rd / 2);
    op_rope_inv_freq(inv, rd, &p);
    int32_t *pos = (int32_t *)hmalloc((size_t)T * 4);
    for (int t = 0; t < T; t++) pos[t] = far ? 100000 + 3 * t + (t > T / 2 ? 5000 : 0) : t;
    float *cs = hfloats((size_t)T * rd), *sn = hfloats((size_t)T * rd);
    op_rope_table(cs, sn, pos, T, inv, rd, op_rope_scale(&p));
    float *d_inv = (float *)to_dev(inv, rd / 2, F32);
    int32_t *d_pos = to_dev_i32(pos, T);
    float *d_cs = (float *)dmalloc((size_t)T * rd * 4), *d_sn = (float *)dmalloc((size_t)T * rd * 4);
    CK_SYNC(cuda_op_rope_table(d_cs, d_sn, d_pos, T, d_inv, rd, op_rope_scale(&p), 0));
    compare_dev("table cos", d_cs, F32, cs, (size_t)T * rd, 1e-6);
    compare_dev("table sin", d_sn, F32, sn, (size_t)T * rd, 1e-6);
    CK(cudaMemcpy(d_cs, cs, (size_t)T * rd * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_sn, sn, (size_t)T * rd * 4, cudaMemcpyHostToDevice));

    const size_t n = (size_t)B * T * nh * hd;
    float *x = randn(n, 1.0f, dt), *x0 = copy_of(x, n);
    void *d_x = to_dev(x, n, dt);
    op_rope_forward(x, cs, sn, B, T, nh, hd, rd);
    CK_SYNC(cuda_op_rope_forward(d_x, d_cs, d_sn, B, T, nh, hd, rd, dt, 0));
    compare_dev("fwd", d_x, dt, x, n, tol_of(dt));
    float *got = from_dev(d_x, n, dt);
    size_t moved = 0;
    for (size_t i = 0; i < n; i++) moved += (int)(i % (size_t)hd) >= rd && memcmp(&got[i], &x0[i], 4) != 0;
    report("fwd dims past rd untouched (values differing)", (double)moved, 0.0);
    fill_normal(x, n, 1.0f, dt);
    upload(d_x, x, n, dt);
    op_rope_backward(x, cs, sn, B, T, nh, hd, rd);
    CK_SYNC(cuda_op_rope_backward(d_x, d_cs, d_sn, B, T, nh, hd, rd, dt, 0));
    compare_dev("bwd", d_x, dt, x, n, tol_of(dt));
    TEST_END();
}

/* ============================================================ attention */
enum { POS_CAUSAL, POS_LATER_Q, POS_ZIGZAG, POS_FUTURE, POS_RANDOM };
static const char *posname[] = {"causal", "q-after-kv", "zigzag", "kv-in-future", "random"};

/* packed documents: none; random lengths (about 8 per sequence, fewer in the second);
 * boundaries on the tile edges (every 64 positions, 32 in the second sequence);
 * one-token documents (with some of two tokens in the first sequence) */
enum { DOC_NONE, DOC_RANDOM, DOC_TILE_EDGE, DOC_ONE_TOKEN };
static const char *docname[] = {"", " docs-random", " docs-on-tile-edges", " docs-one-token"};

typedef struct {
    int B, Tq, Tk, nh, nkv, hd, window, pos, docs;
} attn_case;

static void make_positions(const attn_case *c, int32_t *qpos, int32_t *kpos)
{
    switch (c->pos) {
    case POS_CAUSAL:
    default:
        for (int i = 0; i < c->Tq; i++) qpos[i] = i;
        for (int j = 0; j < c->Tk; j++) kpos[j] = j;
        break;
    case POS_LATER_Q: /* a ring step: the q block sits after (and overlapping) the kv block */
        for (int j = 0; j < c->Tk; j++) kpos[j] = j;
        for (int i = 0; i < c->Tq; i++) qpos[i] = c->Tk - c->Tq + i;
        break;
    case POS_ZIGZAG: { /* context parallel, 2 ranks: rank 0 holds chunks 0 and 3 of 4 */
        const int h = c->Tq / 2, ch = c->Tq - h;
        for (int i = 0; i < c->Tq; i++) qpos[i] = i < h ? i : 3 * ch + (i - h);
        for (int j = 0; j < c->Tk; j++) kpos[j] = j < c->Tk / 2 ? j : 3 * (c->Tk - c->Tk / 2) + (j - c->Tk / 2);
        break;
    }
    case POS_FUTURE: /* every key after every query: nothing visible */
        for (int i = 0; i < c->Tq; i++) qpos[i] = i;
        for (int j = 0; j < c->Tk; j++) kpos[j] = c->Tq + 7 + j;
        break;
    case POS_RANDOM:
        for (int i = 0; i < c->Tq; i++) qpos[i] = (int32_t)(rng_u64() % (uint64_t)(2 * c->Tq + 1));
        for (int j = 0; j < c->Tk; j++) kpos[j] = (int32_t)(rng_u64() % (uint64_t)(2 * c->Tq + 1));
        break;
    }
}

/* Does a document of sequence b begin at position p? */
static int doc_begins(const attn_case *c, int b, int p)
{
    switch (c->docs) {
    case DOC_RANDOM: return rng_u64() % (uint64_t)(4 + c->Tq / (8 - 3 * (b & 1))) == 0;
    case DOC_TILE_EDGE: return p % (b & 1 ? 32 : 64) == 0;
    default: return b & 1 || p % 4 != 3;
    }
}

/* qdoc [B][Tq], kdoc [B][Tk]: per sequence, the first position of each token's
 * document (positions are >= 0) */
static void make_docs(const attn_case *c, const int32_t *qpos, const int32_t *kpos, int32_t *qdoc, int32_t *kdoc)
{
    int32_t P = 1;
    for (int i = 0; i < c->Tq; i++) P = qpos[i] >= P ? qpos[i] + 1 : P;
    for (int j = 0; j < c->Tk; j++) P = kpos[j] >= P ? kpos[j] + 1 : P;
    int32_t *start = (int32_t *)hmalloc((size_t)P * 4);
    for (int b = 0; b < c->B; b++) {
        for (int32_t p = 0, s = 0; p < P; p++) start[p] = s = (p == 0 || doc_begins(c, b, p)) ? p : s;
        for (int i = 0; i < c->Tq; i++) qdoc[(size_t)b * c->Tq + i] = start[qpos[i]];
        for (int j = 0; j < c->Tk; j++) kdoc[(size_t)b * c->Tk + j] = start[kpos[j]];
    }
}

static void test_attention(const attn_case *c)
{
    TEST_BEGIN("attention B=%d Tq=%d Tk=%d nh=%d nkv=%d hd=%d win=%d %s%s", c->B, c->Tq, c->Tk, c->nh, c->nkv, c->hd,
               c->window, posname[c->pos], docname[c->docs]);
    const size_t nq = (size_t)c->B * c->Tq * c->nh * c->hd, nk = (size_t)c->B * c->Tk * c->nkv * c->hd;
    const size_t nl = (size_t)c->B * c->nh * c->Tq;
    int32_t *qpos = (int32_t *)hmalloc((size_t)c->Tq * 4), *kpos = (int32_t *)hmalloc((size_t)c->Tk * 4);
    make_positions(c, qpos, kpos);
    int32_t *qdoc = NULL, *kdoc = NULL, *d_qdoc = NULL, *d_kdoc = NULL;
    if (c->docs != DOC_NONE) {
        qdoc = (int32_t *)hmalloc((size_t)c->B * c->Tq * 4);
        kdoc = (int32_t *)hmalloc((size_t)c->B * c->Tk * 4);
        make_docs(c, qpos, kpos, qdoc, kdoc);
        d_qdoc = to_dev_i32(qdoc, (size_t)c->B * c->Tq);
        d_kdoc = to_dev_i32(kdoc, (size_t)c->B * c->Tk);
    }
    /* bf16-representable inputs: one C reference serves both storage dtypes */
    float *q = randu(nq, -2.0f, 2.0f, BF16), *k = randu(nk, -2.0f, 2.0f, BF16), *v = randn(nk, 1.0f, BF16);
    float *out = hfloats(nq), *lse = hfloats(nl);
    op_attention_forward(out, lse, q, k, v, qpos, kpos, qdoc, kdoc, c->B, c->Tq, c->Tk, c->nh, c->nkv, c->hd,
                         c->window);
    /* backward inputs: dout, the (rounded) forward output, and accumulators */
    float *g = randn(nq, 1.0f, BF16), *o_in = copy_of(out, nq);
    round_to(o_in, nq, BF16);
    float *dq = randn(nq, 0.1f, BF16), *dk = randn(nk, 0.1f, BF16), *dv = randn(nk, 0.1f, BF16);
    float *dq0 = copy_of(dq, nq), *dk0 = copy_of(dk, nk), *dv0 = copy_of(dv, nk);
    op_attention_backward(dq, dk, dv, g, q, k, v, o_in, lse, qpos, kpos, qdoc, kdoc, c->B, c->Tq, c->Tk, c->nh,
                          c->nkv, c->hd, c->window);
    int32_t *d_qpos = to_dev_i32(qpos, c->Tq), *d_kpos = to_dev_i32(kpos, c->Tk);
    float *d_lse = (float *)dmalloc(nl * 4);
    const int form0 = cuda_op_attention_backward_form(), shape0 = cuda_op_attention_forward_shape();
    cuda_op_attention_set_backward_form(1); /* room for the fused backward's dq too */
    void *d_scratch = dmalloc(cuda_op_attention_scratch(c->B, c->Tq, c->Tk, c->nh, c->hd));
    /* fp32; bf16 in the default forms (forward blocks of 8 warps x 16 rows, the split
     * backward); bf16 in the others (4 x 16 with the fused backward, 4 x 32 with the
     * fused one of 8 warps) */
    for (int di = 0; di < 4; di++) {
        const cudaDataType_t dt = di ? BF16 : F32;
        cuda_op_attention_set_backward_form(di >= 2 ? di - 1 : 0);
        cuda_op_attention_set_forward_shape(di >= 2 ? di - 1 : 0);
        const char *shape = di >= 2 ? cuda_op_attention_forward_shape_name(di - 1) : "";
        char what[64];
        void *d_q = to_dev(q, nq, dt), *d_k = to_dev(k, nk, dt), *d_v = to_dev(v, nk, dt);
        const char *form = di >= 2 ? cuda_op_attention_backward_form_name(di - 1) : "";
        void *d_out = dmalloc(nq * esize(dt));
        poison(d_lse, nl * 4);
        CK_SYNC(cuda_op_attention_forward(d_out, d_lse, d_q, d_k, d_v, d_qpos, d_kpos, d_qdoc, d_kdoc, c->B,
                                          c->Tq, c->Tk, c->nh, c->nkv, c->hd, c->window, d_scratch, dt, 0));
        snprintf(what, sizeof what, "%s fwd %s out", dtname(dt), shape);
        compare_dev(what, d_out, dt, out, nq, dt == F32 ? 2e-5 : 1e-2);
        snprintf(what, sizeof what, "%s fwd %s lse", dtname(dt), shape);
        compare_dev(what, d_lse, F32, lse, nl, dt == F32 ? 1e-5 : 1e-4);

        void *d_g = to_dev(g, nq, dt), *d_o = to_dev(o_in, nq, dt);
        void *d_dq = to_dev(dq0, nq, dt), *d_dk = to_dev(dk0, nk, dt), *d_dv = to_dev(dv0, nk, dt);
        CK(cudaMemcpy(d_lse, lse, nl * 4, cudaMemcpyHostToDevice));
        CK_SYNC(cuda_op_attention_backward(d_dq, d_dk, d_dv, d_g, d_q, d_k, d_v, d_o, d_lse, d_qpos, d_kpos, d_qdoc,
                                           d_kdoc, c->B, c->Tq, c->Tk, c->nh, c->nkv, c->hd, c->window, d_scratch,
                                           dt, 0));
        const double tb = dt == F32 ? 2e-5 : 2e-2;
        snprintf(what, sizeof what, "%s bwd %s dq", dtname(dt), form);
        compare_dev(what, d_dq, dt, dq, nq, tb);
        snprintf(what, sizeof what, "%s bwd %s dk", dtname(dt), form);
        compare_dev(what, d_dk, dt, dk, nk, tb);
        snprintf(what, sizeof what, "%s bwd %s dv", dtname(dt), form);
        compare_dev(what, d_dv, dt, dv, nk, tb);
    }
    cuda_op_attention_set_backward_form(form0);
    cuda_op_attention_set_forward_shape(shape0);
    TEST_END();
}

static void test_attention_merge(cudaDataType_t dt, int B, int T, int nh, int hd)
{
    TEST_BEGIN("attention merge %s B=%d T=%d nh=%d hd=%d", dtname(dt), B, T, nh, hd);
    const size_t n = (size_t)B * T * nh * hd, nl = (size_t)B * nh * T;
    float *o1 = randn(n, 1.0f, dt), *o2 = randn(n, 1.0f, dt);
    float *l1 = randu(nl, -3.0f, 8.0f, F32), *l2 = randu(nl, -3.0f, 8.0f, F32);
    for (size_t i = 0; i < nl; i += 7) l1[i] = -INFINITY; /* parts that saw no key */
    for (size_t i = 3; i < nl; i += 11) l2[i] = -INFINITY;
    void *d_o1 = to_dev(o1, n, dt), *d_o2 = to_dev(o2, n, dt);
    float *d_l1 = (float *)to_dev(l1, nl, F32), *d_l2 = (float *)to_dev(l2, nl, F32);
    op_attention_merge(o1, l1, o2, l2, B, T, nh, hd);
    CK_SYNC(cuda_op_attention_merge(d_o1, d_l1, d_o2, d_l2, B, T, nh, hd, dt, 0));
    compare_dev("out", d_o1, dt, o1, n, tol_of(dt));
    compare_dev("lse", d_l1, F32, l1, nl, 1e-6);
    TEST_END();
}

/* ============================================================ swiglu */
static void test_swiglu(cudaDataType_t dt, size_t n, int offset)
{
    TEST_BEGIN("swiglu+add %s n=%zu%s", dtname(dt), n, offset ? " unaligned" : "");
    float *gt = randn(n, 2.0f, dt), *up = randn(n, 1.0f, dt), *out = hfloats(n);
    op_swiglu_forward(out, gt, up, n);
    const size_t off = (size_t)offset * esize(dt); /* offset: pointers off the 16-byte grid */
    char *d_gt = to_dev_off(gt, n, dt, off), *d_up = to_dev_off(up, n, dt, off), *d_out = to_dev_off(NULL, n, dt, off);
    CK_SYNC(cuda_op_swiglu_forward(d_out, d_gt, d_up, n, dt, 0));
    compare_dev("fwd", d_out, dt, out, n, tol_of(dt));
    float *g = randn(n, 1.0f, dt), *dg = randn(n, 1.0f, dt), *du = randn(n, 1.0f, dt);
    char *d_g = to_dev_off(g, n, dt, off), *d_dg = to_dev_off(dg, n, dt, off), *d_du = to_dev_off(du, n, dt, off);
    op_swiglu_backward(dg, du, g, gt, up, n);
    CK_SYNC(cuda_op_swiglu_backward(d_dg, d_du, d_g, d_gt, d_up, n, dt, 0));
    compare_dev("bwd dgate", d_dg, dt, dg, n, tol_of(dt));
    compare_dev("bwd dup", d_du, dt, du, n, tol_of(dt));
    /* add (the residual connections) on the same tensors: y = a + b, then in place
     * through either operand */
    float *y = hfloats(n), *y2 = hfloats(n);
    op_add(y, gt, up, n);
    round_to(y, n, dt);
    op_add(y2, y, up, n);
    CK(cuda_op_add(d_out, d_gt, d_up, n, dt, 0));
    CK(cuda_op_add(d_gt, d_gt, d_up, n, dt, 0));
    CK_SYNC(cuda_op_add(d_up, d_out, d_up, n, dt, 0));
    compare_dev("add y = a + b", d_out, dt, y, n, dt == F32 ? 0.0 : 1e-2);
    compare_dev("add a += b", d_gt, dt, y, n, dt == F32 ? 0.0 : 1e-2);
    compare_dev("add b = y + b", d_up, dt, y2, n, dt == F32 ? 0.0 : 1e-2);
    TEST_END();
}

/* ============================================================ gelu */
static void test_gelu(cudaDataType_t dt, size_t n, int offset)
{
    TEST_BEGIN("gelu %s n=%zu%s", dtname(dt), n, offset ? " unaligned" : "");
    float *x = randn(n, 3.0f, dt), *out = hfloats(n);
    op_gelu_forward(out, x, n);
    const size_t off = (size_t)offset * esize(dt); /* offset: pointers off the 16-byte grid */
    char *d_x = to_dev_off(x, n, dt, off), *d_out = to_dev_off(NULL, n, dt, off);
    CK_SYNC(cuda_op_gelu_forward(d_out, d_x, n, dt, 0));
    compare_dev("fwd", d_out, dt, out, n, tol_of(dt));
    float *g = randn(n, 1.0f, dt), *dx = randn(n, 1.0f, dt);
    char *d_g = to_dev_off(g, n, dt, off), *d_dx = to_dev_off(dx, n, dt, off);
    op_gelu_backward(dx, g, x, n);
    CK_SYNC(cuda_op_gelu_backward(d_dx, d_g, d_x, n, dt, 0));
    compare_dev("bwd dinp (+=)", d_dx, dt, dx, n, tol_of(dt));
    TEST_END();
}

/* ============================================================ cross-entropy */
static void test_xent(cudaDataType_t dt, int N, int Vl, int vs)
{
    TEST_BEGIN("xent %s N=%d Vl=%d vocab_start=%d", dtname(dt), N, Vl, vs);
    const size_t n = (size_t)N * Vl;
    float *x = randn(n, 3.0f, dt);
    int32_t *t = (int32_t *)hmalloc((size_t)N * 4);
    for (int i = 0; i < N; i++) {
        uint64_t r = rng_u64() % 10;
        if (r == 0) t[i] = -1; /* ignored row */
        else if (r < 3) /* owned by another rank */
            t[i] = vs > 0 ? (int32_t)(rng_u64() % (uint64_t)vs) : vs + Vl + (int32_t)(rng_u64() % 100);
        else t[i] = vs + (int32_t)(rng_u64() % (uint64_t)Vl);
    }
    float *rm = hfloats(N), *tl = hfloats(N), *se = hfloats(N), *loss = hfloats(N), *dx = hfloats(n);
    op_xent_rowmax(rm, tl, x, t, N, Vl, vs);
    op_xent_sumexp(se, x, rm, N, Vl);
    const double total = op_xent_loss(loss, rm, se, tl, t, N);
    const float scale = 1.0f / (float)N;
    op_xent_backward(dx, x, rm, se, t, N, Vl, vs, scale);

    void *d_x = to_dev(x, n, dt);
    int32_t *d_t = to_dev_i32(t, N);
    float *d_rm = (float *)dmalloc((size_t)N * 4), *d_tl = (float *)dmalloc((size_t)N * 4);
    float *d_se = (float *)dmalloc((size_t)N * 4), *d_loss = (float *)dmalloc((size_t)N * 4);
    double *d_total = (double *)dmalloc(8);
    CK_SYNC(cuda_op_xent_rowmax(d_rm, d_tl, d_x, d_t, N, Vl, vs, dt, 0));
    compare_dev("rowmax", d_rm, F32, rm, N, 0.0);
    compare_dev("target_logit", d_tl, F32, tl, N, 0.0);
    CK(cudaMemcpy(d_rm, rm, (size_t)N * 4, cudaMemcpyHostToDevice));
    CK_SYNC(cuda_op_xent_sumexp(d_se, d_x, d_rm, N, Vl, dt, 0));
    compare_dev("sumexp", d_se, F32, se, N, 1e-5);
    poison(d_rm, (size_t)N * 4);
    poison(d_se, (size_t)N * 4);
    poison(d_tl, (size_t)N * 4);
    CK_SYNC(cuda_op_xent_stats(d_rm, d_se, d_tl, d_x, d_t, N, Vl, vs, dt, 0));
    compare_dev("stats rowmax", d_rm, F32, rm, N, 0.0);
    compare_dev("stats sumexp", d_se, F32, se, N, 1e-5);
    compare_dev("stats target_logit", d_tl, F32, tl, N, 0.0);
    CK(cudaMemcpy(d_rm, rm, (size_t)N * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_se, se, (size_t)N * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_tl, tl, (size_t)N * 4, cudaMemcpyHostToDevice));
    CK_SYNC(cuda_op_xent_loss(d_loss, d_total, d_rm, d_se, d_tl, d_t, N, 0));
    compare_dev("losses", d_loss, F32, loss, N, 1e-6);
    double total_gpu = 0.0;
    CK(cudaMemcpy(&total_gpu, d_total, 8, cudaMemcpyDeviceToHost));
    report("loss sum", fabs(total_gpu - total) / fmax(fabs(total), 1e-30), 1e-9);
    void *d_dx = dmalloc(n * esize(dt));
    CK_SYNC(cuda_op_xent_backward(d_dx, d_x, d_rm, d_se, d_t, N, Vl, vs, scale, dt, 0));
    compare_dev("bwd dlogits", d_dx, dt, dx, n, tol_of(dt));
    CK_SYNC(cuda_op_xent_backward(d_x, d_x, d_rm, d_se, d_t, N, Vl, vs, scale, dt, 0));
    compare_dev("bwd dlogits in place", d_x, dt, dx, n, tol_of(dt));
    TEST_END();
}

/* ============================================================ adamw */
static void test_adamw(size_t n, int step)
{
    TEST_BEGIN("adamw n=%zu step=%d", n, step);
    float *p = randn(n, 1.0f, F32), *g = randn(n, 0.1f, F32), *m = randn(n, 0.01f, F32);
    float *v = randu(n, 0.0f, 1e-3f, F32);
    float *d_p = (float *)to_dev(p, n, F32), *d_g = (float *)to_dev(g, n, F32);
    float *d_m = (float *)to_dev(m, n, F32), *d_v = (float *)to_dev(v, n, F32);
    void *d_pb = dmalloc(n * 2);
    const float lr = 3e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    op_adamw(p, g, m, v, n, lr, b1, b2, eps, wd, step);
    CK_SYNC(cuda_op_adamw(d_p, d_g, d_m, d_v, d_pb, n, lr, b1, b2, eps, wd, step, 0));
    compare_dev("param", d_p, F32, p, n, 1e-6);
    compare_dev("m", d_m, F32, m, n, 1e-6);
    compare_dev("v", d_v, F32, v, n, 1e-6);
    float *pb = copy_of(p, n);
    round_to(pb, n, BF16);
    compare_dev("param bf16 copy", d_pb, BF16, pb, n, 1e-3);
    TEST_END();
}

/* ============================================================ reductions */
static void test_reduce(cudaDataType_t dt, size_t n, int offset)
{
    TEST_BEGIN("reduce %s n=%zu%s", dtname(dt), n, offset ? " unaligned" : "");
    float *x = randn(n, 1.0f, dt);
    x[n / 3] = 37.5f; /* exact in bf16 */
    char *d_x = to_dev_off(x, n, dt, (size_t)offset * esize(dt));
    double *d_ss = (double *)dmalloc(8);
    float *d_am = (float *)dmalloc(4);
    CK(cuda_op_sumsq(d_ss, d_x, n, dt, 0));
    CK_SYNC(cuda_op_amax(d_am, d_x, n, dt, 0));
    double ss = 0.0;
    float am = 0.0f;
    CK(cudaMemcpy(&ss, d_ss, 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&am, d_am, 4, cudaMemcpyDeviceToHost));
    const double ss_ref = op_sumsq(x, n);
    report("sumsq", fabs(ss - ss_ref) / ss_ref, 1e-9);
    /* the same bits every time (a resumed run's gradient norm must repeat) */
    double ss2 = 0.0;
    int same = 1;
    for (int rep = 0; rep < 5 && same; rep++) {
        CK(cuda_op_sumsq(d_ss, d_x, n, dt, 0));
        CK(cudaMemcpy(&ss2, d_ss, 8, cudaMemcpyDeviceToHost));
        same = memcmp(&ss2, &ss, sizeof ss) == 0;
    }
    report("sumsq repeats bit for bit", same ? 0.0 : INFINITY, 0.0);
    const float am_ref = op_amax(x, n);
    report("amax", am == am_ref ? 0.0 : INFINITY, 0.0);
    /* NaN must propagate */
    float nanv = NAN;
    x[n - 1] = nanv;
    upload(d_x, x, n, dt);
    CK_SYNC(cuda_op_amax(d_am, d_x, n, dt, 0));
    CK(cudaMemcpy(&am, d_am, 4, cudaMemcpyDeviceToHost));
    report("amax with a NaN", isnan(am) && isnan(op_amax(x, n)) ? 0.0 : INFINITY, 0.0);
    x[n - 1] = 1.0f;
    upload(d_x, x, n, dt);
    op_scale(x, 0.37f, n);
    CK_SYNC(cuda_op_scale(d_x, 0.37f, n, dt, 0));
    compare_dev("scale", d_x, dt, x, n, dt == F32 ? 0.0 : 1e-2);
    TEST_END();
}

/* ============================================================ fp8 */
static void fp8_special_values(float *x, size_t n, int fmt)
{
    const float mx = fmt == OP_FP8_E5M2 ? 57344.0f : 448.0f;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_u64() % 16;
        float v;
        if (r < 6) v = rng_normal() * ldexpf(1.0f, (int)(rng_u64() % 41) - 20);
        else if (r < 8) { /* ties: k/2 ulp steps around representable values */
            int e = (int)(rng_u64() % 24) - 16;
            v = ldexpf(1.0f + (float)(rng_u64() % 64) / 32.0f, e);
        } else if (r < 9) v = ldexpf((float)(rng_u64() % 64), -22 - (int)(rng_u64() % 6)); /* fp8 subnormals */
        else if (r < 10) v = mx * rng_uniform(0.9f, 1.2f);
        else if (r < 11) v = ldexpf(rng_uniform(1.0f, 2.0f), (int)(rng_u64() % 60));
        else v = rng_uniform(-4.0f, 4.0f);
        x[i] = (rng_u64() & 1) ? -v : v;
    }
    const uint32_t specials[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff912345u, 0x7f800000u, 0xff800000u,
                                 0x00000000u, 0x80000000u, 0x00000001u, 0x80400000u, 0x43e00000u, 0x43e80000u,
                                 0x43f00000u, 0xc3e80000u, 0x47600000u, 0x47700000u};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0] && i < n; i++) memcpy(&x[i * 97 % n], &specials[i], 4);
}

/* cuda_op_fp8_quantize_acc from `start`: the bytes of the C op, amax folded by the
 * recipe's rule (train/fp8.c: a NaN amax wins, a NaN accumulator stays) */
static void check_quantize_acc(const char *what, const uint8_t *q, float am, uint8_t *qg, uint8_t *d_q, const void *d_x,
                               size_t n, const float *d_s, int fmt, cudaDataType_t dt, float start)
{
    const float want = (am > start || isnan(am)) ? (isnan(start) ? start : am) : start;
    float *d_acc = dev_scalar(start), got;
    CK_SYNC(cuda_op_fp8_quantize_acc(d_q, d_acc, d_x, n, d_s, fmt, dt, 0));
    CK(cudaMemcpy(&got, d_acc, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(qg, d_q, n, cudaMemcpyDeviceToHost));
    char name[96];
    snprintf(name, sizeof name, "quantize_acc from %g %s: amax", start, what);
    report(name, (got == want || (isnan(got) && isnan(want))) ? 0.0 : INFINITY, 0.0);
    snprintf(name, sizeof name, "quantize_acc from %g %s: bytes differing", start, what);
    report(name, memcmp(q, qg, n) ? INFINITY : 0.0, 0.0);
}

static void test_fp8(cudaDataType_t dt, int fmt, size_t n, float scale)
{
    TEST_BEGIN("fp8 %s %s n=%zu scale=%g", dtname(dt), fmt == OP_FP8_E5M2 ? "e5m2" : "e4m3", n, scale);
    float *x = hfloats(n);
    fp8_special_values(x, n, fmt);
    round_to(x, n, dt);
    uint8_t *q = (uint8_t *)hmalloc(n), *qg = (uint8_t *)hmalloc(n);
    float am = 0.0f, amg = 0.0f;
    op_fp8_quantize(q, &am, x, n, scale, fmt);
    void *d_x = to_dev(x, n, dt);
    uint8_t *d_q = (uint8_t *)dmalloc(n + 16);
    float *d_am = (float *)dmalloc(4), *d_s = dev_scalar(scale);
    CK_SYNC(cuda_op_fp8_quantize(d_q, d_am, d_x, n, d_s, fmt, dt, 0));
    CK(cudaMemcpy(qg, d_q, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&amg, d_am, 4, cudaMemcpyDeviceToHost));
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (q[i] != qg[i]) {
            if (first == n) first = i;
            bad++;
        }
    if (bad) {
        uint32_t bits;
        memcpy(&bits, &x[first], 4);
        printf("     first difference at %zu: x=%g (0x%08x) * %g -> C 0x%02x, CUDA 0x%02x\n", first, x[first], bits, scale,
               q[first], qg[first]);
    }
    report("quantize bytes differing (fraction)", (double)bad / (double)n, 0.0);
    report("quantize amax (NaN in input)", (am == amg || (isnan(am) && isnan(amg))) ? 0.0 : INFINITY, 0.0);
    check_quantize_acc("(NaN in input)", q, am, qg, d_q, d_x, n, d_s, fmt, dt, 1.0f);
    /* amax of finite data: replace the NaNs and infinities */
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) x[i] = 0.5f;
    upload(d_x, x, n, dt);
    op_fp8_quantize(q, &am, x, n, scale, fmt);
    CK_SYNC(cuda_op_fp8_quantize(d_q, d_am, d_x, n, d_s, fmt, dt, 0));
    CK(cudaMemcpy(&amg, d_am, 4, cudaMemcpyDeviceToHost));
    report("quantize amax (finite input)", am == amg ? 0.0 : INFINITY, 0.0);
    const float starts[] = {0.0f, 0.5f * am, 2.0f * am + 1.0f, FLT_MAX, NAN};
    for (size_t i = 0; i < sizeof starts / sizeof starts[0]; i++)
        check_quantize_acc("(finite input)", q, am, qg, d_q, d_x, n, d_s, fmt, dt, starts[i]);
    /* unaligned input and output take the scalar path */
    if (n > 64) {
        const size_t m = n - 64;
        CK_SYNC(cuda_op_fp8_quantize(d_q + 3, NULL, (char *)d_x + 5 * esize(dt), m, d_s, fmt, dt, 0));
        CK(cudaMemcpy(qg, d_q + 3, m, cudaMemcpyDeviceToHost));
        op_fp8_quantize(q, NULL, x + 5, m, scale, fmt);
        bad = 0;
        for (size_t i = 0; i < m; i++) bad += q[i] != qg[i];
        report("quantize unaligned bytes differing", (double)bad / (double)m, 0.0);
        op_fp8_quantize(q, NULL, x, n, scale, fmt);
    }
    float *deq = hfloats(n);
    op_fp8_dequantize(deq, q, n, scale, fmt);
    round_to(deq, n, dt);
    CK(cudaMemcpy(d_q, q, n, cudaMemcpyHostToDevice));
    void *d_deq = dmalloc(n * esize(dt));
    CK_SYNC(cuda_op_fp8_dequantize(d_deq, d_q, n, d_s, fmt, dt, 0));
    compare_dev("dequantize", d_deq, dt, deq, n, 0.0);
    TEST_END();
}

/* the recipe's scalars: amax folding and current scaling against train/fp8.c's rules */
static float ref_scale_from(float amax, float prev, int fmt, float margin)
{
    if (!(amax > 0.0f) || !isfinite(amax)) return prev;
    float sc = (float)((double)(fmt == OP_FP8_E5M2 ? 57344.0f : 448.0f) / amax / pow(2.0, margin));
    return isfinite(sc) && sc > 0.0f ? sc : prev;
}
static void test_fp8_recipe(int fmt, float margin)
{
    TEST_BEGIN("fp8 recipe %s margin=%g", fmt == OP_FP8_E5M2 ? "e5m2" : "e4m3", margin);
    enum { K = 12 };
    /* amaxes: ordinary, 0, inf, NaN, tiny (scale overflows), huge; accumulators likewise */
    static const float am[K] = {1.5f, 0.0f, INFINITY, NAN, 1e-40f, 3e38f, 0.25f, 7.0f, NAN, 2.0f, 0.0f, 100.0f};
    static const float ac[K] = {1.0f, 2.0f, 3.0f, 4.0f, 0.0f, 1.0f, NAN, 7.5f, NAN, 2.0f, 0.0f, INFINITY};
    float *sc = hfloats(K), *si = hfloats(K), *acc = copy_of(ac, K);
    for (int i = 0; i < K; i++) sc[i] = 0.5f + (float)i;
    float *d_am = (float *)to_dev(am, K, F32), *d_acc = (float *)to_dev(ac, K, F32), *d_sc = (float *)to_dev(sc, K, F32);
    float *d_si = (float *)dmalloc(K * 4);
    CK(cuda_op_fp8_amax_fold(d_acc, d_am, K, 0));
    CK_SYNC(cuda_op_fp8_scale_update(d_sc, d_si, d_am, K, fmt, margin, 0));
    for (int i = 0; i < K; i++) {
        if (am[i] > acc[i] || isnan(am[i])) acc[i] = isnan(acc[i]) ? acc[i] : am[i];
        sc[i] = ref_scale_from(am[i], sc[i], fmt, margin);
        si[i] = 1.0f / sc[i];
    }
    float *g_acc = from_dev(d_acc, K, F32), *g_sc = from_dev(d_sc, K, F32), *g_si = from_dev(d_si, K, F32);
    report("amax fold (bits)", memcmp(g_acc, acc, K * 4) ? INFINITY : 0.0, 0.0);
    report("scale (bits)", memcmp(g_sc, sc, K * 4) ? INFINITY : 0.0, 0.0);
    report("1/scale (bits)", memcmp(g_si, si, K * 4) ? INFINITY : 0.0, 0.0);
    TEST_END();
}

/* dst [cols, ld]: the rows transposed, columns rows..ld-1 zero. soff / doff shift the
 * source and destination off their allocation's alignment (the word form needs 4 bytes). */
static void test_fp8_transpose(int rows, int cols, int ld, int soff, int doff)
{
    TEST_BEGIN("fp8 transpose %dx%d ld=%d src+%d dst+%d", rows, cols, ld, soff, doff);
    const size_t n = (size_t)rows * cols, nt = (size_t)ld * cols;
    uint8_t *a = (uint8_t *)hmalloc(n), *t = (uint8_t *)hmalloc(nt);
    for (size_t i = 0; i < n; i++) a[i] = (uint8_t)rng_u64();
    uint8_t *d_a0 = (uint8_t *)dmalloc(n + 4), *d_t0 = (uint8_t *)dmalloc(nt + 4);
    uint8_t *d_a = d_a0 + soff, *d_t = d_t0 + doff;
    CK(cudaMemcpy(d_a, a, n, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_t0, 0x5a, nt + 4)); /* the pad must be written, not left */
    CK_SYNC(cuda_op_fp8_transpose(d_t, ld, d_a, rows, cols, 0));
    CK(cudaMemcpy(t, d_t, nt, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < ld; r++) bad += t[(size_t)c * ld + r] != (r < rows ? a[(size_t)r * cols + c] : 0);
    uint8_t edge[4];
    CK(cudaMemcpy(edge, d_t + nt, (size_t)(4 - doff), cudaMemcpyDeviceToHost));
    for (int i = 0; i < 4 - doff; i++) bad += edge[i] != 0x5a; /* nothing written past dst */
    report("bytes differing", (double)bad, 0.0);
    TEST_END();
}

/* ============================================================ GEMMs */
static void test_gemm(cudaDataType_t dt, cudaDataType_t out_dt, cudaDataType_t dw_dt, int N, int IN, int OUT)
{
    TEST_BEGIN("linear %s->%s dW %s N=%d IN=%d OUT=%d", dtname(dt), dtname(out_dt), dtname(dw_dt), N, IN, OUT);
    const size_t nx = (size_t)N * IN, nw = (size_t)OUT * IN, ny = (size_t)N * OUT;
    float *x = randn(nx, 1.0f, dt), *w = randn(nw, 0.1f, dt), *y = hfloats(ny);
    op_linear_forward(y, x, w, N, IN, OUT);
    void *d_x = to_dev(x, nx, dt), *d_w = to_dev(w, nw, dt), *d_y = dmalloc(ny * esize(out_dt));
    CK_SYNC(cuda_op_linear_forward(gemm, d_y, out_dt, d_x, d_w, dt, N, IN, OUT, 0));
    compare_dev("fwd", d_y, out_dt, y, ny, tol_of(out_dt) * (dt == F32 ? 10 : 1));
    float *g = randn(ny, 1.0f, dt), *dx = randn(nx, 1.0f, dt), *dw = randn(nw, 1.0f, dw_dt);
    void *d_g = to_dev(g, ny, dt), *d_dx = to_dev(dx, nx, dt), *d_dw = to_dev(dw, nw, dw_dt);
    op_linear_backward(dx, dw, g, x, w, N, IN, OUT);
    CK_SYNC(cuda_op_linear_backward(gemm, d_dx, d_dw, dw_dt, d_g, d_x, d_w, dt, N, IN, OUT, 0));
    compare_dev("bwd dinp", d_dx, dt, dx, nx, tol_of(dt) * (dt == F32 ? 10 : 1));
    compare_dev("bwd dweight", d_dw, dw_dt, dw, nw, tol_of(dw_dt) * (dw_dt == F32 ? 10 : 1));
    TEST_END();
}

/* amax of |x| on the host (for scales) */
static float host_amax(const float *x, size_t n)
{
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}
/* dequant(quant(x)) as the C backend's FP8 recipe sees it */
static float *fp8_roundtrip(const float *x, size_t n, float s, int fmt)
{
    uint8_t *q = (uint8_t *)hmalloc(n);
    float *y = hfloats(n);
    op_fp8_quantize(q, NULL, x, n, s, fmt);
    op_fp8_dequantize(y, q, n, s, fmt);
    return y;
}

static void test_gemm_fp8(cudaDataType_t out_dt, int N, int IN, int OUT, int fast_accum)
{
    TEST_BEGIN("linear fp8 ->%s N=%d IN=%d OUT=%d%s", dtname(out_dt), N, IN, OUT, fast_accum ? " fast-accum" : "");
    const size_t nx = (size_t)N * IN, nw = (size_t)OUT * IN, ny = (size_t)N * OUT;
    float *x = randn(nx, 1.0f, F32), *w = randn(nw, 0.05f, F32), *y = hfloats(ny);
    const float s_x = 448.0f / host_amax(x, nx), s_w = 448.0f / host_amax(w, nw) * 0.5f;
    void *scratch = hmalloc(OP_LINEAR_FP8_SCRATCH_BYTES(N, IN, OUT));
    op_linear_forward_fp8(y, x, w, N, IN, OUT, s_x, s_w, scratch);
    float *d_x = (float *)to_dev(x, nx, F32), *d_w = (float *)to_dev(w, nw, F32);
    uint8_t *d_xq = (uint8_t *)dmalloc(nx), *d_wq = (uint8_t *)dmalloc(nw);
    float *d_sx = dev_scalar(s_x), *d_sw = dev_scalar(s_w), *d_isx = dev_scalar(1.0f / s_x), *d_isw = dev_scalar_at(1.0f / s_w, 1);
    CK(cuda_op_fp8_quantize(d_xq, NULL, d_x, nx, d_sx, OP_FP8_E4M3, F32, 0));
    CK(cuda_op_fp8_quantize(d_wq, NULL, d_w, nw, d_sw, OP_FP8_E4M3, F32, 0));
    void *d_y = dmalloc(ny * esize(out_dt));
    float *d_amax = (float *)dmalloc(4);
    CK_SYNC(cuda_op_linear_forward_fp8(gemm, d_y, out_dt, d_amax, d_xq, d_isx, d_wq, d_isw, N, IN, OUT, fast_accum, 0));
    const double tf = out_dt == F32 ? (fast_accum ? 1e-2 : 1e-3) : 1e-2;
    compare_dev("fwd", d_y, out_dt, y, ny, tf);
    float amax = 0.0f;
    CK(cudaMemcpy(&amax, d_amax, 4, cudaMemcpyDeviceToHost));
    const float amax_ref = host_amax(y, ny);
    report("fwd amax", fabs(amax - amax_ref) / amax_ref, 1e-2);
    if (fast_accum) {
        TEST_END();
        return;
    }
    /* backward: dout in E5M2, reference through the C emulation of the recipe */
    float *g = randn(ny, 1e-3f, F32), *dx = randn(nx, 1.0f, BF16), *dw = randn(nw, 1.0f, F32);
    const float s_g = 57344.0f / host_amax(g, ny) / 4.0f;
    float *gq = fp8_roundtrip(g, ny, s_g, OP_FP8_E5M2), *xq = fp8_roundtrip(x, nx, s_x, OP_FP8_E4M3);
    float *wq = fp8_roundtrip(w, nw, s_w, OP_FP8_E4M3);
    float *d_g = (float *)to_dev(g, ny, F32), *d_sg = dev_scalar(s_g), *d_isg = dev_scalar_at(1.0f / s_g, 3);
    uint8_t *d_gq = (uint8_t *)dmalloc(ny);
    CK(cuda_op_fp8_quantize(d_gq, NULL, d_g, ny, d_sg, OP_FP8_E5M2, F32, 0));
    void *d_dx = to_dev(dx, nx, BF16);
    float *d_dw = (float *)to_dev(dw, nw, F32);
    op_linear_backward(dx, dw, gq, xq, wq, N, IN, OUT);
    CK_SYNC(cuda_op_linear_backward_fp8(gemm, d_dx, BF16, d_dw, F32, d_gq, d_isg, d_xq, d_isx, d_wq, d_isw, N, IN, OUT, 0));
    compare_dev("bwd dinp (bf16)", d_dx, BF16, dx, nx, 1e-2);
    compare_dev("bwd dweight (f32)", d_dw, F32, dw, nw, 1e-3);
    TEST_END();
}

/* ============================================================ main */
/* the checks run for each storage dtype */
static void test_per_dtype(cudaDataType_t dt)
{
    if (selected("embedding")) {
        test_embedding(dt, 77, 96, 10, 40);
        test_embedding(dt, 33, 50, 0, 60);
    }
    if (selected("bias")) {
        test_bias(dt, 33, 96, 0);    /* 16-byte packs in the forward */
        test_bias(dt, 7, 1001, 0);   /* C not a multiple of the pack or the 32-column tile */
        test_bias(dt, 45, 64, 1);    /* unaligned */
        test_bias(dt, 50, 1, 0);     /* C = 1 */
        test_bias(dt, 1, 130, 0);    /* N = 1 */
        test_bias(dt, 17, 33, 0);    /* N below the row slices, C one past a tile */
        if (!quick) {
            test_bias(dt, 4097, 896, 0);
            test_bias(dt, 3000, 127, 1);
            test_bias(dt, 8192, 1, 0);
        }
    }
    if (selected("qkv")) {
        test_qkv(dt, 9, 4, 64, 0); /* 16-byte units */
        test_qkv(dt, 7, 3, 5, 0);  /* hd not a whole unit: one element at a time */
        test_qkv(dt, 5, 2, 32, 1); /* unaligned */
        test_qkv(dt, 1, 1, 8, 0);  /* N = nh = 1; bf16: one unit per head */
        if (!quick) test_qkv(dt, 4096, 16, 128, 0);
    }
    if (selected("moe")) {
        test_moe_route(dt, 37, 8, 2, 1, 0);  /* Mixtral: 8 experts, top 2, renormalized */
        test_moe_route(dt, 1, 4, 1, 0, 0);   /* N = 1, k = 1 */
        test_moe_route(dt, 13, 60, 4, 0, 0); /* E not a multiple of the warp */
        test_moe_route(dt, 9, 256, 8, 1, 0); /* 8 experts per lane, k = 8 */
        test_moe_route(dt, 21, 8, 2, 1, 1);  /* exact ties */
        test_moe_route(dt, 7, 64, 8, 0, 1);  /* ties across lanes */
        test_moe_rows(dt, 9, 2, 64);        /* 16-byte rows in gather */
        test_moe_rows(dt, 1, 1, 7);         /* N = k = 1, H odd */
        test_moe_rows(dt, 13, 8, 33);       /* k = 8, H past no block */
        test_moe_rows(dt, 3, 2, 700);       /* H past one block of threads */
        if (dt == F32) {                      /* int32 and fp32 only: once */
            test_moe_group(13, 2, 8, 0);      /* one chunk, its last warp partly empty */
            test_moe_group(1, 1, 1, 0);       /* one pair, one expert */
            test_moe_group(1500, 2, 60, 0);   /* 3 chunks, E not a multiple of the warp */
            test_moe_group(700, 2, 4, 1);     /* expert 0's rows across both chunks */
            test_moe_group(0, 2, 8, 0);       /* no tokens */
            test_moe_group(40, 8, 1024, 0);   /* the most experts */
        }
        if (!quick) {
            test_moe_route(dt, 8192, 128, 8, 1, 0);
            test_moe_rows(dt, 2048, 2, 4096);
        }
    }
    if (selected("rmsnorm")) {
        test_rmsnorm(dt, 33, 96);
        test_rmsnorm(dt, 7, 1001);
        if (!quick) test_rmsnorm(dt, 300, 4096);
    }
    if (selected("layernorm")) {
        test_layernorm(dt, 33, 96, 0.0f, 1);    /* 16-byte packs */
        test_layernorm(dt, 7, 1001, 3.0f, 1);   /* H not a multiple of the pack or the block */
        test_layernorm(dt, 5, 37, -2.0f, 0);    /* no bias */
        test_layernorm(dt, 1, 300, 0.5f, 1);    /* one row, H past one block of threads */
        if (!quick) {
            test_layernorm(dt, 300, 4096, 1.0f, 1);
            test_layernorm(dt, 129, 2561, 0.0f, 1);
        }
    }
    if (selected("rope")) {
        test_rope(dt, 2, 17, 3, 64, 64, 0);
        test_rope(dt, 1, 9, 2, 128, 128, 1);
        test_rope(dt, 2, 17, 3, 64, 16, 0);     /* GPT-NeoX's rotary_pct = 0.25 */
        test_rope(dt, 1, 13, 2, 80, 20, 1);     /* Pythia-like: head_dim 80, rotary 20 */
        test_rope(dt, 1, 7, 3, 10, 6, 0);       /* odd half-widths */
        if (!quick) {
            test_rope(dt, 2, 1024, 8, 128, 128, 1);
            test_rope(dt, 2, 1024, 8, 128, 32, 1);
        }
    }
    if (selected("swiglu") || selected("add")) {
        test_swiglu(dt, 4096, 0);
        test_swiglu(dt, quick ? 5003 : 1000003, 0);
        test_swiglu(dt, 1001, 1);
    }
    if (selected("gelu")) {
        test_gelu(dt, 4096, 0);
        test_gelu(dt, quick ? 5003 : 1000003, 0);
        test_gelu(dt, 1001, 1);
    }
    if (selected("xent")) {
        test_xent(dt, 37, 1000, 500);
        test_xent(dt, 9, 999, 0);
        if (!quick) test_xent(dt, 64, 32768, 32768);
    }
    if (selected("reduce")) {
        test_reduce(dt, quick ? 10007 : 1000003, 0);
        test_reduce(dt, 999, 1);
    }
    if (selected("fp8")) {
        const size_t n = quick ? 20000 : 1 << 20;
        test_fp8(dt, OP_FP8_E4M3, n, 1.0f);
        test_fp8(dt, OP_FP8_E4M3, n, 0.37f);
        test_fp8(dt, OP_FP8_E5M2, n, 1.0f);
        test_fp8(dt, OP_FP8_E5M2, n, 1024.0f);
    }
    if (selected("attention merge")) test_attention_merge(dt, 2, 37, 3, 64);
}

/* the attention cases of the --quick run and of the full one */
static void test_attention_cases(void)
{
    enum { FULL, QUICK };
    static const struct {
        int run;
        attn_case c; /* B, Tq, Tk, nh, nkv, hd, window, positions, documents */
    } cases[] = {
        {QUICK, {1, 37, 37, 2, 2, 64, 0, POS_CAUSAL, DOC_NONE}},
        {QUICK, {1, 70, 70, 4, 2, 32, 0, POS_CAUSAL, DOC_NONE}},
        {QUICK, {1, 130, 130, 4, 1, 128, 0, POS_CAUSAL, DOC_NONE}},
        {QUICK, {2, 40, 40, 2, 1, 64, 16, POS_CAUSAL, DOC_NONE}},
        {QUICK, {1, 48, 80, 2, 2, 64, 0, POS_LATER_Q, DOC_NONE}},
        {QUICK, {1, 64, 64, 2, 1, 32, 0, POS_ZIGZAG, DOC_NONE}},
        {QUICK, {1, 20, 30, 2, 2, 64, 0, POS_FUTURE, DOC_NONE}},
        {QUICK, {1, 33, 41, 4, 2, 32, 0, POS_RANDOM, DOC_NONE}},
        {QUICK, {1, 29, 29, 2, 1, 48, 0, POS_CAUSAL, DOC_NONE}},
        {QUICK, {1, 21, 21, 2, 2, 80, 7, POS_CAUSAL, DOC_NONE}},
        {QUICK, {2, 96, 96, 4, 2, 64, 0, POS_CAUSAL, DOC_RANDOM}},
        {QUICK, {2, 64, 64, 2, 1, 32, 0, POS_ZIGZAG, DOC_RANDOM}},
        {QUICK, {2, 48, 80, 2, 2, 32, 0, POS_LATER_Q, DOC_RANDOM}},
        {QUICK, {2, 33, 41, 2, 1, 48, 0, POS_RANDOM, DOC_RANDOM}},
        {QUICK, {2, 160, 160, 2, 1, 64, 0, POS_CAUSAL, DOC_TILE_EDGE}},
        {QUICK, {2, 40, 40, 2, 2, 64, 8, POS_CAUSAL, DOC_ONE_TOKEN}},
        /* where a tile's range decides (skip, fully visible): unsorted positions in
         * windows, and an odd offset between the sides against every tile edge */
        {QUICK, {1, 150, 170, 2, 1, 64, 40, POS_RANDOM, DOC_NONE}},
        {QUICK, {2, 130, 150, 2, 2, 128, 0, POS_RANDOM, DOC_RANDOM}},
        {QUICK, {1, 83, 147, 2, 1, 32, 21, POS_LATER_Q, DOC_NONE}},
        {FULL, {2, 37, 37, 4, 4, 64, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 100, 100, 8, 4, 64, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 130, 130, 8, 2, 128, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 257, 257, 4, 1, 128, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {2, 77, 77, 4, 2, 32, 16, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 300, 300, 4, 2, 128, 64, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 64, 96, 4, 1, 128, 0, POS_LATER_Q, DOC_NONE}},
        {FULL, {1, 200, 200, 4, 2, 64, 0, POS_ZIGZAG, DOC_NONE}},
        {FULL, {1, 50, 70, 4, 2, 128, 0, POS_FUTURE, DOC_NONE}},
        {FULL, {1, 91, 113, 4, 2, 64, 0, POS_RANDOM, DOC_NONE}},
        {FULL, {1, 75, 75, 2, 1, 48, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 66, 66, 4, 2, 80, 9, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 40, 40, 2, 2, 256, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 1024, 1024, 4, 2, 128, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 4096, 4096, 4, 1, 128, 0, POS_CAUSAL, DOC_NONE}},
        {FULL, {1, 4096, 4096, 8, 2, 128, 512, POS_CAUSAL, DOC_NONE}},
        {FULL, {2, 200, 200, 4, 2, 64, 0, POS_ZIGZAG, DOC_RANDOM}},
        {FULL, {2, 91, 113, 4, 2, 80, 0, POS_RANDOM, DOC_RANDOM}},
        {FULL, {2, 300, 300, 4, 2, 128, 64, POS_CAUSAL, DOC_TILE_EDGE}},
        {FULL, {1, 77, 77, 4, 2, 32, 9, POS_CAUSAL, DOC_ONE_TOKEN}},
        {FULL, {1, 1024, 1024, 4, 2, 128, 0, POS_CAUSAL, DOC_RANDOM}},
        {FULL, {2, 1024, 1024, 4, 1, 64, 0, POS_ZIGZAG, DOC_RANDOM}},
    };
    const char *mt = getenv("SMP_PARITY_MAX_TOKENS");
    const long max_tokens = mt ? strtol(mt, NULL, 10) : LONG_MAX;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].run == (quick ? QUICK : FULL) && cases[i].c.Tq <= max_tokens && cases[i].c.Tk <= max_tokens)
            test_attention(&cases[i].c);
}

int main(int argc, char **argv)
{
    if (!check_args(argc, argv, &quick, &only)) return 2;
    if (!check_device("parity")) return 0;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        printf("parity: device %s, %d multiprocessors, cc %d.%d%s\n", prop.name, prop.multiProcessorCount, prop.major,
               prop.minor, quick ? " (quick)" : "");
    fflush(stdout);
    snprintf(test_name, sizeof test_name, "setup");
    if (setjmp(test_jmp)) summary_and_exit(1);
    const size_t scratch = quick ? cuda_gemm_fp8_scratch_bytes(64, 128, 96)
                                 : cuda_gemm_fp8_scratch_bytes(256, 1024, 768);
    CK(cuda_gemm_create(&gemm, 0, scratch));
    test_per_dtype(F32);
    test_per_dtype(BF16);
    if (selected("fp8 recipe")) {
        test_fp8_recipe(OP_FP8_E4M3, 0.0f);
        test_fp8_recipe(OP_FP8_E5M2, 1.0f);
    }
    if (selected("fp8 transpose")) {
        /* the word form: columns and ld multiples of 4, aligned pointers */
        test_fp8_transpose(64, 96, 64, 0, 0);
        test_fp8_transpose(77, 132, 80, 0, 0);   /* partial tiles, rows padded */
        test_fp8_transpose(3, 68, 16, 0, 0);     /* an expert's few rows */
        test_fp8_transpose(130, 260, 132, 0, 0); /* tiles both ways, partial at both ends */
        test_fp8_transpose(40, 64, 256, 0, 0);   /* tiles of pad only */
        /* the byte form: odd columns or ld, or pointers off 4 bytes */
        test_fp8_transpose(77, 130, 77, 0, 0);
        test_fp8_transpose(77, 130, 80, 0, 0); /* padded to 16 rows */
        test_fp8_transpose(3, 70, 16, 0, 0);
        test_fp8_transpose(77, 132, 77, 0, 0);
        test_fp8_transpose(64, 96, 64, 1, 0);
        test_fp8_transpose(64, 96, 64, 0, 2);
    }
    if (selected("adamw")) {
        test_adamw(quick ? 10003 : 1000003, 1);
        test_adamw(1001, 7);
    }
    if (selected("linear")) {
        test_gemm(F32, F32, F32, 64, 96, 80);
        test_gemm(F32, F32, F32, 17, 36, 20);
        test_gemm(BF16, BF16, F32, 64, 96, 80);
        test_gemm(BF16, F32, BF16, 33, 40, 24);
        if (!quick) test_gemm(BF16, BF16, F32, 256, 1024, 768);
        test_gemm_fp8(BF16, 64, 128, 96, 0);
        test_gemm_fp8(F32, 64, 128, 96, 0);
        test_gemm_fp8(F32, 64, 128, 96, 1);
        test_gemm_fp8(BF16, 37, 128, 96, 0); /* rows not a multiple of 16: two GEMMs, the last rows padded */
        test_gemm_fp8(F32, 5, 64, 48, 0);    /* fewer than 16 rows: the padded GEMM only */
        test_gemm_fp8(F32, 21, 48, 32, 1);
        if (!quick) test_gemm_fp8(BF16, 256, 1024, 768, 0);
    }
    if (selected("attention")) test_attention_cases();
    cuda_gemm_free(gemm);
    summary_and_exit(n_fail ? 1 : 0);
    return 0;
}
