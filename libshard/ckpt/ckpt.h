/* What libshard's checkpoint parts share (not public): HDF5 set-up, the chunking of
 * a piece in its shard file, and the state of a checkpoint opened for reading. */
#ifndef SHARD_CKPT_H
#define SHARD_CKPT_H

#include "../core/internal.h"

#include <hdf5.h>
#include <pthread.h>

void shard_h5_init(void);
void shard_h5_quiet(void); /* shard_h5_init, and no HDF5 error prints from this thread */
/* libshard's HDF5 calls, a sequence at a time (h5shard.c: why); nothing else is taken while held */
void shard_h5_lock(void);
void shard_h5_unlock(void);
hid_t shard_h5_type(shard_dtype dt);
hid_t shard_h5_fapl(int create); /* a shard file's access properties (to H5Pclose) */
/* Attributes of an HDF5 object (h5shard.c). A string: into buf (cap bytes, with its
 * terminating 0); 0, or -1 when missing, not a fixed-length string or too long. An
 * array: 1-D of min_n..max_n elements, read as memory type mt into v (room for
 * max_n); its element count, or -1. */
int shard_h5_attr_str(hid_t obj, const char *name, char *buf, size_t cap);
int shard_h5_attr_ints(hid_t obj, const char *name, hid_t mt, void *v, int64_t min_n, int64_t max_n);

#define SHARD_ZSTD_FILTER_ID 32015
#define SHARD_CHUNK_TARGET (1u << 20)     /* bytes per chunk the writer aims at */
#define SHARD_CHUNKS_MAX 4096             /* per piece: chunk_xxh3 stays a compact attribute */
#define SHARD_CHUNK_BYTES_MAX (256u << 20) /* readers refuse larger chunks */

/* A piece cut into chunks of whole rows (docs/FORMAT.md, "Shard files"). The piece is seen
 * as planes x rows x cols (cols: its last dim, rows: the second-last, planes: the
 * product of the others; a 1-D piece is 1 x n x 1). Chunk k holds rows [r0, r0 + nr)
 * of one plane, that is elements [(plane * rows + r0) * cols, + nr * cols) of the
 * piece's C order: the chunks, in order, are the piece. */
typedef struct {
    int ndim;
    int64_t len[SHARD_MAX_DIMS];
    int64_t planes, rows, cols, chunk_rows;
    uint64_t per_plane, nchunks;
    size_t es, full; /* element size; bytes of a whole chunk (HDF5 stores whole chunks) */
} shard_chunking;

/* The rows per chunk the writer picks: at most ~SHARD_CHUNK_TARGET bytes, at most
 * SHARD_CHUNKS_MAX chunks where the planes allow it, the rows spread evenly over the
 * chunks (a last, partial chunk pads fewer rows than there are chunks). */
int64_t shard_chunking_rows_for(int ndim, const int64_t *len, size_t es);
void shard_chunking_init(shard_chunking *g, int ndim, const int64_t *len, size_t es, int64_t chunk_rows);
/* The HDF5 chunk dims of that chunking (ndim entries). */
void shard_chunking_dims(const shard_chunking *g, hsize_t *dims);
/* Chunk k: its plane, first row and row count, and its HDF5 chunk offset (ndim entries,
 * relative to the piece). */
void shard_chunking_at(const shard_chunking *g, uint64_t k, uint64_t *plane, int64_t *r0, int64_t *nr, hsize_t *hoff);

/* HDF5's shuffle filter, both ways: n elements of es bytes <-> es planes of n bytes. */
void shard_shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t es);
void shard_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t es);
/* elements [from, to) of the n that es planes hold, to dst */
void shard_unshuffle_part(uint8_t *dst, const uint8_t *src, size_t n, size_t es, size_t from, size_t to);

/* ------------------------------------------------------------- the reader */
typedef struct {
    uint64_t addr, size; /* where the chunk's stored bytes are in the file */
} chunk_loc;

/* Where a piece's chunks are and how to check them; looked up once (HDF5 calls, under
 * the checkpoint's lock), then read lock-free with pread. */
typedef struct {
    shard_chunking g;
    chunk_loc *loc;  /* g.nchunks */
    uint64_t *xxh3;  /* per chunk, or NULL: a piece written before chunk checksums */
    int zstd;        /* shuffle + zstd; else stored raw */
    int contiguous;  /* not chunked in the file (h5py's default): chunks of the writer's size */
    int fd;          /* the shard file's descriptor (owned by the checkpoint) */
} piece_index;

typedef struct {
    const char *file, *dataset;
    shard_box box;
    uint64_t xxh64;
    size_t file_index;
    int verified;     /* its xxh64 (legacy) or every chunk (by smp-verify) checked */
    piece_index *ix;  /* NULL until first touched */
} piece;

typedef struct {
    shard_ckpt_tensor t;
    piece *p;
} tensor;

typedef struct scratch scratch;
typedef struct cache_slot cache_slot;

/* A shard file's group whose links were checked (chunkread.c, open_own_dataset). */
typedef struct {
    char group[256]; /* its path */
    int checked;     /* group is set */
    int all_hard;    /* every link in it is a hard link: its datasets' own links need no check */
} ckpt_links;

struct shard_ckpt {
    char *dir;
    json_t *m;
    uint64_t fingerprint; /* XXH64 of smp.json's bytes */
    int lock_fd;          /* smp.json, holding a shared flock while open (-1: released) */
    shard_model_desc model;
    shard_layout layout;
    int stages[SHARD_MAX_PP];
    const char *config;
    tensor *t;
    size_t n;
    const char **files;
    uint64_t *file_bytes, *file_hash;
    shard_fhash_kind file_hash_kind; /* what file_hash holds: by the format version */
    hid_t *h5;   /* open shard files, lazily */
    int *fd;     /* their descriptors for pread, lazily */
    size_t nfiles;
    const char **extras;
    size_t nextras;
    size_t *extra_file; /* extras[k] is files[extra_file[k]] */
    pthread_mutex_t mu; /* HDF5 calls and the lazy state above */
    char *training;
    size_t *file_order, *tensor_order; /* sorted by name: lookups */
    int threads;                       /* per read call (shard_ckpt_set_threads) */
    int uncached;                      /* conversions by shard_convert_uncached */
    pthread_mutex_t smu;               /* the free scratch buffers and the cache */
    scratch *free_scratch;
    cache_slot *cache;                 /* recently decoded chunks (chunkread.c) */
    size_t ncache;
    uint64_t ctick;
    pthread_cond_t ccv;
    uint64_t bytes_read;               /* stored bytes read (atomic) */
    ckpt_links *links;                 /* per file: the group whose links were checked last (under mu) */
    char *strings;                     /* the tensors' names and datasets (compact_manifest) */
};

/* Look a piece's chunks up (once); legacy pieces (no chunk checksums) are also
 * verified whole here unless skip_legacy. Takes c->mu. */
shard_status ckpt_prepare(shard_ckpt *c, tensor *t, piece *p, int skip_legacy);
/* The same with c->mu held: many pieces in one hold (verify.c: a thread per file, whose
 * pieces taken one lock at a time made the threads wake each other at every piece). */
shard_status ckpt_prepare_locked(shard_ckpt *c, tensor *t, piece *p, int skip_legacy);
/* Per-thread buffers, pooled in the checkpoint. */
scratch *ckpt_scratch_get(shard_ckpt *c);
void ckpt_scratch_put(shard_ckpt *c, scratch *s);
void ckpt_scratch_free_all(shard_ckpt *c);
shard_status ckpt_cache_init(shard_ckpt *c);
void ckpt_cache_free(shard_ckpt *c);
/* Read chunk k of p, decode it and check its xxh3 when the piece has them; *out: the
 * chunk's elements (valid bytes first, C order). With stored_out, the chunk is read
 * afresh (not taken from s's last chunk) and *stored_out is its bytes as stored. */
shard_status ckpt_chunk_decode(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, const uint8_t **stored_out,
                               const uint8_t **out);
/* Read chunk k of p and check it as ckpt_chunk_decode does, keeping no decoded copy;
 * with h, its valid bytes go into h too. *stored_out: its bytes as stored. */
shard_status ckpt_chunk_check(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, const uint8_t **stored_out,
                              shard_xxh64_state *h);
/* Bytes of chunk k that are the piece's (the rest of a last chunk is padding). */
size_t ckpt_chunk_valid(const shard_chunking *g, uint64_t k);
/* The piece's xxh64, streaming its chunks in order (p->ix loaded); marks it verified. */
shard_status ckpt_verify_piece(shard_ckpt *c, piece *p);
/* Extra file fi: a regular file (no link) of the manifest's size and xxh64. */
shard_status ckpt_check_extra(const shard_ckpt *c, size_t fi, const char *path);
/* Open shard file fi for pread and HDF5 (takes c->mu). */
shard_status ckpt_open_file(shard_ckpt *c, size_t fi);
/* The path of file fi ("dir/name") into buf. */
void ckpt_file_path(const shard_ckpt *c, size_t fi, char *buf, size_t cap);
/* Run fn(arg, worker) on `threads` threads (the caller is worker 0); the first failure
 * is returned, with its thread's message. */
shard_status ckpt_parallel(int threads, shard_status (*fn)(void *arg, int worker), void *arg);

#endif
