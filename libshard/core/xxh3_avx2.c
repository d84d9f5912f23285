/* libshard/core/xxh3_avx2.c: the chunks' XXH3 (xxh3.c) built for x86-64-v3. */
#include "core.h"

#if SHARD_XXH3_WIDE
#pragma GCC target("arch=x86-64-v3")
#define XXH3_FORM avx2
#include "xxh3_body.h"
#else
typedef int shard_xxh3_avx2_unused; /* ISO C wants a declaration in every file */
#endif
