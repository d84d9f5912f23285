/* XXH3_64bits inlined (xxhash.h's XXH_INLINE_ALL), for the target its includer's
 * pragma sets: xxhash.h picks its vector code (SSE2, AVX2, AVX-512) by the target's
 * macros at compile time. The includer names the form (XXH3_FORM: base, avx2, avx512);
 * this defines shard_xxh3_FORM(data, len), shard_xxh3_FORM_rows(base, row, stride, n):
 * the XXH3 of n rows of `row` bytes, `stride` bytes apart, as if they lay one after the
 * other, and shard_xxh3_FORM_stream(next, ctx): of the blocks next hands over, laid end
 * to end (both xxhash's streaming form: the same value). */
#define XXH_INLINE_ALL
#include <xxhash.h>

/* xxhash's AVX2 and AVX-512 loops return with the vector registers' upper halves
 * dirty (GCC puts no vzeroupper after them), and every SSE instruction a thread runs
 * after that waits on those halves until something clears them: on an AVX-512 Xeon
 * the init fill's draw (libm's log and cos) took ~260 ns an element instead of ~30
 * (by hand; docs/DESIGN.md). Each entry point of a vector form clears them on its way out. */
#if defined(__AVX__)
#include <immintrin.h>
#define XXH3_LEAVE() _mm256_zeroupper()
#else
#define XXH3_LEAVE() ((void)0)
#endif

#define XXH3_CAT2(a, b) a##b
#define XXH3_CAT(a, b) XXH3_CAT2(a, b)
#define XXH3_BODY_NAME XXH3_CAT(shard_xxh3_, XXH3_FORM)
#define XXH3_ROWS_NAME XXH3_CAT(XXH3_BODY_NAME, _rows)
#define XXH3_STREAM_NAME XXH3_CAT(XXH3_BODY_NAME, _stream)

uint64_t XXH3_BODY_NAME(const void *data, size_t len);
uint64_t XXH3_BODY_NAME(const void *data, size_t len)
{
    const uint64_t h = XXH3_64bits(data, len);
    XXH3_LEAVE();
    return h;
}

uint64_t XXH3_ROWS_NAME(const void *base, size_t row, size_t stride, size_t n);
uint64_t XXH3_ROWS_NAME(const void *base, size_t row, size_t stride, size_t n)
{
    if (n <= 1 || stride == row) return XXH3_BODY_NAME(base, row * n);
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (size_t i = 0; i < n; i++) XXH3_64bits_update(&st, (const char *)base + i * stride, row);
    const uint64_t h = XXH3_64bits_digest(&st);
    XXH3_LEAVE();
    return h;
}

uint64_t XXH3_STREAM_NAME(shard_xxh3_next next, void *ctx);
uint64_t XXH3_STREAM_NAME(shard_xxh3_next next, void *ctx)
{
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    size_t len;
    for (const void *b; (b = next(ctx, &len));) {
        XXH3_64bits_update(&st, b, len);
        XXH3_LEAVE(); /* next() is SSE code */
    }
    const uint64_t h = XXH3_64bits_digest(&st);
    XXH3_LEAVE();
    return h;
}
