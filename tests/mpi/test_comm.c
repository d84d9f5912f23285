/* The communicator under mpirun: every collective against its definition, the
 * groups of a layout against the rank formula, byte counts against the ring
 * formulas. Usage: mpirun -np N test_comm [LAYOUT]   (LAYOUT's size must be N)
 * Prints one line per failed check and "comm: P passed, F failed" on rank 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* all-to-all: rank `from` sends cnt elements to `to` (zeros included; with 3 ranks
 * or more the last sends nothing), valued v (exact in bf16) */
static size_t cnt(int from, int to, int n) { return n > 2 && from == n - 1 ? 0 : (size_t)((3 * from + to + 1) % 4); }
static double v(int from, int to, size_t i) { return from * 16 + to * 4 + (double)i; }

static void put(void *b, size_t i, shard_dtype dt, double x)
{
    if (dt == SHARD_DT_F32) ((float *)b)[i] = (float)x;
    else if (dt == SHARD_DT_I32) ((int32_t *)b)[i] = (int32_t)x;
    else ((uint16_t *)b)[i] = shard_f32_to_bf16((float)x);
}
static double get(const void *b, size_t i, shard_dtype dt)
{
    if (dt == SHARD_DT_F32) return ((const float *)b)[i];
    if (dt == SHARD_DT_I32) return ((const int32_t *)b)[i];
    return shard_bf16_to_f32(((const uint16_t *)b)[i]);
}

/* blocks one element apart (the gaps must stay -1), received in reverse rank order */
static void alltoallv(shard_comm *c, const char *what, shard_dtype dt)
{
    const int r = shard_comm_rank(c), n = shard_comm_size(c);
    enum { N = 64, B = N * 5 };
    size_t sc[N], sd[N], rc[N], rd[N], so = 0, ro = 0;
    float send[B], recv[B]; /* room for any of the three dtypes */
    uint64_t bytes = 0;
    for (int q = 0; q < n; q++) {
        sc[q] = cnt(r, q, n), sd[q] = so, so += sc[q] + 1;
        bytes += q == r ? 0 : sc[q] * shard_dtype_size(dt);
        for (size_t i = 0; i < sc[q]; i++) put(send, sd[q] + i, dt, v(r, q, i));
    }
    for (int q = n - 1; q >= 0; q--) rc[q] = cnt(q, r, n), rd[q] = ro, ro += rc[q] + 1;
    for (size_t i = 0; i < ro; i++) put(recv, i, dt, -1);
    shard_comm_reset_bytes(c);
    OK(shard_comm_alltoallv(c, so == (size_t)n ? NULL : send, sc, sd, recv, rc, rd, dt)); /* nothing to send: NULL is fine */
    CHECK(shard_comm_bytes(c) == bytes, "%s alltoallv %s bytes %llu, expected %llu", what, shard_dtype_name(dt),
          (unsigned long long)shard_comm_bytes(c), (unsigned long long)bytes);
    for (int q = 0; q < n; q++) {
        for (size_t i = 0; i < rc[q]; i++)
            CHECK(get(recv, rd[q] + i, dt) == v(q, r, i), "%s alltoallv %s from %d [%zu] = %g", what, shard_dtype_name(dt), q, i,
                  get(recv, rd[q] + i, dt));
        CHECK(get(recv, rd[q] + rc[q], dt) == -1, "%s alltoallv %s: the gap after rank %d's block was written", what,
              shard_dtype_name(dt), q);
    }
    CHECK(shard_comm_alltoallv(c, send, NULL, sd, recv, rc, rd, dt) == SHARD_E_USAGE, "%s alltoallv NULL scounts", what);
    CHECK(shard_comm_alltoallv(c, send, sc, sd, recv, rc, NULL, dt) == SHARD_E_USAGE, "%s alltoallv NULL rdispls", what);
    rc[r]++; /* the own block's two sizes differ */
    CHECK(shard_comm_alltoallv(c, send, sc, sd, recv, rc, rd, dt) == SHARD_E_USAGE, "%s alltoallv own block", what);
}

static void collectives(shard_comm *c, const char *what)
{
    const int r = shard_comm_rank(c), n = shard_comm_size(c);
    enum { K = 37 };
    float a[K], out[K * 16];
    for (int i = 0; i < K; i++) a[i] = (float)(r + 1) * (float)(i + 1);
    shard_comm_reset_bytes(c);
    OK(shard_comm_allreduce(c, a, K, SHARD_DT_F32, SHARD_OP_SUM));
    for (int i = 0; i < K; i++) CHECK(a[i] == (float)(n * (n + 1) / 2) * (float)(i + 1), "%s allreduce sum [%d] = %g", what, i, a[i]);
    uint64_t expect = n > 1 ? 2 * (uint64_t)(n - 1) * K * 4 / (uint64_t)n : 0;
    CHECK(shard_comm_bytes(c) == expect, "%s allreduce bytes %llu, expected %llu", what, (unsigned long long)shard_comm_bytes(c), (unsigned long long)expect);
    double d = r == n - 1 ? 7.5 : (double)r;
    OK(shard_comm_allreduce(c, &d, 1, SHARD_DT_F64, SHARD_OP_MAX));
    CHECK(d == (n - 1 > 7.5 ? n - 1 : 7.5), "%s allreduce max %g", what, d);
    /* reduce-scatter: block b of rank r is r*100 + b: the sum over ranks of block me */
    float send[K * 16];
    for (int b = 0; b < n; b++) for (int i = 0; i < K; i++) send[b * K + i] = (float)(r * 100 + b) + (float)i;
    OK(shard_comm_reduce_scatter(c, send, out, K, SHARD_DT_F32, SHARD_OP_SUM));
    for (int i = 0; i < K; i++) CHECK(out[i] == (float)(100 * n * (n - 1) / 2 + n * r + n * i), "%s reduce_scatter [%d] = %g", what, i, out[i]);
    /* all-gather */
    for (int i = 0; i < K; i++) a[i] = (float)(r * 1000 + i);
    OK(shard_comm_allgather(c, a, out, K, SHARD_DT_F32));
    for (int b = 0; b < n; b++) for (int i = 0; i < K; i++) CHECK(out[b * K + i] == (float)(b * 1000 + i), "%s allgather", what);
    /* broadcast from the last rank */
    int64_t v[3] = {r, r * 2, -r};
    OK(shard_comm_broadcast(c, v, 3, SHARD_DT_I64, n - 1));
    CHECK(v[0] == n - 1 && v[1] == 2 * (n - 1) && v[2] == -(n - 1), "%s broadcast", what);
    if (n > 1) {
        /* a ring pass: send to r+1, receive from r-1 */
        float x = (float)r, y = -1;
        OK(shard_comm_sendrecv(c, &x, (r + 1) % n, &y, (r + n - 1) % n, 1, SHARD_DT_F32, 7));
        CHECK(y == (float)((r + n - 1) % n), "%s sendrecv", what);
        /* point to point: 0 -> n-1 */
        float p = 3.25f;
        if (r == 0) OK(shard_comm_send(c, &p, 1, SHARD_DT_F32, n - 1, 9));
        if (r == n - 1) { p = 0; OK(shard_comm_recv(c, &p, 1, SHARD_DT_F32, 0, 9)); CHECK(p == 3.25f, "%s send/recv", what); }
    }
    alltoallv(c, what, SHARD_DT_F32);
    alltoallv(c, what, SHARD_DT_I32);
    alltoallv(c, what, SHARD_DT_BF16);
    OK(shard_comm_barrier(c));
    CHECK(shard_comm_allreduce(c, a, 1, SHARD_DT_U8, SHARD_OP_SUM) == SHARD_E_USAGE, "%s u8 reduction must be refused", what);
}

int main(int argc, char **argv)
{
    shard_comm *world = check_start(&argc, &argv), *self;
    if (!world) return 1;
    collectives(world, "world");
    OK(shard_comm_self(&self));
    collectives(self, "self");
    shard_comm_free(self);
    if (argc > 1) {
        shard_layout l;
        OK(shard_layout_parse(argv[1], &l));
        shard_groups g;
        OK(shard_groups_create(world, &l, &g));
        shard_coords c = shard_layout_coords(&l, me);
        CHECK(shard_comm_size(g.tp) == l.tp && shard_comm_rank(g.tp) == c.tp, "tp group");
        CHECK(shard_comm_size(g.cp) == l.cp && shard_comm_rank(g.cp) == c.cp, "cp group");
        CHECK(shard_comm_size(g.dp) == l.dp && shard_comm_rank(g.dp) == c.dp, "dp group");
        CHECK(shard_comm_size(g.pp) == l.pp && shard_comm_rank(g.pp) == c.pp, "pp group");
        CHECK(shard_comm_size(g.dpcp) == l.dp * l.cp && shard_comm_rank(g.dpcp) == c.dp * l.cp + c.cp, "dpcp group");
        /* members of my tp group: the world ranks that differ from me only in tp */
        int64_t w = me, members[64];
        OK(shard_comm_allgather(g.tp, &w, members, 1, SHARD_DT_I64));
        for (int t = 0; t < l.tp; t++) {
            shard_coords o = c;
            o.tp = t;
            CHECK(members[t] == shard_layout_rank(&l, o), "tp member %d", t);
        }
        OK(shard_comm_allgather(g.pp, &w, members, 1, SHARD_DT_I64));
        for (int p = 0; p < l.pp; p++) {
            shard_coords o = c;
            o.pp = p;
            CHECK(members[p] == shard_layout_rank(&l, o), "pp member %d", p);
        }
        collectives(g.tp, "tp");
        collectives(g.cp, "cp");
        collectives(g.dpcp, "dpcp");
        shard_groups_free(&g);
    }
    return check_finish(world, "comm");
}
