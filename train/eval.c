/* train/eval.c: evaluation over sequential batches (eval.h). */
#include "eval.h"

#include "par.h"

shard_status eval_loss_sum(model *m, data_set *ds, int rows, int64_t nbatches, int32_t *inputs, int32_t *targets,
                           double *sum, uint64_t *tokens)
{
    *sum = 0.0;
    *tokens = 0;
    for (int64_t i = 0; i < nbatches; i++) {
        shard_status s = data_fill_sequential(ds, (uint64_t)i * (uint64_t)rows, rows, inputs, targets);
        if (s) return s;
        *tokens += par_take_batch(m, rows, inputs, targets);
        *sum += model_forward(m, inputs, targets);
    }
    return SHARD_OK;
}
