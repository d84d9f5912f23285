/* Pipeline stages: how many consecutive layers each stage holds, given explicitly
 * ("8,8,7,9") or balanced by a cost model ("auto"). */
#include "../core/internal.h"

#include <string.h>

/* The cost model, in one unit (flop or byte, counted alike):
 *   a layer:     2 flops per token per matmul weight (q, k, v, o, gate, up, down)
 *                + 4 bytes per parameter (its matmul weights and its two norms)
 *   embedding:   4 bytes per parameter, on stage 0 (a lookup: no matmul)
 *   head:        2 flops + 4 bytes per lm_head parameter, plus 4 bytes per final
 *                norm parameter, on the last stage (a tied model's last stage holds
 *                a copy of the embedding as its head: the same cost)
 * Bytes are counted at 4 per parameter (fp32 master weights, what training keeps
 * whatever the checkpoint's dtype), so that a model gets the same stages in any
 * dtype. Attention's score and value products grow with the sequence, not the
 * weights, and are the same for every layer: they are left out. */
typedef struct {
    uint64_t layer, embed, head;
} stage_costs;

static shard_status costs_of(const shard_model_desc *d, stage_costs *c)
{
    uint64_t H = (uint64_t)d->hidden, F = (uint64_t)d->intermediate, V = (uint64_t)d->vocab;
    uint64_t QD, KD, a, b, mm = 0, vh, t, nmlp = d->gelu_mlp ? 2 : 3; /* up, down (and gate) */
    bool ok = shard_mul_u64((uint64_t)d->heads, (uint64_t)d->head_dim, &QD) &&
              shard_mul_u64((uint64_t)d->kv_heads, (uint64_t)d->head_dim, &KD) &&
              shard_add_u64(QD, KD, &a) && shard_mul_u64(a, 2 * H, &a) && /* q, o and k, v */
              shard_mul_u64(nmlp * H, F, &b) && shard_add_u64(a, b, &mm) &&
              shard_mul_u64(mm, 6, &t) && shard_add_u64(t, 8 * H, &c->layer) && /* 2 flops + 4 bytes; norms 4 bytes */
              shard_mul_u64(V, H, &vh) && shard_mul_u64(vh, 4, &c->embed) &&
              shard_mul_u64(vh, 6, &t) && shard_add_u64(t, 4 * H, &c->head) &&
              shard_mul_u64(c->layer, (uint64_t)d->layers, &t) && shard_add_u64(t, c->embed, &t) && shard_add_u64(t, c->head, &t);
    if (!ok) return shard_fail(SHARD_E_UNSUPPORTED, "model too large for the stage cost model (hidden %lld, %lld layers); give the stages explicitly",
                               (long long)d->hidden, (long long)d->layers);
    return SHARD_OK;
}

/* The most layers stage s may take under a stage-cost bound T (0 if none). */
static uint64_t cap_of(const stage_costs *c, int pp, int s, uint64_t T)
{
    uint64_t fixed = (s == 0 ? c->embed : 0) + (s == pp - 1 ? c->head : 0);
    return T < fixed ? 0 : (T - fixed) / c->layer;
}

static int feasible(const stage_costs *c, int pp, uint64_t L, uint64_t T)
{
    uint64_t sum = 0;
    for (int s = 0; s < pp; s++) {
        uint64_t k = cap_of(c, pp, s, T);
        if (k < 1) return 0;
        sum += k < L ? k : L; /* capped: no overflow */
    }
    return sum >= L;
}

static shard_status check_pp(const shard_model_desc *d, int pp)
{
    if (d->layers < 1 || d->hidden < 1 || d->intermediate < 1 || d->heads < 1 || d->kv_heads < 1 || d->head_dim < 1 || d->vocab < 1)
        return shard_fail(SHARD_E_USAGE, "stages: the model description has a count below 1 (not from shard_config_load?)");
    if (pp < 1 || pp > SHARD_MAX_PP) return shard_fail(SHARD_E_USAGE, "stages: pp=%d is out of range [1, %d]", pp, SHARD_MAX_PP);
    if (pp > d->layers)
        return shard_fail(SHARD_E_USAGE, "stages: pp=%d exceeds the %lld layers (every stage needs at least one)", pp, (long long)d->layers);
    return SHARD_OK;
}

/* All layers cost the same, so a split is just the layer counts: binary-search the
 * smallest bound T on the largest stage cost that some split meets (exact: costs
 * are integers and feasibility is monotone in T). Among the splits that meet it,
 * take the lexicographically smallest (earlier stages take fewer layers): under
 * 1F1B the early stages hold the most microbatches' activations in flight. */
shard_status shard_stages_auto(const shard_model_desc *d, int pp, int *layers_per_stage)
{
    if (!d || !layers_per_stage) return shard_fail(SHARD_E_USAGE, "shard_stages_auto: NULL argument");
    shard_status st = check_pp(d, pp);
    if (st) return st;
    stage_costs c = {0, 0, 0};
    if ((st = costs_of(d, &c))) return st;
    uint64_t L = (uint64_t)d->layers;
    uint64_t lo = 0, hi = c.layer * L + c.embed + c.head; /* hi: feasible, checked in costs_of */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (feasible(&c, pp, L, mid)) hi = mid;
        else lo = mid + 1;
    }
    /* Fill from the last stage back, leaving one layer for each earlier stage. */
    uint64_t left = L;
    for (int s = pp - 1; s > 0; s--) {
        uint64_t k = cap_of(&c, pp, s, hi), room = left - (uint64_t)s;
        layers_per_stage[s] = (int)(k < room ? k : room);
        left -= (uint64_t)layers_per_stage[s];
    }
    layers_per_stage[0] = (int)left;
    if (left < 1 || left > cap_of(&c, pp, 0, hi))
        return shard_fail(SHARD_E_INTERNAL, "stages: the balanced split of %lld layers over %d stages is inconsistent", (long long)L, pp);
    return SHARD_OK;
}

shard_status shard_stages_parse(const char *spec, const shard_model_desc *d, int pp, int *layers_per_stage)
{
    if (!spec || !d || !layers_per_stage) return shard_fail(SHARD_E_USAGE, "shard_stages_parse: NULL argument");
    if (strcmp(spec, "auto") == 0) return shard_stages_auto(d, pp, layers_per_stage);
    shard_status st = check_pp(d, pp);
    if (st) return st;
    int got[SHARD_MAX_PP]; /* layers_per_stage is written only on success */
    const char *s = spec;
    long long sum = 0;
    int n = 0;
    for (;;) {
        const char *p = s;
        long long x = 0;
        for (; *p >= '0' && *p <= '9'; p++)
            if (x <= d->layers) x = x * 10 + (*p - '0'); /* stop growing past any valid count */
        if (p == s || (*p && *p != ','))
            return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": expected \"auto\" or %d comma-separated layer counts", spec, pp);
        if (x < 1) return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": stage %d has no layers (each needs at least one)", spec, n);
        if (x > d->layers) return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": stage %d has more than the model's %lld layers", spec, n, (long long)d->layers);
        if (n == pp) return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": more than pp=%d stages", spec, pp);
        got[n++] = (int)x;
        sum += x;
        if (!*p) break;
        s = p + 1;
    }
    if (n != pp) return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": %d stages given but pp=%d", spec, n, pp);
    if (sum != d->layers)
        return shard_fail(SHARD_E_USAGE, "stages \"%.200s\": the stages hold %lld layers but the model has %lld", spec, sum, (long long)d->layers);
    memcpy(layers_per_stage, got, (size_t)pp * sizeof *got);
    return SHARD_OK;
}

int shard_stage_of_layer(const int *layers_per_stage, int pp, int layer)
{
    if (!layers_per_stage || layer < 0) return -1;
    long long end = 0;
    for (int s = 0; s < pp; s++) {
        end += layers_per_stage[s];
        if (layer < end) return s;
    }
    return -1;
}
