/* Started send-receives (shard_comm_sendrecv_start / shard_comm_wait) under
 * mpirun: ring passes against the rank formula, bytes as sendrecv's, the argument
 * checks, one transfer in flight per communicator; on the world, the one-rank
 * communicator, a layout's cp group, and a backend without the table's pair (the
 * fallback that NCCL's and the CUDA wrapper's tables take). With
 * SMP_TEST_MPI_THREAD=single MPI gets no thread support and the MPI backend moves
 * the data at start. Usage: mpirun -np N test_comm_start [LAYOUT]
 * Prints one line per failed check and "comm_start: P passed, F failed" on rank 0. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

enum { K = 1000 };

static float value(int rank, int i) { return (float)(rank * 10000 + i); }

/* 2n passes of a block through two buffers, each waited for before the next
 * starts: after pass j the block in hand is rank r - j's */
static void ring(shard_comm *c, const char *what)
{
    const int r = shard_comm_rank(c), n = shard_comm_size(c);
    static float buf[2][K];
    for (int i = 0; i < K; i++) buf[0][i] = value(r, i);
    shard_comm_reset_bytes(c);
    int cur = 0;
    for (int j = 1; j <= 2 * n; j++) {
        shard_comm_req *q = NULL;
        OK(shard_comm_sendrecv_start(c, buf[cur], (r + 1) % n, buf[!cur], (r + n - 1) % n, K, SHARD_DT_F32, 5, &q));
        double sum = 0; /* the send buffer may be read meanwhile (the ring computes on it) */
        for (int i = 0; i < K; i++) sum += buf[cur][i];
        OK(shard_comm_wait(q));
        cur = !cur;
        const int src = ((r - j) % n + n) % n;
        int bad = 0;
        for (int i = 0; i < K; i++) bad += buf[cur][i] != value(src, i);
        CHECK(!bad && sum == K * (double)value((src + 1) % n, 0) + K * (K - 1) / 2.0,
              "%s pass %d: %d elements differ from rank %d's", what, j, bad, src);
    }
    const uint64_t expect = n > 1 ? 2 * (uint64_t)n * K * sizeof(float) : 0;
    CHECK(shard_comm_bytes(c) == expect, "%s bytes %llu, expected %llu", what, (unsigned long long)shard_comm_bytes(c),
          (unsigned long long)expect);
}

/* refused calls: no transfer in flight after them, req NULL */
static void refusals(shard_comm *c, const char *what)
{
    const int r = shard_comm_rank(c), n = shard_comm_size(c);
    float x = (float)r, y = -1;
    shard_comm_req *q = (shard_comm_req *)(void *)&x, *q2 = q;
    CHECK(shard_comm_sendrecv_start(c, &x, n, &y, 0, 1, SHARD_DT_F32, 5, &q) == SHARD_E_USAGE && !q, "%s bad peer", what);
    CHECK(shard_comm_sendrecv_start(c, &x, 0, &y, -1, 1, SHARD_DT_F32, 5, &q) == SHARD_E_USAGE && !q, "%s bad source", what);
    CHECK(shard_comm_wait(NULL) == SHARD_OK, "%s wait(NULL)", what);
    OK(shard_comm_sendrecv_start(c, &x, (r + 1) % n, &y, (r + n - 1) % n, 1, SHARD_DT_F32, 6, &q));
    CHECK(shard_comm_sendrecv_start(c, &x, (r + 1) % n, &y, (r + n - 1) % n, 1, SHARD_DT_F32, 6, &q2) == SHARD_E_USAGE && !q2,
          "%s a second transfer in flight", what);
    OK(shard_comm_wait(q));
    CHECK(y == (float)((r + n - 1) % n), "%s received %g", what, y);
    CHECK(shard_comm_wait(q) == SHARD_E_USAGE, "%s a second wait", what);
}

/* the world's rank 0 times its start while the others hold theirs back: a
 * thread's start returns at once, a blocking one waits for its source */
static void start_returns(shard_comm *world, int threaded)
{
    const int r = shard_comm_rank(world), n = shard_comm_size(world);
    if (n < 2) return;
    float x = (float)r, y = -1;
    shard_comm_req *q = NULL;
    OK(shard_comm_barrier(world));
    if (r) usleep(300000);
    const double t = MPI_Wtime();
    OK(shard_comm_sendrecv_start(world, &x, (r + 1) % n, &y, (r + n - 1) % n, 1, SHARD_DT_F32, 8, &q));
    const double took = MPI_Wtime() - t;
    OK(shard_comm_wait(q));
    CHECK(y == (float)((r + n - 1) % n), "timed pass received %g", y);
    if (r == 0) CHECK(threaded ? took < 0.15 : took > 0.25, "the start took %.3f s (%s)", took, threaded ? "thread" : "blocking");
}

/* a table without the pair: sendrecv forwards to the wrapped communicator */
static shard_status fwd_sendrecv(shard_comm *c, const void *s, int to, void *r, int from, size_t n, shard_dtype dt, int tag)
{
    return shard_comm_sendrecv(shard_comm_impl(c), s, to, r, from, n, dt, tag);
}
static const shard_comm_ops FWD = {.name = "forward", .sendrecv = fwd_sendrecv};

static void all(shard_comm *c, const char *what)
{
    ring(c, what);
    refusals(c, what);
}

int main(int argc, char **argv)
{
    shard_comm *world = check_start(&argc, &argv), *self, *fwd;
    if (!world) return 1;
    const char *lvl = getenv("SMP_TEST_MPI_THREAD");
    const int threaded = !(lvl && !strcmp(lvl, "single"));
    all(world, "world");
    start_returns(world, threaded);
    OK(shard_comm_self(&self));
    all(self, "self");
    shard_comm_free(self);
    OK(shard_comm_create(&FWD, shard_comm_rank(world), shard_comm_size(world), world, &fwd));
    all(fwd, "fallback");
    shard_comm_free(fwd);
    if (argc > 1) {
        shard_layout l;
        shard_groups g;
        OK(shard_layout_parse(argv[1], &l));
        OK(shard_groups_create(world, &l, &g));
        all(g.cp, "cp");
        shard_groups_free(&g);
    }
    return check_finish(world, "comm_start");
}
