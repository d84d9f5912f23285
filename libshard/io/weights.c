/* The weights of a Hugging Face model folder: one model.safetensors, or several
 * files listed by model.safetensors.index.json. */
#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define INDEX_MAX_BYTES (64u << 20)

typedef struct {
    const shard_st_tensor *t;
    size_t file;
} entry;

struct shard_weights {
    char *dir;
    shard_st_file **files;
    char **file_names;
    size_t nfiles;
    entry *e;
    size_t n;
    int indexed;
};

void shard_weights_close(shard_weights *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->nfiles; i++) { shard_st_close(w->files[i]); free(w->file_names[i]); }
    free(w->files); free(w->file_names); free(w->e); free(w->dir); free(w);
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const entry *)a)->t->name, ((const entry *)b)->t->name);
}

static int file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static shard_status add_file(shard_weights *w, const char *name, size_t *idx)
{
    for (size_t i = 0; i < w->nfiles; i++)
        if (strcmp(w->file_names[i], name) == 0) { *idx = i; return SHARD_OK; }
    char *p = shard_path_join(w->dir, name);
    if (!p) return shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_st_file **nf = realloc(w->files, (w->nfiles + 1) * sizeof *nf);
    char **nn = realloc(w->file_names, (w->nfiles + 1) * sizeof *nn);
    if (nf) w->files = nf;
    if (nn) w->file_names = nn;
    if (!nf || !nn) { free(p); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    shard_status s = shard_st_open(p, &w->files[w->nfiles]);
    free(p);
    if (s) return s;
    w->file_names[w->nfiles] = strdup(name);
    *idx = w->nfiles++;
    return SHARD_OK;
}

static shard_status collect(shard_weights *w)
{
    size_t total = 0;
    for (size_t i = 0; i < w->nfiles; i++) total += shard_st_count(w->files[i]);
    w->e = malloc((total ? total : 1) * sizeof *w->e);
    if (!w->e) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < w->nfiles; i++)
        for (size_t k = 0; k < shard_st_count(w->files[i]); k++)
            w->e[w->n++] = (entry){shard_st_at(w->files[i], k), i};
    qsort(w->e, w->n, sizeof *w->e, cmp_entry);
    for (size_t i = 1; i < w->n; i++)
        if (strcmp(w->e[i].t->name, w->e[i - 1].t->name) == 0)
            return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is stored twice (in %s and %s)", w->dir, w->e[i].t->name,
                              w->file_names[w->e[i - 1].file], w->file_names[w->e[i].file]);
    return SHARD_OK;
}

static shard_status open_index(shard_weights *w, const char *ipath)
{
    char *text;
    size_t len;
    shard_status s = shard_read_file(ipath, INDEX_MAX_BYTES, &text, &len);
    if (s) return s;
    json_t *root;
    s = shard_json_parse(text, len, ipath, &root);
    free(text);
    if (s) return s;
    json_t *wm = json_object_get(root, "weight_map");
    const char *key;
    json_t *val;
    if (!json_is_object(root)) { s = shard_fail(SHARD_E_INVALID, "%s: not a JSON object", ipath); goto out; }
    json_t *meta = json_object_get(root, "metadata");
    if (meta && !json_is_object(meta) && !json_is_null(meta)) { s = shard_fail(SHARD_E_INVALID, "%s: \"metadata\" is not an object", ipath); goto out; }
    if (!json_is_object(wm)) { s = shard_fail(SHARD_E_INVALID, "%s: \"weight_map\" missing or not an object", ipath); goto out; }
    if (json_object_size(wm) == 0) { s = shard_fail(SHARD_E_INVALID, "%s: \"weight_map\" is empty", ipath); goto out; }
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val)) { s = shard_fail(SHARD_E_INVALID, "%s: weight_map[\"%s\"] is not a file name", ipath, key); goto out; }
        const char *fn = json_string_value(val);
        if (!shard_path_is_contained(fn) || strchr(fn, '/')) {
            s = shard_fail(SHARD_E_INVALID, "%s: weight_map[\"%s\"] = \"%s\" leaves the model folder", ipath, key, fn);
            goto out;
        }
        size_t idx;
        if ((s = add_file(w, fn, &idx))) goto out;
        if (!shard_st_find(w->files[idx], key)) {
            s = shard_fail(SHARD_E_INVALID, "%s: weight_map[\"%s\"] points to %s, which has no such tensor", ipath, key, fn);
            goto out;
        }
    }
    if ((s = collect(w))) goto out;
    for (size_t i = 0; i < w->n; i++) {
        json_t *v = json_object_get(wm, w->e[i].t->name);
        if (!v) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" of %s is not listed in the index", ipath, w->e[i].t->name, w->file_names[w->e[i].file]); goto out; }
        if (strcmp(json_string_value(v), w->file_names[w->e[i].file]) != 0) {
            s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is listed in %s but stored in %s", ipath, w->e[i].t->name, json_string_value(v), w->file_names[w->e[i].file]);
            goto out;
        }
    }
    w->indexed = 1;
out:
    json_decref(root);
    return s;
}

/* model.safetensors and an index side by side: one model only when the index names
 * model.safetensors alone (some hub repositories ship that). Otherwise one is a
 * leftover: save_pretrained into a folder saved before deletes the other layout's
 * numbered shards but neither of these, and transformers loads model.safetensors
 * first, so a folder saved whole, then sharded, loads its stale weights there. */
static shard_status open_both(shard_weights *w, const char *dir, const char *ipath)
{
    shard_status s = open_index(w, ipath);
    if (!s && w->nfiles == 1 && !strcmp(w->file_names[0], "model.safetensors")) return SHARD_OK;
    char why[600] = "the index names other files";
    if (s) snprintf(why, sizeof why, "the index fails: %s", shard_errmsg());
    return shard_fail(SHARD_E_INVALID,
                      "%s: holds both model.safetensors and model.safetensors.index.json, and %s (one is a leftover "
                      "of an earlier save; transformers would load model.safetensors): remove the one that is not "
                      "the model", dir, why);
}

shard_status shard_weights_open(const char *dir, shard_weights **out)
{
    *out = NULL;
    shard_weights *w = calloc(1, sizeof *w);
    if (!w || !(w->dir = strdup(dir))) { free(w); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    char *ipath = shard_path_join(dir, "model.safetensors.index.json");
    char *spath = shard_path_join(dir, "model.safetensors");
    shard_status s;
    if (!ipath || !spath) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    else if (file_exists(ipath) && file_exists(spath)) s = open_both(w, dir, ipath);
    else if (file_exists(ipath)) s = open_index(w, ipath);
    else if (file_exists(spath)) {
        size_t idx;
        s = add_file(w, "model.safetensors", &idx);
        if (!s) s = collect(w);
    } else
        s = shard_fail(SHARD_E_INVALID, "%s: no model.safetensors or model.safetensors.index.json in this folder", dir);
    free(ipath);
    free(spath);
    if (s) { shard_weights_close(w); return s; }
    *out = w;
    return SHARD_OK;
}

size_t shard_weights_count(const shard_weights *w) { return w->n; }
const shard_st_tensor *shard_weights_at(const shard_weights *w, size_t i) { return i < w->n ? w->e[i].t : NULL; }
const char *shard_weights_file_of(const shard_weights *w, size_t i) { return w->file_names[w->e[i].file]; }
size_t shard_weights_file_count(const shard_weights *w) { return w->nfiles; }
const shard_st_file *shard_weights_file_at(const shard_weights *w, size_t i) { return w->files[i]; }
int shard_weights_indexed(const shard_weights *w) { return w->indexed; }

size_t shard_weights_index(const shard_weights *w, const char *name)
{
    size_t lo = 0, hi = w->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(w->e[mid].t->name, name);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return w->n;
}

const shard_st_tensor *shard_weights_find(const shard_weights *w, const char *name)
{
    return shard_weights_at(w, shard_weights_index(w, name));
}

#define FP_SAMPLE 4096u

/* tensor t's first and last FP_SAMPLE bytes (t whole when smaller) into buf */
static shard_status sample(int fd, const char *path, const shard_st_tensor *t, uint8_t *buf, size_t *n)
{
    const uint64_t head = t->nbytes < FP_SAMPLE ? t->nbytes : FP_SAMPLE;
    const uint64_t tail = t->nbytes - head < FP_SAMPLE ? t->nbytes - head : FP_SAMPLE;
    shard_status s = shard_pread_full(fd, path, buf, (size_t)head, t->file_offset);
    if (!s) s = shard_pread_full(fd, path, buf + head, (size_t)tail, t->file_offset + t->nbytes - tail);
    *n = (size_t)(head + tail);
    return s;
}

shard_status shard_weights_fingerprint(const shard_weights *w, uint64_t *out)
{
    int *fds = malloc((w->nfiles ? w->nfiles : 1) * sizeof *fds);
    uint8_t *buf = malloc(2 * FP_SAMPLE);
    shard_status s = fds && buf ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; fds && i < w->nfiles; i++) fds[i] = -1;
    uint64_t h = 0;
    for (size_t i = 0; !s && i < w->n; i++) {
        const shard_st_tensor *t = w->e[i].t;
        const char *path = shard_st_path(w->files[w->e[i].file]);
        int *fd = &fds[w->e[i].file];
        const int32_t meta[2] = {(int32_t)t->dtype, t->ndim};
        uint64_t size;
        size_t n;
        h = shard_hash64(h, t->name, strlen(t->name) + 1);
        h = shard_hash64(h, meta, sizeof meta);
        h = shard_hash64(h, t->shape, (size_t)t->ndim * sizeof *t->shape);
        if (*fd < 0) s = shard_open_regular(path, 0, fd, &size);
        if (!s) s = sample(*fd, path, t, buf, &n);
        if (!s) h = shard_hash64(h, buf, n);
    }
    for (size_t i = 0; fds && i < w->nfiles; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(fds);
    free(buf);
    *out = h;
    return s;
}
