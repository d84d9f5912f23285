/* The communicator interface: argument checks, byte counting, the single-process
 * backend, and the groups of a layout. Backends: self (here), MPI (mpi.c). */
#include "comm.h"
#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* bf16/f16: NCCL natively, MPI through user operations in fp32 (mpi.c), self trivially */
static int reducible(shard_dtype dt)
{
    return dt == SHARD_DT_F32 || dt == SHARD_DT_F64 || dt == SHARD_DT_I32 || dt == SHARD_DT_I64 || dt == SHARD_DT_U64 ||
           dt == SHARD_DT_BF16 || dt == SHARD_DT_F16;
}

int shard_comm_rank(const shard_comm *c) { return c->rank; }
int shard_comm_size(const shard_comm *c) { return c->size; }
uint64_t shard_comm_bytes(const shard_comm *c) { return c->bytes; }
void shard_comm_reset_bytes(shard_comm *c) { c->bytes = 0; }

shard_status shard_comm_create(const shard_comm_ops *ops, int rank, int size, void *impl, shard_comm **out)
{
    *out = calloc(1, sizeof **out);
    if (!*out) return shard_fail(SHARD_E_NOMEM, "out of memory");
    **out = (shard_comm){.ops = ops, .rank = rank, .size = size, .impl = impl};
    return SHARD_OK;
}

void *shard_comm_impl(const shard_comm *c) { return c->impl; }
const char *shard_comm_backend(const shard_comm *c) { return c->ops->name; }

void shard_comm_free(shard_comm *c)
{
    if (!c) return;
    if (c->req.busy) shard_comm_wait(&c->req); /* the backend may still be reading and writing the buffers */
    if (c->ops->free) c->ops->free(c);
    free(c);
}

shard_status shard_comm_split(shard_comm *c, int color, int key, shard_comm **out)
{
    if (color < 0) return shard_fail(SHARD_E_USAGE, "comm split: negative color");
    return c->ops->split(c, color, key, out);
}

shard_status shard_comm_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    if (!reducible(dt)) return shard_fail(SHARD_E_USAGE, "allreduce: dtype %s cannot be reduced", shard_dtype_name(dt));
    /* a ring all-reduce sends 2 (size-1)/size of the buffer from each rank */
    c->bytes += c->size > 1 ? 2 * (uint64_t)(c->size - 1) * n * shard_dtype_size(dt) / (uint64_t)c->size : 0;
    return c->ops->allreduce(c, buf, n, dt, op);
}

shard_status shard_comm_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op)
{
    if (!reducible(dt)) return shard_fail(SHARD_E_USAGE, "reduce_scatter: dtype %s cannot be reduced", shard_dtype_name(dt));
    c->bytes += (uint64_t)(c->size - 1) * n * shard_dtype_size(dt);
    return c->ops->reduce_scatter(c, send, recv, n, dt, op);
}

shard_status shard_comm_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt)
{
    c->bytes += (uint64_t)(c->size - 1) * n * shard_dtype_size(dt);
    return c->ops->allgather(c, send, recv, n, dt);
}

shard_status shard_comm_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root)
{
    if (root < 0 || root >= c->size) return shard_fail(SHARD_E_USAGE, "broadcast: root %d outside 0..%d", root, c->size - 1);
    if (c->rank == root) c->bytes += (uint64_t)(c->size - 1) * n * shard_dtype_size(dt);
    return c->ops->broadcast(c, buf, n, dt, root);
}

shard_status shard_comm_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    if (peer < 0 || peer >= c->size || peer == c->rank) return shard_fail(SHARD_E_USAGE, "send: bad peer %d", peer);
    c->bytes += n * shard_dtype_size(dt);
    return c->ops->send(c, buf, n, dt, peer, tag);
}

shard_status shard_comm_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    if (peer < 0 || peer >= c->size || peer == c->rank) return shard_fail(SHARD_E_USAGE, "recv: bad peer %d", peer);
    return c->ops->recv(c, buf, n, dt, peer, tag);
}

/* a send-receive's peers checked and its bytes counted; *local: to and from this
 * rank (any communicator's self case, the one-rank one's only), copied here */
static shard_status sendrecv_begin(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                   shard_dtype dt, const char *what, int *local)
{
    *local = 0;
    if (to < 0 || to >= c->size || from < 0 || from >= c->size) return shard_fail(SHARD_E_USAGE, "%s: bad peers %d, %d", what, to, from);
    if (to == c->rank && from == c->rank) {
        memmove(recv, send, n * shard_dtype_size(dt));
        *local = 1;
        return SHARD_OK;
    }
    c->bytes += n * shard_dtype_size(dt);
    return SHARD_OK;
}

shard_status shard_comm_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag)
{
    int local;
    shard_status s = sendrecv_begin(c, send, to, recv, from, n, dt, "sendrecv", &local);
    if (s || local) return s;
    return c->ops->sendrecv(c, send, to, recv, from, n, dt, tag);
}

/* Without the table's pair the blocking sendrecv runs here and the wait has
 * nothing to do: NCCL and the CUDA wrapper stay as they were. */
shard_status shard_comm_sendrecv_start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                       shard_dtype dt, int tag, shard_comm_req **req)
{
    *req = NULL;
    if (c->req.busy) return shard_fail(SHARD_E_USAGE, "sendrecv_start: a started transfer on this communicator was not waited for");
    int local;
    shard_status s = sendrecv_begin(c, send, to, recv, from, n, dt, "sendrecv_start", &local);
    const int backend = !local && c->ops->sendrecv_start && c->ops->wait;
    if (!s && !local) s = backend ? c->ops->sendrecv_start(c, send, to, recv, from, n, dt, tag)
                                  : c->ops->sendrecv(c, send, to, recv, from, n, dt, tag);
    if (s) return s;
    c->req = (shard_comm_req){.c = c, .busy = 1, .backend = backend};
    *req = &c->req;
    return SHARD_OK;
}

shard_status shard_comm_wait(shard_comm_req *req)
{
    if (!req) return SHARD_OK;
    if (!req->busy) return shard_fail(SHARD_E_USAGE, "wait: the transfer was already waited for");
    req->busy = 0;
    return req->backend ? req->c->ops->wait(req->c) : SHARD_OK;
}

/* one side of an all-to-all: every block addressable, buf present when it moves data */
static shard_status a2a_side(const shard_comm *c, const void *buf, const size_t *counts, const size_t *displs, size_t es,
                             const char *side)
{
    if (!counts || !displs) return shard_fail(SHARD_E_USAGE, "alltoallv: NULL %s counts or displacements", side);
    for (int r = 0; r < c->size; r++) {
        if (counts[r] > SIZE_MAX / es || displs[r] > SIZE_MAX / es - counts[r])
            return shard_fail(SHARD_E_USAGE, "alltoallv: %s block %d overflows size_t", side, r);
        if (counts[r] && !buf) return shard_fail(SHARD_E_USAGE, "alltoallv: NULL %s buffer with %zu elements for rank %d", side, counts[r], r);
    }
    return SHARD_OK;
}

shard_status shard_comm_alltoallv(shard_comm *c, const void *send, const size_t *scounts, const size_t *sdispls,
                                  void *recv, const size_t *rcounts, const size_t *rdispls, shard_dtype dt)
{
    const size_t es = shard_dtype_size(dt);
    if (!c || !es) return shard_fail(SHARD_E_USAGE, "alltoallv: %s", c ? "invalid dtype" : "NULL communicator");
    shard_status s = a2a_side(c, send, scounts, sdispls, es, "send");
    if (s || (s = a2a_side(c, recv, rcounts, rdispls, es, "receive"))) return s;
    /* the one pair a rank can check alone; the others would fail inside the backend */
    if (scounts[c->rank] != rcounts[c->rank])
        return shard_fail(SHARD_E_USAGE, "alltoallv: rank %d sends itself %zu elements but receives %zu", c->rank,
                          scounts[c->rank], rcounts[c->rank]);
    for (int r = 0; r < c->size; r++) c->bytes += r == c->rank ? 0 : (uint64_t)scounts[r] * es;
    return c->ops->alltoallv(c, send, scounts, sdispls, recv, rcounts, rdispls, dt);
}

shard_status shard_comm_barrier(shard_comm *c) { return c->ops->barrier(c); }

shard_status shard_comm_agree(shard_comm *c, shard_status mine, const char *others, int *theirs)
{
    if (c->size == 1) return mine;
    char msg[2048] = ""; /* mine's message, kept through the collective */
    if (mine) snprintf(msg, sizeof msg, "%s", shard_errmsg());
    int32_t worst = (int32_t)mine;
    shard_status s = shard_comm_allreduce(c, &worst, 1, SHARD_DT_I32, SHARD_OP_MAX);
    if (mine) return s ? shard_fail(mine, "%s", msg) : mine;
    if (s) return s;
    if (!worst) return SHARD_OK;
    if (theirs) *theirs = 1;
    shard_fail((shard_status)worst, "%s", others);
    shard_set_secondhand();
    return (shard_status)worst;
}

/* ----------------------------------------------------------- self backend */
static shard_status self_split(shard_comm *c, int color, int key, shard_comm **out)
{
    (void)c; (void)color; (void)key;
    return shard_comm_self(out);
}
static shard_status self_allreduce(shard_comm *c, void *b, size_t n, shard_dtype dt, shard_op op) { (void)c; (void)b; (void)n; (void)dt; (void)op; return SHARD_OK; }
static shard_status self_reduce_scatter(shard_comm *c, const void *s, void *r, size_t n, shard_dtype dt, shard_op op)
{
    (void)c; (void)op;
    memmove(r, s, n * shard_dtype_size(dt));
    return SHARD_OK;
}
static shard_status self_allgather(shard_comm *c, const void *s, void *r, size_t n, shard_dtype dt)
{
    (void)c;
    memmove(r, s, n * shard_dtype_size(dt));
    return SHARD_OK;
}
static shard_status self_broadcast(shard_comm *c, void *b, size_t n, shard_dtype dt, int root) { (void)c; (void)b; (void)n; (void)dt; (void)root; return SHARD_OK; }
static shard_status self_p2p(shard_comm *c, const void *b, size_t n, shard_dtype dt, int peer, int tag)
{
    (void)c; (void)b; (void)n; (void)dt; (void)peer; (void)tag;
    return shard_fail(SHARD_E_USAGE, "point-to-point transfer on a one-process communicator");
}
static shard_status self_recv(shard_comm *c, void *b, size_t n, shard_dtype dt, int peer, int tag) { return self_p2p(c, b, n, dt, peer, tag); }
static shard_status self_sendrecv(shard_comm *c, const void *s, int to, void *r, int from, size_t n, shard_dtype dt, int tag)
{
    (void)r; (void)from;
    return self_p2p(c, s, n, dt, to, tag);
}
static shard_status self_barrier(shard_comm *c) { (void)c; return SHARD_OK; }
static shard_status self_alltoallv(shard_comm *c, const void *s, const size_t *sc, const size_t *sd, void *r,
                                   const size_t *rc, const size_t *rd, shard_dtype dt)
{
    (void)c; (void)rc;
    if (sc[0]) memmove((char *)r + rd[0] * shard_dtype_size(dt), (const char *)s + sd[0] * shard_dtype_size(dt),
                       sc[0] * shard_dtype_size(dt));
    return SHARD_OK;
}

static const shard_comm_ops SELF = {"self", self_split, self_allreduce, self_reduce_scatter, self_allgather, self_broadcast,
                                    self_p2p, self_recv, self_sendrecv, self_alltoallv, self_barrier, NULL,
                                    NULL, NULL}; /* started transfers: only to and from rank 0, copied by comm.c */

shard_status shard_comm_self(shard_comm **out)
{
    shard_comm *c = calloc(1, sizeof *c);
    if (!c) return shard_fail(SHARD_E_NOMEM, "out of memory");
    c->ops = &SELF;
    c->rank = 0;
    c->size = 1;
    *out = c;
    return SHARD_OK;
}

/* ---------------------------------------------------------------- groups */
shard_status shard_groups_create(shard_comm *world, const shard_layout *l, shard_groups *g)
{
    memset(g, 0, sizeof *g);
    if (shard_layout_size(l) != world->size)
        return shard_fail(SHARD_E_USAGE, "the layout needs %d ranks but %d processes are running", shard_layout_size(l), world->size);
    shard_coords me = shard_layout_coords(l, world->rank);
    g->me = me;
    const int T = l->tp, C = l->cp, D = l->dp;
    shard_status s;
    /* color: the coordinates that stay fixed; key: the one that varies */
    if ((s = shard_comm_split(world, (me.pp * D + me.dp) * C + me.cp, me.tp, &g->tp)) ||
        (s = shard_comm_split(world, (me.pp * D + me.dp) * T + me.tp, me.cp, &g->cp)) ||
        (s = shard_comm_split(world, (me.pp * C + me.cp) * T + me.tp, me.dp, &g->dp)) ||
        (s = shard_comm_split(world, me.pp * T + me.tp, me.dp * C + me.cp, &g->dpcp)) ||
        (s = shard_comm_split(world, (me.dp * C + me.cp) * T + me.tp, me.pp, &g->pp))) {
        shard_groups_free(g);
        return s;
    }
    return SHARD_OK;
}

void shard_groups_free(shard_groups *g)
{
    shard_comm_free(g->tp); shard_comm_free(g->cp); shard_comm_free(g->dp); shard_comm_free(g->dpcp); shard_comm_free(g->pp);
    memset(g, 0, sizeof *g);
}

/* the launcher's word for this process's rank on its host (one GPU each) */
int shard_comm_local_rank(void)
{
    static const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK", NULL};
    for (int i = 0; vars[i]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}
