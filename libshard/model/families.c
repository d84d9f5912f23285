/* The model families smp trains, as data: each family's architecture name, its
 * layer tensors by their Hugging Face names and roles, and what sets it apart; and
 * the check of a model folder against them. The shape of every role, and how each
 * role is split over tensor-parallel ranks, are the role table of partition.c. */
#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ATT "model.layers.%d.self_attn."
#define LLAMA_LAYER \
    {"model.layers.%d.input_layernorm.weight", SHARD_T_NORM_ATTN}, {ATT "q_proj.weight", SHARD_T_Q}, \
    {ATT "k_proj.weight", SHARD_T_K}, {ATT "v_proj.weight", SHARD_T_V}, {ATT "o_proj.weight", SHARD_T_O}, \
    {"model.layers.%d.post_attention_layernorm.weight", SHARD_T_NORM_MLP}, \
    {"model.layers.%d.mlp.gate_proj.weight", SHARD_T_GATE}, {"model.layers.%d.mlp.up_proj.weight", SHARD_T_UP}, \
    {"model.layers.%d.mlp.down_proj.weight", SHARD_T_DOWN}

static const shard_layer_tensor LLAMA[] = {LLAMA_LAYER};
/* Qwen2: biases on q, k and v (not o) */
static const shard_layer_tensor QWEN2[] = {LLAMA_LAYER, {ATT "q_proj.bias", SHARD_T_Q_BIAS},
                                           {ATT "k_proj.bias", SHARD_T_K_BIAS}, {ATT "v_proj.bias", SHARD_T_V_BIAS}};
/* Qwen3: RMSNorm over head_dim of each query and key head, before RoPE */
static const shard_layer_tensor QWEN3[] = {LLAMA_LAYER, {ATT "q_norm.weight", SHARD_T_Q_NORM},
                                           {ATT "k_norm.weight", SHARD_T_K_NORM}};
#define N_OF(a) (sizeof a / sizeof a[0])

static const shard_family FAMILIES[] = {
    {"LlamaForCausalLM", "llama", LLAMA, N_OF(LLAMA), SHARD_WINDOW_NONE, 0, 0},
    {"MistralForCausalLM", "mistral", LLAMA, N_OF(LLAMA), SHARD_WINDOW_ALL, 0, 0},
    {"Qwen2ForCausalLM", "qwen2", QWEN2, N_OF(QWEN2), SHARD_WINDOW_OPTIONAL, 1, 0},
    {"Qwen3ForCausalLM", "qwen3", QWEN3, N_OF(QWEN3), SHARD_WINDOW_OPTIONAL, 0, 1},
};

const shard_family *shard_family_of(const char *architecture)
{
    for (size_t i = 0; i < N_OF(FAMILIES); i++)
        if (!strcmp(FAMILIES[i].architecture, architecture)) return &FAMILIES[i];
    return NULL;
}

const char *shard_family_names(void)
{
    static char names[256]; /* "A, B and C", from the table */
    if (!names[0])
        for (size_t i = 0, k = 0; i < N_OF(FAMILIES) && k < sizeof names; i++)
            k += (size_t)snprintf(names + k, sizeof names - k, "%s%s", i == 0 ? "" : i + 1 < N_OF(FAMILIES) ? ", " : " and ",
                                  FAMILIES[i].architecture);
    return names;
}

/* d's family; its architecture was checked when it was parsed (Llama's otherwise) */
static const shard_family *family(const shard_model_desc *d)
{
    const shard_family *f = shard_family_of(d->architecture);
    return f ? f : &FAMILIES[0];
}

size_t shard_model_tensor_count(const shard_model_desc *d)
{
    return 2 + (size_t)d->layers * family(d)->nlayer + (d->tie_word_embeddings ? 0 : 1);
}

void shard_model_tensor(const shard_model_desc *d, size_t i, shard_tensor_spec *o)
{
    memset(o, 0, sizeof *o);
    const shard_family *f = family(d);
    const size_t nl = (size_t)d->layers * f->nlayer;
    o->layer = -1;
    if (i == 0) {
        snprintf(o->name, sizeof o->name, "model.embed_tokens.weight");
        o->role = SHARD_T_EMBED;
    } else if (i <= nl) {
        const shard_layer_tensor *t = &f->layer[(i - 1) % f->nlayer];
        o->layer = (int)((i - 1) / f->nlayer);
        o->role = t->role;
        snprintf(o->name, sizeof o->name, t->fmt, o->layer);
    } else if (i == nl + 1) {
        snprintf(o->name, sizeof o->name, "model.norm.weight");
        o->role = SHARD_T_NORM_FINAL;
    } else {
        snprintf(o->name, sizeof o->name, "lm_head.weight");
        o->role = SHARD_T_HEAD;
    }
    o->ndim = shard_role_shape(d, o->role, o->shape);
}

uint64_t shard_model_param_count(const shard_model_desc *d)
{
    uint64_t n = 0;
    shard_tensor_spec t;
    for (size_t i = 0; i < shard_model_tensor_count(d); i++) {
        shard_model_tensor(d, i, &t);
        uint64_t e = 1;
        for (int k = 0; k < t.ndim; k++) e *= (uint64_t)t.shape[k];
        n += e;
    }
    return n;
}

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++) k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static int is_derived_buffer(const char *name)
{
    const char *s = strstr(name, ".self_attn.rotary_emb.inv_freq");
    return s && strncmp(name, "model.layers.", 13) == 0 && s[strlen(".self_attn.rotary_emb.inv_freq")] == 0;
}

shard_status shard_model_check_weights(const shard_model_desc *d, const shard_weights *w, const char *dir)
{
    size_t n = shard_model_tensor_count(d), matched = 0;
    shard_tensor_spec t;
    char a[96], b[96];
    for (size_t i = 0; i < n; i++) {
        shard_model_tensor(d, i, &t);
        const shard_st_tensor *st = shard_weights_find(w, t.name);
        if (!st) return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is missing from the weights", dir, t.name);
        int same = st->ndim == t.ndim;
        for (int k = 0; same && k < t.ndim; k++) same = st->shape[k] == t.shape[k];
        if (!same) {
            fmt_shape(a, sizeof a, st->ndim, st->shape);
            fmt_shape(b, sizeof b, t.ndim, t.shape);
            return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" has shape %s but config.json implies %s", dir, t.name, a, b);
        }
        if (!shard_dtype_is_float(st->dtype))
            return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" has dtype %s; weights must be floating point", dir, t.name, shard_dtype_name(st->dtype));
        matched++;
    }
    for (size_t i = 0; i < shard_weights_count(w); i++) {
        const shard_st_tensor *st = shard_weights_at(w, i);
        if (is_derived_buffer(st->name)) continue;
        if (d->tie_word_embeddings && strcmp(st->name, "lm_head.weight") == 0) {
            const shard_st_tensor *e = shard_weights_find(w, "model.embed_tokens.weight");
            if (st->ndim != 2 || st->shape[0] != e->shape[0] || st->shape[1] != e->shape[1])
                return shard_fail(SHARD_E_INVALID, "%s: tied \"lm_head.weight\" differs in shape from the embedding", dir);
            continue;
        }
        int known = 0;
        for (size_t k = 0; k < n && !known; k++) { shard_model_tensor(d, k, &t); known = strcmp(t.name, st->name) == 0; }
        if (!known)
            return shard_fail(SHARD_E_UNSUPPORTED, "%s: tensor \"%s\" (in %s) is not part of a %s model; smp refuses weights it would ignore",
                              dir, st->name, shard_weights_file_of(w, i), d->architecture);
    }
    (void)matched;
    return SHARD_OK;
}
