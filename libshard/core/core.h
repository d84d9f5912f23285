/* libshard/core's own declarations: the checksums and the error state. Needs libc
 * alone (no jansson, HDF5 or zstd), so that tools/gpu-check can build status.c and
 * dtype.c on a GPU machine that has none of them (the checksums' files also need
 * xxhash.h: gpu-check leaves them out). */
#ifndef SHARD_CORE_H
#define SHARD_CORE_H

#include "shard.h"

#include <stddef.h>
#include <stdint.h>

/* XXH3_64bits (seed 0) of a chunk's bytes, the same value as libxxhash's, computed
 * with the CPU's widest vectors (xxh3.c). */
uint64_t shard_xxh3(const void *data, size_t len);
/* the same of n rows of `row` bytes each, `stride` bytes apart: the XXH3 of the rows
 * laid one after the other (a chunk read straight into a strided box, chunkread.c) */
uint64_t shard_xxh3_rows(const void *base, size_t row, size_t stride, size_t n);
/* the same of bytes handed over a block at a time: next(ctx, &len) returns the next
 * block, or NULL after the last (a chunk unshuffled a block at a time, chunkread.c) */
typedef const void *(*shard_xxh3_next)(void *ctx, size_t *len);
uint64_t shard_xxh3_stream(shard_xxh3_next next, void *ctx);
/* the vector bits of the form shard_xxh3 runs: 512, 256 or 128 (SSE2, or not x86-64) */
int shard_xxh3_bits(void);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SHARD_XXH3_WIDE 1
uint64_t shard_xxh3_base(const void *data, size_t len);
uint64_t shard_xxh3_avx2(const void *data, size_t len);
uint64_t shard_xxh3_avx512(const void *data, size_t len);
uint64_t shard_xxh3_base_rows(const void *base, size_t row, size_t stride, size_t n);
uint64_t shard_xxh3_avx2_rows(const void *base, size_t row, size_t stride, size_t n);
uint64_t shard_xxh3_avx512_rows(const void *base, size_t row, size_t stride, size_t n);
uint64_t shard_xxh3_base_stream(shard_xxh3_next next, void *ctx);
uint64_t shard_xxh3_avx2_stream(shard_xxh3_next next, void *ctx);
uint64_t shard_xxh3_avx512_stream(shard_xxh3_next next, void *ctx);
#else
#define SHARD_XXH3_WIDE 0
#endif
/* XXH64 (seed 0), libxxhash's value, streamed (xxh64.c): reset, update with the bytes
 * in order, digest (the state is left as it was). */
typedef struct {
    uint64_t v[4], total;
    uint8_t mem[32]; /* a partial stripe */
    unsigned n;
} shard_xxh64_state;
void shard_xxh64_reset(shard_xxh64_state *s);
void shard_xxh64_update(shard_xxh64_state *s, const void *data, size_t len);
uint64_t shard_xxh64_digest(const shard_xxh64_state *s);
uint64_t shard_xxh64(const void *data, size_t len);
/* the bits of the stripe loop that runs: 256 (one vector, AMD AVX-512 cores) or 64 */
int shard_xxh64_bits(void);
/* tests: the one-shot hash through the scalar (0) or the vector (1) stripe loop, the
 * latter on AVX-512 x86-64 only */
uint64_t shard_xxh64_form(int vector, const void *data, size_t len);
/* A checkpoint file's checksum (fhash.c, docs/FORMAT.md files[]): XXH64 of the whole
 * file (format version 1), or XXH64 of the XXH3s of its 4096-byte blocks (version 2).
 * Streamed like XXH64; add_digest feeds a whole block's XXH3 computed elsewhere (the
 * state must be at a block boundary). */
typedef enum { SHARD_FHASH_XXH64 = 1, SHARD_FHASH_XXH3_BLOCKS = 2 } shard_fhash_kind;
#define SHARD_FHASH_BLOCK 4096u
typedef struct {
    shard_xxh64_state outer;
    shard_fhash_kind kind;
    size_t part; /* bytes of a block held in buf */
    uint8_t buf[SHARD_FHASH_BLOCK];
} shard_fhash_state;
void shard_fhash_reset(shard_fhash_state *s, shard_fhash_kind kind);
void shard_fhash_update(shard_fhash_state *s, const void *data, size_t len);
void shard_fhash_add_digest(shard_fhash_state *s, uint64_t block_xxh3);
uint64_t shard_fhash_digest(const shard_fhash_state *s);
/* Mark the thread's last failure as another process's (shard_err_secondhand). */
void shard_set_secondhand(void);

#endif
