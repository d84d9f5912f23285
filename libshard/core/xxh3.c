/* libshard/core/xxh3.c: XXH3_64bits of the chunks (their checksums, written and
 * checked), inlined and built for the widest vectors the CPU has. Debian's libxxhash
 * is built for the SSE2 baseline and not inlined: 15-19 GB/s on a 1 MiB chunk on a
 * Zen 4 core, where the inlined forms ran at 27 (SSE2) and 33-42 (AVX2) GB/s. The
 * same function, so the same value, in every form (tests/unit/test_core.c). */
#include "core.h"

#define XXH3_BODY_NAME shard_xxh3_base
#include "xxh3_body.h"

#if SHARD_XXH3_WIDE
typedef uint64_t (*xxh3_fn)(const void *, size_t);

static xxh3_fn widest(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return shard_xxh3_avx512;
    if (__builtin_cpu_supports("x86-64-v3")) return shard_xxh3_avx2;
    return shard_xxh3_base;
}

static xxh3_fn picked(void)
{
    static xxh3_fn fn; /* picked once; a race between threads picks the same */
    xxh3_fn f = __atomic_load_n(&fn, __ATOMIC_RELAXED);
    if (!f) {
        f = widest();
        __atomic_store_n(&fn, f, __ATOMIC_RELAXED);
    }
    return f;
}

uint64_t shard_xxh3(const void *data, size_t len) { return picked()(data, len); }

int shard_xxh3_bits(void)
{
    const xxh3_fn f = picked();
    return f == shard_xxh3_avx512 ? 512 : f == shard_xxh3_avx2 ? 256 : 128;
}
#else
uint64_t shard_xxh3(const void *data, size_t len) { return shard_xxh3_base(data, len); }
int shard_xxh3_bits(void) { return 128; }
#endif
