/* bf16 and f16 reductions of the MPI communicator (libshard/comm/mpi.c's user
 * operations) against an fp32 reference: all-reduce and reduce-scatter, sum and
 * max, on MPI_COMM_WORLD and a split of it. Every rank computes every rank's
 * inputs (a hash of rank and index), so the reference needs no communication.
 * Sums of small integers are exact in both formats and must match bit for bit;
 * sums of random values must be within one rounding per step of the fp32 sum;
 * max is exact, and a NaN anywhere gives NaN.
 * Usage: mpirun -np N test_comm_half. Prints "comm_half: P passed, F failed" on rank 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static float to_f(uint16_t h, shard_dtype dt) { return dt == SHARD_DT_BF16 ? shard_bf16_to_f32(h) : shard_f16_to_f32(h); }
static uint16_t from_f(float x, shard_dtype dt) { return dt == SHARD_DT_BF16 ? shard_f32_to_bf16(x) : shard_f32_to_f16(x); }

enum { EXACT, RANDOM, WITH_NAN };

/* element i of rank r's input, as the format holds it */
static float input(int r, size_t i, int kind, shard_dtype dt)
{
    if (kind == EXACT) return (float)((int)((r + 1) * (i % 7)) - 3);
    uint64_t z = (uint64_t)r * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + 12345;
    z = (z ^ (z >> 31)) * 0x94d049bb133111ebull;
    z ^= z >> 29;
    float u = (float)((z >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; /* [-1, 1) */
    float x = u * ldexpf(1.0f, (int)(z % 9) - 4);
    if (kind == WITH_NAN && r == 0 && i == 5) x = NAN;
    return to_f(from_f(x, dt), dt);
}

static void check_block(const char *what, shard_comm *c, const uint16_t *got, size_t n, size_t off, int kind,
                        shard_dtype dt, shard_op op)
{
    const int size = shard_comm_size(c);
    const double ulp = dt == SHARD_DT_BF16 ? 1.0 / 256 : 1.0 / 2048; /* one rounding, relative */
    int bad = 0;
    for (size_t i = 0; i < n && bad < 3; i++) {
        /* the reference: every member's input (inputs depend on the rank in c) */
        double ref = op == SHARD_OP_SUM ? 0.0 : -INFINITY, mag = 0.0;
        int nan = 0;
        for (int r = 0; r < size; r++) {
            float x = input(r, off + i, kind, dt);
            nan |= isnan(x);
            mag += fabs(x);
            ref = op == SHARD_OP_SUM ? ref + x : (x > ref ? x : ref);
        }
        const float g = to_f(got[i], dt);
        int ok;
        if (nan) ok = isnan(g);
        else if (kind == EXACT || op == SHARD_OP_MAX) ok = g == (float)ref;
        else ok = fabs(g - ref) <= size * ulp * mag + 1e-30;
        if (!ok) bad++;
        CHECK(ok, "%s %s %s [%zu] = %g, reference %g", what, shard_dtype_name(dt), op == SHARD_OP_SUM ? "sum" : "max",
              off + i, g, ref);
    }
}

static void reductions(shard_comm *c, const char *what)
{
    const int r = shard_comm_rank(c), size = shard_comm_size(c);
    const size_t K = 1031;
    uint16_t *buf = malloc(K * size * 2), *out = malloc(K * 2);
    const shard_dtype dts[2] = {SHARD_DT_BF16, SHARD_DT_F16};
    for (int t = 0; t < 2; t++)
        for (int kind = EXACT; kind <= WITH_NAN; kind++)
            for (int o = 0; o < 2; o++) {
                const shard_dtype dt = dts[t];
                const shard_op op = o ? SHARD_OP_MAX : SHARD_OP_SUM;
                for (size_t i = 0; i < K; i++) buf[i] = from_f(input(r, i, kind, dt), dt);
                shard_status s = shard_comm_allreduce(c, buf, K, dt, op);
                CHECK(s == SHARD_OK, "%s allreduce %s: %s", what, shard_dtype_name(dt), shard_errmsg());
                char name[64];
                snprintf(name, sizeof name, "%s allreduce", what);
                check_block(name, c, buf, K, 0, kind, dt, op);
                /* reduce-scatter: rank r's block b holds elements b*K.. of its input */
                for (size_t i = 0; i < K * size; i++) buf[i] = from_f(input(r, i, kind, dt), dt);
                s = shard_comm_reduce_scatter(c, buf, out, K, dt, op);
                CHECK(s == SHARD_OK, "%s reduce_scatter %s: %s", what, shard_dtype_name(dt), shard_errmsg());
                snprintf(name, sizeof name, "%s reduce_scatter", what);
                check_block(name, c, out, K, (size_t)r * K, kind, dt, op);
            }
    free(buf);
    free(out);
}

int main(int argc, char **argv)
{
    shard_comm *world = check_start(&argc, &argv), *self, *half = NULL;
    if (!world) return 1;
    reductions(world, "world");
    shard_comm_self(&self);
    reductions(self, "self");
    shard_comm_free(self);
    /* a split in two, as the groups of a layout */
    const int n = shard_comm_size(world);
    if (shard_comm_split(world, me < (n + 1) / 2 ? 0 : 1, me, &half) == SHARD_OK) reductions(half, "split");
    else CHECK(0, "split: %s", shard_errmsg());
    shard_comm_free(half);
    return check_finish(world, "comm_half");
}
