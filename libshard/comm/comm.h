/* Internal: the communicator object; the table of a backend (shard_comm_ops) is
 * public, in shard.h, for backends outside libshard. */
#ifndef SHARD_COMM_INTERNAL_H
#define SHARD_COMM_INTERNAL_H
#include "shard.h"

/* a started transfer (shard_comm_sendrecv_start): one per communicator, so it
 * lives in it; backend: the table's wait ends it (else it moved at start) */
struct shard_comm_req {
    shard_comm *c;
    int busy, backend;
};

struct shard_comm {
    const shard_comm_ops *ops;
    int rank, size;
    uint64_t bytes;
    void *impl;
    shard_comm_req req;
};

/* A thread that runs one call at a time while its owner goes on (worker.c; the MPI
 * backend's started transfers). start: the thread, waiting; post: fn(arg) handed
 * to it (none in flight); wait: until it returns, its status and message raised on
 * the caller's thread (SHARD_OK when none was posted); free: joins it (NULL is fine). */
typedef struct comm_worker comm_worker;
shard_status comm_worker_start(comm_worker **out);
void comm_worker_post(comm_worker *w, shard_status (*fn)(void *arg), void *arg);
shard_status comm_worker_wait(comm_worker *w);
void comm_worker_free(comm_worker *w);

#endif
