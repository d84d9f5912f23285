/* The MPI backend: host buffers, any number of hosts. Errors are returned (the
 * communicators use MPI_ERRORS_RETURN), so a failing rank can report and exit;
 * Open MPI's runtime then ends the others. */
#include "comm.h"

#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>

/* a started send-receive's arguments, for the worker thread */
typedef struct {
    shard_comm *c;
    const void *send;
    void *recv;
    int to, from, tag;
    size_t n;
    shard_dtype dt;
} mpi_job;

typedef struct {
    MPI_Comm comm;
    comm_worker *worker; /* started by the first started transfer */
    mpi_job job;
    int posted;          /* the started transfer went to the worker (else it ran at start) */
} mpi_impl;

static MPI_Comm C_(shard_comm *c) { return ((mpi_impl *)c->impl)->comm; }

static MPI_Datatype mtype(shard_dtype dt)
{
    switch (dt) {
    case SHARD_DT_F32: return MPI_FLOAT;
    case SHARD_DT_F64: return MPI_DOUBLE;
    case SHARD_DT_I32: return MPI_INT32_T;
    case SHARD_DT_I64: return MPI_INT64_T;
    case SHARD_DT_U64: return MPI_UINT64_T;
    case SHARD_DT_U32: return MPI_UINT32_T;
    case SHARD_DT_U16: case SHARD_DT_F16: case SHARD_DT_BF16: case SHARD_DT_I16: return MPI_UINT16_T;
    default: return MPI_UINT8_T;
    }
}

static shard_status check(int rc, const char *what)
{
    if (rc == MPI_SUCCESS) return SHARD_OK;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return shard_fail(SHARD_E_IO, "MPI %s failed: %.*s", what, len, msg);
}

/* bf16 and f16 reductions: MPI has no 16-bit float types, so they travel as
 * MPI_UINT16_T and reduce through user operations that work element by element in
 * fp32 and round back to nearest even (a sum over ranks is thus rounded at each
 * step, as NCCL's is). Max propagates NaN. Created on first use (MPI is then
 * initialized), kept until MPI_Finalize. */
#define HALF_REDUCE(name, to_f32, from_f32, expr)                              \
    static void name(void *in, void *inout, int *len, MPI_Datatype *type)     \
    {                                                                          \
        (void)type;                                                            \
        const uint16_t *x = in;                                                \
        uint16_t *y = inout;                                                   \
        for (int i = 0; i < *len; i++) {                                       \
            const float a = to_f32(x[i]), b = to_f32(y[i]);                    \
            y[i] = from_f32(expr);                                             \
        }                                                                      \
    }
#define MAX_NAN(a, b) (isnan(a) || (a) > (b) ? (a) : (b))
HALF_REDUCE(bf16_sum, shard_bf16_to_f32, shard_f32_to_bf16, a + b)
HALF_REDUCE(bf16_max, shard_bf16_to_f32, shard_f32_to_bf16, MAX_NAN(a, b))
HALF_REDUCE(f16_sum, shard_f16_to_f32, shard_f32_to_f16, a + b)
HALF_REDUCE(f16_max, shard_f16_to_f32, shard_f32_to_f16, MAX_NAN(a, b))

static shard_status mop(shard_dtype dt, shard_op op, MPI_Op *out)
{
    static MPI_Op half[2][2]; /* [bf16, f16][sum, max] */
    static MPI_User_function *const fn[2][2] = {{bf16_sum, bf16_max}, {f16_sum, f16_max}};
    if (dt != SHARD_DT_BF16 && dt != SHARD_DT_F16) {
        *out = op == SHARD_OP_SUM ? MPI_SUM : MPI_MAX;
        return SHARD_OK;
    }
    const int t = dt == SHARD_DT_F16, o = op != SHARD_OP_SUM;
    if (!half[t][o]) {
        MPI_Op h;
        int rc = MPI_Op_create(fn[t][o], 1, &h);
        if (rc != MPI_SUCCESS) return shard_fail(SHARD_E_IO, "MPI_Op_create for %s reductions failed", shard_dtype_name(dt));
        half[t][o] = h;
    }
    *out = half[t][o];
    return SHARD_OK;
}

/* MPI counts are int: move large buffers in pieces */
#define MAXC ((size_t)1 << 30)

static shard_status m_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    MPI_Op mo;
    shard_status s = mop(dt, op, &mo);
    if (s) return s;
    for (size_t o = 0; o < n; o += MAXC) {
        size_t k = n - o < MAXC ? n - o : MAXC;
        s = check(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + o * shard_dtype_size(dt), (int)k, mtype(dt), mo, C_(c)),
                  "all-reduce");
        if (s) return s;
    }
    return SHARD_OK;
}

static shard_status m_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op)
{
    if (n > MAXC) return shard_fail(SHARD_E_USAGE, "reduce-scatter of more than 2^30 elements per rank");
    MPI_Op mo;
    shard_status s = mop(dt, op, &mo);
    if (s) return s;
    return check(MPI_Reduce_scatter_block(send, recv, (int)n, mtype(dt), mo, C_(c)), "reduce-scatter");
}

static shard_status m_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt)
{
    if (n > MAXC) return shard_fail(SHARD_E_USAGE, "all-gather of more than 2^30 elements per rank");
    return check(MPI_Allgather(send, (int)n, mtype(dt), recv, (int)n, mtype(dt), C_(c)), "all-gather");
}

static shard_status m_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root)
{
    for (size_t o = 0; o < n; o += MAXC) {
        size_t k = n - o < MAXC ? n - o : MAXC;
        shard_status s = check(MPI_Bcast((char *)buf + o * shard_dtype_size(dt), (int)k, mtype(dt), root, C_(c)), "broadcast");
        if (s) return s;
    }
    return SHARD_OK;
}

static shard_status m_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    if (n > MAXC) return shard_fail(SHARD_E_USAGE, "send of more than 2^30 elements");
    return check(MPI_Send(buf, (int)n, mtype(dt), peer, tag, C_(c)), "send");
}

static shard_status m_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    if (n > MAXC) return shard_fail(SHARD_E_USAGE, "receive of more than 2^30 elements");
    return check(MPI_Recv(buf, (int)n, mtype(dt), peer, tag, C_(c), MPI_STATUS_IGNORE), "receive");
}

static shard_status m_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag)
{
    if (n > MAXC) return shard_fail(SHARD_E_USAGE, "send-receive of more than 2^30 elements");
    return check(MPI_Sendrecv(send, (int)n, mtype(dt), to, tag, recv, (int)n, mtype(dt), from, tag, C_(c), MPI_STATUS_IGNORE), "send-receive");
}

/* Started transfers. Measured on this project's machine (Open MPI 4.1, shared
 * memory): MPI_Isend + MPI_Irecv, then a compute twice as long as the transfer,
 * then MPI_Waitall took about as long past the compute as the blocking
 * MPI_Sendrecv takes (the data moves only inside MPI calls), while a thread
 * running the blocking MPI_Sendrecv during the compute hid most of it. So the
 * communicator's worker thread runs it. That needs MPI_THREAD_SERIALIZED (the
 * caller makes no MPI call until the wait, shard.h); below it the transfer runs
 * at start, blocking. */
static int threads_ok(void)
{
    int provided = MPI_THREAD_SINGLE;
    return MPI_Query_thread(&provided) == MPI_SUCCESS && provided >= MPI_THREAD_SERIALIZED;
}

static shard_status run_job(void *arg)
{
    const mpi_job *j = arg;
    return m_sendrecv(j->c, j->send, j->to, j->recv, j->from, j->n, j->dt, j->tag);
}

static shard_status m_sendrecv_start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                     shard_dtype dt, int tag)
{
    mpi_impl *m = c->impl;
    m->posted = 0;
    if (!threads_ok()) return m_sendrecv(c, send, to, recv, from, n, dt, tag);
    shard_status s = m->worker ? SHARD_OK : comm_worker_start(&m->worker);
    if (s) return s;
    m->job = (mpi_job){c, send, recv, to, from, tag, n, dt};
    comm_worker_post(m->worker, run_job, &m->job);
    m->posted = 1;
    return SHARD_OK;
}

static shard_status m_wait(shard_comm *c)
{
    mpi_impl *m = c->impl;
    if (!m->posted) return SHARD_OK;
    m->posted = 0;
    return comm_worker_wait(m->worker);
}

/* The largest count or displacement given to MPI_Alltoallv (INT_MAX), past which
 * blocks go pairwise in chunks of at most MAXC elements; SMP_MPI_A2A_CHUNK (a test
 * hook) lowers both, to send small buffers through the pairwise path. */
static size_t a2a_limit(void)
{
    const char *e = getenv("SMP_MPI_A2A_CHUNK");
    long v = e ? atol(e) : 0;
    return v > 0 && (size_t)v < MAXC ? (size_t)v : (size_t)INT_MAX;
}

static int fits(const size_t *a, int n, size_t lim)
{
    for (int i = 0; i < n; i++) if (a[i] > lim) return 0;
    return 1;
}

static shard_status a2a_ints(shard_comm *c, const void *send, const size_t *sc, const size_t *sd, void *recv,
                             const size_t *rc, const size_t *rd, shard_dtype dt)
{
    const int n = c->size;
    int *v = malloc(sizeof *v * 4 * (size_t)n);
    if (!v) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (int r = 0; r < n; r++) v[r] = (int)sc[r], v[n + r] = (int)sd[r], v[2 * n + r] = (int)rc[r], v[3 * n + r] = (int)rd[r];
    shard_status s = check(MPI_Alltoallv(send, v, v + n, mtype(dt), recv, v + 2 * n, v + 3 * n, mtype(dt), C_(c)), "all-to-all");
    free(v);
    return s;
}

/* a tag of its own so that the chunks never match the caller's point-to-point
 * transfers (each pair's chunks arrive in order: MPI does not overtake) */
#define A2A_TAG 32000

static size_t nchunks(size_t k, size_t lim) { return (k + lim - 1) / lim; }

/* post the chunks of one block, receives when recv is set, else sends; *nq grows */
static int a2a_post(shard_comm *c, char *recv, const char *send, size_t k, shard_dtype dt, size_t lim, int peer,
                    MPI_Request *q, int *nq)
{
    const size_t es = shard_dtype_size(dt);
    for (size_t o = 0; o < k; o += lim) {
        const int m = (int)(k - o < lim ? k - o : lim);
        int rc = recv ? MPI_Irecv(recv + o * es, m, mtype(dt), peer, A2A_TAG, C_(c), &q[*nq])
                      : MPI_Isend(send + o * es, m, mtype(dt), peer, A2A_TAG, C_(c), &q[*nq]);
        if (rc != MPI_SUCCESS) return rc;
        ++*nq;
    }
    return MPI_SUCCESS;
}

/* every block in chunks of at most lim elements, all posted, then one wait */
static shard_status a2a_pairwise(shard_comm *c, const char *send, const size_t *sc, const size_t *sd, char *recv,
                                 const size_t *rc, const size_t *rd, shard_dtype dt, size_t lim)
{
    const size_t es = shard_dtype_size(dt);
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += nchunks(sc[r], lim) + nchunks(rc[r], lim);
    if (total > INT_MAX) return shard_fail(SHARD_E_USAGE, "all-to-all of more than INT_MAX chunks");
    MPI_Request *q = malloc(sizeof *q * (total ? total : 1));
    if (!q) return shard_fail(SHARD_E_NOMEM, "out of memory");
    int nq = 0, err = MPI_SUCCESS;
    /* receives before sends, so that most arrivals find theirs posted */
    for (int i = 0; i < c->size && err == MPI_SUCCESS; i++) {
        const int p = (c->rank + i) % c->size;
        if (rc[p]) err = a2a_post(c, recv + rd[p] * es, NULL, rc[p], dt, lim, p, q, &nq);
    }
    for (int i = 0; i < c->size && err == MPI_SUCCESS; i++) {
        const int p = (c->rank + c->size - i) % c->size;
        if (sc[p]) err = a2a_post(c, NULL, send + sd[p] * es, sc[p], dt, lim, p, q, &nq);
    }
    /* wait for what was posted even after a failure: the buffers stay in use until then */
    int werr = MPI_Waitall(nq, q, MPI_STATUSES_IGNORE);
    free(q);
    return check(err != MPI_SUCCESS ? err : werr, "all-to-all");
}

static shard_status m_alltoallv(shard_comm *c, const void *send, const size_t *sc, const size_t *sd, void *recv,
                                const size_t *rc, const size_t *rd, shard_dtype dt)
{
    const size_t lim = a2a_limit();
    const int n = c->size;
    /* displacements are each rank's own, so the ranks agree on the path, and on
     * the chunk, which a receive must not be shorter than */
    int agree[2] = {fits(sc, n, lim) && fits(sd, n, lim) && fits(rc, n, lim) && fits(rd, n, lim),
                    (int)(lim < MAXC ? lim : MAXC)};
    shard_status s = check(MPI_Allreduce(MPI_IN_PLACE, agree, 2, MPI_INT, MPI_MIN, C_(c)), "all-to-all");
    if (s) return s;
    if (agree[0]) return a2a_ints(c, send, sc, sd, recv, rc, rd, dt);
    return a2a_pairwise(c, send, sc, sd, recv, rc, rd, dt, (size_t)agree[1]);
}

static shard_status m_barrier(shard_comm *c) { return check(MPI_Barrier(C_(c)), "barrier"); }

static void m_free(shard_comm *c)
{
    mpi_impl *m = c->impl;
    int fin = 0;
    if (m) comm_worker_free(m->worker);
    MPI_Finalized(&fin);
    if (m && m->comm != MPI_COMM_WORLD && !fin) MPI_Comm_free(&m->comm);
    free(m);
}

static shard_status wrap(MPI_Comm comm, shard_comm **out);

static shard_status m_split(shard_comm *c, int color, int key, shard_comm **out)
{
    MPI_Comm nc;
    shard_status s = check(MPI_Comm_split(C_(c), color, key, &nc), "communicator split");
    if (s) return s;
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    return wrap(nc, out);
}

static const shard_comm_ops MPI_OPS = {"mpi", m_split, m_allreduce, m_reduce_scatter, m_allgather, m_broadcast,
                                       m_send, m_recv, m_sendrecv, m_alltoallv, m_barrier, m_free,
                                       m_sendrecv_start, m_wait};

static shard_status wrap(MPI_Comm comm, shard_comm **out)
{
    shard_comm *c = calloc(1, sizeof *c);
    mpi_impl *m = calloc(1, sizeof *m);
    if (!c || !m) { free(c); free(m); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    m->comm = comm;
    c->ops = &MPI_OPS;
    c->impl = m;
    MPI_Comm_rank(comm, &c->rank);
    MPI_Comm_size(comm, &c->size);
    *out = c;
    return SHARD_OK;
}

shard_status shard_comm_mpi_world(shard_comm **out)
{
    int init = 0;
    MPI_Initialized(&init);
    if (!init) return shard_fail(SHARD_E_USAGE, "MPI is not initialized");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    return wrap(MPI_COMM_WORLD, out);
}
