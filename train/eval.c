/* train/eval.c: evaluation over sequential batches (eval.h). */
#include "eval.h"

double eval_loss_sum(model *m, const data_set *ds, int rows, int64_t nbatches, int32_t *inputs, int32_t *targets,
                     uint64_t *tokens)
{
    double sum = 0.0;
    for (int64_t i = 0; i < nbatches; i++) {
        data_fill_sequential(ds, (uint64_t)i * (uint64_t)rows, rows, inputs, targets);
        sum += model_forward(m, inputs, targets);
    }
    *tokens = (uint64_t)nbatches * (uint64_t)rows * (uint64_t)ds->S;
    return sum;
}
