/* Reading boxes of tensors: the planner intersects the stored pieces with the wanted
 * box, and the chunks that the intersection touches are read with pread, decompressed,
 * unshuffled, checked against their own XXH3 and scattered into the box, by as many
 * threads as the checkpoint is given. HDF5 is asked once per piece where its chunks
 * lie (under the checkpoint's lock); the data never passes through HDF5's selections. */
#include "ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zstd.h>

struct scratch {
    scratch *next;
    uint8_t *stored, *tmp, *raw; /* the stored bytes; decompressed; unshuffled */
    size_t cap_stored, cap_tmp, cap_raw;
    ZSTD_DCtx *dctx;
};

void ckpt_file_path(const shard_ckpt *c, size_t fi, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/%s", c->dir, c->files[fi]);
}

/* ------------------------------------------------------------------ scratch */
scratch *ckpt_scratch_get(shard_ckpt *c)
{
    pthread_mutex_lock(&c->smu);
    scratch *s = c->free_scratch;
    if (s) c->free_scratch = s->next;
    pthread_mutex_unlock(&c->smu);
    return s ? s : calloc(1, sizeof *s);
}

void ckpt_scratch_put(shard_ckpt *c, scratch *s)
{
    if (!s) return;
    pthread_mutex_lock(&c->smu);
    s->next = c->free_scratch;
    c->free_scratch = s;
    pthread_mutex_unlock(&c->smu);
}

void ckpt_scratch_free_all(shard_ckpt *c)
{
    for (scratch *s = c->free_scratch, *n; s; s = n) {
        n = s->next;
        free(s->stored); free(s->tmp); free(s->raw);
        ZSTD_freeDCtx(s->dctx);
        free(s);
    }
    c->free_scratch = NULL;
}

static int grow(uint8_t **b, size_t *cap, size_t need)
{
    if (*cap >= need) return 0;
    uint8_t *n = malloc(need);
    if (!n) return -1;
    free(*b);
    *b = n;
    *cap = need;
    return 0;
}

/* Room for a compressed chunk (stored bytes, and the decompressed ones before unshuffling). */
static shard_status scratch_fit(scratch *s, size_t stored, size_t raw, int zstd)
{
    int bad = grow(&s->stored, &s->cap_stored, stored);
    if (!bad && zstd) {
        bad = grow(&s->tmp, &s->cap_tmp, raw);
        if (!s->dctx) s->dctx = ZSTD_createDCtx();
        bad |= !s->dctx;
    }
    if (bad) return shard_fail(SHARD_E_NOMEM, "out of memory for a chunk of %zu bytes", raw);
    return SHARD_OK;
}

/* ------------------------------------------------------------- the index */
/* Open shard file fi for HDF5 and for pread (c->mu held): a regular file of the size
 * the manifest says. */
static shard_status open_file(shard_ckpt *c, size_t fi)
{
    char path[4200];
    ckpt_file_path(c, fi, path, sizeof path);
    if (c->fd[fi] >= 0) return SHARD_OK;
    int fd;
    uint64_t size;
    shard_status s = shard_open_regular(path, 1, &fd, &size); /* inside the checkpoint: no links out of it */
    if (s) return s;
    if (size != c->file_bytes[fi])
        s = shard_fail(SHARD_E_CORRUPT, "%s: %llu bytes, the manifest says %llu (truncated or replaced)", path, (unsigned long long)size,
                       (unsigned long long)c->file_bytes[fi]);
    else {
        hid_t fapl = shard_h5_fapl(0);
        if ((c->h5[fi] = H5Fopen(path, H5F_ACC_RDONLY, fapl)) < 0)
            s = shard_fail(SHARD_E_CORRUPT, "%s: not a readable HDF5 file", path);
        if (fapl >= 0) H5Pclose(fapl);
    }
    if (s) { close(fd); return s; }
    c->fd[fi] = fd;
    return SHARD_OK;
}

shard_status ckpt_open_file(shard_ckpt *c, size_t fi)
{
    pthread_mutex_lock(&c->mu);
    shard_status s = open_file(c, fi);
    pthread_mutex_unlock(&c->mu);
    return s;
}

/* attribute `name` of n uint64 into *out (malloc'd), or *out NULL when it is absent;
 * -1 when it is there but not that */
static int attr_u64s(hid_t ds, const char *name, uint64_t n, uint64_t **out)
{
    *out = NULL;
    if (H5Aexists(ds, name) <= 0) return 0;
    int bad = n > INT64_MAX || !(*out = malloc(n * sizeof **out)) ||
              shard_h5_attr_ints(ds, name, H5T_NATIVE_UINT64, *out, (int64_t)n, (int64_t)n) < 0;
    if (bad) { free(*out); *out = NULL; return -1; }
    return 0;
}

static int attr_str_is(hid_t ds, const char *name, const char *want)
{
    char buf[64];
    return !shard_h5_attr_str(ds, name, buf, sizeof buf) && !strcmp(buf, want);
}

/* The dataset's shape, type, chunking and filters as smp writes them. */
static shard_status check_layout(hid_t ds, const tensor *t, const piece *p, const char *path, piece_index *ix)
{
    const int nd = t->t.ndim;
    hid_t space = H5Dget_space(ds), ft = H5Dget_type(ds), dcpl = H5Dget_create_plist(ds);
    hsize_t dims[SHARD_MAX_DIMS], chunk[SHARD_MAX_DIMS];
    int ok = space >= 0 && H5Sget_simple_extent_ndims(space) == nd;
    if (ok) H5Sget_simple_extent_dims(space, dims, NULL);
    for (int k = 0; ok && k < nd; k++) ok = dims[k] == (hsize_t)p->box.len[k];
    ok = ok && ft >= 0 && H5Tequal(ft, shard_h5_type(t->t.dtype)) > 0;
    shard_status s = ok ? SHARD_OK : shard_fail(SHARD_E_CORRUPT, "%s: dataset %s has another shape or type than the manifest says", path, p->dataset);
    if (!s && H5Pget_external_count(dcpl) != 0) /* raw data in other files: refused, wherever they are */
        s = shard_fail(SHARD_E_CORRUPT, "%s: dataset %s keeps its data in external files", path, p->dataset);
    const H5D_layout_t layout = s ? H5D_LAYOUT_ERROR : H5Pget_layout(dcpl);
    if (layout == H5D_CONTIGUOUS) { /* not smp's, but what h5py writes: read in the writer's chunks */
        const size_t es = shard_dtype_size(t->t.dtype);
        shard_chunking_init(&ix->g, nd, p->box.len, es, shard_chunking_rows_for(nd, p->box.len, es));
        ix->contiguous = 1;
    } else if (!s && (layout != H5D_CHUNKED || H5Pget_chunk(dcpl, nd, chunk) != nd)) {
        s = shard_fail(SHARD_E_UNSUPPORTED, "%s: dataset %s is neither chunked as smp writes it nor contiguous", path, p->dataset);
    }
    if (!s && !ix->contiguous) {
        const size_t es = shard_dtype_size(t->t.dtype);
        const int rdim = nd == 1 ? 0 : nd - 2;
        /* the rows per chunk are the file's, so checked before any arithmetic on them */
        int rows_ok = chunk[rdim] >= 1 && chunk[rdim] <= (hsize_t)p->box.len[rdim];
        shard_chunking_init(&ix->g, nd, p->box.len, es, rows_ok ? (int64_t)chunk[rdim] : 1);
        hsize_t want[SHARD_MAX_DIMS];
        shard_chunking_dims(&ix->g, want);
        for (int k = 0; rows_ok && k < nd; k++) rows_ok = chunk[k] == want[k];
        if (!rows_ok || ix->g.full > SHARD_CHUNK_BYTES_MAX)
            s = shard_fail(SHARD_E_UNSUPPORTED, "%s: dataset %s: chunks are not whole rows of at most 256 MiB (not written by smp)", path, p->dataset);
    }
    int nf = s ? 0 : H5Pget_nfilters(dcpl);
    if (!s && nf == 2) {
        unsigned flags, cd[8];
        size_t ncd = 8;
        H5Z_filter_t f0 = H5Pget_filter2(dcpl, 0, &flags, &ncd, cd, 0, NULL, NULL);
        ncd = 8;
        H5Z_filter_t f1 = H5Pget_filter2(dcpl, 1, &flags, &ncd, cd, 0, NULL, NULL);
        ix->zstd = f0 == H5Z_FILTER_SHUFFLE && f1 == SHARD_ZSTD_FILTER_ID;
    }
    if (!s && nf != 0 && !ix->zstd)
        s = shard_fail(SHARD_E_UNSUPPORTED, "%s: dataset %s: filters other than smp's (none, or shuffle + zstd)", path, p->dataset);
    if (dcpl >= 0) H5Pclose(dcpl);
    if (ft >= 0) H5Tclose(ft);
    if (space >= 0) H5Sclose(space);
    return s;
}

/* Where every chunk lies: inside the file, whole, never skipping a filter. */
/* A contiguous dataset: the chunks are where the C order puts them. */
static shard_status locate_contiguous(hid_t ds, const piece *p, uint64_t file_bytes, const char *path, piece_index *ix)
{
    const shard_chunking *g = &ix->g;
    const haddr_t base = H5Dget_offset(ds);
    const uint64_t bytes = shard_box_numel(&p->box) * g->es;
    if (base == HADDR_UNDEF || base > file_bytes || bytes > file_bytes - base)
        return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s was never written whole", path, p->dataset);
    if (!(ix->loc = malloc(g->nchunks * sizeof *ix->loc))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (uint64_t k = 0; k < g->nchunks; k++) {
        uint64_t plane;
        int64_t r0, nr;
        hsize_t hoff[SHARD_MAX_DIMS];
        shard_chunking_at(g, k, &plane, &r0, &nr, hoff);
        ix->loc[k] = (chunk_loc){base + (plane * (uint64_t)g->rows + (uint64_t)r0) * (uint64_t)g->cols * g->es, ckpt_chunk_valid(g, k)};
    }
    return SHARD_OK;
}

static shard_status locate_chunks(hid_t ds, const piece *p, uint64_t file_bytes, const char *path, piece_index *ix)
{
    if (ix->contiguous) return locate_contiguous(ds, p, file_bytes, path, ix);
    const shard_chunking *g = &ix->g;
    hsize_t n = 0;
    hid_t space = H5Dget_space(ds);
    herr_t e = space < 0 ? -1 : H5Dget_num_chunks(ds, space, &n);
    if (space >= 0) H5Sclose(space);
    if (e < 0 || n != g->nchunks)
        return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s holds %llu of its %llu chunks (never written whole)", path, p->dataset,
                          (unsigned long long)n, (unsigned long long)g->nchunks);
    if (!(ix->loc = malloc(g->nchunks * sizeof *ix->loc))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    const uint64_t most = ix->zstd ? ZSTD_compressBound(g->full) : g->full;
    for (uint64_t k = 0; k < g->nchunks; k++) {
        uint64_t plane;
        int64_t r0, nr;
        hsize_t hoff[SHARD_MAX_DIMS], size = 0;
        haddr_t addr = HADDR_UNDEF;
        unsigned mask = 0;
        shard_chunking_at(g, k, &plane, &r0, &nr, hoff);
        if (H5Dget_chunk_info_by_coord(ds, hoff, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF)
            return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: chunk %llu was never written", path, p->dataset, (unsigned long long)k);
        if (mask || size == 0 || size > most || (!ix->zstd && size != g->full) || addr > file_bytes || size > file_bytes - addr)
            return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: chunk %llu has an impossible place or size", path, p->dataset, (unsigned long long)k);
        ix->loc[k] = (chunk_loc){addr, size};
    }
    return SHARD_OK;
}

/* H5Literate's callback: stops the walk at the first link that is not a hard link */
static herr_t not_hard(hid_t g, const char *name, const H5L_info_t *li, void *arg)
{
    (void)g; (void)name; (void)arg;
    return li->type != H5L_TYPE_HARD;
}

/* 1 when every link of group (of file) is a hard link: one pass over the group's links
 * (a model of 18867 tensors has that many in `params`), instead of a lookup of each
 * dataset's own link before it is opened (a tenth of smp-merge's time on that model). */
static int all_hard(hid_t file, const char *group)
{
    hid_t g = H5Gopen2(file, group[0] ? group : "/", H5P_DEFAULT);
    if (g < 0) return 0;
    hsize_t at = 0;
    const herr_t r = H5Literate(g, H5_INDEX_NAME, H5_ITER_NATIVE, &at, not_hard, NULL);
    H5Gclose(g);
    return r == 0;
}

enum { DPATH_MAX = 1024 }; /* bytes of a dataset's path, its NUL included */

/* The links named by dpath's prefixes that end in [from, upto] (at a '/' or at upto)
 * are hard links: [1, parent] the groups above a dataset, [parent + 1, n] its own. */
static shard_status check_links(hid_t file, const char *dpath, size_t from, size_t upto, const char *path)
{
    char prefix[DPATH_MAX];
    for (size_t i = from; i <= upto; i++) {
        if (dpath[i] != '/' && i != upto) continue;
        memcpy(prefix, dpath, i);
        prefix[i] = 0;
        H5L_info_t li;
        if (H5Lget_info(file, prefix, &li, H5P_DEFAULT) < 0) /* missing (its errors are silenced) */
            return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s is missing", path, dpath);
        if (li.type != H5L_TYPE_HARD)
            return shard_fail(SHARD_E_CORRUPT, "%s: %s is a %s link, not an object of this file", path, prefix,
                              li.type == H5L_TYPE_SOFT ? "soft" : "external");
    }
    return SHARD_OK;
}

/* The dataset at dpath of file fi, reached through hard links only: an external or soft
 * link (to another file, anywhere on the machine) is refused before HDF5 follows it.
 * The groups above it are checked once per group and file (c->links[fi]: the last one
 * checked; c->mu held), and its own link not at all where its group holds hard links
 * only. */
static shard_status open_own_dataset(shard_ckpt *c, size_t fi, const char *dpath, const char *path, hid_t *out)
{
    const hid_t file = c->h5[fi];
    ckpt_links *lk = &c->links[fi];
    const size_t n = strlen(dpath);
    if (n == 0 || n >= DPATH_MAX || dpath[0] != '/')
        return shard_fail(SHARD_E_INVALID, "%s: dataset name \"%.64s\" is not an absolute HDF5 path", path, dpath);
    const size_t parent = (size_t)(strrchr(dpath, '/') - dpath);
    int known = lk->checked && strlen(lk->group) == parent && !memcmp(lk->group, dpath, parent);
    shard_status s = SHARD_OK;
    if (!known) {
        if ((s = check_links(file, dpath, 1, parent, path))) return s; /* the groups above it */
        if (parent < sizeof lk->group) {
            memcpy(lk->group, dpath, parent);
            lk->group[parent] = 0;
            lk->all_hard = all_hard(file, lk->group);
            lk->checked = known = 1;
        }
    }
    if (!(known && lk->all_hard)) s = check_links(file, dpath, parent + 1, n, path); /* its own */
    if (s) return s;
    *out = H5Dopen2(file, dpath, H5P_DEFAULT);
    if (*out >= 0) return SHARD_OK;
    s = check_links(file, dpath, parent + 1, n, path); /* missing, rather than not a dataset */
    return s ? s : shard_fail(SHARD_E_CORRUPT, "%s: %s does not open as a dataset (another kind of object, or "
                              "its HDF5 header is damaged)", path, dpath);
}

static shard_status load_index(shard_ckpt *c, const tensor *t, piece *p)
{
    char path[4200];
    shard_status s = open_file(c, p->file_index);
    if (s) return s;
    ckpt_file_path(c, p->file_index, path, sizeof path);
    hid_t ds = -1;
    if ((s = open_own_dataset(c, p->file_index, p->dataset, path, &ds))) return s;
    piece_index *ix = calloc(1, sizeof *ix);
    if (!ix) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s) s = check_layout(ds, t, p, path, ix);
    if (!s) s = locate_chunks(ds, p, c->file_bytes[p->file_index], path, ix);
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)p->xxh64);
    if (!s && !attr_str_is(ds, "xxh64", hex)) /* the dataset is the one the manifest describes */
        s = shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: its xxh64 attribute is not the manifest's (file replaced?)", path, p->dataset);
    if (!s && attr_u64s(ds, "chunk_xxh3", ix->g.nchunks, &ix->xxh3))
        s = shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: attribute chunk_xxh3 is not one checksum per chunk", path, p->dataset);
    H5Dclose(ds);
    if (s) {
        if (ix) { free(ix->loc); free(ix->xxh3); free(ix); }
        return s;
    }
    ix->fd = c->fd[p->file_index];
    __atomic_store_n(&p->ix, ix, __ATOMIC_RELEASE); /* ckpt_prepare reads it without the lock */
    return SHARD_OK;
}

/* ---------------------------------------------------------------- chunks */
/* a read of p's file that failed (r < 0: errno) or met its end (r == 0) */
static shard_status read_fault(shard_ckpt *c, const piece *p, ssize_t r)
{
    char path[4200];
    ckpt_file_path(c, p->file_index, path, sizeof path);
    return r < 0 ? shard_fail(SHARD_E_IO, "%s: read failed: %s", path, strerror(errno))
                 : shard_fail(SHARD_E_CORRUPT, "%s: shorter than its chunk index says (truncated)", path);
}

/* chunk k of p's stored bytes do not match its own XXH3 */
static shard_status chunk_mismatch(shard_ckpt *c, const piece *p, uint64_t k)
{
    char path[4200];
    ckpt_file_path(c, p->file_index, path, sizeof path);
    return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: chunk %llu: checksum mismatch (damaged data)", path, p->dataset,
                      (unsigned long long)k);
}

static shard_status read_stored(shard_ckpt *c, const piece *p, uint64_t k, uint8_t *buf)
{
    const chunk_loc *l = &p->ix->loc[k];
    for (uint64_t done = 0; done < l->size;) {
        ssize_t r = pread(p->ix->fd, buf + done, l->size - done, (off_t)(l->addr + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return read_fault(c, p, r);
        done += (uint64_t)r;
    }
    __atomic_add_fetch(&c->bytes_read, l->size, __ATOMIC_RELAXED);
    return SHARD_OK;
}

/* An uncompressed chunk k straight into rows of dst `stride` bytes apart (a column
 * slice of the wanted box: each of the chunk's rows is a run there), by preadv, then
 * checked there: the chunk's bytes are its rows one after the other, so their XXH3 is
 * the chunk's. No copy through a chunk buffer. */
enum { ROWS_IOV = 128 };
static shard_status read_rows_into(shard_ckpt *c, const piece *p, uint64_t k, uint8_t *dst, size_t stride)
{
    const piece_index *ix = p->ix;
    const chunk_loc *l = &ix->loc[k];
    const size_t row = (size_t)ix->g.cols * ix->g.es;
    struct iovec iov[ROWS_IOV];
    for (uint64_t done = 0; done < l->size;) {
        int n = 0;
        for (uint64_t at = done; at < l->size && n < ROWS_IOV; n++) { /* from where the last read stopped */
            const size_t i = (size_t)(at / row), in = (size_t)(at % row);
            iov[n] = (struct iovec){dst + i * stride + in, row - in};
            at += row - in;
        }
        ssize_t r = preadv(ix->fd, iov, n, (off_t)(l->addr + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return read_fault(c, p, r);
        done += (uint64_t)r;
    }
    __atomic_add_fetch(&c->bytes_read, l->size, __ATOMIC_RELAXED);
    return ix->xxh3 && shard_xxh3_rows(dst, row, stride, l->size / row) != ix->xxh3[k] ? chunk_mismatch(c, p, k) : SHARD_OK;
}

size_t ckpt_chunk_valid(const shard_chunking *g, uint64_t k)
{
    uint64_t plane;
    int64_t r0, nr;
    hsize_t hoff[SHARD_MAX_DIMS];
    shard_chunking_at(g, k, &plane, &r0, &nr, hoff);
    return (size_t)(nr * g->cols) * g->es;
}

/* A decompressed chunk's elements, unshuffled a block at a time for shard_xxh3_stream:
 * to dst, or (dst NULL) to blk alone, and with h into a piece's XXH64 too. The hashes
 * read each block while it is in L1, instead of the whole chunk back from L2 or L3. */
#define UNSHUFFLE_BLOCK 16384
typedef struct {
    const uint8_t *planes;
    size_t n, es, at, end;
    uint8_t *dst, *blk;
    shard_xxh64_state *h;
} unshuffled;

static const void *next_unshuffled(void *ctx, size_t *len)
{
    unshuffled *u = ctx;
    if (u->at >= u->end) return NULL;
    size_t m = UNSHUFFLE_BLOCK / u->es < u->end - u->at ? UNSHUFFLE_BLOCK / u->es : u->end - u->at;
    uint8_t *out = u->dst ? u->dst + u->at * u->es : u->blk;
    shard_unshuffle_part(out, u->planes, u->n, u->es, u->at, u->at + m);
    u->at += m;
    *len = m * u->es;
    if (u->h) shard_xxh64_update(u->h, out, *len);
    return out;
}

/* The XXH3 of the first `valid` bytes of the chunk that planes hold unshuffled (all of
 * it written to dst when dst is not NULL). */
static uint64_t unshuffle_xxh3(uint8_t *dst, const uint8_t *planes, size_t full, size_t es, size_t valid, shard_xxh64_state *h)
{
    uint8_t blk[UNSHUFFLE_BLOCK];
    unshuffled u = {planes, full / es, es, 0, valid / es, dst, blk, h};
    const uint64_t x = shard_xxh3_stream(next_unshuffled, &u);
    if (dst && u.end < u.n) shard_unshuffle_part(dst + u.end * es, planes, u.n, es, u.end, u.n); /* the padding */
    return x;
}

static shard_status undecodable(shard_ckpt *c, const piece *p, uint64_t k)
{
    char path[4200];
    ckpt_file_path(c, p->file_index, path, sizeof path);
    return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: chunk %llu cannot be decompressed (damaged data)", path, p->dataset,
                      (unsigned long long)k);
}

/* Zstd chunk k's stored bytes into s->stored, decompressed into raw, or (raw NULL)
 * into s->tmp. */
static shard_status inflate(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, uint8_t *raw)
{
    const piece_index *ix = p->ix;
    const size_t full = ix->g.full;
    shard_status st = scratch_fit(s, ix->loc[k].size, full, 1);
    if (!st) st = read_stored(c, p, k, s->stored);
    if (st) return st;
    size_t r = ZSTD_getFrameContentSize(s->stored, ix->loc[k].size) == full
                   ? ZSTD_decompressDCtx(s->dctx, raw ? raw : s->tmp, full, s->stored, ix->loc[k].size)
                   : 0;
    return ZSTD_isError(r) || r != full ? undecodable(c, p, k) : SHARD_OK;
}

static shard_status xxh3_check(shard_ckpt *c, const piece *p, uint64_t k, uint64_t x)
{
    return x != p->ix->xxh3[k] ? chunk_mismatch(c, p, k) : SHARD_OK;
}

/* Read chunk k into raw (g.full bytes): uncompressed chunks straight there, others
 * through s's buffers; then its xxh3. *stored: where its stored bytes are. */
static shard_status decode_into(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, uint8_t *raw, const uint8_t **stored)
{
    const piece_index *ix = p->ix;
    const size_t full = ix->g.full, es = ix->g.es, valid = ckpt_chunk_valid(&ix->g, k);
    shard_status st = ix->zstd ? inflate(c, p, k, s, es > 1 ? NULL : raw) : read_stored(c, p, k, raw);
    if (st) return st;
    *stored = ix->zstd ? s->stored : raw;
    if (ix->zstd && es > 1) {
        if (ix->xxh3) return xxh3_check(c, p, k, unshuffle_xxh3(raw, s->tmp, full, es, valid, NULL)); /* a block at a time */
        shard_unshuffle(raw, s->tmp, full / es, es);
    }
    return ix->xxh3 ? xxh3_check(c, p, k, shard_xxh3(raw, valid)) : SHARD_OK;
}

shard_status ckpt_chunk_check(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, const uint8_t **stored_out,
                              shard_xxh64_state *h)
{
    const piece_index *ix = p->ix;
    const size_t valid = ckpt_chunk_valid(&ix->g, k);
    if (!ix->zstd || ix->g.es == 1 || !ix->xxh3) { /* nothing to unshuffle, or no chunk checksum to stream */
        const uint8_t *raw;
        shard_status st = ckpt_chunk_decode(c, p, k, s, stored_out, &raw);
        if (!st && h) shard_xxh64_update(h, raw, valid);
        return st;
    }
    shard_status st = inflate(c, p, k, s, NULL);
    if (st) return st;
    *stored_out = s->stored;
    return xxh3_check(c, p, k, unshuffle_xxh3(NULL, s->tmp, ix->g.full, ix->g.es, valid, h));
}

shard_status ckpt_chunk_decode(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, const uint8_t **stored_out,
                               const uint8_t **out)
{
    const uint8_t *stored;
    shard_status st = grow(&s->raw, &s->cap_raw, p->ix->g.full) ? shard_fail(SHARD_E_NOMEM, "out of memory") : SHARD_OK;
    if (!st) st = decode_into(c, p, k, s, s->raw, &stored);
    if (st) return st;
    if (stored_out) *stored_out = stored;
    *out = s->raw;
    return SHARD_OK;
}

/* ----------------------------------------------------- the decoded chunks */
/* The last CACHE_SLOTS chunks decoded, shared by the threads that read: a chunk that
 * two wanted boxes share (boxes and chunks seldom align) is read and checked once.
 * Memory: CACHE_SLOTS chunks. */
typedef struct cache_slot {
    const piece *p;
    uint64_t k, tick;
    uint8_t *raw;
    size_t cap;
    int refs, ready; /* ready 0 with refs > 0: being decoded */
} cache_slot;

#define CACHE_SLOTS 24

shard_status ckpt_cache_init(shard_ckpt *c)
{
    c->cache = calloc(CACHE_SLOTS, sizeof *c->cache);
    c->ncache = CACHE_SLOTS;
    pthread_cond_init(&c->ccv, NULL);
    return c->cache ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
}

void ckpt_cache_free(shard_ckpt *c)
{
    for (size_t i = 0; i < c->ncache && c->cache; i++) free(c->cache[i].raw);
    free(c->cache);
    pthread_cond_destroy(&c->ccv);
}

/* Chunk k of p, decoded and checked: from the cache, or decoded into a free slot (or,
 * when every slot is in use, into s's own buffer: *slot NULL). Release with cache_put.
 * busy non-NULL: when another thread is decoding the chunk, *busy = 1 and *raw NULL
 * at once, rather than waiting for it. */
static shard_status cache_get(shard_ckpt *c, const piece *p, uint64_t k, scratch *s, cache_slot **slot, const uint8_t **raw,
                              int *busy)
{
    *slot = NULL;
    *raw = NULL;
    pthread_mutex_lock(&c->smu);
    for (;;) {
        cache_slot *hit = NULL, *victim = NULL;
        for (size_t i = 0; i < c->ncache; i++) {
            cache_slot *e = &c->cache[i];
            if (e->p == p && e->k == k && (e->ready || e->refs)) { hit = e; break; }
            if (!e->refs && (!victim || e->tick < victim->tick)) victim = e;
        }
        if (hit && hit->ready) {
            hit->refs++;
            hit->tick = ++c->ctick;
            pthread_mutex_unlock(&c->smu);
            *slot = hit;
            *raw = hit->raw;
            return SHARD_OK;
        }
        if (hit && busy) { *busy = 1; pthread_mutex_unlock(&c->smu); return SHARD_OK; }
        if (hit) { pthread_cond_wait(&c->ccv, &c->smu); continue; } /* another thread decodes it */
        if (!victim) break;
        victim->p = p;
        victim->k = k;
        victim->ready = 0;
        victim->refs = 1;
        pthread_mutex_unlock(&c->smu);
        const uint8_t *stored;
        shard_status st = grow(&victim->raw, &victim->cap, p->ix->g.full) ? shard_fail(SHARD_E_NOMEM, "out of memory") : SHARD_OK;
        if (!st) st = decode_into(c, p, k, s, victim->raw, &stored);
        pthread_mutex_lock(&c->smu);
        victim->ready = !st;
        victim->tick = ++c->ctick;
        if (st) { victim->p = NULL; victim->refs = 0; }
        pthread_cond_broadcast(&c->ccv);
        pthread_mutex_unlock(&c->smu);
        if (st) return st;
        *slot = victim;
        *raw = victim->raw;
        return SHARD_OK;
    }
    pthread_mutex_unlock(&c->smu);
    return ckpt_chunk_decode(c, p, k, s, NULL, raw);
}

static void cache_put(shard_ckpt *c, cache_slot *slot)
{
    if (!slot) return;
    pthread_mutex_lock(&c->smu);
    slot->refs--;
    pthread_mutex_unlock(&c->smu);
}

shard_status ckpt_verify_piece(shard_ckpt *c, piece *p)
{
    scratch *s = ckpt_scratch_get(c);
    shard_xxh64_state h;
    shard_status st = s ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_xxh64_reset(&h);
    for (uint64_t k = 0; k < p->ix->g.nchunks && !st; k++) {
        const uint8_t *raw;
        if (!(st = ckpt_chunk_decode(c, p, k, s, NULL, &raw))) shard_xxh64_update(&h, raw, ckpt_chunk_valid(&p->ix->g, k));
    }
    if (!st && shard_xxh64_digest(&h) != p->xxh64) {
        char path[4200];
        ckpt_file_path(c, p->file_index, path, sizeof path);
        st = shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: checksum mismatch (damaged data)", path, p->dataset);
    }
    ckpt_scratch_put(c, s);
    if (!st) __atomic_store_n(&p->verified, 1, __ATOMIC_RELEASE);
    return st;
}

static int prepared(const piece *p, int skip_legacy)
{
    return __atomic_load_n(&p->ix, __ATOMIC_ACQUIRE) && (p->ix->xxh3 || skip_legacy || __atomic_load_n(&p->verified, __ATOMIC_ACQUIRE));
}

shard_status ckpt_prepare_locked(shard_ckpt *c, tensor *t, piece *p, int skip_legacy)
{
    if (prepared(p, skip_legacy)) return SHARD_OK;
    shard_h5_quiet(); /* any thread may be the first to touch a piece */
    shard_h5_lock();
    shard_status s = p->ix ? SHARD_OK : load_index(c, t, p);
    shard_h5_unlock();
    if (!s && !p->ix->xxh3 && !skip_legacy && !p->verified) s = ckpt_verify_piece(c, p);
    return s;
}

shard_status ckpt_prepare(shard_ckpt *c, tensor *t, piece *p, int skip_legacy)
{
    if (prepared(p, skip_legacy)) return SHARD_OK;
    pthread_mutex_lock(&c->mu);
    shard_status s = ckpt_prepare_locked(c, t, p, skip_legacy);
    pthread_mutex_unlock(&c->mu);
    return s;
}

/* ---------------------------------------------------------- reading boxes */
/* One chunk to scatter: chunk k of piece p, for the intersection x (global coords). */
typedef struct {
    const piece *p;
    uint64_t k;
    shard_box x;
} task;

typedef struct {
    shard_ckpt *c;
    const tensor *t;
    const shard_box *want;
    void *dst;
    shard_dtype dt;
    task *tasks;
    size_t ntasks, next; /* next: atomic */
} read_job;

/* Where the rows of chunk k that x wants go: rows [lo, hi) of the piece, columns
 * [c0, c0 + nc), from src (offset in the decoded chunk) to dst, dstep elements apart
 * in dst. */
typedef struct {
    int64_t lo, hi, nc, dstep;
    size_t src;
    char *dst;
} span;

static span span_of(const read_job *j, const task *tk, int64_t *r0, int64_t *nr)
{
    const shard_chunking *g = &tk->p->ix->g;
    const shard_box *pb = &tk->p->box, *x = &tk->x, *w = j->want;
    const int nd = g->ndim, rdim = nd == 1 ? 0 : nd - 2;
    uint64_t plane;
    hsize_t hoff[SHARD_MAX_DIMS];
    shard_chunking_at(g, tk->k, &plane, r0, nr, hoff);
    span sp = {x->off[rdim] - pb->off[rdim], 0, nd == 1 ? 1 : x->len[nd - 1], nd == 1 ? 1 : w->len[nd - 1], 0, NULL};
    sp.hi = sp.lo + x->len[rdim];
    if (sp.lo < *r0) sp.lo = *r0;
    if (sp.hi > *r0 + *nr) sp.hi = *r0 + *nr;
    const int64_t c0 = nd == 1 ? 0 : x->off[nd - 1] - pb->off[nd - 1];
    /* the element of dst at (plane, row lo, column c0) */
    int64_t doff = 0, gidx[SHARD_MAX_DIMS];
    for (int d = 0; d < rdim; d++) gidx[d] = pb->off[d] + (int64_t)hoff[d];
    gidx[rdim] = pb->off[rdim] + sp.lo;
    if (nd > 1) gidx[nd - 1] = pb->off[nd - 1] + c0;
    for (int d = 0; d < nd; d++) doff = doff * w->len[d] + (gidx[d] - w->off[d]);
    sp.src = (size_t)((sp.lo - *r0) * g->cols + c0) * g->es;
    sp.dst = (char *)j->dst + (size_t)doff * shard_dtype_size(j->dt);
    return sp;
}

/* The span's rows of decoded chunk raw, converted into their places in dst. */
static shard_status scatter(const read_job *j, const task *tk, const span *sp, const uint8_t *raw)
{
    const shard_chunking *g = &tk->p->ix->g;
    const size_t des = shard_dtype_size(j->dt);
    const uint8_t *src = raw + sp->src;
    char *dst = sp->dst;
    shard_status (*convert)(void *, shard_dtype, const void *, shard_dtype, size_t) =
        j->c->uncached ? shard_convert_uncached : shard_convert;
    if (sp->nc == g->cols && sp->dstep == g->cols) /* whole rows, adjacent in dst too: one run */
        return convert(dst, j->dt, src, j->t->t.dtype, (size_t)((sp->hi - sp->lo) * sp->nc));
    for (int64_t r = sp->lo; r < sp->hi; r++, src += (size_t)g->cols * g->es, dst += (size_t)sp->dstep * des) {
        shard_status s = convert(dst, j->dt, src, j->t->t.dtype, (size_t)sp->nc);
        if (s) return s;
    }
    return SHARD_OK;
}

/* A task that wants the whole of an uncompressed chunk, in the stored dtype: read
 * straight into its place in dst and checked there, without a copy through the chunk
 * cache (merge, reshard and loads: most chunks), as one run where its rows lie
 * adjacent in dst (*stride 0), else row by row, *stride bytes apart (a column-split
 * piece's chunk in a box of whole rows). NULL when the task is not such. */
static uint8_t *direct_place(const read_job *j, const task *tk, const span *sp, int64_t r0, int64_t nr, size_t *stride)
{
    const piece_index *ix = tk->p->ix;
    const shard_chunking *g = &ix->g;
    if (ix->zstd || j->dt != j->t->t.dtype) return NULL;
    const int whole = sp->lo == r0 && sp->hi == r0 + nr && sp->nc == g->cols;
    if (!whole || ix->loc[tk->k].size != ckpt_chunk_valid(g, tk->k)) return NULL;
    *stride = sp->dstep == g->cols ? 0 : (size_t)sp->dstep * g->es;
    return (uint8_t *)sp->dst;
}

/* One task. busy non-NULL: a chunk of the shared cache that another thread is
 * decoding is left for later (*busy = 1) instead of waited for. */
static shard_status run_task(read_job *j, const task *tk, scratch *s, int *busy)
{
    int64_t r0, nr;
    const span sp = span_of(j, tk, &r0, &nr);
    const uint8_t *raw, *stored;
    size_t stride = 0;
    uint8_t *place = direct_place(j, tk, &sp, r0, nr, &stride);
    if (place && stride) return read_rows_into(j->c, tk->p, tk->k, place, stride);
    if (place) return decode_into(j->c, tk->p, tk->k, s, place, &stored);
    shard_status st;
    if (sp.lo == r0 && sp.hi == r0 + nr && sp.nc == tk->p->ix->g.cols) {
        /* wanted whole by this box (no box beside it wants any of it), but to be
         * decoded or converted: through this worker's own buffer, still in the cache
         * from its last chunk, not through a slot of the cache last used long ago */
        st = ckpt_chunk_decode(j->c, tk->p, tk->k, s, NULL, &raw);
        return st ? st : scatter(j, tk, &sp, raw);
    }
    cache_slot *slot;
    st = cache_get(j->c, tk->p, tk->k, s, &slot, &raw, busy);
    if (!st && raw) st = scatter(j, tk, &sp, raw);
    cache_put(j->c, slot);
    return st;
}

/* The job's tasks, taken in turn by every thread. Two readers that want one chunk at
 * once (the boxes of a reshard's files side by side, cut from the same stored chunks)
 * would take turns waiting for each other's decoding: a chunk being decoded elsewhere
 * is put off (up to DEFER of them) and the next task done first. */
enum { DEFER = 8 };
static shard_status read_worker(void *arg, int worker)
{
    (void)worker;
    read_job *j = arg;
    scratch *s = ckpt_scratch_get(j->c);
    shard_status st = s ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    size_t later[DEFER], nlater = 0;
    for (;;) {
        size_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (st || i >= j->ntasks) break;
        int busy = 0;
        st = run_task(j, &j->tasks[i], s, nlater < DEFER ? &busy : NULL);
        if (busy) later[nlater++] = i;
        if (st) __atomic_store_n(&j->next, j->ntasks, __ATOMIC_RELAXED); /* the others stop too */
    }
    for (size_t q = 0; q < nlater && !st; q++) st = run_task(j, &j->tasks[later[q]], s, NULL);
    ckpt_scratch_put(j->c, s);
    return st;
}

/* The chunks of p that x touches, appended to the job's tasks. */
static shard_status add_tasks(read_job *j, const piece *p, const shard_box *x, size_t *cap)
{
    const shard_chunking *g = &p->ix->g;
    const int nd = g->ndim, rdim = nd == 1 ? 0 : nd - 2;
    int64_t rel[SHARD_MAX_DIMS];
    for (int d = 0; d < nd; d++) rel[d] = x->off[d] - p->box.off[d];
    const uint64_t b0 = (uint64_t)(rel[rdim] / g->chunk_rows), b1 = (uint64_t)((rel[rdim] + x->len[rdim] - 1) / g->chunk_rows);
    uint64_t nplanes = 1;
    for (int d = 0; d < rdim; d++) nplanes *= (uint64_t)x->len[d];
    for (uint64_t q = 0; q < nplanes; q++) {
        uint64_t rem = q, plane = 0;
        int64_t idx[SHARD_MAX_DIMS];
        for (int d = rdim - 1; d >= 0; d--) { idx[d] = rel[d] + (int64_t)(rem % (uint64_t)x->len[d]); rem /= (uint64_t)x->len[d]; }
        for (int d = 0; d < rdim; d++) plane = plane * (uint64_t)g->len[d] + (uint64_t)idx[d];
        for (uint64_t b = b0; b <= b1; b++) {
            if (j->ntasks == *cap) {
                size_t nc = *cap ? 2 * *cap : 16;
                task *n = realloc(j->tasks, nc * sizeof *n);
                if (!n) return shard_fail(SHARD_E_NOMEM, "out of memory");
                j->tasks = n;
                *cap = nc;
            }
            task *tk = &j->tasks[j->ntasks++];
            tk->p = p;
            tk->k = plane * g->per_plane + b;
            tk->x = *x;
            for (int d = 0; d < rdim; d++) { tk->x.off[d] = p->box.off[d] + idx[d]; tk->x.len[d] = 1; }
        }
    }
    return SHARD_OK;
}

shard_status shard_ckpt_read(shard_ckpt *c, size_t i, const shard_box *want, void *dst, shard_dtype dst_dt)
{
    if (i >= c->n) return shard_fail(SHARD_E_USAGE, "%s: no tensor %zu", c->dir, i);
    tensor *t = &c->t[i];
    if (want->ndim != t->t.ndim) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": box rank %d, tensor rank %d", c->dir, t->t.name, want->ndim, t->t.ndim);
    for (int k = 0; k < t->t.ndim; k++)
        if (want->off[k] < 0 || want->len[k] < 0 || want->len[k] > t->t.shape[k] || want->off[k] > t->t.shape[k] - want->len[k])
            return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": wanted box outside the tensor", c->dir, t->t.name);
    if (!shard_dtype_is_float(dst_dt) && dst_dt != t->t.dtype)
        return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": cannot convert %s to %s", c->dir, t->t.name, shard_dtype_name(t->t.dtype), shard_dtype_name(dst_dt));
    read_job j = {c, t, want, dst, dst_dt, NULL, 0, 0};
    size_t cap = 0;
    shard_status s = SHARD_OK;
    shard_box x;
    for (size_t q = 0; q < t->t.npieces && !s; q++) {
        piece *p = &t->p[q];
        if (!shard_box_intersect(&p->box, want, &x)) continue;
        if (!(s = ckpt_prepare(c, t, p, 0))) s = add_tasks(&j, p, &x, &cap);
    }
    if (!s && j.ntasks) {
        /* a thread per task, and per MiB wanted: a small tensor's few chunks are read
         * sooner than threads start (an 18867-tensor load spent a sixth in them) */
        const uint64_t mib = shard_box_numel(want) * shard_dtype_size(dst_dt) >> 20;
        int th = c->threads < (int)j.ntasks ? c->threads : (int)j.ntasks;
        if ((uint64_t)th > mib + 1) th = (int)mib + 1;
        s = ckpt_parallel(th, read_worker, &j);
    }
    free(j.tasks);
    return s;
}

/* ----------------------------------------------------------------- threads */
typedef struct {
    shard_status (*fn)(void *, int);
    void *arg;
    int worker;
    shard_status s;
    char msg[1024];
} thread_arg;

static void *thread_main(void *p)
{
    thread_arg *a = p;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    a->s = a->fn(a->arg, a->worker);
    if (a->s) snprintf(a->msg, sizeof a->msg, "%s", shard_errmsg());
    H5Eclear2(H5E_DEFAULT);
    return NULL;
}

shard_status ckpt_parallel(int threads, shard_status (*fn)(void *arg, int worker), void *arg)
{
    if (threads > 64) threads = 64;
    if (threads <= 1) return fn(arg, 0);
    pthread_t th[64];
    thread_arg a[64];
    int started = 0;
    for (int w = 1; w < threads; w++) {
        a[started] = (thread_arg){fn, arg, w, SHARD_OK, ""};
        if (pthread_create(&th[started], NULL, thread_main, &a[started]) == 0) started++;
    }
    shard_status s = fn(arg, 0);
    char msg[1024] = "";
    if (s) snprintf(msg, sizeof msg, "%s", shard_errmsg());
    for (int w = 0; w < started; w++) {
        pthread_join(th[w], NULL);
        if (!s && a[w].s) { s = a[w].s; snprintf(msg, sizeof msg, "%s", a[w].msg); }
    }
    return s ? shard_fail(s, "%s", msg) : SHARD_OK;
}

void shard_ckpt_set_threads(shard_ckpt *c, int threads) { c->threads = threads < 1 ? 1 : threads > 64 ? 64 : threads; }
void shard_ckpt_set_uncached(shard_ckpt *c, int on) { c->uncached = on != 0; }
uint64_t shard_ckpt_bytes_read(const shard_ckpt *c) { return __atomic_load_n(&c->bytes_read, __ATOMIC_RELAXED); }
