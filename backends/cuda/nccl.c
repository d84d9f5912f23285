/* The NCCL backend of the communicator: GPU buffers, one GPU per rank,
 * bootstrapped over another communicator (MPI) that broadcasts NCCL's unique id.
 * Built into libshard_nccl.so when the CUDA toolkit is found (and, for the CPU
 * emulator, into its libsmp_cuda.so over tests/gpu/emu/nccl_emu.cpp).
 *
 * Two ways to call it:
 *   - blocking (the default): every call is enqueued on the communicator's own
 *     stream and then waited for with a deadline: while waiting, NCCL's
 *     asynchronous error state is polled, and on an error or past the deadline
 *     (SMP_NCCL_TIMEOUT seconds, default 300) the NCCL communicator is aborted and
 *     the call returns an error, so a failing peer surfaces as an error on every
 *     rank instead of a hang;
 *   - stream-ordered (shard_comm_nccl_enqueue_on, the CUDA backend): calls are
 *     enqueued on the caller's stream and return at once, as the kernels around
 *     them are (a host wait per call drained the GPU's queue at every all-reduce);
 *     the caller's own waits watch for failures (shard_comm_nccl_check). Started
 *     transfers run on the communicator's stream beside the caller's (ring
 *     attention's passes overlap its compute), ordered by two events. */
#include "shard.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    ncclComm_t comm;
    cudaStream_t stream;     /* its own: blocking calls, started transfers */
    cudaStream_t on;         /* stream-ordered: the caller's stream; NULL: blocking */
    cudaEvent_t ready, done; /* a started transfer: after `on`'s work so far; its end */
    int posted;              /* a started transfer awaits shard_comm_wait */
    int device;
    int aborted;
    double timeout;          /* SMP_NCCL_TIMEOUT, read once when the first was made */
    char why[384];           /* what aborted it, for the calls refused after */
} nccl_impl;

static nccl_impl *I(shard_comm *c) { return shard_comm_impl(c); }

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* SMP_NCCL_TIMEOUT: seconds above 0, the whole value a number ("5m" is refused, not
 * read as 5 s; "inf": no deadline), default 300; *ok 0 when it is set otherwise */
static double timeout_parse(int *ok)
{
    const char *e = getenv("SMP_NCCL_TIMEOUT");
    *ok = 1;
    if (!e) return 300.0;
    char *end = NULL;
    const double v = strtod(e, &end);
    if (end == e || *end || !(v > 0)) {
        *ok = 0;
        return 300.0;
    }
    return v;
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

static void abort_comm(shard_comm *c, const char *why)
{
    nccl_impl *m = I(c);
    if (m->aborted) return;
    ncclCommAbort(m->comm);
    m->aborted = 1;
    snprintf(m->why, sizeof m->why, "%s", why);
}

/* NCCL's asynchronous error, or a wait past the deadline: the communicator aborted */
static shard_status watch(shard_comm *c, double waited, const char *what)
{
    nccl_impl *m = I(c);
    if (m->aborted)
        return shard_fail(SHARD_E_IO, "NCCL %s on rank %d: the communicator was aborted after: %s", what,
                          shard_comm_rank(c), m->why);
    ncclResult_t ae = ncclSuccess;
    ncclCommGetAsyncError(m->comm, &ae);
    shard_status s = SHARD_OK;
    if (ae != ncclSuccess && ae != ncclInProgress) s = fail_nccl(c, ae, what);
    else if (waited > m->timeout)
        s = shard_fail(SHARD_E_IO, "NCCL %s on rank %d did not finish within %.0f s (a peer failed or hangs)", what,
                       shard_comm_rank(c), m->timeout);
    if (s) abort_comm(c, shard_errmsg());
    return s;
}

void shard_comm_nccl_abort(shard_comm *c, const char *why) { abort_comm(c, why); }

shard_status shard_comm_nccl_check(shard_comm *c, double waited_s)
{
    return watch(c, waited_s, "work on the GPU");
}

/* Wait for the stream, watching NCCL's error state and the deadline. */
static shard_status wait(shard_comm *c, const char *what)
{
    nccl_impl *m = I(c);
    const double t0 = now();
    for (;;) {
        cudaError_t q = cudaStreamQuery(m->stream);
        if (q == cudaSuccess) return SHARD_OK;
        if (q != cudaErrorNotReady) return shard_fail(SHARD_E_IO, "CUDA error during NCCL %s on rank %d: %s", what, shard_comm_rank(c), cudaGetErrorString(q));
        shard_status s = watch(c, now() - t0, what);
        if (s) return s;
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

/* where a call's work goes: the caller's stream when stream-ordered */
static cudaStream_t ST(shard_comm *c) { return I(c)->on ? I(c)->on : I(c)->stream; }

/* a call: refused on an aborted or failed communicator; blocking: waited for */
#define CALL(what, expr) do { \
        shard_status s_ = watch(c, 0, what); \
        if (s_) return s_; \
        ncclResult_t r_ = (expr); \
        if (r_ != ncclSuccess) return fail_nccl(c, r_, what); \
        return I(c)->on ? SHARD_OK : wait(c, what); } while (0)

static shard_status n_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL all-reduce: dtype %s", shard_dtype_name(dt));
    CALL("all-reduce", ncclAllReduce(buf, buf, n, t, op == SHARD_OP_SUM ? ncclSum : ncclMax, I(c)->comm, ST(c)));
}

static shard_status n_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL reduce-scatter: dtype %s", shard_dtype_name(dt));
    CALL("reduce-scatter", ncclReduceScatter(send, recv, n, t, op == SHARD_OP_SUM ? ncclSum : ncclMax, I(c)->comm, ST(c)));
}

static shard_status n_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL all-gather: dtype %s", shard_dtype_name(dt));
    CALL("all-gather", ncclAllGather(send, recv, n, t, I(c)->comm, ST(c)));
}

static shard_status n_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root)
{
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL broadcast: dtype %s", shard_dtype_name(dt));
    CALL("broadcast", ncclBroadcast(buf, buf, n, t, root, I(c)->comm, ST(c)));
}

static shard_status n_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    (void)tag; /* NCCL matches point-to-point transfers by order, not tags */
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL send: dtype %s", shard_dtype_name(dt));
    CALL("send", ncclSend(buf, n, t, peer, I(c)->comm, ST(c)));
}

static shard_status n_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    (void)tag;
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL receive: dtype %s", shard_dtype_name(dt));
    CALL("receive", ncclRecv(buf, n, t, peer, I(c)->comm, ST(c)));
}

static ncclResult_t pair(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, ncclDataType_t t,
                         cudaStream_t st)
{
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess && to != shard_comm_rank(c)) r = ncclSend(send, n, t, to, I(c)->comm, st);
    if (r == ncclSuccess && from != shard_comm_rank(c)) r = ncclRecv(recv, n, t, from, I(c)->comm, st);
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

static shard_status n_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag)
{
    (void)tag;
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL send-receive: dtype %s", shard_dtype_name(dt));
    CALL("send-receive", pair(c, send, to, recv, from, n, t, ST(c)));
}

/* the communicator's own stream after the work enqueued on `on` so far */
static ncclResult_t join(shard_comm *c)
{
    nccl_impl *m = I(c);
    if (!m->on) return ncclSuccess;
    return cudaEventRecord(m->ready, m->on) == cudaSuccess && cudaStreamWaitEvent(m->stream, m->ready, 0) == cudaSuccess
               ? ncclSuccess : ncclUnhandledCudaError;
}

static ncclResult_t start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, ncclDataType_t t)
{
    nccl_impl *m = I(c);
    ncclResult_t r = join(c);
    if (r == ncclSuccess) r = pair(c, send, to, recv, from, n, t, m->stream);
    if (r == ncclSuccess && cudaEventRecord(m->done, m->stream) != cudaSuccess) r = ncclUnhandledCudaError;
    m->posted = r == ncclSuccess;
    return r;
}

/* stream-ordered: the transfer on the communicator's stream, after the caller's work
 * enqueued so far (which may have written send, or still read recv's old contents);
 * blocking: a send-receive at once */
static shard_status n_sendrecv_start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                     shard_dtype dt, int tag)
{
    if (!I(c)->on) return n_sendrecv(c, send, to, recv, from, n, dt, tag);
    ncclDataType_t t;
    if (!ntype(dt, &t)) return shard_fail(SHARD_E_USAGE, "NCCL send-receive: dtype %s", shard_dtype_name(dt));
    CALL("started send-receive", start(c, send, to, recv, from, n, t));
}

/* the caller's later work after the transfer: no host wait */
static shard_status n_wait(shard_comm *c)
{
    nccl_impl *m = I(c);
    if (!m->posted) return SHARD_OK;
    m->posted = 0;
    cudaError_t e = cudaStreamWaitEvent(m->on, m->done, 0);
    return e == cudaSuccess ? SHARD_OK : shard_fail(SHARD_E_IO, "CUDA error after an NCCL transfer on rank %d: %s",
                                                    shard_comm_rank(c), cudaGetErrorString(e));
}

/* one group: a send and a receive per peer with data; the own block a device copy
 * on the same stream (so the wait below covers it). Moved as bytes: no reduction,
 * so any dtype goes. */
static ncclResult_t a2a(shard_comm *c, const char *send, const size_t *sc, const size_t *sd, char *recv,
                        const size_t *rc, const size_t *rd, size_t es)
{
    const int me = shard_comm_rank(c);
    if (sc[me] && cudaMemcpyAsync(recv + rd[me] * es, send + sd[me] * es, sc[me] * es, cudaMemcpyDeviceToDevice,
                                  ST(c)) != cudaSuccess)
        return ncclUnhandledCudaError;
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < shard_comm_size(c) && r == ncclSuccess; p++) {
        if (p == me) continue;
        if (sc[p]) r = ncclSend(send + sd[p] * es, sc[p] * es, ncclUint8, p, I(c)->comm, ST(c));
        if (r == ncclSuccess && rc[p]) r = ncclRecv(recv + rd[p] * es, rc[p] * es, ncclUint8, p, I(c)->comm, ST(c));
    }
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

static shard_status n_alltoallv(shard_comm *c, const void *send, const size_t *sc, const size_t *sd, void *recv,
                                const size_t *rc, const size_t *rd, shard_dtype dt)
{
    CALL("all-to-all", a2a(c, send, sc, sd, recv, rc, rd, shard_dtype_size(dt)));
}

/* a one-element all-reduce on a small device buffer, waited for (stream-ordered
 * too: a barrier is where the host meets the others) after the caller's work */
static ncclResult_t barrier_call(shard_comm *c, float *d)
{
    nccl_impl *m = I(c);
    ncclResult_t r = join(c);
    if (r == ncclSuccess && cudaMemsetAsync(d, 0, 4, m->stream) != cudaSuccess) r = ncclUnhandledCudaError;
    return r == ncclSuccess ? ncclAllReduce(d, d, 1, ncclFloat32, ncclSum, m->comm, m->stream) : r;
}

static shard_status n_barrier(shard_comm *c)
{
    float *d = NULL;
    if (cudaMalloc((void **)&d, 4) != cudaSuccess) return shard_fail(SHARD_E_NOMEM, "NCCL barrier: no device memory");
    shard_status s = watch(c, 0, "barrier");
    ncclResult_t r = s ? ncclSuccess : barrier_call(c, d);
    if (!s) s = r != ncclSuccess ? fail_nccl(c, r, "barrier") : wait(c, "barrier");
    if (!s) cudaFree(d); /* (after a failure the device may be hung: leaked) */
    return s;
}

static void n_free_impl(nccl_impl *m)
{
    if (!m) return;
    if (!m->aborted) ncclCommDestroy(m->comm);
    if (m->ready) cudaEventDestroy(m->ready);
    if (m->done) cudaEventDestroy(m->done);
    if (m->stream) cudaStreamDestroy(m->stream);
    free(m);
}

static void n_free(shard_comm *c) { n_free_impl(I(c)); }

static shard_status wrap(ncclComm_t comm, int device, cudaStream_t on, double timeout, shard_comm **out);

static shard_status n_split(shard_comm *c, int color, int key, shard_comm **out)
{
    ncclComm_t nc;
    ncclResult_t r = ncclCommSplit(I(c)->comm, color, key, &nc, NULL);
    if (r != ncclSuccess) return fail_nccl(c, r, "communicator split");
    return wrap(nc, I(c)->device, I(c)->on, I(c)->timeout, out);
}

static const shard_comm_ops NCCL_OPS = {"nccl", n_split, n_allreduce, n_reduce_scatter, n_allgather, n_broadcast,
                                        n_send, n_recv, n_sendrecv, n_alltoallv, n_barrier, n_free,
                                        n_sendrecv_start, n_wait};

/* on: the caller's stream of a stream-ordered parent (NULL: blocking); timeout: the
 * parent's deadline (seconds) */
static shard_status wrap(ncclComm_t comm, int device, cudaStream_t on, double timeout, shard_comm **out)
{
    nccl_impl *m = calloc(1, sizeof *m);
    if (!m) { ncclCommDestroy(comm); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    m->comm = comm;
    m->device = device;
    m->on = on;
    m->timeout = timeout;
    int rank = 0, size = 1;
    ncclCommUserRank(comm, &rank);
    ncclCommCount(comm, &size);
    shard_status s = SHARD_OK;
    if (cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->done, cudaEventDisableTiming) != cudaSuccess)
        s = shard_fail(SHARD_E_IO, "NCCL: cannot create a CUDA stream or event");
    if (!s) s = shard_comm_create(&NCCL_OPS, rank, size, m, out);
    if (s) n_free_impl(m);
    return s;
}

shard_status shard_comm_nccl_enqueue_on(shard_comm *c, void *stream)
{
    if (!c || strcmp(shard_comm_backend(c), "nccl"))
        return shard_fail(SHARD_E_USAGE, "shard_comm_nccl_enqueue_on: not an NCCL communicator");
    if (I(c)->posted) return shard_fail(SHARD_E_USAGE, "shard_comm_nccl_enqueue_on: a started transfer is in flight");
    I(c)->on = stream;
    return SHARD_OK;
}

shard_status shard_comm_nccl(shard_comm *bootstrap, int device, shard_comm **out)
{
    *out = NULL;
    int ok;
    const double timeout = timeout_parse(&ok);
    if (!ok)
        return shard_fail(SHARD_E_USAGE, "SMP_NCCL_TIMEOUT=%s: not a number of seconds above 0",
                          getenv("SMP_NCCL_TIMEOUT"));
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
    return wrap(comm, device, NULL, timeout, out);
}
