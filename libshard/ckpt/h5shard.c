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
};

shard_status shard_h5_create(const char *path, shard_compress c, shard_h5_writer **out)
{
    shard_h5_init();
    *out = NULL;
    shard_h5_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->path = strdup(path))) { free(w); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    w->c = c;
    w->file = H5Fcreate(path, H5F_ACC_EXCL, H5P_DEFAULT, H5P_DEFAULT);
    if (w->file < 0) { free(w->path); free(w); return shard_fail(SHARD_E_IO, "%s: cannot create the HDF5 file", path); }
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

/* Copy rows [r0, r0+nr) of the box (rows = index over all dims but the last) from
 * the source into dst (C order), converting dtype. The source is either the whole
 * tensor (whole=1, shape gshape) or the box itself. */
static shard_status gather_rows(void *dst, shard_dtype dt, const void *src, shard_dtype sdt, int ndim,
                                const int64_t *gshape, const shard_box *box, int whole, int64_t r0, int64_t nr)
{
    const size_t ses = shard_dtype_size(sdt), des = shard_dtype_size(dt);
    const int64_t rowlen = ndim ? box->len[ndim - 1] : 1;
    int64_t idx[SHARD_MAX_DIMS];
    for (int64_t r = 0; r < nr; r++) {
        int64_t rem = r0 + r, soff = 0;
        for (int k = ndim - 2; k >= 0; k--) { idx[k] = rem % box->len[k]; rem /= box->len[k]; }
        const int64_t *shape = whole ? gshape : box->len;
        for (int k = 0; k < ndim - 1; k++) soff = soff * shape[k] + idx[k] + (whole ? box->off[k] : 0);
        if (ndim) soff = soff * shape[ndim - 1] + (whole ? box->off[ndim - 1] : 0);
        shard_status s = shard_convert((char *)dst + (size_t)(r * rowlen) * des, dt, (const char *)src + (size_t)soff * ses, sdt, (size_t)rowlen);
        if (s) return s;
    }
    return SHARD_OK;
}

static shard_status write_piece(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                const int64_t *gshape, const shard_box *box, const void *src, shard_dtype sdt, int whole)
{
    if (ndim < 1 || ndim > SHARD_MAX_DIMS || box->ndim != ndim) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": bad rank", w->path, name);
    const uint64_t numel = shard_box_numel(box);
    if (numel == 0) return SHARD_OK; /* empty pieces are not stored */
    const size_t es = shard_dtype_size(dt);
    hid_t h5t = shard_h5_type(dt);
    if (h5t < 0) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": dtype cannot be stored", w->path, name);
    hsize_t dims[SHARD_MAX_DIMS], chunk[SHARD_MAX_DIMS];
    int64_t rowlen = box->len[ndim - 1], nrows = (int64_t)(numel / (uint64_t)rowlen);
    for (int k = 0; k < ndim; k++) { dims[k] = (hsize_t)box->len[k]; chunk[k] = 1; }
    chunk[ndim - 1] = dims[ndim - 1];
    /* chunk = a block of whole rows of about CHUNK_TARGET bytes */
    int64_t rows_per_chunk = (int64_t)(CHUNK_TARGET / ((uint64_t)rowlen * es));
    if (rows_per_chunk < 1) rows_per_chunk = 1;
    if (ndim >= 2) chunk[ndim - 2] = (hsize_t)(rows_per_chunk < box->len[ndim - 2] ? rows_per_chunk : box->len[ndim - 2]);
    if (ndim == 1 && (uint64_t)rowlen * es > CHUNK_TARGET) chunk[0] = CHUNK_TARGET / es;
    int64_t block_rows = ndim >= 2 ? (int64_t)chunk[ndim - 2] : 1;

    char dpath[1024];
    snprintf(dpath, sizeof dpath, "/%s/%s", group, name);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    H5Pset_chunk(dcpl, ndim, chunk);
    if (w->c.zstd_level > 0) {
        unsigned lvl = (unsigned)w->c.zstd_level;
        H5Pset_shuffle(dcpl);
        H5Pset_filter(dcpl, ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &lvl);
    }
    hid_t space = H5Screate_simple(ndim, dims, NULL);
    hid_t ds = H5Dcreate2(w->file, dpath, h5t, space, lcpl, dcpl, H5P_DEFAULT);
    H5Pclose(lcpl); H5Pclose(dcpl);
    if (ds < 0) { H5Sclose(space); return shard_fail(SHARD_E_IO, "%s: cannot create dataset %s", w->path, dpath); }

    shard_status s = SHARD_OK;
    size_t block_bytes = (size_t)(block_rows * rowlen) * es;
    void *buf = malloc(block_bytes);
    XXH64_state_t *h = XXH64_createState();
    if (!buf || !h) { s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", w->path); goto out; }
    XXH64_reset(h, 0);
    /* walk rows in blocks; for ndim >= 2 a block never crosses a boundary of the
     * dims before the last two only if rows are counted in the flattened space:
     * we write with a hyperslab over the flattened row range, chunk-aligned */
    for (int64_t r0 = 0; r0 < nrows; r0 += block_rows) {
        int64_t nr = nrows - r0 < block_rows ? nrows - r0 : block_rows;
        if ((s = gather_rows(buf, dt, src, sdt, ndim, gshape, box, whole, r0, nr))) goto out;
        XXH64_update(h, buf, (size_t)(nr * rowlen) * es);
        /* the rows r0..r0+nr-1 of the flattened [nrows, rowlen] view */
        hsize_t start[SHARD_MAX_DIMS] = {0}, count[SHARD_MAX_DIMS];
        for (int k = 0; k < ndim; k++) count[k] = 1;
        if (ndim == 1) { start[0] = (hsize_t)r0; count[0] = (hsize_t)rowlen; }
        else {
            /* rows inside one [.., len[ndim-2], rowlen] plane: block_rows divides nothing
             * in general, so write row by row across plane boundaries */
            int64_t plane = box->len[ndim - 2];
            int64_t done = 0;
            while (done < nr) {
                int64_t rr = r0 + done, rem = rr;
                int64_t in_plane = rem % plane;
                int64_t take = plane - in_plane < nr - done ? plane - in_plane : nr - done;
                rem /= plane;
                for (int k = ndim - 3; k >= 0; k--) { start[k] = (hsize_t)(rem % box->len[k]); rem /= box->len[k]; count[k] = 1; }
                start[ndim - 2] = (hsize_t)in_plane; count[ndim - 2] = (hsize_t)take;
                start[ndim - 1] = 0; count[ndim - 1] = (hsize_t)rowlen;
                hsize_t mdim = (hsize_t)(take * rowlen);
                hid_t ms = H5Screate_simple(1, &mdim, NULL);
                H5Sselect_hyperslab(space, H5S_SELECT_SET, start, NULL, count, NULL);
                herr_t e = H5Dwrite(ds, h5t, ms, space, H5P_DEFAULT, (char *)buf + (size_t)(done * rowlen) * es);
                H5Sclose(ms);
                if (e < 0) { s = shard_fail(SHARD_E_IO, "%s: writing %s failed (disk full?)", w->path, dpath); goto out; }
                done += take;
            }
            continue;
        }
        hsize_t mdim = count[0];
        hid_t ms = H5Screate_simple(1, &mdim, NULL);
        H5Sselect_hyperslab(space, H5S_SELECT_SET, start, NULL, count, NULL);
        herr_t e = H5Dwrite(ds, h5t, ms, space, H5P_DEFAULT, buf);
        H5Sclose(ms);
        if (e < 0) { s = shard_fail(SHARD_E_IO, "%s: writing %s failed (disk full?)", w->path, dpath); goto out; }
    }
    {
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH64_digest(h));
        int64_t off[SHARD_MAX_DIMS];
        for (int k = 0; k < ndim; k++) off[k] = box->off[k];
        if (set_attr_str(ds, "tensor", name) || set_attr_str(ds, "dtype", shard_dtype_name(dt)) ||
            set_attr_i64(ds, "offset", ndim, off) || set_attr_i64(ds, "global_shape", ndim, gshape) || set_attr_str(ds, "xxh64", hex))
            s = shard_fail(SHARD_E_IO, "%s: writing the attributes of %s failed", w->path, dpath);
    }
out:
    free(buf);
    if (h) XXH64_freeState(h);
    H5Sclose(space);
    H5Dclose(ds);
    return s;
}

shard_status shard_h5_write_piece(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                  const int64_t *gshape, const shard_box *box, const void *src, shard_dtype src_dt)
{
    return write_piece(w, group, name, dt, ndim, gshape, box, src, src_dt, 1);
}

shard_status shard_h5_write_local(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt, int ndim,
                                  const int64_t *gshape, const shard_box *box, const void *local, shard_dtype src_dt)
{
    return write_piece(w, group, name, dt, ndim, gshape, box, local, src_dt, 0);
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
