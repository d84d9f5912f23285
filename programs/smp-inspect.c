/* smp-inspect: what a model folder (or, later, an SMP checkpoint) holds. */
#include "cli.h"
#include "opts.h"
#include "shard.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char HELP[] =
    "usage: smp-inspect PATH [--json]\n"
    "\n"
    "Describe a Hugging Face model folder (config.json + safetensors weights):\n"
    "architecture, sizes, parameter count, dtypes, bytes and files; or an SMP\n"
    "checkpoint (smp.json + shard files; a run folder: the checkpoint its latest\n"
    "names): layout, stages, tensors and their pieces, sizes per shard file,\n"
    "compression ratio and the training state.\n"
    "\n"
    "  --json     print the same as one JSON object\n"
    "  --help     this text\n"
    "  --version  version and backends\n"
    "\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

static const char *base_name(const char *path)
{
    const char *b = strrchr(path, '/');
    return b ? b + 1 : path;
}

/* Files of the folder that are neither weights nor config.json (tokenizer, ...), sorted. */
static int other_file(const char *name, void *ctx)
{
    const shard_weights *w = ctx;
    if (name[0] == '.' || !strcmp(name, "config.json") || !strcmp(name, "model.safetensors.index.json")) return 0;
    for (size_t i = 0; i < shard_weights_file_count(w); i++)
        if (!strcmp(base_name(shard_st_path(shard_weights_file_at(w, i))), name)) return 0;
    return 1;
}

static shard_status other_files(const char *dir, const shard_weights *w, char ***out, size_t *count)
{
    shard_status s = shard_list_dir(dir, other_file, (void *)w, out, count);
    return s == SHARD_E_IO ? SHARD_OK : s; /* an unreadable folder has none to show */
}

/* ------------------------------------------------------- model folders */
typedef struct {
    const char *dir;
    shard_model_desc d;
    shard_weights *w;
    uint64_t params, bytes;
    size_t per_dt[SHARD_DT_COUNT];
    uint64_t per_dt_bytes[SHARD_DT_COUNT];
    char **others;
    size_t nothers;
} hf_info;

static void hf_json(const hf_info *h)
{
    const shard_weights *w = h->w;
    json_t *o = json_object(), *files = json_array(), *tensors = json_array(), *dts = json_object(), *of = json_array();
    json_object_set_new(o, "path", json_string(h->dir));
    json_object_set_new(o, "kind", json_string("hf"));
    json_object_set_new(o, "architecture", json_string(h->d.architecture));
    json_object_set_new(o, "model_type", json_string(h->d.model_type));
    json_object_set_new(o, "config", shard_config_json(&h->d));
    json_object_set_new(o, "parameters", json_integer((json_int_t)h->params));
    json_object_set_new(o, "bytes", json_integer((json_int_t)h->bytes));
    for (int k = 1; k < SHARD_DT_COUNT; k++)
        if (h->per_dt[k])
            json_object_set_new(dts, shard_dtype_name((shard_dtype)k),
                                json_pack("{s:I,s:I}", "tensors", (json_int_t)h->per_dt[k], "bytes", (json_int_t)h->per_dt_bytes[k]));
    json_object_set_new(o, "dtypes", dts);
    for (size_t i = 0; i < shard_weights_file_count(w); i++) {
        const shard_st_file *f = shard_weights_file_at(w, i);
        json_array_append_new(files, json_pack("{s:s,s:I,s:I}", "name", base_name(shard_st_path(f)), "bytes", (json_int_t)shard_st_file_size(f),
                                               "tensors", (json_int_t)shard_st_count(f)));
    }
    json_object_set_new(o, "files", files);
    json_object_set_new(o, "indexed", json_boolean(shard_weights_indexed(w)));
    for (size_t i = 0; i < shard_weights_count(w); i++) {
        const shard_st_tensor *t = shard_weights_at(w, i);
        json_t *sh = json_array();
        for (int k = 0; k < t->ndim; k++) json_array_append_new(sh, json_integer(t->shape[k]));
        json_array_append_new(tensors, json_pack("{s:s,s:s,s:o,s:I,s:s}", "name", t->name, "dtype", shard_dtype_name(t->dtype), "shape", sh,
                                                 "bytes", (json_int_t)t->nbytes, "file", shard_weights_file_of(w, i)));
    }
    json_object_set_new(o, "tensors", tensors);
    for (size_t i = 0; i < h->nothers; i++) json_array_append_new(of, json_string(h->others[i]));
    json_object_set_new(o, "other_files", of);
    json_dumpf(o, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
    fputc('\n', stdout);
    json_decref(o);
}

static void hf_text(const hf_info *h)
{
    const shard_model_desc *d = &h->d;
    const shard_weights *w = h->w;
    const uint64_t params = h->params;
    char b1[32], b2[32];
    printf("%s\n", h->dir);
    printf("  model        %s (%s)\n", d->architecture, d->model_type);
    printf("  parameters   %s (%s)\n", cli_count(b1, params),
           params >= 1e9 ? (snprintf(b2, 32, "%.2f B", params / 1e9), b2) : params >= 1e6 ? (snprintf(b2, 32, "%.2f M", params / 1e6), b2)
                                                                          : (snprintf(b2, 32, "%.1f K", params / 1e3), b2));
    printf("  layers       %lld    hidden %lld    intermediate %lld    vocab %lld\n", (long long)d->layers, (long long)d->hidden,
           (long long)d->intermediate, (long long)d->vocab);
    printf("  attention    %lld heads, %lld kv heads%s, head_dim %lld, sliding window %s\n", (long long)d->heads, (long long)d->kv_heads,
           d->kv_heads < d->heads ? " (GQA)" : "", (long long)d->head_dim, d->sliding_window ? cli_count(b1, (unsigned long long)d->sliding_window) : "none");
    if (d->experts)
        printf("  experts      %lld per layer, %lld per token%s, intermediate %lld each; load-balancing coef %g%s\n",
               (long long)d->experts, (long long)d->experts_per_tok, d->norm_topk_prob ? " (weights renormalized)" : "",
               (long long)d->moe_intermediate, d->router_aux_loss_coef,
               d->output_router_logits ? " (in the loss)" : " (reported, not trained: output_router_logits false)");
    printf("  rope         theta %g", d->rope_theta);
    if (d->rope_type == SHARD_ROPE_YARN)
        printf(", yarn scaling (factor %g, original %lld)", d->rope_factor, (long long)d->rope_original_max_positions);
    if (d->rope_type == SHARD_ROPE_LINEAR) printf(", linear scaling (factor %g)", d->rope_factor);
    if (d->rope_type == SHARD_ROPE_LLAMA3)
        printf(", llama3 scaling (factor %g, low %g, high %g, original %lld)", d->rope_factor, d->rope_low_freq_factor, d->rope_high_freq_factor,
               (long long)d->rope_original_max_positions);
    if (d->rotary_dim != d->head_dim) printf(", %lld of %lld dims rotated", (long long)d->rotary_dim, (long long)d->head_dim);
    printf(", max positions %lld\n", (long long)d->max_positions);
    printf("  norm         %s, eps %g\n", d->layer_norm ? "LayerNorm with bias" : "RMSNorm", d->norm_eps);
    printf("  block        %s%s%s\n", d->gelu_mlp ? "GELU MLP" : "SwiGLU MLP", d->linear_bias ? ", biases on every linear" : "",
           d->fused_qkv ? (d->parallel_residual ? ", fused qkv, parallel residual" : ", fused qkv, sequential residual") : "");
    printf("  embeddings   %s\n", d->tie_word_embeddings ? "tied (the head shares the embedding)" : "untied");
    const char *td = shard_torch_dtype_name(d->torch_dtype);
    printf("  torch_dtype  %s\n", td ? td : "(not set)");
    printf("  weights      %s in %zu tensor%s, %zu file%s%s\n", cli_bytes(b1, (double)h->bytes), shard_weights_count(w),
           shard_weights_count(w) == 1 ? "" : "s", shard_weights_file_count(w), shard_weights_file_count(w) == 1 ? "" : "s",
           shard_weights_indexed(w) ? " (model.safetensors.index.json)" : "");
    printf("  dtypes      ");
    for (int k = 1; k < SHARD_DT_COUNT; k++)
        if (h->per_dt[k]) printf(" %s: %zu tensors, %s;", shard_dtype_name((shard_dtype)k), h->per_dt[k], cli_bytes(b2, (double)h->per_dt_bytes[k]));
    printf("\n  files\n");
    for (size_t i = 0; i < shard_weights_file_count(w); i++) {
        const shard_st_file *f = shard_weights_file_at(w, i);
        printf("    %-40s %10s  %zu tensors\n", base_name(shard_st_path(f)), cli_bytes(b1, (double)shard_st_file_size(f)), shard_st_count(f));
    }
    if (h->nothers) {
        printf("  other files ");
        for (size_t i = 0; i < h->nothers; i++) printf(" %s", h->others[i]);
        printf("\n");
    }
}

static int inspect_hf(const char *dir, int as_json)
{
    char cfg_path[4096];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    hf_info h = {.dir = dir};
    shard_status s = shard_config_load(cfg_path, &h.d);
    if (!s) s = shard_weights_open(dir, &h.w);
    if (!s) s = shard_model_check_weights(&h.d, h.w, dir);
    if (!s) s = other_files(dir, h.w, &h.others, &h.nothers);
    if (s) { shard_weights_close(h.w); return cli_fail(s); }
    h.params = shard_model_param_count(&h.d);
    for (size_t i = 0; i < shard_weights_count(h.w); i++) {
        const shard_st_tensor *t = shard_weights_at(h.w, i);
        h.per_dt[t->dtype]++;
        h.per_dt_bytes[t->dtype] += t->nbytes;
        h.bytes += t->nbytes;
    }
    if (as_json) hf_json(&h);
    else hf_text(&h);
    shard_free_names(h.others, h.nothers);
    shard_weights_close(h.w);
    return 0;
}

/* ---------------------------------------------------------- checkpoints */
typedef struct {
    const char *name;
    size_t index;
} named;

static int by_name(const void *a, const void *b) { return strcmp(((const named *)a)->name, ((const named *)b)->name); }

/* A checkpoint's manifest and, per shard file, its pieces and their raw bytes (vs the
 * files' sizes: the compression ratio). */
typedef struct {
    const char *dir;
    shard_ckpt *c;
    json_t *m, *files, *tensors;
    uint64_t *raw, *npieces; /* per entry of files */
    uint64_t raw_total, file_total, extra_total;
} ckpt_info;

static shard_status ckpt_sizes(ckpt_info *k)
{
    const size_t nf = json_array_size(k->files);
    k->raw = calloc(nf + 1, 8);
    k->npieces = calloc(nf + 1, 8);
    named *by = malloc((nf + 1) * sizeof *by); /* the files by name: a lookup per piece, not a scan */
    if (!k->raw || !k->npieces || !by) { free(by); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    size_t i, j;
    json_t *t, *p, *f;
    json_array_foreach(k->files, i, f) by[i] = (named){json_string_value(json_object_get(f, "name")), i};
    qsort(by, nf, sizeof *by, by_name);
    json_array_foreach(k->tensors, i, t) {
        size_t es = shard_dtype_size(shard_dtype_from_name(json_string_value(json_object_get(t, "dtype"))));
        json_array_foreach(json_object_get(t, "pieces"), j, p) {
            uint64_t n = es;
            size_t q;
            json_t *v;
            json_array_foreach(json_object_get(p, "shape"), q, v) n *= (uint64_t)json_integer_value(v);
            named key = {json_string_value(json_object_get(p, "file")), 0}, *hit = bsearch(&key, by, nf, sizeof *by, by_name);
            if (hit) { k->raw[hit->index] += n; k->npieces[hit->index]++; } /* shard_ckpt_open checked that it is listed */
            k->raw_total += n;
        }
    }
    free(by);
    json_array_foreach(k->files, i, f) {
        uint64_t b = (uint64_t)json_integer_value(json_object_get(f, "bytes"));
        if (!strncmp(json_string_value(json_object_get(f, "name")), "extra/", 6)) k->extra_total += b;
        else k->file_total += b;
    }
    return SHARD_OK;
}

static double ratio(uint64_t raw, uint64_t stored) { return stored ? (double)raw / (double)stored : 0.0; }

static void ckpt_json(const ckpt_info *k)
{
    const shard_model_desc *d = shard_ckpt_model(k->c);
    const shard_layout *l = shard_ckpt_layout(k->c);
    json_t *o = json_object(), *fa = json_array(), *f;
    json_object_set_new(o, "path", json_string(k->dir));
    json_object_set_new(o, "kind", json_string("smp"));
    json_object_set_new(o, "format_version", json_incref(json_object_get(k->m, "version"))); /* the reader checked it */
    json_object_set_new(o, "architecture", json_string(d->architecture));
    json_object_set_new(o, "parameters", json_integer((json_int_t)shard_model_param_count(d)));
    json_object_set_new(o, "layout", json_pack("{s:i,s:i,s:i,s:i,s:i}", "pp", l->pp, "tp", l->tp, "cp", l->cp, "dp", l->dp,
                                               "ep", shard_layout_ep(l)));
    if (d->experts) json_object_set_new(o, "experts_per_rank", json_integer(d->experts / shard_layout_ep(l)));
    json_object_set_new(o, "stages", json_incref(json_object_get(k->m, "stages")));
    json_object_set_new(o, "tensors", json_incref(k->tensors));
    size_t i;
    json_array_foreach(k->files, i, f) {
        json_t *e = json_deep_copy(f);
        if (strncmp(json_string_value(json_object_get(f, "name")), "extra/", 6)) {
            json_object_set_new(e, "raw_bytes", json_integer((json_int_t)k->raw[i]));
            json_object_set_new(e, "pieces", json_integer((json_int_t)k->npieces[i]));
        }
        json_array_append_new(fa, e);
    }
    json_object_set_new(o, "files", fa);
    json_object_set_new(o, "raw_bytes", json_integer((json_int_t)k->raw_total));
    json_object_set_new(o, "stored_bytes", json_integer((json_int_t)k->file_total));
    json_object_set_new(o, "compression_ratio", json_real(ratio(k->raw_total, k->file_total)));
    json_object_set_new(o, "training", json_incref(json_object_get(k->m, "training")));
    json_dumpf(o, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
    fputc('\n', stdout);
    json_decref(o);
}

/* a tensor's name as listed: "group/name", params without their group */
static const char *display_name(const json_t *t, char *buf, size_t cap)
{
    const char *g = json_string_value(json_object_get(t, "group"));
    const int params = !strcmp(g, "params");
    snprintf(buf, cap, "%s%s%s", params ? "" : g, params ? "" : "/", json_string_value(json_object_get(t, "name")));
    return buf;
}

static void ckpt_text(const ckpt_info *k)
{
    const shard_model_desc *d = shard_ckpt_model(k->c);
    const shard_layout *l = shard_ckpt_layout(k->c);
    const char *tr = shard_ckpt_training_json(k->c);
    char b1[32], b2[32], b3[32], lay[64];
    printf("%s  (SMP checkpoint, format version %lld)\n", k->dir, (long long)json_integer_value(json_object_get(k->m, "version")));
    printf("  model        %s, %s parameters, %lld layers\n", d->architecture, cli_count(b1, shard_model_param_count(d)), (long long)d->layers);
    printf("  layout       %s (%d ranks)\n", shard_layout_format(l, lay, sizeof lay), shard_layout_size(l));
    if (d->experts)
        printf("  experts      %lld per layer, %lld per rank (ep=%d: ep rank i holds experts [i*%lld, (i+1)*%lld))\n",
               (long long)d->experts, (long long)d->experts / shard_layout_ep(l), shard_layout_ep(l),
               (long long)d->experts / shard_layout_ep(l), (long long)d->experts / shard_layout_ep(l));
    printf("  stages      ");
    for (int q = 0; q < l->pp; q++) printf(" %d", shard_ckpt_stages(k->c)[q]);
    printf(" layers\n");
    printf("  size         %s of tensor data in %s of shard files (compression %.2fx), extra files %s\n", cli_bytes(b1, (double)k->raw_total),
           cli_bytes(b2, (double)k->file_total), ratio(k->raw_total, k->file_total), cli_bytes(b3, (double)k->extra_total));
    printf("  training     %s\n", tr ? tr : "none (weights only)");
    size_t i;
    json_t *t, *f;
    char name[300];
    int w = 4; /* the name column: as wide as the longest name (the optimizer's are long) */
    json_array_foreach(k->tensors, i, t) {
        const int n = (int)strlen(display_name(t, name, sizeof name));
        if (n > w) w = n;
    }
    printf("  tensors\n    %-*s %-8s %-16s %s\n", w, "name", "dtype", "shape", "pieces");
    json_array_foreach(k->tensors, i, t) {
        char shape[256] = "["; /* SHARD_MAX_DIMS numbers of up to 20 digits fit */
        size_t q;
        json_t *v;
        json_array_foreach(json_object_get(t, "shape"), q, v)
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), q ? ", %lld" : "%lld", (long long)json_integer_value(v));
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "]");
        printf("    %-*s %-8s %-16s %zu\n", w, display_name(t, name, sizeof name),
               json_string_value(json_object_get(t, "dtype")), shape, json_array_size(json_object_get(t, "pieces")));
    }
    printf("  files\n");
    json_array_foreach(k->files, i, f) {
        const char *fn = json_string_value(json_object_get(f, "name"));
        uint64_t b = (uint64_t)json_integer_value(json_object_get(f, "bytes"));
        if (strncmp(fn, "extra/", 6))
            printf("    %-40s %10s  %llu pieces, %s raw (%.2fx)\n", fn, cli_bytes(b1, (double)b), (unsigned long long)k->npieces[i],
                   cli_bytes(b2, (double)k->raw[i]), ratio(k->raw[i], b));
        else
            printf("    %-40s %10s\n", fn, cli_bytes(b1, (double)b));
    }
}

static int inspect_ckpt(const char *dir, int as_json)
{
    ckpt_info k = {0};
    shard_status s = shard_ckpt_open_any(dir, &k.c);
    if (s) return cli_fail(s);
    k.dir = shard_ckpt_dir(k.c); /* a run folder's: the checkpoint its latest names */
    k.m = (json_t *)shard_ckpt_manifest_json(k.c);
    k.files = json_object_get(k.m, "files");
    void *ts = NULL;
    s = shard_ckpt_manifest_tensors(k.c, &ts); /* the reader keeps no JSON of them */
    k.tensors = ts;
    if (!s && !(s = ckpt_sizes(&k))) {
        if (as_json) ckpt_json(&k);
        else ckpt_text(&k);
    }
    free(k.raw);
    free(k.npieces);
    json_decref(k.tensors);
    shard_ckpt_close(k.c);
    return s ? cli_fail(s) : 0;
}

int main(int argc, char **argv)
{
    cli_init("smp-inspect");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    static const cli_opt opts[] = {{"--json", 1}};
    const char *json, *pos[2];
    int npos, rc = cli_parse(argc, argv, 1, opts, 1, &json, pos, 2, &npos);
    if (rc) return rc;
    if (npos == 0) return cli_usage("missing PATH");
    if (npos > 1) return cli_usage("more than one PATH given");
    const char *path = pos[0];
    const int as_json = json != NULL;
    struct stat st;
    if (stat(path, &st) != 0) { shard_fail(SHARD_E_INVALID, "%s: no such file or folder", path); return cli_fail(SHARD_E_INVALID); }
    if (!S_ISDIR(st.st_mode)) { shard_fail(SHARD_E_INVALID, "%s: not a folder", path); return cli_fail(SHARD_E_INVALID); }
    char probe[4096];
    /* lstat: a link, even to nothing, is the folder's kind, refused by the reader */
    snprintf(probe, sizeof probe, "%s/config.json", path);
    if (lstat(probe, &st) == 0) return inspect_hf(path, as_json);
    snprintf(probe, sizeof probe, "%s/smp.json", path);
    const int ckpt = lstat(probe, &st) == 0;
    snprintf(probe, sizeof probe, "%s/latest", path);
    if (ckpt || lstat(probe, &st) == 0) return inspect_ckpt(path, as_json);
    shard_fail(SHARD_E_INVALID, "%s: neither a Hugging Face model folder (no config.json) nor an SMP checkpoint or run folder",
               path);
    return cli_fail(SHARD_E_INVALID);
}
