/* config.json of a supported family (libshard/model/families.c: Llama, Mistral,
 * Qwen2, Qwen3, GPT-NeoX) -> shard_model_desc; transformers 4's keys and 5's (rope_parameters,
 * dtype, layer_types) alike.
 *
 * Every field smp relies on is type- and range-checked. Settings that would change
 * the computation in a way smp does not implement are refused by name rather than
 * ignored (attention or MLP biases, other activations, other rope scalings,
 * quantized weights ...). */
#include "../core/internal.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONFIG_MAX_BYTES (16u << 20)
#define DIM_MAX (INT64_C(1) << 24)

typedef struct {
    const char *path;
    json_t *root;
} ctx;

/* config.json's torch_dtype names */
static const struct {
    const char *name;
    shard_dtype dt;
} TORCH_DTYPES[] = {{"float32", SHARD_DT_F32}, {"bfloat16", SHARD_DT_BF16}, {"float16", SHARD_DT_F16}, {"float64", SHARD_DT_F64}, {NULL, 0}};

const char *shard_torch_dtype_name(shard_dtype dt)
{
    for (int k = 0; TORCH_DTYPES[k].name; k++)
        if (TORCH_DTYPES[k].dt == dt) return TORCH_DTYPES[k].name;
    return NULL;
}

/* Integer field: missing -> def (or error when def < 0 means required). */
static shard_status get_int(ctx *c, json_t *obj, const char *key, int64_t def, int64_t lo, int64_t hi, int64_t *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (def == INT64_MIN) return shard_fail(SHARD_E_INVALID, "%s: \"%s\" is missing", c->path, key);
        *out = def;
        return SHARD_OK;
    }
    if (!json_is_integer(v)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\": expected an integer", c->path, key);
    int64_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return shard_fail(SHARD_E_INVALID, "%s: \"%s\" = %lld is out of range [%lld, %lld]", c->path, key, (long long)x, (long long)lo, (long long)hi);
    *out = x;
    return SHARD_OK;
}

static shard_status get_num(ctx *c, json_t *obj, const char *key, double def, double lo, double hi, double *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (isnan(def)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\" is missing", c->path, key);
        *out = def;
        return SHARD_OK;
    }
    if (!json_is_number(v)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\": expected a number", c->path, key);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\" = %g is out of range [%g, %g]", c->path, key, x, lo, hi);
    *out = x;
    return SHARD_OK;
}

static shard_status get_bool(ctx *c, const char *key, int def, int *out)
{
    json_t *v = json_object_get(c->root, key);
    if (!v || json_is_null(v)) { *out = def; return SHARD_OK; }
    if (!json_is_boolean(v)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\": expected true or false", c->path, key);
    *out = json_is_true(v);
    return SHARD_OK;
}

static shard_status refuse_true(ctx *c, const char *key, const char *why)
{
    int b;
    shard_status s = get_bool(c, key, 0, &b);
    if (s) return s;
    if (b) return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"%s\": true is not supported (%s)", c->path, key, why);
    return SHARD_OK;
}

#define TRY(x) do { shard_status s_ = (x); if (s_) return s_; } while (0)

/* RoPE: transformers < 5 writes "rope_theta" and "rope_scaling" (null for the default
 * rope); transformers >= 5 writes "rope_parameters" ({"rope_type", "rope_theta", and
 * the scaling's fields}). As transformers reads them: a non-null "rope_scaling" wins over
 * "rope_parameters", and a "rope_theta" inside the object over the top-level one. */
static json_t *rope_object(const ctx *c, const char **key)
{
    *key = "rope_scaling";
    json_t *rs = json_object_get(c->root, *key);
    if (!rs || json_is_null(rs)) {
        *key = "rope_parameters";
        rs = json_object_get(c->root, *key);
    }
    return rs;
}

/* YaRN (_compute_yarn_parameters): factor required; original_max_position_embeddings
 * from the config's top level where it has one (Phi-3's spelling, which transformers
 * prefers), else from the rope object, else max_position_embeddings; attention_factor,
 * mscale and mscale_all_dim as given (op_rope_scale resolves them); beta_fast and
 * beta_slow 0 or null for transformers' 32 and 1 (it reads them with `or`) */
static shard_status parse_yarn(ctx *c, ctx *sub, shard_model_desc *d)
{
    json_t *rs = sub->root;
    d->rope_type = SHARD_ROPE_YARN;
    TRY(get_num(sub, rs, "factor", NAN, 1e-6, 1e6, &d->rope_factor));
    json_t *top = json_object_get(c->root, "original_max_position_embeddings");
    ctx *from = top && !json_is_null(top) ? c : sub;
    TRY(get_int(from, from->root, "original_max_position_embeddings", d->max_positions, 1, DIM_MAX * 64,
                &d->rope_original_max_positions));
    TRY(get_num(sub, rs, "attention_factor", 0, 1e-6, 1e6, &d->rope_attention_factor));
    TRY(get_num(sub, rs, "mscale", 0, -1e6, 1e6, &d->rope_mscale));
    TRY(get_num(sub, rs, "mscale_all_dim", 0, -1e6, 1e6, &d->rope_mscale_all_dim));
    TRY(get_num(sub, rs, "beta_fast", 0, 0, 1e6, &d->rope_beta_fast));
    TRY(get_num(sub, rs, "beta_slow", 0, 0, 1e6, &d->rope_beta_slow));
    TRY(get_bool(sub, "truncate", 1, &d->rope_truncate));
    return SHARD_OK;
}

/* GPT-NeoX's transformers-4 keys: rotary_emb_base is its rope_theta */
static shard_status parse_rope(ctx *c, const shard_family *fam, shard_model_desc *d)
{
    const char *key;
    json_t *rs = rope_object(c, &key);
    if (rs && !json_is_null(rs) && !json_is_object(rs))
        return shard_fail(SHARD_E_INVALID, "%s: \"%s\": expected an object or null", c->path, key);
    TRY(get_num(c, c->root, "rope_theta", 10000.0, 1e-3, 1e30, &d->rope_theta));
    if (fam->fused_qkv) TRY(get_num(c, c->root, "rotary_emb_base", d->rope_theta, 1e-3, 1e30, &d->rope_theta));
    if (!json_is_object(rs)) return SHARD_OK;
    ctx sub = {c->path, rs};
    TRY(get_num(&sub, rs, "rope_theta", d->rope_theta, 1e-3, 1e30, &d->rope_theta));
    json_t *t = json_object_get(rs, "rope_type");
    if (!t) t = json_object_get(rs, "type");
    if (!t && strcmp(key, "rope_parameters") == 0) return SHARD_OK; /* transformers' default: "default" */
    if (!json_is_string(t)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\": \"rope_type\" missing or not a string", c->path, key);
    const char *type = json_string_value(t);
    if (strcmp(type, "default") == 0) return SHARD_OK;
    if (strcmp(type, "yarn") == 0) return parse_yarn(c, &sub, d);
    if (strcmp(type, "linear") == 0) {
        d->rope_type = SHARD_ROPE_LINEAR;
        return get_num(&sub, rs, "factor", NAN, 1e-6, 1e6, &d->rope_factor);
    }
    if (strcmp(type, "llama3") != 0)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"%s\": rope type \"%s\" is not supported (smp supports \"default\", "
                          "\"llama3\", \"yarn\" and \"linear\")", c->path, key, type);
    d->rope_type = SHARD_ROPE_LLAMA3;
    TRY(get_num(&sub, rs, "factor", NAN, 1e-6, 1e6, &d->rope_factor));
    TRY(get_num(&sub, rs, "low_freq_factor", NAN, 1e-6, 1e6, &d->rope_low_freq_factor));
    TRY(get_num(&sub, rs, "high_freq_factor", NAN, 1e-6, 1e6, &d->rope_high_freq_factor));
    TRY(get_int(&sub, rs, "original_max_position_embeddings", INT64_MIN, 1, DIM_MAX * 64, &d->rope_original_max_positions));
    if (d->rope_high_freq_factor <= d->rope_low_freq_factor)
        return shard_fail(SHARD_E_INVALID, "%s: \"%s\": high_freq_factor must exceed low_freq_factor", c->path, key);
    return SHARD_OK;
}

/* The rotary dims of a head: all of them, or GPT-NeoX's int(head_dim * fraction), the
 * fraction its "partial_rotary_factor" (transformers 5, in the rope object) or its
 * "rotary_pct" (transformers 4), 0.25 when neither is given (as transformers) */
static shard_status parse_rotary(ctx *c, const shard_family *fam, shard_model_desc *d)
{
    const char *key, *name = "rotary_pct";
    json_t *rs = rope_object(c, &key);
    double f = 1.0;
    if (fam->fused_qkv) TRY(get_num(c, c->root, name, 0.25, -1e30, 1e30, &f));
    if (json_is_object(rs) && json_object_get(rs, "partial_rotary_factor")) { /* it wins, as in transformers */
        ctx sub = {c->path, rs};
        name = "partial_rotary_factor";
        TRY(get_num(&sub, rs, name, f, -1e30, 1e30, &f));
    }
    if (!fam->fused_qkv && f != 1.0)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"%s\" = %g: a partial rotary embedding is not supported for %s",
                          c->path, name, f, fam->architecture);
    if (!(f > 0.0 && f <= 1.0)) return shard_fail(SHARD_E_INVALID, "%s: \"%s\" = %g is out of range (0, 1]", c->path, name, f);
    d->rotary_dim = (int64_t)((double)d->head_dim * f); /* Python's int(head_dim * f) */
    if (d->rotary_dim < 2 || d->rotary_dim % 2)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"%s\" = %g gives %lld rotary dims of head_dim %lld: an odd count "
                                               "or none is not supported (RoPE turns pairs)",
                          c->path, name, f, (long long)d->rotary_dim, (long long)d->head_dim);
    return SHARD_OK;
}

/* GPT-NeoX: one head size (hidden / heads) for q, k and v, biases on the attention
 * projections, and its residual form */
static shard_status parse_neox(ctx *c, shard_model_desc *d)
{
    if (d->kv_heads != d->heads)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"num_key_value_heads\" = %lld: GPT-NeoX has as many kv heads as query heads",
                          c->path, (long long)d->kv_heads);
    if (d->head_dim * d->heads != d->hidden)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"head_dim\" = %lld: GPT-NeoX's heads are hidden_size / num_attention_heads",
                          c->path, (long long)d->head_dim);
    int bias;
    TRY(get_bool(c, "attention_bias", 1, &bias));
    if (!bias)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"attention_bias\": false is not supported (smp's GPT-NeoX has biases on "
                                               "query_key_value and dense)", c->path);
    return get_bool(c, "use_parallel_residual", 1, &d->parallel_residual);
}

/* Mixture of experts: the experts, the top-k and its renormalization (Mixtral's
 * always, Qwen3-MoE's by norm_topk_prob), the load-balancing loss; Qwen3-MoE's dense
 * layers (mlp_only_layers, decoder_sparse_step) are refused by name */
static shard_status parse_moe(ctx *c, const shard_family *fam, shard_model_desc *d)
{
    json_t *r = c->root;
    const char *key = json_object_get(r, "num_local_experts") ? "num_local_experts" : "num_experts";
    TRY(get_int(c, r, key, INT64_MIN, 1, 4096, &d->experts));
    TRY(get_int(c, r, "num_experts_per_tok", 2, 1, d->experts, &d->experts_per_tok));
    d->moe_intermediate = d->intermediate;
    d->norm_topk_prob = 1;
    TRY(get_num(c, r, "router_aux_loss_coef", 0.001, 0.0, 1e6, &d->router_aux_loss_coef));
    TRY(get_bool(c, "output_router_logits", 0, &d->output_router_logits));
    double jitter;
    TRY(get_num(c, r, "router_jitter_noise", 0.0, 0.0, 1.0, &jitter));
    if (jitter != 0)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"router_jitter_noise\" = %g: router noise is not supported", c->path, jitter);
    if (fam->moe != 2) return SHARD_OK;
    TRY(get_int(c, r, "moe_intermediate_size", INT64_MIN, 1, DIM_MAX, &d->moe_intermediate));
    TRY(get_bool(c, "norm_topk_prob", 0, &d->norm_topk_prob));
    int64_t step;
    TRY(get_int(c, r, "decoder_sparse_step", 1, 1, 100000, &step));
    if (step != 1)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"decoder_sparse_step\" = %lld: dense layers between the sparse ones are "
                                               "not supported (every layer must be a mixture of experts)", c->path, (long long)step);
    json_t *dense = json_object_get(r, "mlp_only_layers");
    if (dense && !json_is_null(dense) && !json_is_array(dense))
        return shard_fail(SHARD_E_INVALID, "%s: \"mlp_only_layers\": expected a list", c->path);
    if (json_array_size(dense))
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"mlp_only_layers\" is not empty: dense layers among the experts' are "
                                               "not supported", c->path);
    return SHARD_OK;
}

/* The sliding window: Mistral's on every layer ("sliding_window"); the Qwen families'
 * only with "use_sliding_window" (then on layers from max_window_layers on, or as
 * "layer_types" says): refused by name. Elsewhere a window is refused. */
static shard_status parse_window(ctx *c, const shard_family *fam, shard_model_desc *d)
{
    json_t *r = c->root, *sw = json_object_get(r, "sliding_window"), *lt = json_object_get(r, "layer_types");
    int use = 0;
    TRY(get_bool(c, "use_sliding_window", 0, &use));
    if (use)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"use_sliding_window\": true (a window on some layers, from "
                                               "max_window_layers on) is not supported", c->path);
    for (size_t i = 0; fam->sliding_window != SHARD_WINDOW_ALL && json_is_array(lt) && i < json_array_size(lt); i++) {
        json_t *k = json_array_get(lt, i);
        if (!json_is_string(k)) return shard_fail(SHARD_E_INVALID, "%s: \"layer_types\": expected strings", c->path);
        if (strcmp(json_string_value(k), "full_attention"))
            return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"layer_types\"[%zu] \"%.40s\" is not supported (every layer "
                                                   "must be \"full_attention\")", c->path, i, json_string_value(k));
    }
    if (!sw || json_is_null(sw) || fam->sliding_window == SHARD_WINDOW_OPTIONAL)
        return SHARD_OK; /* the Qwen families keep a sliding_window that use_sliding_window leaves off */
    if (fam->sliding_window == SHARD_WINDOW_NONE)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"sliding_window\" is set but %s has no sliding-window attention",
                          c->path, fam->architecture);
    return get_int(c, r, "sliding_window", INT64_MIN, 1, INT64_C(1) << 40, &d->sliding_window);
}

/* a token id of the config, -1 when absent, null, or outside the vocabulary */
static int64_t token_id(const json_t *v, int64_t vocab)
{
    return json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < vocab ? json_integer_value(v) : -1;
}

static shard_status parse(ctx *c, shard_model_desc *d)
{
    memset(d, 0, sizeof *d);
    json_t *r = c->root;
    if (!json_is_object(r)) return shard_fail(SHARD_E_INVALID, "%s: not a JSON object", c->path);
    json_t *archs = json_object_get(r, "architectures");
    if (!json_is_array(archs) || json_array_size(archs) != 1 || !json_is_string(json_array_get(archs, 0)))
        return shard_fail(SHARD_E_INVALID, "%s: \"architectures\": expected a list of one name", c->path);
    const char *arch = json_string_value(json_array_get(archs, 0));
    const shard_family *fam = shard_family_of(arch);
    if (!fam)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: architecture \"%.60s\" is not supported (smp supports %s)", c->path, arch,
                          shard_family_names());
    const char *want_type = fam->model_type;
    snprintf(d->architecture, sizeof d->architecture, "%s", arch);
    json_t *mt = json_object_get(r, "model_type");
    if (!json_is_string(mt)) return shard_fail(SHARD_E_INVALID, "%s: \"model_type\" missing or not a string", c->path);
    if (strcmp(json_string_value(mt), want_type) != 0)
        return shard_fail(SHARD_E_INVALID, "%s: \"model_type\" is \"%.40s\" but the architecture %s needs \"%s\"", c->path, json_string_value(mt), arch, want_type);
    snprintf(d->model_type, sizeof d->model_type, "%s", want_type);

    TRY(get_int(c, r, "hidden_size", INT64_MIN, 1, DIM_MAX, &d->hidden));
    TRY(get_int(c, r, "intermediate_size", INT64_MIN, 1, DIM_MAX, &d->intermediate));
    TRY(get_int(c, r, "num_hidden_layers", INT64_MIN, 1, 100000, &d->layers));
    TRY(get_int(c, r, "num_attention_heads", INT64_MIN, 1, 65536, &d->heads));
    TRY(get_int(c, r, "num_key_value_heads", d->heads, 1, 65536, &d->kv_heads));
    TRY(get_int(c, r, "vocab_size", INT64_MIN, 1, INT64_C(1) << 31, &d->vocab));
    TRY(get_int(c, r, "max_position_embeddings", 2048, 1, INT64_C(1) << 40, &d->max_positions));
    if (d->heads % d->kv_heads)
        return shard_fail(SHARD_E_INVALID, "%s: num_attention_heads (%lld) is not a multiple of num_key_value_heads (%lld)", c->path, (long long)d->heads, (long long)d->kv_heads);
    json_t *hd = json_object_get(r, "head_dim");
    if (hd && !json_is_null(hd)) {
        TRY(get_int(c, r, "head_dim", INT64_MIN, 1, 65536, &d->head_dim));
    } else {
        if (d->hidden % d->heads)
            return shard_fail(SHARD_E_INVALID, "%s: hidden_size (%lld) is not a multiple of num_attention_heads (%lld) and no head_dim is given", c->path, (long long)d->hidden, (long long)d->heads);
        d->head_dim = d->hidden / d->heads;
    }
    if (d->head_dim % 2) return shard_fail(SHARD_E_INVALID, "%s: head_dim %lld is odd (RoPE needs pairs)", c->path, (long long)d->head_dim);
    TRY(get_num(c, r, fam->eps_key, fam->layer_norm ? 1e-5 : 1e-6, 1e-30, 1.0, &d->norm_eps));
    TRY(get_num(c, r, "initializer_range", 0.02, 0.0, 10.0, &d->initializer_range));
    TRY(get_bool(c, "tie_word_embeddings", 0, &d->tie_word_embeddings));
    TRY(parse_rope(c, fam, d));
    TRY(parse_rotary(c, fam, d));

    TRY(parse_window(c, fam, d));
    json_t *act = json_object_get(r, "hidden_act");
    if (act && !json_is_string(act)) return shard_fail(SHARD_E_INVALID, "%s: \"hidden_act\": expected a string", c->path);
    if (act && strcmp(json_string_value(act), fam->hidden_act) != 0)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"hidden_act\" \"%.40s\" is not supported (smp implements %s's MLP with \"%s\")",
                          c->path, json_string_value(act), fam->architecture, fam->hidden_act);
    d->qkv_bias = fam->qkv_bias; /* Qwen2's q, k, v always have biases (its config has no key) */
    d->qk_norm = fam->qk_norm;
    d->fused_qkv = fam->fused_qkv;
    d->linear_bias = fam->linear_bias;
    d->layer_norm = fam->layer_norm;
    d->gelu_mlp = fam->gelu_mlp;
    if (fam->fused_qkv) TRY(parse_neox(c, d));
    else if (!d->qkv_bias) TRY(refuse_true(c, "attention_bias", "smp's attention projections have no bias"));
    if (fam->moe) TRY(parse_moe(c, fam, d));
    if (!d->linear_bias) TRY(refuse_true(c, "mlp_bias", "smp's MLP projections have no bias"));
    if (json_object_get(r, "quantization_config"))
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"quantization_config\": quantized checkpoints are not supported", c->path);
    double drop = 0;
    TRY(get_num(c, r, "attention_dropout", 0.0, 0.0, 1.0, &drop));
    if (drop != 0) return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"attention_dropout\" = %g: dropout is not supported", c->path, drop);
    TRY(get_num(c, r, "hidden_dropout", 0.0, 0.0, 1.0, &drop));
    if (drop != 0) return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"hidden_dropout\" = %g: dropout is not supported", c->path, drop);
    /* the padding token (transformers zeroes its embedding row at initialization);
     * informational, so an unusual value is kept as "none" rather than refused */
    d->pad_token_id = token_id(json_object_get(r, "pad_token_id"), d->vocab);
    json_t *eos = json_object_get(r, "eos_token_id"); /* Llama 3: a list, the end of text first */
    d->eos_token_id = token_id(json_is_array(eos) ? json_array_get(eos, 0) : eos, d->vocab);
    int64_t ptp;
    TRY(get_int(c, r, "pretraining_tp", 1, 1, 1024, &ptp)); /* the same function split differently: accepted */

    json_t *dt = json_object_get(r, "torch_dtype");
    if (!dt || json_is_null(dt)) dt = json_object_get(r, "dtype"); /* transformers >= 5 */
    d->torch_dtype = SHARD_DT_INVALID;
    if (dt && !json_is_null(dt)) {
        if (!json_is_string(dt)) return shard_fail(SHARD_E_INVALID, "%s: \"torch_dtype\": expected a string", c->path);
        const char *n = json_string_value(dt);
        for (int k = 0; TORCH_DTYPES[k].name && d->torch_dtype == SHARD_DT_INVALID; k++)
            if (!strcmp(n, TORCH_DTYPES[k].name)) d->torch_dtype = TORCH_DTYPES[k].dt;
        if (d->torch_dtype == SHARD_DT_INVALID)
            return shard_fail(SHARD_E_UNSUPPORTED, "%s: \"torch_dtype\" \"%.40s\" is not supported", c->path, n);
    }
    return SHARD_OK;
}

shard_status shard_config_parse(const char *json, size_t len, const char *path, shard_model_desc *out)
{
    ctx c = {path, NULL};
    shard_status s = shard_json_parse(json, len, path, &c.root);
    if (s) return s;
    s = parse(&c, out);
    json_decref(c.root);
    return s;
}

shard_status shard_config_read(const char *path, shard_model_desc *out, char **text, size_t *len)
{
    shard_status s = shard_read_file(path, CONFIG_MAX_BYTES, text, len);
    if (s) { *text = NULL; return s; }
    if ((s = shard_config_parse(*text, *len, path, out))) { free(*text); *text = NULL; }
    return s;
}

shard_status shard_config_load(const char *path, shard_model_desc *out)
{
    char *text;
    size_t len;
    shard_status s = shard_config_read(path, out, &text, &len);
    free(text);
    return s;
}

/* ------------------------------------------------- the description as JSON */
/* The dimensions, by their config.json names: both JSON forms below have them. */
static const struct {
    const char *key;
    size_t off;
} DIMS[] = {
    {"hidden_size", offsetof(shard_model_desc, hidden)},
    {"intermediate_size", offsetof(shard_model_desc, intermediate)},
    {"num_hidden_layers", offsetof(shard_model_desc, layers)},
    {"num_attention_heads", offsetof(shard_model_desc, heads)},
    {"num_key_value_heads", offsetof(shard_model_desc, kv_heads)},
    {"head_dim", offsetof(shard_model_desc, head_dim)},
    {"vocab_size", offsetof(shard_model_desc, vocab)},
};

static void set_dims(json_t *o, const shard_model_desc *d)
{
    for (size_t k = 0; k < sizeof DIMS / sizeof DIMS[0]; k++)
        json_object_set_new(o, DIMS[k].key, json_integer(*(const int64_t *)((const char *)d + DIMS[k].off)));
}

/* a mixture of experts' sizes (nothing for a dense model) */
static void set_experts(json_t *o, const shard_model_desc *d)
{
    if (!d->experts) return;
    json_object_set_new(o, "num_local_experts", json_integer(d->experts));
    json_object_set_new(o, "num_experts_per_tok", json_integer(d->experts_per_tok));
    json_object_set_new(o, "moe_intermediate_size", json_integer(d->moe_intermediate));
}

json_t *shard_model_to_json(const shard_model_desc *d)
{
    json_t *o = json_object();
    json_object_set_new(o, "architecture", json_string(d->architecture));
    json_object_set_new(o, "model_type", json_string(d->model_type));
    set_dims(o, d);
    json_object_set_new(o, "tie_word_embeddings", json_boolean(d->tie_word_embeddings));
    set_experts(o, d);
    json_object_set_new(o, "parameters", json_integer((json_int_t)shard_model_param_count(d)));
    return o;
}

/* YaRN's rope object as transformers reads it back: the keys given (0s and truncate true left out) */
static json_t *yarn_json(const shard_model_desc *d)
{
    json_t *y = json_pack("{s:s,s:f,s:I}", "rope_type", "yarn", "factor", d->rope_factor,
                          "original_max_position_embeddings", (json_int_t)d->rope_original_max_positions);
    if (!d->rope_truncate) json_object_set_new(y, "truncate", json_false());
    const struct { const char *key; double v; } opt[] = {
        {"attention_factor", d->rope_attention_factor}, {"mscale", d->rope_mscale},
        {"mscale_all_dim", d->rope_mscale_all_dim}, {"beta_fast", d->rope_beta_fast}, {"beta_slow", d->rope_beta_slow}};
    for (size_t k = 0; k < sizeof opt / sizeof opt[0]; k++)
        if (opt[k].v != 0) json_object_set_new(y, opt[k].key, json_real(opt[k].v));
    return y;
}

void *shard_config_json(const shard_model_desc *d)
{
    json_t *o = json_object();
    set_dims(o, d);
    json_object_set_new(o, "max_position_embeddings", json_integer(d->max_positions));
    json_object_set_new(o, d->layer_norm ? "layer_norm_eps" : "rms_norm_eps", json_real(d->norm_eps));
    json_object_set_new(o, "rope_theta", json_real(d->rope_theta));
    if (d->rotary_dim != d->head_dim)
        json_object_set_new(o, "partial_rotary_factor", json_real((double)d->rotary_dim / (double)d->head_dim));
    if (d->fused_qkv) json_object_set_new(o, "use_parallel_residual", json_boolean(d->parallel_residual));
    set_experts(o, d);
    if (d->experts) {
        json_object_set_new(o, "norm_topk_prob", json_boolean(d->norm_topk_prob));
        json_object_set_new(o, "router_aux_loss_coef", json_real(d->router_aux_loss_coef));
        json_object_set_new(o, "output_router_logits", json_boolean(d->output_router_logits));
    }
    if (d->rope_type == SHARD_ROPE_LLAMA3)
        json_object_set_new(o, "rope_scaling", json_pack("{s:s,s:f,s:f,s:f,s:I}", "rope_type", "llama3", "factor", d->rope_factor,
                                                         "low_freq_factor", d->rope_low_freq_factor, "high_freq_factor",
                                                         d->rope_high_freq_factor, "original_max_position_embeddings",
                                                         (json_int_t)d->rope_original_max_positions));
    else if (d->rope_type == SHARD_ROPE_LINEAR)
        json_object_set_new(o, "rope_scaling", json_pack("{s:s,s:f}", "rope_type", "linear", "factor", d->rope_factor));
    else if (d->rope_type == SHARD_ROPE_YARN)
        json_object_set_new(o, "rope_scaling", yarn_json(d));
    else
        json_object_set_new(o, "rope_scaling", json_null());
    json_object_set_new(o, "tie_word_embeddings", json_boolean(d->tie_word_embeddings));
    json_object_set_new(o, "sliding_window", d->sliding_window ? json_integer(d->sliding_window) : json_null());
    const char *td = shard_torch_dtype_name(d->torch_dtype);
    json_object_set_new(o, "torch_dtype", td ? json_string(td) : json_null());
    return o;
}

/* ------------------------------------------- config.json for other weights */
/* p past JSON's whitespace */
static const char *skip_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

/* The value of `"key": "..."` in text, where the text names the key once (at any depth:
 * the caller checks what the edit does): [*at, *at + *n). 0 when the key is not there
 * exactly once in that form, or its value has escapes. */
static int find_string_value(const char *text, const char *key, size_t *at, size_t *n)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    const char *k = strstr(text, pat);
    if (!k || strstr(k + 1, pat)) return 0;
    const char *p = skip_ws(k + strlen(pat));
    if (*p++ != ':') return 0;
    p = skip_ws(p);
    if (*p++ != '"') return 0;
    const char *e = p;
    while (*e && *e != '"' && *e != '\\') e++;
    if (*e != '"') return 0;
    *at = (size_t)(p - text);
    *n = (size_t)(e - p);
    return 1;
}

/* text with one value replaced (malloc'd) */
static char *splice(const char *text, size_t at, size_t n, const char *v)
{
    size_t len = strlen(text), vl = strlen(v);
    char *o = malloc(len - n + vl + 1);
    if (!o) return NULL;
    memcpy(o, text, at);
    memcpy(o + at, v, vl);
    memcpy(o + at + vl, text + at + n, len - at - n + 1);
    return o;
}

/* The keys' values set to name by editing the text in place of each (so the rest
 * stays byte for byte as given), checked by parsing the result against want; NULL
 * where the text does not lend itself to that. */
static char *edit_in_place(const char *text, const char *const *keys, int nkeys, const char *name, const json_t *want)
{
    char *cur = strdup(text);
    for (int i = 0; i < nkeys && cur; i++) {
        size_t at, n;
        char *next = find_string_value(cur, keys[i], &at, &n) ? splice(cur, at, n, name) : NULL;
        free(cur);
        cur = next;
    }
    json_t *got = cur ? json_loads(cur, 0, NULL) : NULL;
    int same = got && json_equal(got, want);
    json_decref(got);
    if (!same) { free(cur); return NULL; }
    return cur;
}

shard_status shard_config_with_dtype(const char *json, shard_dtype dt, char **out)
{
    *out = NULL;
    const char *name = shard_torch_dtype_name(dt);
    json_t *root = json_loads(json, 0, NULL);
    if (!root || !json_is_object(root)) { json_decref(root); return shard_fail(SHARD_E_INVALID, "config.json: not a JSON object"); }
    /* transformers < 5 writes torch_dtype, 5 writes dtype: whichever the file has */
    const char *keys[2];
    int nkeys = 0;
    for (int k = 0; k < 2 && name; k++) {
        const char *key = k ? "dtype" : "torch_dtype";
        json_t *v = json_object_get(root, key);
        if (json_is_string(v) && strcmp(json_string_value(v), name)) {
            keys[nkeys++] = key;
            json_object_set_new(root, key, json_string(name));
        }
    }
    shard_status s = SHARD_OK;
    if (nkeys) {
        *out = edit_in_place(json, keys, nkeys, name, root);
        if (!*out) { /* the whole object again, transformers' indentation, the keys' order kept */
            char *d = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
            size_t l = d ? strlen(d) : 0;
            if (d && (*out = malloc(l + 2))) { memcpy(*out, d, l); memcpy(*out + l, "\n", 2); }
            free(d);
        }
        if (!*out) s = shard_fail(SHARD_E_NOMEM, "config.json: out of memory");
    }
    json_decref(root);
    return s;
}
