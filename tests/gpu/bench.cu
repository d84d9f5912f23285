/* tests/gpu/bench.cu: timings of the CUDA ops (kernels/ops_cuda.h) on one GPU.
 *
 *   smp-gpu-bench [--quick] [--only copy|ops|gemms|attention]
 *
 * Built by tools/gpu-check (nvcc) and by SConstruct (build/bin/smp-gpu-bench, which
 * skips without a GPU); --only runs one group (gpu-check's profile of attention).
 *
 * Method (/work/.library/device/METHOD.md): random non-zero data, buffers larger
 * than the L2 cache, warm-up runs, then the median of repeated runs timed with CUDA
 * events. Memory-bound ops are reported in GB/s of the fewest bytes they must move
 * (each input read once, each output written once), next to the device-to-device
 * copy bandwidth measured here; GEMMs and attention in TFLOP/s (attention's causal
 * FLOPs counted as half of the full square; backward as 2.5x forward, the usual
 * convention, although these kernels recompute more than that). Every line starts
 * with "RESULT" or "FAIL"; a failed benchmark is recorded and the rest continue. */
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"
#include "ops_cuda.h"

static int quick;
static double copy_gbs = 0.0;

struct Summary {
    char name[96];
    double value;
    const char *unit;
};
static std::vector<Summary> summary;

static void add_summary(const char *name, double v, const char *unit)
{
    Summary s;
    snprintf(s.name, sizeof s.name, "%s", name);
    s.value = v;
    s.unit = unit;
    summary.push_back(s);
}

/* a sticky error makes every later call fail: stop there with what we have */
static void check_device_or_exit(const char *where)
{
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
        printf("FAIL %s: device error %s; stopping the benchmarks\n", where, cudaGetErrorString(e));
        fflush(stdout);
        exit(1);
    }
}

static void fail(const char *name, cudaError_t e)
{
    printf("FAIL %-44s %s: %s\n", name, cudaGetErrorString(e), cuda_op_errmsg());
    fflush(stdout);
    n_fail++;
    check_device_or_exit(name);
}

static void *dalloc(size_t bytes)
{
    void *p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        printf("FAIL cudaMalloc(%zu): %s\n", bytes, cudaGetErrorString(e));
        exit(1);
    }
    return p;
}

__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed)
{
    uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((z >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}
template <typename T>
__global__ void fill_kernel(T *x, size_t n, uint64_t seed, float scale, float offset)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = offset + scale * hash_uniform(i, seed);
        if (v == 0.0f) v = 1e-3f;
        x[i] = (T)v;
    }
}
template <> __global__ void fill_kernel<__nv_bfloat16>(__nv_bfloat16 *x, size_t n, uint64_t seed, float scale, float offset)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = offset + scale * hash_uniform(i, seed);
        if (v == 0.0f) v = 1e-3f;
        x[i] = __float2bfloat16_rn(v);
    }
}
__global__ void fill_tokens(int32_t *t, size_t n, uint64_t seed, int V)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        t[i] = (int32_t)((hash_uniform(i, seed) * 0.5f + 0.5f) * (V - 1));
}
__global__ void fill_iota(int32_t *t, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) t[i] = i;
}

static uint64_t seed_counter = 1;
static float *rand_f32(size_t n, float scale = 1.0f, float offset = 0.0f)
{
    float *p = (float *)dalloc(n * 4);
    fill_kernel<float><<<1024, 256>>>(p, n, seed_counter++ * 7919, scale, offset);
    return p;
}
static __nv_bfloat16 *rand_bf16(size_t n, float scale = 1.0f, float offset = 0.0f)
{
    __nv_bfloat16 *p = (__nv_bfloat16 *)dalloc(n * 2);
    fill_kernel<__nv_bfloat16><<<1024, 256>>>(p, n, seed_counter++ * 7919, scale, offset);
    return p;
}

/* median time in ms of fn() over reps runs after warm runs; negative on error */
template <typename F> static double time_ms(const char *name, F fn, int warm = 3, int reps = 10)
{
    if (quick) {
        warm = 1;
        reps = 3;
    }
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> t;
    for (int i = 0; i < warm + reps; i++) {
        cudaEventRecord(a);
        cudaError_t e = fn();
        cudaEventRecord(b);
        if (e != cudaSuccess) {
            cudaEventDestroy(a);
            cudaEventDestroy(b);
            fail(name, e);
            return -1.0;
        }
        e = cudaEventSynchronize(b);
        if (e != cudaSuccess) {
            cudaEventDestroy(a);
            cudaEventDestroy(b);
            fail(name, e);
            return -1.0;
        }
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, a, b);
        if (i >= warm) t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static void report_bw(const char *name, double ms, double bytes)
{
    if (ms < 0) return;
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("RESULT %-48s %9.3f ms %9.1f GB/s  %5.1f%% of copy\n", name, ms, gbs, copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0);
    fflush(stdout);
    add_summary(name, gbs, "GB/s");
}
static double report_flops(const char *name, double ms, double flops)
{
    if (ms < 0) return -1.0;
    const double tf = flops / (ms * 1e-3) / 1e12;
    printf("RESULT %-48s %9.3f ms %9.1f TFLOP/s\n", name, ms, tf);
    fflush(stdout);
    add_summary(name, tf, "TFLOP/s");
    return tf;
}

/* ------------------------------------------------------------------ copy */
static void bench_copy()
{
    const size_t bytes = (size_t)1 << 30;
    void *a = dalloc(bytes), *b = dalloc(bytes);
    cudaMemset(a, 1, bytes);
    double ms = time_ms("copy", [&] { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
    if (ms > 0) {
        copy_gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
        printf("RESULT %-48s %9.3f ms %9.1f GB/s  (read + write, the ceiling below)\n", "copy d2d 1 GiB", ms, copy_gbs);
        add_summary("copy d2d 1 GiB", copy_gbs, "GB/s");
    }
    cudaFree(a);
    cudaFree(b);
}

/* ------------------------------------------------------------------ memory-bound ops */
static void bench_ops()
{
    const int N = 8192, H = 4096, F = 11008, V = 32000;
    const cudaDataType_t BF = CUDA_R_16BF;
    const size_t nh = (size_t)N * H, nf = (size_t)N * F;
    __nv_bfloat16 *x = rand_bf16(nh), *y = rand_bf16(nh), *w = rand_bf16(H, 0.5f, 1.0f), *g = rand_bf16(nh);
    __nv_bfloat16 *dx = rand_bf16(nh);
    float *rstd = rand_f32(N, 0.1f, 1.0f), *dw = rand_f32(H);
    int32_t *tok = (int32_t *)dalloc((size_t)N * 4);
    fill_tokens<<<64, 256>>>(tok, N, 99, V);
    __nv_bfloat16 *wte = rand_bf16((size_t)V * H);
    float *dwte = rand_f32((size_t)V * H);
    check_device_or_exit("setup");
    double ms;

    ms = time_ms("embedding fwd", [&] { return cuda_op_embedding_forward(y, tok, wte, N, H, 0, V, BF, 0); });
    report_bw("embedding fwd bf16 N=8192 H=4096", ms, 2.0 * nh * 2);
    ms = time_ms("embedding bwd", [&] { return cuda_op_embedding_backward(dwte, g, tok, N, H, 0, V, BF, 0); });
    report_bw("embedding bwd bf16->f32 N=8192 H=4096", ms, nh * 2.0 + nh * 4.0 * 2);
    ms = time_ms("rmsnorm fwd", [&] { return cuda_op_rmsnorm_forward(y, rstd, x, w, N, H, 1e-5f, BF, 0); });
    report_bw("rmsnorm fwd bf16 N=8192 H=4096", ms, 2.0 * nh * 2);
    ms = time_ms("rmsnorm bwd", [&] { return cuda_op_rmsnorm_backward(dx, dw, g, x, w, rstd, N, H, BF, 0); });
    report_bw("rmsnorm bwd bf16 N=8192 H=4096", ms, 4.0 * nh * 2);
    ms = time_ms("bias fwd", [&] { return cuda_op_bias_forward(y, w, N, H, BF, 0); });
    report_bw("bias fwd bf16 N=8192 C=4096", ms, 2.0 * nh * 2);
    ms = time_ms("bias bwd", [&] { return cuda_op_bias_backward(dw, g, N, H, BF, 0); });
    report_bw("bias bwd bf16->f32 N=8192 C=4096", ms, nh * 2.0);
    /* a k/v bias: few columns, many rows (the same buffer as 65536 x 512) */
    ms = time_ms("bias bwd kv", [&] { return cuda_op_bias_backward(dw, g, N * 8, 512, BF, 0); });
    report_bw("bias bwd bf16->f32 N=65536 C=512", ms, nh * 2.0);
    /* NeoX's fused qkv of N/4 rows, 32 heads of 128 (3/4 of x; q, k, v a quarter of y, g, dx) */
    ms = time_ms("qkv split", [&] { return cuda_op_qkv_split(y, g, dx, x, N / 4, 32, 128, BF, 0); });
    report_bw("qkv split bf16 N=2048 nh=32 hd=128", ms, 2.0 * (nh / 4 * 3) * 2);
    ms = time_ms("qkv merge", [&] { return cuda_op_qkv_merge(x, y, g, dx, N / 4, 32, 128, BF, 0); });
    report_bw("qkv merge bf16 N=2048 nh=32 hd=128", ms, 2.0 * (nh / 4 * 3) * 2);

    {
        const int T = 4096, B = 2, nhd = 32, hd = 128;
        float *cs = rand_f32((size_t)T * hd), *sn = rand_f32((size_t)T * hd);
        ms = time_ms("rope fwd", [&] { return cuda_op_rope_forward(x, cs, sn, B, T, nhd, hd, hd, BF, 0); });
        report_bw("rope fwd bf16 B=2 T=4096 nh=32 hd=128", ms, 2.0 * nh * 2);
        cudaFree(cs);
        cudaFree(sn);
    }
    {
        __nv_bfloat16 *gt = rand_bf16(nf, 3.0f), *up = rand_bf16(nf), *o = rand_bf16(nf), *dg = rand_bf16(nf);
        __nv_bfloat16 *du = rand_bf16(nf);
        ms = time_ms("swiglu fwd", [&] { return cuda_op_swiglu_forward(o, gt, up, nf, BF, 0); });
        report_bw("swiglu fwd bf16 8192x11008", ms, 3.0 * nf * 2);
        ms = time_ms("swiglu bwd", [&] { return cuda_op_swiglu_backward(dg, du, o, gt, up, nf, BF, 0); });
        report_bw("swiglu bwd bf16 8192x11008", ms, 7.0 * nf * 2);
        cudaFree(gt);
        cudaFree(up);
        cudaFree(o);
        cudaFree(dg);
        cudaFree(du);
    }
    {
        const size_t nl = (size_t)N * V;
        __nv_bfloat16 *logits = rand_bf16(nl, 8.0f);
        float *rm = rand_f32(N), *se = rand_f32(N), *tl = rand_f32(N), *loss = rand_f32(N);
        double *tot = (double *)dalloc(8);
        ms = time_ms("xent stats", [&] { return cuda_op_xent_stats(rm, se, tl, logits, tok, N, V, 0, BF, 0); });
        report_bw("xent stats (fused) bf16 8192x32000", ms, nl * 2.0);
        ms = time_ms("xent rowmax+sumexp", [&] {
            cudaError_t e = cuda_op_xent_rowmax(rm, tl, logits, tok, N, V, 0, BF, 0);
            return e != cudaSuccess ? e : cuda_op_xent_sumexp(se, logits, rm, N, V, BF, 0);
        });
        report_bw("xent rowmax+sumexp (2 passes) bf16 8192x32000", ms, nl * 2.0);
        cuda_op_xent_loss(loss, tot, rm, se, tl, tok, N, 0);
        ms = time_ms("xent bwd", [&] {
            return cuda_op_xent_backward(logits, logits, rm, se, tok, N, V, 0, 1.0f / N, BF, 0);
        });
        report_bw("xent bwd in place bf16 8192x32000", ms, 2.0 * nl * 2);
        cudaFree(logits);
        cudaFree(rm);
        cudaFree(se);
        cudaFree(tl);
        cudaFree(loss);
        cudaFree(tot);
    }
    {
        const size_t n = quick ? (size_t)1 << 26 : (size_t)1 << 28;
        float *p = rand_f32(n), *gr = rand_f32(n, 0.01f), *m = rand_f32(n, 0.01f), *v = rand_f32(n, 1e-4f, 1e-4f);
        __nv_bfloat16 *pb = (__nv_bfloat16 *)dalloc(n * 2);
        int step = 1;
        ms = time_ms("adamw", [&] { return cuda_op_adamw(p, gr, m, v, pb, n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, step++, 0); });
        char name[96];
        snprintf(name, sizeof name, "adamw f32 + bf16 copy n=%zuM", n >> 20);
        report_bw(name, ms, n * (16.0 + 12.0 + 2.0));
        double *ss = (double *)dalloc(8);
        float *am = (float *)dalloc(4);
        ms = time_ms("sumsq", [&] { return cuda_op_sumsq(ss, p, n, CUDA_R_32F, 0); });
        snprintf(name, sizeof name, "sumsq f32 n=%zuM", n >> 20);
        report_bw(name, ms, n * 4.0);
        ms = time_ms("amax", [&] { return cuda_op_amax(am, p, n, CUDA_R_32F, 0); });
        snprintf(name, sizeof name, "amax f32 n=%zuM", n >> 20);
        report_bw(name, ms, n * 4.0);
        ms = time_ms("scale", [&] { return cuda_op_scale(gr, 0.999f, n, CUDA_R_32F, 0); });
        snprintf(name, sizeof name, "scale f32 n=%zuM", n >> 20);
        report_bw(name, ms, n * 8.0);
        cudaFree(p);
        cudaFree(gr);
        cudaFree(m);
        cudaFree(v);
        cudaFree(pb);
        cudaFree(ss);
        cudaFree(am);
    }
    {
        uint8_t *q = (uint8_t *)dalloc(nh), *qt = (uint8_t *)dalloc(nh);
        float *s = rand_f32(1, 0.0f, 100.0f), *am = (float *)dalloc(4);
        ms = time_ms("fp8 quantize", [&] { return cuda_op_fp8_quantize(q, am, x, nh, s, OP_FP8_E4M3, BF, 0); });
        report_bw("fp8 quantize+amax bf16->e4m3 8192x4096", ms, nh * 3.0);
        ms = time_ms("fp8 transpose", [&] { return cuda_op_fp8_transpose(qt, N, q, N, H, 0); });
        report_bw("fp8 transpose 8192x4096", ms, nh * 2.0);
        cudaFree(q);
        cudaFree(qt);
        cudaFree(s);
        cudaFree(am);
    }
    cudaFree(x);
    cudaFree(y);
    cudaFree(w);
    cudaFree(g);
    cudaFree(dx);
    cudaFree(rstd);
    cudaFree(dw);
    cudaFree(tok);
    cudaFree(wte);
    cudaFree(dwte);
}

/* ------------------------------------------------------------------ GEMMs */
struct GemmShape {
    int N, IN, OUT;
    const char *label;
};

static void bench_gemms()
{
    static const GemmShape shapes[] = {
        {8192, 8192, 8192, "8192^3"},
        {8192, 4096, 4096, "tok8192 4096->4096 (qkvo-like)"},
        {8192, 4096, 11008, "tok8192 4096->11008 (up/gate)"},
        {8192, 11008, 4096, "tok8192 11008->4096 (down)"},
    };
    size_t max_x = 0, max_w = 0, max_y = 0;
    for (const GemmShape &s : shapes) {
        max_x = std::max(max_x, (size_t)s.N * s.IN);
        max_w = std::max(max_w, (size_t)s.OUT * s.IN);
        max_y = std::max(max_y, (size_t)s.N * s.OUT);
    }
    size_t scratch = 0;
    for (const GemmShape &s : shapes) scratch = std::max(scratch, cuda_gemm_fp8_scratch_bytes(s.N, s.IN, s.OUT));
    cuda_gemm *g = nullptr;
    cudaError_t e = cuda_gemm_create(&g, 0, scratch);
    if (e != cudaSuccess) {
        fail("cuda_gemm_create", e);
        return;
    }
    __nv_bfloat16 *x = rand_bf16(max_x), *w = rand_bf16(max_w, 0.05f), *y = rand_bf16(max_y), *dy = rand_bf16(max_y);
    __nv_bfloat16 *dx = rand_bf16(max_x);
    float *dw = rand_f32(max_w);
    uint8_t *xq = (uint8_t *)dalloc(max_x), *wq = (uint8_t *)dalloc(max_w), *dyq = (uint8_t *)dalloc(max_y);
    float *one = rand_f32(1, 0.0f, 1.0f), *sx = rand_f32(1, 0.0f, 100.0f), *sw = rand_f32(1, 0.0f, 2000.0f);
    float *sg = rand_f32(1, 0.0f, 10000.0f), *isx = rand_f32(1, 0.0f, 0.01f), *isw = rand_f32(1, 0.0f, 0.0005f);
    float *isg = rand_f32(1, 0.0f, 0.0001f), *amax = (float *)dalloc(4);
    (void)one;
    cuda_op_fp8_quantize(xq, nullptr, x, max_x, sx, OP_FP8_E4M3, CUDA_R_16BF, 0);
    cuda_op_fp8_quantize(wq, nullptr, w, max_w, sw, OP_FP8_E4M3, CUDA_R_16BF, 0);
    cuda_op_fp8_quantize(dyq, nullptr, dy, max_y, sg, OP_FP8_E5M2, CUDA_R_16BF, 0);
    check_device_or_exit("gemm setup");
    for (const GemmShape &s : shapes) {
        const double fl = 2.0 * s.N * (double)s.IN * s.OUT;
        char name[96];
        double ms;
        snprintf(name, sizeof name, "gemm bf16 fwd %s", s.label);
        ms = time_ms(name, [&] { return cuda_op_linear_forward(g, y, CUDA_R_16BF, x, w, CUDA_R_16BF, s.N, s.IN, s.OUT, 0); });
        const double tb = report_flops(name, ms, fl);
        snprintf(name, sizeof name, "gemm fp8 fwd %s", s.label);
        ms = time_ms(name, [&] {
            return cuda_op_linear_forward_fp8(g, y, CUDA_R_16BF, amax, xq, isx, wq, isw, s.N, s.IN, s.OUT, 0, 0);
        });
        const double tf = report_flops(name, ms, fl);
        snprintf(name, sizeof name, "gemm fp8 fwd fast-accum %s", s.label);
        ms = time_ms(name, [&] {
            return cuda_op_linear_forward_fp8(g, y, CUDA_R_16BF, amax, xq, isx, wq, isw, s.N, s.IN, s.OUT, 1, 0);
        });
        report_flops(name, ms, fl);
        if (tb > 0 && tf > 0) {
            snprintf(name, sizeof name, "ratio fp8/bf16 fwd %s", s.label);
            printf("RESULT %-48s %9.2fx\n", name, tf / tb);
            add_summary(name, tf / tb, "x");
        }
        if (s.IN == 8192 && s.OUT == 8192) continue; /* backward only at model shapes */
        snprintf(name, sizeof name, "gemm bf16 bwd (dx+dW) %s", s.label);
        ms = time_ms(name, [&] {
            return cuda_op_linear_backward(g, dx, dw, CUDA_R_32F, dy, x, w, CUDA_R_16BF, s.N, s.IN, s.OUT, 0);
        });
        const double bb = report_flops(name, ms, 2.0 * fl);
        snprintf(name, sizeof name, "gemm fp8 bwd (dx+dW, transposes) %s", s.label);
        ms = time_ms(name, [&] {
            return cuda_op_linear_backward_fp8(g, dx, CUDA_R_16BF, dw, CUDA_R_32F, dyq, isg, xq, isx, wq, isw, s.N, s.IN,
                                               s.OUT, 0);
        });
        const double bf = report_flops(name, ms, 2.0 * fl);
        if (bb > 0 && bf > 0) {
            snprintf(name, sizeof name, "ratio fp8/bf16 bwd %s", s.label);
            printf("RESULT %-48s %9.2fx\n", name, bf / bb);
            add_summary(name, bf / bb, "x");
        }
    }
    cuda_gemm_free(g);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    cudaFree(dy);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(xq);
    cudaFree(wq);
    cudaFree(dyq);
    cudaFree(one);
    cudaFree(sx);
    cudaFree(sw);
    cudaFree(sg);
    cudaFree(isx);
    cudaFree(isw);
    cudaFree(isg);
    cudaFree(amax);
}

/* ------------------------------------------------------------------ attention */
static void bench_attention()
{
    const int T = 4096, nh = 32, hd = 128;
    struct Case { int B, nkv; };
    static const Case cases[] = {{1, 32}, {2, 32}, {4, 32}, {1, 8}};
    int32_t *pos = (int32_t *)dalloc((size_t)T * 4);
    fill_iota<<<16, 256>>>(pos, T);
    const int Bmax = 4;
    const size_t nq = (size_t)Bmax * T * nh * hd;
    __nv_bfloat16 *q = rand_bf16(nq, 2.0f), *k = rand_bf16(nq, 2.0f), *v = rand_bf16(nq), *o = rand_bf16(nq);
    __nv_bfloat16 *dout = rand_bf16(nq), *dq = rand_bf16(nq), *dk = rand_bf16(nq), *dv = rand_bf16(nq);
    float *lse = rand_f32((size_t)Bmax * nh * T);
    const int form0 = cuda_op_attention_backward_form(), shape0 = cuda_op_attention_forward_shape();
    cuda_op_attention_set_backward_form(1); /* the scratch with room for the fused forms' dq */
    void *scratch = dalloc(cuda_op_attention_scratch(Bmax, T, T, nh, hd));
    check_device_or_exit("attention setup");
    for (const Case &c : cases) {
        const double fl = 4.0 * c.B * nh * (double)T * T * hd / 2.0; /* causal: half */
        char name[96];
        double ms = 0;
        for (int shape = 0; shape < 3; shape++) { /* blocks of 8 x 16 rows (the default), 4 x 16, 4 x 32 */
            cuda_op_attention_set_forward_shape(shape);
            snprintf(name, sizeof name, "attention fwd%s%s bf16 B=%d T=%d nh=%d nkv=%d hd=%d", shape ? " " : "",
                     shape ? cuda_op_attention_forward_shape_name(shape) : "", c.B, T, nh, c.nkv, hd);
            ms = time_ms(name, [&] {
                return cuda_op_attention_forward(o, lse, q, k, v, pos, pos, NULL, NULL, c.B, T, T, nh, c.nkv, hd, 0,
                                                 scratch, CUDA_R_16BF, 0);
            });
            report_flops(name, ms, fl);
        }
        cuda_op_attention_set_forward_shape(shape0);
        for (int form = 0; form < 3; form++) { /* the split kernels (the default), fused, fused-8x16 */
            cuda_op_attention_set_backward_form(form);
            snprintf(name, sizeof name, "attention bwd%s%s bf16 B=%d T=%d nh=%d nkv=%d hd=%d", form ? " " : "",
                     form ? cuda_op_attention_backward_form_name(form) : "", c.B, T, nh, c.nkv, hd);
            ms = time_ms(name, [&] {
                return cuda_op_attention_backward(dq, dk, dv, dout, q, k, v, o, lse, pos, pos, NULL, NULL, c.B, T, T,
                                                  nh, c.nkv, hd, 0, scratch, CUDA_R_16BF, 0);
            });
            report_flops(name, ms, 2.5 * fl);
        }
        cuda_op_attention_set_backward_form(form0);
    }
    { /* the portable fp32 kernel (parity tests, odd head sizes), for scale */
        const int B = 1, Ts = T / 4, nhs = nh / 4;
        const size_t n = (size_t)B * Ts * nhs * hd;
        float *qf = rand_f32(n, 2.0f), *kf = rand_f32(n, 2.0f), *vf = rand_f32(n), *of = rand_f32(n);
        const double fl = 4.0 * B * nhs * (double)Ts * Ts * hd / 2.0;
        double ms = time_ms("attention fwd f32", [&] {
            return cuda_op_attention_forward(of, lse, qf, kf, vf, pos, pos, NULL, NULL, B, Ts, Ts, nhs, nhs, hd, 0,
                                             scratch, CUDA_R_32F, 0);
        });
        report_flops("attention fwd f32 (portable) B=1 T=1024 nh=8 hd=128", ms, fl);
        cudaFree(qf);
        cudaFree(kf);
        cudaFree(vf);
        cudaFree(of);
    }
    cudaFree(pos);
    cudaFree(scratch);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(dout);
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(lse);
}

int main(int argc, char **argv)
{
    const char *only = NULL; /* copy, ops, gemms or attention: that group alone (the profile of gpu-check) */
    if (!check_args(argc, argv, &quick, &only)) return 2;
    if (!check_device("bench")) return 0;
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("bench: device %s, %d SMs, L2 %d MiB, %.1f GiB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20,
           p.totalGlobalMem / 1073741824.0);
    fflush(stdout);
    if (!only || strstr("copy", only)) bench_copy();
    if (!only || strstr("ops", only)) bench_ops();
    check_device_or_exit("ops");
    if (!only || strstr("gemms", only)) bench_gemms();
    check_device_or_exit("gemms");
    if (!only || strstr("attention", only)) bench_attention();
    check_device_or_exit("attention");
    printf("\nbench summary (%d failed)\n", n_fail);
    for (const Summary &s : summary) printf("  %-52s %10.2f %s\n", s.name, s.value, s.unit);
    return n_fail ? 1 : 0;
}
