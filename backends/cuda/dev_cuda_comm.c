/* backends/cuda/dev_cuda_comm.c: communicators for tensors in the CUDA backend's memory.
 *
 * comm_for returns a thin communicator of this file around the real one, for two
 * reasons:
 *   - ordering: the NCCL communicator is stream-ordered on the backend's stream
 *     (shard_comm_nccl_enqueue_on): a collective is enqueued between the kernels
 *     that produce and consume its buffers and returns at once, so the host never
 *     waits for the GPU at a collective; a started transfer (ring attention's
 *     passes) runs on the communicator's own stream beside the backend's, ordered
 *     by events (nccl.c). The backend's own waits (dev_cuda.c, cu_wait) watch the
 *     communicators registered here for NCCL's failures and the deadline, so a
 *     failed or hung peer is an error, not a hang;
 *   - one rank: the self and MPI communicators copy buffers with memmove/memcpy
 *     (reduce-scatter, all-gather), which cannot touch device memory; here the
 *     copies of a one-rank group are device copies on the backend's stream, and
 *     the in-place collectives do nothing.
 * Under the CPU emulator (SMP_CUDA_EMU) NCCL is tests/gpu/emu/nccl_emu.cpp, over MPI,
 * with the same deferred (stream-ordered) semantics.
 *
 * The wrapper holds the backend's stream: free the communicators before the
 * backend (dev_close), as one frees any NCCL communicator before its device. It
 * is a communicator backend of libshard's public table (shard_comm_ops). */
#include <stdlib.h>

#include "dev_cuda.h"

typedef struct {
    dev *d;
    shard_comm *inner;   /* the NCCL communicator (owned); NULL for one rank */
    shard_comm_req *req; /* inner's started transfer */
} wcomm;

static wcomm *W(shard_comm *c) { return shard_comm_impl(c); }

static shard_status dcopy(shard_comm *c, void *dst, const void *src, size_t bytes)
{
    if (dst == src || !bytes) return SHARD_OK;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cu_of(W(c)->d)->st);
    if (e != cudaSuccess) return shard_fail(SHARD_E_IO, "cudaMemcpyAsync: %s", cudaGetErrorString(e));
    return SHARD_OK;
}

static shard_status wrap(dev *d, shard_comm *inner, shard_comm **out);

static shard_status w_split(shard_comm *c, int color, int key, shard_comm **out)
{
    shard_comm *in = NULL;
    shard_status s = W(c)->inner ? shard_comm_split(W(c)->inner, color, key, &in) : SHARD_OK;
    return s ? s : wrap(W(c)->d, in, out);
}

static shard_status w_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_allreduce(in, buf, n, dt, op) : SHARD_OK;
}

static shard_status w_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt,
                                     shard_op op)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_reduce_scatter(in, send, recv, n, dt, op) : dcopy(c, recv, send, n * shard_dtype_size(dt));
}

static shard_status w_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_allgather(in, send, recv, n, dt) : dcopy(c, recv, send, n * shard_dtype_size(dt));
}

static shard_status w_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_broadcast(in, buf, n, dt, root) : SHARD_OK;
}

static shard_status one_rank_p2p(void)
{
    return shard_fail(SHARD_E_USAGE, "point-to-point transfer on a one-process communicator");
}

static shard_status w_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_send(in, buf, n, dt, peer, tag) : one_rank_p2p();
}

static shard_status w_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_recv(in, buf, n, dt, peer, tag) : one_rank_p2p();
}

static shard_status w_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt,
                               int tag)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_sendrecv(in, send, to, recv, from, n, dt, tag) : one_rank_p2p();
}

static shard_status w_sendrecv_start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                     shard_dtype dt, int tag)
{
    wcomm *w = W(c);
    return w->inner ? shard_comm_sendrecv_start(w->inner, send, to, recv, from, n, dt, tag, &w->req) : one_rank_p2p();
}

static shard_status w_wait(shard_comm *c)
{
    shard_comm_req *q = W(c)->req;
    W(c)->req = NULL;
    return shard_comm_wait(q);
}

static shard_status w_alltoallv(shard_comm *c, const void *send, const size_t *sc, const size_t *sd, void *recv,
                                const size_t *rc, const size_t *rd, shard_dtype dt)
{
    shard_comm *in = W(c)->inner;
    const size_t es = shard_dtype_size(dt);
    if (!in) return sc[0] ? dcopy(c, (char *)recv + rd[0] * es, (const char *)send + sd[0] * es, sc[0] * es) : SHARD_OK;
    return shard_comm_alltoallv(in, send, sc, sd, recv, rc, rd, dt);
}

static shard_status w_barrier(shard_comm *c)
{
    shard_comm *in = W(c)->inner;
    return in ? shard_comm_barrier(in) : SHARD_OK;
}

static void w_free(shard_comm *c)
{
    wcomm *w = W(c);
    if (!w) return;
    if (w->inner) cu_comm_unwatch(w->d, w->inner);
    shard_comm_free(w->inner);
    free(w);
}

static const shard_comm_ops WRAP_OPS = {"cuda", w_split, w_allreduce, w_reduce_scatter, w_allgather, w_broadcast,
                                        w_send, w_recv, w_sendrecv, w_alltoallv, w_barrier, w_free,
                                        w_sendrecv_start, w_wait};

/* inner: NULL for a one-rank communicator; owned by the result, made stream-ordered
 * on the backend's stream and watched by its waits */
static shard_status wrap(dev *d, shard_comm *inner, shard_comm **out)
{
    wcomm *w = calloc(1, sizeof *w);
    shard_status s = w ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s && inner && !(s = shard_comm_nccl_enqueue_on(inner, cu_of(d)->st))) s = cu_comm_watch(d, inner);
    if (!s) s = shard_comm_create(&WRAP_OPS, inner ? shard_comm_rank(inner) : 0, inner ? shard_comm_size(inner) : 1,
                                  w, out);
    if (s) {
        if (inner) cu_comm_unwatch(d, inner);
        free(w);
        shard_comm_free(inner);
        return s;
    }
    w->d = d;
    w->inner = inner;
    return SHARD_OK;
}

shard_status cu_comm_for(dev *d, shard_comm *host, shard_comm **out, int *owned)
{
    *out = NULL;
    *owned = 0;
    shard_comm *inner = NULL;
    if (shard_comm_size(host) > 1) {
        shard_status s = shard_comm_nccl(host, d->device, &inner);
        if (s) return s;
    }
    shard_status s = wrap(d, inner, out);
    if (!s) *owned = 1;
    return s;
}
