/* train/par.h: smp-train across processes (MPI through libshard's communicators).
 *
 * One process (no mpirun) runs with the self communicator and layout 1,1,1,1, and
 * the code paths below reduce to the single-rank trainer's, bit for bit.
 *
 * Data parallelism with ZeRO-1 (DESIGN.md "Parallel layout"):
 *   - replica r of D takes its contiguous B/D of each step's sequences;
 *   - the gradients are reduce-scattered over the dp*cp group (dpcp): rank k of it
 *     receives the sum of block k of every tensor, block k being shard_partition_optim's
 *     box (dim 0 split in ceil(rows / (dp*cp)) rows);
 *   - the gradient norm is the global one: the sum of squares of every rank's blocks
 *     that it stores (writes = 1, so a tp-replicated region counts once), all-reduced
 *     over the world;
 *   - each rank clips and updates its block (fp32 master weights = the parameters, Adam
 *     m and v only for the block), then the updated blocks are all-gathered over dpcp.
 * Checkpoints: every rank writes its own shard file (params pieces where
 * shard_partition says writes = 1, optimizer pieces where shard_partition_optim says
 * writes = 1); rank 0 begins (staging folder, broadcast), commits after everyone
 * reported, and replaces `latest`. Loading reads every rank's boxes through the
 * planner, from a checkpoint of any layout.
 *
 * Failure: any error on a rank calls MPI_Abort (every rank ends, non-zero); a
 * checkpoint is committed only after every rank reported its shard file whole. */
#ifndef SMP_TRAIN_PAR_H
#define SMP_TRAIN_PAR_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "optim.h"
#include "shard.h"

typedef struct {
    int mpi;                 /* 1: launched by mpirun (MPI_Init was called) */
    int rank, size;          /* in the world */
    shard_layout l;
    int stages[SHARD_MAX_PP];
    shard_comm *world;
    shard_groups g;
    int ndp;                 /* dp * cp: the ZeRO-1 group's size */
    /* per tensor of the model (m->ntensors) */
    shard_piece *pp;         /* shard_partition: the parameter piece held */
    shard_piece *op;         /* shard_partition_optim: the optimizer block held */
    size_t *rowsz;           /* elements per dim-0 row of the local piece */
    size_t *rows;            /* dim-0 rows of the local piece */
    size_t *blkrows;         /* ceil(rows / ndp) */
    size_t *zoff, *zn;       /* this rank's block: element offset in the local tensor, count */
    size_t *zbase;           /* offset of tensor i's block in a packed block of zpad elements */
    size_t zpad;             /* sum over tensors of blkrows * rowsz */
    size_t zsum;             /* sum of zn: the optimizer state's length on this rank */
    float *send, *recv;      /* packing buffers: ndp * zpad and zpad (or the other way) */
} par_ctx;

/* 1 when the environment says mpirun started this process. */
int par_launched_by_mpirun(void);
/* World communicator (MPI when mpi, else self). */
shard_status par_init_world(par_ctx *p, int mpi);
/* Groups of layout l (whose size must be the world's) and the per-tensor tables of
 * model m (created with the global description). */
shard_status par_setup(par_ctx *p, const shard_layout *l, const int *stages, const model *m);
void par_free(par_ctx *p);

/* Read group ("params" or "optim/master") into m->params: every tensor's piece
 * (*present 0 when the group holds none of the tensors). */
shard_status par_read_params(par_ctx *p, shard_ckpt *c, const model *m, const char *group, int *present);
/* Read this rank's optimizer blocks of group ("optim/exp_avg", "optim/exp_avg_sq")
 * into dst[zsum] (packed in tensor order). */
shard_status par_read_optim(par_ctx *p, shard_ckpt *c, const model *m, const char *group, float *dst, int *present);

/* After the backward passes: reduce-scatter the gradients over dpcp (every rank
 * then holds the summed gradient of its blocks in m->grads), return the global
 * gradient norm's square (over the world). */
shard_status par_reduce_grads(par_ctx *p, model *m, double *sumsq);
/* Clip this rank's blocks by the global norm, AdamW them, all-gather the blocks. */
shard_status par_update(par_ctx *p, model *m, optim *o, double norm, float lr);
/* Sum (op SUM) or max of a double over the world. */
shard_status par_allreduce_f64(par_ctx *p, shard_comm *c, double *v, int n, shard_op op);
int par_any(par_ctx *p, int mine); /* max over the world of an int flag */

#endif
