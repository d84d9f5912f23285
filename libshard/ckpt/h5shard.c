/* Shard files: HDF5, one chunked dataset per piece, shuffle + Zstandard.
 *
 * Zstandard is HDF5's registered filter 32015 (the one hdf5plugin and h5py read);
 * libshard registers its own implementation of it, so writing and reading need no
 * plugin on the system. Half-precision and fp8 pieces are stored as unsigned
 * integers of the same width with a "dtype" attribute naming the real type, because
 * HDF5 and h5py have no bfloat16 or fp8 types (docs/FORMAT.md). */
#include "../core/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#define ZSTD_FILTER_ID 32015
#define CHUNK_TARGET (1u << 20)      /* bytes per chunk: ~1 MiB */
#define ZSTD_MAX_CHUNK (256u << 20)  /* refuse frames that claim more */

/* ---------------------------------------------------------- the zstd filter */
static size_t zstd_filter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes,
                          size_t *buf_size, void **buf)
{
    if (flags & H5Z_FLAG_REVERSE) {
        unsigned long long n = ZSTD_getFrameContentSize(*buf, nbytes);
        if (n == ZSTD_CONTENTSIZE_ERROR || n == ZSTD_CONTENTSIZE_UNKNOWN || n > ZSTD_MAX_CHUNK) return 0;
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
    H5Z_CLASS_T_VERS, (H5Z_filter_t)ZSTD_FILTER_ID, 1, 1, "zstd (smp)", NULL, NULL, zstd_filter,
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_hdf5(void)
{
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* errors come back as statuses, not prints */
    if (H5Zfilter_avail(ZSTD_FILTER_ID) <= 0) H5Zregister(&ZSTD_CLASS);
}
void shard_h5_init(void) { pthread_once(&once, init_hdf5); }

shard_status shard_compress_parse(const char *text, shard_compress *out)
{
    out->threads = 1;
    if (!strcmp(text, "none")) { out->zstd_level = 0; return SHARD_OK; }
    if (!strcmp(text, "zstd")) { out->zstd_level = 3; return SHARD_OK; }
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
};

/* Start writing dirty pages back every 64 MiB, without waiting: the fsync at close
 * then finds most of the file already on disk, and the disk works while we convert. */
static void start_writeback(shard_h5_writer *w, size_t n)
{
    w->unsynced += n;
    if (w->fd < 0 || w->unsynced < (64u << 20)) return;
    sync_file_range(w->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    w->unsynced = 0;
}

shard_status shard_h5_create(const char *path, shard_compress c, shard_h5_writer **out)
{
    shard_h5_init();
    *out = NULL;
    shard_h5_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->path = strdup(path))) { free(w); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    w->c = c;
    w->threads = c.threads > 0 ? (c.threads > 64 ? 64 : c.threads) : 1;
    w->file = H5Fcreate(path, H5F_ACC_EXCL, H5P_DEFAULT, H5P_DEFAULT);
    if (w->file < 0) { free(w->path); free(w); return shard_fail(SHARD_E_IO, "%s: cannot create the HDF5 file", path); }
    void *handle = NULL;
    w->fd = H5Fget_vfd_handle(w->file, H5P_DEFAULT, &handle) >= 0 && handle ? *(int *)handle : -1;
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

static shard_status set_attr_i64(hid_t obj, const char *name, int n, const int64_t *v)
{
    hsize_t dims[1] = {(hsize_t)n};
    hid_t sp = H5Screate_simple(1, dims, NULL);
    hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t e = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_INT64, v);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    return e < 0 ? SHARD_E_IO : SHARD_OK;
}

/* Copy the sub-box `sub` of the piece from a C-order source into dst (C order of
 * sub), converting dtype. The source is the whole tensor (shape gshape) or, when
 * gshape is NULL, a buffer holding exactly `box`. */
static shard_status gather(void *dst, shard_dtype dt, const void *src, shard_dtype sdt, const int64_t *gshape,
                           const shard_box *box, const shard_box *sub)
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
        for (int k = 0; k < nd; k++) soff = gshape ? soff * gshape[k] + idx[k] : soff * box->len[k] + (idx[k] - box->off[k]);
        shard_status s = shard_convert((char *)dst + (size_t)r * (size_t)rowlen * des, dt, (const char *)src + (size_t)soff * ses, sdt, (size_t)rowlen);
        if (s) return s;
    }
    return SHARD_OK;
}

typedef struct {
    const void *src;
    shard_dtype sdt;
    const int64_t *gshape; /* NULL: src holds exactly the box */
    const shard_box *box;
    size_t src_bytes;      /* size of the mapping, for madvise */
} mem_source;

/* fill from memory; for a mapped file, drop the pages read from this process's
 * resident set right away (they stay in the page cache), so converting a model
 * of any size keeps a small footprint. */
static shard_status fill_from_memory(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const mem_source *m = ctx;
    shard_status s = gather(dst, dt, m->src, m->sdt, m->gshape, m->box, sub);
    if (!s && m->gshape && m->src_bytes) {
        const int nd = sub->ndim;
        int64_t first = 0, last = 0;
        for (int k = 0; k < nd; k++) {
            first = first * m->gshape[k] + sub->off[k];
            last = last * m->gshape[k] + sub->off[k] + sub->len[k] - 1;
        }
        const uintptr_t pg = 4096, a = (uintptr_t)m->src + (uintptr_t)first * shard_dtype_size(m->sdt);
        const uintptr_t b = (uintptr_t)m->src + (uintptr_t)(last + 1) * shard_dtype_size(m->sdt);
        uintptr_t lo = (a + pg - 1) & ~(pg - 1), hi = b & ~(pg - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
    return s;
}

/* --------------------------------------------------------- the chunk pipeline */
/* A piece is cut into chunks of whole rows (chunk shape [1, ..., 1, rows, rowlen]).
 * Worker threads each take the next chunk, fill it, byte-shuffle and compress it;
 * then, in chunk order, fold it into the piece's checksum and hand it to HDF5 with
 * H5Dwrite_chunk, which bypasses HDF5's filter pipeline (and its global lock for
 * the compression work). Memory: threads x (chunk + compressed chunk). */
typedef struct {
    shard_h5_writer *w;
    hid_t ds;
    const char *dpath;
    shard_dtype dt;
    const shard_box *box;
    shard_fill_fn fill;
    void *ctx;
    int64_t chunk_rows, rowlen, plane; /* plane: len of the second-last dim (1 for 1-D) */
    uint64_t nchunks, next_take, next_commit;
    XXH64_state_t *hash;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    shard_status s;
} pipeline;

static void chunk_box(const pipeline *p, uint64_t c, shard_box *sub, hsize_t *hoff)
{
    const int nd = p->box->ndim;
    const uint64_t per_plane = (uint64_t)((p->plane + p->chunk_rows - 1) / p->chunk_rows);
    uint64_t plane_idx = c / per_plane, in_plane = c % per_plane;
    *sub = *p->box;
    for (int k = nd - 1; k >= 0; k--) hoff[k] = 0;
    if (nd == 1) {
        sub->off[0] = p->box->off[0] + (int64_t)in_plane * p->chunk_rows;
        int64_t rest = p->box->len[0] - (int64_t)in_plane * p->chunk_rows;
        sub->len[0] = rest < p->chunk_rows ? rest : p->chunk_rows;
        hoff[0] = (hsize_t)(in_plane * (uint64_t)p->chunk_rows);
        return;
    }
    for (int k = nd - 3; k >= 0; k--) {
        int64_t i = (int64_t)(plane_idx % (uint64_t)p->box->len[k]);
        plane_idx /= (uint64_t)p->box->len[k];
        sub->off[k] = p->box->off[k] + i;
        sub->len[k] = 1;
        hoff[k] = (hsize_t)i;
    }
    int64_t r0 = (int64_t)in_plane * p->chunk_rows, rest = p->plane - r0;
    sub->off[nd - 2] = p->box->off[nd - 2] + r0;
    sub->len[nd - 2] = rest < p->chunk_rows ? rest : p->chunk_rows;
    hoff[nd - 2] = (hsize_t)r0;
}

static void shuffle_bytes(uint8_t *dst, const uint8_t *src, size_t n, size_t es)
{
    for (size_t b = 0; b < es; b++)
        for (size_t i = 0; i < n; i++) dst[b * n + i] = src[i * es + b];
}

static void *pipeline_worker(void *arg)
{
    pipeline *p = arg;
    const size_t es = shard_dtype_size(p->dt);
    const size_t full = (size_t)(p->chunk_rows * p->rowlen) * es; /* HDF5 stores whole chunks */
    const int level = p->w->c.zstd_level;
    uint8_t *raw = calloc(1, full), *shuf = level ? malloc(full) : NULL;
    size_t zcap = level ? ZSTD_compressBound(full) : 0;
    uint8_t *z = level ? malloc(zcap) : NULL;
    ZSTD_CCtx *cctx = level ? ZSTD_createCCtx() : NULL;
    if (!raw || (level && (!shuf || !z || !cctx))) {
        pthread_mutex_lock(&p->mu);
        if (!p->s) p->s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", p->w->path);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        goto out;
    }
    for (;;) {
        pthread_mutex_lock(&p->mu);
        uint64_t c = p->next_take++;
        int stop = c >= p->nchunks || p->s;
        pthread_mutex_unlock(&p->mu);
        if (stop) break;
        shard_box sub;
        hsize_t hoff[SHARD_MAX_DIMS];
        chunk_box(p, c, &sub, hoff);
        size_t valid = (size_t)shard_box_numel(&sub) * es;
        if (valid < full) memset(raw + valid, 0, full - valid);
        shard_status s = p->fill(p->ctx, &sub, raw, p->dt);
        const void *out = raw;
        size_t outn = full;
        if (!s && level) {
            shuffle_bytes(shuf, raw, full / es, es);
            size_t r = ZSTD_compressCCtx(cctx, z, zcap, es > 1 ? shuf : raw, full, level);
            if (ZSTD_isError(r)) s = shard_fail(SHARD_E_INTERNAL, "%s: zstd: %s", p->w->path, ZSTD_getErrorName(r));
            out = z;
            outn = r;
        }
        pthread_mutex_lock(&p->mu);
        while (p->next_commit != c && !p->s) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->s && s) p->s = s;
        if (!p->s) {
            XXH64_update(p->hash, raw, valid);
            if (H5Dwrite_chunk(p->ds, H5P_DEFAULT, 0, hoff, outn, out) < 0)
                p->s = shard_fail(SHARD_E_IO, "%s: writing %s failed (disk full?)", p->w->path, p->dpath);
            else
                start_writeback(p->w, outn);
        }
        p->next_commit++;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
out:
    free(raw); free(shuf); free(z);
    ZSTD_freeCCtx(cctx);
    return NULL;
}

shard_status shard_h5_write_stream(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                   const int64_t *gshape, const shard_box *box, shard_fill_fn fill, void *ctx)
{
    if (ndim < 1 || ndim > SHARD_MAX_DIMS || box->ndim != ndim) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": bad rank", w->path, name);
    if (shard_box_numel(box) == 0) return SHARD_OK; /* empty pieces are not stored */
    const size_t es = shard_dtype_size(dt);
    hid_t h5t = shard_h5_type(dt);
    if (h5t < 0) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": dtype cannot be stored", w->path, name);
    pipeline p = {.w = w, .dt = dt, .box = box, .fill = fill, .ctx = ctx};
    p.rowlen = box->len[ndim - 1];
    hsize_t dims[SHARD_MAX_DIMS], chunk[SHARD_MAX_DIMS];
    for (int k = 0; k < ndim; k++) { dims[k] = (hsize_t)box->len[k]; chunk[k] = 1; }
    if (ndim == 1) {
        p.rowlen = 1;
        p.plane = box->len[0];
        p.chunk_rows = (int64_t)(CHUNK_TARGET / es);
        if (p.chunk_rows > p.plane) p.chunk_rows = p.plane;
        chunk[0] = (hsize_t)p.chunk_rows;
    } else {
        p.plane = box->len[ndim - 2];
        p.chunk_rows = (int64_t)(CHUNK_TARGET / ((uint64_t)p.rowlen * es));
        if (p.chunk_rows < 1) p.chunk_rows = 1;
        if (p.chunk_rows > p.plane) p.chunk_rows = p.plane;
        chunk[ndim - 2] = (hsize_t)p.chunk_rows;
        chunk[ndim - 1] = (hsize_t)p.rowlen;
    }
    uint64_t planes = shard_box_numel(box) / (uint64_t)(p.plane * p.rowlen);
    p.nchunks = planes * (uint64_t)((p.plane + p.chunk_rows - 1) / p.chunk_rows);

    char dpath[1024];
    snprintf(dpath, sizeof dpath, "/%s/%s", group, name);
    p.dpath = dpath;
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    H5Pset_chunk(dcpl, ndim, chunk);
    H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER);
    if (w->c.zstd_level > 0) {
        unsigned lvl = (unsigned)w->c.zstd_level;
        H5Pset_shuffle(dcpl);
        H5Pset_filter(dcpl, ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &lvl);
    }
    hid_t space = H5Screate_simple(ndim, dims, NULL);
    p.ds = H5Dcreate2(w->file, dpath, h5t, space, lcpl, dcpl, H5P_DEFAULT);
    H5Pclose(lcpl); H5Pclose(dcpl); H5Sclose(space);
    if (p.ds < 0) return shard_fail(SHARD_E_IO, "%s: cannot create dataset %s", w->path, dpath);
    p.hash = XXH64_createState();
    XXH64_reset(p.hash, 0);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    int nt = w->threads;
    if ((uint64_t)nt > p.nchunks) nt = (int)p.nchunks;
    pthread_t th[64];
    int started = 0;
    for (int i = 1; i < nt; i++) if (pthread_create(&th[started], NULL, pipeline_worker, &p) == 0) started++;
    pipeline_worker(&p);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    shard_status s = p.s;
    if (!s) {
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH64_digest(p.hash));
        int64_t off[SHARD_MAX_DIMS];
        for (int k = 0; k < ndim; k++) off[k] = box->off[k];
        if (set_attr_str(p.ds, "tensor", name) || set_attr_str(p.ds, "dtype", shard_dtype_name(dt)) ||
            set_attr_i64(p.ds, "offset", ndim, off) || set_attr_i64(p.ds, "global_shape", ndim, gshape) || set_attr_str(p.ds, "xxh64", hex))
            s = shard_fail(SHARD_E_IO, "%s: writing the attributes of %s failed", w->path, dpath);
    }
    XXH64_freeState(p.hash);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    H5Dclose(p.ds);
    return s;
}

shard_status shard_h5_write_piece(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                  const int64_t *gshape, const shard_box *box, const void *src, shard_dtype src_dt)
{
    uint64_t n = 1;
    for (int k = 0; k < ndim; k++) n *= (uint64_t)gshape[k];
    mem_source m = {src, src_dt, gshape, box, (size_t)n * shard_dtype_size(src_dt)};
    return shard_h5_write_stream(w, group, name, dt, ndim, gshape, box, fill_from_memory, &m);
}

shard_status shard_h5_write_local(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                  const int64_t *gshape, const shard_box *box, const void *local, shard_dtype src_dt)
{
    mem_source m = {local, src_dt, NULL, box, 0};
    return shard_h5_write_stream(w, group, name, dt, ndim, gshape, box, fill_from_memory, &m);
}

shard_status shard_h5_close(shard_h5_writer *w)
{
    shard_status s = SHARD_OK;
    if (H5Fflush(w->file, H5F_SCOPE_GLOBAL) < 0 || H5Fclose(w->file) < 0) s = shard_fail(SHARD_E_IO, "%s: closing the HDF5 file failed", w->path);
    if (!s) {
        int fd = open(w->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", w->path, strerror(errno));
        if (fd >= 0) close(fd);
    }
    free(w->path);
    free(w);
    return s;
}

void shard_h5_abort(shard_h5_writer *w)
{
    if (!w) return;
    H5Fclose(w->file);
    unlink(w->path);
    free(w->path);
    free(w);
}
