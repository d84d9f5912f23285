/* Opening a checkpoint: the manifest's validation and the lookups. Reading pieces is
 * chunkread.c's, verifying verify.c's. */
#include "ckpt.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define MANIFEST_MAX (256u << 20)

#define BAD(...) return shard_fail(SHARD_E_INVALID, __VA_ARGS__)

static int parse_hex(const char *h, uint64_t *v)
{
    if (!h || strlen(h) != 16) return -1;
    char *end;
    *v = strtoull(h, &end, 16);
    return *end ? -1 : 0;
}

static int int_array(json_t *a, int n, int64_t *out, int64_t lo)
{
    if (!json_is_array(a) || (int)json_array_size(a) != n) return -1;
    for (int k = 0; k < n; k++) {
        json_t *v = json_array_get(a, (size_t)k);
        if (!json_is_integer(v) || json_integer_value(v) < lo) return -1;
        out[k] = json_integer_value(v);
    }
    return 0;
}


static int cmp_file(const void *a, const void *b, void *ctx)
{
    const shard_ckpt *c = ctx;
    return strcmp(c->files[*(const size_t *)a], c->files[*(const size_t *)b]);
}

static size_t find_file(const shard_ckpt *c, const char *name)
{
    size_t lo = 0, hi = c->nfiles;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int k = strcmp(c->files[c->file_order[mid]], name);
        if (k == 0) return c->file_order[mid];
        if (k < 0) lo = mid + 1; else hi = mid;
    }
    return c->nfiles;
}

static int cmp_tensor(const void *a, const void *b, void *ctx)
{
    const shard_ckpt *c = ctx;
    const tensor *x = &c->t[*(const size_t *)a], *y = &c->t[*(const size_t *)b];
    int k = strcmp(x->t.group, y->t.group);
    return k ? k : strcmp(x->t.name, y->t.name);
}

static int cmp_piece_start(const void *a, const void *b, void *ctx)
{
    const piece *p = ctx;
    int64_t x = p[*(const size_t *)a].box.off[0], y = p[*(const size_t *)b].box.off[0];
    return x < y ? -1 : x > y;
}

/* Any two overlapping boxes (1, *a and *b; -1: out of memory)? A sweep along dim 0: each box is compared only with
 * the boxes whose dim-0 interval it meets (tp splits: a few; ZeRO splits: none),
 * not with all of them. */
static int find_overlap(const piece *p, size_t n, long *a, long *b)
{
    if (n < 2) return 0;
    size_t *order = malloc(n * sizeof *order), *active = malloc(n * sizeof *active), na = 0;
    if (!order || !active) { free(order); free(active); return -1; }
    int found = 0;
    for (size_t i = 0; i < n; i++) order[i] = i;
    qsort_r(order, n, sizeof *order, cmp_piece_start, (void *)p);
    shard_box x;
    for (size_t i = 0; i < n && !found; i++) {
        const piece *q = &p[order[i]];
        size_t keep = 0;
        for (size_t k = 0; k < na; k++) {
            const piece *r = &p[active[k]];
            if (r->box.off[0] + r->box.len[0] <= q->box.off[0]) continue; /* ended before q starts */
            active[keep++] = active[k];
            if (!found && shard_box_intersect(&r->box, &q->box, &x)) { *a = (long)active[k]; *b = (long)order[i]; found = 1; }
        }
        na = keep;
        active[na++] = order[i];
    }
    free(order);
    free(active);
    return found;
}

/* The params are exactly the model's tensors (names and shapes from config_json);
 * the optimizer groups hold model tensors of the same shapes, in F32. */
static int cmp_spec(const void *a, const void *b) { return strcmp(((const shard_tensor_spec *)a)->name, ((const shard_tensor_spec *)b)->name); }

static shard_status check_against_model(shard_ckpt *c, const char *mpath)
{
    const shard_model_desc *d = &c->model;
    const size_t nt = shard_model_tensor_count(d);
    shard_tensor_spec *specs = malloc(nt * sizeof *specs);
    if (!specs) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < nt; i++) shard_model_tensor(d, i, &specs[i]);
    qsort(specs, nt, sizeof *specs, cmp_spec);
    shard_status s = SHARD_OK;
    for (size_t i = 0; i < nt && !s; i++)
        if (shard_ckpt_find(c, "params", specs[i].name) < 0)
            s = shard_fail(SHARD_E_INVALID, "%s: the model's tensor \"%s\" is not in the checkpoint", mpath, specs[i].name);
    for (size_t i = 0; i < c->n && !s; i++) {
        const tensor *t = &c->t[i];
        if (!strcmp(t->t.group, "fp8")) continue; /* scaling state: shapes of its own */
        shard_tensor_spec key;
        snprintf(key.name, sizeof key.name, "%s", t->t.name);
        const shard_tensor_spec *spec = bsearch(&key, specs, nt, sizeof *specs, cmp_spec);
        if (!spec) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" (%s) is not part of the model", mpath, t->t.name, t->t.group); break; }
        int same = spec->ndim == t->t.ndim;
        for (int q = 0; same && q < spec->ndim; q++) same = spec->shape[q] == t->t.shape[q];
        if (!same) s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" (%s) has another shape than config_json implies", mpath, t->t.name, t->t.group);
        else if (!shard_dtype_is_float(t->t.dtype)) s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is not floating point", mpath, t->t.name);
        else if (strcmp(t->t.group, "params") && t->t.dtype != SHARD_DT_F32)
            s = shard_fail(SHARD_E_INVALID, "%s: optimizer tensor \"%s\" (%s) must be F32", mpath, t->t.name, t->t.group);
    }
    free(specs);
    return s;
}

static int cmp_piece_place(const void *a, const void *b)
{
    const piece *x = *(const piece *const *)a, *y = *(const piece *const *)b;
    if (x->file_index != y->file_index) return x->file_index < y->file_index ? -1 : 1;
    return strcmp(x->dataset, y->dataset);
}

/* Every piece its own dataset: two pieces (of one tensor or two) stored in one
 * dataset would read the same bytes twice and pass every checksum. */
static shard_status check_datasets_distinct(shard_ckpt *c, const char *mpath)
{
    size_t np = 0, k = 0;
    for (size_t i = 0; i < c->n; i++) np += c->t[i].t.npieces;
    const piece **all = malloc((np + 1) * sizeof *all);
    if (!all) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < c->n; i++)
        for (size_t j = 0; j < c->t[i].t.npieces; j++) all[k++] = &c->t[i].p[j];
    qsort(all, np, sizeof *all, cmp_piece_place);
    shard_status s = SHARD_OK;
    for (size_t i = 1; i < np && !s; i++)
        if (!cmp_piece_place(&all[i - 1], &all[i]))
            s = shard_fail(SHARD_E_INVALID, "%s: dataset %s of %s holds two pieces", mpath, all[i]->dataset, all[i]->file);
    free(all);
    return s;
}

static const char *GROUPS[] = {"params", "optim/master", "optim/exp_avg", "optim/exp_avg_sq", "fp8", NULL};

/* format, version, config_json, layout, stages and training */
static shard_status read_header(shard_ckpt *c, const char *mpath)
{
    json_t *m = c->m;
    if (!json_is_object(m)) BAD("%s: not a JSON object", mpath);
    json_t *f = json_object_get(m, "format"), *v = json_object_get(m, "version");
    if (!json_is_string(f) || strcmp(json_string_value(f), SHARD_FORMAT_NAME)) BAD("%s: \"format\" is not \"smp\"", mpath);
    if (!json_is_integer(v)) BAD("%s: \"version\" missing", mpath);
    if (json_integer_value(v) < SHARD_FORMAT_VERSION_OLDEST || json_integer_value(v) > SHARD_FORMAT_VERSION)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: format version %lld is not supported (this smp reads versions %d to %d)", mpath,
                          (long long)json_integer_value(v), SHARD_FORMAT_VERSION_OLDEST, SHARD_FORMAT_VERSION);
    c->file_hash_kind = json_integer_value(v) == 1 ? SHARD_FHASH_XXH64 : SHARD_FHASH_XXH3_BLOCKS;
    json_t *cj = json_object_get(m, "config_json");
    if (!json_is_string(cj)) BAD("%s: \"config_json\" missing", mpath);
    c->config = json_string_value(cj);
    char where[4200];
    snprintf(where, sizeof where, "%s (config_json)", mpath);
    shard_status s = shard_config_parse(c->config, json_string_length(cj), where, &c->model);
    if (s) return s;
    json_t *l = json_object_get(m, "layout");
    int64_t lv[4];
    const char *lk[4] = {"pp", "tp", "cp", "dp"};
    for (int k = 0; k < 4; k++) {
        json_t *x = json_object_get(l, lk[k]);
        if (!json_is_integer(x) || json_integer_value(x) < 1 || json_integer_value(x) > 65536) BAD("%s: layout.%s missing or out of range", mpath, lk[k]);
        lv[k] = json_integer_value(x);
    }
    c->layout = (shard_layout){(int)lv[0], (int)lv[1], (int)lv[2], (int)lv[3], 1};
    json_t *ep = json_object_get(l, "ep"); /* expert parallelism; absent: none */
    if (ep && (!json_is_integer(ep) || json_integer_value(ep) < 1 || json_integer_value(ep) > 65536))
        BAD("%s: layout.ep out of range", mpath);
    if (ep) c->layout.ep = (int)json_integer_value(ep);
    const int64_t E = c->model.experts, q = (int64_t)c->layout.dp * c->layout.cp;
    if (c->layout.ep > 1 && (!E || E % c->layout.ep || q % c->layout.ep))
        BAD("%s: layout.ep = %d does not split the model's %lld experts over dp x cp = %lld ranks", mpath, c->layout.ep,
            (long long)E, (long long)q);
    if (c->layout.pp > SHARD_MAX_PP || c->layout.pp > c->model.layers) BAD("%s: layout.pp out of range", mpath);
    int64_t st[SHARD_MAX_PP], sum = 0;
    if (int_array(json_object_get(m, "stages"), c->layout.pp, st, 1)) BAD("%s: \"stages\" must list %d positive layer counts", mpath, c->layout.pp);
    for (int k = 0; k < c->layout.pp; k++) {
        if (st[k] > c->model.layers) BAD("%s: stages[%d] = %lld exceeds the %lld layers", mpath, k, (long long)st[k], (long long)c->model.layers);
        c->stages[k] = (int)st[k];
        sum += st[k];
    }
    if (sum != c->model.layers) BAD("%s: \"stages\" sum to %lld, not %lld layers", mpath, (long long)sum, (long long)c->model.layers);
    json_t *tr = json_object_get(m, "training");
    if (tr && !json_is_null(tr)) {
        if (!json_is_object(tr)) BAD("%s: \"training\" is neither an object nor null", mpath);
        if (!(c->training = json_dumps(tr, JSON_COMPACT | JSON_REAL_PRECISION(17)))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    }
    return SHARD_OK;
}

/* "files": names (shard files, extra/...), sizes and checksums; sorted by name (an
 * index for the pieces' lookups), duplicates refused */
static shard_status read_files(shard_ckpt *c, const char *mpath)
{
    json_t *files = json_object_get(c->m, "files");
    if (!json_is_array(files)) BAD("%s: \"files\" missing", mpath);
    const size_t n = json_array_size(files);
    c->files = calloc(n + 1, sizeof *c->files);
    c->file_bytes = calloc(n + 1, 8);
    c->file_hash = calloc(n + 1, 8);
    c->h5 = malloc((n + 1) * sizeof *c->h5);
    c->fd = malloc((n + 1) * sizeof *c->fd);
    c->extras = calloc(n + 1, sizeof *c->extras);
    c->extra_file = calloc(n + 1, sizeof *c->extra_file);
    c->file_order = malloc((n + 1) * sizeof *c->file_order);
    c->links = calloc(n + 1, sizeof *c->links);
    if (!c->files || !c->file_bytes || !c->file_hash || !c->h5 || !c->fd || !c->extras || !c->extra_file || !c->file_order ||
        !c->links)
        return shard_fail(SHARD_E_NOMEM, "out of memory"); /* nfiles 0: close frees what there is */
    c->nfiles = n;
    const char *hash_key = c->file_hash_kind == SHARD_FHASH_XXH64 ? "xxh64" : "xxh3_blocks"; /* by the version */
    for (size_t i = 0; i < n; i++) { c->h5[i] = -1; c->fd[i] = -1; } /* close looks at every one */
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(files, i);
        json_t *nm = json_object_get(e, "name"), *by = json_object_get(e, "bytes");
        if (!json_is_string(nm) || !shard_path_is_contained(json_string_value(nm))) BAD("%s: files[%zu]: name missing or leaves the checkpoint folder", mpath, i);
        c->files[i] = json_string_value(nm);
        if (!json_is_integer(by) || json_integer_value(by) < 0) BAD("%s: files[%zu]: bytes missing", mpath, i);
        c->file_bytes[i] = (uint64_t)json_integer_value(by);
        if (parse_hex(json_string_value(json_object_get(e, hash_key)), &c->file_hash[i])) BAD("%s: files[%zu]: %s missing or malformed", mpath, i, hash_key);
        if (!strncmp(c->files[i], "extra/", 6)) { c->extra_file[c->nextras] = i; c->extras[c->nextras++] = c->files[i] + 6; }
        else if (strchr(c->files[i], '/')) BAD("%s: files[%zu]: \"%s\" is neither a shard file nor under extra/", mpath, i, c->files[i]);
    }
    for (size_t i = 0; i < n; i++) c->file_order[i] = i;
    qsort_r(c->file_order, n, sizeof *c->file_order, cmp_file, c);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(c->files[c->file_order[i]], c->files[c->file_order[i - 1]])) BAD("%s: file %s is listed twice", mpath, c->files[c->file_order[i]]);
    return SHARD_OK;
}

/* Piece j of tensor t: in a listed shard file, inside the tensor. */
static shard_status read_piece(shard_ckpt *c, const char *mpath, tensor *t, size_t j, json_t *pe)
{
    piece *p = &t->p[j];
    json_t *pf = json_object_get(pe, "file"), *pd = json_object_get(pe, "dataset");
    if (!json_is_string(pf) || !json_is_string(pd)) BAD("%s: tensor \"%s\": piece %zu: file or dataset missing", mpath, t->t.name, j);
    p->file = json_string_value(pf);
    p->dataset = json_string_value(pd);
    size_t fi = find_file(c, p->file);
    if (fi == c->nfiles || strchr(p->file, '/')) BAD("%s: tensor \"%s\": piece %zu: file \"%s\" is not a listed shard file", mpath, t->t.name, j, p->file);
    p->file_index = fi;
    p->box.ndim = t->t.ndim;
    if (int_array(json_object_get(pe, "offset"), t->t.ndim, p->box.off, 0) || int_array(json_object_get(pe, "shape"), t->t.ndim, p->box.len, 1))
        BAD("%s: tensor \"%s\": piece %zu: bad offset or shape", mpath, t->t.name, j);
    for (int k = 0; k < t->t.ndim; k++)
        if (p->box.off[k] > t->t.shape[k] || p->box.len[k] > t->t.shape[k] - p->box.off[k])
            BAD("%s: tensor \"%s\": piece %zu lies outside the tensor", mpath, t->t.name, j);
    if (parse_hex(json_string_value(json_object_get(pe, "xxh64")), &p->xxh64)) BAD("%s: tensor \"%s\": piece %zu: xxh64 missing or malformed", mpath, t->t.name, j);
    return SHARD_OK;
}

/* Tensor i (manifest entry e): name, group, dtype, shape, and pieces that cover it
 * exactly once. */
static shard_status read_tensor(shard_ckpt *c, const char *mpath, size_t i, json_t *e)
{
    tensor *t = &c->t[c->n++]; /* counted now: close frees what it holds even if it is refused */
    json_t *nm = json_object_get(e, "name"), *gr = json_object_get(e, "group"), *dt = json_object_get(e, "dtype"), *sh = json_object_get(e, "shape");
    if (!json_is_string(nm) || !json_is_string(gr)) BAD("%s: tensors[%zu]: name or group missing", mpath, i);
    t->t.name = json_string_value(nm);
    t->t.group = json_string_value(gr);
    int known = 0;
    for (int g = 0; GROUPS[g]; g++) known |= !strcmp(GROUPS[g], t->t.group);
    if (!known) BAD("%s: tensor \"%s\": unknown group \"%s\"", mpath, t->t.name, t->t.group);
    t->t.dtype = json_is_string(dt) ? shard_dtype_from_name(json_string_value(dt)) : SHARD_DT_INVALID;
    if (t->t.dtype == SHARD_DT_INVALID || shard_h5_type(t->t.dtype) < 0) BAD("%s: tensor \"%s\": bad dtype", mpath, t->t.name);
    t->t.ndim = json_is_array(sh) ? (int)json_array_size(sh) : 0;
    if (t->t.ndim < 1 || t->t.ndim > SHARD_MAX_DIMS || int_array(sh, t->t.ndim, t->t.shape, 0)) BAD("%s: tensor \"%s\": bad shape", mpath, t->t.name);
    json_t *ps = json_object_get(e, "pieces");
    if (!json_is_array(ps)) BAD("%s: tensor \"%s\": pieces missing", mpath, t->t.name);
    if (!(t->p = calloc(json_array_size(ps) + 1, sizeof *t->p))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    t->t.npieces = json_array_size(ps);
    uint64_t total = 1, covered = 0;
    for (int k = 0; k < t->t.ndim; k++) if (!shard_mul_u64(total, (uint64_t)t->t.shape[k], &total)) BAD("%s: tensor \"%s\": shape overflows", mpath, t->t.name);
    /* every size derived from a shape (bytes, rows x columns, offsets) then fits an int64 */
    if (total > (UINT64_C(1) << 56)) BAD("%s: tensor \"%s\": more than 2^56 elements", mpath, t->t.name);
    for (size_t j = 0; j < t->t.npieces; j++) {
        shard_status s = read_piece(c, mpath, t, j, json_array_get(ps, j));
        if (s) return s;
        covered += shard_box_numel(&t->p[j].box);
    }
    long a, b;
    int overlap = find_overlap(t->p, t->t.npieces, &a, &b);
    if (overlap < 0) return shard_fail(SHARD_E_NOMEM, "out of memory");
    if (overlap) BAD("%s: tensor \"%s\": pieces %ld and %ld overlap", mpath, t->t.name, a, b);
    if (covered != total) BAD("%s: tensor \"%s\": pieces cover %llu of %llu elements (holes)", mpath, t->t.name, (unsigned long long)covered, (unsigned long long)total);
    return SHARD_OK;
}

/* "tensors", each once (sorted by group and name: the index of shard_ckpt_find) */
static shard_status read_tensors(shard_ckpt *c, const char *mpath)
{
    json_t *ts = json_object_get(c->m, "tensors");
    if (!json_is_array(ts)) BAD("%s: \"tensors\" missing", mpath);
    const size_t n = json_array_size(ts);
    c->t = calloc(n + 1, sizeof *c->t);
    c->tensor_order = malloc((n + 1) * sizeof *c->tensor_order);
    if (!c->t || !c->tensor_order) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        shard_status s = read_tensor(c, mpath, i, json_array_get(ts, i));
        if (s) return s;
    }
    for (size_t i = 0; i < c->n; i++) c->tensor_order[i] = i;
    qsort_r(c->tensor_order, c->n, sizeof *c->tensor_order, cmp_tensor, c);
    for (size_t i = 1; i < c->n; i++) {
        const tensor *x = &c->t[c->tensor_order[i - 1]], *y = &c->t[c->tensor_order[i]];
        if (!strcmp(x->t.name, y->t.name) && !strcmp(x->t.group, y->t.group)) BAD("%s: tensor \"%s\" (%s) is listed twice", mpath, y->t.name, y->t.group);
    }
    return SHARD_OK;
}

static shard_status validate(shard_ckpt *c, const char *mpath)
{
    shard_status s;
    if ((s = read_header(c, mpath)) || (s = read_files(c, mpath)) || (s = read_tensors(c, mpath)) ||
        (s = check_datasets_distinct(c, mpath)))
        return s;
    return check_against_model(c, mpath);
}

void shard_ckpt_close(shard_ckpt *c)
{
    if (!c) return;
    shard_ckpt_unlock(c);
    for (size_t i = 0; i < c->nfiles && c->h5; i++) if (c->h5[i] >= 0) H5Fclose(c->h5[i]);
    for (size_t i = 0; i < c->nfiles && c->fd; i++) if (c->fd[i] >= 0) close(c->fd[i]);
    for (size_t i = 0; i < c->n; i++) {
        for (size_t j = 0; j < c->t[i].t.npieces && c->t[i].p; j++) {
            piece_index *ix = c->t[i].p[j].ix;
            if (ix) { free(ix->loc); free(ix->xxh3); free(ix); }
        }
        free(c->t[i].p);
    }
    free(c->t); free(c->files); free(c->file_bytes); free(c->file_hash); free(c->h5); free(c->fd); free(c->extras); free(c->extra_file);
    free(c->links);
    json_decref(c->m);
    free(c->strings);
    ckpt_scratch_free_all(c);
    ckpt_cache_free(c);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->smu);
    free(c->training);
    free(c->file_order);
    free(c->tensor_order);
    free(c->dir);
    free(c);
}

void shard_ckpt_unlock(shard_ckpt *c)
{
    if (c->lock_fd >= 0) close(c->lock_fd);
    c->lock_fd = -1;
}

/* A run folder's `latest` that names another checkpoint than dir now: the one opened was
 * pruned (--keep) while this process opened it, and the newer one is to be opened. */
static int latest_moved(const char *path, const char *dir)
{
    char *now = NULL;
    const int moved = strcmp(path, dir) && !shard_ckpt_resolve(path, &now) && strcmp(now, dir);
    free(now);
    return moved;
}

shard_status shard_ckpt_open_any(const char *path, shard_ckpt **out)
{
    *out = NULL;
    shard_status s;
    for (int tries = 0;; tries++) {
        char *dir;
        if ((s = shard_ckpt_resolve(path, &dir))) return s;
        s = shard_ckpt_open(dir, out);
        const int again = s && tries < 8 && latest_moved(path, dir);
        free(dir);
        if (!again) return s;
    }
}

shard_status shard_ckpt_open_any_on(shard_comm *world, const char *path, shard_ckpt **out)
{
    *out = NULL;
    if (!world || shard_comm_size(world) == 1) return shard_ckpt_open_any(path, out);
    char name[256] = {0}; /* the step folder rank 0 opened through `latest`, or "" */
    shard_status mine = SHARD_OK;
    if (shard_comm_rank(world) == 0) {
        mine = shard_ckpt_open_any(path, out); /* held (its lock) while the others open it */
        const char *dir = mine ? NULL : shard_ckpt_dir(*out), *base = dir ? strrchr(dir, '/') : NULL;
        if (base && strcmp(dir, path) && strlen(base + 1) < sizeof name) strcpy(name, base + 1); /* through latest */
    }
    shard_status s = shard_comm_broadcast(world, name, sizeof name, SHARD_DT_U8, 0);
    if (shard_comm_rank(world) == 0) return s ? s : mine;
    if (s) return s;
    char *dir = NULL;
    if ((s = shard_ckpt_resolve(path, &dir))) return s;
    char *there = name[0] && strcmp(dir, path) ? shard_path_join(path, name) : NULL; /* a run folder here too */
    struct stat st;
    if (there && (lstat(there, &st) != 0 || !S_ISDIR(st.st_mode))) /* as resolve checks latest's name */
        s = shard_fail(SHARD_E_INVALID, "%s: has no folder %s, the step that rank 0 loaded through its latest (every "
                       "rank loads the same checkpoint)", path, name);
    else
        s = shard_ckpt_open(there ? there : dir, out);
    free(there);
    free(dir);
    return s;
}

/* smp.json, read through a descriptor that keeps a shared flock while c is open: a
 * training run's --keep removes no checkpoint that a reader holds (it takes the lock
 * exclusively first, and leaves one it cannot take for a later save). One that is being
 * removed, or was removed between the lookup and the lock, is refused as such. A file
 * system without flock: no lock. */
static shard_status read_manifest(shard_ckpt *c, const char *mp, char **text, size_t *len)
{
    uint64_t size;
    shard_status s = shard_open_regular(mp, 1, &c->lock_fd, &size);
    if (s) return s;
    struct stat st;
    const int held = flock(c->lock_fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (held || (fstat(c->lock_fd, &st) == 0 && st.st_nlink == 0))
        return shard_fail(SHARD_E_INVALID, "%s: removed while being opened (an older checkpoint of a run that keeps "
                                           "only its newest: --keep)", c->dir);
    return shard_read_fd(c->lock_fd, mp, size, MANIFEST_MAX, text, len);
}

/* Once validated, the manifest's tensors live on in c->t alone: their names and datasets
 * are copied into one block and "tensors" leaves the JSON, which held them at ~5x their
 * text (a Qwen3-30B-A3B's smp.json is 12 MB; ~60 MB parsed, on every rank of a run). */
static shard_status compact_manifest(shard_ckpt *c)
{
    size_t need = 1;
    for (size_t i = 0; i < c->n; i++) {
        need += strlen(c->t[i].t.name) + 1;
        for (size_t j = 0; j < c->t[i].t.npieces; j++) need += strlen(c->t[i].p[j].dataset) + 1;
    }
    char *at = c->strings = malloc(need);
    if (!at) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < c->n; i++) {
        tensor *t = &c->t[i];
        for (int g = 0; GROUPS[g]; g++)
            if (!strcmp(GROUPS[g], t->t.group)) t->t.group = GROUPS[g]; /* read_tensor refused any other */
        t->t.name = strcpy(at, t->t.name);
        at += strlen(at) + 1;
        for (size_t j = 0; j < t->t.npieces; j++) {
            piece *p = &t->p[j];
            p->file = c->files[p->file_index];
            p->dataset = strcpy(at, p->dataset);
            at += strlen(at) + 1;
        }
    }
    json_object_del(c->m, "tensors");
    return SHARD_OK;
}

shard_status shard_ckpt_manifest_tensors(const shard_ckpt *c, void **out)
{
    *out = NULL;
    char *mp = shard_path_join(c->dir, "smp.json"), *text = NULL;
    uint64_t size;
    size_t len;
    int fd = -1;
    json_t *m = NULL, *ts = NULL;
    shard_status s = mp ? shard_open_regular(mp, 1, &fd, &size) : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s) s = shard_read_fd(fd, mp, size, MANIFEST_MAX, &text, &len);
    if (fd >= 0) close(fd);
    if (!s && shard_xxh64(text, len) != c->fingerprint)
        s = shard_fail(SHARD_E_INVALID, "%s: changed since the checkpoint was opened", mp);
    if (!s) s = shard_json_parse(text, len, mp, &m);
    if (!s && !json_is_array(ts = json_object_get(m, "tensors"))) s = shard_fail(SHARD_E_INVALID, "%s: \"tensors\" missing", mp);
    if (!s) json_incref(ts);
    json_decref(m);
    free(text);
    free(mp);
    if (!s) *out = ts;
    return s;
}

shard_status shard_ckpt_open(const char *dir, shard_ckpt **out)
{
    shard_h5_quiet();
    *out = NULL;
    shard_ckpt *c = calloc(1, sizeof *c);
    if (!c) return shard_fail(SHARD_E_NOMEM, "out of memory");
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->smu, NULL);
    c->threads = 1;
    c->lock_fd = -1;
    c->dir = strdup(dir);
    if (!c->dir || ckpt_cache_init(c)) { shard_ckpt_close(c); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    char *mp = shard_path_join(dir, "smp.json");
    struct stat st;
    shard_status s;
    if (!mp) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    else if (lstat(mp, &st) != 0) /* a link, even to nothing, is refused by the read below */
        s = shard_fail(SHARD_E_INVALID, "%s: no smp.json: not a checkpoint, or one that was never committed", dir);
    else {
        char *text;
        size_t len;
        s = read_manifest(c, mp, &text, &len);
        if (!s) {
            c->fingerprint = shard_xxh64(text, len);
            s = shard_json_parse(text, len, mp, &c->m);
            free(text);
        }
        if (!s) s = validate(c, mp);
        if (!s) s = compact_manifest(c);
    }
    free(mp);
    if (s) { shard_ckpt_close(c); return s; }
    *out = c;
    return SHARD_OK;
}

shard_status shard_ckpt_resolve(const char *path, char **ckpt_dir)
{
    *ckpt_dir = NULL;
    char *man = shard_path_join(path, "smp.json"), *lat = shard_path_join(path, "latest");
    if (!man || !lat) {
        free(man); free(lat);
        return shard_fail(SHARD_E_NOMEM, "out of memory");
    }
    shard_status s = SHARD_OK;
    struct stat lst;
    if (lstat(man, &lst) == 0) {
        *ckpt_dir = strdup(path);
    } else if (lstat(lat, &lst) == 0) {
        char *name = NULL;
        size_t len;
        s = shard_read_file_in(lat, 4096, 1, &name, &len); /* a FIFO, link or directory: refused */
        if (!s) {
            const size_t n = strcspn(name, "\r\n");
            int clean = memchr(name, 0, n) == NULL; /* one name, then only line ends */
            for (size_t i = n; clean && i < len; i++) clean = name[i] == '\r' || name[i] == '\n';
            name[n] = 0;
            if (!clean || !name[0] || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
                s = shard_fail(SHARD_E_INVALID, "%s: does not hold the name of a checkpoint folder", lat);
            else if (!(*ckpt_dir = shard_path_join(path, name)))
                s = shard_fail(SHARD_E_NOMEM, "out of memory");
            else if (lstat(*ckpt_dir, &lst) != 0 || !S_ISDIR(lst.st_mode)) /* a link would lead out of the run folder */
                s = shard_fail(SHARD_E_INVALID, "%s: names %s, which is not a folder of this run", lat, name);
        }
        free(name);
    } else {
        char *cfg = shard_path_join(path, "config.json");
        if (cfg && lstat(cfg, &lst) == 0) /* the commonest mix-up, said as such */
            s = shard_fail(SHARD_E_INVALID, "%s: a Hugging Face model folder, not a checkpoint (smp-convert hf2smp "
                                            "makes one of it)", path);
        else
            s = shard_fail(SHARD_E_INVALID, "%s: no smp.json: not a checkpoint (or one never committed), nor a run "
                                            "folder (no latest)", path);
        free(cfg);
    }
    if (!s && !*ckpt_dir) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    if (s) { free(*ckpt_dir); *ckpt_dir = NULL; }
    free(man);
    free(lat);
    return s;
}

const char *shard_ckpt_dir(const shard_ckpt *c) { return c->dir; }
const shard_model_desc *shard_ckpt_model(const shard_ckpt *c) { return &c->model; }
const shard_layout *shard_ckpt_layout(const shard_ckpt *c) { return &c->layout; }
const int *shard_ckpt_stages(const shard_ckpt *c) { return c->stages; }
const char *shard_ckpt_config_json(const shard_ckpt *c) { return c->config; }
size_t shard_ckpt_tensor_count(const shard_ckpt *c) { return c->n; }
const shard_ckpt_tensor *shard_ckpt_tensor_at(const shard_ckpt *c, size_t i) { return i < c->n ? &c->t[i].t : NULL; }
size_t shard_ckpt_extra_count(const shard_ckpt *c) { return c->nextras; }
const char *shard_ckpt_extra_at(const shard_ckpt *c, size_t i) { return c->extras[i]; }
const void *shard_ckpt_manifest_json(const shard_ckpt *c) { return c->m; }
const char *shard_ckpt_training_json(const shard_ckpt *c) { return c->training; }
uint64_t shard_ckpt_fingerprint(const shard_ckpt *c) { return c->fingerprint; }

long shard_ckpt_find(const shard_ckpt *c, const char *group, const char *name)
{
    if (!group) group = "params";
    size_t lo = 0, hi = c->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const tensor *t = &c->t[c->tensor_order[mid]];
        int k = strcmp(t->t.group, group);
        if (!k) k = strcmp(t->t.name, name);
        if (k == 0) return (long)c->tensor_order[mid];
        if (k < 0) lo = mid + 1; else hi = mid;
    }
    return -1;
}

