/* Writing a checkpoint: the staging folder, extra files, and the atomic commit.
 * The manifest is built from the shard files' own attributes, so any number of
 * processes can write shard files into the staging folder and one commits. */
#include "ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct shard_ckpt_writer {
    char *final_dir, *staging;
    json_t *extras; /* array of relative names */
    shard_write_opts opts;
};

const char *shard_ckpt_staging(const shard_ckpt_writer *w) { return w->staging; }

shard_status shard_ckpt_begin(const char *final_dir, shard_ckpt_writer **out)
{
    return shard_ckpt_begin_opts(final_dir, NULL, out);
}

shard_status shard_ckpt_begin_opts(const char *final_dir, const shard_write_opts *o, shard_ckpt_writer **out)
{
    *out = NULL;
    shard_ckpt_writer *w = calloc(1, sizeof *w);
    if (!w) return shard_fail(SHARD_E_NOMEM, "out of memory");
    if (o) w->opts = *o;
    w->final_dir = strdup(final_dir);
    w->staging = shard_staging_path(final_dir);
    w->extras = json_array();
    if (!w->final_dir || !w->staging || !w->extras) {
        free(w->staging); /* not made yet: nothing to remove */
        w->staging = NULL;
        shard_ckpt_abort(w);
        return shard_fail(SHARD_E_NOMEM, "out of memory");
    }
    if (mkdir(w->staging, 0755) != 0) {
        shard_status s = shard_fail(SHARD_E_IO, "%s: cannot create the staging folder: %s", w->staging, strerror(errno));
        free(w->staging); w->staging = NULL;
        shard_ckpt_abort(w);
        return s;
    }
    *out = w;
    return SHARD_OK;
}

/* Copy src to a new file dst (refused if it exists; fsynced unless no_fsync). With
 * want_hash (an extra file of a checkpoint) src must be a regular file, no link, of
 * want_bytes whose checksum (of that kind) is *want_hash: checked as it is copied, and on a mismatch
 * nothing is left at dst. */
static shard_status copy_checked(const char *src, const char *dst, uint64_t want_bytes, const uint64_t *want_hash,
                                 shard_fhash_kind kind, const shard_write_opts *opts)
{
    int in;
    uint64_t size;
    shard_status s = shard_open_regular(src, want_hash != NULL, &in, &size);
    if (s) return s;
    if (want_hash && size != want_bytes) {
        close(in);
        return shard_fail(SHARD_E_CORRUPT, "%s: %llu bytes, the manifest says %llu", src, (unsigned long long)size, (unsigned long long)want_bytes);
    }
    int o = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (o < 0) { close(in); return shard_fail(SHARD_E_IO, "%s: cannot create: %s", dst, strerror(errno)); }
    shard_fhash_state h;
    shard_fhash_reset(&h, kind);
    char buf[1 << 16];
    uint64_t total = 0;
    while (!s) {
        ssize_t r = read(in, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { s = shard_fail(SHARD_E_IO, "%s: read failed: %s", src, strerror(errno)); break; }
        if (r == 0) break;
        if (want_hash) shard_fhash_update(&h, buf, (size_t)r);
        total += (uint64_t)r;
        for (ssize_t k = 0; k < r && !s;) {
            ssize_t wr = write(o, buf + k, (size_t)(r - k));
            if (wr < 0 && errno == EINTR) continue;
            if (wr < 0) s = shard_fail(SHARD_E_IO, "%s: write failed: %s", dst, strerror(errno));
            else k += wr;
        }
    }
    if (!s && want_hash && (total != want_bytes || shard_fhash_digest(&h) != *want_hash))
        s = shard_fail(SHARD_E_CORRUPT, "%s: checksum mismatch (file damaged)", src);
    if (!s && !(opts && opts->no_fsync) && fsync(o) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", dst, strerror(errno));
    close(in);
    if (close(o) != 0 && !s) s = shard_fail(SHARD_E_IO, "%s: write failed: %s", dst, strerror(errno));
    if (s) unlink(dst);
    return s;
}

shard_status shard_copy_file(const char *src, const char *dst, const shard_write_opts *opts)
{
    return copy_checked(src, dst, 0, NULL, SHARD_FHASH_XXH3_BLOCKS, opts);
}

shard_status shard_ckpt_copy_extra(const shard_ckpt *c, size_t i, const char *dst, const shard_write_opts *opts)
{
    if (i >= c->nextras) return shard_fail(SHARD_E_USAGE, "%s: no extra file %zu", c->dir, i);
    size_t fi = c->extra_file[i];
    char src[4200];
    ckpt_file_path(c, fi, src, sizeof src);
    return copy_checked(src, dst, c->file_bytes[fi], &c->file_hash[fi], c->file_hash_kind, opts);
}

/* Copy a file into the staging folder's extra/: from a model folder (src_path), or
 * checked, from a checkpoint (src, extra i). */
static shard_status add_extra(shard_ckpt_writer *w, const char *src_path, const shard_ckpt *src, size_t i, const char *rel)
{
    if (!shard_path_is_contained(rel) || strchr(rel, '/')) return shard_fail(SHARD_E_USAGE, "extra file name \"%s\" is not a plain file name", rel);
    char *dir = shard_path_join(w->staging, "extra"), *dst = dir ? shard_path_join(dir, rel) : NULL;
    shard_status s = SHARD_OK;
    if (!dst) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    else mkdir(dir, 0755);
    if (!s) s = src ? shard_ckpt_copy_extra(src, i, dst, &w->opts) : shard_copy_file(src_path, dst, &w->opts);
    if (!s && json_array_append_new(w->extras, json_string(rel)) != 0) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    free(dir);
    free(dst);
    return s;
}

shard_status shard_ckpt_carry_extra(shard_ckpt_writer *w, const shard_ckpt *src, size_t i)
{
    if (i >= src->nextras) return shard_fail(SHARD_E_USAGE, "%s: no extra file %zu", src->dir, i);
    return add_extra(w, NULL, src, i, src->extras[i]);
}

shard_status shard_ckpt_add_extra(shard_ckpt_writer *w, const char *src_path, const char *rel)
{
    return add_extra(w, src_path, NULL, 0, rel);
}

/* ------------------------------------------------- scanning the shard files */
/* The other files of a Hugging Face model folder: all but hidden ones, config.json and
 * the weights (*.safetensors and their index). */
static int is_model_extra(const char *n)
{
    size_t len = strlen(n);
    return n[0] != '.' && strcmp(n, "config.json") && strcmp(n, "model.safetensors.index.json") &&
           !(len > 12 && !strcmp(n + len - 12, ".safetensors"));
}

shard_status shard_ckpt_add_folder_extras(shard_ckpt_writer *w, const char *model_dir)
{
    DIR *dir = opendir(model_dir);
    if (!dir) return SHARD_OK; /* the weights were read from it: nothing else to carry */
    shard_status s = SHARD_OK;
    struct dirent *e;
    while (!s && (e = readdir(dir))) {
        if (!is_model_extra(e->d_name)) continue;
        char *p = shard_path_join(model_dir, e->d_name);
        struct stat st;
        if (!p) s = shard_fail(SHARD_E_NOMEM, "out of memory");
        else if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) s = shard_ckpt_add_extra(w, p, e->d_name);
        free(p);
    }
    closedir(dir);
    return s;
}

shard_status shard_ckpt_carry_extras(shard_ckpt_writer *w, const shard_ckpt *src)
{
    shard_status s = SHARD_OK;
    for (size_t i = 0; i < src->nextras && !s; i++) s = shard_ckpt_carry_extra(w, src, i);
    return s;
}

/* ------------------------------------------------- scanning the shard files */
typedef struct {
    const char *file_name, *path;
    hid_t file;
    json_t *tensors; /* key "group\nname" -> tensor object */
    shard_status s;
} scan_ctx;

/* A piece of tensor tname (group, dtype dtn, global shape gsh) at off, of dims, in the
 * dataset dpath of c's file, into c->tensors; -1 (c->s set) when it disagrees with the
 * tensor's other pieces. */
static int add_piece(scan_ctx *c, const char *group, const char *tname, const char *dtn, int nd, const int64_t *gsh,
                     const int64_t *off, const int64_t *dims, const char *hex, const char *dpath)
{
    char key[1400];
    snprintf(key, sizeof key, "%s\n%s", group, tname);
    json_t *t = json_object_get(c->tensors, key);
    json_t *jshape = json_array();
    for (int k = 0; k < nd; k++) json_array_append_new(jshape, json_integer(gsh[k]));
    if (!t) {
        t = json_pack("{s:s,s:s,s:s,s:o,s:[]}", "name", tname, "group", group, "dtype", dtn, "shape", jshape, "pieces");
        json_object_set_new(c->tensors, key, t);
    } else {
        if (!json_equal(json_object_get(t, "shape"), jshape) || strcmp(json_string_value(json_object_get(t, "dtype")), dtn)) {
            json_decref(jshape);
            c->s = shard_fail(SHARD_E_INVALID, "%s: piece of \"%s\" disagrees with other pieces on shape or dtype", c->path, tname);
            return -1;
        }
        json_decref(jshape);
    }
    json_t *jo = json_array(), *jl = json_array();
    for (int k = 0; k < nd; k++) { json_array_append_new(jo, json_integer(off[k])); json_array_append_new(jl, json_integer(dims[k])); }
    json_array_append_new(json_object_get(t, "pieces"),
                          json_pack("{s:s,s:s,s:o,s:o,s:s}", "file", c->file_name, "dataset", dpath, "offset", jo, "shape", jl, "xxh64", hex));
    return 0;
}

static herr_t visit(hid_t g, const char *name, const H5L_info_t *info, void *p)
{
    (void)info;
    scan_ctx *c = p;
    hid_t ds = H5Oopen(g, name, H5P_DEFAULT); /* one lookup by name: a group is passed over */
    if (ds >= 0 && H5Iget_type(ds) != H5I_DATASET) { H5Oclose(ds); return 0; }
    char tname[1024], dtn[32], hex[32];
    int64_t off[SHARD_MAX_DIMS], gsh[SHARD_MAX_DIMS], dims[SHARD_MAX_DIMS];
    hsize_t hd[SHARD_MAX_DIMS];
    hid_t sp = ds < 0 ? -1 : H5Dget_space(ds);
    int nd = sp < 0 ? -1 : H5Sget_simple_extent_ndims(sp);
    if (nd >= 1 && nd <= SHARD_MAX_DIMS) H5Sget_simple_extent_dims(sp, hd, NULL);
    for (int k = 0; k < nd && k < SHARD_MAX_DIMS; k++) dims[k] = (int64_t)hd[k];
    if (sp >= 0) H5Sclose(sp);
    int n1 = shard_h5_attr_ints(ds, "offset", H5T_NATIVE_INT64, off, 1, SHARD_MAX_DIMS);
    int n2 = shard_h5_attr_ints(ds, "global_shape", H5T_NATIVE_INT64, gsh, 1, SHARD_MAX_DIMS);
    int bad = ds < 0 || shard_h5_attr_str(ds, "tensor", tname, sizeof tname) || shard_h5_attr_str(ds, "dtype", dtn, sizeof dtn) ||
              shard_h5_attr_str(ds, "xxh64", hex, sizeof hex) || n1 != nd || n2 != nd || nd < 1;
    if (ds >= 0) H5Oclose(ds);
    if (bad) { c->s = shard_fail(SHARD_E_INVALID, "%s: dataset /%s lacks the piece attributes", c->path, name); return -1; }
    /* group = the dataset path without its last component */
    const char *last = strrchr(name, '/');
    char group[256], dpath[1100];
    snprintf(group, sizeof group, "%.*s", last ? (int)(last - name) : 0, name);
    snprintf(dpath, sizeof dpath, "/%s", name);
    return add_piece(c, group, tname, dtn, nd, gsh, off, dims, hex, dpath);
}

/* One line of a writer's note into c->tensors when add; -1 when it is not one (or, with
 * add, the piece disagrees: c->s). */
static int note_line(scan_ctx *c, char *line, int add)
{
    shard_note_piece q;
    if (shard_note_piece_parse(line, &q)) return -1;
    if (!add) return 0;
    char dpath[1400];
    snprintf(dpath, sizeof dpath, "/%s/%s", q.group, q.name);
    return add_piece(c, q.group, q.name, q.dtype, q.ndim, q.gshape, q.off, q.len, q.hex, dpath);
}

/* The file's pieces from its writer's note, when the note still describes the file and
 * every line reads (checked before any is added); 0 when they were taken, -1 when the
 * file must be scanned instead, 1 on a failure (c->s). */
static int take_noted(scan_ctx *c)
{
    size_t n;
    char *text = shard_file_note_pieces(c->path, &n);
    if (!text) return -1;
    int rc = 0;
    for (int add = 0; add < 2 && !rc; add++) {
        char *copy = add ? text : strdup(text); /* note_line cuts its line at the tabs */
        if (!copy) { free(text); return -1; }
        for (char *line = copy, *nl; *line && !rc; line = nl + 1) {
            if (!(nl = strchr(line, '\n'))) { rc = -1; break; } /* a last line cut short */
            *nl = 0;
            if (note_line(c, line, add)) rc = add ? 1 : -1;
        }
        if (!add) free(copy);
    }
    free(text);
    return rc;
}

static int cmp_cstr(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The staging folder's shard files (shard-*.h5), sorted by name. */
static int is_shard_file(const char *name, void *ctx)
{
    size_t len = strlen(name);
    return !strncmp(name, "shard-", 6) && len >= 4 && !strcmp(name + len - 3, ".h5");
}

/* The pieces of every shard file, from their datasets' attributes, into tensors. */
static shard_status scan_shard_files(const char *staging, char **names, size_t n, json_t *tensors)
{
    shard_status s = SHARD_OK;
    for (size_t i = 0; i < n && !s; i++) {
        char *p = shard_path_join(staging, names[i]);
        if (!p) return shard_fail(SHARD_E_NOMEM, "out of memory");
        scan_ctx c = {names[i], p, -1, tensors, SHARD_OK};
        const int noted = take_noted(&c); /* the writer's own lines: no HDF5 call for the file */
        if (noted >= 0) {
            s = c.s;
            free(p);
            continue;
        }
        hid_t fapl = shard_h5_fapl(0);
        c.file = H5Fopen(p, H5F_ACC_RDONLY, fapl);
        if (fapl >= 0) H5Pclose(fapl);
        if (c.file < 0) s = shard_fail(SHARD_E_INVALID, "%s: not a readable HDF5 file", p);
        else {
            if (H5Lvisit(c.file, H5_INDEX_NAME, H5_ITER_INC, visit, &c) < 0) s = c.s ? c.s : shard_fail(SHARD_E_INVALID, "%s: cannot list its datasets", p);
            H5Fclose(c.file);
        }
        free(p);
    }
    return s;
}

typedef struct {
    shard_status s;
    uint64_t hash, bytes;
    char msg[512];
} hash_result;

typedef struct {
    const char *dir;
    char **names;
    size_t n;
    hash_result *out;
    size_t next;
    pthread_mutex_t mu;
} hash_job;

static void *hash_worker(void *arg)
{
    hash_job *j = arg;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        size_t i = j->next++;
        pthread_mutex_unlock(&j->mu);
        if (i >= j->n) break;
        char *p = shard_path_join(j->dir, j->names[i]);
        hash_result *r = &j->out[i];
        /* the writer's note when it still describes the file, else read the file */
        if (!p) r->s = shard_fail(SHARD_E_NOMEM, "out of memory");
        else if (!shard_file_hash_noted(p, &r->hash, &r->bytes)) r->s = shard_file_hash(p, SHARD_FHASH_XXH3_BLOCKS, &r->hash, &r->bytes);
        if (r->s) snprintf(r->msg, sizeof r->msg, "%s", shard_errmsg()); /* messages are per thread */
        free(p);
    }
    return NULL;
}

/* The manifest's entry of a file: its name, size and checksum. */
static void add_file_entry(json_t *files, const char *name, uint64_t bytes, uint64_t hash)
{
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)hash);
    json_array_append_new(files, json_pack("{s:s,s:I,s:s}", "name", name, "bytes", (json_int_t)bytes, "xxh3_blocks", hex));
}

/* Every shard file's checksum (several files at once) into files. */
static shard_status hash_shard_files(const char *staging, char **names, size_t n, json_t *files)
{
    hash_job hj = {staging, names, n, calloc(n + 1, sizeof(hash_result)), 0, PTHREAD_MUTEX_INITIALIZER};
    if (!hj.out) return shard_fail(SHARD_E_NOMEM, "out of memory");
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = (int)(nc < 1 ? 1 : nc > 8 ? 8 : nc);
    if ((size_t)nt > n) nt = (int)n;
    pthread_t th[8];
    int started = 0;
    for (int i = 1; i < nt; i++) if (pthread_create(&th[started], NULL, hash_worker, &hj) == 0) started++;
    hash_worker(&hj);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    shard_status s = SHARD_OK;
    for (size_t i = 0; i < n && !s; i++) {
        if (hj.out[i].s) s = shard_fail(hj.out[i].s, "%s", hj.out[i].msg);
        else add_file_entry(files, names[i], hj.out[i].bytes, hj.out[i].hash);
    }
    free(hj.out);
    return s;
}

/* Every extra file's checksum into files. */
static shard_status hash_extras(const shard_ckpt_writer *w, json_t *files)
{
    shard_status s = SHARD_OK;
    size_t k;
    json_t *ev;
    json_array_foreach(w->extras, k, ev) {
        char rel[600];
        snprintf(rel, sizeof rel, "extra/%s", json_string_value(ev));
        char *p = shard_path_join(w->staging, rel);
        uint64_t hash, bytes;
        s = p ? shard_file_hash(p, SHARD_FHASH_XXH3_BLOCKS, &hash, &bytes) : shard_fail(SHARD_E_NOMEM, "out of memory");
        free(p);
        if (s) break;
        add_file_entry(files, rel, bytes, hash);
    }
    return s;
}

/* The tensors of the manifest in a stable order: by group, then name (the object's
 * keys sorted). */
static json_t *sorted_tensors(json_t *tensors)
{
    const char **keys = malloc((json_object_size(tensors) + 1) * sizeof *keys);
    if (!keys) return NULL;
    size_t nk = 0;
    const char *key;
    json_t *val;
    json_object_foreach(tensors, key, val) keys[nk++] = key;
    qsort(keys, nk, sizeof *keys, cmp_cstr);
    json_t *tarr = json_array();
    for (size_t i = 0; i < nk && tarr; i++) json_array_append(tarr, json_object_get(tensors, keys[i]));
    free(keys);
    return tarr;
}

/* The tensors and files of the staging folder's shard files and extras. */
static shard_status scan_staging(const shard_ckpt_writer *w, json_t **tensors_out, json_t **files_out)
{
    char **names;
    size_t n;
    shard_status s = shard_list_dir(w->staging, is_shard_file, NULL, &names, &n);
    if (s) return s;
    json_t *tensors = json_object(), *files = json_array();
    if (!tensors || !files) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s) s = scan_shard_files(w->staging, names, n, tensors);
    if (!s) s = hash_shard_files(w->staging, names, n, files);
    if (!s) s = hash_extras(w, files);
    shard_free_names(names, n);
    json_t *sorted = s ? NULL : sorted_tensors(tensors);
    if (!s && !sorted) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    json_decref(tensors);
    if (s) { json_decref(files); return s; }
    *tensors_out = sorted;
    *files_out = files;
    return SHARD_OK;
}

static shard_status fsync_path(const shard_ckpt_writer *w, const char *p, int dir)
{
    if (w->opts.no_fsync) return SHARD_OK;
    int fd = open(p, O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
    shard_status s = SHARD_OK;
    if (fd < 0 || fsync(fd) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync failed: %s", p, strerror(errno));
    if (fd >= 0) close(fd);
    return s;
}

/* The manifest: what the checkpoint holds (tensors, files: taken over) and describes. */
static shard_status build_manifest(const shard_ckpt_writer *w, json_t *tensors, json_t *files, const char *config_json,
                                   size_t config_len, const shard_model_desc *d, const shard_layout *l, const int *stages,
                                   const char *training_json, json_t **out)
{
    json_t *tr = json_null();
    if (training_json) {
        json_error_t je;
        tr = json_loads(training_json, JSON_REJECT_DUPLICATES, &je);
        if (!json_is_object(tr)) {
            json_decref(tr);
            json_decref(tensors);
            json_decref(files);
            return shard_fail(SHARD_E_USAGE, "%s: the training state is not a JSON object: %s", w->final_dir, je.text);
        }
    }
    json_t *jst = json_array();
    for (int i = 0; i < l->pp; i++) json_array_append_new(jst, json_integer(stages[i]));
    json_t *m = json_object();
    json_object_set_new(m, "format", json_string(SHARD_FORMAT_NAME));
    json_object_set_new(m, "version", json_integer(SHARD_FORMAT_VERSION));
    json_object_set_new(m, "minor", json_integer(SHARD_FORMAT_MINOR));
    json_object_set_new(m, "producer", json_string("smp " SHARD_VERSION_STRING));
    json_object_set_new(m, "config_json", json_stringn(config_json, config_len));
    json_object_set_new(m, "model", shard_model_to_json(d));
    json_t *lj = json_pack("{s:i,s:i,s:i,s:i}", "pp", l->pp, "tp", l->tp, "cp", l->cp, "dp", l->dp);
    if (shard_layout_ep(l) > 1) json_object_set_new(lj, "ep", json_integer(l->ep)); /* format 1.1 readers: absent is 1 */
    json_object_set_new(m, "layout", lj);
    json_object_set_new(m, "stages", jst);
    json_object_set_new(m, "tensors", tensors);
    json_object_set_new(m, "files", files);
    json_object_set_new(m, "training", tr);
    *out = m;
    return SHARD_OK;
}

/* smp.json into the staging folder, then the folder (and extra/) made durable. */
static shard_status write_manifest(const shard_ckpt_writer *w, json_t *m)
{
    char *mp = shard_path_join(w->staging, "smp.json"), *ex = shard_path_join(w->staging, "extra");
    shard_status s = SHARD_OK;
    struct stat st;
    if (!mp || !ex) s = shard_fail(SHARD_E_NOMEM, "out of memory");
    else if (json_dump_file(m, mp, JSON_INDENT(1) | JSON_REAL_PRECISION(17)) != 0) s = shard_fail(SHARD_E_IO, "%s: cannot write the manifest", mp);
    if (!s) s = fsync_path(w, mp, 0);
    if (!s && stat(ex, &st) == 0) s = fsync_path(w, ex, 1);
    if (!s) s = fsync_path(w, w->staging, 1);
    free(mp);
    free(ex);
    return s;
}

/* The staging folder renamed into place; with overwrite, an old checkpoint there is
 * moved aside first (a crash leaves one of the two whole) and removed after. */
static shard_status put_in_place(const shard_ckpt_writer *w, int overwrite)
{
    shard_status s = SHARD_OK;
    struct stat st;
    char *old = NULL;
    if (overwrite && stat(w->final_dir, &st) == 0) {
        /* aside under a staging name (".tmp-<name>.old-<pid>-<time>"): what a process
         * killed before the removal below leaves is swept like a killed write's staging */
        size_t n = strlen(w->final_dir);
        while (n > 1 && w->final_dir[n - 1] == '/') n--;
        char *was = malloc(n + 8);
        if (was) sprintf(was, "%.*s.old", (int)n, w->final_dir);
        old = was ? shard_staging_path(was) : NULL;
        free(was);
        if (!old) return shard_fail(SHARD_E_NOMEM, "out of memory");
        if (rename(w->final_dir, old) != 0) s = shard_fail(SHARD_E_IO, "%s: cannot move aside: %s", w->final_dir, strerror(errno));
    }
    if (!s && rename(w->staging, w->final_dir) != 0) s = shard_fail(SHARD_E_IO, "%s: rename into place failed: %s", w->final_dir, strerror(errno));
    if (!s && old) shard_remove_tree(old);
    free(old);
    if (!s && !w->opts.no_fsync) s = shard_fsync_dir_of(w->final_dir);
    return s;
}

shard_status shard_ckpt_commit(shard_ckpt_writer *w, const char *config_json, size_t config_len, const shard_model_desc *d,
                               const shard_layout *l, const int *stages, const char *training_json, int overwrite)
{
    shard_h5_quiet();
    struct stat st;
    if (!overwrite && stat(w->final_dir, &st) == 0) return shard_fail(SHARD_E_USAGE, "%s: already exists (refusing to replace it)", w->final_dir);
    json_t *tensors, *files, *m;
    shard_status s = scan_staging(w, &tensors, &files);
    if (!s) s = build_manifest(w, tensors, files, config_json, config_len, d, l, stages, training_json, &m);
    if (s) return s;
    s = write_manifest(w, m);
    json_decref(m);
    if (!s) s = put_in_place(w, overwrite);
    if (!s) { free(w->staging); w->staging = NULL; shard_ckpt_abort(w); }
    return s;
}

/* The bytes of the files under p (links not followed, p itself included); with remove,
 * each removed (and the folders, emptied, after them). */
static uint64_t walk_tree(const char *p, int remove)
{
    struct stat st;
    if (lstat(p, &st) != 0) return 0;
    if (!S_ISDIR(st.st_mode)) { /* a link: itself, never what it points at */
        if (remove) unlink(p);
        return S_ISREG(st.st_mode) ? (uint64_t)st.st_size : 0;
    }
    uint64_t bytes = 0;
    DIR *d = opendir(p);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *c = shard_path_join(p, e->d_name);
        if (c) bytes += walk_tree(c, remove);
        free(c);
    }
    if (d) closedir(d);
    if (remove) rmdir(p);
    return bytes;
}

uint64_t shard_remove_tree(const char *p) { return walk_tree(p, 1); }
uint64_t shard_tree_bytes(const char *p) { return walk_tree(p, 0); }

void shard_ckpt_abort(shard_ckpt_writer *w)
{
    if (!w) return;
    if (w->staging) shard_remove_tree(w->staging);
    json_decref(w->extras);
    free(w->staging);
    free(w->final_dir);
    free(w);
}
