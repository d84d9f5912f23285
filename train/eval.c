/* train/eval.c: evaluation over sequential batches (eval.h). */
#include "eval.h"

#include "par.h"

shard_status eval_loss_sum(lanes *ln, data_set *ds, int64_t nbatches, int32_t *inputs, int32_t *targets,
                           double *sum, uint64_t *tokens)
{
    const int rows = ln->n * ln->rows;
    *sum = 0.0;
    *tokens = 0;
    for (int64_t i = 0; i < nbatches; i++) {
        shard_status s = data_fill_sequential(ds, (uint64_t)i * (uint64_t)rows, rows, inputs, targets);
        if (s) return s;
        *sum += lanes_forward(ln, inputs, targets, tokens);
    }
    return SHARD_OK;
}
