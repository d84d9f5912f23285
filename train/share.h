/* train/share.c: one copy of read-only weights per host and piece (smp-eval).
 *
 * Under mpirun, ranks of one host that hold the same piece of a tensor (dp and cp
 * replicas hold the same pieces of every tensor; under ep, the ranks of one tp and pp
 * position hold the same pieces of every tensor but the experts) keep one copy of it.
 * For each set of ranks that share pieces (a group), its lowest rank makes one object
 * (a memfd the others open through /proc, else a POSIX shared memory object unlinked
 * as soon as every rank has mapped it) holding those pieces page by page; each rank
 * maps the pages of its shared tensors from there over its own weights array (each
 * tensor starts on a page: model_localize's align), splits the reading of them with
 * the group, and reads the pieces no other rank of its host holds into its own pages.
 * The weights are made read-only once loaded. On the 2-core benchmark VM the fresh
 * memory that a load writes, not the reading, sets the 8-rank load's time
 * (docs/TRAINING.md "Loading"): sharing divides both by the replicas.
 * Training never shares: each rank updates its own weights. */
#ifndef SMP_TRAIN_SHARE_H
#define SMP_TRAIN_SHARE_H

#include "par.h"

/* Collective over p->world, after par_setup (m is this rank's model, on the C
 * backend). When some ranks of this host share pieces: p->twins (the host's ranks),
 * p->shm and p->reader set, m's parameters moved into the mapping
 * (model_adopt_params), and the pages of the shared tensors this rank reads
 * allocated. When the ranks of a host cannot get the shared memory (no memfd, and
 * /dev/shm full or absent), each keeps its own copy, and world rank 0 says so on
 * stderr, once for the run (cmd: the program's name). Fails only when a collective does. */
shard_status share_weights(par_ctx *p, model *m, const char *cmd);
/* 1 when this rank reads tensor i (every tensor it holds, without sharing) */
int share_reads(const par_ctx *p, size_t i);
/* 1 when tensor i lives in a shared object (its pages allocated by share_weights) */
int share_mapped(const par_ctx *p, size_t i);
/* After each rank read its tensors (mine: its status): whether every rank of the host
 * did (shard_comm_agree), then the weights made read-only. Without sharing: mine. */
shard_status share_seal(par_ctx *p, shard_status mine);
/* The mapping and the host's group (par_release calls it; after model_free). */
void share_release(par_ctx *p);

#endif
