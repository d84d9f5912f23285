/* smp-convert init: a new model from config.json, initialized as transformers'
 * LlamaPreTrainedModel._init_weights does: every linear and the embedding from
 * N(0, initializer_range), the padding token's embedding row zero, norms one, biases
 * zero (Qwen2PreTrainedModel too).
 *
 * The random numbers are counter-based (a hash of seed, tensor and element index,
 * then Box-Muller), so any piece of any tensor is computed on its own: the same
 * seed gives the same global tensors in every layout and with any thread count. */
#include "init.h"

#include <math.h>
#include <string.h>

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static double uniform(uint64_t seed, uint64_t tensor, uint64_t i, int which)
{
    uint64_t h = mix(mix(mix(seed) ^ tensor) ^ (2 * i + (uint64_t)which));
    return ((double)(h >> 11) + 0.5) * 0x1p-53; /* in (0, 1) */
}

double init_normal(uint64_t seed, uint64_t tensor, uint64_t i)
{
    double u1 = uniform(seed, tensor, i, 0), u2 = uniform(seed, tensor, i, 1);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

shard_status init_fill(void *ctx, const shard_box *sub, void *dst, shard_dtype dt)
{
    const init_tensor *it = ctx;
    const int nd = sub->ndim;
    const uint64_t n = shard_box_numel(sub);
    const int64_t rowlen = sub->len[nd - 1];
    float row[4096];
    int64_t idx[SHARD_MAX_DIMS];
    for (uint64_t r = 0; r < n / (uint64_t)rowlen; r++) {
        uint64_t rem = r;
        for (int k = nd - 2; k >= 0; k--) { idx[k] = sub->off[k] + (int64_t)(rem % (uint64_t)sub->len[k]); rem /= (uint64_t)sub->len[k]; }
        idx[nd - 1] = sub->off[nd - 1];
        uint64_t flat = 0;
        for (int k = 0; k < nd; k++) flat = flat * (uint64_t)it->spec->shape[k] + (uint64_t)idx[k];
        for (int64_t c0 = 0; c0 < rowlen; c0 += 4096) {
            int64_t m = rowlen - c0 < 4096 ? rowlen - c0 : 4096;
            for (int64_t c = 0; c < m; c++) {
                if (it->constant) row[c] = it->value;
                else if (it->zero_row >= 0 && nd == 2 && idx[0] == it->zero_row) row[c] = 0.0f;
                else row[c] = (float)(it->std * init_normal(it->seed, it->tensor_id, flat + (uint64_t)(c0 + c)));
            }
            shard_status s = shard_convert((char *)dst + (size_t)(r * (uint64_t)rowlen + (uint64_t)c0) * shard_dtype_size(dt), dt, row,
                                           SHARD_DT_F32, (size_t)m);
            if (s) return s;
        }
    }
    return SHARD_OK;
}
