/* The tensors of the Llama family (LlamaForCausalLM, MistralForCausalLM), by
 * their Hugging Face names, and the check of a model folder against them. */
#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { PER_LAYER = 9 };

static const struct {
    const char *fmt;
    shard_tensor_role role;
} LAYER[PER_LAYER] = {
    {"model.layers.%d.input_layernorm.weight", SHARD_T_NORM_ATTN},
    {"model.layers.%d.self_attn.q_proj.weight", SHARD_T_Q},
    {"model.layers.%d.self_attn.k_proj.weight", SHARD_T_K},
    {"model.layers.%d.self_attn.v_proj.weight", SHARD_T_V},
    {"model.layers.%d.self_attn.o_proj.weight", SHARD_T_O},
    {"model.layers.%d.post_attention_layernorm.weight", SHARD_T_NORM_MLP},
    {"model.layers.%d.mlp.gate_proj.weight", SHARD_T_GATE},
    {"model.layers.%d.mlp.up_proj.weight", SHARD_T_UP},
    {"model.layers.%d.mlp.down_proj.weight", SHARD_T_DOWN},
};

size_t shard_model_tensor_count(const shard_model_desc *d)
{
    return 2 + (size_t)d->layers * PER_LAYER + (d->tie_word_embeddings ? 0 : 1);
}

void shard_model_tensor(const shard_model_desc *d, size_t i, shard_tensor_spec *o)
{
    memset(o, 0, sizeof *o);
    const int64_t H = d->hidden, F = d->intermediate, V = d->vocab;
    const int64_t QD = d->heads * d->head_dim, KD = d->kv_heads * d->head_dim;
    o->layer = -1;
    o->ndim = 2;
    size_t nl = (size_t)d->layers * PER_LAYER;
    if (i == 0) {
        snprintf(o->name, sizeof o->name, "model.embed_tokens.weight");
        o->role = SHARD_T_EMBED; o->shape[0] = V; o->shape[1] = H;
        return;
    }
    if (i <= nl) {
        size_t k = i - 1;
        o->layer = (int)(k / PER_LAYER);
        o->role = LAYER[k % PER_LAYER].role;
        snprintf(o->name, sizeof o->name, LAYER[k % PER_LAYER].fmt, o->layer);
        switch (o->role) {
        case SHARD_T_NORM_ATTN: case SHARD_T_NORM_MLP: o->ndim = 1; o->shape[0] = H; break;
        case SHARD_T_Q: o->shape[0] = QD; o->shape[1] = H; break;
        case SHARD_T_K: case SHARD_T_V: o->shape[0] = KD; o->shape[1] = H; break;
        case SHARD_T_O: o->shape[0] = H; o->shape[1] = QD; break;
        case SHARD_T_GATE: case SHARD_T_UP: o->shape[0] = F; o->shape[1] = H; break;
        case SHARD_T_DOWN: o->shape[0] = H; o->shape[1] = F; break;
        default: break;
        }
        return;
    }
    if (i == nl + 1) {
        snprintf(o->name, sizeof o->name, "model.norm.weight");
        o->role = SHARD_T_NORM_FINAL; o->ndim = 1; o->shape[0] = H;
        return;
    }
    snprintf(o->name, sizeof o->name, "lm_head.weight");
    o->role = SHARD_T_HEAD; o->shape[0] = V; o->shape[1] = H;
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
