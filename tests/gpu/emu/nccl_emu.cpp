/* tests/gpu/emu/nccl_emu.cpp: the part of NCCL that backends/cuda/nccl.c uses, for the
 * CPU emulator (cuda_emu.h), so that the communicator a GPU run uses is the one the
 * emulated runs use: one process per rank under mpirun, every transfer MPI
 * point-to-point messages on MPI_COMM_WORLD under tags of its own per communicator.
 *
 * As on a GPU, a call returns before its data has arrived: its messages are posted
 * at once (MPI_Isend / MPI_Irecv of copies: what it sends is its buffers' contents
 * when the call is made, which on the emulator is when the stream's work before it
 * has run), and it completes when the emulator flushes its stream (cuda_emu.cpp: a
 * kernel, copy or GEMM on that stream, a wait for it or for an event recorded on
 * it): the received data land in the buffers then, so a kernel that reads them
 * before the wait that covers the transfer sees the old contents, and a send
 * buffer written before that wait is reported (the transfer may still be reading it
 * on a GPU). Posting at once, as a GPU progresses on its own, keeps the host free:
 * a rank may go on to other (host) communication while its transfers wait for
 * their peers. Buffers must be cudaMalloc'd memory (emu_device_range), as NCCL's
 * must be device memory: a host pointer is refused. Reductions add in rank order
 * (bf16 and f16 in fp32, rounded once), so every rank gets the same bits.
 * Point-to-point calls inside ncclGroupStart/End are posted at the group's end;
 * collectives inside a group are not emulated (nccl.c makes none).
 *
 * Environment (tests of the failure paths): SMP_EMU_NCCL_FAIL_AT=n makes this
 * process's n-th call (1-based, counted over all communicators) fail:
 * SMP_EMU_NCCL_FAIL=error (default) moves nothing and reports ncclSystemError as the
 * communicator's asynchronous error; =hang stalls the call's stream, and the streams
 * that wait for it, until the communicator is aborted (cudaStreamQuery says not ready;
 * a host synchronization with it ends the program: a GPU run would hang there). An
 * aborted communicator's calls still complete their messages (the peers posted theirs)
 * but deliver nothing and check nothing. */
#include "cuda_emu.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define OMPI_SKIP_MPICXX 1 /* MPI's C interface only (no libmpi_cxx) */
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <memory>
#include <vector>

struct ncclComm {
    int rank, size, tag;
    std::vector<int> world; /* each rank's MPI_COMM_WORLD rank */
    ncclResult_t async;
    std::string error;
    bool aborted;                      /* its queued work then does nothing */
    std::vector<cudaStream_t> stalled; /* by its hung call, released by the abort */
};

namespace {
const int TAG_BASE = 1 << 20; /* above the tags smp's own MPI communicator uses */
const char ID_MAGIC[8] = "smp-emu";
int next_seq;                 /* this process's communicators rooted here */
int calls;                    /* calls so far, for SMP_EMU_NCCL_FAIL_AT */
int group_depth;
struct P2p {
    ncclComm *c;
    bool send;
    void *buf;
    size_t bytes;
    int peer;
    cudaStream_t st;
};
std::vector<P2p> group;
thread_local std::string last_error;

int wrank()
{
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}
int wsize()
{
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}
ncclResult_t fail(ncclResult_t r, const std::string &msg)
{
    last_error = "nccl_emu: " + msg;
    return r;
}
size_t esize(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}
/* a communicator's data tag (even); its bootstrap messages (init, split) use tag + 1 */
int tag_for(int root_world, int seq) { return TAG_BASE + 2 * (seq * wsize() + root_world); }

float half_to_f(uint16_t h, ncclDataType_t t)
{
    if (t == ncclBfloat16) return __uint_as_float((uint32_t)h << 16);
    __half_raw r;
    r.x = h;
    return __half2float(__half(r));
}
uint16_t f_to_half(float f, ncclDataType_t t)
{
    if (t == ncclBfloat16) {
        __nv_bfloat16 b = __float2bfloat16_rn(f);
        uint16_t h;
        memcpy(&h, &b, 2);
        return h;
    }
    __half_raw r = __half(f);
    return r.x;
}
template <typename T> void red(T *acc, const T *x, size_t n, ncclRedOp_t op)
{
    for (size_t i = 0; i < n; i++) acc[i] = op == ncclMax ? (x[i] > acc[i] ? x[i] : acc[i]) : (T)(acc[i] + x[i]);
}
/* out[n] = the reduction of parts[0..k) in rank order */
void reduce(void *out, const std::vector<char> &parts, int k, size_t n, ncclDataType_t t, ncclRedOp_t op)
{
    const size_t bytes = n * esize(t);
    if (t == ncclFloat16 || t == ncclBfloat16) {
        std::vector<float> acc(n), x(n);
        const uint16_t *p = (const uint16_t *)parts.data();
        for (size_t i = 0; i < n; i++) acc[i] = half_to_f(p[i], t);
        for (int r = 1; r < k; r++) {
            for (size_t i = 0; i < n; i++) x[i] = half_to_f(p[r * n + i], t);
            red(acc.data(), x.data(), n, op);
        }
        for (size_t i = 0; i < n; i++) ((uint16_t *)out)[i] = f_to_half(acc[i], t);
        return;
    }
    std::vector<char> acc(parts.begin(), parts.begin() + (long)bytes);
    for (int r = 1; r < k; r++) {
        const char *x = parts.data() + r * bytes;
        switch (t) {
        case ncclFloat32: red((float *)acc.data(), (const float *)x, n, op); break;
        case ncclFloat64: red((double *)acc.data(), (const double *)x, n, op); break;
        case ncclInt32: red((int32_t *)acc.data(), (const int32_t *)x, n, op); break;
        case ncclUint32: red((uint32_t *)acc.data(), (const uint32_t *)x, n, op); break;
        case ncclInt64: red((int64_t *)acc.data(), (const int64_t *)x, n, op); break;
        case ncclUint64: red((uint64_t *)acc.data(), (const uint64_t *)x, n, op); break;
        case ncclInt8: red((int8_t *)acc.data(), (const int8_t *)x, n, op); break;
        default: red((uint8_t *)acc.data(), (const uint8_t *)x, n, op); break;
        }
    }
    memcpy(out, acc.data(), bytes);
}

/* A call in flight: its messages posted, its completion queued on its stream. The
 * sends go from copies (snapshots, compared with the buffers at completion), the
 * receives into buffers of its own, moved to their destinations at completion. */
struct Flight {
    std::vector<MPI_Request> q;
    std::vector<std::vector<char>> bufs;     /* snapshots and receive buffers */
    std::vector<std::pair<const void *, size_t>> sent; /* where each snapshot came from */
    std::vector<size_t> snap;                /* bufs index of each snapshot */
    /* a snapshot of [b, b + bytes), sent to peer */
    void send(const ncclComm *c, const void *b, size_t bytes, int peer)
    {
        bufs.emplace_back((const char *)b, (const char *)b + bytes);
        sent.emplace_back(b, bytes);
        snap.push_back(bufs.size() - 1);
        q.emplace_back();
        MPI_Isend(bufs.back().data(), (int)bytes, MPI_BYTE, c->world[peer], c->tag, MPI_COMM_WORLD, &q.back());
    }
    /* a buffer of its own receiving from peer: its index in bufs */
    size_t recv(const ncclComm *c, size_t bytes, int peer)
    {
        bufs.emplace_back(bytes);
        q.emplace_back();
        MPI_Irecv(bufs.back().data(), (int)bytes, MPI_BYTE, c->world[peer], c->tag, MPI_COMM_WORLD, &q.back());
        return bufs.size() - 1;
    }
    /* check: compare the snapshots (not for an aborted communicator's calls, whose
     * buffers the emulator's kernels, run at once, may have written behind a stall) */
    void wait(bool check)
    {
        if (!q.empty() && MPI_Waitall((int)q.size(), q.data(), MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            fprintf(stderr, "nccl_emu: MPI_Waitall failed\n");
            abort();
        }
        for (size_t i = 0; check && i < sent.size(); i++)
            if (memcmp(sent[i].first, bufs[snap[i]].data(), sent[i].second)) {
                fprintf(stderr, "nccl_emu: a buffer was written while an NCCL call was still sending it "
                                "(before the wait that covers the transfer)\n");
                abort();
            }
    }
};

/* a call: its messages posted by post() at once, then done() on its stream's turn
 * (or, for the call SMP_EMU_NCCL_FAIL_AT names, its failure) */
ncclResult_t enqueue(ncclComm *c, cudaStream_t st, const std::function<void(Flight &)> &post,
                     std::function<void(Flight &)> done)
{
    const char *at = getenv("SMP_EMU_NCCL_FAIL_AT");
    if (at && ++calls == atoi(at)) {
        const char *kind = getenv("SMP_EMU_NCCL_FAIL");
        if (kind && !strcmp(kind, "hang")) {
            emu_stream_stall(st);
            c->stalled.push_back(st);
            return ncclSuccess;
        }
        emu_stream_defer(st, [c]() {
            c->async = ncclSystemError;
            c->error = "nccl_emu: emulated asynchronous failure (SMP_EMU_NCCL_FAIL_AT)";
        });
        return ncclSuccess;
    }
    auto f = std::make_shared<Flight>();
    post(*f);
    emu_stream_defer(st, [c, f, done]() {
        f->wait(!c->aborted);
        if (!c->aborted) done(*f);
    });
    return ncclSuccess;
}

ncclResult_t check(const ncclComm *c, const void *b, size_t bytes, const char *what)
{
    if (!c) return fail(ncclInvalidArgument, std::string(what) + ": no communicator");
    if (c->async != ncclSuccess || c->aborted) return fail(ncclInvalidUsage, std::string(what) + ": the communicator failed before");
    if (bytes > (size_t)INT32_MAX) return fail(ncclInvalidUsage, std::string(what) + ": more than 2^31-1 bytes");
    if (bytes && !emu_device_range(b, bytes))
        return fail(ncclInvalidArgument, std::string(what) + ": a buffer that is not device memory (cudaMalloc)");
    return ncclSuccess;
}
} // namespace

extern "C" {

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    default: return "emulated NCCL error";
    }
}

const char *ncclGetLastError(ncclComm_t c)
{
    if (c && !c->error.empty()) return c->error.c_str();
    return last_error.empty() ? nullptr : last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    int mpi = 0;
    MPI_Initialized(&mpi);
    if (!mpi) return fail(ncclSystemError, "MPI is not initialized (the emulator's NCCL runs over MPI)");
    memset(id, 0, sizeof *id);
    const int v[2] = {wrank(), next_seq++};
    memcpy(id->internal, ID_MAGIC, sizeof ID_MAGIC);
    memcpy(id->internal + sizeof ID_MAGIC, v, sizeof v);
    return ncclSuccess;
}

/* the table of world ranks: the others tell rank 0 theirs, rank 0 sends it back */
ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank)
{
    *out = nullptr;
    int v[2];
    if (memcmp(id.internal, ID_MAGIC, sizeof ID_MAGIC)) return fail(ncclInvalidArgument, "not an id of ncclGetUniqueId");
    memcpy(v, id.internal + sizeof ID_MAGIC, sizeof v);
    if (nranks < 1 || rank < 0 || rank >= nranks || nranks > wsize()) return fail(ncclInvalidArgument, "bad rank or size");
    if ((rank == 0) != (v[0] == wrank())) return fail(ncclInvalidArgument, "rank 0 is not the process that made the id");
    ncclComm *c = new ncclComm{rank, nranks, tag_for(v[0], v[1]), std::vector<int>(nranks, -1), ncclSuccess, "", false, {}};
    if (rank == 0) {
        c->world[0] = wrank();
        for (int i = 1; i < nranks; i++) {
            int m[2];
            MPI_Recv(m, 2, MPI_INT, MPI_ANY_SOURCE, c->tag + 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (m[0] < 1 || m[0] >= nranks || c->world[m[0]] != -1) {
                delete c;
                return fail(ncclInvalidUsage, "two processes gave the same rank");
            }
            c->world[m[0]] = m[1];
        }
        for (int i = 1; i < nranks; i++) MPI_Send(c->world.data(), nranks, MPI_INT, c->world[i], c->tag + 1, MPI_COMM_WORLD);
    } else {
        const int m[2] = {rank, wrank()};
        MPI_Send(m, 2, MPI_INT, v[0], c->tag + 1, MPI_COMM_WORLD);
        MPI_Recv(c->world.data(), nranks, MPI_INT, v[0], c->tag + 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    *out = c;
    return ncclSuccess;
}

/* blocking, as NCCL's: every rank's (color, key, next_seq) to all; each group's
 * first member by (key, rank) is its root and names its tag */
ncclResult_t ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, ncclConfig_t *)
{
    *out = nullptr;
    if (!c) return fail(ncclInvalidArgument, "split: no communicator");
    const int mine[3] = {color, key, next_seq};
    std::vector<int> all(3 * (size_t)c->size);
    std::vector<MPI_Request> q;
    for (int p = 0; p < c->size; p++)
        if (p != c->rank) {
            q.emplace_back();
            MPI_Isend(mine, 3, MPI_INT, c->world[p], c->tag + 1, MPI_COMM_WORLD, &q.back());
            q.emplace_back();
            MPI_Irecv(&all[3 * (size_t)p], 3, MPI_INT, c->world[p], c->tag + 1, MPI_COMM_WORLD, &q.back());
        }
    MPI_Waitall((int)q.size(), q.data(), MPI_STATUSES_IGNORE);
    memcpy(&all[3 * (size_t)c->rank], mine, sizeof mine);
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
    std::vector<int> members; /* old ranks of my group, by (key, rank) */
    for (int p = 0; p < c->size; p++)
        if (all[3 * (size_t)p] == color) members.push_back(p);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[3 * (size_t)a + 1] < all[3 * (size_t)b + 1]; });
    const int root = members[0];
    if (root == c->rank) next_seq++;
    ncclComm *n = new ncclComm{0, (int)members.size(), tag_for(c->world[root], all[3 * (size_t)root + 2]),
                               std::vector<int>(members.size()), ncclSuccess, "", false, {}};
    for (size_t i = 0; i < members.size(); i++) {
        n->world[i] = c->world[members[i]];
        if (members[i] == c->rank) n->rank = (int)i;
    }
    *out = n;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t c)
{
    cudaDeviceSynchronize(); /* its work still pending completes first */
    delete c;
    return ncclSuccess;
}
/* kept (leaked): work queued on streams may still name it */
ncclResult_t ncclCommAbort(ncclComm_t c)
{
    c->aborted = true;
    for (cudaStream_t st : c->stalled) emu_stream_release(st);
    return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e)
{
    *e = c ? c->async : ncclInvalidArgument;
    return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t c, int *n)
{
    *n = c->size;
    return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t c, int *r)
{
    *r = c->rank;
    return ncclSuccess;
}

/* parts[r] of the call: rank r's block, mine copied, the others received */
static void gather_parts(const ncclComm *c, Flight &f, const char *send, size_t bytes, size_t stride,
                         std::vector<size_t> &idx)
{
    idx.assign(c->size, 0);
    for (int p = 0; p < c->size; p++)
        if (p != c->rank) f.send(c, send + stride * p, bytes, p), idx[p] = f.recv(c, bytes, p);
    f.bufs.emplace_back(send + stride * c->rank, send + stride * c->rank + bytes);
    idx[c->rank] = f.bufs.size() - 1;
}

static void reduce_parts(const ncclComm *c, Flight &f, const std::vector<size_t> &idx, void *recv, size_t n,
                         ncclDataType_t t, ncclRedOp_t op)
{
    const size_t bytes = n * esize(t);
    std::vector<char> parts(bytes * c->size);
    for (int p = 0; p < c->size; p++) memcpy(&parts[bytes * p], f.bufs[idx[p]].data(), bytes);
    reduce(recv, parts, c->size, n, t, op);
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                           cudaStream_t st)
{
    const size_t bytes = n * esize(t);
    ncclResult_t r = check(c, send, bytes, "all-reduce");
    if (r == ncclSuccess) r = check(c, recv, bytes, "all-reduce");
    if (r != ncclSuccess || group_depth) return group_depth ? fail(ncclInvalidUsage, "collective in a group") : r;
    auto idx = std::make_shared<std::vector<size_t>>();
    return enqueue(
        c, st, [&](Flight &f) { gather_parts(c, f, (const char *)send, bytes, 0, *idx); },
        [=](Flight &f) { reduce_parts(c, f, *idx, recv, n, t, op); });
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t n, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t c, cudaStream_t st)
{
    const size_t bytes = n * esize(t);
    ncclResult_t r = check(c, send, c ? bytes * c->size : 0, "reduce-scatter");
    if (r == ncclSuccess) r = check(c, recv, bytes, "reduce-scatter");
    if (r != ncclSuccess || group_depth) return group_depth ? fail(ncclInvalidUsage, "collective in a group") : r;
    auto idx = std::make_shared<std::vector<size_t>>();
    return enqueue(
        c, st, [&](Flight &f) { gather_parts(c, f, (const char *)send, bytes, bytes, *idx); },
        [=](Flight &f) { reduce_parts(c, f, *idx, recv, n, t, op); });
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st)
{
    const size_t bytes = n * esize(t);
    ncclResult_t r = check(c, send, bytes, "all-gather");
    if (r == ncclSuccess) r = check(c, recv, c ? bytes * c->size : 0, "all-gather");
    if (r != ncclSuccess || group_depth) return group_depth ? fail(ncclInvalidUsage, "collective in a group") : r;
    auto idx = std::make_shared<std::vector<size_t>>();
    return enqueue(
        c, st, [&](Flight &f) { gather_parts(c, f, (const char *)send, bytes, 0, *idx); },
        [=](Flight &f) {
            for (int p = 0; p < c->size; p++) memcpy((char *)recv + bytes * p, f.bufs[(*idx)[p]].data(), bytes);
        });
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                           cudaStream_t st)
{
    const size_t bytes = n * esize(t);
    ncclResult_t r = check(c, recv, bytes, "broadcast");
    if (r == ncclSuccess && c->rank == root) r = check(c, send, bytes, "broadcast");
    if (r == ncclSuccess && (root < 0 || root >= c->size)) r = fail(ncclInvalidArgument, "broadcast: bad root");
    if (r != ncclSuccess || group_depth) return group_depth ? fail(ncclInvalidUsage, "collective in a group") : r;
    auto got = std::make_shared<size_t>(0);
    return enqueue(
        c, st,
        [&](Flight &f) {
            if (c->rank != root) {
                *got = f.recv(c, bytes, root);
                return;
            }
            for (int p = 0; p < c->size; p++)
                if (p != root) f.send(c, send, bytes, p);
            f.bufs.emplace_back((const char *)send, (const char *)send + bytes);
            *got = f.bufs.size() - 1;
        },
        [=](Flight &f) { memcpy(recv, f.bufs[*got].data(), bytes); });
}

ncclResult_t ncclGroupStart()
{
    group_depth++;
    return ncclSuccess;
}

static ncclResult_t p2p(ncclComm_t c, bool send, void *buf, size_t n, ncclDataType_t t, int peer, cudaStream_t st)
{
    const size_t bytes = n * esize(t);
    ncclResult_t r = check(c, buf, bytes, send ? "send" : "receive");
    if (r == ncclSuccess && (peer < 0 || peer >= c->size || peer == c->rank))
        r = fail(ncclInvalidArgument, "point-to-point: bad peer");
    if (r != ncclSuccess) return r;
    group.push_back(P2p{c, send, buf, bytes, peer, st});
    if (group_depth) return ncclSuccess;
    group_depth = 1; /* a call outside a group is a group of one */
    return ncclGroupEnd();
}

ncclResult_t ncclSend(const void *buf, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st)
{
    return p2p(c, true, (void *)buf, n, t, peer, st);
}
ncclResult_t ncclRecv(void *buf, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st)
{
    return p2p(c, false, buf, n, t, peer, st);
}

/* the group's transfers, posted together at its end */
ncclResult_t ncclGroupEnd()
{
    if (group_depth < 1) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth || group.empty()) return ncclSuccess;
    std::vector<P2p> ops;
    ops.swap(group);
    for (const P2p &o : ops)
        if (o.st != ops[0].st) return fail(ncclInvalidUsage, "a group's calls on several streams (not emulated)");
    auto idx = std::make_shared<std::vector<size_t>>(ops.size());
    return enqueue(
        ops[0].c, ops[0].st,
        [&](Flight &f) {
            for (size_t i = 0; i < ops.size(); i++) {
                if (ops[i].send) f.send(ops[i].c, ops[i].buf, ops[i].bytes, ops[i].peer);
                else (*idx)[i] = f.recv(ops[i].c, ops[i].bytes, ops[i].peer);
            }
        },
        [ops, idx](Flight &f) {
            for (size_t i = 0; i < ops.size(); i++)
                if (!ops[i].send) memcpy(ops[i].buf, f.bufs[(*idx)[i]].data(), ops[i].bytes);
        });
}

} /* extern "C" */
