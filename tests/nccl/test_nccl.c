/* The NCCL communicator on GPUs, under mpirun (one GPU per rank) or alone (one rank,
 * a machine without mpirun: tools/bench/e2e-gpu.sh runs it so):
 *   mpirun -np N build/bin/smp-nccl-test
 * and on the CPU emulator's NCCL (tests/gpu/emu/nccl_emu.cpp, tools/emu-check):
 *   mpirun -np N build/emu/bin/smp-nccl-test
 * Each collective on device buffers against its definition, blocking and
 * stream-ordered (as the CUDA backend uses it); prints one line per failed check
 * and "nccl: P passed, F failed" on rank 0. Without a GPU it prints
 * "nccl: SKIP: no CUDA device found" and exits 0. */
#include "shard.h"

#include <cuda_runtime.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int passed, failed, me;
#define CHECK(cond, ...) do { if (cond) passed++; else { failed++; fprintf(stderr, "rank %d: FAIL line %d: ", me, __LINE__); fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)

/* all-to-all: rank f sends cnt elements to t (zeros included; the last of 3 or more
 * sends nothing), valued f*16 + t*4 + i; blocks one element apart (the gaps stay
 * -1), received in reverse rank order; d and d2: device buffers of 5n floats or more */
static size_t cnt(int f, int t, int n) { return n > 2 && f == n - 1 ? 0 : (size_t)((3 * f + t + 1) % 4); }

static void alltoallv(shard_comm *gpu, int n, float *d, float *d2)
{
    size_t *sc = calloc(4 * (size_t)n, sizeof *sc), *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n, so = 0, ro = 0;
    float *hs = malloc(sizeof(float) * 5 * (size_t)n), *hr = malloc(sizeof(float) * 5 * (size_t)n);
    for (int t = 0; t < n; t++) {
        sc[t] = cnt(me, t, n), sd[t] = so, so += sc[t] + 1;
        for (size_t i = 0; i < sc[t]; i++) hs[sd[t] + i] = (float)(me * 16 + t * 4) + (float)i;
    }
    for (int f = n - 1; f >= 0; f--) rc[f] = cnt(f, me, n), rd[f] = ro, ro += rc[f] + 1;
    for (size_t i = 0; i < ro; i++) hr[i] = -1;
    cudaMemcpy(d, hs, sizeof(float) * so, cudaMemcpyHostToDevice);
    cudaMemcpy(d2, hr, sizeof(float) * ro, cudaMemcpyHostToDevice);
    CHECK(shard_comm_alltoallv(gpu, d, sc, sd, d2, rc, rd, SHARD_DT_F32) == SHARD_OK, "alltoallv: %s", shard_errmsg());
    cudaMemcpy(hr, d2, sizeof(float) * ro, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int f = 0; f < n; f++) {
        for (size_t i = 0; i < rc[f]; i++) bad += hr[rd[f] + i] != (float)(f * 16 + me * 4) + (float)i;
        bad += hr[rd[f] + rc[f]] != -1;
    }
    CHECK(!bad, "alltoallv values (%d wrong)", bad);
    CHECK(shard_comm_alltoallv(gpu, d, NULL, sd, d2, rc, rd, SHARD_DT_F32) == SHARD_E_USAGE, "alltoallv NULL scounts");
    free(hs);
    free(hr);
    free(sc);
}

/* a float of device memory, read back after the work queued on st */
static float get(const float *d, cudaStream_t st)
{
    float v = -1;
    cudaMemcpyAsync(&v, d, 4, cudaMemcpyDeviceToHost, st);
    cudaStreamSynchronize(st);
    return v;
}

/* Stream-ordered use (the CUDA backend's): calls return before the data moves, the
 * work after them on st sees the results; a started ring pass runs on the
 * communicator's stream, after what st held before it, and the wait orders st's
 * later work after it. d, d2: device buffers of 4n floats or more. */
static void stream_ordered(shard_comm *world, int n, int dev, float *d, float *d2)
{
    shard_comm *gpu = NULL, *half = NULL;
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (shard_comm_nccl(world, dev, &gpu) || shard_comm_nccl_enqueue_on(gpu, st)) {
        CHECK(0, "stream-ordered communicator: %s", shard_errmsg());
        return;
    }
    const float mine = (float)(me + 1);
    cudaMemcpyAsync(d, &mine, 4, cudaMemcpyHostToDevice, st);
    CHECK(shard_comm_allreduce(gpu, d, 1, SHARD_DT_F32, SHARD_OP_SUM) == SHARD_OK, "enqueued allreduce: %s", shard_errmsg());
    CHECK(get(d, st) == (float)(n * (n + 1) / 2), "enqueued allreduce value %g", get(d, st));
    if (n > 1) {
        /* the value sent is the one st wrote before the start, not after it */
        const float x = (float)(10 * me), late = -5;
        cudaMemcpyAsync(d, &x, 4, cudaMemcpyHostToDevice, st);
        shard_comm_req *q = NULL;
        CHECK(shard_comm_sendrecv_start(gpu, d, (me + 1) % n, d2, (me + n - 1) % n, 1, SHARD_DT_F32, 0, &q) == SHARD_OK,
              "sendrecv_start: %s", shard_errmsg());
        CHECK(shard_comm_wait(q) == SHARD_OK, "wait: %s", shard_errmsg());
        cudaMemcpyAsync(d, &late, 4, cudaMemcpyHostToDevice, st);
        CHECK(get(d2, st) == (float)(10 * ((me + n - 1) % n)), "started ring pass value %g", get(d2, st));
        /* point to point along a pipeline: rank r sends to r + 1 */
        const float y = (float)(100 + me);
        cudaMemcpyAsync(d, &y, 4, cudaMemcpyHostToDevice, st);
        if (me % 2 == 0 && me + 1 < n)
            CHECK(shard_comm_send(gpu, d, 1, SHARD_DT_F32, me + 1, 0) == SHARD_OK, "send: %s", shard_errmsg());
        if (me % 2 == 1) {
            CHECK(shard_comm_recv(gpu, d2, 1, SHARD_DT_F32, me - 1, 0) == SHARD_OK, "recv: %s", shard_errmsg());
            CHECK(get(d2, st) == (float)(100 + me - 1), "recv value %g", get(d2, st));
        }
    }
    /* a split keeps the stream order; broadcast from each half's last rank */
    CHECK(shard_comm_split(gpu, me % 2, -me, &half) == SHARD_OK, "split: %s", shard_errmsg());
    if (half) {
        const float z = (float)me;
        cudaMemcpyAsync(d, &z, 4, cudaMemcpyHostToDevice, st);
        CHECK(shard_comm_broadcast(half, d, 1, SHARD_DT_F32, 0) == SHARD_OK, "broadcast: %s", shard_errmsg());
        const int top = (n - 1) - ((n - 1) % 2 != me % 2); /* the half's highest rank: its rank 0 (key -me) */
        CHECK(get(d, st) == (float)top, "split broadcast value %g (want %d)", get(d, st), top);
        CHECK(shard_comm_nccl_check(half, 0) == SHARD_OK, "check: %s", shard_errmsg());
        /* past the deadline: a failure, and the communicator aborted */
        CHECK(shard_comm_nccl_check(half, 1e9) == SHARD_E_IO, "check past the deadline");
        CHECK(shard_comm_allreduce(half, d, 1, SHARD_DT_F32, SHARD_OP_SUM) == SHARD_E_IO, "a call after the abort");
    }
#ifdef SMP_CUDA_EMU
    /* host memory is refused, as NCCL refuses it (the emulator checks every buffer) */
    float host = 0;
    CHECK(shard_comm_allreduce(gpu, &host, 1, SHARD_DT_F32, SHARD_OP_SUM) == SHARD_E_IO, "host buffer accepted");
#endif
    shard_comm_free(half);
    shard_comm_free(gpu);
    cudaStreamDestroy(st);
}

int main(int argc, char **argv)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("nccl: SKIP: no CUDA device found\n");
        return 0;
    }
    /* without a launcher (a GPU machine without mpirun): one rank, NCCL bootstrapped
     * over the one-process communicator (the emulator's NCCL needs mpirun) */
    const int mpi = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
    if (mpi) MPI_Init(&argc, &argv);
    shard_comm *world, *gpu;
    if (mpi ? shard_comm_mpi_world(&world) : shard_comm_self(&world)) { fprintf(stderr, "%s\n", shard_errmsg()); return 1; }
    me = shard_comm_rank(world);
    const int n = shard_comm_size(world), dev = shard_comm_local_rank() % ndev;
    if (shard_comm_nccl(world, dev, &gpu)) {
        fprintf(stderr, "rank %d: %s\n", me, shard_errmsg());
        if (mpi) MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    enum { K = 1 << 20 };
    float *h = malloc(sizeof(float) * K * (size_t)n), *d, *d2;
    cudaMalloc((void **)&d, sizeof(float) * K * (size_t)n);
    cudaMalloc((void **)&d2, sizeof(float) * K * (size_t)n);
    /* all-reduce */
    for (int i = 0; i < K; i++) h[i] = (float)(me + 1) * (float)(i % 7);
    cudaMemcpy(d, h, sizeof(float) * K, cudaMemcpyHostToDevice);
    CHECK(shard_comm_allreduce(gpu, d, K, SHARD_DT_F32, SHARD_OP_SUM) == SHARD_OK, "allreduce: %s", shard_errmsg());
    cudaMemcpy(h, d, sizeof(float) * K, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int i = 0; i < K; i++) bad += h[i] != (float)(n * (n + 1) / 2) * (float)(i % 7);
    CHECK(!bad, "allreduce values (%d wrong)", bad);
    /* reduce-scatter and all-gather */
    for (int b = 0; b < n; b++) for (int i = 0; i < K; i++) h[(size_t)b * K + i] = (float)(me + b);
    cudaMemcpy(d, h, sizeof(float) * K * (size_t)n, cudaMemcpyHostToDevice);
    CHECK(shard_comm_reduce_scatter(gpu, d, d2, K, SHARD_DT_F32, SHARD_OP_SUM) == SHARD_OK, "reduce_scatter: %s", shard_errmsg());
    cudaMemcpy(h, d2, sizeof(float) * K, cudaMemcpyDeviceToHost);
    bad = 0;
    for (int i = 0; i < K; i++) bad += h[i] != (float)(n * (n - 1) / 2 + n * me);
    CHECK(!bad, "reduce_scatter values (%d wrong)", bad);
    CHECK(shard_comm_allgather(gpu, d2, d, K, SHARD_DT_F32) == SHARD_OK, "allgather: %s", shard_errmsg());
    cudaMemcpy(h, d, sizeof(float) * K * (size_t)n, cudaMemcpyDeviceToHost);
    bad = 0;
    for (int b = 0; b < n; b++) for (int i = 0; i < K; i++) bad += h[(size_t)b * K + i] != (float)(n * (n - 1) / 2 + n * b);
    CHECK(!bad, "allgather values (%d wrong)", bad);
    /* a ring pass, and a bf16 reduction (allowed on GPUs) */
    if (n > 1) {
        float x = (float)me, y = -1;
        cudaMemcpy(d, &x, 4, cudaMemcpyHostToDevice);
        CHECK(shard_comm_sendrecv(gpu, d, (me + 1) % n, d2, (me + n - 1) % n, 1, SHARD_DT_F32, 0) == SHARD_OK, "sendrecv: %s", shard_errmsg());
        cudaMemcpy(&y, d2, 4, cudaMemcpyDeviceToHost);
        CHECK(y == (float)((me + n - 1) % n), "sendrecv value %g", y);
    }
    alltoallv(gpu, n, d, d2);
    uint16_t one = shard_f32_to_bf16(1.0f), got = 0;
    cudaMemcpy(d, &one, 2, cudaMemcpyHostToDevice);
    CHECK(shard_comm_allreduce(gpu, d, 1, SHARD_DT_BF16, SHARD_OP_SUM) == SHARD_OK, "bf16 allreduce: %s", shard_errmsg());
    cudaMemcpy(&got, d, 2, cudaMemcpyDeviceToHost);
    CHECK(shard_bf16_to_f32(got) == (float)n, "bf16 allreduce value %g", shard_bf16_to_f32(got));
    CHECK(shard_comm_barrier(gpu) == SHARD_OK, "barrier: %s", shard_errmsg());
    stream_ordered(world, n, dev, d, d2);
    int tot[2] = {passed, failed}, sum[2] = {passed, failed};
    if (mpi) MPI_Reduce(tot, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (me == 0) printf("nccl: %d passed, %d failed\n", sum[0], sum[1]);
    cudaFree(d);
    cudaFree(d2);
    free(h);
    shard_comm_free(gpu);
    shard_comm_free(world);
    if (mpi) MPI_Finalize();
    return failed ? 1 : 0;
}
