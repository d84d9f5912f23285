/* XXH3_64bits inlined (xxhash.h's XXH_INLINE_ALL), for the target its includer's
 * pragma sets: xxhash.h picks its vector code (SSE2, AVX2, AVX-512) by the target's
 * macros at compile time. Defines XXH3_BODY_NAME(data, len) and XXH3_ROWS_NAME(base,
 * row, stride, n): the XXH3 of n rows of `row` bytes, `stride` bytes apart, as if they
 * lay one after the other (xxhash's streaming form: the same value). */
#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t XXH3_BODY_NAME(const void *data, size_t len);
uint64_t XXH3_BODY_NAME(const void *data, size_t len) { return XXH3_64bits(data, len); }

uint64_t XXH3_ROWS_NAME(const void *base, size_t row, size_t stride, size_t n);
uint64_t XXH3_ROWS_NAME(const void *base, size_t row, size_t stride, size_t n)
{
    if (n <= 1 || stride == row) return XXH3_64bits(base, row * n);
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (size_t i = 0; i < n; i++) XXH3_64bits_update(&st, (const char *)base + i * stride, row);
    return XXH3_64bits_digest(&st);
}
