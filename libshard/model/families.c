/* The model families smp trains, as data: each family's architecture name, its
 * tensors by their Hugging Face names and roles, and what sets it apart; and
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
/* GPT-NeoX: one fused qkv projection, biases on every linear, LayerNorm with bias,
 * a GELU MLP */
#define NX "gpt_neox.layers.%d."
static const shard_layer_tensor NEOX[] = {
    {NX "input_layernorm.weight", SHARD_T_NORM_ATTN}, {NX "input_layernorm.bias", SHARD_T_NORM_ATTN_BIAS},
    {NX "attention.query_key_value.weight", SHARD_T_QKV}, {NX "attention.query_key_value.bias", SHARD_T_QKV_BIAS},
    {NX "attention.dense.weight", SHARD_T_O}, {NX "attention.dense.bias", SHARD_T_O_BIAS},
    {NX "post_attention_layernorm.weight", SHARD_T_NORM_MLP}, {NX "post_attention_layernorm.bias", SHARD_T_NORM_MLP_BIAS},
    {NX "mlp.dense_h_to_4h.weight", SHARD_T_UP}, {NX "mlp.dense_h_to_4h.bias", SHARD_T_UP_BIAS},
    {NX "mlp.dense_4h_to_h.weight", SHARD_T_DOWN}, {NX "mlp.dense_4h_to_h.bias", SHARD_T_DOWN_BIAS}};
/* Mixtral: Llama's attention, then a router and the experts' SwiGLU (w1 gate, w3 up, w2 down) */
#define LLAMA_ATTN \
    {"model.layers.%d.input_layernorm.weight", SHARD_T_NORM_ATTN}, {ATT "q_proj.weight", SHARD_T_Q}, \
    {ATT "k_proj.weight", SHARD_T_K}, {ATT "v_proj.weight", SHARD_T_V}, {ATT "o_proj.weight", SHARD_T_O}, \
    {"model.layers.%d.post_attention_layernorm.weight", SHARD_T_NORM_MLP}
#define MOE "model.layers.%d.block_sparse_moe."
static const shard_layer_tensor MIXTRAL[] = {
    LLAMA_ATTN, {MOE "gate.weight", SHARD_T_ROUTER}, {MOE "experts.%d.w1.weight", SHARD_T_EXPERT_GATE},
    {MOE "experts.%d.w3.weight", SHARD_T_EXPERT_UP}, {MOE "experts.%d.w2.weight", SHARD_T_EXPERT_DOWN}};
/* Qwen3-MoE: Qwen3's attention (q/k norms), a router and the experts */
#define QMOE "model.layers.%d.mlp."
static const shard_layer_tensor QWEN3_MOE[] = {
    LLAMA_ATTN, {ATT "q_norm.weight", SHARD_T_Q_NORM}, {ATT "k_norm.weight", SHARD_T_K_NORM},
    {QMOE "gate.weight", SHARD_T_ROUTER}, {QMOE "experts.%d.gate_proj.weight", SHARD_T_EXPERT_GATE},
    {QMOE "experts.%d.up_proj.weight", SHARD_T_EXPERT_UP}, {QMOE "experts.%d.down_proj.weight", SHARD_T_EXPERT_DOWN}};
static const shard_layer_tensor LLAMA_OUTER[] = {
    {"model.embed_tokens.weight", SHARD_T_EMBED}, {"model.norm.weight", SHARD_T_NORM_FINAL}, {"lm_head.weight", SHARD_T_HEAD}};
/* transformers 5 calls the head lm_head but saves it as embed_out (its conversion mapping) */
static const shard_layer_tensor NEOX_OUTER[] = {
    {"gpt_neox.embed_in.weight", SHARD_T_EMBED}, {"gpt_neox.final_layer_norm.weight", SHARD_T_NORM_FINAL},
    {"gpt_neox.final_layer_norm.bias", SHARD_T_NORM_FINAL_BIAS}, {"embed_out.weight", SHARD_T_HEAD}};
static const char *const LLAMA_DERIVED[] = {"model.layers.%d.self_attn.rotary_emb.inv_freq", NULL};
static const char *const NEOX_DERIVED[] = {NX "attention.rotary_emb.inv_freq", NX "attention.bias",
                                           NX "attention.masked_bias", NULL};
#define N_OF(a) (sizeof a / sizeof a[0])
#define TENSORS(layer, outer, derived) layer, N_OF(layer), outer, N_OF(outer), derived

static const shard_family FAMILIES[] = {
    /* architecture, model_type, tensors, window; qkv_bias, qk_norm, fused_qkv, linear_bias, layer_norm, gelu_mlp,
     * moe; eps key, activation */
    {"LlamaForCausalLM", "llama", TENSORS(LLAMA, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_NONE, 0, 0, 0, 0, 0, 0, 0,
     "rms_norm_eps", "silu"},
    {"MistralForCausalLM", "mistral", TENSORS(LLAMA, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_ALL, 0, 0, 0, 0, 0, 0, 0,
     "rms_norm_eps", "silu"},
    {"Qwen2ForCausalLM", "qwen2", TENSORS(QWEN2, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_OPTIONAL, 1, 0, 0, 0, 0, 0, 0,
     "rms_norm_eps", "silu"},
    {"Qwen3ForCausalLM", "qwen3", TENSORS(QWEN3, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_OPTIONAL, 0, 1, 0, 0, 0, 0, 0,
     "rms_norm_eps", "silu"},
    {"GPTNeoXForCausalLM", "gpt_neox", TENSORS(NEOX, NEOX_OUTER, NEOX_DERIVED), SHARD_WINDOW_NONE, 0, 0, 1, 1, 1, 1, 0,
     "layer_norm_eps", "gelu"},
    {"MixtralForCausalLM", "mixtral", TENSORS(MIXTRAL, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_ALL, 0, 0, 0, 0, 0, 0,
     1, "rms_norm_eps", "silu"},
    {"Qwen3MoeForCausalLM", "qwen3_moe", TENSORS(QWEN3_MOE, LLAMA_OUTER, LLAMA_DERIVED), SHARD_WINDOW_OPTIONAL, 0, 1, 0,
     0, 0, 0, 2, "rms_norm_eps", "silu"},
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

/* *same: a and b (of one shape) hold the same values, compared as F32 where their
 * dtypes differ */
static shard_status same_values(const shard_st_tensor *a, const shard_st_tensor *b, int *same)
{
    if (a->dtype == b->dtype) {
        *same = a->nbytes == b->nbytes && memcmp(a->data, b->data, a->nbytes) == 0;
        return SHARD_OK;
    }
    enum { BLOCK = 1 << 14 };
    float *x = malloc(2 * BLOCK * sizeof *x);
    if (!x) return shard_fail(SHARD_E_NOMEM, "out of memory");
    const size_t sa = shard_dtype_size(a->dtype), sb = shard_dtype_size(b->dtype);
    shard_status s = SHARD_OK;
    *same = 1;
    for (uint64_t i = 0; i < a->numel && *same && !s; i += BLOCK) {
        const size_t n = a->numel - i < BLOCK ? (size_t)(a->numel - i) : BLOCK;
        s = shard_convert(x, SHARD_DT_F32, (const char *)a->data + i * sa, a->dtype, n);
        if (!s) s = shard_convert(x + BLOCK, SHARD_DT_F32, (const char *)b->data + i * sb, b->dtype, n);
        if (!s) *same = memcmp(x, x + BLOCK, n * sizeof *x) == 0;
    }
    free(x);
    return s;
}

/* the family's tensors outside the layers that d has (a tied head is the embedding) */
static size_t outer_count(const shard_model_desc *d)
{
    return family(d)->nouter - (d->tie_word_embeddings ? 1 : 0);
}

/* the tensors of one layer: an expert's role once per expert */
static size_t layer_count(const shard_model_desc *d)
{
    const shard_family *f = family(d);
    size_t n = 0;
    for (size_t k = 0; k < f->nlayer; k++) n += shard_role_per_expert(f->layer[k].role) ? (size_t)d->experts : 1;
    return n;
}

size_t shard_model_tensor_count(const shard_model_desc *d)
{
    return (size_t)d->layers * layer_count(d) + outer_count(d);
}

/* tensor j of a layer: its table row and its expert (-1: not an expert's) */
static const shard_layer_tensor *layer_tensor(const shard_model_desc *d, size_t j, int *expert)
{
    const shard_family *f = family(d);
    for (size_t k = 0;; k++) {
        const size_t n = shard_role_per_expert(f->layer[k].role) ? (size_t)d->experts : 1;
        if (j < n) {
            *expert = shard_role_per_expert(f->layer[k].role) ? (int)j : -1;
            return &f->layer[k];
        }
        j -= n;
    }
}

/* the name of the family's tensor of a role outside the layers */
static const char *outer_name(const shard_model_desc *d, shard_tensor_role role)
{
    const shard_family *f = family(d);
    for (size_t k = 0; k < f->nouter; k++)
        if (f->outer[k].role == role) return f->outer[k].fmt;
    return "";
}

void shard_model_tensor(const shard_model_desc *d, size_t i, shard_tensor_spec *o)
{
    memset(o, 0, sizeof *o);
    const shard_family *f = family(d);
    const size_t per = layer_count(d), nl = (size_t)d->layers * per;
    o->layer = o->expert = -1;
    const shard_layer_tensor *t;
    if (i == 0) t = &f->outer[0]; /* the embedding */
    else if (i <= nl) {
        t = layer_tensor(d, (i - 1) % per, &o->expert);
        o->layer = (int)((i - 1) / per);
    } else t = &f->outer[i - nl];
    o->role = t->role;
    if (o->expert >= 0) snprintf(o->name, sizeof o->name, t->fmt, o->layer, o->expert);
    else if (o->layer >= 0) snprintf(o->name, sizeof o->name, t->fmt, o->layer);
    else snprintf(o->name, sizeof o->name, "%s", t->fmt);
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

/* name is fmt ("prefix%dsuffix") with a layer number in d's range */
static int is_layer_name(const shard_model_desc *d, const char *fmt, const char *name)
{
    const char *pct = strstr(fmt, "%d");
    const size_t pre = (size_t)(pct - fmt);
    if (strncmp(name, fmt, pre) != 0) return 0;
    const char *p = name + pre, *q = p;
    while (*q >= '0' && *q <= '9' && q - p < 7) q++;
    if (q == p || (q - p > 1 && *p == '0') || strtol(p, NULL, 10) >= d->layers) return 0;
    return strcmp(q, pct + 2) == 0;
}

static int is_derived_buffer(const shard_model_desc *d, const char *name)
{
    for (const char *const *k = family(d)->derived; *k; k++)
        if (is_layer_name(d, *k, name)) return 1;
    return 0;
}

/* every tensor of d is in w, of its shape and a float dtype; used[i]: w's tensor i is one */
static shard_status check_used(const shard_model_desc *d, const shard_weights *w, const char *dir, unsigned char *used)
{
    shard_tensor_spec t;
    char a[96], b[96];
    for (size_t i = 0, n = shard_model_tensor_count(d); i < n; i++) {
        shard_model_tensor(d, i, &t);
        const size_t k = shard_weights_index(w, t.name);
        const shard_st_tensor *st = shard_weights_at(w, k);
        if (!st) return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" is missing from the weights", dir, t.name);
        int same = st->ndim == t.ndim;
        for (int j = 0; same && j < t.ndim; j++) same = st->shape[j] == t.shape[j];
        if (!same) {
            fmt_shape(a, sizeof a, st->ndim, st->shape);
            fmt_shape(b, sizeof b, t.ndim, t.shape);
            return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" has shape %s but config.json implies %s", dir, t.name, a, b);
        }
        if (!shard_dtype_is_float(st->dtype))
            return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" has dtype %s; weights must be floating point", dir, t.name, shard_dtype_name(st->dtype));
        used[k] = 1;
    }
    return SHARD_OK;
}

/* w's tensor i, which the model does not use: a derived buffer, a tied head equal to
 * the embedding, or refused */
static shard_status check_unused(const shard_model_desc *d, const shard_weights *w, const char *dir, size_t i)
{
    const shard_st_tensor *st = shard_weights_at(w, i);
    if (is_derived_buffer(d, st->name)) return SHARD_OK;
    if (!d->tie_word_embeddings || strcmp(st->name, outer_name(d, SHARD_T_HEAD)) != 0)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: tensor \"%s\" (in %s) is not part of a %s model; smp refuses weights it would ignore",
                          dir, st->name, shard_weights_file_of(w, i), d->architecture);
    const shard_st_tensor *e = shard_weights_find(w, outer_name(d, SHARD_T_EMBED));
    if (st->ndim != 2 || st->shape[0] != e->shape[0] || st->shape[1] != e->shape[1])
        return shard_fail(SHARD_E_INVALID, "%s: tied \"%s\" differs in shape from the embedding", dir, st->name);
    if (!shard_dtype_is_float(st->dtype))
        return shard_fail(SHARD_E_INVALID, "%s: tensor \"%s\" has dtype %s; weights must be floating point", dir,
                          st->name, shard_dtype_name(st->dtype));
    int same = 0;
    shard_status s = same_values(e, st, &same);
    if (!s && !same) /* transformers keeps both then (untied, with a warning): the head would be dropped */
        s = shard_fail(SHARD_E_INVALID, "%s: config.json ties the head to the embedding (tie_word_embeddings), "
                       "but \"%s\" differs from \"%s\" (transformers then keeps both, untied): set "
                       "tie_word_embeddings to false in config.json", dir, st->name, e->name);
    return s;
}

shard_status shard_model_check_weights(const shard_model_desc *d, const shard_weights *w, const char *dir)
{
    /* each of the weights is looked up once (a Qwen3-30B-A3B shape has 18867 tensors: a
     * scan of the model's names for each took 50 s of a 608 MB conversion) */
    const size_t nw = shard_weights_count(w);
    unsigned char *used = calloc(nw ? nw : 1, 1);
    if (!used) return shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_status s = check_used(d, w, dir, used);
    for (size_t i = 0; !s && i < nw; i++)
        if (!used[i]) s = check_unused(d, w, dir, i);
    free(used);
    return s;
}
