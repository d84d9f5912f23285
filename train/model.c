/* train/model.c: the Llama/Mistral model of one rank, forward and backward (see model.h). */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

static void *zalloc(size_t n, size_t size)
{
    return calloc(n ? n : 1, size);
}

long model_find(const model *m, const char *name)
{
    for (size_t i = 0; i < m->ntensors; i++)
        if (!strcmp(m->spec[i].name, name)) return (long)i;
    return -1;
}

/* point the per-tensor views at params/grads (offsets and sizes already set) */
static shard_status bind(model *m)
{
    m->embed = m->norm_final = m->head = m->dembed = m->dnorm_final = m->dhead = NULL;
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        float *p = m->params + m->offset[i], *g = m->grads + m->offset[i];
        layer_params *lw = t->layer >= 0 ? &m->lw[t->layer] : NULL, *lg = t->layer >= 0 ? &m->lg[t->layer] : NULL;
        switch (t->role) {
        case SHARD_T_EMBED: m->embed = p; m->dembed = g; break;
        case SHARD_T_Q: lw->q = p; lg->q = g; break;
        case SHARD_T_K: lw->k = p; lg->k = g; break;
        case SHARD_T_V: lw->v = p; lg->v = g; break;
        case SHARD_T_O: lw->o = p; lg->o = g; break;
        case SHARD_T_GATE: lw->gate = p; lg->gate = g; break;
        case SHARD_T_UP: lw->up = p; lg->up = g; break;
        case SHARD_T_DOWN: lw->down = p; lg->down = g; break;
        case SHARD_T_NORM_ATTN: lw->norm_attn = p; lg->norm_attn = g; break;
        case SHARD_T_NORM_MLP: lw->norm_mlp = p; lg->norm_mlp = g; break;
        case SHARD_T_NORM_FINAL: m->norm_final = p; m->dnorm_final = g; break;
        case SHARD_T_HEAD: m->head = p; m->dhead = g; break;
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

shard_status model_create(model *m, const shard_model_desc *d)
{
    memset(m, 0, sizeof *m);
    m->d = *d;
    m->V = (int)d->vocab;
    m->H = (int)d->hidden;
    m->F = (int)d->intermediate;
    m->L = (int)d->layers;
    m->nh = (int)d->heads;
    m->nkv = (int)d->kv_heads;
    m->hd = (int)d->head_dim;
    m->window = (int)d->sliding_window;
    m->vocab_start = 0;
    m->vocab_local = m->V;
    m->l0 = 0;
    m->l1 = m->L;
    m->first = m->last = 1;
    m->eps = (float)d->rms_norm_eps;
    if (m->hd % 2) return shard_fail(SHARD_E_UNSUPPORTED, "head_dim %d is odd: RoPE needs an even head_dim", m->hd);
    m->ntensors = shard_model_tensor_count(d);
    m->spec = zalloc(m->ntensors, sizeof *m->spec);
    m->offset = zalloc(m->ntensors, sizeof *m->offset);
    m->numel = zalloc(m->ntensors, sizeof *m->numel);
    m->lw = zalloc((size_t)m->L, sizeof *m->lw);
    m->lg = zalloc((size_t)m->L, sizeof *m->lg);
    m->inv_freq = zalloc((size_t)m->hd / 2, sizeof(float));
    if (!m->spec || !m->offset || !m->numel || !m->lw || !m->lg || !m->inv_freq) goto nomem;
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
    m->params = zalloc(off, sizeof(float));
    m->grads = zalloc(off, sizeof(float));
    if (!m->params || !m->grads) goto nomem;
    shard_status st = bind(m);
    if (st) {
        model_free(m);
        return st;
    }
    op_rope_params rp = {(float)d->rope_theta, d->rope_llama3, (float)d->rope_factor, (float)d->rope_low_freq_factor,
                         (float)d->rope_high_freq_factor, (float)d->rope_original_max_positions};
    op_rope_inv_freq(m->inv_freq, m->hd, &rp);
    return SHARD_OK;
nomem:
    model_free(m);
    return shard_fail(SHARD_E_NOMEM, "out of memory for the model's parameters");
}

shard_status model_localize(model *m, const shard_piece *pieces, int tp)
{
    if (m->acts) return shard_fail(SHARD_E_INTERNAL, "model_localize after model_alloc_acts");
    size_t off = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_tensor_spec *t = &m->spec[i];
        const shard_box *b = &pieces[i].box;
        size_t n = pieces[i].holds ? (size_t)shard_box_numel(b) : 0;
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
        case SHARD_T_GATE: m->F = (int)b->len[0]; break;
        default: break;
        }
    }
    free(m->params);
    free(m->grads);
    m->nparams = off;
    m->params = zalloc(off, sizeof(float));
    m->grads = zalloc(off, sizeof(float));
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

static void tp_sum(model *m, float *buf, size_t n, shard_op op)
{
    if (m->tp_size <= 1 || !m->tp || m->comm_err) return;
    shard_status s = shard_comm_allreduce(m->tp, buf, n, SHARD_DT_F32, op);
    if (s) m->comm_err = s;
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
static void tp_reduce_scatter(model *m, const float *full, float *loc, size_t nloc)
{
    if (m->comm_err) return;
    shard_status s = shard_comm_reduce_scatter(m->tp, full, loc, nloc, SHARD_DT_F32, SHARD_OP_SUM);
    if (s) m->comm_err = s;
}

/* loc[N/tp rows] of every tp rank -> full[N rows] */
static void tp_allgather(model *m, const float *loc, float *full, size_t nloc)
{
    if (m->comm_err) return;
    shard_status s = shard_comm_allgather(m->tp, loc, full, nloc, SHARD_DT_F32);
    if (s) m->comm_err = s;
}

void model_set_cp(model *m, shard_comm *cp, int cp_size, int cp_rank)
{
    m->cp = cp;
    m->cp_size = cp_size;
    m->cp_rank = cp_rank;
}

static void free_slot(model *m, act_slot *sl)
{
    if (sl->acts) {
        for (int l = 0; l < m->L; l++) {
            layer_acts *a = &sl->acts[l];
            float **all[] = {&a->x, &a->rstd1, &a->xn1, &a->q, &a->k, &a->v, &a->att, &a->lse,
                             &a->xmid, &a->rstd2, &a->xn2, &a->gate, &a->up, &a->act};
            for (size_t k = 0; k < sizeof all / sizeof *all; k++) free(*all[k]);
        }
        free(sl->acts);
    }
    float **bufs[] = {&sl->xL, &sl->rstdf, &sl->xnf, &sl->logits, &sl->rowmax, &sl->sumexp, &sl->losses};
    for (size_t k = 0; k < sizeof bufs / sizeof *bufs; k++) free(*bufs[k]);
    memset(sl, 0, sizeof *sl);
}

static void free_acts(model *m)
{
    for (int k = 0; m->slots && k < m->nslots; k++) free_slot(m, &m->slots[k]);
    free(m->slots);
    m->slots = NULL;
    m->nslots = 0;
    m->acts = NULL;
    m->xL = m->rstdf = m->xnf = m->logits = m->rowmax = m->sumexp = m->losses = NULL;
    m->target_logit = NULL; /* the second half of sumexp's buffer */
    float **bufs[] = {&m->cos_t, &m->sin_t, &m->dx, &m->dxn, &m->dq, &m->dk, &m->dv,
                      &m->datt, &m->dgate, &m->dup, &m->dact, &m->dlogits, &m->ring[0], &m->ring[1],
                      &m->ring_out, &m->ring_lse, &m->sp_loc};
    for (size_t k = 0; k < sizeof bufs / sizeof *bufs; k++) {
        free(*bufs[k]);
        *bufs[k] = NULL;
    }
    free(m->pos);
    m->pos = NULL;
    free(m->cp_pos);
    m->cp_pos = NULL;
}

void model_use_slot(model *m, int k)
{
    act_slot *sl = &m->slots[k];
    m->slot = k;
    m->acts = sl->acts;
    m->xL = sl->xL;
    m->rstdf = sl->rstdf;
    m->xnf = sl->xnf;
    m->logits = sl->logits;
    m->rowmax = sl->rowmax;
    m->sumexp = sl->sumexp;
    m->target_logit = sl->sumexp ? sl->sumexp + (size_t)m->B * m->T : NULL; /* one all-reduce for both */
    m->losses = sl->losses;
}

float *model_stage_input(model *m)
{
    return m->l0 < m->l1 ? m->acts[m->l0].x : m->xL;
}

void model_free(model *m)
{
    if (!m) return;
    free_acts(m);
    free(m->spec); free(m->offset); free(m->numel); free(m->lw); free(m->lg); free(m->inv_freq);
    free(m->params); free(m->grads);
    fp8_free(m->fp8);
    memset(m, 0, sizeof *m);
}

shard_status model_alloc_acts(model *m, int B, int T)
{
    return model_alloc_slots(m, B, T, 1);
}

shard_status model_alloc_slots(model *m, int B, int T, int nslots)
{
    free_acts(m);
    if (sp_on(m) && ((size_t)B * T) % (size_t)m->tp_size)
        return shard_fail(SHARD_E_USAGE, "sequence parallelism: %d x %d tokens per microbatch are not divisible by tp = %d",
                          B, T, m->tp_size);
    m->B = B;
    m->T = T;
    const size_t N = (size_t)B * T, H = (size_t)m->H, F = (size_t)m->F;
    const size_t QD = (size_t)m->nh * m->hd, KD = (size_t)m->nkv * m->hd, Vl = (size_t)m->vocab_local;
    int ok = 1;
#define A(p, n) do { (p) = zalloc((n), sizeof(float)); ok &= (p) != NULL; } while (0)
    m->slots = zalloc((size_t)nslots, sizeof *m->slots);
    ok &= m->slots != NULL;
    if (ok) m->nslots = nslots;
    const size_t NV = m->last ? N * Vl : 0, NL = m->last ? N : 0;
    for (int k = 0; ok && k < nslots; k++) {
        act_slot *sl = &m->slots[k];
        sl->acts = zalloc((size_t)m->L, sizeof *sl->acts);
        ok &= sl->acts != NULL;
        for (int l = m->l0; ok && l < m->l1; l++) {
            layer_acts *a = &sl->acts[l];
            A(a->x, N * H); A(a->rstd1, N); A(a->xn1, N * H); A(a->q, N * QD); A(a->k, N * KD); A(a->v, N * KD);
            A(a->att, N * QD); A(a->lse, (size_t)B * m->nh * T); A(a->xmid, N * H); A(a->rstd2, N);
            A(a->xn2, N * H); A(a->gate, N * F); A(a->up, N * F); A(a->act, N * F);
        }
        A(sl->xL, N * H); A(sl->rstdf, NL); A(sl->xnf, m->last ? N * H : 0); A(sl->logits, NV);
        A(sl->rowmax, NL); A(sl->sumexp, 2 * NL); A(sl->losses, NL);
    }
    A(m->cos_t, (size_t)T * m->hd); A(m->sin_t, (size_t)T * m->hd);
    A(m->dx, N * H); A(m->dxn, N * H); A(m->dq, N * QD); A(m->dk, N * KD); A(m->dv, N * KD); A(m->datt, N * QD);
    A(m->dgate, N * F); A(m->dup, N * F); A(m->dact, N * F); A(m->dlogits, NV);
    if (sp_on(m)) A(m->sp_loc, N / (size_t)m->tp_size * H);
    const int C = m->cp_size > 1 ? m->cp_size : 1;
    if (C > 1) {
        if (T % 2) {
            free_acts(m);
            return shard_fail(SHARD_E_USAGE, "context parallelism: %d tokens per rank is odd (two equal chunks)", T);
        }
        A(m->ring[0], 4 * N * KD); A(m->ring[1], 4 * N * KD); A(m->ring_out, N * QD); A(m->ring_lse, (size_t)B * m->nh * T);
    }
#undef A
    m->pos = zalloc((size_t)T, sizeof(int32_t));
    m->cp_pos = zalloc((size_t)T * C, sizeof(int32_t));
    if (ok) model_use_slot(m, 0);
    if (!ok || !m->pos || !m->cp_pos) {
        free_acts(m);
        return shard_fail(SHARD_E_NOMEM, "out of memory for the activations of %d x %d tokens", B, T);
    }
    if (m->fp8) {
        size_t D = H > QD ? H : QD;
        D = D > F ? D : F;
        D = D > KD ? D : KD;
        size_t big = N * D > D * D ? N * D : D * D;
        shard_status s = fp8_reserve(m->fp8, 2 * N * D + D * D, big);
        if (s) {
            free_acts(m);
            return s;
        }
    }
    /* cp rank i: chunks i and 2C-1-i of T/2 tokens each (C = 1: 0..T-1) */
    for (int i = 0; i < C; i++)
        for (int t = 0; t < T; t++)
            m->cp_pos[(size_t)i * T + t] = C == 1 ? t : t < T / 2 ? i * (T / 2) + t : (2 * C - 1 - i) * (T / 2) + t - T / 2;
    memcpy(m->pos, m->cp_pos + (size_t)(C > 1 ? m->cp_rank : 0) * T, (size_t)T * sizeof(int32_t));
    op_rope_table(m->cos_t, m->sin_t, m->pos, T, m->inv_freq, m->hd);
    return SHARD_OK;
}

void model_zero_grads(model *m)
{
    memset(m->grads, 0, m->nparams * sizeof(float));
}

/* The linear layers of the blocks go through the FP8 recipe when it is on; the
 * head stays in fp32 (as TransformerEngine leaves the output layer). */
enum { LIN_Q, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, LIN_COUNT };

static void lin_fwd(model *m, int l, int which, float *out, const float *inp, const float *w, int N, int IN, int OUT)
{
    if (m->fp8) fp8_linear_forward(m->fp8, l * LIN_COUNT + which, out, inp, w, N, IN, OUT);
    else op_linear_forward(out, inp, w, N, IN, OUT);
}

static void lin_bwd(model *m, int l, int which, float *dinp, float *dw, const float *dout, const float *inp,
                    const float *w, int N, int IN, int OUT)
{
    if (m->fp8) fp8_linear_backward(m->fp8, l * LIN_COUNT + which, dinp, dw, dout, inp, w, N, IN, OUT);
    else op_linear_backward(dinp, dw, dout, inp, w, N, IN, OUT);
}

/* ---- ring attention over the cp group ------------------------------------------ */
#define CP_TAG 11

/* one step of the ring: send n floats to the next cp rank, receive the previous one's */
static void cp_pass(model *m, const float *send, float *recv, size_t n)
{
    if (m->comm_err) return;
    const int C = m->cp_size, r = m->cp_rank;
    shard_status s = shard_comm_sendrecv(m->cp, send, (r + 1) % C, recv, (r + C - 1) % C, n, SHARD_DT_F32, CP_TAG);
    if (s) m->comm_err = s;
}

/* a->att, a->lse: attention of this rank's queries over the keys of the whole
 * sequence. The local block first; then C - 1 times the K/V block in hand goes to
 * the next rank and the previous rank's comes in (at pass j the block of cp rank
 * r - j), its partial result merged by log-sum-exp. */
static void attention_forward(model *m, layer_acts *a)
{
    const int B = m->B, T = m->T, C = m->cp_size, r = m->cp_rank;
    op_attention_forward(a->att, a->lse, a->q, a->k, a->v, m->pos, m->pos, B, T, T, m->nh, m->nkv, m->hd, m->window);
    if (C <= 1) return;
    const size_t nk = (size_t)B * T * m->nkv * m->hd;
    float *cur = m->ring[0], *nxt = m->ring[1];
    memcpy(cur, a->k, nk * sizeof(float));
    memcpy(cur + nk, a->v, nk * sizeof(float));
    for (int j = 1; j < C; j++) {
        cp_pass(m, cur, nxt, 2 * nk);
        float *t = cur; cur = nxt; nxt = t;
        const int src = (r - j + C) % C;
        op_attention_forward(m->ring_out, m->ring_lse, a->q, cur, cur + nk, m->pos, m->cp_pos + (size_t)src * T,
                             B, T, T, m->nh, m->nkv, m->hd, m->window);
        op_attention_merge(a->att, a->lse, m->ring_out, m->ring_lse, B, T, m->nh, m->hd);
    }
}

/* dq, dk, dv (zeroed by the caller) from datt, with the final out and lse: the local
 * pair first; then the K/V blocks go around the ring as in forward, each carrying
 * the dK/dV that the ranks it visited accumulated; after C - 1 passes the block in
 * hand is the next rank's, and one more pass of its dK/dV brings every block's
 * gradient home. */
static void attention_backward(model *m, layer_acts *a)
{
    const int B = m->B, T = m->T, C = m->cp_size, r = m->cp_rank;
    op_attention_backward(m->dq, m->dk, m->dv, m->datt, a->q, a->k, a->v, a->att, a->lse, m->pos, m->pos,
                          B, T, T, m->nh, m->nkv, m->hd, m->window);
    if (C <= 1) return;
    const size_t nk = (size_t)B * T * m->nkv * m->hd;
    float *cur = m->ring[0], *nxt = m->ring[1];
    memcpy(cur, a->k, nk * sizeof(float));
    memcpy(cur + nk, a->v, nk * sizeof(float));
    memset(cur + 2 * nk, 0, 2 * nk * sizeof(float));
    for (int j = 1; j < C; j++) {
        cp_pass(m, cur, nxt, 4 * nk);
        float *t = cur; cur = nxt; nxt = t;
        const int src = (r - j + C) % C;
        op_attention_backward(m->dq, cur + 2 * nk, cur + 3 * nk, m->datt, a->q, cur, cur + nk, a->att, a->lse,
                              m->pos, m->cp_pos + (size_t)src * T, B, T, T, m->nh, m->nkv, m->hd, m->window);
    }
    cp_pass(m, cur + 2 * nk, nxt + 2 * nk, 2 * nk); /* to the owner, r + 1; ours from r - 1 */
    const float *dk = nxt + 2 * nk, *dv = nxt + 3 * nk;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < nk; i++) {
        m->dk[i] += dk[i];
        m->dv[i] += dv[i];
    }
}

static void add(float *y, const float *a, const float *b, size_t n)
{
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

double model_forward(model *m, const int32_t *tokens, const int32_t *targets)
{
    const int B = m->B, T = m->T, N = B * T, H = m->H, F = m->F, hd = m->hd;
    const int QD = m->nh * hd, KD = m->nkv * hd, Vl = m->vocab_local;
    const int sp = sp_on(m), Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    if (m->first) {
        float *x0 = model_stage_input(m);
        if (sp) { /* vocab-parallel partial rows of all N tokens, summed into this rank's tokens */
            op_embedding_forward(m->dxn, tokens, m->embed, N, H, m->vocab_start, Vl);
            tp_reduce_scatter(m, m->dxn, x0, NlH);
        } else {
            op_embedding_forward(x0, tokens, m->embed, N, H, m->vocab_start, Vl);
            tp_sum(m, x0, (size_t)N * H, SHARD_OP_SUM); /* vocab-parallel: rows of the others */
        }
    }
    for (int l = m->l0; l < m->l1; l++) {
        layer_acts *a = &m->acts[l];
        const layer_params *w = &m->lw[l];
        float *xnext = l + 1 < m->l1 ? m->acts[l + 1].x : m->xL;
        if (sp) { /* the norm on this rank's tokens, then all of them for the linears */
            op_rmsnorm_forward(m->sp_loc, a->rstd1, a->x, w->norm_attn, Nl, H, m->eps);
            tp_allgather(m, m->sp_loc, a->xn1, NlH);
        } else {
            op_rmsnorm_forward(a->xn1, a->rstd1, a->x, w->norm_attn, N, H, m->eps);
        }
        lin_fwd(m, l, LIN_Q, a->q, a->xn1, w->q, N, H, QD);
        lin_fwd(m, l, LIN_K, a->k, a->xn1, w->k, N, H, KD);
        lin_fwd(m, l, LIN_V, a->v, a->xn1, w->v, N, H, KD);
        op_rope_forward(a->q, m->cos_t, m->sin_t, B, T, m->nh, hd);
        op_rope_forward(a->k, m->cos_t, m->sin_t, B, T, m->nkv, hd);
        attention_forward(m, a);
        lin_fwd(m, l, LIN_O, m->dxn, a->att, w->o, N, QD, H); /* dxn: scratch for the projection */
        if (sp) {
            tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
            add(a->xmid, a->x, m->sp_loc, NlH);
            op_rmsnorm_forward(m->sp_loc, a->rstd2, a->xmid, w->norm_mlp, Nl, H, m->eps);
            tp_allgather(m, m->sp_loc, a->xn2, NlH);
        } else {
            tp_sum(m, m->dxn, (size_t)N * H, SHARD_OP_SUM); /* row-parallel: sum of the partial products */
            add(a->xmid, a->x, m->dxn, (size_t)N * H);
            op_rmsnorm_forward(a->xn2, a->rstd2, a->xmid, w->norm_mlp, N, H, m->eps);
        }
        lin_fwd(m, l, LIN_GATE, a->gate, a->xn2, w->gate, N, H, F);
        lin_fwd(m, l, LIN_UP, a->up, a->xn2, w->up, N, H, F);
        op_swiglu_forward(a->act, a->gate, a->up, (size_t)N * F);
        lin_fwd(m, l, LIN_DOWN, m->dxn, a->act, w->down, N, F, H);
        if (sp) {
            tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
            add(xnext, a->xmid, m->sp_loc, NlH);
        } else {
            tp_sum(m, m->dxn, (size_t)N * H, SHARD_OP_SUM);
            add(xnext, a->xmid, m->dxn, (size_t)N * H);
        }
    }
    if (!m->last) return 0.0; /* the output, xL, goes to the next stage */
    if (sp) {
        op_rmsnorm_forward(m->sp_loc, m->rstdf, m->xL, m->norm_final, Nl, H, m->eps);
        tp_allgather(m, m->sp_loc, m->xnf, NlH); /* the head and the loss on all N tokens */
    } else {
        op_rmsnorm_forward(m->xnf, m->rstdf, m->xL, m->norm_final, N, H, m->eps);
    }
    op_linear_forward(m->logits, m->xnf, m->head, N, H, Vl);
    /* the vocabulary-parallel cross-entropy; on one rank the tp reductions between
     * its steps are the identity */
    op_xent_rowmax(m->rowmax, m->target_logit, m->logits, targets, N, Vl, m->vocab_start);
    tp_sum(m, m->rowmax, (size_t)N, SHARD_OP_MAX);
    op_xent_sumexp(m->sumexp, m->logits, m->rowmax, N, Vl);
    tp_sum(m, m->sumexp, 2 * (size_t)N, SHARD_OP_SUM); /* sumexp and target_logit (one owner) */
    op_xent_loss(m->losses, m->rowmax, m->sumexp, m->target_logit, targets, N);
    double sum = 0.0; /* in row order: the same bits for any thread count */
    for (int n = 0; n < N; n++)
        if (targets[n] >= 0) sum += m->losses[n];
    return sum;
}

void model_backward(model *m, const int32_t *tokens, const int32_t *targets, float loss_scale)
{
    const int B = m->B, T = m->T, N = B * T, H = m->H, F = m->F, hd = m->hd;
    const int QD = m->nh * hd, KD = m->nkv * hd, Vl = m->vocab_local;
    const size_t NH = (size_t)N * H;
    const int sp = sp_on(m), Nl = (int)model_local_rows(m);
    const size_t NlH = (size_t)Nl * H;
    /* sp: the input gradient of the column-parallel linears is reduce-scattered to
     * this rank's tokens (sp_loc) for the norm's backward; the other way, dx (this
     * rank's tokens) is all-gathered into dxn before the row-parallel linears */
    float *dnorm = sp ? m->sp_loc : m->dxn;
    if (m->last) { /* else dx holds the gradient of xL, from the next stage */
        op_xent_backward(m->dlogits, m->logits, m->rowmax, m->sumexp, targets, N, Vl, m->vocab_start, loss_scale);
        memset(m->dxn, 0, NH * sizeof(float));
        op_linear_backward(m->dxn, m->dhead, m->dlogits, m->xnf, m->head, N, H, Vl);
        if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        else tp_sum(m, m->dxn, NH, SHARD_OP_SUM); /* the head is column-parallel over the vocabulary */
        memset(m->dx, 0, NlH * sizeof(float));
        op_rmsnorm_backward(m->dx, m->dnorm_final, dnorm, m->xL, m->norm_final, m->rstdf, Nl, H);
    }
    /* m->dx holds d loss / d (residual stream) as it goes down the layers: each
     * block adds its branch's gradient to it (rmsnorm_backward accumulates) */
    for (int l = m->l1 - 1; l >= m->l0; l--) {
        layer_acts *a = &m->acts[l];
        const layer_params *w = &m->lw[l];
        layer_params *g = &m->lg[l];
        /* MLP: x_next = xmid + down(silu(gate(xn2)) * up(xn2)) */
        const float *dout = m->dx;
        if (sp) {
            tp_allgather(m, m->dx, m->dxn, NlH);
            dout = m->dxn;
        }
        memset(m->dact, 0, (size_t)N * F * sizeof(float));
        lin_bwd(m, l, LIN_DOWN, m->dact, g->down, dout, a->act, w->down, N, F, H);
        memset(m->dgate, 0, (size_t)N * F * sizeof(float));
        memset(m->dup, 0, (size_t)N * F * sizeof(float));
        op_swiglu_backward(m->dgate, m->dup, m->dact, a->gate, a->up, (size_t)N * F);
        memset(m->dxn, 0, NH * sizeof(float));
        lin_bwd(m, l, LIN_GATE, m->dxn, g->gate, m->dgate, a->xn2, w->gate, N, H, F);
        lin_bwd(m, l, LIN_UP, m->dxn, g->up, m->dup, a->xn2, w->up, N, H, F);
        if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        else tp_sum(m, m->dxn, NH, SHARD_OP_SUM); /* column-parallel: input gradient summed, then the norm */
        op_rmsnorm_backward(m->dx, g->norm_mlp, dnorm, a->xmid, w->norm_mlp, a->rstd2, Nl, H);
        /* attention: xmid = x + o(attn(rope(q(xn1)), rope(k(xn1)), v(xn1))) */
        if (sp) tp_allgather(m, m->dx, m->dxn, NlH);
        memset(m->datt, 0, (size_t)N * QD * sizeof(float));
        lin_bwd(m, l, LIN_O, m->datt, g->o, dout, a->att, w->o, N, QD, H);
        memset(m->dq, 0, (size_t)N * QD * sizeof(float));
        memset(m->dk, 0, (size_t)N * KD * sizeof(float));
        memset(m->dv, 0, (size_t)N * KD * sizeof(float));
        attention_backward(m, a);
        op_rope_backward(m->dq, m->cos_t, m->sin_t, B, T, m->nh, hd);
        op_rope_backward(m->dk, m->cos_t, m->sin_t, B, T, m->nkv, hd);
        memset(m->dxn, 0, NH * sizeof(float));
        lin_bwd(m, l, LIN_Q, m->dxn, g->q, m->dq, a->xn1, w->q, N, H, QD);
        lin_bwd(m, l, LIN_K, m->dxn, g->k, m->dk, a->xn1, w->k, N, H, KD);
        lin_bwd(m, l, LIN_V, m->dxn, g->v, m->dv, a->xn1, w->v, N, H, KD);
        if (sp) tp_reduce_scatter(m, m->dxn, m->sp_loc, NlH);
        else tp_sum(m, m->dxn, NH, SHARD_OP_SUM);
        op_rmsnorm_backward(m->dx, g->norm_attn, dnorm, a->x, w->norm_attn, a->rstd1, Nl, H);
    }
    if (m->first) {
        const float *demb = m->dx;
        if (sp) { /* the gradient of every token's row: this rank's vocabulary rows */
            tp_allgather(m, m->dx, m->dxn, NlH);
            demb = m->dxn;
        }
        op_embedding_backward(m->dembed, demb, tokens, N, H, m->vocab_start, Vl);
    }
}
