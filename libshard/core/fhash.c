/* libshard/core/fhash.c: a checkpoint file's checksum, streamed (docs/FORMAT.md, files[]).
 *
 * Version 2 ("xxh3_blocks"): XXH64 (seed 0) of the little-endian XXH3_64bits (seed 0)
 * of each 4096-byte block of the file in order, the last block short. Unlike one XXH64
 * of the whole file, a block's part can be computed by whoever holds its bytes, in any
 * order: a shard writer hashes its chunks from memory as it writes them and reads back
 * only HDF5's metadata and the chunks' edges at close (h5shard.c), instead of the whole
 * file. Version 1 ("xxh64"): XXH64 of the whole file. */
#include "core.h"

#include <string.h>

void shard_fhash_reset(shard_fhash_state *s, shard_fhash_kind kind)
{
    shard_xxh64_reset(&s->outer);
    s->kind = kind;
    s->part = 0;
}

static void add_block(shard_fhash_state *s, const void *p, size_t n)
{
    uint64_t d = shard_xxh3(p, n); /* little-endian hosts only (xxh64.c): stored as is */
    shard_xxh64_update(&s->outer, &d, sizeof d);
}

void shard_fhash_update(shard_fhash_state *s, const void *data, size_t len)
{
    if (s->kind == SHARD_FHASH_XXH64) { shard_xxh64_update(&s->outer, data, len); return; }
    const uint8_t *p = data;
    if (s->part) { /* fill the held block first */
        size_t take = SHARD_FHASH_BLOCK - s->part < len ? SHARD_FHASH_BLOCK - s->part : len;
        memcpy(s->buf + s->part, p, take);
        s->part += take;
        p += take;
        len -= take;
        if (s->part < SHARD_FHASH_BLOCK) return;
        add_block(s, s->buf, SHARD_FHASH_BLOCK);
        s->part = 0;
    }
    for (; len >= SHARD_FHASH_BLOCK; p += SHARD_FHASH_BLOCK, len -= SHARD_FHASH_BLOCK) add_block(s, p, SHARD_FHASH_BLOCK);
    if (len) memcpy(s->buf, p, len); /* (data may be NULL when len is 0) */
    s->part = len;
}

void shard_fhash_add_digest(shard_fhash_state *s, uint64_t block_xxh3)
{
    shard_xxh64_update(&s->outer, &block_xxh3, sizeof block_xxh3);
}

uint64_t shard_fhash_digest(const shard_fhash_state *s)
{
    if (s->kind == SHARD_FHASH_XXH64 || !s->part) return shard_xxh64_digest(&s->outer);
    shard_xxh64_state o = s->outer; /* the short last block, without changing the state */
    uint64_t d = shard_xxh3(s->buf, s->part);
    shard_xxh64_update(&o, &d, sizeof d);
    return shard_xxh64_digest(&o);
}
