/* smp-inspect: what a model folder (or, later, an SMP checkpoint) holds. */
#include "cli.h"
#include "shard.h"

#include <dirent.h>
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
    "checkpoint (smp.json + shard files): layout, stages, tensors and their pieces,\n"
    "sizes per shard file, compression ratio and the training state.\n"
    "\n"
    "  --json     print the same as one JSON object\n"
    "  --help     this text\n"
    "  --version  version and backends\n"
    "\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Files of the folder that are neither weights nor config.json (tokenizer, ...). */
static size_t other_files(const char *dir, const shard_weights *w, char ***out)
{
    DIR *d = opendir(dir);
    size_t n = 0, cap = 0;
    char **v = NULL;
    if (!d) { *out = NULL; return 0; }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "config.json") || !strcmp(e->d_name, "model.safetensors.index.json")) continue;
        int weight = 0;
        for (size_t i = 0; i < shard_weights_file_count(w) && !weight; i++) {
            const char *p = shard_st_path(shard_weights_file_at(w, i));
            const char *base = strrchr(p, '/');
            weight = !strcmp(base ? base + 1 : p, e->d_name);
        }
        if (weight) continue;
        if (n == cap) { cap = cap ? 2 * cap : 8; v = realloc(v, cap * sizeof *v); }
        v[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(v, n, sizeof *v, cmp_str);
    *out = v;
    return n;
}

static const char *torch_dtype_name(shard_dtype dt)
{
    switch (dt) {
    case SHARD_DT_F32: return "float32";
    case SHARD_DT_BF16: return "bfloat16";
    case SHARD_DT_F16: return "float16";
    case SHARD_DT_F64: return "float64";
    default: return NULL;
    }
}

static int inspect_hf(const char *dir, int as_json)
{
    char cfg_path[4096];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    shard_model_desc d;
    shard_status s = shard_config_load(cfg_path, &d);
    if (s) return cli_fail(s);
    shard_weights *w;
    if ((s = shard_weights_open(dir, &w))) return cli_fail(s);
    if ((s = shard_model_check_weights(&d, w, dir))) { shard_weights_close(w); return cli_fail(s); }

    uint64_t params = shard_model_param_count(&d), bytes = 0;
    size_t per_dt[SHARD_DT_COUNT] = {0};
    uint64_t per_dt_bytes[SHARD_DT_COUNT] = {0};
    for (size_t i = 0; i < shard_weights_count(w); i++) {
        const shard_st_tensor *t = shard_weights_at(w, i);
        per_dt[t->dtype]++;
        per_dt_bytes[t->dtype] += t->nbytes;
        bytes += t->nbytes;
    }
    char **others;
    size_t nothers = other_files(dir, w, &others);

    if (as_json) {
        json_t *o = json_object(), *cfg = json_object(), *files = json_array(), *tensors = json_array(), *dts = json_object(), *of = json_array();
        json_object_set_new(o, "path", json_string(dir));
        json_object_set_new(o, "kind", json_string("hf"));
        json_object_set_new(o, "architecture", json_string(d.architecture));
        json_object_set_new(o, "model_type", json_string(d.model_type));
        json_object_set_new(cfg, "hidden_size", json_integer(d.hidden));
        json_object_set_new(cfg, "intermediate_size", json_integer(d.intermediate));
        json_object_set_new(cfg, "num_hidden_layers", json_integer(d.layers));
        json_object_set_new(cfg, "num_attention_heads", json_integer(d.heads));
        json_object_set_new(cfg, "num_key_value_heads", json_integer(d.kv_heads));
        json_object_set_new(cfg, "head_dim", json_integer(d.head_dim));
        json_object_set_new(cfg, "vocab_size", json_integer(d.vocab));
        json_object_set_new(cfg, "max_position_embeddings", json_integer(d.max_positions));
        json_object_set_new(cfg, "rms_norm_eps", json_real(d.rms_norm_eps));
        json_object_set_new(cfg, "rope_theta", json_real(d.rope_theta));
        if (d.rope_llama3)
            json_object_set_new(cfg, "rope_scaling", json_pack("{s:s,s:f,s:f,s:f,s:I}", "rope_type", "llama3", "factor", d.rope_factor,
                                                               "low_freq_factor", d.rope_low_freq_factor, "high_freq_factor", d.rope_high_freq_factor,
                                                               "original_max_position_embeddings", (json_int_t)d.rope_original_max_positions));
        else
            json_object_set_new(cfg, "rope_scaling", json_null());
        json_object_set_new(cfg, "tie_word_embeddings", json_boolean(d.tie_word_embeddings));
        json_object_set_new(cfg, "sliding_window", d.sliding_window ? json_integer(d.sliding_window) : json_null());
        const char *td = torch_dtype_name(d.torch_dtype);
        json_object_set_new(cfg, "torch_dtype", td ? json_string(td) : json_null());
        json_object_set_new(o, "config", cfg);
        json_object_set_new(o, "parameters", json_integer((json_int_t)params));
        json_object_set_new(o, "bytes", json_integer((json_int_t)bytes));
        for (int k = 1; k < SHARD_DT_COUNT; k++)
            if (per_dt[k]) json_object_set_new(dts, shard_dtype_name((shard_dtype)k), json_pack("{s:I,s:I}", "tensors", (json_int_t)per_dt[k], "bytes", (json_int_t)per_dt_bytes[k]));
        json_object_set_new(o, "dtypes", dts);
        for (size_t i = 0; i < shard_weights_file_count(w); i++) {
            const shard_st_file *f = shard_weights_file_at(w, i);
            const char *p = shard_st_path(f), *base = strrchr(p, '/');
            json_array_append_new(files, json_pack("{s:s,s:I,s:I}", "name", base ? base + 1 : p, "bytes", (json_int_t)shard_st_file_size(f), "tensors", (json_int_t)shard_st_count(f)));
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
        for (size_t i = 0; i < nothers; i++) json_array_append_new(of, json_string(others[i]));
        json_object_set_new(o, "other_files", of);
        json_dumpf(o, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
        fputc('\n', stdout);
        json_decref(o);
    } else {
        char b1[32], b2[32];
        printf("%s\n", dir);
        printf("  model        %s (%s)\n", d.architecture, d.model_type);
        printf("  parameters   %s (%s)\n", cli_count(b1, params),
               params >= 1e9 ? (snprintf(b2, 32, "%.2f B", params / 1e9), b2) : params >= 1e6 ? (snprintf(b2, 32, "%.2f M", params / 1e6), b2)
                                                                              : (snprintf(b2, 32, "%.1f K", params / 1e3), b2));
        printf("  layers       %lld    hidden %lld    intermediate %lld    vocab %lld\n", (long long)d.layers, (long long)d.hidden,
               (long long)d.intermediate, (long long)d.vocab);
        printf("  attention    %lld heads, %lld kv heads%s, head_dim %lld, sliding window %s\n", (long long)d.heads, (long long)d.kv_heads,
               d.kv_heads < d.heads ? " (GQA)" : "", (long long)d.head_dim, d.sliding_window ? cli_count(b1, (unsigned long long)d.sliding_window) : "none");
        printf("  rope         theta %g", d.rope_theta);
        if (d.rope_llama3)
            printf(", llama3 scaling (factor %g, low %g, high %g, original %lld)", d.rope_factor, d.rope_low_freq_factor, d.rope_high_freq_factor,
                   (long long)d.rope_original_max_positions);
        printf(", max positions %lld\n", (long long)d.max_positions);
        printf("  norm         RMSNorm, eps %g\n", d.rms_norm_eps);
        printf("  embeddings   %s\n", d.tie_word_embeddings ? "tied (lm_head shares model.embed_tokens)" : "untied");
        const char *td = torch_dtype_name(d.torch_dtype);
        printf("  torch_dtype  %s\n", td ? td : "(not set)");
        printf("  weights      %s in %zu tensor%s, %zu file%s%s\n", cli_bytes(b1, (double)bytes), shard_weights_count(w),
               shard_weights_count(w) == 1 ? "" : "s", shard_weights_file_count(w), shard_weights_file_count(w) == 1 ? "" : "s",
               shard_weights_indexed(w) ? " (model.safetensors.index.json)" : "");
        printf("  dtypes      ");
        for (int k = 1; k < SHARD_DT_COUNT; k++)
            if (per_dt[k]) printf(" %s: %zu tensors, %s;", shard_dtype_name((shard_dtype)k), per_dt[k], cli_bytes(b2, (double)per_dt_bytes[k]));
        printf("\n  files\n");
        for (size_t i = 0; i < shard_weights_file_count(w); i++) {
            const shard_st_file *f = shard_weights_file_at(w, i);
            const char *p = shard_st_path(f), *base = strrchr(p, '/');
            printf("    %-40s %10s  %zu tensors\n", base ? base + 1 : p, cli_bytes(b1, (double)shard_st_file_size(f)), shard_st_count(f));
        }
        if (nothers) {
            printf("  other files ");
            for (size_t i = 0; i < nothers; i++) printf(" %s", others[i]);
            printf("\n");
        }
    }
    for (size_t i = 0; i < nothers; i++) free(others[i]);
    free(others);
    shard_weights_close(w);
    return 0;
}

/* ---------------------------------------------------------- checkpoints */
typedef struct {
    const char *name;
    size_t index;
} named;

static int by_name(const void *a, const void *b) { return strcmp(((const named *)a)->name, ((const named *)b)->name); }

static int inspect_ckpt(const char *dir, int as_json)
{
    shard_ckpt *c;
    shard_status s = shard_ckpt_open(dir, &c);
    if (s) return cli_fail(s);
    const shard_model_desc *d = shard_ckpt_model(c);
    const shard_layout *l = shard_ckpt_layout(c);
    const int *st = shard_ckpt_stages(c);
    json_t *m = (json_t *)shard_ckpt_manifest_json(c);
    /* raw bytes of the pieces per shard file vs the files' sizes: the compression ratio */
    json_t *files = json_object_get(m, "files"), *tensors = json_object_get(m, "tensors");
    size_t nf = json_array_size(files);
    uint64_t *raw = calloc(nf + 1, 8), *npieces = calloc(nf + 1, 8), raw_total = 0, file_total = 0, extra_total = 0;
    named *by = malloc((nf + 1) * sizeof *by); /* the files by name: a lookup per piece, not a scan */
    if (!raw || !npieces || !by) { free(raw); free(npieces); free(by); shard_ckpt_close(c); return cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")); }
    size_t i, j;
    json_t *t, *p, *f;
    json_array_foreach(files, i, f) by[i] = (named){json_string_value(json_object_get(f, "name")), i};
    qsort(by, nf, sizeof *by, by_name);
    json_array_foreach(tensors, i, t) {
        size_t es = shard_dtype_size(shard_dtype_from_name(json_string_value(json_object_get(t, "dtype"))));
        json_array_foreach(json_object_get(t, "pieces"), j, p) {
            uint64_t n = es;
            size_t k;
            json_t *v;
            json_array_foreach(json_object_get(p, "shape"), k, v) n *= (uint64_t)json_integer_value(v);
            named key = {json_string_value(json_object_get(p, "file")), 0}, *hit = bsearch(&key, by, nf, sizeof *by, by_name);
            if (hit) { raw[hit->index] += n; npieces[hit->index]++; } /* shard_ckpt_open checked that it is listed */
            raw_total += n;
        }
    }
    json_array_foreach(files, i, f) {
        const char *fn = json_string_value(json_object_get(f, "name"));
        uint64_t b = (uint64_t)json_integer_value(json_object_get(f, "bytes"));
        if (!strncmp(fn, "extra/", 6)) extra_total += b; else file_total += b;
    }
    const char *tr = shard_ckpt_training_json(c);
    char lay[64];
    shard_layout_format(l, lay, sizeof lay);
    if (as_json) {
        json_t *o = json_object(), *fa = json_array();
        json_object_set_new(o, "path", json_string(dir));
        json_object_set_new(o, "kind", json_string("smp"));
        json_object_set_new(o, "format_version", json_integer(SHARD_FORMAT_VERSION));
        json_object_set_new(o, "architecture", json_string(d->architecture));
        json_object_set_new(o, "parameters", json_integer((json_int_t)shard_model_param_count(d)));
        json_object_set_new(o, "layout", json_pack("{s:i,s:i,s:i,s:i}", "pp", l->pp, "tp", l->tp, "cp", l->cp, "dp", l->dp));
        json_object_set_new(o, "stages", json_incref(json_object_get(m, "stages")));
        json_object_set_new(o, "tensors", json_incref(tensors));
        json_array_foreach(files, i, f) {
            json_t *e = json_deep_copy(f);
            if (strncmp(json_string_value(json_object_get(f, "name")), "extra/", 6)) {
                json_object_set_new(e, "raw_bytes", json_integer((json_int_t)raw[i]));
                json_object_set_new(e, "pieces", json_integer((json_int_t)npieces[i]));
            }
            json_array_append_new(fa, e);
        }
        json_object_set_new(o, "files", fa);
        json_object_set_new(o, "raw_bytes", json_integer((json_int_t)raw_total));
        json_object_set_new(o, "stored_bytes", json_integer((json_int_t)file_total));
        json_object_set_new(o, "compression_ratio", json_real(file_total ? (double)raw_total / (double)file_total : 0));
        json_object_set_new(o, "training", json_incref(json_object_get(m, "training")));
        json_dumpf(o, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
        fputc('\n', stdout);
        json_decref(o);
    } else {
        char b1[32], b2[32], b3[32];
        printf("%s  (SMP checkpoint, format version %d)\n", dir, SHARD_FORMAT_VERSION);
        printf("  model        %s, %s parameters, %lld layers\n", d->architecture, cli_count(b1, shard_model_param_count(d)), (long long)d->layers);
        printf("  layout       %s (%d ranks)\n", lay, shard_layout_size(l));
        printf("  stages      ");
        for (int k = 0; k < l->pp; k++) printf(" %d", st[k]);
        printf(" layers\n");
        printf("  size         %s of tensor data in %s of shard files (compression %.2fx), extra files %s\n", cli_bytes(b1, (double)raw_total),
               cli_bytes(b2, (double)file_total), file_total ? (double)raw_total / (double)file_total : 0.0, cli_bytes(b3, (double)extra_total));
        printf("  training     %s\n", tr ? tr : "none (weights only)");
        printf("  tensors\n    %-52s %-8s %-16s %s\n", "name", "dtype", "shape", "pieces");
        json_array_foreach(tensors, i, t) {
            char shape[256] = "["; /* SHARD_MAX_DIMS numbers of up to 20 digits fit */
            size_t k;
            json_t *v;
            json_array_foreach(json_object_get(t, "shape"), k, v)
                snprintf(shape + strlen(shape), sizeof shape - strlen(shape), k ? ", %lld" : "%lld", (long long)json_integer_value(v));
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "]");
            const char *g = json_string_value(json_object_get(t, "group"));
            char name[300];
            snprintf(name, sizeof name, "%s%s%s", strcmp(g, "params") ? g : "", strcmp(g, "params") ? "/" : "", json_string_value(json_object_get(t, "name")));
            printf("    %-52s %-8s %-16s %zu\n", name, json_string_value(json_object_get(t, "dtype")), shape, json_array_size(json_object_get(t, "pieces")));
        }
        printf("  files\n");
        json_array_foreach(files, i, f) {
            const char *fn = json_string_value(json_object_get(f, "name"));
            uint64_t b = (uint64_t)json_integer_value(json_object_get(f, "bytes"));
            if (strncmp(fn, "extra/", 6))
                printf("    %-40s %10s  %llu pieces, %s raw (%.2fx)\n", fn, cli_bytes(b1, (double)b), (unsigned long long)npieces[i],
                       cli_bytes(b2, (double)raw[i]), b ? (double)raw[i] / (double)b : 0.0);
            else
                printf("    %-40s %10s\n", fn, cli_bytes(b1, (double)b));
        }
    }
    free(raw);
    free(npieces);
    free(by);
    shard_ckpt_close(c);
    return 0;
}

int main(int argc, char **argv)
{
    cli_init("smp-inspect");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    const char *path = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) as_json = 1;
        else if (argv[i][0] == '-' && argv[i][1]) return cli_usage("unknown option %s", argv[i]);
        else if (path) return cli_usage("more than one PATH given");
        else path = argv[i];
    }
    if (!path) return cli_usage("missing PATH");
    struct stat st;
    if (stat(path, &st) != 0) { shard_fail(SHARD_E_INVALID, "%s: no such file or folder", path); return cli_fail(SHARD_E_INVALID); }
    if (!S_ISDIR(st.st_mode)) { shard_fail(SHARD_E_INVALID, "%s: not a folder", path); return cli_fail(SHARD_E_INVALID); }
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/config.json", path);
    if (stat(probe, &st) == 0) return inspect_hf(path, as_json);
    snprintf(probe, sizeof probe, "%s/smp.json", path);
    if (stat(probe, &st) == 0) return inspect_ckpt(path, as_json);
    shard_fail(SHARD_E_INVALID, "%s: neither a Hugging Face model folder (no config.json) nor an SMP checkpoint", path);
    return cli_fail(SHARD_E_INVALID);
}
