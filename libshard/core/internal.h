/* Internal helpers shared by libshard's parts; not part of the public API. */
#ifndef SHARD_INTERNAL_H
#define SHARD_INTERNAL_H

#include "shard.h"
#include "core.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>

/* Parse JSON text strictly: one value, duplicate keys rejected, only whitespace
 * after it; errors name path and the position. */
shard_status shard_json_parse(const char *text, size_t len, const char *path, json_t **out);
/* The manifest's "model" object (architecture, dimensions, parameter count). */
json_t *shard_model_to_json(const shard_model_desc *d);
/* "dir/name" into a fresh string (NULL on overflow of memory). */
char *shard_path_join(const char *dir, const char *name);
/* 1 when name is a plain relative path that stays inside its folder. */
int shard_path_is_contained(const char *name);
/* A whole file's checksum of the given kind (core.h) and its size (fd: an open
 * descriptor of path). */
shard_status shard_file_hash(const char *path, shard_fhash_kind kind, uint64_t *hash, uint64_t *bytes);
shard_status shard_fd_hash(int fd, const char *path, shard_fhash_kind kind, uint64_t *hash, uint64_t *bytes);
/* Bytes [from, to) of fd into h, read cap bytes at a time through buf; a file shorter
 * than `to` is "truncated" (SHARD_E_CORRUPT). */
shard_status shard_fd_hash_range(int fd, const char *path, uint64_t from, uint64_t to, void *buf, size_t cap,
                                 shard_fhash_state *h);
/* A shard writer's record of the blocks it wrote itself (SHARD_FHASH_XXH3_BLOCKS):
 * record hashes, from memory, the blocks that lie wholly inside n bytes written at
 * offset `at` (thread-safe); finish computes the file's checksum from those and reads
 * back only the rest (HDF5's metadata, the edges of chunks). Out of memory, a block is
 * simply not kept: it is read back. */
typedef struct {
    pthread_mutex_t mu;
    uint64_t *dig, cap; /* blocks [0, cap): dig[b] is block b's XXH3 where known[b] */
    uint8_t *known;
} shard_blockmap;
void shard_blockmap_init(shard_blockmap *m);
void shard_blockmap_free(shard_blockmap *m);
void shard_blockmap_record(shard_blockmap *m, uint64_t at, const void *buf, size_t n);
shard_status shard_blockmap_finish(shard_blockmap *m, int fd, const char *path, uint64_t *hash, uint64_t *bytes);
/* A shard file's whole-file checksum (SHARD_FHASH_XXH3_BLOCKS), computed by its writer
 * at close, kept beside it in "<path>.fhash" with the file's identity (inode, size,
 * mtime) so that the commit need not read the file again. note: write it (fd: the
 * file, open); noted: 1 and the checksum when a note exists and still describes the
 * file, else 0; the note is removed either way. */
shard_status shard_file_hash_note(const char *path, int fd, uint64_t hash, uint64_t bytes, const char *pieces, size_t n);
int shard_file_hash_noted(const char *path, uint64_t *hash, uint64_t *bytes);
/* The note's lines after the checksum's, the file's pieces as its writer made them (n
 * bytes, NUL-terminated, to free), when the note still describes the file; else NULL.
 * The note stays (shard_file_hash_noted removes it). */
char *shard_file_note_pieces(const char *path, size_t *n);
/* One of those lines (without its line end), written by the shard writer (h5shard.c,
 * pieces_line): group, tensor, dtype, offset, shape, global shape, xxh64, tab-separated;
 * the ints comma-separated. 0 and *out (pointing into line, cut at its tabs), or -1 when
 * it is not one. */
typedef struct {
    const char *group, *name, *dtype, *hex;
    int ndim;
    int64_t off[SHARD_MAX_DIMS], len[SHARD_MAX_DIMS], gshape[SHARD_MAX_DIMS];
} shard_note_piece;
int shard_note_piece_parse(char *line, shard_note_piece *out);
/* A durable writer's background flushes (io/flusher.c): a thread that fdatasyncs the
 * file (a duplicate of fd) once after each kick, while the writer goes on. start: NULL
 * where fd < 0 or no thread can be made (the writer's fsync at close then does it all);
 * kick and stop take NULL. stop waits for the flushes asked for, ends the thread and
 * returns 0 or the errno of the first failed flush, which the writer must report as
 * its fsync's failure (the kernel reports a writeback error once per open file). */
typedef struct shard_flusher shard_flusher;
shard_flusher *shard_flusher_start(int fd);
void shard_flusher_kick(shard_flusher *f);
int shard_flusher_stop(shard_flusher *f);
/* Early writeback for durable writers: count n more bytes written to fd and, past
 * 64 MiB since the last time, start the kernel's writeback of the file without
 * waiting and kick the writer's flusher (*f, started the first time: smaller files
 * never get one), so that the fsync at close finds most of it on disk (no_fsync:
 * never). */
void shard_start_writeback(int fd, shard_flusher **f, uint64_t *unsynced, size_t n, int no_fsync);
/* The most bytes one write(2) of ours hands the kernel. Linux (6.x, ext4 among others)
 * sizes page-cache folios by the write: a 4 MiB write gets 2 MiB folios, taken from the
 * free blocks a VM's balloon has reported to its host (2 MiB and up), so that copying
 * into them faults on the host page by page. Measured here (dd of 1.5 GB to ext4):
 * 4 MiB writes 2.0-4.4 s, 1 MiB 0.7-1.5 s, 256 KiB 0.27-0.40 s, as fast as cp. On bare
 * metal it costs 4 system calls per MiB. */
#define SHARD_WRITE_MAX ((size_t)256 << 10)
/* All n bytes of p at offset off of fd, SHARD_WRITE_MAX at a time: 0, or errno's value
 * (ENOSPC for a write that stops short). */
int shard_pwrite_all(int fd, const void *p, size_t n, uint64_t off);
/* Take the disk blocks of [off, off + len) of fd before writing there (fallocate, the
 * file's size kept): the filesystem then maps each write onto blocks it has instead of
 * reserving them write by write (ext4, dd of 1.5 GB in writes of 256 KiB, by hand:
 * 0.33 s of system time, 0.24 s into taken blocks; with fsync 0.78-0.81 s against
 * 0.67-0.74). 0, or ENOSPC: a filesystem without fallocate is no fault, a full one is. */
int shard_reserve_blocks(int fd, uint64_t off, uint64_t len);
/* Overflow-checked arithmetic: false on overflow. */
static inline bool shard_mul_u64(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline bool shard_add_u64(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_add_overflow(a, b, r); }

#endif
