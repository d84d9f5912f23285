/* Internal: the communicator object; the table of a backend (shard_comm_ops) is
 * public, in shard.h, for backends outside libshard. */
#ifndef SHARD_COMM_INTERNAL_H
#define SHARD_COMM_INTERNAL_H
#include "shard.h"

struct shard_comm {
    const shard_comm_ops *ops;
    int rank, size;
    uint64_t bytes;
    void *impl;
};

#endif
