/* train/par.c: smp-train across processes (par.h). */
#include "par.h"

#include "share.h"
#include "prefault.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptio.h"

shard_status par_init_world(par_ctx *p, int mpi)
{
    memset(p, 0, sizeof *p);
    p->mpi = mpi;
    p->read_together = -1;
    shard_status s = mpi ? shard_comm_mpi_world(&p->world) : shard_comm_self(&p->world);
    if (s) return s;
    p->rank = shard_comm_rank(p->world);
    p->size = shard_comm_size(p->world);
    return SHARD_OK;
}

void par_release(par_ctx *p)
{
    share_release(p);
    shard_comm_free(p->kvc);
    shard_comm_free(p->emb);
    shard_comm_free(p->erep);
    shard_comm_free(p->ep_h);
    if (p->ep_d != p->ep_h) shard_comm_free(p->ep_d);
    p->kvc = p->emb = p->erep = p->ep_h = p->ep_d = NULL;
    if (p->dg_owned) {
        shard_groups_free(&p->dg);
        shard_comm_free(p->dworld);
    }
    memset(&p->dg, 0, sizeof p->dg);
    p->dworld = NULL;
    p->dg_owned = 0;
    if (p->dev) {
        p->dev->ops->release(p->dev, p->send);
        p->dev->ops->release(p->dev, p->recv);
        p->dev->ops->release(p->dev, p->normbuf);
    }
    p->send = p->recv = NULL;
    p->normbuf = NULL;
    p->dev = NULL;
}

void par_free(par_ctx *p)
{
    par_release(p);
    shard_groups_free(&p->g);
    shard_comm_free(p->host);
    shard_comm_free(p->world);
    free(p->pp); free(p->op); free(p->rowsz); free(p->rows); free(p->blkrows); free(p->zoff); free(p->zn);
    free(p->zbase); free(p->zgrp);
    memset(p, 0, sizeof *p);
}

/* ZeRO-1: this rank's block of each local tensor (rows [k br, (k+1) br) of dim 0 for
 * dp*cp rank k), checked against shard_partition_optim's box, and the packing buffers */
static shard_status zero1_blocks(par_ctx *p, const model *m)
{
    const int q = shard_comm_rank(p->g.dpcp), ep = shard_layout_ep(&p->l);
    p->zpad[0] = p->zpad[1] = p->zsum = 0;
    p->zparts[0] = p->ndp;
    p->zparts[1] = p->ndp / ep;
    for (size_t i = 0; i < m->ntensors; i++) {
        const int g = p->zgrp[i] = ep > 1 && shard_role_per_expert(m->spec[i].role);
        const int k = g ? q / ep : q, parts = p->zparts[g];
        const shard_box *b = &p->pp[i].box;
        size_t rows = 0, rowsz = 1;
        if (p->pp[i].holds) {
            rows = (size_t)b->len[0];
            for (int d = 1; d < b->ndim; d++) rowsz *= (size_t)b->len[d];
        }
        if (rows * rowsz != m->numel[i])
            return shard_fail(SHARD_E_INTERNAL, "%s: this rank's piece (%zu elements) is not the model's local tensor (%zu)",
                              m->spec[i].name, rows * rowsz, m->numel[i]);
        size_t br = (rows + (size_t)parts - 1) / (size_t)parts;
        size_t r0 = (size_t)k * br < rows ? (size_t)k * br : rows;
        size_t r1 = r0 + br < rows ? r0 + br : rows;
        /* the block must be shard_partition_optim's box */
        const shard_box *ob = &p->op[i].box;
        if (p->pp[i].holds && (r1 > r0) &&
            ((size_t)(ob->off[0] - b->off[0]) != r0 || (size_t)ob->len[0] != r1 - r0))
            return shard_fail(SHARD_E_INTERNAL, "%s: the optimizer block of rank %d differs from shard_partition_optim's",
                              m->spec[i].name, p->rank);
        p->rows[i] = rows;
        p->rowsz[i] = rowsz;
        p->blkrows[i] = br;
        p->zoff[i] = r0 * rowsz;
        p->zn[i] = (r1 - r0) * rowsz;
        p->zbase[i] = p->zpad[g];
        p->zpad[g] += br * rowsz;
        p->zsum += p->zn[i];
    }
    if (p->ndp > 1) {
        dev *d = m->dev;
        size_t n = p->zpad[0] * (size_t)p->zparts[0], n1 = p->zpad[1] * (size_t)p->zparts[1];
        n = n > n1 ? n : n1;
        p->send = d->ops->alloc(d, (n ? n : 1) * sizeof(float));
        p->recv = d->ops->alloc(d, (n ? n : 1) * sizeof(float));
        if (!p->send || !p->recv) return shard_fail(SHARD_E_NOMEM, "out of memory for the ZeRO-1 buffers");
    }
    return SHARD_OK;
}

/* Expert parallelism: among the dp*cp ranks of a position (q), the ep consecutive ones
 * q / ep exchange tokens (ep rank q % ep holds that share of the experts); the ranks of
 * one q % ep replicate those experts (ZeRO's group 1) */
static shard_status ep_groups(par_ctx *p, model *m)
{
    const int ep = shard_layout_ep(&p->l), q = shard_comm_rank(p->g.dpcp);
    if (ep <= 1) return SHARD_OK;
    shard_status s;
    if ((s = shard_comm_split(p->dg.dpcp, q % ep, q / ep, &p->erep)) ||
        (s = shard_comm_split(p->g.dpcp, q / ep, q % ep, &p->ep_h)))
        return s;
    p->ep_d = p->ep_h;
    if (p->dg_owned && (s = shard_comm_split(p->dg.dpcp, q / ep, q % ep, &p->ep_d))) return s;
    model_set_ep(m, p->ep_h, p->ep_d, ep, q % ep);
    return SHARD_OK;
}

shard_status par_setup(par_ctx *p, const shard_layout *l, const int *stages, int micro, model *m)
{
    p->l = *l;
    memcpy(p->stages, stages, (size_t)l->pp * sizeof *stages);
    shard_status s = shard_groups_create(p->world, l, &p->g);
    if (s) return s;
    p->dev = m->dev;
    if ((s = m->dev->ops->comm_for(m->dev, p->world, &p->dworld, &p->dg_owned))) return s;
    if (!p->dg_owned) p->dg = p->g;
    else if ((s = shard_groups_create(p->dworld, l, &p->dg))) return s;
    p->ndp = l->dp * l->cp;
    const size_t n = m->ntensors;
    p->pp = calloc(n, sizeof *p->pp);
    p->op = calloc(n, sizeof *p->op);
    p->rowsz = calloc(n, sizeof(size_t));
    p->rows = calloc(n, sizeof(size_t));
    p->blkrows = calloc(n, sizeof(size_t));
    p->zoff = calloc(n, sizeof(size_t));
    p->zn = calloc(n, sizeof(size_t));
    p->zbase = calloc(n, sizeof(size_t));
    p->zgrp = calloc(n, sizeof(int));
    if (!p->pp || !p->op || !p->rowsz || !p->rows || !p->blkrows || !p->zoff || !p->zn || !p->zbase || !p->zgrp)
        return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        if ((s = shard_partition(&m->d, l, stages, &m->spec[i], p->rank, &p->pp[i])) ||
            (s = shard_partition_optim(&m->d, l, stages, &m->spec[i], p->rank, &p->op[i])))
            return s;
    /* the model of this rank: its pieces only */
    /* smp-eval's ranks map the pieces they share whole pages at a time (share.h) */
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), es = m->dev->es;
    const size_t align = p->share_weights && !m->dev->cuda && page % es == 0 ? page / es : 1;
    if ((s = model_localize(m, p->pp, l->tp, align))) return s;
    m->tp = p->dg.tp;
    model_set_cp(m, p->dg.cp, l->cp, p->g.me.cp);
    p->stage = p->g.me.pp;
    p->nstages = l->pp;
    int l0 = 0;
    for (int j = 0; j < p->stage; j++) l0 += stages[j];
    model_set_stage(m, l0, l0 + stages[p->stage], p->stage == 0, p->stage == l->pp - 1);
    p->nslots = l->pp > 1 ? (micro < l->pp - p->stage ? micro : l->pp - p->stage) : 1;
    /* tied embeddings over stages: the first stage's table and the last stage's copy
     * get the sum of both gradients */
    if (l->pp > 1 && m->d.tie_word_embeddings &&
        (s = shard_comm_split(p->dg.pp, m->first || m->last ? 0 : 1, p->stage, &p->emb)))
        return s;
    /* kv heads fewer than tp: each is replicated on kv_rep consecutive tp ranks, whose
     * k/v weight gradients (each from its own query heads) are summed over kvc */
    p->kv_rep = m->d.kv_heads < l->tp ? l->tp / (int)m->d.kv_heads : 1;
    if (p->kv_rep > 1 &&
        (s = shard_comm_split(p->dg.tp, p->g.me.tp / p->kv_rep, p->g.me.tp % p->kv_rep, &p->kvc)))
        return s;
    if ((s = ep_groups(p, m))) return s;
    return zero1_blocks(p, m);
}

/* c split so that each part holds the ranks whose `bytes`-long key (gathered) equals
 * that of the part's lowest rank. Collective over c. */
static shard_status split_by(shard_comm *c, const void *key, size_t bytes, shard_comm **out)
{
    const int me = shard_comm_rank(c), size = shard_comm_size(c);
    unsigned char *all = malloc((size_t)size * bytes);
    shard_status s = all ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    s = shard_comm_agree(c, s, "another process ran out of memory", NULL);
    if (!s) s = shard_comm_allgather(c, key, all, bytes, SHARD_DT_U8);
    int color = me;
    for (int r = 0; !s && r < me; r++)
        if (!memcmp(all + (size_t)r * bytes, key, bytes)) {
            color = r;
            break;
        }
    free(all);
    return s ? s : shard_comm_split(c, color, me, out);
}

/* This machine, as its ranks tell it from the others': the hostname and the kernel's
 * boot id (two machines given one hostname, as clusters of cloned images or
 * containers may be, are two hosts: they share no page cache and no memory file). */
static void machine_key(char key[2 * PAR_HOST])
{
    memset(key, 0, 2 * PAR_HOST);
    (void)gethostname(key, PAR_HOST - 1);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(key + PAR_HOST, PAR_HOST - 1, f)) key[PAR_HOST] = 0;
        fclose(f);
    }
}

shard_status par_host(par_ctx *p, shard_comm **out)
{
    if (!p->host) {
        char key[2 * PAR_HOST];
        machine_key(key);
        shard_status s = split_by(p->world, key, sizeof key, &p->host);
        if (s) return s;
    }
    *out = p->host;
    return SHARD_OK;
}

/* --read-together auto: together when the ranks span more than one host. Ranks of
 * one host share its page cache, so a chunk that two of them read costs the storage
 * once and the second read is a copy from memory; reading together would add an
 * all-to-all's copies for nothing (docs/TRAINING.md "Loading"). Collective. */
static shard_status read_together(par_ctx *p, int *yes)
{
    if (p->read_together >= 0 || p->size == 1) {
        *yes = p->size > 1 && p->read_together > 0;
        return SHARD_OK;
    }
    shard_comm *host;
    shard_status s = par_host(p, &host);
    if (!s) p->read_together = *yes = shard_comm_size(host) < p->size;
    return s;
}

/* The host copy's pages of the tensors this rank reads, faulted in first (prefault.h) */
static void prefault_held(const par_ctx *p, const model *m, float *host)
{
    prefault_span *sp = malloc((m->ntensors + 1) * sizeof *sp);
    if (!sp) return; /* the load faults them in */
    size_t n = 0;
    for (size_t i = 0; i < m->ntensors; i++)
        if (p->pp[i].holds && m->numel[i] && share_reads(p, i) && !share_mapped(p, i))
            sp[n++] = (prefault_span){host + m->offset[i], m->numel[i] * sizeof(float)};
    prefault_spans(sp, n, ckptio_load_threads(p->size));
    free(sp);
}

shard_status par_read_params(par_ctx *p, shard_ckpt *c, model *m, const char *group, int *present)
{
    *present = ckptio_group_count(c, m, group) > 0;
    if (!*present) return SHARD_OK;
    int together = 0;
    shard_status s = read_together(p, &together); /* collective: every rank */
    if (!s && p->share_weights) s = share_weights(p, m, "smp-eval");
    if (s) return s;
    float *host = model_params_host(m);
    s = host ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of host memory for the parameters");
    if (host) prefault_held(p, m, host); /* those in shared objects: share_weights did */
    if (together) {
        if ((s = shard_comm_agree(p->world, s, "another process ran out of memory", NULL))) return s;
        const uint64_t sent = shard_comm_bytes(p->world);
        s = par_coread(p, c, m, group, 0, host);
        p->moved += shard_comm_bytes(p->world) - sent;
        return share_seal(p, s);
    }
    for (size_t i = 0; !s && i < m->ntensors; i++) {
        long k;
        if ((s = ckptio_group_tensor(c, group, &m->spec[i], &k))) break;
        if (p->pp[i].holds && m->numel[i] && share_reads(p, i))
            s = shard_ckpt_read(c, (size_t)k, &p->pp[i].box, host + m->offset[i], SHARD_DT_F32);
    }
    return share_seal(p, s);
}

shard_status par_read_optim(par_ctx *p, shard_ckpt *c, const model *m, const char *group, float *dst, int *present)
{
    *present = ckptio_group_count(c, m, group) > 0;
    if (!*present) return SHARD_OK;
    size_t total = 0;
    for (size_t i = 0; i < m->ntensors; i++) total += p->zn[i];
    const prefault_span all = {dst, total * sizeof(float)}; /* this rank's blocks, read whole */
    prefault_spans(&all, 1, ckptio_load_threads(p->size));
    int together = 0;
    shard_status s = read_together(p, &together);
    if (s) return s;
    if (together) {
        const uint64_t sent = shard_comm_bytes(p->world);
        s = par_coread(p, c, m, group, 1, dst);
        p->moved += shard_comm_bytes(p->world) - sent;
        return s;
    }
    size_t base = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        long k;
        if ((s = ckptio_group_tensor(c, group, &m->spec[i], &k))) return s;
        if (p->zn[i] && (s = shard_ckpt_read(c, (size_t)k, &p->op[i].box, dst + base, SHARD_DT_F32))) return s;
        base += p->zn[i];
    }
    return SHARD_OK;
}

/* block r of tensor i: [r0, r0 + n) elements of its local array */
static void block_of(const par_ctx *p, size_t i, int r, size_t *off, size_t *n)
{
    size_t rows = p->rows[i], br = p->blkrows[i];
    size_t r0 = (size_t)r * br < rows ? (size_t)r * br : rows;
    size_t r1 = r0 + br < rows ? r0 + br : rows;
    *off = r0 * p->rowsz[i];
    *n = (r1 - r0) * p->rowsz[i];
}

/* weight gradients that are partial on each tp rank: the per-head q/k norms' (each
 * rank's heads) and, with sequence parallelism, every other replicated tensor's
 * (the norms and GPT-NeoX's row-parallel biases: each rank's tokens) but the
 * router's (it routes all the tokens, after the all-gather) */
static int tp_partial(const model *m, const shard_tensor_spec *t)
{
    return t->role == SHARD_T_Q_NORM || t->role == SHARD_T_K_NORM ||
           (m->sp && shard_role_replicated(t->role) && t->role != SHARD_T_ROUTER);
}

/* one all-reduce over tp of all the stage's partial gradients (packed) makes them whole */
static shard_status tp_sum_partial_grads(par_ctx *p, model *m)
{
    size_t n = 0;
    for (size_t i = 0; i < m->ntensors; i++)
        if (tp_partial(m, &m->spec[i])) n += m->numel[i];
    if (!n) return SHARD_OK;
    dev *d = p->dev;
    if (!p->normbuf) {
        p->normbuf = d->ops->alloc(d, n * sizeof(float));
        if (!p->normbuf) return dev_status(d);
    }
    float *buf = p->normbuf;
    size_t k = 0;
    for (size_t i = 0; i < m->ntensors; i++)
        if (tp_partial(m, &m->spec[i])) {
            d->ops->copy(d, buf + k, m->grads + m->offset[i], m->numel[i] * sizeof(float));
            k += m->numel[i];
        }
    shard_status s = shard_comm_allreduce(p->dg.tp, buf, n, SHARD_DT_F32, SHARD_OP_SUM);
    k = 0;
    for (size_t i = 0; !s && i < m->ntensors; i++)
        if (tp_partial(m, &m->spec[i])) {
            d->ops->copy(d, m->grads + m->offset[i], buf + k, m->numel[i] * sizeof(float));
            k += m->numel[i];
        }
    return s;
}

/* ZeRO-1 group g: each rank's gradient blocks summed over the group, each rank keeping
 * its own block's sum */
static shard_status reduce_scatter_group(par_ctx *p, model *m, int g)
{
    dev *d = p->dev;
    const int parts = p->zparts[g];
    const size_t zpad = p->zpad[g];
    if (parts <= 1 || !zpad) return SHARD_OK;
    float *send = p->send, *recv = p->recv;
    for (int r = 0; r < parts; r++) {
        float *dst = send + (size_t)r * zpad;
        for (size_t i = 0; i < m->ntensors; i++) {
            if (p->zgrp[i] != g) continue;
            size_t off, n, pad = p->blkrows[i] * p->rowsz[i];
            block_of(p, i, r, &off, &n);
            d->ops->copy(d, dst + p->zbase[i], m->grads + m->offset[i] + off, n * sizeof(float));
            if (pad > n) d->ops->zero(d, dst + p->zbase[i] + n, (pad - n) * sizeof(float));
        }
    }
    shard_status s = shard_comm_reduce_scatter(g ? p->erep : p->dg.dpcp, send, recv, zpad, SHARD_DT_F32, SHARD_OP_SUM);
    if (s) return s;
    for (size_t i = 0; i < m->ntensors; i++)
        if (p->zgrp[i] == g)
            d->ops->copy(d, m->grads + m->offset[i] + p->zoff[i], recv + p->zbase[i], p->zn[i] * sizeof(float));
    return SHARD_OK;
}

shard_status par_reduce_grads(par_ctx *p, model *m, double *sumsq)
{
    shard_status s;
    dev *d = p->dev;
    if (p->emb && (m->first || m->last))
        for (size_t i = 0; i < m->ntensors; i++)
            if (m->spec[i].role == SHARD_T_EMBED &&
                (s = shard_comm_allreduce(p->emb, m->grads + m->offset[i], m->numel[i], SHARD_DT_F32, SHARD_OP_SUM)))
                return s;
    if (p->kv_rep > 1)
        for (int l = m->l0; l < m->l1; l++) {
            const size_t n = (size_t)m->nkv * m->hd * m->H, nb = (size_t)m->nkv * m->hd;
            if ((s = shard_comm_allreduce(p->kvc, m->lg[l].k, n, SHARD_DT_F32, SHARD_OP_SUM)) ||
                (s = shard_comm_allreduce(p->kvc, m->lg[l].v, n, SHARD_DT_F32, SHARD_OP_SUM)))
                return s;
            if (m->d.qkv_bias && ((s = shard_comm_allreduce(p->kvc, m->lg[l].k_bias, nb, SHARD_DT_F32, SHARD_OP_SUM)) ||
                                  (s = shard_comm_allreduce(p->kvc, m->lg[l].v_bias, nb, SHARD_DT_F32, SHARD_OP_SUM))))
                return s;
        }
    if (m->tp_size > 1 && (s = tp_sum_partial_grads(p, m))) return s;
    if (p->size == 1) { /* the single-rank trainer's norm, bit for bit */
        *sumsq = d->ops->sumsq(d, m->grads, m->nparams);
        return dev_status(d);
    }
    if (p->ndp > 1)
        for (int g = 0; g < 2; g++)
            if ((s = reduce_scatter_group(p, m, g))) return s;
    double ss = 0.0;
    for (size_t i = 0; i < m->ntensors; i++)
        if (p->op[i].writes && p->zn[i]) ss += d->ops->sumsq(d, m->grads + m->offset[i] + p->zoff[i], p->zn[i]);
    if ((s = dev_status(d))) return s;
    if ((s = shard_comm_allreduce(p->world, &ss, 1, SHARD_DT_F64, SHARD_OP_SUM))) return s;
    *sumsq = ss;
    return SHARD_OK;
}

/* ZeRO-1 group g: the updated blocks, in the compute dtype, to every rank of the group */
static shard_status allgather_group(par_ctx *p, model *m, int g)
{
    dev *d = p->dev;
    const int parts = p->zparts[g];
    const size_t zpad = p->zpad[g];
    if (parts <= 1 || !zpad) return SHARD_OK;
    for (size_t i = 0; i < m->ntensors; i++) {
        if (p->zgrp[i] != g) continue;
        size_t pad = p->blkrows[i] * p->rowsz[i];
        d->ops->copy(d, dev_at(d, p->send, p->zbase[i]), dev_at(d, m->params, m->offset[i] + p->zoff[i]), p->zn[i] * d->es);
        if (pad > p->zn[i]) d->ops->zero(d, dev_at(d, p->send, p->zbase[i] + p->zn[i]), (pad - p->zn[i]) * d->es);
    }
    shard_status s = shard_comm_allgather(g ? p->erep : p->dg.dpcp, p->send, p->recv, zpad, d->dt);
    if (s) return s;
    for (int r = 0; r < parts; r++) {
        const void *src = dev_at(d, p->recv, (size_t)r * zpad);
        for (size_t i = 0; i < m->ntensors; i++) {
            if (p->zgrp[i] != g) continue;
            size_t off, n;
            block_of(p, i, r, &off, &n);
            d->ops->copy(d, dev_at(d, m->params, m->offset[i] + off), dev_cat(d, src, p->zbase[i]), n * d->es);
        }
    }
    return SHARD_OK;
}

shard_status par_update(par_ctx *p, model *m, optim *o, double norm, float lr)
{
    dev *d = p->dev;
    const float coef = optim_clip_coef(norm, o->h.clip);
    if (p->size == 1) {
        if (coef < 1.0f) d->ops->scale(d, m->grads, coef, m->nparams);
        optim_step(o, m, lr);
        return dev_status(d);
    }
    for (size_t i = 0; i < m->ntensors; i++)
        if (p->zn[i] && coef < 1.0f) d->ops->scale(d, m->grads + m->offset[i] + p->zoff[i], coef, p->zn[i]);
    optim_step_blocks(o, m, lr, p->zoff, p->zn);
    if (p->ndp > 1)
        for (int g = 0; g < 2; g++) {
            shard_status s = allgather_group(p, m, g);
            if (s) return s;
        }
    return dev_status(d);
}

void par_pack_blocks(const par_ctx *p, const model *m, const float *params, float *dst)
{
    size_t base = 0;
    for (size_t i = 0; i < m->ntensors; i++) {
        memcpy(dst + base, params + m->offset[i] + p->zoff[i], p->zn[i] * sizeof(float));
        base += p->zn[i];
    }
}

/* keep this rank's m->T tokens of each sequence, in place: the source index b*S +
 * pos[t] is never below the destination b*T + t, and grows with it, so no source is
 * overwritten before it is read */
static void cp_select(const model *m, int rows, int32_t *in, int32_t *tg)
{
    const size_t T = (size_t)m->T, S = T * (size_t)m->cp_size;
    for (size_t b = 0; b < (size_t)rows; b++)
        for (size_t t = 0; t < T; t++) {
            in[b * T + t] = in[b * S + (size_t)m->pos[t]];
            tg[b * T + t] = tg[b * S + (size_t)m->pos[t]];
        }
}

uint64_t par_take_batch(model *m, int rows, int32_t *in, int32_t *tg)
{
    model_documents(m, rows, in); /* from the whole sequences */
    if (m->cp_size > 1) cp_select(m, rows, in, tg);
    uint64_t n = 0;
    for (size_t i = 0; i < (size_t)rows * (size_t)m->T; i++) n += tg[i] >= 0;
    return n;
}

shard_status par_aux_reduce(par_ctx *p, model *m)
{
    const size_t n = 2 * (size_t)m->E + 1;
    if (!m->E || p->size == 1) return SHARD_OK;
    if (p->g.me.tp != 0) memset(m->aux, 0, n * sizeof *m->aux); /* every tp rank routes the same tokens */
    return shard_comm_allreduce(p->world, m->aux, n, SHARD_DT_F64, SHARD_OP_SUM);
}

shard_status par_allreduce_f64(par_ctx *p, shard_comm *c, double *v, int n, shard_op op)
{
    (void)p;
    return shard_comm_allreduce(c, v, (size_t)n, SHARD_DT_F64, op);
}

int par_any(par_ctx *p, int mine)
{
    if (p->size == 1) return mine;
    int32_t v = mine;
    if (shard_comm_allreduce(p->world, &v, 1, SHARD_DT_I32, SHARD_OP_MAX)) {
        fprintf(stderr, "smp-train: error: rank %d: a collective failed: %s\n", p->rank, shard_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return v;
}

/* ------------------------------------------------------------------ pipeline */
#define PP_TAG 7

static shard_status pp_recv_input(par_ctx *p, model *m, int mb)
{
    model_use_slot(m, mb % p->nslots);
    return shard_comm_recv(p->dg.pp, model_stage_input(m), model_local_rows(m) * m->H, m->dev->dt, p->stage - 1,
                           PP_TAG);
}

static shard_status pp_fwd(par_ctx *p, model *m, int mb, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg,
                           float loss_scale, double *lsum)
{
    model_use_slot(m, mb % p->nslots);
    shard_status s = fill(ctx, mb, in, tg);
    if (s) return s;
    *lsum += model_forward_train(m, in, tg, loss_scale);
    return m->comm_err ? m->comm_err : dev_status(m->dev);
}

static shard_status pp_bwd(par_ctx *p, model *m, int mb, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg)
{
    model_use_slot(m, mb % p->nslots);
    shard_status s = fill(ctx, mb, in, tg);
    if (s) return s;
    model_backward(m, in);
    return m->comm_err ? m->comm_err : dev_status(m->dev);
}

shard_status par_train_step(par_ctx *p, model *m, int M, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg,
                            float loss_scale, double *lsum)
{
    shard_status s;
    *lsum = 0.0;
    if (p->nstages <= 1) {
        for (int mb = 0; mb < M; mb++) {
            if ((s = fill(ctx, mb, in, tg))) return s;
            *lsum += model_forward_train(m, in, tg, loss_scale);
            model_backward(m, in);
            if (m->comm_err) return m->comm_err;
            if ((s = dev_status(m->dev))) return s;
        }
        return SHARD_OK;
    }
    /* 1F1B (PipeDream-flush, as Megatron's non-interleaved schedule) */
    const int P = p->nstages, st = p->stage, first = st == 0, last = st == P - 1;
    const size_t n = model_local_rows(m) * m->H; /* sequence parallel: this rank's tokens */
    shard_comm *c = p->dg.pp;
    const shard_dtype adt = m->dev->dt; /* activations and their gradients */
    const int warm = P - st - 1 < M ? P - st - 1 : M, rem = M - warm;
    for (int i = 0; i < warm; i++) {
        if (!first && (s = pp_recv_input(p, m, i))) return s;
        if ((s = pp_fwd(p, m, i, fill, ctx, in, tg, loss_scale, lsum))) return s;
        if (!last && (s = shard_comm_send(c, m->xL, n, adt, st + 1, PP_TAG))) return s;
    }
    if (rem > 0 && !first && (s = pp_recv_input(p, m, warm))) return s;
    for (int i = 0; i < rem; i++) {
        const int f = warm + i;
        if ((s = pp_fwd(p, m, f, fill, ctx, in, tg, loss_scale, lsum))) return s;
        /* send this forward's output, receive the gradient of the oldest one's */
        if (!last && (s = shard_comm_sendrecv(c, m->xL, st + 1, m->dx, st + 1, n, adt, PP_TAG))) return s;
        if ((s = pp_bwd(p, m, i, fill, ctx, in, tg))) return s;
        if (first) continue;
        if (i == rem - 1) {
            if ((s = shard_comm_send(c, m->dx, n, adt, st - 1, PP_TAG))) return s;
        } else {
            /* send the input gradient back, receive the next forward's input */
            model_use_slot(m, (f + 1) % p->nslots);
            if ((s = shard_comm_sendrecv(c, m->dx, st - 1, model_stage_input(m), st - 1, n, adt, PP_TAG)))
                return s;
        }
    }
    for (int i = rem; i < M; i++) {
        if (!last && (s = shard_comm_recv(c, m->dx, n, adt, st + 1, PP_TAG))) return s;
        if ((s = pp_bwd(p, m, i, fill, ctx, in, tg))) return s;
        if (!first && (s = shard_comm_send(c, m->dx, n, adt, st - 1, PP_TAG))) return s;
    }
    return SHARD_OK;
}

shard_status par_forward(par_ctx *p, model *m, const int32_t *in, const int32_t *tg, double *lsum)
{
    shard_status s;
    const size_t n = model_local_rows(m) * m->H; /* sequence parallel: this rank's tokens */
    model_use_slot(m, 0);
    if (p->nstages > 1 && !m->first &&
        (s = shard_comm_recv(p->dg.pp, model_stage_input(m), n, m->dev->dt, p->stage - 1, PP_TAG)))
        return s;
    *lsum = model_forward(m, in, tg);
    if (m->comm_err) return m->comm_err;
    if ((s = dev_status(m->dev))) return s;
    if (p->nstages > 1 && !m->last && (s = shard_comm_send(p->dg.pp, m->xL, n, m->dev->dt, p->stage + 1, PP_TAG)))
        return s;
    return SHARD_OK;
}
