/* tests/unit/test_kernels.c: self-contained checks of the portable C ops that need
 * no Python: central finite differences against each backward (rmsnorm, layernorm,
 * swiglu, gelu, bias, rope (partial too), attention, cross-entropy) on tiny shapes,
 * the attention log-sum-exp merge, GPT-NeoX's qkv split and its adjoint, and the
 * Mixture-of-Experts ops (routing against hand values and finite differences,
 * gather / combine / scatter_add against hand values and their adjoint identities).
 * The comparisons with torch live in tests/oracle/test_kernels.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "ops.h"
#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- helpers ------------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static void rng_seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }

/* uniform in [-a, a) (xorshift64*) */
static float urand(float a)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 0x2545f4914f6cdd1dull;
    return a * (2.0f * (float)((r >> 40) * (1.0 / 16777216.0)) - 1.0f);
}

static void fill(float *x, size_t n, float a)
{
    for (size_t i = 0; i < n; i++)
        x[i] = urand(a);
}

static double dotd(const float *a, const float *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

/* |got - ref| <= tol * max(max|ref|, floor) for every element; on failure names the
 * first bad element. Finite differences in fp32 carry noise of ~1e-4, hence a
 * tolerance relative to the tensor's scale rather than to each element. */
static void check_close(const char *what, const float *got, const float *ref, size_t n,
                        double tol, double floor_)
{
    double scale = floor_;
    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs((double)ref[i]));
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)ref[i]);
        if (!(err <= tol * scale))
            fail_msg("%s[%zu]: got %.7g, expected %.7g (err %.3g > %.3g)", what, i,
                     (double)got[i], (double)ref[i], err, tol * scale);
    }
}

/* A scalar loss L(x) evaluated by a forward; fd_grad fills g[i] = dL/dx[i] by
 * central differences, perturbing x in place and restoring it. */
typedef double (*loss_fn)(void *ctx);

static void fd_grad(float *g, float *x, size_t n, loss_fn f, void *ctx, float h)
{
    for (size_t i = 0; i < n; i++) {
        float x0 = x[i];
        x[i] = x0 + h;
        double lp = f(ctx);
        x[i] = x0 - h;
        double lm = f(ctx);
        x[i] = x0;
        g[i] = (float)((lp - lm) / (2.0 * h));
    }
}

/* step 1e-2: truncation error ~h^2 and fp32 rounding ~1e-7/h leave errors of
 * ~4e-5 of the scale on these shapes; FD_TOL keeps a margin of ~10 */
#define FD_H 1e-2f
#define FD_TOL 3e-4

/* ---- RMSNorm --------------------------------------------------------------------- */

enum { RN_N = 3, RN_H = 7 };
typedef struct {
    float x[RN_N * RN_H], w[RN_H], dout[RN_N * RN_H];
} rms_ctx;

static double rms_loss(void *p)
{
    rms_ctx *c = p;
    float out[RN_N * RN_H], rstd[RN_N];
    op_rmsnorm_forward(out, rstd, c->x, c->w, RN_N, RN_H, 1e-5f);
    return dotd(out, c->dout, RN_N * RN_H);
}

static void test_rmsnorm_fd(void **state)
{
    (void)state;
    rng_seed(1);
    rms_ctx c;
    fill(c.x, RN_N * RN_H, 2.0f);
    fill(c.w, RN_H, 1.5f);
    fill(c.dout, RN_N * RN_H, 1.0f);

    float out[RN_N * RN_H], rstd[RN_N];
    op_rmsnorm_forward(out, rstd, c.x, c.w, RN_N, RN_H, 1e-5f);
    for (int n = 0; n < RN_N; n++) { /* rstd is what its name says */
        double ms = dotd(c.x + n * RN_H, c.x + n * RN_H, RN_H) / RN_H;
        assert_true(fabs(rstd[n] - 1.0 / sqrt(ms + 1e-5)) < 1e-5 * rstd[n]);
    }
    float dx[RN_N * RN_H] = {0}, dw[RN_H] = {0}, fx[RN_N * RN_H], fw[RN_H];
    op_rmsnorm_backward(dx, dw, c.dout, c.x, c.w, rstd, RN_N, RN_H);
    fd_grad(fx, c.x, RN_N * RN_H, rms_loss, &c, FD_H);
    fd_grad(fw, c.w, RN_H, rms_loss, &c, FD_H);
    check_close("rmsnorm dinp", dx, fx, RN_N * RN_H, FD_TOL, 1e-3);
    check_close("rmsnorm dweight", dw, fw, RN_H, FD_TOL, 1e-3);
}

/* ---- LayerNorm ------------------------------------------------------------------- */

enum { LN_N = 3, LN_H = 70 }; /* H spans two of the parameter gradients' column blocks */
typedef struct {
    float x[LN_N * LN_H], w[LN_H], b[LN_H], dout[LN_N * LN_H];
} ln_ctx;

static double ln_loss(void *p)
{
    ln_ctx *c = p;
    static float out[LN_N * LN_H];
    float mean[LN_N], rstd[LN_N];
    op_layernorm_forward(out, mean, rstd, c->x, c->w, c->b, LN_N, LN_H, 1e-5f);
    return dotd(out, c->dout, LN_N * LN_H);
}

static void test_layernorm_fd(void **state)
{
    (void)state;
    rng_seed(11);
    static ln_ctx c;
    fill(c.x, LN_N * LN_H, 2.0f);
    for (int i = 0; i < LN_N * LN_H; i++)
        c.x[i] += 1.0f + (float)(i / LN_H); /* rows off zero: the centering matters */
    fill(c.w, LN_H, 1.5f);
    fill(c.b, LN_H, 1.0f);
    fill(c.dout, LN_N * LN_H, 1.0f);

    static float out[LN_N * LN_H];
    float mean[LN_N], rstd[LN_N];
    op_layernorm_forward(out, mean, rstd, c.x, c.w, c.b, LN_N, LN_H, 1e-5f);
    for (int n = 0; n < LN_N; n++) { /* mean and rstd (biased variance) are what they say */
        const float *x = c.x + n * LN_H;
        double mu = 0.0, var = 0.0;
        for (int j = 0; j < LN_H; j++)
            mu += x[j];
        mu /= LN_H;
        for (int j = 0; j < LN_H; j++)
            var += (x[j] - mu) * (x[j] - mu);
        var /= LN_H;
        assert_true(fabs(mean[n] - mu) < 1e-6 * fabs(mu) + 1e-7);
        assert_true(fabs(rstd[n] - 1.0 / sqrt(var + 1e-5)) < 1e-5 * rstd[n]);
        for (int j = 0; j < LN_H; j++) {
            double y = (x[j] - mu) / sqrt(var + 1e-5) * c.w[j] + c.b[j];
            assert_true(fabs(out[n * LN_H + j] - y) < 1e-5 * (1.0 + fabs(y)));
        }
    }
    /* the gradients accumulate into what is there */
    static float dx[LN_N * LN_H], fx[LN_N * LN_H];
    float dw[LN_H], db[LN_H], fw[LN_H], fb[LN_H], dw0[LN_H], db0[LN_H];
    fill(dx, LN_N * LN_H, 1.0f);
    fill(dw0, LN_H, 1.0f);
    fill(db0, LN_H, 1.0f);
    memcpy(dw, dw0, sizeof dw);
    memcpy(db, db0, sizeof db);
    static float dx0[LN_N * LN_H];
    memcpy(dx0, dx, sizeof dx);
    op_layernorm_backward(dx, dw, db, c.dout, c.x, c.w, mean, rstd, LN_N, LN_H);
    fd_grad(fx, c.x, LN_N * LN_H, ln_loss, &c, FD_H);
    fd_grad(fw, c.w, LN_H, ln_loss, &c, FD_H);
    fd_grad(fb, c.b, LN_H, ln_loss, &c, FD_H);
    for (int i = 0; i < LN_N * LN_H; i++)
        fx[i] += dx0[i];
    for (int j = 0; j < LN_H; j++) {
        fw[j] += dw0[j];
        fb[j] += db0[j];
    }
    check_close("layernorm dinp (+=)", dx, fx, LN_N * LN_H, FD_TOL, 1e-3);
    check_close("layernorm dweight (+=)", dw, fw, LN_H, FD_TOL, 1e-3);
    check_close("layernorm dbias (+=)", db, fb, LN_H, FD_TOL, 1e-3);

    /* NULL skips a gradient; the others are the same as with all three */
    float dw2[LN_H], db2[LN_H];
    memcpy(dw2, dw0, sizeof dw2);
    memcpy(db2, db0, sizeof db2);
    op_layernorm_backward(NULL, dw2, NULL, c.dout, c.x, c.w, mean, rstd, LN_N, LN_H);
    op_layernorm_backward(NULL, NULL, db2, c.dout, c.x, c.w, mean, rstd, LN_N, LN_H);
    assert_memory_equal(dw2, dw, sizeof dw);
    assert_memory_equal(db2, db, sizeof db);
    memcpy(dx, dx0, sizeof dx);
    op_layernorm_backward(dx, NULL, NULL, c.dout, c.x, c.w, mean, rstd, LN_N, LN_H);
    check_close("layernorm dinp alone", dx, fx, LN_N * LN_H, FD_TOL, 1e-3);

    /* bias NULL: the same output less the bias */
    static float out2[LN_N * LN_H];
    op_layernorm_forward(out2, mean, rstd, c.x, c.w, NULL, LN_N, LN_H, 1e-5f);
    for (int i = 0; i < LN_N * LN_H; i++)
        assert_true(out2[i] + c.b[i % LN_H] == out[i]);
}

/* the bits of every output and gradient do not depend on the thread count */
static void test_layernorm_threads(void **state)
{
    (void)state;
#ifdef _OPENMP
    enum { N = 97, H = 333 };
    static float x[N * H], g[N * H], w[H], b[H], y[2][N * H], mean[2][N], rstd[2][N];
    static float dx[2][N * H], dw[2][H], db[2][H];
    rng_seed(12);
    fill(x, (size_t)N * H, 3.0f);
    fill(g, (size_t)N * H, 1.0f);
    fill(w, H, 1.0f);
    fill(b, H, 1.0f);
    int saved = omp_get_max_threads();
    for (int k = 0; k < 2; k++) {
        omp_set_num_threads(k ? 4 : 1);
        op_layernorm_forward(y[k], mean[k], rstd[k], x, w, b, N, H, 1e-5f);
        op_layernorm_backward(dx[k], dw[k], db[k], g, x, w, mean[k], rstd[k], N, H);
    }
    omp_set_num_threads(saved);
    assert_memory_equal(y[0], y[1], sizeof y[0]);
    assert_memory_equal(rstd[0], rstd[1], sizeof rstd[0]);
    assert_memory_equal(dx[0], dx[1], sizeof dx[0]);
    assert_memory_equal(dw[0], dw[1], sizeof dw[0]);
    assert_memory_equal(db[0], db[1], sizeof db[0]);
#else
    skip();
#endif
}

/* ---- bias -------------------------------------------------------------------------- */

/* C spans several of the backward's 64-column blocks and ends inside one */
enum { BI_N = 5, BI_C = 131 };
typedef struct {
    float x[BI_N * BI_C], b[BI_C], dout[BI_N * BI_C];
} bias_ctx;

static double bias_loss(void *p)
{
    bias_ctx *c = p;
    static float out[BI_N * BI_C];
    memcpy(out, c->x, sizeof out);
    op_bias_forward(out, c->b, BI_N, BI_C);
    return dotd(out, c->dout, BI_N * BI_C);
}

static void test_bias(void **state)
{
    (void)state;
    rng_seed(9);
    bias_ctx c;
    fill(c.x, BI_N * BI_C, 2.0f);
    fill(c.b, BI_C, 1.5f);
    fill(c.dout, BI_N * BI_C, 1.0f);

    /* forward: in place, every row gets the bias, exactly */
    static float out[BI_N * BI_C];
    memcpy(out, c.x, sizeof out);
    op_bias_forward(out, c.b, BI_N, BI_C);
    for (int n = 0; n < BI_N; n++)
        for (int j = 0; j < BI_C; j++)
            assert_true(out[n * BI_C + j] == c.x[n * BI_C + j] + c.b[j]);

    /* backward accumulates the column sums (fp32 rounding of a double sum) */
    float db0[BI_C], db[BI_C], ref[BI_C], fb[BI_C];
    fill(db0, BI_C, 1.0f);
    memcpy(db, db0, sizeof db);
    op_bias_backward(db, c.dout, BI_N, BI_C);
    for (int j = 0; j < BI_C; j++) {
        double s = 0.0;
        for (int n = 0; n < BI_N; n++)
            s += c.dout[n * BI_C + j];
        ref[j] = db0[j] + (float)s;
    }
    check_close("bias dbias (+=)", db, ref, BI_C, 1e-6, 1e-3);

    /* and it is the gradient of the forward */
    float g[BI_C] = {0};
    op_bias_backward(g, c.dout, BI_N, BI_C);
    fd_grad(fb, c.b, BI_C, bias_loss, &c, FD_H);
    check_close("bias dbias vs finite differences", g, fb, BI_C, FD_TOL, 1e-3);

    /* N = 1 and C = 1 */
    float one = 0.5f, col[3] = {1.0f, -2.0f, 4.0f}, d1 = 0.25f;
    op_bias_forward(col, &one, 3, 1);
    assert_true(col[0] == 1.5f && col[1] == -1.5f && col[2] == 4.5f);
    op_bias_backward(&d1, col, 3, 1);
    assert_true(d1 == 0.25f + 4.5f);
    float row[BI_C];
    memcpy(row, c.x, sizeof row);
    op_bias_forward(row, c.b, 1, BI_C);
    float drow[BI_C] = {0};
    op_bias_backward(drow, row, 1, BI_C);
    assert_memory_equal(drow, row, sizeof row);
}

/* the gradient's bits do not depend on the thread count */
static void test_bias_threads(void **state)
{
    (void)state;
#ifdef _OPENMP
    enum { N = 300, C = 333 };
    static float dout[N * C], d1[C], d4[C];
    rng_seed(10);
    fill(dout, (size_t)N * C, 1.0f);
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    op_bias_backward(d1, dout, N, C);
    omp_set_num_threads(4);
    op_bias_backward(d4, dout, N, C);
    omp_set_num_threads(saved);
    assert_memory_equal(d1, d4, sizeof d1);
#else
    skip();
#endif
}

/* ---- GPT-NeoX's fused qkv ------------------------------------------------------------ */

enum { QK_N = 3, QK_NH = 4, QK_HD = 5, QK_ONE = QK_N * QK_NH * QK_HD, QK_ALL = 3 * QK_ONE };

static void test_qkv(void **state)
{
    (void)state;
    rng_seed(13);
    float x[QK_ALL], q[QK_ONE], k[QK_ONE], v[QK_ONE], y[QK_ALL];
    fill(x, QK_ALL, 2.0f);
    memset(q, 0xff, sizeof q); /* NaNs: split writes every element */
    op_qkv_split(q, k, v, x, QK_N, QK_NH, QK_HD);
    const float *parts[3] = {q, k, v};
    for (int n = 0; n < QK_N; n++) /* x [N, nh, 3, hd] -> part [N, nh, hd] */
        for (int h = 0; h < QK_NH; h++)
            for (int p = 0; p < 3; p++)
                for (int j = 0; j < QK_HD; j++)
                    assert_true(parts[p][(n * QK_NH + h) * QK_HD + j] == x[((n * QK_NH + h) * 3 + p) * QK_HD + j]);

    /* merge undoes split, bit for bit */
    memset(y, 0xff, sizeof y);
    op_qkv_merge(y, q, k, v, QK_N, QK_NH, QK_HD);
    assert_memory_equal(y, x, sizeof x);

    /* merge is split's adjoint: <split(x), (a, b, c)> == <x, merge(a, b, c)> */
    float a[QK_ONE], b[QK_ONE], c[QK_ONE];
    fill(a, QK_ONE, 1.0f);
    fill(b, QK_ONE, 1.0f);
    fill(c, QK_ONE, 1.0f);
    op_qkv_merge(y, a, b, c, QK_N, QK_NH, QK_HD);
    double lhs = dotd(q, a, QK_ONE) + dotd(k, b, QK_ONE) + dotd(v, c, QK_ONE), rhs = dotd(x, y, QK_ALL);
    assert_true(fabs(lhs - rhs) <= 1e-12 * (fabs(lhs) + 1.0));
}

/* ---- Mixture of experts ------------------------------------------------------------- */

/* softmax in double, for the expectations */
static void softmax_d(double *p, const float *z, int E)
{
    double m = z[0], s = 0.0;
    for (int e = 1; e < E; e++) m = fmax(m, z[e]);
    for (int e = 0; e < E; e++) s += p[e] = exp(z[e] - m);
    for (int e = 0; e < E; e++) p[e] /= s;
}

static void test_moe_route(void **state)
{
    (void)state;
    /* row 0: a clear order 1, 2, 0, 3; row 1: ties (experts 1 and 3, then 0 and 2) */
    const float z[8] = {1.0f, 3.0f, 2.0f, 0.0f, 0.5f, 2.0f, 0.5f, 2.0f};
    float probs[8], wts[6];
    int32_t idx[6];
    double p[4];
    op_moe_route(probs, idx, wts, z, 2, 4, 2, 0);
    for (int t = 0; t < 2; t++) {
        softmax_d(p, z + 4 * t, 4);
        for (int e = 0; e < 4; e++) assert_true(fabs(probs[4 * t + e] - p[e]) <= 1e-6 * p[e]);
    }
    assert_true(idx[0] == 1 && idx[1] == 2 && idx[2] == 1 && idx[3] == 3);
    assert_true(wts[0] == probs[1] && wts[1] == probs[2] && wts[2] == probs[5] && wts[3] == probs[7]);

    /* renorm: the chosen weights sum to 1; row 0's are sigmoid(+-1) */
    op_moe_route(probs, idx, wts, z, 2, 4, 2, 1);
    assert_true(fabs(wts[0] - 1.0 / (1.0 + exp(-1.0))) < 1e-6 && fabs(wts[1] - 1.0 / (1.0 + exp(1.0))) < 1e-6);
    assert_true(fabs(wts[2] - 0.5) < 1e-7 && fabs(wts[3] - 0.5) < 1e-7);

    /* k = 3 reaches into the second tie: the lower expert first; k = E takes them all */
    op_moe_route(probs, idx, wts, z + 4, 1, 4, 3, 0);
    assert_true(idx[0] == 1 && idx[1] == 3 && idx[2] == 0);
    op_moe_route(probs, idx, wts, z + 4, 1, 4, 4, 1);
    assert_true(idx[0] == 1 && idx[1] == 3 && idx[2] == 0 && idx[3] == 2);
    assert_true(fabs(wts[0] - probs[1]) < 1e-7); /* renormalizing all of them changes little */

    /* a NaN logit makes the row's probs NaN; the picks stay valid experts, lowest first */
    const float zn[4] = {1.0f, NAN, 2.0f, 0.0f};
    op_moe_route(probs, idx, wts, zn, 1, 4, 2, 1);
    assert_true(idx[0] == 0 && idx[1] == 1 && isnan(wts[0]) && isnan(probs[2]));
}

enum { MR_N = 3, MR_E = 6, MR_K = 2 };
typedef struct {
    float z[MR_N * MR_E], gw[MR_N * MR_K], gp[MR_N * MR_E];
    int renorm, with_gp;
} route_ctx;

/* sum(wts * gw) + sum(probs * gp) */
static double route_loss(void *p)
{
    route_ctx *c = p;
    float probs[MR_N * MR_E], wts[MR_N * MR_K];
    int32_t idx[MR_N * MR_K];
    op_moe_route(probs, idx, wts, c->z, MR_N, MR_E, MR_K, c->renorm);
    return dotd(wts, c->gw, MR_N * MR_K) + (c->with_gp ? dotd(probs, c->gp, MR_N * MR_E) : 0.0);
}

static void route_fd_case(route_ctx *c)
{
    float probs[MR_N * MR_E], wts[MR_N * MR_K], dz[MR_N * MR_E], fz[MR_N * MR_E];
    int32_t idx[MR_N * MR_K];
    op_moe_route(probs, idx, wts, c->z, MR_N, MR_E, MR_K, c->renorm);
    memset(dz, 0xff, sizeof dz); /* written */
    op_moe_route_backward(dz, c->gw, c->with_gp ? c->gp : NULL, probs, idx, MR_N, MR_E, MR_K, c->renorm);
    fd_grad(fz, c->z, MR_N * MR_E, route_loss, c, FD_H);
    check_close("moe route dlogits", dz, fz, MR_N * MR_E, FD_TOL, 1e-3);
}

static void test_moe_route_fd(void **state)
{
    (void)state;
    rng_seed(21);
    route_ctx c;
    /* logits 0.4 apart (a permutation per row) plus noise: the top k stays put under +-h */
    for (int t = 0; t < MR_N; t++)
        for (int e = 0; e < MR_E; e++) c.z[t * MR_E + e] = 0.4f * (float)((5 * e + 2 * t) % MR_E) + urand(0.05f);
    fill(c.gw, MR_N * MR_K, 1.0f);
    fill(c.gp, MR_N * MR_E, 1.0f);
    for (int renorm = 0; renorm < 2; renorm++)
        for (int with_gp = 0; with_gp < 2; with_gp++) {
            c.renorm = renorm, c.with_gp = with_gp;
            route_fd_case(&c);
        }
}

enum { MC_N = 3, MC_K = 2, MC_H = 5, MC_S = MC_N * MC_K };

static void test_moe_gather(void **state)
{
    (void)state;
    rng_seed(22);
    float x[MC_N * MC_H], xs[4 * MC_H];
    const int32_t rows[4] = {2, 0, 2, 1};
    fill(x, MC_N * MC_H, 1.0f);
    op_moe_gather(xs, x, rows, 4, MC_H);
    for (int p = 0; p < 4; p++) assert_memory_equal(xs + p * MC_H, x + rows[p] * MC_H, MC_H * sizeof(float));
}

static void test_moe_combine(void **state)
{
    (void)state;
    rng_seed(23);
    /* token t's expert rows: a permutation of the 6 slots */
    const int32_t slot[MC_S] = {4, 1, 0, 5, 3, 2};
    float ys[MC_S * MC_H], wts[MC_S], out[MC_N * MC_H], dout[MC_N * MC_H], dys[MC_S * MC_H], dwts[MC_S];
    fill(ys, MC_S * MC_H, 1.0f);
    fill(wts, MC_S, 1.0f);
    fill(dout, MC_N * MC_H, 1.0f);
    memset(out, 0xff, sizeof out); /* written */
    op_moe_combine(out, ys, wts, slot, MC_N, MC_K, MC_H);
    for (int t = 0; t < MC_N; t++)
        for (int h = 0; h < MC_H; h++) {
            float want = 0.0f;
            for (int j = 0; j < MC_K; j++) want += wts[t * MC_K + j] * ys[slot[t * MC_K + j] * MC_H + h];
            assert_true(out[t * MC_H + h] == want);
        }

    memset(dys, 0xff, sizeof dys);
    memset(dwts, 0xff, sizeof dwts);
    op_moe_combine_backward(dys, dwts, dout, ys, wts, slot, MC_N, MC_K, MC_H);
    for (int t = 0; t < MC_N; t++)
        for (int j = 0; j < MC_K; j++) {
            const int s = slot[t * MC_K + j];
            for (int h = 0; h < MC_H; h++) assert_true(dys[s * MC_H + h] == wts[t * MC_K + j] * dout[t * MC_H + h]);
            assert_true(fabs(dwts[t * MC_K + j] - dotd(dout + t * MC_H, ys + s * MC_H, MC_H)) < 1e-6);
        }

    /* adjoints: out is linear in ys and in wts, so <out, dout> = <ys, dys> = <wts, dwts> */
    const double lhs = dotd(out, dout, MC_N * MC_H);
    assert_true(fabs(lhs - dotd(ys, dys, MC_S * MC_H)) <= 1e-6 * (fabs(lhs) + 1.0));
    assert_true(fabs(lhs - dotd(wts, dwts, MC_S)) <= 1e-6 * (fabs(lhs) + 1.0));
}

/* scatter_add is the adjoint of gathering each token into its slots */
static void test_moe_scatter_add(void **state)
{
    (void)state;
    rng_seed(24);
    const int32_t slot[MC_S] = {4, 1, 0, 5, 3, 2};
    int32_t rows[MC_S];
    for (int i = 0; i < MC_S; i++) rows[slot[i]] = i / MC_K;
    float x[MC_N * MC_H], xs[MC_S * MC_H], g[MC_S * MC_H], dx0[MC_N * MC_H], dx[MC_N * MC_H];
    fill(x, MC_N * MC_H, 1.0f);
    fill(g, MC_S * MC_H, 1.0f);
    fill(dx0, MC_N * MC_H, 1.0f);
    memcpy(dx, dx0, sizeof dx);
    op_moe_scatter_add(dx, g, slot, MC_N, MC_K, MC_H);
    for (int t = 0; t < MC_N; t++) /* accumulated */
        for (int h = 0; h < MC_H; h++)
            assert_true(dx[t * MC_H + h] ==
                        dx0[t * MC_H + h] + (g[slot[t * MC_K] * MC_H + h] + g[slot[t * MC_K + 1] * MC_H + h]));
    op_moe_gather(xs, x, rows, MC_S, MC_H);
    memset(dx, 0, sizeof dx);
    op_moe_scatter_add(dx, g, slot, MC_N, MC_K, MC_H);
    const double lhs = dotd(xs, g, MC_S * MC_H), rhs = dotd(x, dx, MC_N * MC_H);
    assert_true(fabs(lhs - rhs) <= 1e-6 * (fabs(lhs) + 1.0));
}

/* 4 tokens, k = 2, 3 experts (expert 2 gets none... then one): by hand */
static void test_moe_group(void **state)
{
    (void)state;
    const int32_t idx[8] = {1, 0, 0, 1, 1, 0, 2, 1}; /* token t's choices at 2t, 2t+1 */
    int32_t off[4], rows[8], slot[8];
    op_moe_group(off, rows, slot, idx, 4, 2, 3);
    const int32_t off_want[4] = {0, 3, 7, 8};          /* expert 0: 3 pairs, 1: 4, 2: 1 */
    const int32_t rows_want[8] = {0, 1, 2, 0, 1, 2, 3, 3}; /* tokens in order within each expert */
    const int32_t slot_want[8] = {3, 0, 1, 4, 5, 2, 7, 6};
    assert_memory_equal(off, off_want, sizeof off);
    assert_memory_equal(rows, rows_want, sizeof rows);
    assert_memory_equal(slot, slot_want, sizeof slot);
    for (int p = 0; p < 8; p++) assert_int_equal(rows[slot[p]], p / 2); /* slot inverts rows */
    /* no tokens: every expert empty */
    op_moe_group(off, rows, slot, idx, 0, 2, 3);
    assert_true(off[0] == 0 && off[1] == 0 && off[2] == 0 && off[3] == 0);

    const float probs[6] = {0.5f, 0.25f, 0.25f, 0.125f, 0.75f, 0.125f};
    double sums[3];
    op_moe_prob_sums(sums, probs, 2, 3);
    assert_true(sums[0] == 0.625 && sums[1] == 1.0 && sums[2] == 0.375);
}

/* the routing and the combine's dot products do not depend on the thread count */
static void test_moe_threads(void **state)
{
    (void)state;
#ifdef _OPENMP
    enum { N = 257, E = 8, K = 2, H = 33, S = N * K };
    static float z[N * E], p[2][N * E], w[2][S], ys[S * H], dout[N * H], dys[S * H], dw[2][S];
    static int32_t ix[2][S], slot[S];
    rng_seed(25);
    fill(z, N * E, 2.0f);
    fill(dout, N * H, 1.0f);
    fill(ys, S * H, 1.0f);
    for (int i = 0; i < S; i++) slot[i] = S - 1 - i;
    const int saved = omp_get_max_threads(), threads[2] = {1, 4};
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(threads[r]);
        op_moe_route(p[r], ix[r], w[r], z, N, E, K, 1);
        op_moe_combine_backward(dys, dw[r], dout, ys, w[r], slot, N, K, H);
    }
    omp_set_num_threads(saved);
    assert_memory_equal(p[0], p[1], sizeof p[0]);
    assert_memory_equal(ix[0], ix[1], sizeof ix[0]);
    assert_memory_equal(w[0], w[1], sizeof w[0]);
    assert_memory_equal(dw[0], dw[1], sizeof dw[0]);
#else
    skip();
#endif
}

/* ---- RoPE, full and partial (GPT-NeoX's rotary_pct) ----------------------------- */

enum { RP_T = 5, RP_NH = 2, RP_HD = 12, RP_RD = 4 };
typedef struct {
    float x[RP_T * RP_NH * RP_HD], dout[RP_T * RP_NH * RP_HD], cs[RP_T * RP_HD], sn[RP_T * RP_HD];
    int rd;
} rope_ctx;

static double rope_loss(void *p)
{
    rope_ctx *c = p;
    static float y[RP_T * RP_NH * RP_HD];
    memcpy(y, c->x, sizeof y);
    op_rope_forward(y, c->cs, c->sn, 1, RP_T, RP_NH, RP_HD, c->rd);
    return dotd(y, c->dout, RP_T * RP_NH * RP_HD);
}

static void test_rope_fd(void **state)
{
    (void)state;
    enum { NX = RP_T * RP_NH * RP_HD };
    op_rope_params p = {.theta = 10000.0f};
    int32_t pos[RP_T] = {0, 1, 7, 30, 31};
    static rope_ctx c;
    for (int k = 0; k < 2; k++) {
        c.rd = k ? RP_RD : RP_HD;
        rng_seed(13 + (uint64_t)k);
        fill(c.x, NX, 1.0f);
        fill(c.dout, NX, 1.0f);
        float inv[RP_HD / 2];
        op_rope_inv_freq(inv, c.rd, &p);
        for (int i = 0; i < c.rd / 2; i++) /* 1 / theta^(2i / rotary_dim) */
            assert_true(fabs(inv[i] - pow(10000.0, -2.0 * i / c.rd)) < 1e-6 * inv[i]);
        op_rope_table(c.cs, c.sn, pos, RP_T, inv, c.rd, 1.0f);
        static float y[NX], g[NX], fd[NX];
        memcpy(y, c.x, sizeof y);
        op_rope_forward(y, c.cs, c.sn, 1, RP_T, RP_NH, RP_HD, c.rd);
        for (int i = 0; i < NX; i++) {
            if (i % RP_HD >= c.rd)
                assert_true(memcmp(&y[i], &c.x[i], 4) == 0); /* the pass-through dims, to the bit */
        }
        /* a rotation keeps each head's rotated part's norm */
        for (int r = 0; r < RP_T * RP_NH; r++) {
            double a = dotd(c.x + r * RP_HD, c.x + r * RP_HD, c.rd), b = dotd(y + r * RP_HD, y + r * RP_HD, c.rd);
            assert_true(fabs(a - b) < 1e-5 * a);
        }
        memcpy(g, c.dout, sizeof g);
        op_rope_backward(g, c.cs, c.sn, 1, RP_T, RP_NH, RP_HD, c.rd);
        fd_grad(fd, c.x, NX, rope_loss, &c, FD_H);
        check_close(k ? "partial rope backward" : "rope backward", g, fd, NX, FD_TOL, 1e-3);
    }
    /* a partial rotary is, on the rotated dims, the full rotary of a head of rotary_dim dims */
    float inv[RP_RD / 2], cs[RP_T * RP_RD], sn[RP_T * RP_RD];
    op_rope_inv_freq(inv, RP_RD, &p);
    op_rope_table(cs, sn, pos, RP_T, inv, RP_RD, 1.0f);
    static float y[NX], z[RP_T * RP_NH * RP_RD];
    memcpy(y, c.x, sizeof y);
    for (int r = 0; r < RP_T * RP_NH; r++)
        memcpy(z + r * RP_RD, c.x + r * RP_HD, RP_RD * sizeof(float));
    op_rope_forward(y, cs, sn, 1, RP_T, RP_NH, RP_HD, RP_RD);
    op_rope_forward(z, cs, sn, 1, RP_T, RP_NH, RP_RD, RP_RD);
    for (int r = 0; r < RP_T * RP_NH; r++)
        assert_memory_equal(y + r * RP_HD, z + r * RP_RD, RP_RD * sizeof(float));
}

/* ---- GELU (exact) ----------------------------------------------------------------- */

enum { GE_N = 41 };
typedef struct {
    float x[GE_N], dout[GE_N];
} gelu_ctx;

static double gelu_loss(void *p)
{
    gelu_ctx *c = p;
    float out[GE_N];
    op_gelu_forward(out, c->x, GE_N);
    return dotd(out, c->dout, GE_N);
}

static void test_gelu_fd(void **state)
{
    (void)state;
    rng_seed(14);
    gelu_ctx c;
    fill(c.x, GE_N, 4.0f);
    fill(c.dout, GE_N, 1.0f);
    float out[GE_N];
    op_gelu_forward(out, c.x, GE_N);
    for (int i = 0; i < GE_N; i++) { /* x Phi(x), the erf form */
        double x = c.x[i], y = 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
        assert_true(fabs(out[i] - y) < 1e-6 * (1.0 + fabs(y)));
    }
    float d[GE_N], d0[GE_N], fd[GE_N];
    fill(d0, GE_N, 1.0f);
    memcpy(d, d0, sizeof d);
    op_gelu_backward(d, c.dout, c.x, GE_N);
    fd_grad(fd, c.x, GE_N, gelu_loss, &c, FD_H);
    for (int i = 0; i < GE_N; i++)
        fd[i] += d0[i];
    check_close("gelu dinp (+=)", d, fd, GE_N, FD_TOL, 1e-3);
}

/* ---- SwiGLU ----------------------------------------------------------------------- */

enum { SW_N = 23 };
typedef struct {
    float gate[SW_N], up[SW_N], dout[SW_N];
} swiglu_ctx;

static double swiglu_loss(void *p)
{
    swiglu_ctx *c = p;
    float out[SW_N];
    op_swiglu_forward(out, c->gate, c->up, SW_N);
    return dotd(out, c->dout, SW_N);
}

static void test_swiglu_fd(void **state)
{
    (void)state;
    rng_seed(2);
    swiglu_ctx c;
    fill(c.gate, SW_N, 5.0f);
    fill(c.up, SW_N, 1.0f);
    fill(c.dout, SW_N, 1.0f);
    float dg[SW_N] = {0}, du[SW_N] = {0}, fg[SW_N], fu[SW_N];
    op_swiglu_backward(dg, du, c.dout, c.gate, c.up, SW_N);
    fd_grad(fg, c.gate, SW_N, swiglu_loss, &c, FD_H);
    fd_grad(fu, c.up, SW_N, swiglu_loss, &c, FD_H);
    check_close("swiglu dgate", dg, fg, SW_N, FD_TOL, 1e-3);
    check_close("swiglu dup", du, fu, SW_N, FD_TOL, 1e-3);
}

/* ---- attention -------------------------------------------------------------------- */

enum { AB = 1, AT = 6, ANH = 4, ANKV = 2, AHD = 4, AMAXB = 2 };
enum { AQN = AB * AT * ANH * AHD, AKN = AB * AT * ANKV * AHD, ALN = AB * ANH * AT };
typedef struct {
    float q[AMAXB * AQN], k[AMAXB * AKN], v[AMAXB * AKN], dout[AMAXB * AQN];
    int32_t pos[AT];
    const int32_t *doc; /* [B][AT] for queries and keys alike, or NULL */
    int B, window;
} attn_ctx;

static double attn_loss(void *p)
{
    attn_ctx *c = p;
    float out[AMAXB * AQN], lse[AMAXB * ALN];
    op_attention_forward(out, lse, c->q, c->k, c->v, c->pos, c->pos, c->doc, c->doc, c->B, AT,
                         AT, ANH, ANKV, AHD, c->window);
    return dotd(out, c->dout, (size_t)c->B * AQN);
}

/* Random q, k, v, dout of B sequences at the positions of two cp chunks. */
static void attn_ctx_init(attn_ctx *c, uint64_t seed, int B, const int32_t *doc, int window)
{
    rng_seed(seed);
    fill(c->q, (size_t)B * AQN, 1.5f);
    fill(c->k, (size_t)B * AKN, 1.5f);
    fill(c->v, (size_t)B * AKN, 1.0f);
    fill(c->dout, (size_t)B * AQN, 1.0f);
    const int32_t pos[AT] = {0, 1, 2, 7, 8, 9}; /* two chunks, as a cp rank holds */
    memcpy(c->pos, pos, sizeof pos);
    c->doc = doc;
    c->B = B;
    c->window = window;
}

/* The backward of c against finite differences of its forward; out and lse kept. */
static void attn_fd_check(attn_ctx *c, float *out, float *lse)
{
    const size_t nq = (size_t)c->B * AQN, nk = (size_t)c->B * AKN;
    op_attention_forward(out, lse, c->q, c->k, c->v, c->pos, c->pos, c->doc, c->doc, c->B, AT, AT,
                         ANH, ANKV, AHD, c->window);
    float dq[AMAXB * AQN] = {0}, dk[AMAXB * AKN] = {0}, dv[AMAXB * AKN] = {0};
    float fq[AMAXB * AQN], fk[AMAXB * AKN], fv[AMAXB * AKN];
    op_attention_backward(dq, dk, dv, c->dout, c->q, c->k, c->v, out, lse, c->pos, c->pos, c->doc,
                          c->doc, c->B, AT, AT, ANH, ANKV, AHD, c->window);
    fd_grad(fq, c->q, nq, attn_loss, c, FD_H);
    fd_grad(fk, c->k, nk, attn_loss, c, FD_H);
    fd_grad(fv, c->v, nk, attn_loss, c, FD_H);
    check_close("attention dq", dq, fq, nq, FD_TOL, 1e-3);
    check_close("attention dk", dk, fk, nk, FD_TOL, 1e-3);
    check_close("attention dv", dv, fv, nk, FD_TOL, 1e-3);
}

static void attn_fd_case(int window)
{
    attn_ctx c;
    attn_ctx_init(&c, 3 + (uint64_t)window, AB, NULL, window);
    float out[AQN], lse[ALN];
    attn_fd_check(&c, out, lse);
}

static void test_attention_fd(void **state)
{
    (void)state;
    attn_fd_case(0);
}

static void test_attention_window_fd(void **state)
{
    (void)state;
    attn_fd_case(2);
}

/* Packed documents, split differently in the two sequences (ids: the position of
 * the document's first token; positions 3..6 are another rank's). Sequence 0 ends
 * with a one-token document, so that row's out is its own v exactly. */
static void test_attention_docs_fd(void **state)
{
    (void)state;
    const int32_t doc[AMAXB * AT] = {0, 0, 2, 5, 5, 9, /* */ 0, 0, 0, 0, 8, 8};
    attn_ctx c;
    attn_ctx_init(&c, 11, AMAXB, doc, 0);
    float out[AMAXB * AQN], lse[AMAXB * ALN];
    attn_fd_check(&c, out, lse);
    for (int h = 0; h < ANH; h++)
        for (int d = 0; d < AHD; d++)
            assert_true(out[((AT - 1) * ANH + h) * AHD + d] ==
                        c.v[((AT - 1) * ANKV + h / (ANH / ANKV)) * AHD + d]);
}

/* The mask reads positions through their differences alone: positions at int32's ends
 * (gaps up to 2^32 - 1, a window of INT32_MAX) give the same bits as small ones that
 * show and hide the same pairs: with these, each query sees itself and the one before
 * (gaps 1 and 2^31 - 2 are inside the window; 2^31 - 1, 2^31, 2^32 - 1 are not). */
static void test_attention_extreme_positions_bits(void **state)
{
    (void)state;
    const int32_t far[AT] = {INT32_MIN, INT32_MIN + 1, -1, 0, INT32_MAX - 1, INT32_MAX};
    const int32_t near[AT] = {0, 1, 2, 3, 4, 5};
    attn_ctx c;
    attn_ctx_init(&c, 17, AB, NULL, 0);
    float o[2][AQN], l[2][ALN], g[2][3][AQN];
    memset(g, 0, sizeof g);
    for (int pass = 0; pass < 2; pass++) {
        const int32_t *pos = pass ? near : far;
        const int window = pass ? 2 : INT32_MAX;
        op_attention_forward(o[pass], l[pass], c.q, c.k, c.v, pos, pos, NULL, NULL, AB, AT, AT, ANH, ANKV, AHD,
                             window);
        op_attention_backward(g[pass][0], g[pass][1], g[pass][2], c.dout, c.q, c.k, c.v, o[pass], l[pass], pos,
                              pos, NULL, NULL, AB, AT, AT, ANH, ANKV, AHD, window);
    }
    assert_memory_equal(o[0], o[1], sizeof o[0]);
    assert_memory_equal(l[0], l[1], sizeof l[0]);
    assert_memory_equal(g[0], g[1], sizeof g[0]);
    for (int h = 0; h < ANH; h++) /* query 0 sees only itself: its out is its v */
        for (int d = 0; d < AHD; d++)
            assert_true(o[0][h * AHD + d] == c.v[(h / (ANH / ANKV)) * AHD + d]);
}

/* No documents is one document per sequence: the same bits as any one id for all. */
static void test_attention_one_doc_bits(void **state)
{
    (void)state;
    int32_t same[AMAXB * AT];
    for (int i = 0; i < AMAXB * AT; i++)
        same[i] = 3;
    attn_ctx c;
    attn_ctx_init(&c, 13, AMAXB, NULL, 2);
    float o1[AMAXB * AQN], l1[AMAXB * ALN], o2[AMAXB * AQN], l2[AMAXB * ALN];
    float g1[3][AMAXB * AQN] = {{0}}, g2[3][AMAXB * AQN] = {{0}};
    for (int pass = 0; pass < 2; pass++) {
        const int32_t *doc = pass ? same : NULL;
        float *o = pass ? o2 : o1, *l = pass ? l2 : l1, (*g)[AMAXB * AQN] = pass ? g2 : g1;
        op_attention_forward(o, l, c.q, c.k, c.v, c.pos, c.pos, doc, doc, AMAXB, AT, AT, ANH, ANKV,
                             AHD, c.window);
        op_attention_backward(g[0], g[1], g[2], c.dout, c.q, c.k, c.v, o, l, c.pos, c.pos, doc, doc,
                              AMAXB, AT, AT, ANH, ANKV, AHD, c.window);
    }
    assert_memory_equal(o1, o2, sizeof o1);
    assert_memory_equal(l1, l2, sizeof l1);
    assert_memory_equal(g1, g2, sizeof g1);
}

/* Splitting the keys in two, attending to each part and merging by log-sum-exp gives
 * the attention over all keys; rows where a part sees nothing (lse = -inf) and rows
 * where both parts see nothing are merged correctly. */
static void test_attention_merge_identity(void **state)
{
    (void)state;
    rng_seed(5);
    float q[AQN], k[AKN], v[AKN];
    fill(q, AQN, 1.5f);
    fill(k, AKN, 1.5f);
    fill(v, AKN, 1.0f);
    const int32_t pos[AT] = {0, 1, 2, 7, 8, 9};
    const int cut = 2, rest = AT - cut; /* AB == 1: the key halves are contiguous */
    const size_t kv_row = ANKV * AHD;

    for (int window = 0; window <= 3; window += 3) {
        float out[AQN], lse[ALN], o1[AQN], l1[ALN], o2[AQN], l2[ALN];
        op_attention_forward(out, lse, q, k, v, pos, pos, NULL, NULL, AB, AT, AT, ANH, ANKV, AHD,
                             window);
        op_attention_forward(o1, l1, q, k, v, pos, pos, NULL, NULL, AB, AT, cut, ANH, ANKV, AHD,
                             window);
        op_attention_forward(o2, l2, q, k + cut * kv_row, v + cut * kv_row, pos, pos + cut, NULL,
                             NULL, AB, AT, rest, ANH, ANKV, AHD, window);
        int dead1 = 0, dead2 = 0;
        for (int i = 0; i < ALN; i++) {
            dead1 += isinf(l1[i]) && l1[i] < 0;
            dead2 += isinf(l2[i]) && l2[i] < 0;
        }
        assert_true(dead2 > 0);                /* early queries see no later key */
        assert_true(window == 0 || dead1 > 0); /* late queries: first keys out of window */
        op_attention_merge(o1, l1, o2, l2, AB, AT, ANH, AHD);
        check_close("merged out", o1, out, AQN, 1e-6, 1e-3);
        check_close("merged lse", l1, lse, ALN, 1e-6, 1e-3);
    }

    /* both parts empty: stays out = 0, lse = -inf (no NaN from -inf - -inf) */
    float o[AHD] = {0}, oo[AHD] = {0}, l[1] = {-INFINITY}, ll[1] = {-INFINITY};
    op_attention_merge(o, l, oo, ll, 1, 1, 1, AHD);
    assert_true(isinf(l[0]) && l[0] < 0);
    for (int d = 0; d < AHD; d++)
        assert_true(o[d] == 0.0f);
    /* only the second part: it is copied */
    float o2[AHD] = {1, 2, 3, 4}, l2[1] = {0.5f};
    op_attention_merge(o, l, o2, l2, 1, 1, 1, AHD);
    assert_true(l[0] == 0.5f && o[3] == 4.0f);
}

/* ---- cross-entropy ------------------------------------------------------------------ */

enum { XN = 4, XV = 9 };
typedef struct {
    float logits[XN * XV];
    int32_t targets[XN];
} xent_ctx;

/* the tp=1 pipeline: every statistic is already global */
static double xent_total(xent_ctx *c, float *rowmax, float *sumexp)
{
    float tl[XN], losses[XN];
    op_xent_rowmax(rowmax, tl, c->logits, c->targets, XN, XV, 0);
    op_xent_sumexp(sumexp, c->logits, rowmax, XN, XV);
    return op_xent_loss(losses, rowmax, sumexp, tl, c->targets, XN);
}

static double xent_loss(void *p)
{
    float rowmax[XN], sumexp[XN];
    return xent_total(p, rowmax, sumexp);
}

static void test_xent_fd(void **state)
{
    (void)state;
    rng_seed(6);
    xent_ctx c;
    fill(c.logits, XN * XV, 4.0f);
    const int32_t targets[XN] = {3, -1, 0, 8};
    memcpy(c.targets, targets, sizeof targets);

    float rowmax[XN], sumexp[XN];
    double total = xent_total(&c, rowmax, sumexp);
    double ref = 0.0; /* log-softmax, directly */
    for (int n = 0; n < XN; n++) {
        if (c.targets[n] < 0)
            continue;
        double s = 0.0;
        for (int j = 0; j < XV; j++)
            s += exp((double)c.logits[n * XV + j]);
        ref += log(s) - c.logits[n * XV + c.targets[n]];
    }
    assert_true(fabs(total - ref) < 1e-5 * fabs(ref));

    float d[XN * XV], fd[XN * XV];
    for (int i = 0; i < XN * XV; i++)
        d[i] = NAN; /* written, not accumulated */
    op_xent_backward(d, c.logits, rowmax, sumexp, c.targets, XN, XV, 0, 1.0f);
    fd_grad(fd, c.logits, XN * XV, xent_loss, &c, FD_H);
    check_close("xent dlogits", d, fd, XN * XV, FD_TOL, 1e-3);
    for (int j = 0; j < XV; j++) /* the ignored row has no gradient */
        assert_true(d[1 * XV + j] == 0.0f);
}

/* smp_expf (simd.h) at its edges, as its comment promises: NaN stays NaN, 0 below
 * e^-87.33, inf above e^88, and within 1 ulp of e^x (double exp, rounded) between */
static int32_t ulps(float a, float b)
{
    int32_t ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    return ia > ib ? ia - ib : ib - ia;
}

static void test_expf_edges(void **state)
{
    (void)state;
    assert_true(isnan(smp_expf(NAN)) && isnan(smp_expf(-NAN)));
    assert_true(smp_expf(-INFINITY) == 0.0f && smp_expf(-87.5f) == 0.0f && smp_expf(-1e30f) == 0.0f);
    assert_true(isinf(smp_expf(INFINITY)) && isinf(smp_expf(88.5f)) && isinf(smp_expf(1e30f)));
    assert_true(smp_expf(0.0f) == 1.0f);
    int32_t worst = 0;
    for (int i = 0; i <= 1000000; i++) {
        const float x = -87.3f + (88.0f + 87.3f) * (float)i / 1e6f;
        const int32_t u = ulps(smp_expf(x), (float)exp((double)x));
        worst = u > worst ? u : worst;
    }
    assert_true(worst <= 1);
}

/* smp_expf_shifted (simd.h, the attention's and cross-entropy's softmax): within 1 ulp
 * of e^x (double exp, rounded) on its domain, x in [-87.33, 0], and 2 above it up to
 * e^88; e^0 exactly 1; exactly 0 at -inf and below about -87.7, under 1.2e-38 between;
 * NaN kept, and +inf (outside what it is for: nothing clamps above) NaN, not a number
 * that could pass for e^x */
static void test_expf_shifted(void **state)
{
    (void)state;
    const smp_exp_bounds b = smp_exp_bounds_opaque();
    assert_true(isnan(smp_expf_shifted(NAN, b)) && isnan(smp_expf_shifted(-NAN, b)) &&
                isnan(smp_expf_shifted(INFINITY, b)));
    assert_true(smp_expf_shifted(-INFINITY, b) == 0.0f && smp_expf_shifted(-88.0f, b) == 0.0f &&
                smp_expf_shifted(-87.8f, b) == 0.0f && smp_expf_shifted(-1e30f, b) == 0.0f);
    assert_true(smp_expf_shifted(0.0f, b) == 1.0f && smp_expf_shifted(-0.0f, b) == 1.0f);
    for (float x = -87.7f; x < -87.33f; x += 0.01f) {
        const float e = smp_expf_shifted(x, b);
        assert_true(e >= 0.0f && e < 1.2e-38f);
    }
    int32_t worst[2] = {0, 0}; /* x <= 0, x > 0 */
    for (int i = 0; i <= 1000000; i++) {
        const float x = -87.33f + (88.0f + 87.33f) * (float)i / 1e6f;
        const int32_t u = ulps(smp_expf_shifted(x, b), (float)exp((double)x));
        worst[x > 0.0f] = u > worst[x > 0.0f] ? u : worst[x > 0.0f];
    }
    for (float x = -1.0f; x < 0.0f; x = nextafterf(x, 0.0f) + 1e-7f) { /* near 1, densely */
        const int32_t u = ulps(smp_expf_shifted(x, b), (float)exp((double)x));
        worst[0] = u > worst[0] ? u : worst[0];
    }
    print_message("smp_expf_shifted: worst %d ulp for x <= 0, %d above\n", worst[0], worst[1]);
    assert_true(worst[0] <= 1 && worst[1] <= 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expf_edges),
        cmocka_unit_test(test_expf_shifted),
        cmocka_unit_test(test_rmsnorm_fd),
        cmocka_unit_test(test_layernorm_fd),
        cmocka_unit_test(test_layernorm_threads),
        cmocka_unit_test(test_rope_fd),
        cmocka_unit_test(test_swiglu_fd),
        cmocka_unit_test(test_gelu_fd),
        cmocka_unit_test(test_bias),
        cmocka_unit_test(test_bias_threads),
        cmocka_unit_test(test_qkv),
        cmocka_unit_test(test_moe_route),
        cmocka_unit_test(test_moe_route_fd),
        cmocka_unit_test(test_moe_gather),
        cmocka_unit_test(test_moe_combine),
        cmocka_unit_test(test_moe_scatter_add),
        cmocka_unit_test(test_moe_group),
        cmocka_unit_test(test_moe_threads),
        cmocka_unit_test(test_attention_fd),
        cmocka_unit_test(test_attention_window_fd),
        cmocka_unit_test(test_attention_docs_fd),
        cmocka_unit_test(test_attention_one_doc_bits),
        cmocka_unit_test(test_attention_extreme_positions_bits),
        cmocka_unit_test(test_attention_merge_identity),
        cmocka_unit_test(test_xent_fd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
