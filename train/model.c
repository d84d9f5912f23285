/* train/model.c: the model of one rank (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX), forward and backward (see model.h). */
#include "model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

static void *zalloc(size_t n, size_t size)
{
    return calloc(n ? n : 1, size);
}

/* backend memory: zeroed, NULL on failure (recorded in the backend) */
static void *dalloc(model *m, size_t n, size_t size)
{
    return m->dev->ops->alloc(m->dev, (n ? n : 1) * size);
}
static void dfree(model *m, void *p)
{
    if (p && m->dev) m->dev->ops->release(m->dev, p);
}
#define DV (m->dev)
#define OPS (m->dev->ops)
/* element i of a compute-dtype buffer */
#define AT(p, i) dev_at(m->dev, (p), (size_t)(i))
#define CAT(p, i) dev_cat(m->dev, (p), (size_t)(i)) /* of a const buffer */

/* where a layer tensor of each role is viewed: its field in layer_params and in
 * layer_grads (the same name) */
#define FIELD(role, f) [role] = {offsetof(layer_params, f), offsetof(layer_grads, f)}
static const struct {
    size_t w, g;
} LAYER_FIELD[] = {
    FIELD(SHARD_T_Q, q), FIELD(SHARD_T_K, k), FIELD(SHARD_T_V, v), FIELD(SHARD_T_O, o), FIELD(SHARD_T_GATE, gate),
    FIELD(SHARD_T_UP, up), FIELD(SHARD_T_DOWN, down), FIELD(SHARD_T_NORM_ATTN, norm_attn),
    FIELD(SHARD_T_NORM_MLP, norm_mlp), FIELD(SHARD_T_Q_BIAS, q_bias), FIELD(SHARD_T_K_BIAS, k_bias),
    FIELD(SHARD_T_V_BIAS, v_bias), FIELD(SHARD_T_Q_NORM, q_norm), FIELD(SHARD_T_K_NORM, k_norm),
    FIELD(SHARD_T_QKV, qkv), FIELD(SHARD_T_QKV_BIAS, qkv_bias), FIELD(SHARD_T_O_BIAS, o_bias),
    FIELD(SHARD_T_UP_BIAS, up_bias), FIELD(SHARD_T_DOWN_BIAS, down_bias), FIELD(SHARD_T_NORM_ATTN_BIAS, norm_attn_bias),
    FIELD(SHARD_T_NORM_MLP_BIAS, norm_mlp_bias), FIELD(SHARD_T_ROUTER, router),
};
#undef FIELD

/* an expert's tensor: its slot in the layer's view arrays */
static void bind_expert(model *m, const shard_tensor_spec *t, void *p, float *g)
{
    const int k = t->role == SHARD_T_EXPERT_GATE ? 0 : t->role == SHARD_T_EXPERT_UP ? 1 : 2;
    const size_t at = ((size_t)t->layer * 3 + (size_t)k) * (size_t)m->E + (size_t)t->expert;
    m->ew[at] = p;
    m->eg[at] = g;
}

/* point the per-tensor views at params/grads (offsets and sizes already set) */
static shard_status bind(model *m)
{
    m->embed = m->norm_final = m->head = m->dembed = m->dnorm_final = m->dhead = NULL;
    m->norm_final_bias = m->dnorm_final_bias = NULL;
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        void *p = AT(m->params, m->offset[i]);
        float *g = m->grads + m->offset[i];
        if (t->expert >= 0) {
            bind_expert(m, t, p, g);
        } else if (t->layer >= 0) {
            *(void **)((char *)&m->lw[t->layer] + LAYER_FIELD[t->role].w) = p;
            *(float **)((char *)&m->lg[t->layer] + LAYER_FIELD[t->role].g) = g;
        } else if (t->role == SHARD_T_EMBED) {
            m->embed = p;
            m->dembed = g;
        } else if (t->role == SHARD_T_NORM_FINAL) {
            m->norm_final = p;
            m->dnorm_final = g;
        } else if (t->role == SHARD_T_HEAD) {
            m->head = p;
            m->dhead = g;
        } else if (t->role == SHARD_T_NORM_FINAL_BIAS) {
            m->norm_final_bias = p;
            m->dnorm_final_bias = g;
        }
    }
    if (m->d.tie_word_embeddings) { /* one tensor, two uses: both gradients sum into it */
        m->head = m->embed;
        m->dhead = m->dembed;
    }
    if (!m->embed || !m->head || !m->norm_final)
        return shard_fail(SHARD_E_INTERNAL, "the model's tensor list lacks the embedding, head or final norm");
    return SHARD_OK;
}

/* the per-layer view arrays and the experts' statistics, zeroed: nonzero when out of memory */
static int view_arrays(model *m)
{
    m->lw = zalloc((size_t)m->L, sizeof *m->lw);
    m->lg = zalloc((size_t)m->L, sizeof *m->lg);
    m->ew = zalloc((size_t)m->L * 3 * (size_t)m->E, sizeof *m->ew);
    m->eg = zalloc((size_t)m->L * 3 * (size_t)m->E, sizeof *m->eg);
    m->aux = zalloc(3 * (size_t)m->E + 1, sizeof *m->aux); /* the statistics, then a layer's probability sums */
    if (!m->lw || !m->lg || !m->ew || !m->eg || !m->aux) return 1;
    for (int l = 0; l < m->L && m->E; l++) { /* each layer's views of its experts' gate, up and down */
        void **w = m->ew + (size_t)l * 3 * m->E;
        float **g = m->eg + (size_t)l * 3 * m->E;
        m->lw[l].egate = w; m->lw[l].eup = w + m->E; m->lw[l].edown = w + 2 * m->E;
        m->lg[l].egate = g; m->lg[l].eup = g + m->E; m->lg[l].edown = g + 2 * m->E;
    }
    return 0;
}

shard_status model_create(model *m, const shard_model_desc *d, dev *dv)
{
    memset(m, 0, sizeof *m);
    m->d = *d;
    m->dev = dv;
    m->V = (int)d->vocab;
    m->H = (int)d->hidden;
    m->F = (int)d->intermediate;
    m->L = (int)d->layers;
    m->nh = (int)d->heads;
    m->nkv = (int)d->kv_heads;
    m->hd = (int)d->head_dim;
    m->rd = d->rotary_dim > 0 ? (int)d->rotary_dim : m->hd;
    m->window = (int)d->sliding_window;
    m->E = (int)d->experts;
    m->topk = (int)d->experts_per_tok;
    m->FE = (int)d->moe_intermediate;
    m->vocab_start = 0;
    m->vocab_local = m->V;
    m->l0 = 0;
    m->l1 = m->L;
    m->first = m->last = 1;
    m->eps = (float)d->norm_eps;
    if (dv->cuda && (m->E > 1024 || m->topk > 32)) /* kernels/moe.cu: a warp per token's experts */
        return shard_fail(SHARD_E_UNSUPPORTED, "%d experts, %d per token: the CUDA router takes up to 1024 and 32",
                          m->E, m->topk);
    if (m->rd % 2 || m->rd > m->hd)
        return shard_fail(SHARD_E_UNSUPPORTED, "RoPE over %d of head_dim %d dims: it needs an even count", m->rd, m->hd);
    m->ntensors = shard_model_tensor_count(d);
    m->spec = zalloc(m->ntensors, sizeof *m->spec);
    m->offset = zalloc(m->ntensors, sizeof *m->offset);
    m->numel = zalloc(m->ntensors, sizeof *m->numel);
    m->inv_freq = zalloc((size_t)m->rd / 2, sizeof(float));
    if (!m->spec || !m->offset || !m->numel || !m->inv_freq || view_arrays(m)) goto nomem;
    size_t off = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        shard_model_tensor(d, i, &m->spec[i]);
        size_t n = 1;
        for (int k = 0; k < m->spec[i].ndim; k++) n *= (size_t)m->spec[i].shape[k];
        m->offset[i] = off;
        m->numel[i] = n;
        off += n;
    }
    m->nparams = off;
    m->params = dalloc(m, off, dv->es);
    m->grads = dalloc(m, off, sizeof(float));
    m->inv_freq_d = dalloc(m, (size_t)m->rd / 2, sizeof(float));
    if (!m->params || !m->grads || !m->inv_freq_d) goto nomem;
    shard_status st = bind(m);
    if (st) {
        model_free(m);
        return st;
    }
    const op_rope_params rp = {(float)d->rope_theta, d->rope_type, (float)d->rope_factor, (float)d->rope_low_freq_factor,
                               (float)d->rope_high_freq_factor, (float)d->rope_original_max_positions,
                               (float)d->rope_beta_fast, (float)d->rope_beta_slow, !d->rope_truncate,
                               d->rope_attention_factor, d->rope_mscale, d->rope_mscale_all_dim};
    op_rope_inv_freq(m->inv_freq, m->rd, &rp);
    m->rope_scale = op_rope_scale(&rp);
    OPS->upload(DV, m->inv_freq_d, m->inv_freq, (size_t)m->rd / 2 * sizeof(float));
    return SHARD_OK;
nomem:
    model_free(m);
    return shard_fail(SHARD_E_NOMEM, "out of memory for the model's parameters");
}

shard_status model_lane(model *lane, const model *m)
{
    if (m->slots || m->shares) return shard_fail(SHARD_E_INTERNAL, "model_lane of a model with activations, or of a lane");
    *lane = *m; /* the description, the sizes and the settings; then what is the lane's own */
    lane->shares = m;
    lane->lw = NULL; lane->lg = NULL; lane->ew = NULL; lane->eg = NULL; lane->aux = NULL;
    lane->hparams = NULL;
    lane->fp8 = NULL;
    lane->comm_err = SHARD_OK;
    lane->grads = dalloc(lane, m->nparams, sizeof(float));
    if (view_arrays(lane) || !lane->grads) {
        model_free(lane);
        return shard_fail(SHARD_E_NOMEM, "out of memory for a lane's gradients");
    }
    shard_status s = bind(lane);
    if (s) model_free(lane);
    return s;
}

shard_status model_localize(model *m, const shard_piece *pieces, int tp, size_t align)
{
    if (m->acts) return shard_fail(SHARD_E_INTERNAL, "model_localize after model_alloc_acts");
    size_t off = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        const shard_box *b = &pieces[i].box;
        size_t n = pieces[i].holds ? (size_t)shard_box_numel(b) : 0;
        if (n) off = (off + align - 1) / align * align;
        m->offset[i] = off;
        m->numel[i] = n;
        off += n;
        if (!pieces[i].holds) continue;
        switch (t->role) {
        case SHARD_T_EMBED: case SHARD_T_HEAD: /* the same rows of the vocabulary */
            m->vocab_start = (int)b->off[0];
            m->vocab_local = (int)b->len[0];
            break;
        case SHARD_T_Q: m->nh = (int)(b->len[0] / m->hd); break;
        case SHARD_T_K: m->nkv = (int)(b->len[0] / m->hd); break;
        case SHARD_T_QKV: m->nh = m->nkv = (int)(b->len[0] / (3 * m->hd)); break;
        case SHARD_T_UP: m->F = (int)b->len[0]; break;
        case SHARD_T_EXPERT_UP: m->FE = (int)b->len[0]; break;
        default: break;
        }
    }
    if (!m->params_lent) dfree(m, m->params);
    m->params_lent = 0;
    dfree(m, m->grads);
    free(m->hparams);
    m->hparams = NULL;
    m->nparams = off;
    m->params = dalloc(m, off, DV->es);
    m->grads = dalloc(m, off, sizeof(float));
    if (!m->params || !m->grads) return shard_fail(SHARD_E_NOMEM, "out of memory for the model's parameters");
    m->tp_size = tp;
    return bind(m);
}

void model_set_stage(model *m, int l0, int l1, int first, int last)
{
    m->l0 = l0;
    m->l1 = l1;
    m->first = first;
    m->last = last;
}

/* all-reduce over tp of n elements of dtype dt */
static void tp_reduce(model *m, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    if (m->tp_size <= 1 || !m->tp || m->comm_err) return;
    shard_status s = shard_comm_allreduce(m->tp, buf, n, dt, op);
    if (s) m->comm_err = s;
}
/* the same for activations (the compute dtype), summed */
static void tp_sum(model *m, void *buf, size_t n)
{
    tp_reduce(m, buf, n, DV->dt, SHARD_OP_SUM);
}

static int sp_on(const model *m)
{
    return m->sp && m->tp_size > 1 && m->tp;
}

size_t model_local_rows(const model *m)
{
    const size_t N = (size_t)m->B * m->T;
    return sp_on(m) ? N / (size_t)m->tp_size : N;
}

/* sequence parallelism: full[N rows] (partial sums) -> loc[N/tp rows], this rank's
 * block of the sum (token-major blocks: block r is tp rank r's rows) */
static void tp_reduce_scatter(model *m, const void *full, void *loc, size_t nloc)
{
    if (m->comm_err) return;
    shard_status s = shard_comm_reduce_scatter(m->tp, full, loc, nloc, DV->dt, SHARD_OP_SUM);
    if (s) m->comm_err = s;
}

/* loc[N/tp rows] of every tp rank -> full[N rows] */
static void tp_allgather(model *m, const void *loc, void *full, size_t nloc)
{
    if (m->comm_err) return;
    shard_status s = shard_comm_allgather(m->tp, loc, full, nloc, DV->dt);
    if (s) m->comm_err = s;
}

void model_set_ep(model *m, shard_comm *h, shard_comm *d, int ep, int rank)
{
    m->ep_h = h;
    m->ep_d = d;
    m->ep_size = ep;
    m->ep_rank = rank;
}

void model_set_cp(model *m, shard_comm *cp, int cp_size, int cp_rank)
{
    m->cp = cp;
    m->cp_size = cp_size;
    m->cp_rank = cp_rank;
}

/* every backend buffer of a layer's activations, in a fixed order */
#define LAYER_BUFS(a) {(void **)&(a)->x, (void **)&(a)->rstd1, &(a)->xn1, &(a)->q, &(a)->k, &(a)->v, &(a)->att, \
                       (void **)&(a)->lse, &(a)->xmid, (void **)&(a)->rstd2, &(a)->xn2, &(a)->gate, &(a)->up, &(a)->act, \
                       &(a)->q_pre, &(a)->k_pre, (void **)&(a)->rstd_q, (void **)&(a)->rstd_k, \
                       (void **)&(a)->mean1, (void **)&(a)->mean2, (void **)&(a)->probs, (void **)&(a)->wts, \
                       (void **)&(a)->idx, (void **)&(a)->rows, (void **)&(a)->slot, &(a)->xs, &(a)->ys, \
                       (void **)&(a)->erows, (void **)&(a)->einv}
enum { NBUFS = 29 }; /* the entries of LAYER_BUFS */

static void free_layer(model *m, layer_acts *a)
{
    void **all[] = LAYER_BUFS(a);
    for (size_t k = 0; k < sizeof all / sizeof *all; k++) dfree(m, *all[k]);
    memset(a, 0, sizeof *a);
}

static void free_slot(model *m, act_slot *sl)
{
    if (sl->acts) {
        for (int l = 0; l < m->L; l++) free_layer(m, &sl->acts[l]);
        free(sl->acts);
    }
    void **bufs[] = {&sl->xL, (void **)&sl->rstdf, (void **)&sl->meanf, &sl->xnf, &sl->logits, (void **)&sl->rowmax,
                     (void **)&sl->sumexp, (void **)&sl->losses};
    for (size_t k = 0; k < sizeof bufs / sizeof *bufs; k++) dfree(m, *bufs[k]);
    memset(sl, 0, sizeof *sl);
}

static void free_acts(model *m)
{
    for (int k = 0; m->slots && k < m->nslots; k++) free_slot(m, &m->slots[k]);
    free(m->slots);
    m->slots = NULL;
    m->nslots = 0;
    m->acts = NULL;
    m->xL = m->xnf = m->logits = NULL;
    m->rstdf = m->meanf = m->rowmax = m->sumexp = m->losses = NULL;
    free_layer(m, &m->rc);
    void **bufs[] = {(void **)&m->cos_t, (void **)&m->sin_t, &m->dx, &m->dxn, &m->dq, &m->dk, &m->dv, &m->datt,
                     &m->dgate, &m->dup, &m->dact, &m->ring[0], &m->ring[1], &m->ring_out,
                     (void **)&m->ring_lse, &m->sp_loc, (void **)&m->pos_d, (void **)&m->cp_pos_d,
                     (void **)&m->tok_d, (void **)&m->tgt_d, (void **)&m->rpos_d, (void **)&m->doc_d, &m->dqk_pre,
                     &m->qkv, &m->dres, &m->rlogits, (void **)&m->dwts, &m->dxs, (void **)&m->dprobs, &m->epa, &m->epb};
    for (size_t k = 0; k < sizeof bufs / sizeof *bufs; k++) {
        dfree(m, *bufs[k]);
        *bufs[k] = NULL;
    }
    void *host[] = {m->pos, m->cp_pos, m->rpos, m->doc, m->seq_scratch, m->ring_need, m->eoff, m->hcur, m->hprobs,
                    m->epc, m->hem, m->hinv, m->hloff};
    for (size_t k = 0; k < sizeof host / sizeof *host; k++) free(host[k]);
    m->pos = m->cp_pos = m->rpos = m->doc = m->seq_scratch = NULL;
    m->eoff = m->hcur = m->epc = m->hem = m->hinv = m->hloff = NULL;
    m->hprobs = NULL;
    m->ring_need = NULL;
    m->act_bytes = 0;
}

void model_use_slot(model *m, int k)
{
    act_slot *sl = &m->slots[k];
    m->slot = k;
    m->acts = sl->acts;
    m->xL = sl->xL;
    m->rstdf = sl->rstdf;
    m->meanf = sl->meanf;
    m->xnf = sl->xnf;
    m->logits = sl->logits;
    m->rowmax = sl->rowmax;
    m->sumexp = sl->sumexp;
    m->losses = sl->losses;
}

void *model_stage_input(model *m)
{
    return m->l0 < m->l1 ? m->acts[m->l0].x : m->xL;
}

void model_free(model *m)
{
    if (!m) return;
    if (m->shares) { /* a lane: what it reads of the model it shares is not its own */
        m->params = NULL;
        m->inv_freq_d = NULL;
        m->spec = NULL;
        m->offset = m->numel = NULL;
        m->inv_freq = NULL;
    }
    if (m->params_lent) m->params = NULL;
    if (m->dev) {
        free_acts(m);
        dfree(m, m->params);
        dfree(m, m->grads);
        dfree(m, m->inv_freq_d);
    }
    free(m->spec); free(m->offset); free(m->numel); free(m->lw); free(m->lg); free(m->inv_freq); free(m->ew); free(m->eg); free(m->aux);
    free(m->hparams);
    fp8_free(m->fp8);
    memset(m, 0, sizeof *m);
}

shard_status model_alloc_acts(model *m, int B, int T)
{
    return model_alloc_slots(m, B, T, 1);
}

/* the tensors of a layer that recomputation keeps per layer (else in the shared set m->rc) */
static int kept(const model *m, const void *const *field, const layer_acts *a)
{
    if (m->recompute == RECOMPUTE_NONE || field == (const void *const *)&a->x) return 1;
    if (m->recompute == RECOMPUTE_FULL) return 0;
    /* attention: the MLP half stays */
    const void *const *mlp[] = {(const void *const *)&a->xmid, (const void *const *)&a->rstd2,
                                (const void *const *)&a->mean2, (const void *const *)&a->xn2,
                                (const void *const *)&a->gate, (const void *const *)&a->up,
                                (const void *const *)&a->act, (const void *const *)&a->probs,
                                (const void *const *)&a->wts, (const void *const *)&a->idx,
                                (const void *const *)&a->rows, (const void *const *)&a->slot,
                                (const void *const *)&a->xs, (const void *const *)&a->ys,
                                (const void *const *)&a->erows, (const void *const *)&a->einv};
    for (size_t k = 0; k < sizeof mlp / sizeof *mlp; k++)
        if (field == mlp[k]) return 1;
    return 0;
}

/* the rows this rank's experts may run: its own N*k, or with expert parallelism every
 * ep rank's (dropless: any share of them may come here) */
static size_t expert_rows_cap(const model *m)
{
    const size_t Nk = m->E ? (size_t)m->B * m->T * (size_t)m->topk : 0;
    return m->ep_size > 1 ? Nk * (size_t)m->ep_size : Nk;
}

/* elements of each LAYER_BUFS entry, and its element size */
static void layer_sizes(const model *m, size_t *n, size_t *es)
{
    const size_t N = (size_t)m->B * m->T, H = (size_t)m->H, F = (size_t)m->F, e = m->dev->es, f = sizeof(float);
    const size_t QD = (size_t)m->nh * m->hd, KD = (size_t)m->nkv * m->hd;
    const size_t qk = m->d.qk_norm ? 1 : 0; /* the q/k norm's tensors: none elsewhere */
    const size_t gate = m->d.gelu_mlp ? 0 : 1, ln = m->d.layer_norm ? 1 : 0;
    const size_t Nk = m->E ? N * (size_t)m->topk : 0, E = (size_t)m->E; /* the experts' rows: none elsewhere */
    const size_t cap = expert_rows_cap(m), ep = m->ep_size > 1 ? 1 : 0;
    const size_t MF = m->E ? cap * (size_t)m->FE : N * F, i = sizeof(int32_t);
    const size_t nn[NBUFS] = {N * H, N, N * H, N * QD, N * KD, N * KD, N * QD, (size_t)m->B * m->nh * m->T, N * H, N,
                              N * H, gate * MF, MF, MF, qk * N * QD, qk * N * KD, qk * N * m->nh, qk * N * m->nkv,
                              ln * N, ln * N, N * E, Nk, Nk, Nk, Nk, cap * H, Nk * H, ep * cap, ep * cap};
    const size_t ee[NBUFS] = {e, f, e, e, e, e, e, f, e, f, e, e, e, e, e, e, f, f, f, f, f, f, i, i, i, e, e, i, i};
    memcpy(n, nn, sizeof nn);
    memcpy(es, ee, sizeof ee);
}

/* The positions of this rank's T tokens (and every cp rank's) and their RoPE tables:
 * cp rank i holds chunks i and 2C-1-i of T/2 tokens each (C = 1: 0..T-1). */
static void set_positions(model *m, int T, int C)
{
    for (int i = 0; i < C; i++)
        for (int t = 0; t < T; t++)
            m->cp_pos[(size_t)i * T + t] = C == 1 ? t : t < T / 2 ? i * (T / 2) + t : (2 * C - 1 - i) * (T / 2) + t - T / 2;
    memcpy(m->pos, m->cp_pos + (size_t)(C > 1 ? m->cp_rank : 0) * T, (size_t)T * sizeof(int32_t));
    OPS->upload(DV, m->cp_pos_d, m->cp_pos, (size_t)T * C * sizeof(int32_t));
    OPS->upload(DV, m->pos_d, m->pos, (size_t)T * sizeof(int32_t));
    model_positions(m); /* documents: model_documents replaces them per microbatch */
}

/* The tokens of a microbatch of N whose logits head_loss computes at a time: all of
 * them while their logits fit 256 MiB (1 GiB on a GPU: each chunk adds the head's
 * weight gradient, V x H fp32, once more to the GEMMs' traffic, and a GPU has the
 * memory: the 1B benchmark's 4096 tokens stay one chunk), else as many as fit, a
 * multiple of 128 (the GEMM tiles' rows) and at least 1024 (on the CPU chunks of 512
 * of Llama 3's vocabulary ran 15-25% slower than of 1024, which beat the whole 4096);
 * logits_chunk > 0 sets the count, < 0 the whole microbatch. A vocabulary of 128k
 * columns has 0.5 MB of fp32 logits per token: 4096 tokens' were 2 GB, and their
 * gradient as much again, more than the layers' activations under --recompute. */
static int head_rows(const model *m, int N)
{
    int r = m->logits_chunk < 0 ? N : m->logits_chunk;
    if (r == 0) {
        const size_t budget = (size_t)(DV->cuda ? 1024 : 256) << 20;
        const size_t row = (size_t)m->vocab_local * DV->es, fit = budget / (row ? row : 1);
        r = fit >= (size_t)N ? N : fit >= 1024 ? (int)(fit / 128 * 128) : 1024;
    }
    return r < N ? r : N > 0 ? N : 1;
}

shard_status model_alloc_slots(model *m, int B, int T, int nslots)
{
    free_acts(m);
    if (sp_on(m) && ((size_t)B * T) % (size_t)m->tp_size)
        return shard_fail(SHARD_E_USAGE, "sequence parallelism: %d x %d tokens per microbatch are not divisible by tp = %d",
                          B, T, m->tp_size);
    m->B = B;
    m->T = T;
    const size_t N = (size_t)B * T, H = (size_t)m->H, F = (size_t)m->F, e = DV->es, f = sizeof(float);
    const size_t QD = (size_t)m->nh * m->hd, KD = (size_t)m->nkv * m->hd, Vl = (size_t)m->vocab_local;
    int ok = 1;
#define A(p, n, sz) do { const size_t n_ = (n); (p) = dalloc(m, n_, (sz)); ok &= (p) != NULL; m->act_bytes += (n_ ? n_ : 1) * (sz); } while (0)
    m->slots = zalloc((size_t)nslots, sizeof *m->slots);
    ok &= m->slots != NULL;
    if (ok) m->nslots = nslots;
    m->head_rows = head_rows(m, (int)N);
    const size_t NV = m->last ? (size_t)m->head_rows * Vl : 0, NL = m->last ? N : 0;
    size_t ln[NBUFS], les[NBUFS];
    layer_sizes(m, ln, les);
    for (int k = 0; ok && k < nslots; k++) {
        act_slot *sl = &m->slots[k];
        sl->acts = zalloc((size_t)m->L, sizeof *sl->acts);
        ok &= sl->acts != NULL;
        for (int l = m->l0; ok && l < m->l1; l++) {
            layer_acts *a = &sl->acts[l];
            void **all[] = LAYER_BUFS(a);
            for (int j = 0; ok && j < NBUFS; j++)
                if (ln[j] && kept(m, (const void *const *)all[j], a)) A(*all[j], ln[j], les[j]);
        }
        A(sl->xL, N * H, e); A(sl->rstdf, NL, f); A(sl->xnf, m->last ? N * H : 0, e); A(sl->logits, NV, e);
        if (m->d.layer_norm) A(sl->meanf, NL, f);
        A(sl->rowmax, NL, f); A(sl->sumexp, 2 * NL, f); A(sl->losses, NL, f);
    }
    if (ok && m->recompute != RECOMPUTE_NONE && m->l0 < m->l1) { /* one shared set of what is recomputed */
        layer_acts *a = &m->rc;
        void **all[] = LAYER_BUFS(a);
        for (int j = 1; ok && j < NBUFS; j++)
            if (ln[j] && !kept(m, (const void *const *)all[j], a)) A(*all[j], ln[j], les[j]);
    }
    A(m->cos_t, N * m->hd, f); A(m->sin_t, N * m->hd, f); A(m->rpos_d, N, sizeof(int32_t));
    A(m->dx, N * H, e); A(m->dxn, N * H, e); A(m->dq, N * QD, e); A(m->dk, N * KD, e); A(m->dv, N * KD, e);
    const size_t MF = m->E ? expert_rows_cap(m) * (size_t)m->FE : N * F; /* the MLP's rows: experts' or dense */
    A(m->datt, N * QD, e); A(m->dup, MF, e); A(m->dact, MF, e);
    if (!m->d.gelu_mlp) A(m->dgate, MF, e);
    if (m->E) {
        const size_t Nk = N * (size_t)m->topk;
        A(m->rlogits, N * (size_t)m->E, e); A(m->dwts, Nk, f); A(m->dxs, expert_rows_cap(m) * H, e);
        if (m->ep_size > 1) { A(m->epa, expert_rows_cap(m) * H, e); A(m->epb, expert_rows_cap(m) * H, e); }
    }
    if (m->d.qk_norm) A(m->dqk_pre, N * (QD + KD), e);
    if (m->d.fused_qkv) A(m->qkv, N * 3 * QD, e);
    if (m->d.parallel_residual) A(m->dres, model_local_rows(m) * H, e);
    A(m->tok_d, N, sizeof(int32_t)); A(m->tgt_d, N, sizeof(int32_t));
    if (sp_on(m)) A(m->sp_loc, N / (size_t)m->tp_size * H, e);
    const int C = m->cp_size > 1 ? m->cp_size : 1;
    if (C > 1) {
        if (T % 2) {
            free_acts(m);
            return shard_fail(SHARD_E_USAGE, "context parallelism: %d tokens per rank is odd (two equal chunks)", T);
        }
        A(m->ring[0], 4 * N * KD, e); A(m->ring[1], 4 * N * KD, e); A(m->ring_out, N * QD, e);
        A(m->ring_lse, (size_t)B * m->nh * T, f);
    }
    A(m->pos_d, (size_t)T, sizeof(int32_t)); A(m->cp_pos_d, (size_t)T * C, sizeof(int32_t));
    if (m->docs) A(m->doc_d, N * C, sizeof(int32_t));
#undef A
    m->pos = zalloc((size_t)T, sizeof(int32_t));
    m->cp_pos = zalloc((size_t)T * C, sizeof(int32_t));
    m->rpos = zalloc(N, sizeof(int32_t));
    m->ring_need = zalloc((size_t)C, 1);
    ok &= m->pos && m->cp_pos && m->rpos && m->ring_need;
    if (m->E) {
        m->eoff = zalloc((size_t)nslots * m->L * (m->E + 1), sizeof(int32_t));
        m->hcur = zalloc((size_t)m->E, sizeof(int32_t));
        m->hprobs = zalloc(N * (size_t)m->E, sizeof(float));
        ok &= m->eoff && m->hcur && m->hprobs;
        if (m->ep_size > 1) {
            m->epc = zalloc((size_t)nslots * m->L * (size_t)m->E, sizeof(int32_t)); /* ep * E/ep per layer */
            m->hem = zalloc(expert_rows_cap(m), sizeof(int32_t));
            m->hinv = zalloc(expert_rows_cap(m), sizeof(int32_t));
            m->hloff = zalloc((size_t)m->E + 1, sizeof(int32_t));
            ok &= m->epc && m->hem && m->hinv && m->hloff;
        }
    }
    if (m->docs) {
        m->doc = zalloc(N * C, sizeof(int32_t));
        m->seq_scratch = zalloc(2 * (size_t)T * C, sizeof(int32_t));
        ok &= m->doc && m->seq_scratch;
    }
    if (ok) model_use_slot(m, 0);
    if (!ok) {
        shard_status s = DV->err ? dev_status(DV) : SHARD_E_NOMEM;
        free_acts(m);
        if (s != SHARD_E_NOMEM) return shard_fail(s, "out of memory for the activations of %d x %d tokens: %s", B, T, shard_errmsg());
        return shard_fail(SHARD_E_NOMEM, "out of memory for the activations of %d x %d tokens", B, T);
    }
    if (m->fp8) {
        size_t D = H > (m->d.fused_qkv ? 3 : 1) * QD ? H : (m->d.fused_qkv ? 3 : 1) * QD;
        D = D > F ? D : F;
        D = D > KD ? D : KD;
        D = D > (size_t)m->FE ? D : (size_t)m->FE;
        /* an expert takes each token at most once: up to N rows, every ep rank's N with ep */
        const size_t rows = m->E && m->ep_size > 1 ? N * (size_t)m->ep_size : N;
        shard_status s = OPS->fp8_reserve(DV, m->fp8, (int)rows, (int)D);
        if (s) {
            free_acts(m);
            return s;
        }
    }
    set_positions(m, T, C);
    return dev_status(DV);
}

void model_memory(const model *m, size_t *params, size_t *grads, size_t *acts)
{
    *params = m->nparams * m->dev->es;
    *grads = m->nparams * sizeof(float);
    *acts = m->act_bytes;
}

float *model_params_host(model *m)
{
    if (!m->dev->cuda) return m->params;
    if (!m->hparams) m->hparams = malloc((m->nparams ? m->nparams : 1) * sizeof(float));
    return m->hparams;
}

shard_status model_adopt_params(model *m, void *buf)
{
    if (m->dev->cuda || m->acts || m->shares) return shard_fail(SHARD_E_INTERNAL, "model_adopt_params on a GPU, a lane or after model_alloc_acts");
    if (!m->params_lent) dfree(m, m->params);
    m->params = buf;
    m->params_lent = 1;
    return bind(m);
}

void model_params_download(model *m)
{
    if (m->dev->cuda && model_params_host(m)) dev_download_f32(m->dev, m->hparams, m->params, m->nparams);
}

void model_params_upload(model *m)
{
    if (m->dev->cuda && m->hparams) dev_upload_f32(m->dev, m->params, m->hparams, m->nparams);
}

void model_zero_grads(model *m)
{
    OPS->zero(DV, m->grads, m->nparams * sizeof(float));
}

/* The linear layers of the blocks go through the FP8 recipe when it is on; the
 * head stays in the compute dtype (as TransformerEngine leaves the output layer),
 * and so does the router (its top-k choice is where a rounding would flip an
 * expert, as Megatron and TransformerEngine keep it). Each expert's gate, up and
 * down are linear layers of their own (their own scales, as TransformerEngine's
 * GroupedLinear): after the L x LIN_COUNT dense ones, layer by layer, expert by
 * expert. which: a LIN_* or EXPERT_LIN(e, k). */
enum { LIN_Q, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, LIN_COUNT };
enum { EXP_GATE, EXP_UP, EXP_DOWN, EXP_LINS };
#define EXPERT_LIN(e, k) (LIN_COUNT + (e) * EXP_LINS + (k))

int model_fp8_linears(const model *m)
{
    return m->L * LIN_COUNT + m->L * m->E * EXP_LINS;
}

static int fp8_index(const model *m, int l, int which)
{
    if (which < LIN_COUNT) return l * LIN_COUNT + which;
    return m->L * LIN_COUNT + l * m->E * EXP_LINS + (which - LIN_COUNT);
}

static void lin_fwd(model *m, int l, int which, void *out, const void *inp, const void *w, int N, int IN, int OUT)
{
    if (m->fp8) OPS->fp8_linear_forward(DV, m->fp8, fp8_index(m, l, which), out, inp, w, N, IN, OUT);
    else OPS->linear_forward(DV, out, inp, w, N, IN, OUT);
}

static void lin_bwd(model *m, int l, int which, void *dinp, float *dw, const void *dout, const void *inp,
                    const void *w, int N, int IN, int OUT)
{
    if (m->fp8) OPS->fp8_linear_backward(DV, m->fp8, fp8_index(m, l, which), dinp, dw, dout, inp, w, N, IN, OUT);
    else OPS->linear_backward(DV, dinp, dw, dout, inp, w, N, IN, OUT);
}

/* The blocks' and the final norm over rows of H: LayerNorm with its bias (mean kept
 * for backward) or RMSNorm; backward accumulates into dinp and the weight's (and
 * bias's) gradients. */
static void norm_fwd(model *m, void *out, float *mean, float *rstd, const void *inp, const void *w, const void *b, int rows)
{
    if (m->d.layer_norm) OPS->layernorm_forward(DV, out, mean, rstd, inp, w, b, rows, m->H, m->eps);
    else OPS->rmsnorm_forward(DV, out, rstd, inp, w, rows, m->H, m->eps);
}

static void norm_bwd(model *m, void *dinp, float *dw, float *db, const void *dout, const void *inp, const void *w,
                     const float *mean, const float *rstd, int rows)
{
    if (m->d.layer_norm) OPS->layernorm_backward(DV, dinp, dw, db, dout, inp, w, mean, rstd, rows, m->H);
    else OPS->rmsnorm_backward(DV, dinp, dw, dout, inp, w, rstd, rows, m->H);
}

/* out[rows, C] += bias, when the family has one */
static void add_bias(model *m, void *out, const void *bias, int rows, int C)
{
    if (bias) OPS->bias_forward(DV, out, bias, rows, C);
}

static void bias_grad(model *m, float *dbias, const void *dout, int rows, int C)
{
    if (dbias) OPS->bias_backward(DV, dbias, dout, rows, C);
}

/* ---- ring attention over the cp group ------------------------------------------ */
#define CP_TAG 11
#define CP_GRAD_TAG 12 /* backward's dK/dV half, which travels apart from the K/V half */

/* one step of the ring: send n elements to the next cp rank, receive the previous one's */
static void cp_pass(model *m, const void *send, void *recv, size_t n, int tag)
{
    if (m->comm_err) return;
    const int C = m->cp_size, r = m->cp_rank;
    shard_status s = shard_comm_sendrecv(m->cp, send, (r + 1) % C, recv, (r + C - 1) % C, n, DV->dt, tag);
    if (s) m->comm_err = s;
}

/* cp_pass begun, so that the caller computes while the block moves (over MPI a
 * thread moves it; NCCL and the CUDA wrapper move it here); NULL when nothing is in
 * flight. Until cp_wait the caller only reads send and leaves recv alone. */
static shard_comm_req *cp_start(model *m, const void *send, void *recv, size_t n)
{
    if (m->comm_err) return NULL;
    const int C = m->cp_size, r = m->cp_rank;
    shard_comm_req *q = NULL;
    shard_status s = shard_comm_sendrecv_start(m->cp, send, (r + 1) % C, recv, (r + C - 1) % C, n, DV->dt, CP_TAG, &q);
    if (s) m->comm_err = s;
    return q;
}

static void cp_wait(model *m, shard_comm_req *q)
{
    shard_status s = shard_comm_wait(q);
    if (s && !m->comm_err) m->comm_err = s;
}

/* the document ids of cp rank i's tokens in the backend (NULL without documents) */
static const int32_t *doc_of(const model *m, int i)
{
    return m->docs ? m->doc_d + (size_t)i * m->B * m->T : NULL;
}

/* The ring's first block in cur: this rank's K and V (with grads, zeroed dK/dV
 * after them), its K/V pass to the next rank started. */
static shard_comm_req *ring_begin(model *m, const layer_acts *a, void *cur, void *nxt, size_t nk, int grads)
{
    OPS->copy(DV, cur, a->k, nk * DV->es);
    OPS->copy(DV, AT(cur, nk), a->v, nk * DV->es);
    if (grads) OPS->zero(DV, AT(cur, 2 * nk), 2 * nk * DV->es);
    return cp_start(m, cur, nxt, 2 * nk);
}

/* a->att, a->lse: attention of this rank's queries over the keys of the whole
 * sequence. The local block first; then C - 1 times the K/V block in hand goes to
 * the next rank and the previous rank's comes in (at pass j the block of cp rank
 * r - j), its partial result merged by log-sum-exp. A block that no query of this
 * rank may see (ring_need: documents, the window) still passes on, uncomputed.
 * Each pass is started before the compute on the block it sends (the local
 * attention overlaps the first): sending and computing both only read it, and
 * the results are those of the blocking ring, op for op. */
static void attention_forward(model *m, layer_acts *a)
{
    const int B = m->B, T = m->T, C = m->cp_size, r = m->cp_rank;
    const int32_t *qdoc = doc_of(m, C > 1 ? r : 0);
    const size_t nk = (size_t)B * T * m->nkv * m->hd;
    void *cur = m->ring[0], *nxt = m->ring[1];
    shard_comm_req *q = C > 1 ? ring_begin(m, a, cur, nxt, nk, 0) : NULL;
    OPS->attention_forward(DV, a->att, a->lse, a->q, a->k, a->v, m->pos_d, m->pos_d, qdoc, qdoc, B, T, T, m->nh,
                           m->nkv, m->hd, m->window);
    for (int j = 1; j < C; j++) {
        cp_wait(m, q);
        void *t = cur; cur = nxt; nxt = t;
        q = j < C - 1 ? cp_start(m, cur, nxt, 2 * nk) : NULL; /* nxt: sent, free again; the last block stays */
        const int src = (r - j + C) % C;
        if (!m->ring_need[src]) continue;
        OPS->attention_forward(DV, m->ring_out, m->ring_lse, a->q, cur, AT(cur, nk), m->pos_d,
                               m->cp_pos_d + (size_t)src * T, qdoc, doc_of(m, src), B, T, T, m->nh, m->nkv, m->hd,
                               m->window);
        OPS->attention_merge(DV, a->att, a->lse, m->ring_out, m->ring_lse, B, T, m->nh, m->hd);
    }
}

/* dq, dk, dv (zeroed by the caller) from datt, with the final out and lse: the local
 * pair first; then the K/V blocks go around the ring as in forward, each carrying
 * the dK/dV that the ranks it visited accumulated; after C - 1 passes the block in
 * hand is the next rank's, and one more pass of its dK/dV brings every block's
 * gradient home. A pass moves in two halves: the K/V half of the block that comes
 * next is started before the compute on the one in hand (K/V are only read), the
 * dK/dV half moves once that compute has finished it. */
static void attention_backward(model *m, layer_acts *a)
{
    const int B = m->B, T = m->T, C = m->cp_size, r = m->cp_rank;
    const int32_t *qdoc = doc_of(m, C > 1 ? r : 0);
    const size_t nk = (size_t)B * T * m->nkv * m->hd;
    void *cur = m->ring[0], *nxt = m->ring[1];
    shard_comm_req *q = C > 1 ? ring_begin(m, a, cur, nxt, nk, 1) : NULL;
    OPS->attention_backward(DV, m->dq, m->dk, m->dv, m->datt, a->q, a->k, a->v, a->att, a->lse, m->pos_d, m->pos_d,
                            qdoc, qdoc, B, T, T, m->nh, m->nkv, m->hd, m->window);
    if (C <= 1) return;
    for (int j = 1; j < C; j++) {
        cp_wait(m, q);
        cp_pass(m, AT(cur, 2 * nk), AT(nxt, 2 * nk), 2 * nk, CP_GRAD_TAG);
        void *t = cur; cur = nxt; nxt = t;
        q = j < C - 1 ? cp_start(m, cur, nxt, 2 * nk) : NULL; /* nxt: both halves sent, free again */
        const int src = (r - j + C) % C;
        if (!m->ring_need[src]) continue;
        OPS->attention_backward(DV, m->dq, AT(cur, 2 * nk), AT(cur, 3 * nk), m->datt, a->q, cur, AT(cur, nk), a->att,
                                a->lse, m->pos_d, m->cp_pos_d + (size_t)src * T, qdoc, doc_of(m, src), B, T, T, m->nh,
                                m->nkv, m->hd, m->window);
    }
    cp_pass(m, AT(cur, 2 * nk), AT(nxt, 2 * nk), 2 * nk, CP_GRAD_TAG); /* to the owner, r + 1; ours from r - 1 */
    OPS->add(DV, m->dk, m->dk, AT(nxt, 2 * nk), nk);
    OPS->add(DV, m->dv, m->dv, AT(nxt, 3 * nk), nk);
}

/* The working set of layer l: its own tensors where it keeps them, the shared
 * recompute set for the others (model.h, recompute_mode). */
static layer_acts *work(model *m, int l)
{
    if (m->recompute == RECOMPUTE_NONE) return &m->acts[l];
    layer_acts *a = &m->acts[l], *w = &m->wk;
    *w = m->rc;
    void **own[] = LAYER_BUFS(a), **mine[] = LAYER_BUFS(w);
    for (int j = 0; j < NBUFS; j++)
        if (kept(m, (const void *const *)own[j], a)) *mine[j] = *own[j];
    return w;
}

/* The four parts of a layer's forward, so that backward can recompute the first ones.
 * 1: input norm, q/k/v, RoPE, attention -> att, lse */
static void fwd_attention(model *m, int l, layer_acts *a)
{
    const int B = m->B, T = m->T, N = B * T, H = m->H, hd = m->hd, QD = m->nh * hd, KD = m->nkv * hd;
    const int Nl = (int)model_local_rows(m);
    const layer_params *w = &m->lw[l];
    if (sp_on(m)) { /* the norm on this rank's tokens, then all of them for the linears */
        norm_fwd(m, m->sp_loc, a->mean1, a->rstd1, a->x, w->norm_attn, w->norm_attn_bias, Nl);
        tp_allgather(m, m->sp_loc, a->xn1, (size_t)Nl * H);
    } else {
        norm_fwd(m, a->xn1, a->mean1, a->rstd1, a->x, w->norm_attn, w->norm_attn_bias, N);
    }
    /* with the q/k norm, the projections go to q_pre/k_pre and the norm to q/k */
    void *q = m->d.qk_norm ? a->q_pre : a->q, *k = m->d.qk_norm ? a->k_pre : a->k;
    if (m->d.fused_qkv) { /* GPT-NeoX: one projection, each head's [q, k, v] rows */
        lin_fwd(m, l, LIN_Q, m->qkv, a->xn1, w->qkv, N, H, 3 * QD);
        add_bias(m, m->qkv, w->qkv_bias, N, 3 * QD);
        OPS->qkv_split(DV, a->q, a->k, a->v, m->qkv, N, m->nh, hd);
    } else {
        lin_fwd(m, l, LIN_Q, q, a->xn1, w->q, N, H, QD);
        lin_fwd(m, l, LIN_K, k, a->xn1, w->k, N, H, KD);
        lin_fwd(m, l, LIN_V, a->v, a->xn1, w->v, N, H, KD);
        add_bias(m, q, w->q_bias, N, QD);
        add_bias(m, k, w->k_bias, N, KD);
        add_bias(m, a->v, w->v_bias, N, KD);
    }
    if (m->d.qk_norm) { /* RMSNorm over head_dim: one row per (token, head) */
        OPS->rmsnorm_forward(DV, a->q, a->rstd_q, q, w->q_norm, N * m->nh, hd, m->eps);
        OPS->rmsnorm_forward(DV, a->k, a->rstd_k, k, w->k_norm, N * m->nkv, hd, m->eps);
    }
    OPS->rope_forward(DV, a->q, m->cos_t, m->sin_t, 1, N, m->nh, hd, m->rd); /* a table row per token */
    OPS->rope_forward(DV, a->k, m->cos_t, m->sin_t, 1, N, m->nkv, hd, m->rd);
    attention_forward(m, a);
}

/* 2: output projection (and its bias, once the partial products are summed),
 * residual -> xmid, post-attention norm -> xn2: of xmid, or of x in a parallel
 * residual */
static void fwd_attention_out(model *m, int l, layer_acts *a)
{
    const int N = m->B * m->T, H = m->H, QD = m->nh * m->hd, Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    const layer_params *w = &m->lw[l];
    const void *ln2_in = m->d.parallel_residual ? a->x : a->xmid;
    lin_fwd(m, l, LIN_O, m->dxn, a->att, w->o, N, QD, H); /* dxn: scratch for the projection */
    if (sp_on(m)) {
        tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        add_bias(m, m->sp_loc, w->o_bias, Nl, H);
        OPS->add(DV, a->xmid, a->x, m->sp_loc, NlH);
        norm_fwd(m, m->sp_loc, a->mean2, a->rstd2, ln2_in, w->norm_mlp, w->norm_mlp_bias, Nl);
        tp_allgather(m, m->sp_loc, a->xn2, NlH);
    } else {
        tp_sum(m, m->dxn, (size_t)N * H); /* row-parallel: sum of the partial products */
        add_bias(m, m->dxn, w->o_bias, N, H);
        OPS->add(DV, a->xmid, a->x, m->dxn, (size_t)N * H);
        norm_fwd(m, a->xn2, a->mean2, a->rstd2, ln2_in, w->norm_mlp, w->norm_mlp_bias, N);
    }
}

/* ---- a mixture of experts ------------------------------------------------------ */
/* layer l's first row of each expert (and the end), in the current slot */
static int32_t *expert_rows(const model *m, int l)
{
    return m->eoff + ((size_t)m->slot * m->L + (size_t)l) * (size_t)(m->E + 1);
}

/* Group the N*k (token, choice) pairs by expert, tokens in order within each (in the
 * backend; the counts come to the host, they size the experts' GEMMs): a->rows[p] is
 * the token of row p, a->slot[t*k + j] the row of token t's choice j, off[e] expert
 * e's first row. */
static void moe_group(model *m, layer_acts *a, int32_t *off)
{
    OPS->moe_group(DV, off, a->rows, a->slot, a->idx, m->B * m->T, m->topk, m->E);
}

/* the load-balancing loss's statistics of one layer's tokens */
static void aux_add(model *m, const layer_acts *a, const int32_t *off)
{
    const int N = m->B * m->T, E = m->E;
    double *sums = m->aux + 2 * E + 1; /* scratch past the statistics */
    OPS->moe_prob_sums(DV, sums, a->probs, N, E);
    for (int e = 0; e < E; e++) {
        m->aux[e] += off[e + 1] - off[e];
        m->aux[E + e] += sums[e];
    }
    m->aux[2 * E] += N;
}

void model_aux_reset(model *m)
{
    if (m->E) memset(m->aux, 0, (2 * (size_t)m->E + 1) * sizeof *m->aux);
}

double model_aux_loss(const model *m)
{
    const int E = m->E;
    const double R = E ? m->aux[2 * E] : 0.0;
    double sum = 0.0;
    for (int e = 0; e < E && R > 0; e++) sum += (m->aux[e] / R) * (m->aux[E + e] / R);
    return sum * E;
}

shard_status model_aux_set_gradient(model *m, double coef)
{
    const int E = m->E, N = m->B * m->T;
    const double R = E ? m->aux[2 * E] : 0.0;
    if (!E || coef == 0.0 || R <= 0) {
        dfree(m, m->dprobs);
        m->dprobs = NULL;
        return SHARD_OK;
    }
    if (!m->dprobs && !(m->dprobs = dalloc(m, (size_t)N * E, sizeof(float)))) return dev_status(DV);
    for (int e = 0; e < E; e++) m->hprobs[e] = (float)(coef * E * (m->aux[e] / R) / R);
    for (int t = 1; t < N; t++) memcpy(m->hprobs + (size_t)t * E, m->hprobs, (size_t)E * sizeof(float));
    OPS->upload(DV, m->dprobs, m->hprobs, (size_t)N * E * sizeof(float));
    return dev_status(DV);
}

/* The local experts e0 .. e0+n-1 of layer l over a->xs, expert j's rows [off[j],
 * off[j+1]): gate, up, SwiGLU (into a->gate, up, act) and down into out */
static void experts_forward(model *m, int l, layer_acts *a, void *out, const int32_t *off, int e0, int n)
{
    const int H = m->H, FE = m->FE;
    const layer_params *w = &m->lw[l];
    for (int j = 0; j < n; j++) {
        const int r0 = off[j], c = off[j + 1] - off[j], e = e0 + j;
        if (!c) continue;
        lin_fwd(m, l, EXPERT_LIN(e, EXP_GATE), AT(a->gate, (size_t)r0 * FE), AT(a->xs, (size_t)r0 * H), w->egate[e], c,
                H, FE);
        lin_fwd(m, l, EXPERT_LIN(e, EXP_UP), AT(a->up, (size_t)r0 * FE), AT(a->xs, (size_t)r0 * H), w->eup[e], c, H, FE);
    }
    OPS->swiglu_forward(DV, a->act, a->gate, a->up, (size_t)off[n] * FE);
    for (int j = 0; j < n; j++) {
        const int r0 = off[j], c = off[j + 1] - off[j], e = e0 + j;
        if (c)
            lin_fwd(m, l, EXPERT_LIN(e, EXP_DOWN), AT(out, (size_t)r0 * H), AT(a->act, (size_t)r0 * FE), w->edown[e], c,
                    FE, H);
    }
}

/* Back through experts_forward: dout (the gradient of out) to dxs, the gradient of
 * a->xs (written; it may be dout's buffer: dout is spent first), weight gradients
 * accumulated */
static void experts_backward(model *m, int l, const layer_acts *a, const void *dout, void *dxs, const int32_t *off,
                             int e0, int n)
{
    const int H = m->H, FE = m->FE;
    const layer_params *w = &m->lw[l];
    layer_grads *g = &m->lg[l];
    const size_t rows = (size_t)off[n], e_ = DV->es;
    OPS->zero(DV, m->dact, rows * FE * e_);
    for (int j = 0; j < n; j++) {
        const int r0 = off[j], c = off[j + 1] - off[j], e = e0 + j;
        if (c)
            lin_bwd(m, l, EXPERT_LIN(e, EXP_DOWN), AT(m->dact, (size_t)r0 * FE), g->edown[e], CAT(dout, (size_t)r0 * H),
                    AT(a->act, (size_t)r0 * FE), w->edown[e], c, FE, H);
    }
    OPS->zero(DV, m->dgate, rows * FE * e_);
    OPS->zero(DV, m->dup, rows * FE * e_);
    OPS->swiglu_backward(DV, m->dgate, m->dup, m->dact, a->gate, a->up, rows * FE);
    OPS->zero(DV, dxs, rows * H * e_);
    for (int j = 0; j < n; j++) {
        const int r0 = off[j], c = off[j + 1] - off[j], e = e0 + j;
        if (!c) continue;
        void *dx = AT(dxs, (size_t)r0 * H);
        const void *xs = AT(a->xs, (size_t)r0 * H);
        lin_bwd(m, l, EXPERT_LIN(e, EXP_GATE), dx, g->egate[e], AT(m->dgate, (size_t)r0 * FE), xs, w->egate[e], c, H, FE);
        lin_bwd(m, l, EXPERT_LIN(e, EXP_UP), dx, g->eup[e], AT(m->dup, (size_t)r0 * FE), xs, w->eup[e], c, H, FE);
    }
}

/* ---- expert parallelism: the rows of expert e go to ep rank e / (E/ep) ---------- */
enum { EP_MAX = SHARD_MAX_EP };

/* layer l's rows received from each ep rank for each of this rank's E/ep experts */
static int32_t *ep_counts(const model *m, int l)
{
    return m->epc + ((size_t)m->slot * m->L + (size_t)l) * (size_t)m->E;
}

/* the exchange's element counts and offsets: what this rank sends to each ep rank (its
 * rows for that rank's experts, contiguous in off's order) and receives from each */
static void ep_plan(const model *m, int l, size_t *sc, size_t *sd, size_t *rc, size_t *rd)
{
    const int ep = m->ep_size, El = m->E / ep;
    const int32_t *off = expert_rows(m, l), *cnt = ep_counts(m, l);
    size_t at = 0;
    for (int r = 0; r < ep; r++) {
        sd[r] = (size_t)off[r * El] * m->H;
        sc[r] = (size_t)(off[(r + 1) * El] - off[r * El]) * m->H;
        size_t n = 0;
        for (int j = 0; j < El; j++) n += (size_t)cnt[r * El + j];
        rd[r] = at;
        rc[r] = n * m->H;
        at += rc[r];
    }
}

/* this rank's experts' rows by expert: offsets loff[E/ep + 1] into the rows received
 * (source-major: rank r's rows for expert 0, 1, ...), and, in the backend, erows (the
 * received row of each) and einv (its inverse) */
static void ep_order(model *m, int l, layer_acts *a, int32_t *loff, int upload)
{
    const int ep = m->ep_size, El = m->E / ep;
    const int32_t *cnt = ep_counts(m, l);
    loff[0] = 0;
    for (int j = 0; j < El; j++) {
        loff[j + 1] = loff[j];
        for (int r = 0; r < ep; r++) loff[j + 1] += cnt[r * El + j];
    }
    if (!upload) return;
    int32_t src = 0;
    for (int r = 0; r < ep; r++)
        for (int j = 0; j < El; j++) {
            int32_t dst = loff[j];
            for (int r2 = 0; r2 < r; r2++) dst += cnt[r2 * El + j];
            for (int32_t k = 0; k < cnt[r * El + j]; k++, src++) {
                m->hem[dst + k] = src;
                m->hinv[src] = dst + k;
            }
        }
    const size_t bytes = (size_t)loff[El] * sizeof(int32_t);
    if (DV->cuda) {
        OPS->upload(DV, a->erows, m->hem, bytes);
        OPS->upload(DV, a->einv, m->hinv, bytes);
    } else {
        memcpy(a->erows, m->hem, bytes);
        memcpy(a->einv, m->hinv, bytes);
    }
}

static void ep_alltoall(model *m, const void *send, const size_t *sc, const size_t *sd, void *recv, const size_t *rc,
                        const size_t *rd)
{
    if (m->comm_err) return;
    shard_status s = shard_comm_alltoallv(m->ep_d, send, sc, sd, recv, rc, rd, DV->dt);
    if (s) m->comm_err = s;
}

/* forward with expert parallelism, from the rows grouped by expert in xs_local: every
 * ep rank's counts, the rows to their experts' ranks, this rank's experts on what came,
 * the results back into a->ys */
static void ep_forward(model *m, int l, layer_acts *a, const void *xs_local)
{
    const int ep = m->ep_size, El = m->E / ep, H = m->H;
    const int32_t *off = expert_rows(m, l);
    int32_t *cnt = m->hcur, *loff = m->hloff;
    size_t sc[EP_MAX], sd[EP_MAX], rc[EP_MAX], rd[EP_MAX], one[EP_MAX], at[EP_MAX];
    for (int e = 0; e < m->E; e++) cnt[e] = off[e + 1] - off[e];
    for (int r = 0; r < ep; r++) {
        one[r] = (size_t)El;
        at[r] = (size_t)r * El;
    }
    if (!m->comm_err) {
        shard_status s = shard_comm_alltoallv(m->ep_h, cnt, one, at, ep_counts(m, l), one, at, SHARD_DT_I32);
        if (s) m->comm_err = s;
    }
    ep_plan(m, l, sc, sd, rc, rd);
    ep_order(m, l, a, loff, 1);
    ep_alltoall(m, xs_local, sc, sd, m->epa, rc, rd);
    OPS->moe_gather(DV, a->xs, m->epa, a->erows, loff[El], H);
    experts_forward(m, l, a, m->epb, loff, m->ep_rank * El, El);
    OPS->moe_gather(DV, m->epa, m->epb, a->einv, loff[El], H);
    ep_alltoall(m, m->epa, rc, rd, a->ys, sc, sd);
}

/* backward with expert parallelism: dys (the gradient of a->ys) to the experts' ranks,
 * back through them, the gradient of the rows sent back into dxs */
static void ep_backward(model *m, int l, const layer_acts *a, const void *dys, void *dxs)
{
    const int ep = m->ep_size, El = m->E / ep, H = m->H;
    int32_t *loff = m->hloff;
    size_t sc[EP_MAX], sd[EP_MAX], rc[EP_MAX], rd[EP_MAX];
    ep_plan(m, l, sc, sd, rc, rd);
    ep_order(m, l, (layer_acts *)a, loff, 0);
    ep_alltoall(m, dys, sc, sd, m->epa, rc, rd);
    OPS->moe_gather(DV, m->epb, m->epa, a->erows, loff[El], H);
    experts_backward(m, l, a, m->epb, m->epa, loff, m->ep_rank * El, El);
    OPS->moe_gather(DV, m->epb, m->epa, a->einv, loff[El], H);
    ep_alltoall(m, m->epb, rc, rd, dxs, sc, sd);
}

/* 3 (experts): the router's top-k, the routed rows of xn2, each expert's gate, up,
 * SwiGLU and down into ys (the weighted sum of ys is part 4's) */
static void fwd_moe(model *m, int l, layer_acts *a)
{
    const int N = m->B * m->T, H = m->H, E = m->E, k = m->topk, Nk = N * k;
    const layer_params *w = &m->lw[l];
    OPS->linear_forward(DV, m->rlogits, a->xn2, w->router, N, H, E);
    OPS->moe_route(DV, a->probs, a->idx, a->wts, m->rlogits, N, E, k, m->d.norm_topk_prob);
    int32_t *off = expert_rows(m, l);
    moe_group(m, a, off);
    if (m->aux_collect) aux_add(m, a, off);
    if (m->ep_size > 1) {
        OPS->moe_gather(DV, m->epb, a->xn2, a->rows, Nk, H);
        ep_forward(m, l, a, m->epb);
        return;
    }
    OPS->moe_gather(DV, a->xs, a->xn2, a->rows, Nk, H);
    experts_forward(m, l, a, a->ys, off, 0, E);
}

/* back through the experts from dout (all N rows: the gradient of the weighted sum);
 * the gradient of xn2 is left in dxn: this rank's part of the experts' (summed over
 * tp by the caller) and, on tp rank 0 only, the router's (every tp rank computes it
 * whole) */
static void bwd_moe(model *m, int l, const layer_acts *a, const void *dout)
{
    const int N = m->B * m->T, H = m->H, E = m->E, k = m->topk, Nk = N * k;
    const layer_params *w = &m->lw[l];
    layer_grads *g = &m->lg[l];
    OPS->moe_combine_backward(DV, m->dxs, m->dwts, dout, a->ys, a->wts, a->slot, N, k, H); /* dxs: dys first */
    tp_reduce(m, m->dwts, (size_t)Nk, SHARD_DT_F32, SHARD_OP_SUM); /* ys are this rank's partial products */
    if (m->ep_size > 1) ep_backward(m, l, a, m->dxs, m->dxs);
    else experts_backward(m, l, a, m->dxs, m->dxs, expert_rows(m, l), 0, E);
    OPS->zero(DV, m->dxn, (size_t)N * H * DV->es);
    OPS->moe_scatter_add(DV, m->dxn, m->dxs, a->slot, N, k, H);
    OPS->moe_route_backward(DV, m->rlogits, m->dwts, m->dprobs, a->probs, a->idx, N, E, k, m->d.norm_topk_prob);
    const int first_tp = m->tp_size <= 1 || !m->tp || shard_comm_rank(m->tp) == 0;
    OPS->linear_backward(DV, first_tp ? m->dxn : NULL, g->router, m->rlogits, a->xn2, w->router, N, H, E);
}

/* 3: gate, up, SwiGLU -> act; or up (and its bias), GELU; or the experts */
static void fwd_mlp(model *m, int l, layer_acts *a)
{
    const int N = m->B * m->T, H = m->H, F = m->F;
    const layer_params *w = &m->lw[l];
    if (m->E) {
        fwd_moe(m, l, a);
        return;
    }
    lin_fwd(m, l, LIN_UP, a->up, a->xn2, w->up, N, H, F);
    add_bias(m, a->up, w->up_bias, N, F);
    if (m->d.gelu_mlp) {
        OPS->gelu_forward(DV, a->act, a->up, (size_t)N * F);
        return;
    }
    lin_fwd(m, l, LIN_GATE, a->gate, a->xn2, w->gate, N, H, F);
    OPS->swiglu_forward(DV, a->act, a->gate, a->up, (size_t)N * F);
}

/* 4: down projection (and its bias), residual -> the next layer's input */
static void fwd_mlp_out(model *m, int l, layer_acts *a, void *xnext)
{
    const int N = m->B * m->T, H = m->H, F = m->F, Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    if (m->E) OPS->moe_combine(DV, m->dxn, a->ys, a->wts, a->slot, N, m->topk, H); /* the k experts' weighted sum */
    else lin_fwd(m, l, LIN_DOWN, m->dxn, a->act, m->lw[l].down, N, F, H);
    if (sp_on(m)) {
        tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        add_bias(m, m->sp_loc, m->lw[l].down_bias, Nl, H);
        OPS->add(DV, xnext, a->xmid, m->sp_loc, NlH);
    } else {
        tp_sum(m, m->dxn, (size_t)N * H);
        add_bias(m, m->dxn, m->lw[l].down_bias, N, H);
        OPS->add(DV, xnext, a->xmid, m->dxn, (size_t)N * H);
    }
}

/* the microbatch's tokens and targets where the backend reads them */
static void put_tokens(model *m, const int32_t *tokens, const int32_t *targets, const int32_t **tok,
                       const int32_t **tgt)
{
    const size_t n = (size_t)m->B * m->T * sizeof(int32_t);
    if (!DV->cuda) {
        *tok = tokens;
        *tgt = targets;
        return;
    }
    if (tokens) OPS->upload(DV, m->tok_d, tokens, n);
    if (targets) OPS->upload(DV, m->tgt_d, targets, n);
    *tok = m->tok_d;
    *tgt = m->tgt_d;
}

/* The head and the vocabulary-parallel cross-entropy over the final norm's output xnf,
 * head_rows tokens at a time: their logits, the rows' max, sum of exps and target logit
 * (each reduced over tp; on one rank the reductions are the identity) and losses. In
 * training (loss_scale: d loss / d sum of the losses), each chunk's logits then become
 * their gradient in place, which goes at once into the head's gradient and dxn (the
 * gradient of xnf, this rank's part): the logits of the whole microbatch are never
 * held, nor computed twice. Returns the sum of the losses. */
static double head_loss(model *m, const int32_t *tgt, const float *loss_scale)
{
    const int N = m->B * m->T, H = m->H, Vl = m->vocab_local;
    double total = 0.0;
    if (loss_scale) OPS->zero(DV, m->dxn, (size_t)N * H * DV->es);
    for (int r0 = 0; r0 < N; r0 += m->head_rows) {
        const int n = N - r0 < m->head_rows ? N - r0 : m->head_rows;
        const void *x = AT(m->xnf, (size_t)r0 * H);
        /* the chunk's sums of exps and target logits side by side: one all-reduce */
        float *mx = m->rowmax + r0, *se = m->sumexp + 2 * (size_t)r0, *tl = se + n;
        OPS->linear_forward(DV, m->logits, x, m->head, n, H, Vl);
        OPS->xent_rowmax(DV, mx, tl, m->logits, tgt + r0, n, Vl, m->vocab_start);
        tp_reduce(m, mx, (size_t)n, SHARD_DT_F32, SHARD_OP_MAX);
        OPS->xent_sumexp(DV, se, m->logits, mx, n, Vl);
        tp_reduce(m, se, 2 * (size_t)n, SHARD_DT_F32, SHARD_OP_SUM); /* the target's logit: one owner */
        total += OPS->xent_loss(DV, m->losses + r0, mx, se, tl, tgt + r0, n);
        if (!loss_scale) continue;
        OPS->xent_backward(DV, m->logits, m->logits, mx, se, tgt + r0, n, Vl, m->vocab_start, *loss_scale);
        OPS->linear_backward(DV, AT(m->dxn, (size_t)r0 * H), m->dhead, m->logits, x, m->head, n, H, Vl);
    }
    return total;
}

/* the forward of one microbatch; with a loss_scale, training's (head_loss) */
static double forward(model *m, const int32_t *tokens, const int32_t *targets, const float *loss_scale)
{
    const int B = m->B, T = m->T, N = B * T, H = m->H, Vl = m->vocab_local;
    const int sp = sp_on(m), Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    const int32_t *tok, *tgt;
    put_tokens(m, m->first ? tokens : NULL, m->last ? targets : NULL, &tok, &tgt);
    if (m->first) {
        void *x0 = model_stage_input(m);
        if (sp) { /* vocab-parallel partial rows of all N tokens, summed into this rank's tokens */
            OPS->embedding_forward(DV, m->dxn, tok, m->embed, N, H, m->vocab_start, Vl);
            tp_reduce_scatter(m, m->dxn, x0, NlH);
        } else {
            OPS->embedding_forward(DV, x0, tok, m->embed, N, H, m->vocab_start, Vl);
            tp_sum(m, x0, (size_t)N * H); /* vocab-parallel: rows of the others */
        }
    }
    m->aux_collect = m->E > 0;
    for (int l = m->l0; l < m->l1; l++) {
        layer_acts *a = work(m, l);
        fwd_attention(m, l, a);
        fwd_attention_out(m, l, a);
        fwd_mlp(m, l, a);
        fwd_mlp_out(m, l, a, l + 1 < m->l1 ? m->acts[l + 1].x : m->xL);
    }
    m->aux_collect = 0;
    if (!m->last) return 0.0; /* the output, xL, goes to the next stage */
    if (sp) {
        norm_fwd(m, m->sp_loc, m->meanf, m->rstdf, m->xL, m->norm_final, m->norm_final_bias, Nl);
        tp_allgather(m, m->sp_loc, m->xnf, NlH); /* the head and the loss on all N tokens */
    } else {
        norm_fwd(m, m->xnf, m->meanf, m->rstdf, m->xL, m->norm_final, m->norm_final_bias, N);
    }
    return head_loss(m, tgt, loss_scale);
}

double model_forward(model *m, const int32_t *tokens, const int32_t *targets)
{
    return forward(m, tokens, targets, NULL);
}

double model_forward_train(model *m, const int32_t *tokens, const int32_t *targets, float loss_scale)
{
    const double loss = forward(m, tokens, targets, &loss_scale);
    if (!m->last) return loss;
    /* on to the gradient of xL, which a stage before the last receives in dx */
    const size_t NH = (size_t)m->B * m->T * m->H, NlH = model_local_rows(m) * m->H;
    const int sp = sp_on(m);
    if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
    else tp_sum(m, m->dxn, NH); /* the head is column-parallel over the vocabulary */
    OPS->zero(DV, m->dx, NlH * DV->es);
    norm_bwd(m, m->dx, m->dnorm_final, m->dnorm_final_bias, sp ? m->sp_loc : m->dxn, m->xL, m->norm_final, m->meanf,
             m->rstdf, (int)model_local_rows(m));
    return loss;
}

/* Qwen3: back through the per-head RMSNorm of q and k: *dq and *dk (the gradients of
 * the normed q and k) become those of the projections' outputs, in m->dqk_pre */
static void qk_norm_backward(model *m, int l, const layer_acts *a, void **dq, void **dk)
{
    const size_t N = (size_t)m->B * m->T, QD = (size_t)m->nh * m->hd, KD = (size_t)m->nkv * m->hd;
    void *dqp = m->dqk_pre, *dkp = AT(m->dqk_pre, N * QD);
    const layer_params *w = &m->lw[l];
    layer_grads *g = &m->lg[l];
    OPS->zero(DV, m->dqk_pre, N * (QD + KD) * DV->es); /* backward ops accumulate */
    OPS->rmsnorm_backward(DV, dqp, g->q_norm, *dq, a->q_pre, w->q_norm, a->rstd_q, (int)N * m->nh, m->hd);
    OPS->rmsnorm_backward(DV, dkp, g->k_norm, *dk, a->k_pre, w->k_norm, a->rstd_k, (int)N * m->nkv, m->hd);
    *dq = dqp;
    *dk = dkp;
}

/* back through the MLP of layer l: dout (all N rows) is the gradient of the down
 * projection's output; the gradient of xn2 is left in dxn (this rank's part, to sum) */
static void bwd_mlp(model *m, int l, const layer_acts *a, const void *dout)
{
    const int N = m->B * m->T, H = m->H, F = m->F;
    const size_t NF = (size_t)N * F, e = DV->es;
    const layer_params *w = &m->lw[l];
    layer_grads *g = &m->lg[l];
    if (m->E) {
        bwd_moe(m, l, a, dout);
        return;
    }
    OPS->zero(DV, m->dact, NF * e);
    lin_bwd(m, l, LIN_DOWN, m->dact, g->down, dout, a->act, w->down, N, F, H);
    OPS->zero(DV, m->dup, NF * e);
    OPS->zero(DV, m->dxn, (size_t)N * H * e);
    if (m->d.gelu_mlp) {
        OPS->gelu_backward(DV, m->dup, m->dact, a->up, NF);
    } else {
        OPS->zero(DV, m->dgate, NF * e);
        OPS->swiglu_backward(DV, m->dgate, m->dup, m->dact, a->gate, a->up, NF);
        lin_bwd(m, l, LIN_GATE, m->dxn, g->gate, m->dgate, a->xn2, w->gate, N, H, F);
    }
    bias_grad(m, g->up_bias, m->dup, N, F);
    lin_bwd(m, l, LIN_UP, m->dxn, g->up, m->dup, a->xn2, w->up, N, H, F);
}

/* back through the projections of layer l, from the gradients of q, k and v (after
 * RoPE's and the q/k norm's backward); the gradient of xn1 is left in dxn */
static void bwd_qkv(model *m, int l, const layer_acts *a, const void *dq, const void *dk)
{
    const int N = m->B * m->T, H = m->H, QD = m->nh * m->hd, KD = m->nkv * m->hd;
    const layer_params *w = &m->lw[l];
    layer_grads *g = &m->lg[l];
    OPS->zero(DV, m->dxn, (size_t)N * H * DV->es);
    if (m->d.fused_qkv) {
        OPS->qkv_merge(DV, m->qkv, dq, dk, m->dv, N, m->nh, m->hd);
        bias_grad(m, g->qkv_bias, m->qkv, N, 3 * QD);
        lin_bwd(m, l, LIN_Q, m->dxn, g->qkv, m->qkv, a->xn1, w->qkv, N, H, 3 * QD);
        return;
    }
    bias_grad(m, g->q_bias, dq, N, QD);
    bias_grad(m, g->k_bias, dk, N, KD);
    bias_grad(m, g->v_bias, m->dv, N, KD);
    lin_bwd(m, l, LIN_Q, m->dxn, g->q, dq, a->xn1, w->q, N, H, QD);
    lin_bwd(m, l, LIN_K, m->dxn, g->k, dk, a->xn1, w->k, N, H, KD);
    lin_bwd(m, l, LIN_V, m->dxn, g->v, m->dv, a->xn1, w->v, N, H, KD);
}

void model_backward(model *m, const int32_t *tokens)
{
    const int B = m->B, T = m->T, N = B * T, H = m->H, hd = m->hd;
    const int QD = m->nh * hd, KD = m->nkv * hd, Vl = m->vocab_local;
    const size_t NH = (size_t)N * H, e = DV->es;
    const int sp = sp_on(m), Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    const int32_t *tok, *tgt;
    put_tokens(m, m->first ? tokens : NULL, NULL, &tok, &tgt);
    /* sp: the input gradient of the column-parallel linears is reduce-scattered to
     * this rank's tokens (sp_loc) for the norm's backward; the other way, dx (this
     * rank's tokens) is all-gathered into dxn before the row-parallel linears */
    void *dnorm = sp ? m->sp_loc : m->dxn;
    /* m->dx holds d loss / d (residual stream) as it goes down the layers: each
     * block adds its branch's gradient to it (the norms' backward accumulates) */
    for (int l = m->l1 - 1; l >= m->l0; l--) {
        layer_acts *a = work(m, l);
        if (m->recompute != RECOMPUTE_NONE) fwd_attention(m, l, a);
        if (m->recompute == RECOMPUTE_FULL) {
            fwd_attention_out(m, l, a);
            fwd_mlp(m, l, a);
        }
        const layer_params *w = &m->lw[l];
        layer_grads *g = &m->lg[l];
        /* MLP: x_next = xmid + down(mlp(xn2)). A parallel residual's attention branch
         * takes d x_next as it is, before the MLP's norm adds to it: kept in dres */
        const void *dattn = m->dx;
        if (m->d.parallel_residual) {
            OPS->copy(DV, m->dres, m->dx, NlH * e);
            dattn = m->dres;
        }
        bias_grad(m, g->down_bias, m->dx, Nl, H); /* this rank's tokens: summed over tp with sp */
        const void *dout = m->dx;
        if (sp) {
            tp_allgather(m, m->dx, m->dxn, NlH);
            dout = m->dxn;
        }
        bwd_mlp(m, l, a, dout);
        if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        else tp_sum(m, m->dxn, NH); /* column-parallel: input gradient summed, then the norm */
        norm_bwd(m, m->dx, g->norm_mlp, g->norm_mlp_bias, dnorm, m->d.parallel_residual ? a->x : a->xmid, w->norm_mlp,
                 a->mean2, a->rstd2, Nl);
        /* attention: xmid = x + o(attn(rope(q(xn1)), rope(k(xn1)), v(xn1))) */
        bias_grad(m, g->o_bias, dattn, Nl, H);
        dout = dattn;
        if (sp) {
            tp_allgather(m, dattn, m->dxn, NlH);
            dout = m->dxn;
        }
        OPS->zero(DV, m->datt, (size_t)N * QD * e);
        lin_bwd(m, l, LIN_O, m->datt, g->o, dout, a->att, w->o, N, QD, H);
        OPS->zero(DV, m->dq, (size_t)N * QD * e);
        OPS->zero(DV, m->dk, (size_t)N * KD * e);
        OPS->zero(DV, m->dv, (size_t)N * KD * e);
        attention_backward(m, a);
        OPS->rope_backward(DV, m->dq, m->cos_t, m->sin_t, 1, N, m->nh, hd, m->rd);
        OPS->rope_backward(DV, m->dk, m->cos_t, m->sin_t, 1, N, m->nkv, hd, m->rd);
        void *dq = m->dq, *dk = m->dk; /* the gradients of the projections' outputs */
        if (m->d.qk_norm) qk_norm_backward(m, l, a, &dq, &dk);
        bwd_qkv(m, l, a, dq, dk);
        if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        else tp_sum(m, m->dxn, NH);
        norm_bwd(m, m->dx, g->norm_attn, g->norm_attn_bias, dnorm, a->x, w->norm_attn, a->mean1, a->rstd1, Nl);
    }
    if (m->first) {
        const void *demb = m->dx;
        if (sp) { /* the gradient of every token's row: this rank's vocabulary rows */
            tp_allgather(m, m->dx, m->dxn, NlH);
            demb = m->dxn;
        }
        OPS->embedding_backward(DV, m->dembed, demb, tok, N, H, m->vocab_start, Vl);
    }
}
