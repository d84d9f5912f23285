/* dtypes of the safetensors format and exact conversions between the float ones.
 *
 * Every narrowing conversion rounds once, to nearest with ties to even, from the
 * source value (F64 included: no double rounding through F32). The generic
 * round_pack() handles F16, BF16, E4M3 and E5M2; F32 <-> BF16 has a fast path. The
 * behaviour at the edges (NaN payloads, overflow to inf or NaN) follows ml_dtypes,
 * which the test suite checks on every bit pattern. */
#include "shard.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static const struct {
    const char *name;
    size_t size;
    int is_float;
} DT[SHARD_DT_COUNT] = {
    [SHARD_DT_INVALID] = {NULL, 0, 0},
    [SHARD_DT_BOOL] = {"BOOL", 1, 0},
    [SHARD_DT_U8] = {"U8", 1, 0},
    [SHARD_DT_I8] = {"I8", 1, 0},
    [SHARD_DT_U16] = {"U16", 2, 0},
    [SHARD_DT_I16] = {"I16", 2, 0},
    [SHARD_DT_U32] = {"U32", 4, 0},
    [SHARD_DT_I32] = {"I32", 4, 0},
    [SHARD_DT_U64] = {"U64", 8, 0},
    [SHARD_DT_I64] = {"I64", 8, 0},
    [SHARD_DT_F8_E4M3] = {"F8_E4M3", 1, 1},
    [SHARD_DT_F8_E5M2] = {"F8_E5M2", 1, 1},
    [SHARD_DT_F16] = {"F16", 2, 1},
    [SHARD_DT_BF16] = {"BF16", 2, 1},
    [SHARD_DT_F32] = {"F32", 4, 1},
    [SHARD_DT_F64] = {"F64", 8, 1},
};

const char *shard_dtype_name(shard_dtype dt)
{
    return (dt > SHARD_DT_INVALID && dt < SHARD_DT_COUNT) ? DT[dt].name : NULL;
}

shard_dtype shard_dtype_from_name(const char *s)
{
    if (!s) return SHARD_DT_INVALID;
    for (int i = 1; i < SHARD_DT_COUNT; i++)
        if (strcmp(s, DT[i].name) == 0) return (shard_dtype)i;
    return SHARD_DT_INVALID;
}

size_t shard_dtype_size(shard_dtype dt)
{
    return (dt > SHARD_DT_INVALID && dt < SHARD_DT_COUNT) ? DT[dt].size : 0;
}

int shard_dtype_is_float(shard_dtype dt)
{
    return (dt > SHARD_DT_INVALID && dt < SHARD_DT_COUNT) ? DT[dt].is_float : 0;
}

/* ---------------------------------------------------------------- small floats */
typedef struct {
    int ebits, mbits;
    int fn;      /* 1: "finite" format (E4M3): no inf; all-ones pattern is NaN */
    int payload; /* 1: NaN payloads carried over (numpy's float16); 0: canonical quiet NaN */
} fmt;

static const fmt F16 = {5, 10, 0, 1}, BF16 = {8, 7, 0, 0}, E4M3 = {4, 3, 1, 0}, E5M2 = {5, 2, 0, 0};

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Round |value| = m * 2^(e - sbits) (m holds the implicit bit at position sbits)
 * to the format, ties to even; returns the magnitude bits (no sign). */
static uint32_t round_pack(int e, uint64_t m, int sbits, fmt f)
{
    const int bias = (1 << (f.ebits - 1)) - 1;
    int te = e + bias; /* target biased exponent if normal */
    int shift = sbits - f.mbits;
    if (te < 1) shift += 1 - te; /* subnormal: fewer mantissa bits survive */
    uint64_t q;
    if (shift >= 64 || (shift > sbits + 1)) {
        q = 0; /* below half of the smallest subnormal */
    } else if (shift > 0) {
        uint64_t rem = m & ((UINT64_C(1) << shift) - 1), half = UINT64_C(1) << (shift - 1);
        q = m >> shift;
        if (rem > half || (rem == half && (q & 1))) q++;
    } else {
        q = m << -shift;
    }
    uint32_t out;
    if (te < 1) {
        out = (uint32_t)q; /* may carry into the first normal: same encoding */
    } else {
        if (q >> (f.mbits + 1)) { q >>= 1; te++; }
        out = ((uint32_t)te << f.mbits) | (uint32_t)(q & ((UINT64_C(1) << f.mbits) - 1));
    }
    const uint32_t emax = (1u << f.ebits) - 1;
    if (f.fn) {
        const uint32_t nan = (emax << f.mbits) | ((1u << f.mbits) - 1);
        if (out >= nan) out = nan;
    } else if ((out >> f.mbits) >= emax) {
        out = emax << f.mbits; /* inf */
    }
    return out;
}

static uint32_t nan_bits(uint32_t payload_top, fmt f)
{
    const uint32_t emax = (1u << f.ebits) - 1;
    if (f.fn) return (emax << f.mbits) | ((1u << f.mbits) - 1);
    if (!f.payload) return (emax << f.mbits) | (1u << (f.mbits - 1));
    /* numpy: the payload's top bits as they are, but never zero (that is inf) */
    uint32_t m = payload_top & ((1u << f.mbits) - 1);
    return (emax << f.mbits) | (m ? m : 1u);
}

static uint32_t from_f32(float x, fmt f)
{
    uint32_t u = f32_bits(x), sign = (u >> 31) << (f.ebits + f.mbits), a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | nan_bits((a & 0x7fffffu) >> (23 - f.mbits), f);
    if (a == 0x7f800000u) return sign | (f.fn ? nan_bits(0, f) : ((1u << f.ebits) - 1) << f.mbits);
    if (a == 0) return sign;
    int e;
    uint64_t m;
    if (a >> 23) { e = (int)(a >> 23) - 127; m = (a & 0x7fffffu) | 0x800000u; }
    else { /* f32 subnormal: normalize */
        m = a; e = -126;
        while (!(m & 0x800000u)) { m <<= 1; e--; }
    }
    return sign | round_pack(e, m, 23, f);
}

static uint32_t from_f64(double x, fmt f)
{
    uint64_t u;
    memcpy(&u, &x, 8);
    uint32_t sign = (uint32_t)(u >> 63) << (f.ebits + f.mbits);
    uint64_t a = u & UINT64_C(0x7fffffffffffffff);
    const uint64_t inf = UINT64_C(0x7ff0000000000000);
    if (a > inf) return sign | nan_bits((uint32_t)((a & ((UINT64_C(1) << 52) - 1)) >> (52 - f.mbits)), f);
    if (a == inf) return sign | (f.fn ? nan_bits(0, f) : ((1u << f.ebits) - 1) << f.mbits);
    if (a == 0) return sign;
    int e;
    uint64_t m;
    if (a >> 52) { e = (int)(a >> 52) - 1023; m = (a & ((UINT64_C(1) << 52) - 1)) | (UINT64_C(1) << 52); }
    else { m = a; e = -1022; while (!(m >> 52)) { m <<= 1; e--; } }
    return sign | round_pack(e, m, 52, f);
}

static float to_f32(uint32_t h, fmt f)
{
    const int nb = f.ebits + f.mbits, bias = (1 << (f.ebits - 1)) - 1;
    const uint32_t sign = ((h >> nb) & 1u) << 31, mmask = (1u << f.mbits) - 1, emax = (1u << f.ebits) - 1;
    uint32_t e = (h >> f.mbits) & emax, m = h & mmask;
    if (f.fn ? (e == emax && m == mmask) : (e == emax)) {
        if (!f.fn && !m) return bits_f32(sign | 0x7f800000u);
        if (f.payload) return bits_f32(sign | 0x7f800000u | (m << (23 - f.mbits)));
        return bits_f32(sign | 0x7fc00000u);
    }
    if (e == 0) { /* subnormal (or zero): m * 2^(1 - bias - mbits), exact in f32 */
        float v = ldexpf((float)m, 1 - bias - f.mbits);
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e - bias + 127) << 23) | (m << (23 - f.mbits)));
}

float shard_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* f32 bits -> bf16, rounded to nearest even (overflow carries into inf); NaN stays a
 * quiet NaN of its sign. A select, not a branch, so that bulk loops vectorize. */
static inline uint16_t bf16_of_bits(uint32_t u)
{
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u) : rounded;
}

uint16_t shard_f32_to_bf16(float f) { return bf16_of_bits(f32_bits(f)); }

float shard_f16_to_f32(uint16_t h) { return to_f32(h, F16); }
uint16_t shard_f32_to_f16(float f) { return (uint16_t)from_f32(f, F16); }
float shard_e4m3_to_f32(uint8_t b) { return to_f32(b, E4M3); }
uint8_t shard_f32_to_e4m3(float f) { return (uint8_t)from_f32(f, E4M3); }
float shard_e5m2_to_f32(uint8_t b) { return to_f32(b, E5M2); }
uint8_t shard_f32_to_e5m2(float f) { return (uint8_t)from_f32(f, E5M2); }

/* --------------------------------------------------------------- bulk convert */
static float load_f32(const void *src, shard_dtype dt, size_t i)
{
    switch (dt) {
    case SHARD_DT_F32: return ((const float *)src)[i];
    case SHARD_DT_BF16: return shard_bf16_to_f32(((const uint16_t *)src)[i]);
    case SHARD_DT_F16: return to_f32(((const uint16_t *)src)[i], F16);
    case SHARD_DT_F8_E4M3: return to_f32(((const uint8_t *)src)[i], E4M3);
    case SHARD_DT_F8_E5M2: return to_f32(((const uint8_t *)src)[i], E5M2);
    default: return NAN;
    }
}

static const fmt *small_fmt(shard_dtype dt)
{
    switch (dt) {
    case SHARD_DT_F16: return &F16;
    case SHARD_DT_BF16: return &BF16;
    case SHARD_DT_F8_E4M3: return &E4M3;
    case SHARD_DT_F8_E5M2: return &E5M2;
    default: return NULL;
    }
}

static void store_bits(void *dst, shard_dtype dt, size_t i, uint32_t bits)
{
    if (shard_dtype_size(dt) == 2) ((uint16_t *)dst)[i] = (uint16_t)bits;
    else ((uint8_t *)dst)[i] = (uint8_t)bits;
}

/* The conversions a checkpoint's load runs over every weight (bf16 <-> f32) in
 * loops the compiler vectorizes: -O2's cost model leaves them scalar, and a load of
 * a model's bf16 into fp32 spent a fifth of its time here. */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORIZED __attribute__((optimize("tree-vectorize")))
#else
#define VECTORIZED
#endif

VECTORIZED static void bf16_to_f32(float *d, const uint16_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = bits_f32((uint32_t)s[i] << 16);
}

VECTORIZED static void f32_to_bf16(uint16_t *d, const float *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = bf16_of_bits(f32_bits(s[i]));
}

/* F16 (IEEE half) bits -> f32 bits, exactly as to_f32 with F16 gives them (NaN payloads
 * kept, as numpy does), picked by masks instead of branches, and no arithmetic on
 * subnormal floats (a thread in denormals-are-zero mode would lose them): normals by
 * moving the fields and re-biasing the exponent, subnormals as m * 2^-24 from the
 * integer m (exact). */
static inline uint32_t f32_bits_of_f16(uint32_t h)
{
    const uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
    const uint32_t normal = (em << 13) + ((127u - 15u) << 23), special = (em << 13) | 0x7f800000u;
    const uint32_t sub = f32_bits((float)(int32_t)em * 0x1p-24f);
    const uint32_t is_special = 0u - (em >= 0x7c00u), is_normal = 0u - (em >= 0x0400u); /* masks: selects */
    return sign | (special & is_special) | (normal & is_normal & ~is_special) | (sub & ~is_normal);
}

/* f32 bits -> F16 bits, rounded to nearest even, exactly as from_f32 with F16 gives
 * them: overflow to inf, subnormals rounded by one float addition (the magic number
 * puts the f16 subnormal's last bit at the float's last), NaN with the payload's top
 * bits (never 0) as numpy keeps them. Every case computed and picked by masks: a
 * ternary on a float sum is a branch to GCC (the sum could trap), and the loop would
 * not vectorize. */
static inline uint16_t f16_of_f32_bits(uint32_t u)
{
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    const uint32_t top = (a & 0x7fffffu) >> 13;
    const uint32_t nan = 0x7c00u | (top ? top : 1u);
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23; /* 0.5: its last bit is 2^-24 */
    const uint32_t sub = f32_bits(bits_f32(a) + bits_f32(magic)) - magic;
    const uint32_t normal = (a + ((15u - 127u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    const uint32_t is_nan = 0u - (a > 0x7f800000u), is_big = 0u - (a >= 0x47800000u), is_sub = 0u - (a < 0x38800000u);
    const uint32_t o = (nan & is_nan) | (0x7c00u & is_big & ~is_nan) | (sub & is_sub) | (normal & ~is_big & ~is_sub);
    return (uint16_t)(sign | o);
}

VECTORIZED static void f16_to_f32(float *d, const uint16_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = bits_f32(f32_bits_of_f16(s[i]));
}

VECTORIZED static void f32_to_f16(uint16_t *d, const float *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = f16_of_f32_bits(f32_bits(s[i]));
}

VECTORIZED static void f16_to_bf16(uint16_t *d, const uint16_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = bf16_of_bits(f32_bits_of_f16(s[i]));
}

VECTORIZED static void bf16_to_f16(uint16_t *d, const uint16_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = f16_of_f32_bits((uint32_t)s[i] << 16);
}

/* The pairs of the 16- and 32-bit formats, in the loops above (the general rules
 * below, a branch or a loop per element, took ~8 ns an element); 0 for the others */
static int convert_bulk(void *dst, shard_dtype dd, const void *src, shard_dtype sd, size_t n)
{
    const int d32 = dd == SHARD_DT_F32, s32 = sd == SHARD_DT_F32;
    if (d32 && sd == SHARD_DT_BF16) bf16_to_f32(dst, src, n);
    else if (d32 && sd == SHARD_DT_F16) f16_to_f32(dst, src, n);
    else if (dd == SHARD_DT_BF16 && s32) f32_to_bf16(dst, src, n);
    else if (dd == SHARD_DT_BF16 && sd == SHARD_DT_F16) f16_to_bf16(dst, src, n);
    else if (dd == SHARD_DT_F16 && s32) f32_to_f16(dst, src, n);
    else if (dd == SHARD_DT_F16 && sd == SHARD_DT_BF16) bf16_to_f16(dst, src, n);
    else return 0;
    return 1;
}

shard_status shard_convert(void *dst, shard_dtype dst_dt, const void *src, shard_dtype src_dt, size_t n)
{
    if (dst_dt == src_dt) {
        size_t sz = shard_dtype_size(dst_dt);
        if (!sz) return shard_fail(SHARD_E_USAGE, "convert: invalid dtype");
        memcpy(dst, src, n * sz);
        return SHARD_OK;
    }
    if (!shard_dtype_is_float(dst_dt) || !shard_dtype_is_float(src_dt))
        return shard_fail(SHARD_E_USAGE, "convert: %s -> %s is not a float conversion",
                          shard_dtype_name(src_dt) ? shard_dtype_name(src_dt) : "?",
                          shard_dtype_name(dst_dt) ? shard_dtype_name(dst_dt) : "?");
    if (src_dt == SHARD_DT_F64) {
        const double *s = src;
        if (dst_dt == SHARD_DT_F32) {
            for (size_t i = 0; i < n; i++) ((float *)dst)[i] = (float)s[i];
        } else {
            const fmt *f = small_fmt(dst_dt);
            for (size_t i = 0; i < n; i++) store_bits(dst, dst_dt, i, from_f64(s[i], *f));
        }
        return SHARD_OK;
    }
    if (dst_dt == SHARD_DT_F64) {
        for (size_t i = 0; i < n; i++) ((double *)dst)[i] = load_f32(src, src_dt, i);
        return SHARD_OK;
    }
    if (convert_bulk(dst, dst_dt, src, src_dt, n)) return SHARD_OK;
    if (dst_dt == SHARD_DT_F32) {
        float *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = load_f32(src, src_dt, i);
        return SHARD_OK;
    }
    if (dst_dt == SHARD_DT_BF16) {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = shard_f32_to_bf16(load_f32(src, src_dt, i));
        return SHARD_OK;
    }
    const fmt *f = small_fmt(dst_dt);
    for (size_t i = 0; i < n; i++) store_bits(dst, dst_dt, i, from_f32(load_f32(src, src_dt, i), *f));
    return SHARD_OK;
}

/* A load writes its fp32 weights into memory last touched when the kernel faulted it
 * in: each store misses, and a store that misses first reads its line, which doubles
 * the memory traffic of a loop bound by it. Streaming stores skip that read. By hand
 * on the 2-core Zen 2 VM (2026-12-05; two sets of alternating runs, so roughly):
 * smp-eval's load of 3 GB of fp32 0.60-0.61 -> 0.57-0.58 s, 8 ranks 1.34-1.40 ->
 * 1.28-1.37 s (docs/benchmarks.md). Runs shorter than STREAM_MIN stay in the cache,
 * where a caller may still want them. */
enum { STREAM_MIN = 512 }; /* elements: 2 KiB of fp32 */

#if defined(__SSE2__)
static void bf16_to_f32_stream(float *d, const uint16_t *s, size_t n)
{
    size_t i = (size_t)((16 - ((uintptr_t)d & 15)) & 15) / sizeof *d; /* to a 16-byte boundary */
    if ((uintptr_t)d & 3) i = n;                                      /* a float's alignment at least */
    bf16_to_f32(d, s, i);
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) { /* bf16 bits into the high half of each f32 lane */
        const __m128i v = _mm_loadu_si128((const __m128i *)(s + i));
        _mm_stream_si128((__m128i *)(d + i), _mm_unpacklo_epi16(zero, v));
        _mm_stream_si128((__m128i *)(d + i + 4), _mm_unpackhi_epi16(zero, v));
    }
    _mm_sfence(); /* the streamed lines visible before any later store */
    bf16_to_f32(d + i, s + i, n - i);
}
#endif

shard_status shard_convert_uncached(void *dst, shard_dtype dst_dt, const void *src, shard_dtype src_dt, size_t n)
{
#if defined(__SSE2__)
    if (dst_dt == SHARD_DT_F32 && src_dt == SHARD_DT_BF16 && n >= STREAM_MIN) {
        bf16_to_f32_stream(dst, src, n);
        return SHARD_OK;
    }
#endif
    return shard_convert(dst, dst_dt, src, src_dt, n);
}

/* ------------------------------------------------------- FP8 training quantizer */
float shard_fp8_quantize(uint8_t *q, const float *x, size_t n, float scale, shard_dtype dt)
{
    const fmt f = dt == SHARD_DT_F8_E5M2 ? E5M2 : E4M3;
    const float mx = dt == SHARD_DT_F8_E5M2 ? 57344.0f : 448.0f;
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (!isnan(amax) && (a > amax || isnan(a))) amax = a; /* a NaN sticks */
        float v = x[i] * scale;
        if (v > mx) v = mx;
        else if (v < -mx) v = -mx;
        q[i] = (uint8_t)from_f32(v, f);
    }
    return amax;
}

void shard_fp8_dequantize(float *x, const uint8_t *q, size_t n, float scale, shard_dtype dt)
{
    const fmt f = dt == SHARD_DT_F8_E5M2 ? E5M2 : E4M3;
    const float inv = 1.0f / scale;
    for (size_t i = 0; i < n; i++) x[i] = to_f32(q[i], f) * inv;
}
