/* Boxes and the partition rules (the role table below): which region of each global
 * tensor a rank holds, and whether it is the rank that stores that region. */
#include "../core/internal.h"

#include <string.h>

/* ndim 0 is a scalar (1 element); a negative length counts as empty; UINT64_MAX
 * when the product overflows (no real tensor comes near it). */
uint64_t shard_box_numel(const shard_box *b)
{
    uint64_t n = 1;
    for (int k = 0; k < b->ndim && k < SHARD_MAX_DIMS; k++) {
        if (b->len[k] <= 0) return 0;
        if (!shard_mul_u64(n, (uint64_t)b->len[k], &n)) return UINT64_MAX;
    }
    return n;
}

/* out may alias a or b. Boxes of different rank never overlap. */
int shard_box_intersect(const shard_box *a, const shard_box *b, shard_box *out)
{
    if (a->ndim != b->ndim || a->ndim < 0 || a->ndim > SHARD_MAX_DIMS) return 0;
    shard_box r;
    memset(&r, 0, sizeof r);
    r.ndim = a->ndim;
    for (int k = 0; k < a->ndim; k++) {
        int64_t lo = a->off[k] > b->off[k] ? a->off[k] : b->off[k];
        int64_t ea = a->off[k] + a->len[k], eb = b->off[k] + b->len[k];
        int64_t hi = ea < eb ? ea : eb;
        if (hi <= lo) return 0;
        r.off[k] = lo;
        r.len[k] = hi - lo;
    }
    *out = r;
    return 1;
}

/* Rows of the last dim are contiguous in both buffers: one conversion (or memcpy)
 * per row of x. */
shard_status shard_box_copy(void *dst, shard_dtype ddt, const shard_box *dbox, const void *src, shard_dtype sdt,
                            const shard_box *sbox, const shard_box *x)
{
    const int nd = x->ndim;
    const size_t des = shard_dtype_size(ddt), ses = shard_dtype_size(sdt);
    if (!des || !ses) return shard_fail(SHARD_E_USAGE, "box copy: invalid dtype");
    if (shard_box_numel(x) == 0) return SHARD_OK;
    if (nd == 0) return shard_convert(dst, ddt, src, sdt, 1);
    int64_t idx[SHARD_MAX_DIMS] = {0};
    const size_t row = (size_t)x->len[nd - 1];
    for (;;) {
        size_t so = 0, d = 0;
        for (int k = 0; k < nd; k++) {
            int64_t at = x->off[k] + (k < nd - 1 ? idx[k] : 0);
            so = so * (size_t)sbox->len[k] + (size_t)(at - sbox->off[k]);
            d = d * (size_t)dbox->len[k] + (size_t)(at - dbox->off[k]);
        }
        shard_status s = shard_convert((char *)dst + d * des, ddt, (const char *)src + so * ses, sdt, row);
        if (s) return s;
        int k = nd - 2;
        while (k >= 0 && ++idx[k] == x->len[k]) idx[k--] = 0;
        if (k < 0) return SHARD_OK;
    }
}

/* The role table: each role's shape (in terms of the model's sizes), its
 * tensor-parallel split and how init fills it. Adding a role is a row here (and its
 * use in the model). */
typedef enum { D_NONE, D_V, D_H, D_F, D_QD, D_KD, D_HD, D_QKV, D_E, D_FE } dim_of; /* vocab, hidden, ..., head_dim,
                                                                             3 q width, experts, an expert's intermediate */
typedef enum {
    SPLIT_REPLICATED, /* every tp rank holds it whole; tp rank 0 writes */
    SPLIT_ROWS,       /* blocks of ceil(rows / tp) (vocabulary, MLP) */
    SPLIT_COLS,       /* blocks of ceil(cols / tp) (down_proj) */
    SPLIT_QHEADS,     /* whole query heads along split_dim (GPT-NeoX's fused qkv: a head's q, k and v rows) */
    SPLIT_KVHEADS     /* whole kv heads along dim 0, replicated when fewer than tp */
} split_rule;
#define W SHARD_INIT_NORMAL
#define ONE SHARD_INIT_ONES
#define ZERO SHARD_INIT_ZEROS
static const struct {
    dim_of dims[2];
    split_rule split;
    int split_dim;
    int per_layer;
    shard_init_rule init;
} ROLE[SHARD_T_ROLES] = {
    [SHARD_T_EMBED] = {{D_V, D_H}, SPLIT_ROWS, 0, 0, W},
    [SHARD_T_HEAD] = {{D_V, D_H}, SPLIT_ROWS, 0, 0, W},
    [SHARD_T_NORM_FINAL] = {{D_H}, SPLIT_REPLICATED, 0, 0, ONE},
    [SHARD_T_Q] = {{D_QD, D_H}, SPLIT_QHEADS, 0, 1, W},
    [SHARD_T_K] = {{D_KD, D_H}, SPLIT_KVHEADS, 0, 1, W},
    [SHARD_T_V] = {{D_KD, D_H}, SPLIT_KVHEADS, 0, 1, W},
    [SHARD_T_O] = {{D_H, D_QD}, SPLIT_QHEADS, 1, 1, W},
    [SHARD_T_GATE] = {{D_F, D_H}, SPLIT_ROWS, 0, 1, W},
    [SHARD_T_UP] = {{D_F, D_H}, SPLIT_ROWS, 0, 1, W},
    [SHARD_T_DOWN] = {{D_H, D_F}, SPLIT_COLS, 1, 1, W},
    [SHARD_T_NORM_ATTN] = {{D_H}, SPLIT_REPLICATED, 0, 1, ONE},
    [SHARD_T_NORM_MLP] = {{D_H}, SPLIT_REPLICATED, 0, 1, ONE},
    [SHARD_T_Q_BIAS] = {{D_QD}, SPLIT_QHEADS, 0, 1, ZERO},
    [SHARD_T_K_BIAS] = {{D_KD}, SPLIT_KVHEADS, 0, 1, ZERO},
    [SHARD_T_V_BIAS] = {{D_KD}, SPLIT_KVHEADS, 0, 1, ZERO},
    [SHARD_T_Q_NORM] = {{D_HD}, SPLIT_REPLICATED, 0, 1, ONE},
    [SHARD_T_K_NORM] = {{D_HD}, SPLIT_REPLICATED, 0, 1, ONE},
    [SHARD_T_QKV] = {{D_QKV, D_H}, SPLIT_QHEADS, 0, 1, W},
    [SHARD_T_QKV_BIAS] = {{D_QKV}, SPLIT_QHEADS, 0, 1, ZERO},
    [SHARD_T_O_BIAS] = {{D_H}, SPLIT_REPLICATED, 0, 1, ZERO},   /* added once, after the sum over tp */
    [SHARD_T_UP_BIAS] = {{D_F}, SPLIT_ROWS, 0, 1, ZERO},
    [SHARD_T_DOWN_BIAS] = {{D_H}, SPLIT_REPLICATED, 0, 1, ZERO},
    [SHARD_T_NORM_ATTN_BIAS] = {{D_H}, SPLIT_REPLICATED, 0, 1, ZERO},
    [SHARD_T_NORM_MLP_BIAS] = {{D_H}, SPLIT_REPLICATED, 0, 1, ZERO},
    [SHARD_T_NORM_FINAL_BIAS] = {{D_H}, SPLIT_REPLICATED, 0, 0, ZERO},
    [SHARD_T_ROUTER] = {{D_E, D_H}, SPLIT_REPLICATED, 0, 1, W},
    /* each expert split over tp as a dense MLP is (experts_per_tok partial products summed once) */
    [SHARD_T_EXPERT_GATE] = {{D_FE, D_H}, SPLIT_ROWS, 0, 1, W},
    [SHARD_T_EXPERT_UP] = {{D_FE, D_H}, SPLIT_ROWS, 0, 1, W},
    [SHARD_T_EXPERT_DOWN] = {{D_H, D_FE}, SPLIT_COLS, 1, 1, W},
};
#undef W
#undef ONE
#undef ZERO

shard_init_rule shard_role_init(shard_tensor_role role)
{
    return (unsigned)role < SHARD_T_ROLES ? ROLE[role].init : SHARD_INIT_NORMAL;
}

int shard_role_per_expert(shard_tensor_role role)
{
    return role == SHARD_T_EXPERT_GATE || role == SHARD_T_EXPERT_UP || role == SHARD_T_EXPERT_DOWN;
}

int shard_role_replicated(shard_tensor_role role)
{
    return (unsigned)role < SHARD_T_ROLES && ROLE[role].dims[0] != D_NONE && ROLE[role].split == SPLIT_REPLICATED;
}

static int64_t size_of(const shard_model_desc *d, dim_of k)
{
    switch (k) {
    case D_V: return d->vocab;
    case D_H: return d->hidden;
    case D_F: return d->intermediate;
    case D_QD: return d->heads * d->head_dim;
    case D_KD: return d->kv_heads * d->head_dim;
    case D_HD: return d->head_dim;
    case D_QKV: return 3 * d->heads * d->head_dim;
    case D_E: return d->experts;
    case D_FE: return d->moe_intermediate;
    default: return 0;
    }
}

int shard_role_shape(const shard_model_desc *d, shard_tensor_role role, int64_t shape[2])
{
    if ((unsigned)role >= SHARD_T_ROLES || ROLE[role].dims[0] == D_NONE) return 0;
    int nd = 0;
    for (int k = 0; k < 2 && ROLE[role].dims[k] != D_NONE; k++) shape[nd++] = size_of(d, ROLE[role].dims[k]);
    return nd;
}

static int is_layer_role(shard_tensor_role r) { return (unsigned)r < SHARD_T_ROLES && ROLE[r].per_layer; }

/* Block r of n split over tp in blocks of ceil(n/tp): the last blocks may be short
 * or empty. */
static void block(int64_t n, int tp, int r, int64_t *off, int64_t *len)
{
    int64_t b = (n + tp - 1) / tp, o = b * r;
    if (o > n) o = n;
    *off = o;
    *len = n - o < b ? n - o : b;
}

static shard_status check_args(const shard_model_desc *d, const shard_layout *l, const int *lps, const shard_tensor_spec *t, int rank)
{
    shard_status st = shard_layout_check(l, d);
    if (st) return st;
    long long sum = 0;
    for (int s = 0; s < l->pp; s++) {
        if (lps[s] < 1) return shard_fail(SHARD_E_USAGE, "partition: stage %d has %d layers (each needs at least one)", s, lps[s]);
        sum += lps[s];
    }
    if (sum != d->layers) return shard_fail(SHARD_E_USAGE, "partition: the stages hold %lld layers but the model has %lld", sum, (long long)d->layers);
    if (rank < 0 || rank >= shard_layout_size(l))
        return shard_fail(SHARD_E_USAGE, "partition: rank %d is out of range for %d ranks", rank, shard_layout_size(l));
    int64_t shape[2];
    int nd = shard_role_shape(d, t->role, shape);
    if (nd == 0) return shard_fail(SHARD_E_USAGE, "partition: tensor \"%.*s\" has an unknown role %d", SHARD_NAME_MAX, t->name, (int)t->role);
    if (is_layer_role(t->role) ? (t->layer < 0 || t->layer >= d->layers) : t->layer != -1)
        return shard_fail(SHARD_E_USAGE, "partition: tensor \"%.*s\" has layer %d, out of range for its role", SHARD_NAME_MAX, t->name, t->layer);
    if (t->ndim != nd || t->shape[0] != shape[0] || (nd == 2 && t->shape[1] != shape[1]))
        return shard_fail(SHARD_E_USAGE, "partition: tensor \"%.*s\" does not have the shape its role implies for this model", SHARD_NAME_MAX, t->name);
    return SHARD_OK;
}

shard_status shard_partition(const shard_model_desc *d, const shard_layout *l, const int *layers_per_stage,
                             const shard_tensor_spec *t, int rank, shard_piece *out)
{
    if (!d || !l || !layers_per_stage || !t || !out) return shard_fail(SHARD_E_USAGE, "shard_partition: NULL argument");
    shard_status st = check_args(d, l, layers_per_stage, t, rank);
    if (st) return st;
    const shard_coords c = shard_layout_coords(l, rank);
    const int tp = l->tp, r = c.tp, last = l->pp - 1;
    memset(out, 0, sizeof *out);
    shard_box *b = &out->box;
    b->ndim = t->ndim;

    /* The stage: a layer's by the split; a tied embedding's copy on the last stage
     * is held for the head's matmul but never written (stage 0 stores it). */
    int stage, copy = 0;
    if (is_layer_role(t->role)) stage = shard_stage_of_layer(layers_per_stage, l->pp, t->layer);
    else if (t->role == SHARD_T_EMBED) {
        stage = 0;
        copy = d->tie_word_embeddings && last > 0 && c.pp == last;
    } else stage = last;
    if (stage != c.pp && !copy) return SHARD_OK; /* holds = 0, empty box */

    for (int k = 0; k < t->ndim; k++) b->len[k] = t->shape[k];
    /* Every cp and dp replica holds what cp=0,dp=0 holds; that one writes. An expert
     * under expert parallelism: only the ranks of its ep rank hold it, the first writes. */
    int writes = c.cp == 0 && c.dp == 0 && !copy;
    const int ep = shard_layout_ep(l);
    if (ep > 1 && shard_role_per_expert(t->role)) {
        if (t->expert < 0 || t->expert / (int)(d->experts / ep) != shard_layout_ep_rank(l, c)) return SHARD_OK;
        writes = c.dp * l->cp + c.cp < ep;
    }
    const int64_t hd = d->head_dim, nH = d->heads, nKV = d->kv_heads;
    const int dim = ROLE[t->role].split_dim;
    switch (ROLE[t->role].split) {
    case SPLIT_ROWS: case SPLIT_COLS:
        block(t->shape[dim], tp, r, &b->off[dim], &b->len[dim]);
        break;
    case SPLIT_QHEADS: { /* whole query heads: rank r takes heads [r*nH/tp, (r+1)*nH/tp) */
        const int64_t w = t->shape[dim] / nH; /* a head's rows: head_dim, or 3 head_dim fused */
        b->off[dim] = r * (nH / tp) * w;
        b->len[dim] = (nH / tp) * w;
        break;
    }
    case SPLIT_KVHEADS:
        if (nKV >= tp) {
            b->off[0] = r * (nKV / tp) * hd;
            b->len[0] = (nKV / tp) * hd;
        } else {
            /* Fewer kv heads than ranks: each is replicated on tp/nKV consecutive
             * ranks (the ones whose query heads use it); the first of them writes. */
            int rep = tp / (int)nKV;
            b->off[0] = (r / rep) * hd;
            b->len[0] = hd;
            writes = writes && r % rep == 0;
        }
        break;
    case SPLIT_REPLICATED:
        writes = writes && r == 0;
        break;
    }
    out->holds = 1;
    /* An empty box (a vocab or MLP block past the end) is held as padding at run
     * time but there is nothing to store. */
    out->writes = writes && shard_box_numel(b) > 0;
    return SHARD_OK;
}

shard_status shard_partition_optim(const shard_model_desc *d, const shard_layout *l, const int *layers_per_stage,
                                   const shard_tensor_spec *t, int rank, shard_piece *out)
{
    /* the (pp, tp) position's parameter piece, as its cp = dp = 0 rank holds it (an
     * expert under expert parallelism: as the first rank of its ep rank holds it, split
     * over the dp*cp/ep ranks that replicate it) */
    shard_coords c = shard_layout_coords(l, rank);
    if (c.tp < 0) return shard_fail(SHARD_E_USAGE, "rank %d outside the layout", rank);
    int q = c.dp * l->cp + c.cp, parts = l->dp * l->cp, first = 0;
    const int ep = shard_layout_ep(l);
    if (ep > 1 && shard_role_per_expert(t->role)) {
        first = q % ep;
        q /= ep;
        parts /= ep;
    }
    c.cp = first % l->cp;
    c.dp = first / l->cp;
    shard_status s = shard_partition(d, l, layers_per_stage, t, shard_layout_rank(l, c), out);
    if (s || !out->holds) return s;
    /* ZeRO-1: that piece split along dim 0 over the dp*cp ranks of the position */
    int64_t off, len;
    block(out->box.len[0], parts, q, &off, &len);
    out->box.off[0] += off;
    out->box.len[0] = len;
    out->writes = out->writes && shard_box_numel(&out->box) > 0;
    return SHARD_OK;
}
