/* train/data.c: llm.c token files and the one global order of training sequences.
 *
 * File format (llm.c's): a header of 256 little-endian int32, header[0] the magic,
 * header[1] the version, header[2] the number of tokens, then the tokens:
 *   magic 20240520, version 1: uint16 tokens
 *   magic 20240801, version 7: uint32 tokens
 * The file must hold exactly 1024 + count * token_size bytes.
 *
 * Sequences: a file of n tokens holds (n - 1) / S sequences of S + 1 tokens,
 * sequence j being tokens [j*S, j*S + S] (inputs are the first S, targets the last
 * S): consecutive sequences share one token, so every token but the first is a
 * target once, as in llm.c's data loader. Sequences never span two files.
 *
 * The global order: the files' sequences one after the other (files in the order
 * given, each glob sorted), repeated epoch after epoch. Unshuffled, epoch e visits
 * them in file order; shuffled (a seed), epoch e visits them in the order of a
 * Fisher-Yates permutation drawn from xoshiro256** seeded by splitmix64(seed, e).
 * Position p of the order is sequence perm_e[p mod nseq] with e = p / nseq, so a
 * run resumes from its position alone. Step s of a run with global batch B takes
 * positions [s*B, (s+1)*B).
 */
#ifndef SMP_TRAIN_DATA_H
#define SMP_TRAIN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "shard.h"

#define DATA_MAGIC_U16 20240520
#define DATA_MAGIC_U32 20240801

typedef struct {
    char *path;
    int token_size;       /* 2 or 4 */
    uint64_t ntokens;
    int fd;               /* read with pread: a file truncated while in use is an error, not SIGBUS */
    int64_t vocab;
    uint64_t nseq, first_seq;
} data_file;

typedef struct {
    data_file *files;
    int nfiles;
    int S;
    uint64_t nseq;        /* sequences over all files */
    int shuffle;
    uint64_t seed;
    uint64_t *perm;       /* the permutation of perm_epoch (shuffled only) */
    int64_t perm_epoch;
    uint8_t *buf;         /* one sequence's bytes, as read */
} data_set;

/* Open the files of spec (a comma-separated list of paths or globs) and check every
 * token against the vocabulary (ids >= vocab are refused, naming the file and the
 * position). S: tokens per sequence (inputs). */
shard_status data_open(data_set *ds, const char *spec, int S, int64_t vocab);
void data_close(data_set *ds);
/* The order: sequential (shuffle 0) or shuffled by seed. */
void data_set_order(data_set *ds, int shuffle, uint64_t seed);
/* Inputs and targets (count x S each) of positions [first, first + count) of the
 * global order. Fails when a file changed under the run (shorter, or a token id
 * outside the vocabulary) and when out of memory (the permutation of a new epoch). */
shard_status data_fill(data_set *ds, uint64_t first, int count, int32_t *inputs, int32_t *targets);
/* The same for sequence indices in file order (no permutation): smp-eval. */
shard_status data_fill_sequential(data_set *ds, uint64_t first_seq, int count, int32_t *inputs, int32_t *targets);

/* A small deterministic generator (xoshiro256**), for the shuffle. */
typedef struct {
    uint64_t s[4];
} rng_state;
void rng_seed(rng_state *r, uint64_t seed, uint64_t stream);
uint64_t rng_next(rng_state *r);

#endif
