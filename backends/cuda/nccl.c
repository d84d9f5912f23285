/* The NCCL backend of the communicator: GPU buffers, one GPU per rank,
 * bootstrapped over another communicator (MPI) that broadcasts NCCL's unique id.
 * Built into libshard_nccl.so when the CUDA toolkit is found.
 *
 * Every call is enqueued on the communicator's own stream and then waited for
 * with a deadline: while waiting, NCCL's asynchronous error state is polled, and
 * on an error or past the deadline (SMP_NCCL_TIMEOUT seconds, default 300) the
 * NCCL communicator is aborted and the call returns an error, so a failing peer
 * surfaces as an error on every rank instead of a hang. */
#include "shard.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    ncclComm_t comm;
    cudaStream_t stream;
    int device;
    int aborted;
} nccl_impl;

static nccl_impl *I(shard_comm *c) { return shard_comm_impl(c); }

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static double timeout_s(void)
{
    const char *e = getenv("SMP_NCCL_TIMEOUT");
    double v = e ? atof(e) : 0;
    return v > 0 ? v : 300.0;
}

static int ntype(shard_dtype dt, ncclDataType_t *t)
{
    switch (dt) {
    case SHARD_DT_F32: *t = ncclFloat32; return 1;
    case SHARD_DT_F64: *t = ncclFloat64; return 1;
    case SHARD_DT_F16: *t = ncclFloat16; return 1;
    case SHARD_DT_BF16: *t = ncclBfloat16; return 1;
    case SHARD_DT_I32: *t = ncclInt32; return 1;
    case SHARD_DT_I64: *t = ncclInt64; return 1;
    case SHARD_DT_U64: *t = ncclUint64; return 1;
    case SHARD_DT_U32: *t = ncclUint32; return 1;
    case SHARD_DT_U8: case SHARD_DT_I8: case SHARD_DT_BOOL: case SHARD_DT_F8_E4M3: case SHARD_DT_F8_E5M2: *t = ncclUint8; return 1;
    default: return 0;
    }
}

static shard_status fail_nccl(shard_comm *c, ncclResult_t r, const char *what)
{
    return shard_fail(SHARD_E_IO, "NCCL %s failed on rank %d: %s%s%s", what, shard_comm_rank(c), ncclGetErrorString(r),
                      ncclGetLastError(I(c)->comm) ? ": " : "", ncclGetLastError(I(c)->comm) ? ncclGetLastError(I(c)->comm) : "");
}

/* Wait for the stream, watching NCCL's error state and the deadline. */
static shard_status wait(shard_comm *c, const char *what)
{
    nccl_impl *m = I(c);
    const double deadline = now() + timeout_s();
    for (;;) {
        cudaError_t q = cudaStreamQuery(m->stream);
        if (q == cudaSuccess) return SHARD_OK;
        if (q != cudaErrorNotReady) return shard_fail(SHARD_E_IO, "CUDA error during NCCL %s on rank %d: %s", what, shard_comm_rank(c), cudaGetErrorString(q));
        ncclResult_t ae = ncclSuccess;
        ncclCommGetAsyncError(m->comm, &ae);
        if (ae != ncclSuccess && ae != ncclInProgress) {
            ncclCommAbort(m->comm);
            m->aborted = 1;
            return fail_nccl(c, ae, what);
        }
        if (now() > deadline) {
            ncclCommAbort(m->comm);
            m->aborted = 1;
            return shard_fail(SHARD_E_IO, "NCCL %s on rank %d did not finish within %.0f s (a peer failed or hangs); communicator aborted",
                              what, shard_comm_rank(c), timeout_s());
        }
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

#define CALL(what, expr) do { \
        if (I(c)->aborted) return shard_fail(SHARD_E_IO, "NCCL %s on rank %d: the communicator was aborted", what, shard_comm_rank(c)); \
        ncclResult_t r_ = (expr); \
        if (r_ != ncclSuccess) return fail_nccl(c, r_, what); \
        return wait(c, what); } while (0)

static shard_status n_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL all-reduce: dtype %s", shard_dtype_name(dt));
    CALL("all-reduce", ncclAllReduce(buf, buf, n, t, op == SHARD_OP_SUM ? ncclSum : ncclMax, I(c)->comm, I(c)->stream));
}

static shard_status n_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL reduce-scatter: dtype %s", shard_dtype_name(dt));
    CALL("reduce-scatter", ncclReduceScatter(send, recv, n, t, op == SHARD_OP_SUM ? ncclSum : ncclMax, I(c)->comm, I(c)->stream));
}

static shard_status n_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL all-gather: dtype %s", shard_dtype_name(dt));
    CALL("all-gather", ncclAllGather(send, recv, n, t, I(c)->comm, I(c)->stream));
}

static shard_status n_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL broadcast: dtype %s", shard_dtype_name(dt));
    CALL("broadcast", ncclBroadcast(buf, buf, n, t, root, I(c)->comm, I(c)->stream));
}

static shard_status n_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    (void)tag; /* NCCL matches point-to-point transfers by order, not tags */
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL send: dtype %s", shard_dtype_name(dt));
    CALL("send", ncclSend(buf, n, t, peer, I(c)->comm, I(c)->stream));
}

static shard_status n_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    (void)tag;
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL receive: dtype %s", shard_dtype_name(dt));
    CALL("receive", ncclRecv(buf, n, t, peer, I(c)->comm, I(c)->stream));
}

static ncclResult_t pair(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, ncclDataType_t t)
{
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess && to != shard_comm_rank(c)) r = ncclSend(send, n, t, to, I(c)->comm, I(c)->stream);
    if (r == ncclSuccess && from != shard_comm_rank(c)) r = ncclRecv(recv, n, t, from, I(c)->comm, I(c)->stream);
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

static shard_status n_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag)
{
    (void)tag;
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL send-receive: dtype %s", shard_dtype_name(dt));
    CALL("send-receive", pair(c, send, to, recv, from, n, t));
}

/* one group: a send and a receive per peer with data; the own block a device copy
 * on the same stream (so the wait below covers it). Moved as bytes: no reduction,
 * so any dtype goes. */
static ncclResult_t a2a(shard_comm *c, const char *send, const size_t *sc, const size_t *sd, char *recv,
                        const size_t *rc, const size_t *rd, size_t es)
{
    const int me = shard_comm_rank(c);
    if (sc[me] && cudaMemcpyAsync(recv + rd[me] * es, send + sd[me] * es, sc[me] * es, cudaMemcpyDeviceToDevice,
                                  I(c)->stream) != cudaSuccess)
        return ncclUnhandledCudaError;
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < shard_comm_size(c) && r == ncclSuccess; p++) {
        if (p == me) continue;
        if (sc[p]) r = ncclSend(send + sd[p] * es, sc[p] * es, ncclUint8, p, I(c)->comm, I(c)->stream);
        if (r == ncclSuccess && rc[p]) r = ncclRecv(recv + rd[p] * es, rc[p] * es, ncclUint8, p, I(c)->comm, I(c)->stream);
    }
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

static shard_status n_alltoallv(shard_comm *c, const void *send, const size_t *sc, const size_t *sd, void *recv,
                                const size_t *rc, const size_t *rd, shard_dtype dt)
{
    CALL("all-to-all", a2a(c, send, sc, sd, recv, rc, rd, shard_dtype_size(dt)));
}

static shard_status n_barrier(shard_comm *c)
{
    /* a one-element all-reduce on a small device buffer */
    void *d = NULL;
    if (cudaMalloc(&d, 4) != cudaSuccess) return shard_fail(SHARD_E_NOMEM, "NCCL barrier: no device memory");
    cudaMemsetAsync(d, 0, 4, I(c)->stream);
    shard_status s = n_allreduce(c, d, 1, SHARD_DT_F32, SHARD_OP_SUM);
    cudaFree(d);
    return s;
}

static void n_free(shard_comm *c)
{
    nccl_impl *m = I(c);
    if (!m) return;
    if (!m->aborted) ncclCommDestroy(m->comm);
    cudaStreamDestroy(m->stream);
    free(m);
}

static shard_status wrap(ncclComm_t comm, int device, shard_comm **out);

static shard_status n_split(shard_comm *c, int color, int key, shard_comm **out)
{
    ncclComm_t nc;
    ncclResult_t r = ncclCommSplit(I(c)->comm, color, key, &nc, NULL);
    if (r != ncclSuccess) return fail_nccl(c, r, "communicator split");
    return wrap(nc, I(c)->device, out);
}

static const shard_comm_ops NCCL_OPS = {"nccl", n_split, n_allreduce, n_reduce_scatter, n_allgather, n_broadcast,
                                        n_send, n_recv, n_sendrecv, n_alltoallv, n_barrier, n_free,
                                        NULL, NULL}; /* started transfers: sendrecv at start (shard.h) */

static shard_status wrap(ncclComm_t comm, int device, shard_comm **out)
{
    nccl_impl *m = calloc(1, sizeof *m);
    if (!m) { ncclCommDestroy(comm); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    m->comm = comm;
    m->device = device;
    if (cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking) != cudaSuccess) {
        ncclCommDestroy(comm);
        free(m);
        return shard_fail(SHARD_E_IO, "NCCL: cannot create a CUDA stream");
    }
    int rank = 0, size = 1;
    ncclCommUserRank(comm, &rank);
    ncclCommCount(comm, &size);
    shard_status s = shard_comm_create(&NCCL_OPS, rank, size, m, out);
    if (s) {
        cudaStreamDestroy(m->stream);
        ncclCommDestroy(comm);
        free(m);
    }
    return s;
}

shard_status shard_comm_nccl(shard_comm *bootstrap, int device, shard_comm **out)
{
    *out = NULL;
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) return shard_fail(SHARD_E_IO, "rank %d: cannot use GPU %d: %s", shard_comm_rank(bootstrap), device, cudaGetErrorString(ce));
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (shard_comm_rank(bootstrap) == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) memset(&id, 0, sizeof id); /* the others learn it from the zero id below */
    }
    shard_status s = shard_comm_broadcast(bootstrap, &id, sizeof id, SHARD_DT_U8, 0);
    if (s) return s;
    static const ncclUniqueId zero;
    if (!memcmp(&id, &zero, sizeof id)) return shard_fail(SHARD_E_IO, "NCCL: rank 0 could not create a unique id");
    ncclComm_t comm;
    ncclResult_t r = ncclCommInitRank(&comm, shard_comm_size(bootstrap), id, shard_comm_rank(bootstrap));
    if (r != ncclSuccess) return shard_fail(SHARD_E_IO, "NCCL initialization failed on rank %d: %s", shard_comm_rank(bootstrap), ncclGetErrorString(r));
    return wrap(comm, device, out);
}
