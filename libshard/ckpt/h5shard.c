/* Shard files: HDF5, one chunked dataset per piece, shuffle + Zstandard.
 *
 * Zstandard is HDF5's registered filter 32015 (the one hdf5plugin and h5py read);
 * libshard registers its own implementation of it, so writing and reading need no
 * plugin on the system. Half-precision and fp8 pieces are stored as unsigned
 * integers of the same width with a "dtype" attribute naming the real type, because
 * HDF5 and h5py have no bfloat16 or fp8 types (docs/FORMAT.md). */
#include "ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

/* ---------------------------------------------------------- the zstd filter */
static size_t zstd_filter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes,
                          size_t *buf_size, void **buf)
{
    if (flags & H5Z_FLAG_REVERSE) {
        unsigned long long n = ZSTD_getFrameContentSize(*buf, nbytes);
        if (n == ZSTD_CONTENTSIZE_ERROR || n == ZSTD_CONTENTSIZE_UNKNOWN || n > SHARD_CHUNK_BYTES_MAX) return 0; /* refuse frames that claim more */
        void *out = H5allocate_memory(n ? n : 1, 0);
        if (!out) return 0;
        size_t r = ZSTD_decompress(out, n, *buf, nbytes);
        if (ZSTD_isError(r) || r != n) { H5free_memory(out); return 0; }
        H5free_memory(*buf);
        *buf = out;
        *buf_size = n ? n : 1;
        return n;
    }
    int level = cd_nelmts > 0 ? (int)cd_values[0] : 3;
    size_t cap = ZSTD_compressBound(nbytes);
    void *out = H5allocate_memory(cap, 0);
    if (!out) return 0;
    size_t r = ZSTD_compress(out, cap, *buf, nbytes, level);
    if (ZSTD_isError(r)) { H5free_memory(out); return 0; }
    H5free_memory(*buf);
    *buf = out;
    *buf_size = cap;
    return r;
}

static const H5Z_class2_t ZSTD_CLASS = {
    H5Z_CLASS_T_VERS, (H5Z_filter_t)SHARD_ZSTD_FILTER_ID, 1, 1, "zstd (smp)", NULL, NULL, zstd_filter,
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_hdf5(void)
{
    /* No library shutdown at exit: a file whose flush failed (a full disk) cannot be
     * closed, and HDF5's exit handler, closing it again, crashes (SIGSEGV after the
     * right error line). libshard closes every file it keeps; at exit the rest is
     * abandoned, as the process's memory is. The first HDF5 call, as it must be. */
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* errors come back as statuses, not prints */
    if (H5Zfilter_avail(SHARD_ZSTD_FILTER_ID) <= 0) H5Zregister(&ZSTD_CLASS);
}
void shard_h5_init(void) { pthread_once(&once, init_hdf5); }

/* HDF5's error printing is per thread (thread-safe build): off in every thread that
 * calls it, before the call (a shard file may be closed on a thread of its own). */
void shard_h5_quiet(void)
{
    shard_h5_init();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

/* A thread-safe HDF5 takes its global lock in every API call and, when another thread
 * waits for it, wakes that thread at every release (a mutex and a condition variable,
 * HDF5 1.10's H5TS): two threads taking turns call by call spend their time in futex
 * wake-ups. Each sequence of calls (a batch of pieces' datasets made and described, a
 * piece's index read) takes this lock first, so that HDF5's own is never contended and
 * a thread waits once per sequence, not once per call. */
static pthread_mutex_t h5_mu = PTHREAD_MUTEX_INITIALIZER;
void shard_h5_lock(void) { pthread_mutex_lock(&h5_mu); }
void shard_h5_unlock(void) { pthread_mutex_unlock(&h5_mu); }

/* The metadata cache of each shard file capped at 512 KiB (HDF5's default grows to 32 MiB):
 * each piece's object header is read or written once, and its decoded form in the cache
 * takes ~10x its size in the file; with 8 files open a reshard of a model of 18867
 * tensors (a Qwen3-30B-A3B's count) peaked at 555 MB, 300 MB with the cap, at the same
 * speed (64 KiB: slower, the groups' name indexes no longer stay in the cache). */
#define MDC_MAX (512u << 10)

hid_t shard_h5_fapl(int create)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0) return fapl;
    H5AC_cache_config_t mc = {.version = H5AC__CURR_CACHE_CONFIG_VERSION};
    int ok = H5Pget_mdc_config(fapl, &mc) >= 0;
    if (ok) {
        mc.max_size = MDC_MAX;
        if (mc.initial_size > MDC_MAX) mc.set_initial_size = 1, mc.initial_size = MDC_MAX;
        if (mc.min_size > MDC_MAX) mc.min_size = MDC_MAX;
        ok = H5Pset_mdc_config(fapl, &mc) >= 0;
    }
    if (ok && create) ok = H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110) >= 0;
    if (!ok) { H5Pclose(fapl); return -1; }
    return fapl;
}

shard_status shard_compress_parse(const char *text, shard_compress *out)
{
    out->threads = 1;
    out->no_fsync = 0;
    out->planes = 0;
    if (!strcmp(text, "none")) { out->zstd_level = 0; return SHARD_OK; }
    if (!strcmp(text, "zstd")) { out->zstd_level = 1; out->planes = 1; return SHARD_OK; }
    if (!strncmp(text, "zstd:", 5)) {
        char *end;
        long v = strtol(text + 5, &end, 10);
        if (*end == 0 && end != text + 5 && v >= 1 && v <= 19) { out->zstd_level = (int)v; return SHARD_OK; }
    }
    return shard_fail(SHARD_E_USAGE, "compression \"%s\": expected none, zstd or zstd:N with N in 1..19", text);
}

/* ---------------------------------------------------------------- types */
hid_t shard_h5_type(shard_dtype dt)
{
    switch (dt) {
    case SHARD_DT_F32: return H5T_IEEE_F32LE;
    case SHARD_DT_F64: return H5T_IEEE_F64LE;
    case SHARD_DT_I8: return H5T_STD_I8LE;
    case SHARD_DT_I16: return H5T_STD_I16LE;
    case SHARD_DT_I32: return H5T_STD_I32LE;
    case SHARD_DT_I64: return H5T_STD_I64LE;
    case SHARD_DT_BOOL: case SHARD_DT_U8: case SHARD_DT_F8_E4M3: case SHARD_DT_F8_E5M2: return H5T_STD_U8LE;
    case SHARD_DT_U16: case SHARD_DT_F16: case SHARD_DT_BF16: return H5T_STD_U16LE;
    case SHARD_DT_U32: return H5T_STD_U32LE;
    case SHARD_DT_U64: return H5T_STD_U64LE;
    default: return -1;
    }
}

/* ---------------------------------------------------------------- writer */
struct shard_h5_writer {
    char *path;
    hid_t file;
    shard_compress c;
    int threads;
    int fd;                /* the file's descriptor (sec2 driver), or -1 */
    uint64_t unsynced;     /* bytes handed to HDF5 since writeback was last started */
    shard_flusher *flusher; /* durable writes past 64 MiB: flushes while the file grows, or NULL */
    shard_blockmap blocks; /* the file checksum's blocks hashed as the chunks were written */
    pthread_mutex_t pmu;   /* the pieces' lines (pieces_line) */
    char *pieces;          /* what the commit's scan would read back (pieces_line), for the note */
    size_t plen, pcap;
    int unnoted;           /* a piece's lines could not be kept: the commit scans the file */
    char group[256];       /* the group the last piece went to, known to exist (ensure_group) */
};

shard_status shard_h5_create(const char *path, shard_compress c, shard_h5_writer **out)
{
    shard_h5_quiet();
    *out = NULL;
    shard_h5_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->path = strdup(path))) { free(w); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    w->c = c;
    w->threads = c.threads > 0 ? (c.threads > 64 ? 64 : c.threads) : 1;
    /* HDF5 1.10's own file format (superblock 3, version 2 object headers, 1.10's chunk
     * indexes): its metadata carries checksums that HDF5 checks on every read, so a
     * damaged header is refused instead of parsed (HDF5 1.10.8 reads past its buffers
     * on some malformed attribute messages of the older, unchecked format:
     * tests/fuzz/fuzz_shard.c). h5py reads both. */
    hid_t fapl = shard_h5_fapl(1), fcpl = H5Pcreate(H5P_FILE_CREATE);
    if (fcpl >= 0) H5Pset_obj_track_times(fcpl, 0); /* the root group: no times (ensure_group says why) */
    w->file = fapl >= 0 && fcpl >= 0 ? H5Fcreate(path, H5F_ACC_EXCL, fcpl, fapl) : -1;
    if (fapl >= 0) H5Pclose(fapl);
    if (fcpl >= 0) H5Pclose(fcpl);
    if (w->file < 0) { free(w->path); free(w); return shard_fail(SHARD_E_IO, "%s: cannot create the HDF5 file", path); }
    void *handle = NULL;
    w->fd = H5Fget_vfd_handle(w->file, H5P_DEFAULT, &handle) >= 0 && handle ? *(int *)handle : -1;
    shard_blockmap_init(&w->blocks);
    pthread_mutex_init(&w->pmu, NULL);
    *out = w;
    return SHARD_OK;
}

static shard_status set_attr_str(hid_t obj, const char *name, const char *v)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, strlen(v) + 1);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t e = a < 0 ? -1 : H5Awrite(a, t, v);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp); H5Tclose(t);
    return e < 0 ? SHARD_E_IO : SHARD_OK;
}

/* A 1-D array attribute of 64-bit integers (file type ft, memory type mt). */
static shard_status set_attr_64(hid_t obj, const char *name, hid_t ft, hid_t mt, uint64_t n, const void *v)
{
    hsize_t dims[1] = {(hsize_t)n};
    hid_t sp = H5Screate_simple(1, dims, NULL);
    hid_t a = H5Acreate2(obj, name, ft, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t e = a < 0 ? -1 : H5Awrite(a, mt, v);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    return e < 0 ? SHARD_E_IO : SHARD_OK;
}

int shard_h5_attr_str(hid_t obj, const char *name, char *buf, size_t cap)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return -1;
    hid_t t = H5Aget_type(a), mt = H5Tcopy(H5T_C_S1);
    size_t n = t < 0 ? 0 : H5Tget_size(t);
    int rc = -1;
    /* read as a string one byte longer than the stored one: a null-padded string of n
     * characters (h5py's) keeps them all */
    if (t >= 0 && mt >= 0 && H5Tget_class(t) == H5T_STRING && n > 0 && n + 1 < cap && H5Tset_size(mt, n + 1) >= 0 &&
        H5Aread(a, mt, buf) >= 0) {
        buf[n + 1] = 0;
        rc = 0;
    }
    if (mt >= 0) H5Tclose(mt);
    if (t >= 0) H5Tclose(t);
    H5Aclose(a);
    return rc;
}

int shard_h5_attr_ints(hid_t obj, const char *name, hid_t mt, void *v, int64_t min_n, int64_t max_n)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT), sp = a < 0 ? -1 : H5Aget_space(a);
    hssize_t n = sp < 0 ? -1 : H5Sget_simple_extent_npoints(sp);
    int rc = -1;
    if (n >= min_n && n <= max_n && n > 0 && H5Sget_simple_extent_ndims(sp) == 1 && H5Aread(a, mt, v) >= 0) rc = (int)n;
    if (sp >= 0) H5Sclose(sp);
    if (a >= 0) H5Aclose(a);
    return rc;
}

/* Copy the sub-box `sub` of the piece from src, a C-order buffer holding exactly
 * `box`, into dst (C order of sub), converting dtype. */
static shard_status gather(void *dst, shard_dtype dt, const void *src, shard_dtype sdt, const shard_box *box,
                           const shard_box *sub)
{
    const int nd = sub->ndim;
    const size_t ses = shard_dtype_size(sdt), des = shard_dtype_size(dt);
    const int64_t rowlen = sub->len[nd - 1];
    const uint64_t nrows = shard_box_numel(sub) / (uint64_t)(rowlen ? rowlen : 1);
    int64_t idx[SHARD_MAX_DIMS];
    for (uint64_t r = 0; r < nrows && rowlen; r++) {
        uint64_t rem = r;
        for (int k = nd - 2; k >= 0; k--) { idx[k] = sub->off[k] + (int64_t)(rem % (uint64_t)sub->len[k]); rem /= (uint64_t)sub->len[k]; }
        idx[nd - 1] = sub->off[nd - 1];
        int64_t soff = 0;
        for (int k = 0; k < nd; k++) soff = soff * box->len[k] + (idx[k] - box->off[k]);
        shard_status s = shard_convert((char *)dst + (size_t)r * (size_t)rowlen * des, dt, (const char *)src + (size_t)soff * ses, sdt, (size_t)rowlen);
        if (s) return s;
    }
    return SHARD_OK;
}

typedef struct {
    const void *src; /* holds exactly the box */
    shard_dtype sdt;
    const shard_box *box;
} mem_source;

/* fill from memory (the caller's: nothing is dropped or unmapped here) */
static shard_status fill_from_memory(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const mem_source *m = ctx;
    return gather(dst, dt, m->src, m->sdt, m->box, sub);
}

/* --------------------------------------------------------- the chunk pipeline */
/* A piece is cut into chunks of whole rows (chunk shape [1, ..., 1, rows, rowlen]).
 * The chunks of a list of pieces (of one file or several) form one stream, each file's
 * pieces one after the other (plan_stream says the order). Worker threads each take
 * the next batch of chunks (one chunk of 1 MiB, or up to 64 small ones: take_batch),
 * fill them, byte-shuffle and compress them; then, in each piece's order, fold them
 * into the pieces' checksums (each piece has its own turn: the stream's next chunk, of
 * another piece, does not wait), and, in stream order, hand them to HDF5 with
 * H5Dwrite_chunk, which bypasses HDF5's filter pipeline (and its global lock for the
 * compression work). The holder of the write turn also creates a piece's dataset
 * before its first chunk and gives it its attributes after its last, so each file's
 * operations come in the same order as piece by piece, and the workers never wait for
 * one piece to drain before filling the next. The turns are held by one thread at a
 * time and not under the pipeline's lock: while one thread writes batch b, another
 * hashes batch b+1 and the others fill. Uncompressed pieces ("direct") are made with
 * every chunk's place allocated (H5D_ALLOC_TIME_EARLY, nothing written) and looked up
 * then: their middle chunks take no write turn, only wait for the dataset, and every
 * chunk's bytes go to its place by pwrite outside any turn, from every worker at once
 * and SHARD_WRITE_MAX at a time (HDF5 would hand the kernel the whole chunk in one
 * write, in the turn: a reshard without compression took 1.4-2.3 s that way against
 * 0.73-0.87 s, docs/DESIGN.md). Memory: threads x (batch + compressed batch), a batch
 * 1 MiB or one larger chunk. */
typedef struct {
    const shard_h5_piece *pc;
    hid_t ds;
    shard_chunking g;
    shard_xxh64_state hash; /* the piece's checksum, fed in the piece's order */
    uint64_t *chunk_xxh3;              /* g.nchunks: each chunk's own checksum */
    int direct;                        /* raw chunks placed at creation, written by pwrite in parallel */
    haddr_t *at;                       /* direct: each chunk's place, looked up at creation */
    uint64_t hashed, created;          /* chunks folded into hash; 1 once the dataset is made */
    char hex[17];
} piece_run;

/* a place in the stream: chunk k of run `run`, and its place among the chunks that
 * need HDF5 in stream order (NO_TURN: a direct piece's middle chunk, which needs only
 * its dataset made) */
typedef struct {
    size_t run;
    uint64_t k, turn;
} stream_slot;

#define NO_TURN UINT64_MAX

typedef struct {
    piece_run *runs;
    size_t nruns;
    stream_slot *slot;                 /* nchunks: the stream's order */
    uint64_t nchunks, next_take, next_write;
    size_t max_full;                   /* the largest chunk */
    uint64_t all_full;                 /* all chunks' bytes */
    void (*done)(void *arg, uint64_t bytes);
    void *done_arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    shard_status s;                    /* the first failure */
    char msg[1024];                    /* its message (messages are per thread) */
} pipeline;

/* chunk c of a piece: its box (global coordinates) and HDF5 chunk offset */
static void chunk_box(const piece_run *p, uint64_t c, shard_box *sub, hsize_t *hoff)
{
    const shard_box *box = &p->pc->box;
    const int nd = box->ndim;
    uint64_t plane;
    int64_t r0, nr;
    shard_chunking_at(&p->g, c, &plane, &r0, &nr, hoff);
    *sub = *box;
    const int rdim = nd == 1 ? 0 : nd - 2;
    for (int k = 0; k < rdim; k++) { sub->off[k] = box->off[k] + (int64_t)hoff[k]; sub->len[k] = 1; }
    sub->off[rdim] = box->off[rdim] + r0;
    sub->len[rdim] = nr;
}

/* A piece's chunking: whole rows, about SHARD_CHUNK_TARGET bytes. */
static shard_status plan_run(piece_run *r, const shard_h5_piece *pc)
{
    const size_t es = shard_dtype_size(pc->dt);
    r->pc = pc;
    r->ds = -1;
    r->direct = pc->w->c.zstd_level == 0 && pc->w->fd >= 0;
    shard_chunking_init(&r->g, pc->ndim, pc->box.len, es, shard_chunking_rows_for(pc->ndim, pc->box.len, es));
    if (r->g.full > SHARD_CHUNK_BYTES_MAX) return shard_fail(SHARD_E_UNSUPPORTED, "%s: tensor \"%s\": rows too long to chunk", pc->w->path, pc->name);
    r->chunk_xxh3 = malloc(r->g.nchunks * sizeof *r->chunk_xxh3);
    r->at = r->direct ? malloc(r->g.nchunks * sizeof *r->at) : NULL;
    return r->chunk_xxh3 && (r->at || !r->direct) ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
}

/* The piece's group and the groups above it, made without times: HDF5 stamps the
 * groups it makes (its default), so that two writes of the same pieces in different
 * seconds gave files that differ in those bytes alone. Files are the same bytes for the
 * same pieces, whatever the time or the threads (tests/unit/test_core.c,
 * test_write_batches); the datasets are made without times likewise. */
static shard_status ensure_group(shard_h5_writer *w, const char *group)
{
    if (!strcmp(w->group, group)) return SHARD_OK;
    const size_t n = strlen(group);
    if (n >= sizeof w->group) return SHARD_OK; /* left to the dataset's intermediate groups */
    char prefix[sizeof w->group];
    hid_t gcpl = H5Pcreate(H5P_GROUP_CREATE);
    int ok = gcpl >= 0 && H5Pset_obj_track_times(gcpl, 0) >= 0;
    for (size_t i = 1; ok && i <= n; i++) {
        if (group[i] != '/' && group[i] != 0) continue;
        memcpy(prefix, group, i);
        prefix[i] = 0;
        if (H5Lexists(w->file, prefix, H5P_DEFAULT) > 0) continue;
        hid_t g = H5Gcreate2(w->file, prefix, H5P_DEFAULT, gcpl, H5P_DEFAULT);
        ok = g >= 0;
        if (ok) H5Gclose(g);
    }
    if (gcpl >= 0) H5Pclose(gcpl);
    if (!ok) return shard_fail(SHARD_E_IO, "%s: cannot create group %s", w->path, group);
    memcpy(w->group, group, n + 1);
    return SHARD_OK;
}

static shard_status create_dataset(piece_run *r)
{
    const shard_h5_piece *pc = r->pc;
    shard_status s = ensure_group(pc->w, pc->group);
    if (s) return s;
    char dpath[1024];
    snprintf(dpath, sizeof dpath, "/%s/%s", pc->group, pc->name);
    hsize_t dims[SHARD_MAX_DIMS];
    for (int k = 0; k < pc->ndim; k++) dims[k] = (hsize_t)pc->box.len[k];
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    hsize_t chunk[SHARD_MAX_DIMS];
    shard_chunking_dims(&r->g, chunk);
    H5Pset_chunk(dcpl, pc->ndim, chunk);
    H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER);
    H5Pset_obj_track_times(dcpl, 0);
    if (r->direct) H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY); /* every chunk's place fixed now, nothing written */
    if (pc->w->c.zstd_level > 0) {
        unsigned lvl = (unsigned)pc->w->c.zstd_level;
        H5Pset_shuffle(dcpl);
        H5Pset_filter(dcpl, SHARD_ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &lvl);
    }
    hid_t space = H5Screate_simple(pc->ndim, dims, NULL);
    r->ds = H5Dcreate2(pc->w->file, dpath, shard_h5_type(pc->dt), space, lcpl, dcpl, H5P_DEFAULT);
    H5Pclose(lcpl); H5Pclose(dcpl); H5Sclose(space);
    return r->ds < 0 ? shard_fail(SHARD_E_IO, "%s: cannot create dataset %s", pc->w->path, dpath) : SHARD_OK;
}

/* err: errno's value, or 0 where HDF5 does not tell */
static shard_status write_failed(const shard_h5_piece *pc, int err)
{
    return shard_fail(SHARD_E_IO, "%s: writing /%s/%s failed: %s", pc->w->path, pc->group, pc->name,
                      err ? strerror(err) : "disk full?");
}

/* A direct piece's chunk: its place in the file, allocated when the dataset was made
 * (H5D_ALLOC_TIME_EARLY), checked to hold the n bytes that will be written there. */
static shard_status chunk_place(const piece_run *r, const hsize_t *hoff, size_t n, haddr_t *at)
{
    unsigned mask = 0;
    hsize_t size = 0;
    if (H5Dget_chunk_info_by_coord(r->ds, hoff, &mask, at, &size) < 0 || *at == HADDR_UNDEF || size != n)
        return shard_fail(SHARD_E_IO, "%s: /%s/%s: no place was made for a chunk", r->pc->w->path, r->pc->group, r->pc->name);
    return SHARD_OK;
}

/* A direct piece's chunks' places, looked up once when its dataset is made (so that
 * its middle chunks need no HDF5 call), and its blocks on disk, taken at once before
 * its chunks are written (shard_reserve_blocks). The chunks lie one after the other
 * from the first (early allocation); where they do not, no blocks are taken. */
static shard_status place_chunks(piece_run *r)
{
    shard_box sub;
    hsize_t hoff[SHARD_MAX_DIMS];
    shard_status s = SHARD_OK;
    for (uint64_t k = 0; k < r->g.nchunks && !s; k++) {
        chunk_box(r, k, &sub, hoff);
        s = chunk_place(r, hoff, r->g.full, &r->at[k]);
    }
    if (s) return s; /* r->at is not filled in past the failure */
    /* a piece of one chunk is one pwrite: nothing to keep together (a model of many
     * small tensors spent a twentieth of hf2smp in fallocate) */
    const haddr_t a0 = r->at[0], a1 = r->at[r->g.nchunks - 1];
    const int err = a1 < a0 || r->g.nchunks == 1 ? 0 : shard_reserve_blocks(r->pc->w->fd, a0, a1 - a0 + r->g.full);
    return err ? write_failed(r->pc, err) : SHARD_OK;
}

/* Where HDF5 put the n bytes of a chunk it wrote (H5Dwrite_chunk; in the write turn),
 * so that its blocks go into the file's checksum from memory; HADDR_UNDEF when HDF5
 * does not say it holds exactly these bytes (then they are read back at close). */
static haddr_t written_at(const piece_run *r, const hsize_t *hoff, size_t n)
{
    unsigned mask = 0;
    haddr_t at = HADDR_UNDEF;
    hsize_t size = 0;
    return H5Dget_chunk_info_by_coord(r->ds, hoff, &mask, &at, &size) >= 0 && size == n ? at : HADDR_UNDEF;
}

/* v as "a,b,c" then sep at b[*k...]; 0 when it does not fit in cap */
static int put_ints(char *b, size_t cap, size_t *k, int ndim, const int64_t *v, const char *sep)
{
    for (int i = 0; i <= ndim; i++) {
        int n = i < ndim ? snprintf(b + *k, cap - *k, i ? ",%lld" : "%lld", (long long)v[i]) : snprintf(b + *k, cap - *k, "%s", sep);
        if (n < 0 || (size_t)n >= cap - *k) return 0;
        *k += (size_t)n;
    }
    return 1;
}

/* The piece's line for the commit (docs/DESIGN.md, "Checkpoints of many tensors"):
 * group, tensor, dtype, offset, shape, global shape, xxh64, tab-separated: what the
 * commit would read back from its attributes (shard_note_piece_parse reads it). A name
 * the line cannot hold leaves the file to be scanned. */
static void pieces_line(shard_h5_writer *w, const shard_h5_piece *pc, const char *hex)
{
    char line[4096];
    int64_t off[SHARD_MAX_DIMS], len[SHARD_MAX_DIMS];
    for (int k = 0; k < pc->ndim; k++) off[k] = pc->box.off[k], len[k] = pc->box.len[k];
    int n = snprintf(line, sizeof line, "%s\t%s\t%s\t", pc->group, pc->name, shard_dtype_name(pc->dt));
    size_t k = n > 0 ? (size_t)n : sizeof line;
    int ok = k < sizeof line && !strpbrk(pc->name, "\t\n/") && !strpbrk(pc->group, "\t\n") && pc->name[0] &&
             pc->group[0] && put_ints(line, sizeof line, &k, pc->ndim, off, "\t") &&
             put_ints(line, sizeof line, &k, pc->ndim, len, "\t") && put_ints(line, sizeof line, &k, pc->ndim, pc->gshape, "\t");
    if (ok) {
        n = snprintf(line + k, sizeof line - k, "%s\n", hex);
        ok = n > 0 && (size_t)n < sizeof line - k;
        if (ok) k += (size_t)n;
    }
    const size_t m = k;
    pthread_mutex_lock(&w->pmu);
    if (ok && !w->unnoted && w->plen + m > w->pcap) {
        size_t cap = w->pcap ? w->pcap * 2 : 1 << 16;
        while (cap < w->plen + m) cap *= 2;
        char *grown = realloc(w->pieces, cap);
        if (grown) w->pieces = grown, w->pcap = cap;
        else ok = 0;
    }
    if (!ok) w->unnoted = 1;
    else if (!w->unnoted) memcpy(w->pieces + w->plen, line, m), w->plen += m;
    pthread_mutex_unlock(&w->pmu);
}

/* After the last chunk: the attributes that make the piece self-describing. */
static shard_status finish_dataset(piece_run *r)
{
    const shard_h5_piece *pc = r->pc;
    int64_t off[SHARD_MAX_DIMS];
    for (int k = 0; k < pc->ndim; k++) off[k] = pc->box.off[k];
    shard_status s = SHARD_OK;
    if (set_attr_str(r->ds, "tensor", pc->name) || set_attr_str(r->ds, "dtype", shard_dtype_name(pc->dt)) ||
        set_attr_64(r->ds, "offset", H5T_STD_I64LE, H5T_NATIVE_INT64, (uint64_t)pc->ndim, off) ||
        set_attr_64(r->ds, "global_shape", H5T_STD_I64LE, H5T_NATIVE_INT64, (uint64_t)pc->ndim, pc->gshape) ||
        set_attr_str(r->ds, "xxh64", r->hex) ||
        set_attr_64(r->ds, "chunk_xxh3", H5T_STD_U64LE, H5T_NATIVE_UINT64, r->g.nchunks, r->chunk_xxh3))
        s = shard_fail(SHARD_E_IO, "%s: writing the attributes of /%s/%s failed", pc->w->path, pc->group, pc->name);
    if (!s) pieces_line(pc->w, pc, r->hex);
    H5Dclose(r->ds);
    r->ds = -1;
    return s;
}

/* Record a failure (p->mu held; the first one wins, with its thread's message) and
 * wake every waiting worker, so that all of them stop. */
static void fail_locked(pipeline *p, shard_status s)
{
    if (s && !p->s) {
        p->s = s;
        snprintf(p->msg, sizeof p->msg, "%s", shard_errmsg());
    }
    if (s) pthread_cond_broadcast(&p->cv);
}

/* Wait (p->mu held) until *turn reaches c; 0 when it did, 1 when the stream failed.
 * *woke 0: this thread has moved turns on without waking the others; it wakes them
 * before it sleeps (and sets *woke). */
static int wait_turn(pipeline *p, const uint64_t *turn, uint64_t c, int *woke)
{
    if (*turn != c && !*woke) {
        pthread_cond_broadcast(&p->cv);
        *woke = 1;
    }
    while (*turn != c && !p->s) pthread_cond_wait(&p->cv, &p->mu);
    return p->s != SHARD_OK;
}

/* One chunk's zstd frame. The default ("zstd": c->planes) is level 1's fast strategy
 * finding matches of 7 bytes and up in a 64-entry table: a shuffled chunk of numbers is
 * byte planes of near-random mantissa bytes (which zstd stores raw either way) and
 * low-entropy exponent bytes, whose short matches cost more to decode than they save.
 * On bf16 weights that is 1.06x level 3's ratio at 3x its decoding speed (FORMAT.md). */
static size_t zstd_chunk(ZSTD_CCtx *z, const shard_compress *c, void *dst, size_t cap, const void *src, size_t n)
{
    size_t e = ZSTD_CCtx_reset(z, ZSTD_reset_parameters);
    if (!ZSTD_isError(e)) e = ZSTD_CCtx_setParameter(z, ZSTD_c_compressionLevel, c->zstd_level);
    if (!ZSTD_isError(e) && c->planes) e = ZSTD_CCtx_setParameter(z, ZSTD_c_minMatch, 7);
    if (!ZSTD_isError(e) && c->planes) e = ZSTD_CCtx_setParameter(z, ZSTD_c_hashLog, 6);
    return ZSTD_isError(e) ? e : ZSTD_compress2(z, dst, cap, src, n);
}

/* A worker's batch: consecutive slots of the stream, up to BATCH_BYTES of chunks (or
 * one larger chunk), BATCH_MAX of them. A model of many small tensors has a chunk of a
 * few KB per piece; taken one at a time, the workers passed the turns to each other
 * at every chunk and the futex wake-ups cost more than the second thread gave (a
 * reshard of 18867 tensors: 14.9 s on 2 threads, 8.7 s on one). */
#define BATCH_BYTES SHARD_CHUNK_TARGET
#define BATCH_MAX 64

typedef struct {
    uint64_t c0, n;              /* slots c0 .. c0 + n - 1 */
    uint8_t *raw, *shuf, *z;     /* the chunks as filled, one shuffled, the compressed ones */
    size_t rawcap, zcap;
    ZSTD_CCtx *cctx;
    uint8_t *filled[BATCH_MAX];  /* each chunk as filled (valid bytes of it count) */
    const void *out[BATCH_MAX];  /* each chunk as stored, outn bytes */
    size_t outn[BATCH_MAX], valid[BATCH_MAX];
    haddr_t at[BATCH_MAX];       /* where it goes in its file */
} batch;

static shard_status batch_init(pipeline *p, batch *b)
{
    int zstd = 0;
    for (size_t i = 0; i < p->nruns; i++) zstd |= p->runs[i].pc->w->c.zstd_level > 0;
    const uint64_t most = p->all_full < BATCH_BYTES ? p->all_full : BATCH_BYTES; /* a stream of one small piece: its bytes */
    b->rawcap = p->max_full > most ? p->max_full : (size_t)most;
    b->zcap = zstd ? ZSTD_compressBound(b->rawcap) : 0;
    b->raw = malloc(b->rawcap);
    b->shuf = zstd ? malloc(p->max_full) : NULL;
    b->z = zstd ? malloc(b->zcap) : NULL;
    b->cctx = zstd ? ZSTD_createCCtx() : NULL;
    if (b->raw && (!zstd || (b->shuf && b->z && b->cctx))) return SHARD_OK;
    return shard_fail(SHARD_E_NOMEM, "%s: out of memory", p->runs[0].pc->w->path);
}

static void batch_free(batch *b)
{
    free(b->raw); free(b->shuf); free(b->z);
    ZSTD_freeCCtx(b->cctx);
}

/* The next batch of the stream (p->mu held); 0 when none is left or the stream failed. */
static int take_batch(pipeline *p, batch *b)
{
    b->c0 = p->next_take;
    b->n = 0;
    if (p->s) return 0;
    for (size_t raw = 0, z = 0; b->c0 + b->n < p->nchunks && b->n < BATCH_MAX; b->n++) {
        const size_t full = p->runs[p->slot[b->c0 + b->n].run].g.full, zb = b->zcap ? ZSTD_compressBound(full) : 0;
        if (b->n && (raw + full > b->rawcap || z + zb > b->zcap)) break;
        raw += full;
        z += zb;
    }
    p->next_take += b->n;
    return b->n > 0;
}

/* Each chunk filled, checksummed alone, shuffled and compressed (no lock held). */
static shard_status fill_batch(pipeline *p, batch *b)
{
    size_t roff = 0, zoff = 0;
    for (uint64_t i = 0; i < b->n; i++) {
        const stream_slot *sl = &p->slot[b->c0 + i];
        piece_run *run = &p->runs[sl->run];
        const shard_h5_piece *pc = run->pc;
        const size_t es = run->g.es, full = run->g.full;
        uint8_t *raw = b->raw + roff;
        shard_box sub;
        hsize_t hoff[SHARD_MAX_DIMS];
        chunk_box(run, sl->k, &sub, hoff);
        const size_t valid = (size_t)shard_box_numel(&sub) * es;
        if (valid < full) memset(raw + valid, 0, full - valid);
        shard_status s = pc->fill(pc->ctx, &sub, raw, pc->dt);
        if (s) return s;
        run->chunk_xxh3[sl->k] = shard_xxh3(raw, valid); /* a chunk's own: readers of a slice check it alone */
        b->filled[i] = raw;
        b->out[i] = raw;
        b->outn[i] = full;
        b->valid[i] = valid;
        if (pc->w->c.zstd_level) {
            shard_shuffle(b->shuf, raw, full / es, es);
            size_t r = zstd_chunk(b->cctx, &pc->w->c, b->z + zoff, b->zcap - zoff, es > 1 ? b->shuf : raw, full);
            if (ZSTD_isError(r)) return shard_fail(SHARD_E_INTERNAL, "%s: zstd: %s", pc->w->path, ZSTD_getErrorName(r));
            b->out[i] = b->z + zoff;
            b->outn[i] = r;
            zoff += r;
        }
        roff += full;
        if (shard_cancelled()) return shard_fail_cancelled(); /* a batch at a time: the signal stops it soon */
    }
    return SHARD_OK;
}

/* Each chunk folded into its piece's checksum, in the piece's order (the holder of a
 * piece's turn alone touches its hash; the others are woken once, at the end or before
 * this thread sleeps). 1 when the stream failed. */
static int hash_batch(pipeline *p, batch *b)
{
    int woke = 1, failed = 0;
    pthread_mutex_lock(&p->mu);
    for (uint64_t i = 0; i < b->n && !failed; i++) {
        const stream_slot *sl = &p->slot[b->c0 + i];
        piece_run *run = &p->runs[sl->run];
        if ((failed = wait_turn(p, &run->hashed, sl->k, &woke))) break;
        pthread_mutex_unlock(&p->mu);
        if (sl->k == 0) shard_xxh64_reset(&run->hash);
        shard_xxh64_update(&run->hash, b->filled[i], b->valid[i]);
        if (sl->k + 1 == run->g.nchunks)
            snprintf(run->hex, sizeof run->hex, "%016llx", (unsigned long long)shard_xxh64_digest(&run->hash));
        pthread_mutex_lock(&p->mu);
        run->hashed++;
        woke = 0;
    }
    if (!woke) pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return failed;
}

/* 1 when slot i's piece has its first chunk earlier in the batch (made here, not waited for) */
static int made_in_batch(const pipeline *p, const batch *b, uint64_t i)
{
    for (uint64_t j = 0; j < i; j++)
        if (p->slot[b->c0 + j].run == p->slot[b->c0 + i].run && p->slot[b->c0 + j].k == 0) return 1;
    return 0;
}

/* Wait (p->mu held) for HDF5's part of the batch: the datasets its middle chunks need
 * made, then the write turn of its first chunk that takes one (the batch's turns are
 * consecutive: it then holds them all). *last: one past its last turn (0: none). */
static int wait_write(pipeline *p, const batch *b, uint64_t *last)
{
    int woke = 1;
    uint64_t first = NO_TURN;
    *last = 0;
    for (uint64_t i = 0; i < b->n; i++) {
        const stream_slot *sl = &p->slot[b->c0 + i];
        if (sl->turn != NO_TURN) {
            if (first == NO_TURN) first = sl->turn;
            *last = sl->turn + 1;
        } else if (!made_in_batch(p, b, i) && wait_turn(p, &p->runs[sl->run].created, 1, &woke)) {
            return 1;
        }
    }
    return first != NO_TURN && wait_turn(p, &p->next_write, first, &woke);
}

/* HDF5's part, in stream order (the chunks' places in the file follow it), under the
 * HDF5 lock: a piece's dataset made before its first chunk, a compressed chunk written
 * through H5Dwrite_chunk, a piece's attributes after its last chunk. any 0: none of
 * the batch's chunks takes a turn (a direct piece's middle chunks), no HDF5 call. */
static shard_status h5_batch(pipeline *p, batch *b, int any)
{
    shard_status s = SHARD_OK;
    if (any) shard_h5_lock();
    for (uint64_t i = 0; i < b->n && !s; i++) {
        const stream_slot *sl = &p->slot[b->c0 + i];
        piece_run *run = &p->runs[sl->run];
        shard_box sub;
        hsize_t hoff[SHARD_MAX_DIMS];
        chunk_box(run, sl->k, &sub, hoff);
        if (sl->k == 0) s = create_dataset(run);
        if (!s && sl->k == 0 && run->direct) s = place_chunks(run);
        b->at[i] = HADDR_UNDEF;
        if (!s && run->direct) b->at[i] = run->at[sl->k];
        else if (!s && H5Dwrite_chunk(run->ds, H5P_DEFAULT, 0, hoff, b->outn[i], b->out[i]) < 0)
            s = write_failed(run->pc, 0);
        else if (!s)
            b->at[i] = written_at(run, hoff, b->outn[i]);
        if (!s && sl->k + 1 == run->g.nchunks) s = finish_dataset(run);
    }
    if (any) shard_h5_unlock();
    return s;
}

/* After HDF5's part (when the batch took turns, or failed): the turns passed on, the
 * datasets made announced. */
static void end_write(pipeline *p, const batch *b, uint64_t last, shard_status s)
{
    pthread_mutex_lock(&p->mu);
    fail_locked(p, s);
    for (uint64_t i = 0; i < b->n && !s; i++)
        if (p->slot[b->c0 + i].k == 0) p->runs[p->slot[b->c0 + i].run].created = 1;
    if (last && !s) p->next_write = last;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* The bytes of uncompressed chunks to their places, by pwrite from every worker at once
 * (HDF5 wrote the compressed ones); each written block into its file's checksum. */
static shard_status put_batch(pipeline *p, const batch *b)
{
    for (uint64_t i = 0; i < b->n; i++) {
        const piece_run *run = &p->runs[p->slot[b->c0 + i].run];
        const shard_h5_piece *pc = run->pc;
        const int err = run->direct ? shard_pwrite_all(pc->w->fd, b->out[i], b->outn[i], (uint64_t)b->at[i]) : 0;
        if (err) return write_failed(pc, err);
        if (b->at[i] != HADDR_UNDEF) shard_blockmap_record(&pc->w->blocks, (uint64_t)b->at[i], b->out[i], b->outn[i]);
    }
    pthread_mutex_lock(&p->mu);
    for (uint64_t i = 0; i < b->n; i++) {
        const shard_h5_piece *pc = p->runs[p->slot[b->c0 + i].run].pc;
        shard_start_writeback(pc->w->fd, &pc->w->flusher, &pc->w->unsynced, b->outn[i], pc->w->c.no_fsync); /* the disk works while we convert */
        if (p->done) p->done(p->done_arg, b->valid[i]);
    }
    pthread_mutex_unlock(&p->mu);
    return SHARD_OK;
}

static void *pipeline_worker(void *arg)
{
    pipeline *p = arg;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* per thread in a thread-safe HDF5: no prints */
    batch b = {0};
    shard_status s = batch_init(p, &b);
    for (;;) {
        pthread_mutex_lock(&p->mu);
        fail_locked(p, s);
        const int more = !s && take_batch(p, &b);
        pthread_mutex_unlock(&p->mu);
        if (!more) break;
        if ((s = fill_batch(p, &b))) continue;
        if (hash_batch(p, &b)) break;
        uint64_t last;
        pthread_mutex_lock(&p->mu);
        const int failed = wait_write(p, &b, &last);
        pthread_mutex_unlock(&p->mu);
        if (failed) break;
        s = h5_batch(p, &b, last != 0);
        if (last || s) end_write(p, &b, last, s);
        if (!s) s = put_batch(p, &b);
    }
    batch_free(&b);
    H5Eclear2(H5E_DEFAULT); /* this thread's error stack, before the thread ends */
    return NULL;
}

/* The stream's order: the runs, in groups of consecutive pieces of distinct files
 * (piece i of each of the files written side by side), each group's chunks taken in
 * turn, one of each piece that has chunks left. Workers taking consecutive chunks
 * then write to different files (Linux holds a file's inode lock through each
 * buffered write: two writers of one file spin on it), while each file still sees its
 * pieces one after the other. */
static shard_status plan_stream(pipeline *p)
{
    p->slot = malloc(p->nchunks * sizeof *p->slot);
    if (!p->slot) return shard_fail(SHARD_E_NOMEM, "out of memory");
    uint64_t c = 0, turn = 0;
    for (size_t g0 = 0, g1; g0 < p->nruns; g0 = g1) {
        for (g1 = g0 + 1; g1 < p->nruns; g1++) {
            size_t i = g0;
            while (i < g1 && p->runs[i].pc->w != p->runs[g1].pc->w) i++;
            if (i < g1) break; /* a second piece of a file: the next group */
        }
        for (uint64_t k = 0, left = 1; left; k++) {
            left = 0;
            for (size_t i = g0; i < g1; i++)
                if (k < p->runs[i].g.nchunks) {
                    const int middle = p->runs[i].direct && k > 0 && k + 1 < p->runs[i].g.nchunks;
                    p->slot[c++] = (stream_slot){i, k, middle ? NO_TURN : turn++};
                    left = 1;
                }
        }
    }
    return SHARD_OK;
}

shard_status shard_h5_write_pieces(const shard_h5_piece *pieces, size_t n, void (*done)(void *arg, uint64_t bytes), void *arg)
{
    for (size_t i = 0; i < n; i++) {
        const shard_h5_piece *pc = &pieces[i];
        if (pc->ndim < 1 || pc->ndim > SHARD_MAX_DIMS || pc->box.ndim != pc->ndim)
            return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": bad rank", pc->w->path, pc->name);
        if (shard_h5_type(pc->dt) < 0) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": dtype cannot be stored", pc->w->path, pc->name);
    }
    pipeline p = {.done = done, .done_arg = arg};
    p.runs = calloc(n + 1, sizeof *p.runs);
    if (!p.runs) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (shard_box_numel(&pieces[i].box) == 0) continue; /* empty pieces are not stored */
        piece_run *r = &p.runs[p.nruns++];
        if (!p.s) p.s = plan_run(r, &pieces[i]);
        p.nchunks += r->g.nchunks;
        if (r->g.full > p.max_full) p.max_full = r->g.full;
        p.all_full += r->g.full * r->g.nchunks;
    }
    if (p.nchunks && !p.s) p.s = plan_stream(&p);
    if (p.nchunks && !p.s) {
        pthread_mutex_init(&p.mu, NULL);
        pthread_cond_init(&p.cv, NULL);
        int nt = p.runs[0].pc->w->threads;
        if ((uint64_t)nt > p.nchunks) nt = (int)p.nchunks;
        pthread_t th[64];
        int started = 0;
        for (int i = 1; i < nt; i++) if (pthread_create(&th[started], NULL, pipeline_worker, &p) == 0) started++;
        pipeline_worker(&p);
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        pthread_mutex_destroy(&p.mu);
        pthread_cond_destroy(&p.cv);
    }
    for (size_t i = 0; i < p.nruns; i++) {
        if (p.runs[i].ds >= 0) H5Dclose(p.runs[i].ds); /* a piece left unfinished by a failure */
        free(p.runs[i].chunk_xxh3);
        free(p.runs[i].at);
    }
    free(p.runs);
    free(p.slot);
    if (p.s && p.msg[0]) return shard_fail(p.s, "%s", p.msg); /* the failing worker's message, here */
    return p.s;
}

shard_status shard_h5_write_stream(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                   const int64_t *gshape, const shard_box *box, shard_fill_fn fill, void *ctx)
{
    shard_h5_piece pc = {w, group, name, dt, ndim, gshape, *box, fill, ctx};
    return shard_h5_write_pieces(&pc, 1, NULL, NULL);
}

shard_status shard_h5_write_local(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                  const int64_t *gshape, const shard_box *box, const void *local, shard_dtype src_dt)
{
    mem_source m = {local, src_dt, box};
    return shard_h5_write_stream(w, group, name, dt, ndim, gshape, box, fill_from_memory, &m);
}

/* A shard file that will not be kept: emptied first, so that HDF5's close, which still
 * writes the file's metadata, has the room it needs on a full disk (a close that fails
 * leaves HDF5's file object behind), then closed. */
static void discard_h5(shard_h5_writer *w)
{
    if (w->fd >= 0 && ftruncate(w->fd, 0) != 0) { /* nothing more to do: the close may fail */ }
    H5Fclose(w->file);
}

shard_status shard_h5_close(shard_h5_writer *w)
{
    shard_h5_quiet();
    shard_status s = SHARD_OK;
    if (H5Fflush(w->file, H5F_SCOPE_GLOBAL) < 0) {
        s = shard_fail(SHARD_E_IO, "%s: writing the HDF5 file's metadata failed (disk full?)", w->path);
        discard_h5(w);
    } else if (H5Fclose(w->file) < 0) {
        s = shard_fail(SHARD_E_IO, "%s: closing the HDF5 file failed", w->path);
    }
    int fd = s ? -1 : open(w->path, O_RDONLY | O_CLOEXEC);
    if (!s && fd < 0) s = shard_fail(SHARD_E_IO, "%s: cannot open: %s", w->path, strerror(errno));
    /* the file's checksum for the commit, while the disk writes the rest back: the
     * chunks' blocks were hashed as they were written, the rest is read back */
    uint64_t hash = 0, bytes = 0;
    if (!s && !w->c.no_fsync) sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    if (!s) s = shard_blockmap_finish(&w->blocks, fd, w->path, &hash, &bytes);
    const int flushed = shard_flusher_stop(w->flusher); /* a failure it saw is this fsync's */
    if (!s && flushed) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", w->path, strerror(flushed));
    if (!s && !w->c.no_fsync && fsync(fd) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", w->path, strerror(errno));
    if (!s) /* without a note, the commit reads the file; without its pieces, scans it */
        (void)shard_file_hash_note(w->path, fd, hash, bytes, w->unnoted ? NULL : w->pieces, w->unnoted ? 0 : w->plen);
    if (fd >= 0) close(fd);
    H5Eclear2(H5E_DEFAULT); /* a failure's error stack: this may be a thread of its own, about to end */
    shard_blockmap_free(&w->blocks);
    pthread_mutex_destroy(&w->pmu);
    free(w->pieces);
    free(w->path);
    free(w);
    return s;
}

void shard_h5_abort(shard_h5_writer *w)
{
    if (!w) return;
    shard_h5_quiet();
    (void)shard_flusher_stop(w->flusher);
    discard_h5(w);
    unlink(w->path);
    shard_blockmap_free(&w->blocks);
    pthread_mutex_destroy(&w->pmu);
    free(w->pieces);
    free(w->path);
    free(w);
}
