/* safetensors: a validating, mmap-based reader and a streaming writer.
 *
 * The reader enforces the reference implementation's rules
 * (huggingface/safetensors, tensor.rs): header length capped at 100,000,000
 * bytes and inside the file; the header a JSON object (UTF-8, starting with '{',
 * only whitespace after it); no duplicate keys (the reference catches them only by
 * accident; we reject them explicitly); known dtypes; shapes of non-negative
 * integers whose product and byte size do not overflow; data_offsets [begin, end)
 * with end - begin = numel * dtype size, contiguous from 0 when sorted, ending
 * exactly at the end of the file; __metadata__ a string -> string map. */
#include "../core/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct shard_st_file {
    char *path;
    uint8_t *map;
    uint64_t size;
    size_t n;
    shard_st_tensor *t;     /* file order */
    size_t *by_name;        /* indices into t, sorted by name */
    int64_t *shapes;
    char **names;
    size_t nmeta;
    char **meta;            /* key, value pairs */
};

static int cmp_name(const void *a, const void *b, void *ctx)
{
    const shard_st_file *f = ctx;
    return strcmp(f->t[*(const size_t *)a].name, f->t[*(const size_t *)b].name);
}
static int cmp_offset(const void *a, const void *b)
{
    const shard_st_tensor *x = a, *y = b;
    return x->file_offset < y->file_offset ? -1 : x->file_offset > y->file_offset ? 1
         : x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

static shard_status get_u64(json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return SHARD_E_INVALID;
    *out = (uint64_t)json_integer_value(v);
    return SHARD_OK;
}

void shard_st_close(shard_st_file *f)
{
    if (!f) return;
    if (f->map) munmap(f->map, f->size);
    if (f->names) for (size_t i = 0; i < f->n; i++) free(f->names[i]);
    if (f->meta) for (size_t i = 0; i < 2 * f->nmeta; i++) free(f->meta[i]);
    free(f->names); free(f->meta); free(f->t); free(f->by_name); free(f->shapes); free(f->path);
    free(f);
}

static shard_status parse_header(shard_st_file *f, const char *hdr, uint64_t hlen, uint64_t data_len)
{
    const char *path = f->path;
    if (hlen == 0 || hdr[0] != '{')
        return shard_fail(SHARD_E_INVALID, "%s: safetensors header does not start with '{'", path);
    json_t *root;
    shard_status s = shard_json_parse(hdr, hlen, path, &root);
    if (s) return s;
    if (!json_is_object(root)) { json_decref(root); return shard_fail(SHARD_E_INVALID, "%s: safetensors header is not a JSON object", path); }
    size_t cap = json_object_size(root);
    f->t = calloc(cap ? cap : 1, sizeof *f->t);
    f->names = calloc(cap ? cap : 1, sizeof *f->names);
    size_t total_dims = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        json_t *sh = json_object_get(val, "shape");
        if (json_is_array(sh)) total_dims += json_array_size(sh);
    }
    f->shapes = calloc(total_dims ? total_dims : 1, sizeof *f->shapes);
    if (!f->t || !f->names || !f->shapes) { json_decref(root); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    size_t dim_at = 0;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) { s = shard_fail(SHARD_E_INVALID, "%s: __metadata__ is not an object of strings", path); goto out; }
            f->nmeta = json_object_size(val);
            f->meta = calloc(2 * f->nmeta + 1, sizeof *f->meta);
            if (!f->meta) { s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); goto out; }
            size_t k = 0;
            const char *mk;
            json_t *mv;
            json_object_foreach(val, mk, mv) {
                if (!json_is_string(mv)) { s = shard_fail(SHARD_E_INVALID, "%s: __metadata__[\"%s\"] is not a string", path, mk); goto out; }
                f->meta[k++] = strdup(mk);
                f->meta[k++] = strdup(json_string_value(mv));
                if (!f->meta[k - 1] || !f->meta[k - 2]) { s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); goto out; }
            }
            continue;
        }
        shard_st_tensor *t = &f->t[f->n];
        if (!json_is_object(val)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": entry is not an object", path, key); goto out; }
        json_t *jd = json_object_get(val, "dtype"), *js = json_object_get(val, "shape"), *jo = json_object_get(val, "data_offsets");
        if (!json_is_string(jd)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": dtype missing or not a string", path, key); goto out; }
        t->dtype = shard_dtype_from_name(json_string_value(jd));
        if (t->dtype == SHARD_DT_INVALID) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": unknown dtype \"%s\"", path, key, json_string_value(jd)); goto out; }
        if (!json_is_array(js)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": shape missing or not an array", path, key); goto out; }
        t->ndim = (int)json_array_size(js);
        t->shape = f->shapes + dim_at;
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            uint64_t v;
            if (get_u64(json_array_get(js, (size_t)d), &v)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": shape[%d] is not a non-negative integer", path, key, d); goto out; }
            f->shapes[dim_at++] = (int64_t)v;
            if (!shard_mul_u64(numel, v, &numel)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": shape overflows", path, key); goto out; }
        }
        t->numel = numel;
        if (!shard_mul_u64(numel, shard_dtype_size(t->dtype), &t->nbytes)) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": byte size overflows", path, key); goto out; }
        uint64_t b, e;
        if (!json_is_array(jo) || json_array_size(jo) != 2 || get_u64(json_array_get(jo, 0), &b) || get_u64(json_array_get(jo, 1), &e)) {
            s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": data_offsets must be [begin, end] of non-negative integers", path, key); goto out;
        }
        if (e < b || e - b != t->nbytes) {
            s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": data_offsets [%llu, %llu] do not hold %llu bytes (shape x %s)", path, key,
                           (unsigned long long)b, (unsigned long long)e, (unsigned long long)t->nbytes, shard_dtype_name(t->dtype));
            goto out;
        }
        t->file_offset = b; /* relative for now */
        f->names[f->n] = strdup(key);
        if (!f->names[f->n]) { s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); goto out; }
        t->name = f->names[f->n];
        f->n++;
    }
    /* Sorted by begin, the pieces must tile [0, data_len) exactly. */
    qsort(f->t, f->n, sizeof *f->t, cmp_offset);
    uint64_t at = 0;
    for (size_t i = 0; i < f->n; i++) {
        if (f->t[i].file_offset != at) {
            s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\": data starts at %llu, expected %llu (offsets must be contiguous from 0)",
                           path, f->t[i].name, (unsigned long long)f->t[i].file_offset, (unsigned long long)at);
            goto out;
        }
        at += f->t[i].nbytes;
    }
    if (at != data_len) {
        s = shard_fail(SHARD_E_INVALID, "%s: tensor data covers %llu bytes but the file holds %llu after the header", path,
                       (unsigned long long)at, (unsigned long long)data_len);
        goto out;
    }
    s = SHARD_OK;
out:
    json_decref(root);
    return s;
}

shard_status shard_st_open(const char *path, shard_st_file **out)
{
    *out = NULL;
    shard_st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) { free(f); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    shard_status s;
    int fd;
    if ((s = shard_open_regular(path, 0, &fd, &f->size))) goto fail; /* a FIFO or device: refused, not waited on */
    if (f->size < 8) { close(fd); s = shard_fail(SHARD_E_INVALID, "%s: %llu bytes is too small for a safetensors file", path, (unsigned long long)f->size); goto fail; }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) { f->map = NULL; s = shard_fail(SHARD_E_IO, "%s: mmap failed: %s", path, strerror(errno)); goto fail; }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | f->map[i];
    if (n > SHARD_ST_MAX_HEADER) { s = shard_fail(SHARD_E_INVALID, "%s: header of %llu bytes exceeds the %u-byte limit", path, (unsigned long long)n, SHARD_ST_MAX_HEADER); goto fail; }
    if (n > f->size - 8) { s = shard_fail(SHARD_E_INVALID, "%s: header length %llu runs past the end of the file (%llu bytes)", path, (unsigned long long)n, (unsigned long long)f->size); goto fail; }
    if ((s = parse_header(f, (const char *)f->map + 8, n, f->size - 8 - n))) goto fail;
    f->by_name = malloc((f->n ? f->n : 1) * sizeof *f->by_name);
    if (!f->by_name) { s = shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); goto fail; }
    for (size_t i = 0; i < f->n; i++) {
        f->t[i].file_offset += 8 + n;
        f->t[i].data = f->map + f->t[i].file_offset;
        f->by_name[i] = i;
    }
    qsort_r(f->by_name, f->n, sizeof *f->by_name, cmp_name, f);
    *out = f;
    return SHARD_OK;
fail:
    shard_st_close(f);
    return s;
}

const char *shard_st_path(const shard_st_file *f) { return f->path; }
size_t shard_st_count(const shard_st_file *f) { return f->n; }
uint64_t shard_st_file_size(const shard_st_file *f) { return f->size; }
const shard_st_tensor *shard_st_at(const shard_st_file *f, size_t i) { return i < f->n ? &f->t[i] : NULL; }
size_t shard_st_metadata_count(const shard_st_file *f) { return f->nmeta; }
void shard_st_metadata_at(const shard_st_file *f, size_t i, const char **key, const char **value)
{
    *key = f->meta[2 * i];
    *value = f->meta[2 * i + 1];
}

const shard_st_tensor *shard_st_find(const shard_st_file *f, const char *name)
{
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(f->t[f->by_name[mid]].name, name);
        if (c == 0) return &f->t[f->by_name[mid]];
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

/* ------------------------------------------------------------------ writer */
struct shard_st_writer {
    char *path, *tmp;
    int fd;
    json_t *hdr;
    uint64_t total, written;
    int started;
    char *buf;
    size_t blen;
    shard_write_opts opts;
    uint64_t unsynced; /* bytes written since writeback was last started */
    shard_flusher *flusher; /* durable writes past 64 MiB: flushes while the file grows, or NULL */
};
#define WBUF (4u << 20)

shard_status shard_st_writer_create(const char *path, shard_st_writer **out)
{
    return shard_st_writer_create_opts(path, NULL, out);
}

shard_status shard_st_writer_create_opts(const char *path, const shard_write_opts *o, shard_st_writer **out)
{
    *out = NULL;
    shard_st_writer *w = calloc(1, sizeof *w);
    if (!w) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    if (o) w->opts = *o;
    w->fd = -1;
    w->path = strdup(path);
    w->tmp = malloc(strlen(path) + 16);
    w->hdr = json_object();
    w->buf = malloc(WBUF);
    if (!w->path || !w->tmp || !w->hdr || !w->buf) { shard_st_writer_abort(w); return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path); }
    sprintf(w->tmp, "%s.tmp-XXXXXX", path);
    w->fd = mkstemp(w->tmp);
    if (w->fd < 0) {
        shard_status s = shard_fail(SHARD_E_IO, "%s: cannot create: %s", path, strerror(errno));
        free(w->tmp); w->tmp = NULL;
        shard_st_writer_abort(w);
        return s;
    }
    *out = w;
    return SHARD_OK;
}

shard_status shard_st_writer_metadata(shard_st_writer *w, const char *key, const char *value)
{
    if (w->started) return shard_fail(SHARD_E_USAGE, "%s: metadata after data was written", w->path);
    json_t *m = json_object_get(w->hdr, "__metadata__");
    if (!m) { m = json_object(); json_object_set_new(w->hdr, "__metadata__", m); }
    if (json_object_set_new(m, key, json_string(value))) return shard_fail(SHARD_E_USAGE, "%s: invalid metadata key or value", w->path);
    return SHARD_OK;
}

shard_status shard_st_writer_declare(shard_st_writer *w, const char *name, shard_dtype dt, int ndim, const int64_t *shape)
{
    if (w->started) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\" declared after data was written", w->path, name);
    if (!shard_dtype_size(dt)) return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": invalid dtype", w->path, name);
    if (strcmp(name, "__metadata__") == 0 || json_object_get(w->hdr, name))
        return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\" declared twice (or reserved name)", w->path, name);
    uint64_t nbytes = shard_dtype_size(dt);
    json_t *js = json_array();
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || !shard_mul_u64(nbytes, (uint64_t)shape[d], &nbytes)) { json_decref(js); return shard_fail(SHARD_E_USAGE, "%s: tensor \"%s\": bad shape", w->path, name); }
        json_array_append_new(js, json_integer(shape[d]));
    }
    json_t *t = json_object();
    json_object_set_new(t, "dtype", json_string(shard_dtype_name(dt)));
    json_object_set_new(t, "shape", js);
    json_object_set_new(t, "data_offsets", json_pack("[II]", (json_int_t)w->total, (json_int_t)(w->total + nbytes)));
    if (json_object_set_new(w->hdr, name, t)) return shard_fail(SHARD_E_USAGE, "%s: tensor name \"%s\" is not valid UTF-8", w->path, name);
    w->total += nbytes;
    return SHARD_OK;
}

static shard_status raw_write(shard_st_writer *w, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        if (shard_cancelled()) return shard_fail_cancelled(); /* a signal: the export stops here, removed */
        ssize_t r = write(w->fd, c, n < SHARD_WRITE_MAX ? n : SHARD_WRITE_MAX);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return shard_fail(SHARD_E_IO, "%s: write failed: %s", w->path, strerror(errno));
        c += r;
        n -= (size_t)r;
        shard_start_writeback(w->fd, &w->flusher, &w->unsynced, (size_t)r, w->opts.no_fsync);
    }
    return SHARD_OK;
}

static shard_status flush_buf(shard_st_writer *w)
{
    shard_status s = raw_write(w, w->buf, w->blen);
    w->blen = 0;
    return s;
}

static shard_status start(shard_st_writer *w)
{
    char *h = json_dumps(w->hdr, JSON_COMPACT);
    if (!h) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", w->path);
    size_t n = strlen(h), padded = (n + 7) & ~(size_t)7; /* pad with spaces: 8-byte aligned data */
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    shard_status s = SHARD_OK;
    int err = shard_reserve_blocks(w->fd, 0, 8 + padded + w->total); /* the whole file's blocks, at once */
    if (err) s = shard_fail(SHARD_E_IO, "%s: write failed: %s", w->path, strerror(err));
    if (!s) s = raw_write(w, len8, 8);
    if (!s) s = raw_write(w, h, n);
    if (!s && padded > n) s = raw_write(w, "        ", padded - n);
    free(h);
    w->started = 1;
    return s;
}

shard_status shard_st_writer_write(shard_st_writer *w, const void *data, size_t nbytes)
{
    shard_status s;
    if (!w->started && (s = start(w))) return s;
    if (w->written + nbytes > w->total)
        return shard_fail(SHARD_E_USAGE, "%s: %llu bytes written past the %llu declared", w->path,
                          (unsigned long long)(w->written + nbytes), (unsigned long long)w->total);
    w->written += nbytes;
    if (w->blen + nbytes <= WBUF) {
        memcpy(w->buf + w->blen, data, nbytes);
        w->blen += nbytes;
        return SHARD_OK;
    }
    if ((s = flush_buf(w))) return s;
    if (nbytes >= WBUF) return raw_write(w, data, nbytes);
    memcpy(w->buf, data, nbytes);
    w->blen = nbytes;
    return SHARD_OK;
}

shard_status shard_st_writer_finish(shard_st_writer *w)
{
    shard_status s = SHARD_OK;
    if (!w->started) s = start(w);
    if (!s && w->written != w->total)
        s = shard_fail(SHARD_E_USAGE, "%s: %llu of %llu declared bytes written", w->path, (unsigned long long)w->written, (unsigned long long)w->total);
    if (!s) s = flush_buf(w);
    const int flushed = shard_flusher_stop(w->flusher); /* a failure it saw is this fsync's */
    w->flusher = NULL;
    if (!s && flushed) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", w->path, strerror(flushed));
    if (!s && !w->opts.no_fsync && fsync(w->fd) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", w->path, strerror(errno));
    if (!s && fchmod(w->fd, 0644) != 0) s = shard_fail(SHARD_E_IO, "%s: chmod failed: %s", w->path, strerror(errno));
    if (!s && close(w->fd) != 0) s = shard_fail(SHARD_E_IO, "%s: close failed: %s", w->path, strerror(errno));
    if (!s) w->fd = -1;
    if (!s && rename(w->tmp, w->path) != 0) s = shard_fail(SHARD_E_IO, "%s: rename failed: %s", w->path, strerror(errno));
    if (s) { shard_st_writer_abort(w); return s; }
    if (!w->opts.no_fsync) s = shard_fsync_dir_of(w->path);
    free(w->tmp); w->tmp = NULL;
    shard_st_writer_abort(w);
    return s;
}

void shard_st_writer_abort(shard_st_writer *w)
{
    if (!w) return;
    (void)shard_flusher_stop(w->flusher);
    if (w->fd >= 0) close(w->fd);
    if (w->tmp) unlink(w->tmp);
    json_decref(w->hdr);
    free(w->tmp); free(w->path); free(w->buf); free(w);
}
