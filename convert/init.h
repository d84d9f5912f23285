/* Initialization of a new model (smp-convert init). */
#ifndef SMP_CONVERT_INIT_H
#define SMP_CONVERT_INIT_H
#include "shard.h"

typedef struct {
    const shard_tensor_spec *spec;
    uint64_t seed, tensor_id; /* tensor_id: a hash of the tensor's name */
    double std;
    int constant;             /* 1: every element is value (norms 1, biases 0), else N(0, std) */
    float value;
    int64_t zero_row;         /* the padding token's embedding row, or -1 */
} init_tensor;

/* A standard normal sample that depends only on (seed, tensor, element index). */
double init_normal(uint64_t seed, uint64_t tensor, uint64_t i);
/* shard_fill_fn for an init_tensor. */
shard_status init_fill(void *ctx, const shard_box *sub, void *dst, shard_dtype dt);
#endif
