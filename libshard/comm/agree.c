/* The ranks' inputs and settings against rank 0's (shard.h, "What the processes of one
 * run must hold alike"). */
#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

shard_agree_item shard_agree_float(const char *name, float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return (shard_agree_item){SHARD_AGREE_FLOAT, name, b};
}

static const char *value(char *buf, size_t cap, shard_agree_kind k, uint64_t v)
{
    float f;
    uint32_t b = (uint32_t)v;
    memcpy(&f, &b, sizeof f);
    const char *dt = shard_dtype_name((shard_dtype)v);
    if (k == SHARD_AGREE_FLOAT) snprintf(buf, cap, "%g", (double)f);
    else if (k == SHARD_AGREE_DTYPE) snprintf(buf, cap, "%s", dt ? dt : "(not given)");
    else snprintf(buf, cap, "%lld", (long long)v);
    return buf;
}

static shard_status differ(const shard_agree_item *it, int rank, uint64_t theirs)
{
    char a[32], b[32];
    switch (it->kind) {
    case SHARD_AGREE_CKPT:
        return shard_fail(SHARD_E_INVALID, "%s: rank %d and rank 0 loaded different checkpoints (their smp.json "
                          "differ: another copy on a host, or another `latest`); every rank must load the same one",
                          it->name, rank);
    case SHARD_AGREE_MODEL:
        return shard_fail(SHARD_E_INVALID, "%s: rank %d and rank 0 read different model folders (their config.json "
                          "or weights differ: another copy on a host); every rank must read the same one",
                          it->name, rank);
    case SHARD_AGREE_DATA:
        return shard_fail(SHARD_E_INVALID, "%s: rank %d and rank 0 read different token files (other files, or other "
                          "bytes in a host's copy); every rank must read the same ones", it->name, rank);
    default:
        return shard_fail(SHARD_E_USAGE, "rank %d runs with %s %s, rank 0 with %s: every rank of a run takes the same "
                          "settings", rank, it->name, value(a, sizeof a, it->kind, theirs),
                          value(b, sizeof b, it->kind, it->v));
    }
}

shard_status shard_agree_check(shard_comm *world, const shard_agree_item *items, int n)
{
    const int size = shard_comm_size(world);
    if (size == 1) return SHARD_OK;
    uint64_t *mine = malloc((size_t)n * sizeof *mine), *all = malloc((size_t)n * (size_t)size * sizeof *all);
    shard_status s = mine && all ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    for (int k = 0; !s && k < n; k++) mine[k] = items[k].v;
    /* every rank reaches this gather (a rank that failed before it has ended the run) */
    if (!s) s = shard_comm_allgather(world, mine, all, (size_t)n, SHARD_DT_U64);
    for (int k = 0; !s && k < n; k++)
        for (int r = 1; !s && r < size; r++)
            if (all[(size_t)r * n + k] != all[k]) {
                /* rank 0's item names the path it read; the values are rank r's and 0's */
                shard_agree_item it = items[k];
                it.v = all[k];
                s = differ(&it, r, all[(size_t)r * n + k]);
                /* every rank finds the same difference: rank 0 says it, the others only
                 * if its line does not end the run first (under load their 100 ms head
                 * start was not always enough: both lines were printed) */
                if (shard_comm_rank(world) != 0) shard_set_secondhand();
            }
    free(mine);
    free(all);
    return s;
}
