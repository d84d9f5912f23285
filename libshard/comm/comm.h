/* Internal: what a communicator backend implements (libshard/comm/<backend>.c). */
#ifndef SHARD_COMM_INTERNAL_H
#define SHARD_COMM_INTERNAL_H
#include "shard.h"

typedef struct {
    const char *name;
    shard_status (*split)(shard_comm *c, int color, int key, shard_comm **out);
    shard_status (*allreduce)(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op);
    shard_status (*reduce_scatter)(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op);
    shard_status (*allgather)(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt);
    shard_status (*broadcast)(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root);
    shard_status (*send)(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag);
    shard_status (*recv)(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag);
    shard_status (*sendrecv)(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag);
    shard_status (*barrier)(shard_comm *c);
    void (*free)(shard_comm *c);
} shard_comm_ops;

struct shard_comm {
    const shard_comm_ops *ops;
    int rank, size;
    uint64_t bytes;
    void *impl;
};

#endif
