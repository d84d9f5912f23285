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
 *
 * Fine-tuning (docs/TRAINING.md "Fine-tuning"): targets that do not count are -1
 * (the loss and its gradient skip them).
 *   - documents (data_set_documents): the stream is documents each ended by the
 *     separator token, which belongs to the document it ends; the first token of a
 *     document is not a target (target t, token t + 1, follows a separator at input t);
 *   - loss masks (data_open_masks): one mask file per token file, the 256-int32
 *     header with magic 20241201, version 1 and the token count, then one uint8 per
 *     token, 1 = a target, 0 = not: target t counts only if the mask byte of token
 *     t + 1 is 1.
 */
#ifndef SMP_TRAIN_DATA_H
#define SMP_TRAIN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "shard.h"

#define DATA_MAGIC_U16 20240520
#define DATA_MAGIC_U32 20240801
#define DATA_MAGIC_MASK 20241201
/* The data position and token count may grow past INT32 but not near 2^63, where the
 * arithmetic of a step (position + batch, tokens + batch * seq) would overflow. */
#define DATA_COUNTER_MAX (1ll << 62)

/* A file as opened (inode, size, change and modification times) and its hash: what a
 * saved run records of the files it checked (training.data.checked), so that its
 * resume need not read them again while they are unchanged (data_open_opts.seen). */
typedef struct {
    uint64_t ino, size;
    int64_t ctime_ns, mtime_ns;
    uint64_t hash;        /* shard_hash64 of its 1 MiB blocks' shard_hash64s */
} data_stamp;

typedef struct {
    data_stamp tok, mask; /* a token file's, its mask file's (has_mask) */
    int has_mask;
    int64_t vocab;        /* its tokens were all below it */
} data_seen;

typedef struct {
    char *path;
    int token_size;       /* 2 or 4 */
    uint64_t ntokens;
    int fd;               /* read with pread: a file truncated while in use is an error, not SIGBUS */
    int64_t vocab;
    uint64_t nseq, first_seq;
    char *mpath;          /* its loss mask file (NULL: none) */
    int mfd;
    uint64_t hash;        /* shard_hash64 over its tokens' bytes, then its mask's, as checked */
    data_stamp stamp, mstamp; /* the token file's and the mask file's, as opened, with their hashes */
    int seen, mseen;      /* 1: matched a data_seen record, not read again */
} data_file;

typedef struct {
    data_file *files;
    int nfiles;
    int S;
    int64_t vocab;
    uint64_t nseq;        /* sequences over all files */
    int shuffle;
    uint64_t seed;
    void *perm;           /* the permutation of perm_epoch (shuffled only): uint32_t entries, uint64_t past 2^32 sequences */
    int64_t perm_epoch;
    uint8_t *buf;         /* one sequence's bytes, as read */
    int documents;        /* 1: targets after a separator do not count */
    int32_t sep;          /* the separator token */
    int masked;           /* 1: every file has a loss mask */
    shard_comm *host;     /* the ranks of this host that split the checking (NULL: this process alone) */
    const data_seen *seen; /* records of files checked before (borrowed while opening; NULL: none) */
    int nseen;
} data_set;

/* How data_open_on checks the files: host, the ranks of this host that split the
 * reading (NULL: this process alone); seen[nseen], files a run checked before (kept
 * until data_open_masks is done). */
typedef struct {
    shard_comm *host;
    const data_seen *seen;
    int nseen;
} data_open_opts;

/* Open the files of spec (a comma-separated list of paths or globs) and check every
 * token against the vocabulary (ids >= vocab are refused, naming the file and the
 * position). S: tokens per sequence (inputs). */
shard_status data_open(data_set *ds, const char *spec, int S, int64_t vocab);
/* The same with the checking (reading and hashing every byte of the files, masks too)
 * split over the ranks of o->host, each reading a run of the files' 1 MiB blocks, when
 * they all opened the very same files (ranks given other copies each read theirs
 * whole): collective over o->host (borrowed until data_close). A failure is the rank's
 * that found it; the others' says another rank failed (shard_err_secondhand). A file
 * (or mask file) whose inode, size and change and modification times are those of an
 * o->seen record (and whose tokens were checked against a vocabulary no larger) is not
 * read: its hash is the record's (the change time moves with any write, so the bytes
 * are those the record's run checked; data_fill checks every token it reads anyway).
 * o NULL: data_open. */
shard_status data_open_on(data_set *ds, const char *spec, int S, int64_t vocab, const data_open_opts *o);
/* The bytes of the files that data_open_on and data_open_masks did not read (seen). */
uint64_t data_seen_bytes(const data_set *ds);
void data_close(data_set *ds);
/* Bytes of token and mask files that this process's opens have read and checked so
 * far (any thread may ask; the argument is unused): a progress line's count. */
uint64_t data_checked_bytes(const void *unused);
/* The loss masks of spec (paths or globs, as data_open's), one per token file in the
 * same order: as many files as token files (SHARD_E_USAGE), each of the mask format
 * with the token count of its token file and bytes 0 or 1 (SHARD_E_INVALID naming
 * both files, or the file and the position). */
shard_status data_open_masks(data_set *ds, const char *spec);
/* The files' fingerprint: their token sizes, counts and hashes (and the masks'), in
 * order; the ranks of a run compare it (a host's other copy of a file). A file's hash
 * is shard_hash64 of its 1 MiB blocks' shard_hash64s (blocks hashed in parallel); states
 * written before 2026-12-07 hold a chain over the blocks instead, kind "xxh64". */
uint64_t data_fingerprint(const data_set *ds);
#define DATA_FINGERPRINT_KIND "xxh64-mib"
/* The same as the training state writes it, "xxh64-mib:<16 hex digits>", into buf (32 bytes). */
const char *data_fingerprint_text(const data_set *ds, char *buf);
/* The stream is documents ended by token sep. */
void data_set_documents(data_set *ds, int32_t sep);
/* The order: sequential (shuffle 0) or shuffled by seed. */
void data_set_order(data_set *ds, int shuffle, uint64_t seed);
/* Position p of a run whose sequences were old_S tokens long, re-expressed at this set's
 * length S (*out; p itself when old_S is S or makes no sequence in these files):
 * sequential (both orders), the first sequence of S that repeats no target trained on
 * at old_S (the same token of the same file; past a file's last whole sequence, the
 * next file's first); shuffled, the same fraction of p's epoch. SHARD_E_INVALID when
 * the result would pass the counters' range. */
shard_status data_position_at(const data_set *ds, uint64_t p, int old_S, int sequential, uint64_t *out);
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
