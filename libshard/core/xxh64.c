/* libshard/core/xxh64.c: XXH64 (seed 0) streamed: the pieces' and the files' checksums
 * (docs/FORMAT.md), the same value as libxxhash's XXH64 in every form
 * (tests/unit/test_core.c).
 *
 * Why not libxxhash's: its stripe loop is scalar, eight 64-bit multiplies per 32 bytes,
 * bound by the core's one 64-bit multiplier (10.2 GB/s on a 1 MiB buffer, Zen 4). The
 * four accumulators fit one 256-bit vector; where the CPU multiplies 64-bit lanes
 * quickly (vpmullq: AMD's AVX-512 cores, Zen 4 and later) that loop runs at 18.4 GB/s,
 * bound by one stripe's add, rotate and multiply in a row. Intel's AVX-512 cores take
 * 15 cycles for vpmullq (three uops), slower than their scalar loop: they run the
 * scalar one. Every command that writes or checks a checkpoint hashes each byte with
 * XXH64 once or twice. */
#include "core.h"

#include <string.h>

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL
#define P5 2870177450012600261ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
static inline uint64_t read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* XXH64 reads little-endian words, as these hosts store them */
    return v;
}
#if defined(__BYTE_ORDER__)
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "xxh64.c reads words in the host's order: little-endian only");
#endif

typedef void (*stripes_fn)(uint64_t v[4], const uint8_t *p, size_t n);

/* n stripes of 32 bytes into the four accumulators */
static void stripes_scalar(uint64_t v[4], const uint8_t *p, size_t n)
{
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (size_t i = 0; i < n; i++, p += 32) {
        a = round1(a, read64(p));
        b = round1(b, read64(p + 8));
        c = round1(c, read64(p + 16));
        d = round1(d, read64(p + 24));
    }
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define XXH64_VECTOR 1
__attribute__((target("avx512f,avx512vl,avx512dq"))) static void stripes_avx512(uint64_t v[4], const uint8_t *p, size_t n)
{
    const __m256i p1 = _mm256_set1_epi64x((long long)P1), p2 = _mm256_set1_epi64x((long long)P2);
    __m256i acc = _mm256_loadu_si256((const void *)v);
    for (size_t i = 0; i < n; i++, p += 32) {
        acc = _mm256_add_epi64(acc, _mm256_mullo_epi64(_mm256_loadu_si256((const void *)p), p2));
        acc = _mm256_mullo_epi64(_mm256_rol_epi64(acc, 31), p1);
    }
    _mm256_storeu_si256((void *)v, acc);
}

static stripes_fn quickest(void)
{
    __builtin_cpu_init();
    const int v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512dq");
    return v4 && __builtin_cpu_is("amd") ? stripes_avx512 : stripes_scalar;
}
#else
#define XXH64_VECTOR 0
static stripes_fn quickest(void) { return stripes_scalar; }
#endif

static stripes_fn picked(void)
{
    static stripes_fn fn; /* picked once; threads racing pick the same */
    stripes_fn f = __atomic_load_n(&fn, __ATOMIC_RELAXED);
    if (!f) {
        f = quickest();
        __atomic_store_n(&fn, f, __ATOMIC_RELAXED);
    }
    return f;
}

int shard_xxh64_bits(void)
{
#if XXH64_VECTOR
    return picked() == stripes_avx512 ? 256 : 64;
#else
    return 64;
#endif
}

void shard_xxh64_reset(shard_xxh64_state *s)
{
    memset(s, 0, sizeof *s);
    s->v[0] = P1 + P2, s->v[1] = P2, s->v[2] = 0, s->v[3] = 0 - P1;
}

static void update_with(stripes_fn f, shard_xxh64_state *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->total += len;
    if (s->n) { /* a partial stripe first */
        size_t k = 32 - s->n < len ? 32 - s->n : len;
        memcpy(s->mem + s->n, p, k);
        s->n += (unsigned)k, p += k, len -= k;
        if (s->n < 32) return;
        f(s->v, s->mem, 1);
        s->n = 0;
    }
    f(s->v, p, len / 32);
    p += len / 32 * 32, len %= 32;
    memcpy(s->mem, p, len);
    s->n = (unsigned)len;
}

void shard_xxh64_update(shard_xxh64_state *s, const void *data, size_t len) { update_with(picked(), s, data, len); }

static uint64_t merge(uint64_t h, uint64_t v) { return (h ^ round1(0, v)) * P1 + P4; }

uint64_t shard_xxh64_digest(const shard_xxh64_state *s)
{
    uint64_t h;
    const uint64_t *v = s->v;
    if (s->total >= 32) {
        h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
        for (int i = 0; i < 4; i++) h = merge(h, v[i]);
    } else {
        h = P5; /* + the seed, 0 */
    }
    h += s->total;
    const uint8_t *p = s->mem, *e = s->mem + s->n;
    for (; p + 8 <= e; p += 8) h = rotl(h ^ round1(0, read64(p)), 27) * P1 + P4;
    if (p + 4 <= e) {
        uint32_t w;
        memcpy(&w, p, 4);
        h = rotl(h ^ (uint64_t)w * P1, 23) * P2 + P3;
        p += 4;
    }
    for (; p < e; p++) h = rotl(h ^ *p * P5, 11) * P1;
    h ^= h >> 33, h *= P2, h ^= h >> 29, h *= P3, h ^= h >> 32;
    return h;
}

static uint64_t one_shot(stripes_fn f, const void *data, size_t len)
{
    shard_xxh64_state s;
    shard_xxh64_reset(&s);
    update_with(f, &s, data, len);
    return shard_xxh64_digest(&s);
}

uint64_t shard_xxh64(const void *data, size_t len) { return one_shot(picked(), data, len); }

uint64_t shard_hash64(uint64_t h, const void *data, size_t len)
{
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(h >> (8 * i));
    shard_xxh64_state s;
    shard_xxh64_reset(&s);
    shard_xxh64_update(&s, le, sizeof le);
    shard_xxh64_update(&s, data, len);
    return shard_xxh64_digest(&s);
}

uint64_t shard_xxh64_form(int vector, const void *data, size_t len)
{
#if XXH64_VECTOR
    return one_shot(vector ? stripes_avx512 : stripes_scalar, data, len);
#else
    (void)vector;
    return one_shot(stripes_scalar, data, len);
#endif
}
