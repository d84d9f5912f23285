/* train/eval.c: the mean loss of a model over sequential batches of a token set,
 * laid out as llm.c does (batch i holds sequences [i*rows, (i+1)*rows) of the
 * files' order: for one file, B*S+1 consecutive tokens, row r being tokens
 * [r*S, r*S + S] of it). */
#ifndef SMP_TRAIN_EVAL_H
#define SMP_TRAIN_EVAL_H

#include <stdint.h>

#include "data.h"
#include "lanes.h"
#include "model.h"

/* The lanes' activations must hold a batch of ds->S tokens (one rank: no cp), rows =
 * lanes x their rows: each lane takes its part of each batch (lanes.h). *sum: the
 * sum of the per-token losses (double, in order); *tokens: the number of counted
 * targets (every one, unless documents or loss masks leave some out). Fails when the token
 * files changed under the run (data_fill_sequential). */
shard_status eval_loss_sum(lanes *ln, data_set *ds, int64_t nbatches, int32_t *inputs, int32_t *targets,
                           double *sum, uint64_t *tokens);

#endif
