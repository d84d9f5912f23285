/* XXH3_64bits inlined (xxhash.h's XXH_INLINE_ALL), for the target its includer's
 * pragma sets: xxhash.h picks its vector code (SSE2, AVX2, AVX-512) by the target's
 * macros at compile time. Defines XXH3_BODY_NAME(data, len). */
#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t XXH3_BODY_NAME(const void *data, size_t len);
uint64_t XXH3_BODY_NAME(const void *data, size_t len) { return XXH3_64bits(data, len); }
