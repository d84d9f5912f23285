/* train/coread.c: the ranks of a run read a checkpoint together (par.h).
 *
 * Read alone, every rank fetches the chunks its own box touches: a dp or cp replica
 * reads the same chunks again, and a tp rank whose box is a column split of
 * whole-row chunks reads every chunk of those rows (2.8x the checkpoint's bytes for
 * 8 ranks at tp=4,dp=2 from a pp=2,tp=2 checkpoint). Together, each tensor's rows
 * (the bounding box of every rank's box) are cut at chunk starts into one band per
 * rank; each rank reads its band once, and an all-to-all hands every rank the part
 * of each band that its box holds. Every stored chunk is read once by the whole run
 * (the tied embedding of a last stage included) and checked by the rank that reads
 * it. What travels is the stored dtype (bf16 weights: half of fp32's bytes), turned
 * into fp32 as it lands in the rank's box.
 *
 * A round is one read, one agreement and one all-to-all: small tensors share a
 * round, the largest take several, so each rank's band, sends and receives stay
 * within COREAD_BUDGET bytes and the run makes few collectives (each one costs a
 * scheduling round of every process, and ranks outnumber cores on small machines). */
#include "par.h"

#include <stdlib.h>
#include <string.h>

#include "ckptio.h"
#include "share.h"

#define COREAD_BUDGET ((uint64_t)64 << 20)
#define COREAD_BATCH 64 /* tensors in one round at most */

typedef struct {
    long k;          /* the tensor in the checkpoint */
    shard_dtype dt;  /* as stored: what travels */
    size_t es;
    shard_box U;     /* the bounding box of every rank's box */
    shard_piece *pc; /* every rank's piece of it (its optimizer block when blocks) */
    int64_t *cuts;   /* rounds x ranks bands */
    int rounds, parts; /* parts = rounds x ranks */
    uint64_t cost;   /* bytes a rank moves in one of its rounds */
    float *dst;      /* where this rank's piece lands */
} task;

typedef struct {
    par_ctx *p;
    shard_ckpt *c;
    task t[COREAD_BATCH];
    int nt;
    size_t *sc, *sd, *rc, *rd, *bo; /* bytes per rank; bo: each task's band in band */
    char *band, *send, *recv;
    size_t nband, nsend, nrecv;     /* capacities in bytes */
    uint8_t *reads;                 /* params with twins (share.h): rank j receives tensor i only when bit i
                                     * of reads[j * nreads] is set (else a twin of j does); NULL: every rank */
    size_t nreads;
} coread;

static int grow(char **b, size_t *cap, size_t n)
{
    if (n <= *cap) return 1;
    char *x = realloc(*b, n);
    if (!x) return 0;
    *b = x;
    *cap = n;
    return 1;
}

static int has(const shard_piece *pc) { return pc->holds && shard_box_numel(&pc->box) > 0; }

/* band q of task t: U with rows [cuts[q], cuts[q + 1]); empty past its rounds (a
 * batch makes as many as its largest task needs) */
static shard_box band_of(const task *t, int q)
{
    shard_box b = t->U;
    b.len[0] = 0;
    if (q >= t->parts) return b;
    b.off[0] = t->cuts[q];
    b.len[0] = t->cuts[q + 1] - t->cuts[q];
    return b;
}

/* Elements of band q of t that rank j's box holds (x: where) */
static size_t part(const task *t, int q, int j, shard_box *x)
{
    const shard_box b = band_of(t, q);
    return has(&t->pc[j]) && shard_box_intersect(&b, &t->pc[j].box, x) ? (size_t)shard_box_numel(x) : 0;
}

/* What each rank sends and receives for round q of every task of the batch (every
 * rank knows every box); 0 when out of memory. */
static int sizes(coread *r, int q)
{
    const int n = r->p->size, me = r->p->rank;
    shard_box x;
    size_t nb = 0, ns = 0, nr = 0;
    for (int j = 0; j < n; j++) r->sc[j] = r->rc[j] = 0;
    for (int i = 0; i < r->nt; i++) {
        const task *t = &r->t[i];
        const shard_box mine = band_of(t, q * n + me);
        r->bo[i] = nb;
        nb += (size_t)shard_box_numel(&mine) * t->es;
        for (int j = 0; j < n; j++) {
            r->sc[j] += part(t, q * n + me, j, &x) * t->es;
            r->rc[j] += part(t, q * n + j, me, &x) * t->es;
        }
    }
    for (int j = 0; j < n; j++) {
        r->sd[j] = ns;
        r->rd[j] = nr;
        ns += r->sc[j];
        nr += r->rc[j];
    }
    return grow(&r->band, &r->nband, nb ? nb : 1) && grow(&r->send, &r->nsend, ns ? ns : 1) &&
           grow(&r->recv, &r->nrecv, nr ? nr : 1);
}

/* Round q of the batch: my bands read, every rank agreeing that all read theirs,
 * packed per destination (tasks in batch order), the all-to-all, and what came
 * from each rank placed into my boxes as fp32. */
static shard_status round_of(coread *r, int q)
{
    const int n = r->p->size, me = r->p->rank;
    shard_box x;
    shard_status s = sizes(r, q) ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory for the load");
    for (int i = 0; !s && i < r->nt; i++) {
        const shard_box mine = band_of(&r->t[i], q * n + me);
        if (shard_box_numel(&mine)) s = shard_ckpt_read(r->c, (size_t)r->t[i].k, &mine, r->band + r->bo[i], r->t[i].dt);
    }
    if ((s = shard_comm_agree(r->p->world, s, "another process failed to read the checkpoint", NULL))) return s;
    for (int j = 0; j < n; j++) {
        size_t at = r->sd[j];
        for (int i = 0; !s && i < r->nt; i++) {
            const task *t = &r->t[i];
            const shard_box mine = band_of(t, q * n + me);
            size_t e = part(t, q * n + me, j, &x);
            if (e) s = shard_box_copy(r->send + at, t->dt, &x, r->band + r->bo[i], t->dt, &mine, &x);
            at += e * t->es;
        }
    }
    if (s || (s = shard_comm_alltoallv(r->p->world, r->send, r->sc, r->sd, r->recv, r->rc, r->rd, SHARD_DT_U8))) return s;
    for (int j = 0; j < n; j++) {
        size_t at = r->rd[j];
        for (int i = 0; !s && i < r->nt; i++) {
            const task *t = &r->t[i];
            size_t e = part(t, q * n + j, me, &x);
            if (e) s = shard_box_copy(t->dst, SHARD_DT_F32, &t->pc[me].box, r->recv + at, t->dt, &x, &x);
            at += e * t->es;
        }
    }
    return s;
}

/* The batch's rounds (as many as its tasks' largest), then the batch emptied. */
static shard_status flush(coread *r)
{
    int rounds = 0;
    for (int i = 0; i < r->nt; i++) rounds = r->t[i].rounds > rounds ? r->t[i].rounds : rounds;
    shard_status s = SHARD_OK;
    for (int q = 0; !s && q < rounds; q++) s = round_of(r, q);
    for (int i = 0; i < r->nt; i++) { free(r->t[i].pc); free(r->t[i].cuts); }
    r->nt = 0;
    return s;
}

static void bound(shard_box *U, const shard_box *b)
{
    for (int d = 0; d < b->ndim; d++) {
        int64_t lo = b->off[d] < U->off[d] ? b->off[d] : U->off[d];
        int64_t e = b->off[d] + b->len[d] > U->off[d] + U->len[d] ? b->off[d] + b->len[d] : U->off[d] + U->len[d];
        U->off[d] = lo;
        U->len[d] = e - lo;
    }
}

/* Tensor i as a task: every rank's piece, their bounding box, the rounds it takes
 * and the cuts. *any 0 when no rank holds any of it. */
static shard_status plan(coread *r, const model *m, size_t i, int blocks, task *t, int *any)
{
    par_ctx *p = r->p;
    const int n = p->size;
    const shard_ckpt_tensor *ct = shard_ckpt_tensor_at(r->c, (size_t)t->k);
    t->dt = ct->dtype;
    if (!shard_dtype_is_float(t->dt)) /* every rank fails here alike: the manifest is theirs too */
        return shard_fail(SHARD_E_INVALID, "%s: tensor %s is stored as %s, not a float dtype", shard_ckpt_dir(r->c),
                          ct->name, shard_dtype_name(t->dt));
    t->es = shard_dtype_size(ct->dtype);
    if (!(t->pc = calloc((size_t)n, sizeof *t->pc))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    uint64_t held = 0;
    *any = 0;
    for (int j = 0; j < n; j++) {
        shard_status s = blocks ? shard_partition_optim(&m->d, &p->l, p->stages, &m->spec[i], j, &t->pc[j])
                               : shard_partition(&m->d, &p->l, p->stages, &m->spec[i], j, &t->pc[j]);
        if (s) return s;
        if (r->reads && !(r->reads[(size_t)j * r->nreads + i / 8] >> (i % 8) & 1)) t->pc[j].holds = 0; /* a twin's */
        if (!has(&t->pc[j])) continue;
        held += shard_box_numel(&t->pc[j].box);
        if (!(*any)++) t->U = t->pc[j].box;
        else bound(&t->U, &t->pc[j].box);
    }
    if (!*any) return SHARD_OK;
    /* a rank's band, and as much sent and received as the ranks hold on average */
    t->cost = (shard_box_numel(&t->U) + 2 * held) * t->es / (uint64_t)n;
    t->rounds = (int)(t->cost / COREAD_BUDGET) + 1;
    if (t->rounds > t->U.len[0]) t->rounds = (int)t->U.len[0];
    t->cost /= (uint64_t)t->rounds;
    t->parts = t->rounds * n;
    if (!(t->cuts = malloc(((size_t)t->parts + 1) * sizeof *t->cuts))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    return shard_ckpt_row_cuts(r->c, (size_t)t->k, t->U.off[0], t->U.off[0] + t->U.len[0], t->parts, t->cuts);
}

/* Add tensor i to the batch, flushing first when it would overfill it. A failure
 * of this rank alone (memory) still meets the others' next agreement (the first of
 * their next round), so none waits. */
static shard_status add(coread *r, const model *m, size_t i, int blocks, long k, float *dst, uint64_t *load)
{
    task t = {.k = k, .dst = dst};
    int any = 0;
    shard_status s = plan(r, m, i, blocks, &t, &any);
    if (s || !any) {
        free(t.pc); free(t.cuts);
        if (s) (void)shard_comm_agree(r->p->world, s, "", NULL);
        return s;
    }
    if (r->nt && (r->nt == COREAD_BATCH || *load + t.cost > COREAD_BUDGET || t.rounds > 1)) {
        if ((s = flush(r))) { free(t.pc); free(t.cuts); return s; }
        *load = 0;
    }
    r->t[r->nt++] = t;
    *load += t.cost;
    return SHARD_OK;
}

/* Which ranks receive which parameters (coread.reads): each rank's share_reads,
 * gathered; left NULL when no rank of the run shares its weights. Collective. */
static shard_status gather_reads(coread *r, const model *m)
{
    par_ctx *p = r->p;
    if (!p->share_weights) return SHARD_OK; /* the same on every rank: smp-train never shares */
    int32_t any = p->twins != NULL;
    shard_status s = shard_comm_allreduce(p->world, &any, 1, SHARD_DT_I32, SHARD_OP_MAX);
    if (s || !any) return s;
    r->nreads = (m->ntensors + 7) / 8 + 1;
    uint8_t *mine = calloc(r->nreads, 1);
    r->reads = malloc((size_t)p->size * r->nreads);
    s = mine && r->reads ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; mine && i < m->ntensors; i++) mine[i / 8] |= (uint8_t)(share_reads(p, i) << (i % 8));
    s = shard_comm_agree(p->world, s, "another process ran out of memory", NULL);
    if (!s) s = shard_comm_allgather(p->world, mine, r->reads, r->nreads, SHARD_DT_U8);
    free(mine);
    return s;
}

shard_status par_coread(par_ctx *p, shard_ckpt *c, const model *m, const char *group, int blocks, float *dst)
{
    const size_t n = (size_t)p->size;
    coread r = {.p = p, .c = c};
    r.sc = calloc(n, sizeof(size_t)); r.sd = calloc(n, sizeof(size_t));
    r.rc = calloc(n, sizeof(size_t)); r.rd = calloc(n, sizeof(size_t));
    r.bo = calloc(COREAD_BATCH, sizeof(size_t));
    shard_status s = r.sc && r.sd && r.rc && r.rd && r.bo ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!blocks) {
        shard_status g = gather_reads(&r, m); /* collective: every rank, whatever its s */
        s = s ? s : g;
    }
    size_t base = 0;
    uint64_t load = 0;
    for (size_t i = 0; !s && i < m->ntensors; i++) {
        long k;
        if ((s = ckptio_group_tensor(c, group, &m->spec[i], &k))) break;
        /* params: tensor i's place in the model's host array; blocks: packed */
        s = add(&r, m, i, blocks, k, blocks ? dst + base : dst + m->offset[i], &load);
        base += blocks ? p->zn[i] : 0;
    }
    if (!s && r.nt) s = flush(&r);
    for (int i = 0; i < r.nt; i++) { free(r.t[i].pc); free(r.t[i].cuts); }
    free(r.sc); free(r.sd); free(r.rc); free(r.rd); free(r.bo);
    free(r.band); free(r.send); free(r.recv); free(r.reads);
    return s;
}
