/* convert/merge.c: a checkpoint into a Hugging Face model folder (merge.h). The
 * tensors are read in blocks by the checkpoint's reader threads and written by a
 * thread of its own, one block behind. */
#include "merge.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static shard_status nomem(void) { return shard_fail(SHARD_E_NOMEM, "out of memory"); }

/* ------------------------------------------------------ the writer thread */
/* The weights are written by a thread of their own, one block behind the reads: while
 * it writes block i, the reader threads fill block i+1 (two buffers, one hand-off). */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    shard_st_writer *w;
    const void *buf;
    size_t n;
    int busy, quit, started;
    shard_status s;
    char msg[1024];
} behind;

static void *behind_main(void *arg)
{
    behind *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->busy && !b->quit) pthread_cond_wait(&b->cv, &b->mu);
        if (!b->busy) break;
        pthread_mutex_unlock(&b->mu);
        shard_status s = b->s ? b->s : shard_st_writer_write(b->w, b->buf, b->n);
        pthread_mutex_lock(&b->mu);
        if (s && !b->s) { b->s = s; snprintf(b->msg, sizeof b->msg, "%s", shard_errmsg()); }
        b->busy = 0;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static shard_status behind_start(behind *b)
{
    memset(b, 0, sizeof *b);
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    b->started = pthread_create(&b->th, NULL, behind_main, b) == 0;
    return b->started ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "cannot start the writer thread");
}

static void behind_stop(behind *b)
{
    if (b->started) {
        pthread_mutex_lock(&b->mu);
        b->quit = 1;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        pthread_join(b->th, NULL);
    }
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
}

/* Wait until the last block handed over is written; its status. */
static shard_status behind_wait(behind *b)
{
    pthread_mutex_lock(&b->mu);
    while (b->busy) pthread_cond_wait(&b->cv, &b->mu);
    shard_status s = b->s;
    pthread_mutex_unlock(&b->mu);
    return s ? shard_fail(s, "%s", b->msg) : SHARD_OK;
}

static shard_status behind_write(behind *b, shard_st_writer *w, const void *buf, size_t n)
{
    shard_status s = behind_wait(b);
    if (s) return s;
    pthread_mutex_lock(&b->mu);
    b->w = w;
    b->buf = buf;
    b->n = n;
    b->busy = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return SHARD_OK;
}

/* ---------------------------------------------------------------- a merge */
typedef struct {
    const merge_opts *o;
    const char *in, *out;
    shard_write_opts wo;
    shard_ckpt *c;
    const shard_model_desc *d;
    size_t nt;         /* the model's tensors, in its order */
    long *idx;         /* [nt] each one's index in the checkpoint */
    shard_dtype *dts;  /* [nt] its dtype in the export */
    int *file_of;      /* [nt] the weight file holding it */
    int nfiles;
    uint64_t total;
    char *stage;       /* the folder written, renamed to out when whole */
    behind wb;
    void *buf[2];      /* the blocks: one filled while the other is written */
    size_t cap;
    int cur;
} merge;

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* None of the extra files may stand in for the export's own files. */
static shard_status check_extra_names(const merge *m)
{
    for (size_t i = 0; i < shard_ckpt_extra_count(m->c); i++) {
        const char *n = shard_ckpt_extra_at(m->c, i);
        size_t l = strlen(n);
        if (!strcmp(n, "config.json") || (l >= 12 && !strcmp(n + l - 12, ".safetensors")) || strstr(n, ".safetensors.index"))
            return shard_fail(SHARD_E_INVALID, "%s/extra/%s: an extra file with the name of the export's own config or weights", m->in, n);
    }
    return SHARD_OK;
}

/* The files: tensors in the model's order, a new file when the next would overflow. */
static shard_status plan_files(merge *m)
{
    m->nt = shard_model_tensor_count(m->d);
    m->file_of = calloc(m->nt + 1, sizeof *m->file_of);
    m->idx = calloc(m->nt + 1, sizeof *m->idx);
    m->dts = calloc(m->nt + 1, sizeof *m->dts);
    if (!m->file_of || !m->idx || !m->dts) return nomem();
    uint64_t cur = 0;
    m->nfiles = 1;
    shard_tensor_spec t;
    for (size_t i = 0; i < m->nt; i++) {
        shard_model_tensor(m->d, i, &t);
        m->idx[i] = shard_ckpt_find(m->c, "params", t.name);
        if (m->idx[i] < 0) return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is missing", m->in, t.name);
        const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(m->c, (size_t)m->idx[i]);
        m->dts[i] = m->o->dtype != SHARD_DT_INVALID ? m->o->dtype : ct->dtype;
        uint64_t b = shard_dtype_size(m->dts[i]);
        for (int k = 0; k < ct->ndim; k++) b *= (uint64_t)ct->shape[k];
        if (cur > 0 && cur + b > m->o->max_file_bytes) { m->nfiles++; cur = 0; }
        cur += b;
        m->total += b;
        m->file_of[i] = m->nfiles - 1;
    }
    return SHARD_OK;
}

/* fp16 holds up to 65504: a wider value converted to it is inf, and a model with an
 * inf weight gives NaN. An export to fp16 is refused then (torch's .half() writes the
 * inf without a word). A tensor stored as fp16 is written as it is. */
static shard_status check_f16(const merge *m, const shard_ckpt_tensor *ct, size_t i, const void *buf, size_t nb)
{
    if (m->dts[i] != SHARD_DT_F16 || ct->dtype == SHARD_DT_F16) return SHARD_OK;
    const uint16_t *h = buf;
    size_t k = 0;
    while (k < nb / 2 && (h[k] & 0x7c00) != 0x7c00) k++; /* the first inf or NaN */
    if (k == nb / 2) return SHARD_OK;
    return shard_fail(SHARD_E_UNSUPPORTED, "%s: %s holds values beyond fp16's range (+-65504) or not finite, which fp16 "
                                           "would store as inf or NaN: export as bf16 or fp32 (--dtype)",
                      shard_ckpt_dir(m->c), ct->name);
}

/* Tensor i into w, streamed in blocks of whole rows of dim 0 (~32 MiB each). */
static shard_status write_tensor(merge *m, shard_st_writer *w, size_t i)
{
    const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(m->c, (size_t)m->idx[i]);
    const convert_progress *pg = &m->o->progress;
    shard_box blk = {.ndim = ct->ndim};
    uint64_t row = shard_dtype_size(m->dts[i]);
    for (int k = 1; k < ct->ndim; k++) { blk.len[k] = ct->shape[k]; row *= (uint64_t)ct->shape[k]; }
    int64_t rows = row ? (int64_t)((32u << 20) / row) : 1;
    if (rows < 1) rows = 1;
    size_t need = (size_t)(rows * (int64_t)row);
    shard_status s;
    if (need > m->cap) { /* both buffers free: the writer is done with them */
        if ((s = behind_wait(&m->wb))) return s;
        for (int q = 0; q < 2; q++) { free(m->buf[q]); m->buf[q] = malloc(need ? need : 1); }
        m->cap = need;
    }
    if (!m->buf[0] || !m->buf[1]) { m->cap = 0; return shard_fail(SHARD_E_NOMEM, "out of memory for tensor \"%s\"", ct->name); }
    s = SHARD_OK;
    for (int64_t r0 = 0; r0 < ct->shape[0] && !s; r0 += rows) {
        blk.off[0] = r0;
        blk.len[0] = ct->shape[0] - r0 < rows ? ct->shape[0] - r0 : rows;
        size_t nb = (size_t)blk.len[0] * (size_t)row;
        if (!(s = shard_ckpt_read(m->c, (size_t)m->idx[i], &blk, m->buf[m->cur], m->dts[i])) &&
            !(s = check_f16(m, ct, i, m->buf[m->cur], nb)))
            s = behind_write(&m->wb, w, m->buf[m->cur], nb);
        m->cur ^= 1;
        if (pg->add) pg->add(pg->ctx, nb);
    }
    return s;
}

/* Weight file f: its header (every tensor declared), then the tensors' data. */
static shard_status write_weight_file(merge *m, int f)
{
    char fname[128];
    if (m->nfiles == 1) snprintf(fname, sizeof fname, "model.safetensors");
    else snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", f + 1, m->nfiles);
    char *path = join(m->stage, fname);
    if (!path) return nomem();
    shard_st_writer *w;
    shard_status s = shard_st_writer_create_opts(path, &m->wo, &w);
    free(path);
    if (s) return s;
    s = shard_st_writer_metadata(w, "format", "pt");
    for (size_t i = 0; i < m->nt && !s; i++) {
        if (m->file_of[i] != f) continue;
        const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(m->c, (size_t)m->idx[i]);
        s = shard_st_writer_declare(w, ct->name, m->dts[i], ct->ndim, ct->shape);
    }
    for (size_t i = 0; i < m->nt && !s; i++)
        if (m->file_of[i] == f) s = write_tensor(m, w, i);
    shard_status ws = behind_wait(&m->wb);
    if (!s) s = ws;
    if (s) shard_st_writer_abort(w);
    else s = shard_st_writer_finish(w);
    return s;
}

static shard_status write_weights(merge *m)
{
    const convert_progress *pg = &m->o->progress;
    if (pg->start) pg->start(pg->ctx, m->total);
    shard_status s = behind_start(&m->wb);
    for (int f = 0; f < m->nfiles && !s; f++) s = write_weight_file(m, f);
    behind_stop(&m->wb);
    if (pg->end) pg->end(pg->ctx);
    return s;
}

static shard_status write_file(const char *dir, const char *name, const char *data, size_t len, const shard_write_opts *o)
{
    char *path = join(dir, name);
    if (!path) return nomem();
    FILE *f = fopen(path, "wb");
    shard_status s = SHARD_OK;
    if (!f) s = shard_fail(SHARD_E_IO, "%s: cannot create: %s", path, strerror(errno));
    else {
        int bad = fwrite(data, 1, len, f) != len;
        bad |= fflush(f) != 0 || (!o->no_fsync && fsync(fileno(f)) != 0);
        bad |= fclose(f) != 0;
        if (bad) s = shard_fail(SHARD_E_IO, "%s: write failed", path);
    }
    free(path);
    return s;
}

/* model.safetensors.index.json, as transformers writes it */
static shard_status write_index(const merge *m)
{
    size_t cap = 256 + m->nt * 400, k = 0; /* a line per tensor: its name (< 256) and file */
    char *j = malloc(cap);
    if (!j) return nomem();
    k += (size_t)snprintf(j + k, cap - k, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n", (unsigned long long)m->total);
    shard_tensor_spec t;
    for (size_t i = 0; i < m->nt; i++) {
        shard_model_tensor(m->d, i, &t);
        k += (size_t)snprintf(j + k, cap - k, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", t.name, m->file_of[i] + 1, m->nfiles,
                              i + 1 < m->nt ? "," : "");
    }
    k += (size_t)snprintf(j + k, cap - k, "  }\n}\n");
    shard_status s = write_file(m->stage, "model.safetensors.index.json", j, k, &m->wo);
    free(j);
    return s;
}

/* The one dtype of the exported weights (all of one float type), else INVALID. */
static shard_dtype export_dtype(const merge *m)
{
    shard_dtype dt = SHARD_DT_INVALID;
    for (size_t i = 0; i < m->nt; i++) {
        if (!shard_torch_dtype_name(m->dts[i]) || (dt != SHARD_DT_INVALID && m->dts[i] != dt)) return SHARD_DT_INVALID;
        dt = m->dts[i];
    }
    return dt;
}

/* config.json as it was given to hf2smp, its torch_dtype (or dtype) set to the weights'
 * where they are another type now (--dtype, or hf2smp's): loaders that take the
 * config's word for it (transformers' dtype="auto", its default since 5) then get the
 * weights as they are stored. */
static shard_status write_config(const merge *m)
{
    const char *cfg = shard_ckpt_config_json(m->c);
    char *edited = NULL;
    shard_status s = shard_config_with_dtype(cfg, export_dtype(m), &edited);
    if (s) return s; /* out of memory: the text was checked when the checkpoint was opened */
    const char *text = edited ? edited : cfg;
    s = write_file(m->stage, "config.json", text, strlen(text), &m->wo);
    free(edited);
    return s;
}

/* Beside the weights: the index, config.json, the extra files (checked as they are
 * copied); then the folder into place, durably: its entries before the rename, the
 * rename itself after. */
static shard_status finish(const merge *m)
{
    shard_status s = m->nfiles > 1 ? write_index(m) : SHARD_OK;
    if (!s) s = write_config(m);
    for (size_t i = 0; i < shard_ckpt_extra_count(m->c) && !s; i++) {
        char *path = join(m->stage, shard_ckpt_extra_at(m->c, i));
        s = path ? shard_ckpt_copy_extra(m->c, i, path, &m->wo) : nomem();
        free(path);
    }
    if (!s && !m->wo.no_fsync) s = shard_fsync_dir(m->stage);
    if (!s && rename(m->stage, m->out) != 0) return shard_fail(SHARD_E_IO, "%s: rename into place failed: %s", m->out, strerror(errno));
    if (!s && !m->wo.no_fsync) s = shard_fsync_dir_of(m->out); /* failing, it leaves a whole folder, its rename not durable */
    return s;
}

shard_status merge_run(const char *in, const char *out, const merge_opts *o, int *nfiles)
{
    shard_status s = shard_check_output(out, SHARD_OUT_NEW_DIR);
    if (s) return s;
    merge m = {.o = o, .in = in, .out = out, .wo = {o->no_fsync}};
    if ((s = shard_ckpt_open_any(in, &m.c))) return s;
    shard_ckpt_set_threads(m.c, o->threads);
    m.d = shard_ckpt_model(m.c);
    if (!(s = check_extra_names(&m))) s = plan_files(&m);
    /* the staging folder beside the output, renamed into place when whole */
    if (!s && !(m.stage = shard_staging_path(out))) s = nomem();
    if (!s) {
        if (mkdir(m.stage, 0755) != 0) {
            s = shard_fail(SHARD_E_IO, "%s: cannot create: %s", m.stage, strerror(errno));
            free(m.stage);
            m.stage = NULL;
        }
    }
    if (!s) s = write_weights(&m);
    if (!s) s = finish(&m);
    if (s && m.stage) shard_remove_tree(m.stage);
    *nfiles = m.nfiles;
    free(m.buf[0]);
    free(m.buf[1]);
    free(m.stage);
    free(m.file_of);
    free(m.idx);
    free(m.dts);
    shard_ckpt_close(m.c);
    return s;
}
