/* smp-merge: an SMP checkpoint of any layout -> a Hugging Face model folder
 * (config.json, safetensors weights with an index when split, the extra files),
 * ready for transformers.from_pretrained. */
#include "cli.h"
#include "progress.h"
#include "shard.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char HELP[] =
    "usage: smp-merge --in CKPT --out HF_DIR [--dtype keep|bf16|fp16|fp32] [--max-shard-size 5GB]\n"
    "                 [--threads N] [--no-fsync]\n"
    "\n"
    "Merge a checkpoint (any layout) into a Hugging Face model folder: config.json as it was\n"
    "given to hf2smp, the weights as safetensors (split into files of at most\n"
    "--max-shard-size, with model.safetensors.index.json, when larger), and the model\n"
    "folder's other files (tokenizer, generation config, ...). The folder appears only\n"
    "when whole (written under a temporary name, every file and the folder fsynced, then\n"
    "renamed). --no-fsync skips the fsyncs: the folder still appears only when whole, but\n"
    "is not yet safe from a power loss or an OS crash (scratch disks, a later `sync`).\n"
    "--threads N: threads that read, decompress and check the checkpoint's chunks\n"
    "(default: cores, <= 16).\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    uint64_t mul = 1;
    if (!strcmp(end, "") || !strcmp(end, "B")) mul = 1;
    else if (!strcmp(end, "KB")) mul = 1000;
    else if (!strcmp(end, "MB")) mul = 1000000;
    else if (!strcmp(end, "GB")) mul = 1000000000;
    else if (!strcmp(end, "KiB")) mul = 1024;
    else if (!strcmp(end, "MiB")) mul = 1 << 20;
    else if (!strcmp(end, "GiB")) mul = 1 << 30;
    else return -1;
    double b = v * (double)mul; /* nan, inf and sizes under one byte or over 2^62 are refused */
    if (!(b >= 1.0 && b <= 4.6e18)) return -1;
    *out = (uint64_t)b;
    return 0;
}

/* The weights are written by a thread of their own, one block behind the reads: while
 * it writes block i, the reader threads fill block i+1 (two buffers, one hand-off). */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    shard_st_writer *w;
    const void *buf;
    size_t n;
    int busy, quit;
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

static shard_status write_file(const char *path, const char *data, size_t len, const shard_write_opts *o)
{
    FILE *f = fopen(path, "wb");
    if (!f) return shard_fail(SHARD_E_IO, "%s: cannot create: %s", path, strerror(errno));
    int bad = fwrite(data, 1, len, f) != len;
    bad |= fflush(f) != 0 || (!o->no_fsync && fsync(fileno(f)) != 0);
    bad |= fclose(f) != 0;
    return bad ? shard_fail(SHARD_E_IO, "%s: write failed", path) : SHARD_OK;
}

int main(int argc, char **argv)
{
    cli_init("smp-merge");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    const char *in = NULL, *out = NULL, *dtype = "keep", *maxs = "5GB", *threads = NULL;
    shard_write_opts wo = {0};
    for (int i = 1; i < argc; i++) {
        const char **slot = NULL;
        if (!strcmp(argv[i], "--no-fsync")) { wo.no_fsync = 1; continue; }
        if (!strcmp(argv[i], "--in")) slot = &in;
        else if (!strcmp(argv[i], "--out")) slot = &out;
        else if (!strcmp(argv[i], "--dtype")) slot = &dtype;
        else if (!strcmp(argv[i], "--max-shard-size")) slot = &maxs;
        else if (!strcmp(argv[i], "--threads")) slot = &threads;
        else return cli_usage("unknown option %s", argv[i]);
        if (i + 1 >= argc) return cli_usage("%s needs a value", argv[i]);
        *slot = argv[++i];
    }
    if (!in || !out) return cli_usage("--in and --out are required");
    char out_buf[4096]; /* "export/" is the folder export */
    size_t ol = strlen(out);
    if (ol >= sizeof out_buf) return cli_usage("--out: path too long");
    memcpy(out_buf, out, ol + 1);
    while (ol > 1 && out_buf[ol - 1] == '/') out_buf[--ol] = 0;
    out = out_buf;
    int nthreads = threads ? cli_parse_threads(threads) : cli_default_threads();
    if (!nthreads) return cli_usage("--threads must be an integer in 1..64");
    shard_dtype force = SHARD_DT_INVALID;
    if (!strcmp(dtype, "bf16")) force = SHARD_DT_BF16;
    else if (!strcmp(dtype, "fp16")) force = SHARD_DT_F16;
    else if (!strcmp(dtype, "fp32")) force = SHARD_DT_F32;
    else if (strcmp(dtype, "keep")) return cli_usage("--dtype must be keep, bf16, fp16 or fp32");
    uint64_t max_bytes;
    if (parse_size(maxs, &max_bytes)) return cli_usage("--max-shard-size \"%s\": expected e.g. 5GB, 500MB, 200KB", maxs);
    struct stat st;
    if (stat(out, &st) == 0) { shard_fail(SHARD_E_USAGE, "%s: already exists (refusing to replace it)", out); return cli_fail(SHARD_E_USAGE); }

    double t0 = now_seconds();
    shard_ckpt *c;
    shard_status s = shard_ckpt_open(in, &c);
    if (s) return cli_fail(s);
    shard_ckpt_set_threads(c, nthreads);
    for (size_t i = 0; i < shard_ckpt_extra_count(c) && !s; i++) { /* none may stand in for the export's own files */
        const char *n = shard_ckpt_extra_at(c, i);
        size_t l = strlen(n);
        if (!strcmp(n, "config.json") || (l >= 12 && !strcmp(n + l - 12, ".safetensors")) || strstr(n, ".safetensors.index"))
            s = shard_fail(SHARD_E_INVALID, "%s/extra/%s: an extra file with the name of the export's own config or weights", in, n);
    }
    if (s) { shard_ckpt_close(c); return cli_fail(s); }
    const shard_model_desc *d = shard_ckpt_model(c);
    size_t nt = shard_model_tensor_count(d);
    /* plan the files: tensors in the model's order, a new file when the next would overflow */
    int *file_of = calloc(nt, sizeof *file_of);
    long *idx = calloc(nt, sizeof *idx);
    shard_dtype *dts = calloc(nt, sizeof *dts);
    uint64_t cur = 0, total = 0;
    int nfiles = 1;
    shard_tensor_spec t;
    for (size_t i = 0; i < nt && !s; i++) {
        shard_model_tensor(d, i, &t);
        idx[i] = shard_ckpt_find(c, "params", t.name);
        if (idx[i] < 0) { s = shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is missing", in, t.name); break; }
        const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(c, (size_t)idx[i]);
        dts[i] = force ? force : ct->dtype;
        uint64_t b = shard_dtype_size(dts[i]);
        for (int k = 0; k < ct->ndim; k++) b *= (uint64_t)ct->shape[k];
        if (cur > 0 && cur + b > max_bytes) { nfiles++; cur = 0; }
        cur += b;
        total += b;
        file_of[i] = nfiles - 1;
    }
    /* staging folder beside the output, renamed into place when whole */
    char *stage = malloc(strlen(out) + 64);
    sprintf(stage, "%s.tmp-%ld", out, (long)getpid());
    if (!s && mkdir(stage, 0755) != 0) s = shard_fail(SHARD_E_IO, "%s: cannot create: %s", stage, strerror(errno));
    progress pg;
    progress_start(&pg, "merging", total);
    void *buf[2] = {NULL, NULL};
    size_t cap = 0;
    int cur_buf = 0;
    behind wb = {.s = SHARD_OK};
    pthread_mutex_init(&wb.mu, NULL);
    pthread_cond_init(&wb.cv, NULL);
    int writer_started = !s && pthread_create(&wb.th, NULL, behind_main, &wb) == 0;
    if (!s && !writer_started) s = shard_fail(SHARD_E_NOMEM, "cannot start the writer thread");
    char path[4096], fname[128];
    for (int f = 0; f < nfiles && !s; f++) {
        if (nfiles == 1) snprintf(fname, sizeof fname, "model.safetensors");
        else snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", f + 1, nfiles);
        snprintf(path, sizeof path, "%s/%s", stage, fname);
        shard_st_writer *w;
        if ((s = shard_st_writer_create_opts(path, &wo, &w))) break;
        s = shard_st_writer_metadata(w, "format", "pt");
        for (size_t i = 0; i < nt && !s; i++) {
            if (file_of[i] != f) continue;
            const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(c, (size_t)idx[i]);
            s = shard_st_writer_declare(w, ct->name, dts[i], ct->ndim, ct->shape);
        }
        for (size_t i = 0; i < nt && !s; i++) {
            if (file_of[i] != f) continue;
            /* stream the tensor in blocks of whole rows of dim 0 (~32 MiB each) */
            const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(c, (size_t)idx[i]);
            shard_box blk = {.ndim = ct->ndim};
            uint64_t row = shard_dtype_size(dts[i]);
            for (int k = 1; k < ct->ndim; k++) { blk.len[k] = ct->shape[k]; row *= (uint64_t)ct->shape[k]; }
            int64_t rows = row ? (int64_t)((32u << 20) / row) : 1;
            if (rows < 1) rows = 1;
            size_t need = (size_t)(rows * (int64_t)row);
            if (need > cap) { /* both buffers free: the writer is done with them */
                if ((s = behind_wait(&wb))) break;
                for (int q = 0; q < 2; q++) { free(buf[q]); buf[q] = malloc(need ? need : 1); }
                cap = need;
            }
            if (!buf[0] || !buf[1]) { s = shard_fail(SHARD_E_NOMEM, "out of memory for tensor \"%s\"", ct->name); break; }
            for (int64_t r0 = 0; r0 < ct->shape[0] && !s; r0 += rows) {
                blk.off[0] = r0;
                blk.len[0] = ct->shape[0] - r0 < rows ? ct->shape[0] - r0 : rows;
                size_t nb = (size_t)blk.len[0] * (size_t)row;
                if (!(s = shard_ckpt_read(c, (size_t)idx[i], &blk, buf[cur_buf], dts[i]))) s = behind_write(&wb, w, buf[cur_buf], nb);
                cur_buf ^= 1;
                progress_add(&pg, nb);
            }
        }
        shard_status ws = behind_wait(&wb);
        if (!s) s = ws;
        if (s) shard_st_writer_abort(w);
        else s = shard_st_writer_finish(w);
    }
    if (writer_started) {
        pthread_mutex_lock(&wb.mu);
        wb.quit = 1;
        pthread_cond_broadcast(&wb.cv);
        pthread_mutex_unlock(&wb.mu);
        pthread_join(wb.th, NULL);
    }
    pthread_mutex_destroy(&wb.mu);
    pthread_cond_destroy(&wb.cv);
    free(buf[0]);
    free(buf[1]);
    progress_end(&pg);
    if (!s && nfiles > 1) {
        /* the index, as transformers writes it */
        size_t cap2 = 256 + nt * 400, k = 0;
        char *j = malloc(cap2);
        k += (size_t)snprintf(j + k, cap2 - k, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n", (unsigned long long)total);
        for (size_t i = 0; i < nt; i++) {
            shard_model_tensor(d, i, &t);
            k += (size_t)snprintf(j + k, cap2 - k, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", t.name, file_of[i] + 1, nfiles, i + 1 < nt ? "," : "");
        }
        k += (size_t)snprintf(j + k, cap2 - k, "  }\n}\n");
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", stage);
        s = write_file(path, j, k, &wo);
        free(j);
    }
    if (!s) {
        const char *cfg = shard_ckpt_config_json(c);
        snprintf(path, sizeof path, "%s/config.json", stage);
        s = write_file(path, cfg, strlen(cfg), &wo);
    }
    for (size_t i = 0; i < shard_ckpt_extra_count(c) && !s; i++) {
        snprintf(path, sizeof path, "%s/%s", stage, shard_ckpt_extra_at(c, i));
        s = shard_ckpt_copy_extra(c, i, path, &wo); /* checked as it is copied */
    }
    /* durable: the folder's entries before the rename, the rename itself after */
    if (!s && !wo.no_fsync) s = shard_fsync_dir(stage);
    if (!s && rename(stage, out) != 0) s = shard_fail(SHARD_E_IO, "%s: rename into place failed: %s", out, strerror(errno));
    else if (!s && !wo.no_fsync) s = shard_fsync_dir_of(out); /* failing, it leaves a whole folder, its rename not durable */
    if (s) shard_remove_tree(stage);
    free(stage); free(file_of); free(idx); free(dts);
    shard_ckpt_close(c);
    if (s) return cli_fail(s);
    fprintf(stderr, "%s: %s written in %.2fs (%d file%s)\n", cli_name(), out, now_seconds() - t0, nfiles, nfiles == 1 ? "" : "s");
    return 0;
}
