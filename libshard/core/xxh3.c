/* libshard/core/xxh3.c: XXH3_64bits of the chunks (their checksums, written and
 * checked), inlined and built for the widest vectors the CPU has. Debian's libxxhash
 * is built for the SSE2 baseline and not inlined: 15-19 GB/s on a 1 MiB chunk on a
 * Zen 4 core, where the inlined forms ran at 27 (SSE2) and 33-42 (AVX2) GB/s. The
 * same function, so the same value, in every form (tests/unit/test_core.c). */
#include "core.h"

#define XXH3_FORM base
#include "xxh3_body.h"

#if SHARD_XXH3_WIDE
typedef struct {
    uint64_t (*one)(const void *, size_t);
    uint64_t (*rows)(const void *, size_t, size_t, size_t);
    uint64_t (*stream)(shard_xxh3_next, void *);
    int bits;
} xxh3_form;

static const xxh3_form FORMS[] = {
    {shard_xxh3_base, shard_xxh3_base_rows, shard_xxh3_base_stream, 128},
    {shard_xxh3_avx2, shard_xxh3_avx2_rows, shard_xxh3_avx2_stream, 256},
    {shard_xxh3_avx512, shard_xxh3_avx512_rows, shard_xxh3_avx512_stream, 512},
};

static int widest(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 2;
    if (__builtin_cpu_supports("x86-64-v3")) return 1;
    return 0;
}

static const xxh3_form *picked(void)
{
    static int form = -1; /* picked once; a race between threads picks the same */
    int f = __atomic_load_n(&form, __ATOMIC_RELAXED);
    if (f < 0) {
        f = widest();
        __atomic_store_n(&form, f, __ATOMIC_RELAXED);
    }
    return &FORMS[f];
}

uint64_t shard_xxh3(const void *data, size_t len) { return picked()->one(data, len); }
uint64_t shard_xxh3_rows(const void *base, size_t row, size_t stride, size_t n)
{
    return picked()->rows(base, row, stride, n);
}
uint64_t shard_xxh3_stream(shard_xxh3_next next, void *ctx) { return picked()->stream(next, ctx); }
int shard_xxh3_bits(void) { return picked()->bits; }
#else
uint64_t shard_xxh3(const void *data, size_t len) { return shard_xxh3_base(data, len); }
uint64_t shard_xxh3_rows(const void *base, size_t row, size_t stride, size_t n)
{
    return shard_xxh3_base_rows(base, row, stride, n);
}
uint64_t shard_xxh3_stream(shard_xxh3_next next, void *ctx) { return shard_xxh3_base_stream(next, ctx); }
int shard_xxh3_bits(void) { return 128; }
#endif
