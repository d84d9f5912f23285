/* train/share.c: one copy of read-only weights per host and piece (smp-eval).
 *
 * Under mpirun, ranks that hold the same pieces of the weights (dp and cp replicas: only
 * the tp, pp and ep positions cut the weights) and run on one host are twins: they keep
 * one copy of their weights in a shared mapping (a memfd the others open through /proc,
 * else a POSIX shared memory object unlinked as soon as every twin has mapped it),
 * split the reading of the tensors between them, and make the mapping read-only once
 * it is loaded. On the 2-core benchmark VM the fresh memory that a load writes, not the
 * reading, sets the 8-rank load's time (docs/TRAINING.md "Loading"): twins halve both.
 * Training never shares: each rank updates its own weights. */
#ifndef SMP_TRAIN_SHARE_H
#define SMP_TRAIN_SHARE_H

#include "par.h"

/* Collective over p->world, after par_setup (m is this rank's model, on the C
 * backend). When this rank has twins: p->twins, p->shm and p->reader set, and m's
 * parameters moved into the mapping (model_adopt_params) with the pages of the tensors
 * this rank reads allocated. When the twins cannot get the shared memory (no memfd,
 * and /dev/shm full or absent), each keeps its own copy, and world rank 0 says so on
 * stderr, once for the run (cmd: the program's name). Fails only when a collective does. */
shard_status share_weights(par_ctx *p, model *m, const char *cmd);
/* 1 when this rank reads tensor i (every tensor it holds, without twins) */
int share_reads(const par_ctx *p, size_t i);
/* After each twin read its tensors (mine: its status): whether every twin did
 * (shard_comm_agree), then the mapping made read-only. Without twins: mine. */
shard_status share_seal(par_ctx *p, shard_status mine);
/* The mapping and the twins' group (par_release calls it; after model_free). */
void share_release(par_ctx *p);

#endif
