/* train/par.h: smp-train across processes (MPI through libshard's communicators):
 * pipeline, tensor, context and data parallelism.
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
 * reported, and replaces `latest`. Loading, from a checkpoint of any layout: each
 * rank reads the chunks its boxes touch through the planner, or, when the ranks span
 * several hosts (or --read-together yes), the ranks read together (coread.c: each
 * chunk read once by one rank, an all-to-all hands every rank its boxes). smp-eval's
 * ranks of one host that hold the same pieces share one read-only copy (share.h).
 *
 * Tensor parallelism (Megatron, DESIGN.md "Parallel layout"): each rank holds only its
 * shard_partition pieces (model_localize). q/k/v/gate/up are column-parallel (whole
 * local heads; with kv heads fewer than tp a rank's query heads all read its single
 * kv head), o/down row-parallel with an all-reduce of their outputs over tp; in
 * backward the input gradients of the column-parallel linears (and of the head) are
 * all-reduced over tp before the norm's backward, so every norm's weight gradient
 * is already whole and equal on the tp ranks (no further reduction). The k/v weight
 * gradients of a replicated kv head are summed over the tp/kv ranks sharing it (kvc).
 * Embedding and head are vocab-parallel (blocks of ceil(V/tp) rows, the last one
 * shorter, padding never stored): the embedding's output is all-reduced, the
 * cross-entropy reduces the row max (max) and the sum of exponentials with the
 * target's logit (one sum) over tp, never the logits. The ZeRO-1 blocks cut each
 * rank's LOCAL piece.
 * Sequence parallelism (--sequence-parallel, m->sp; model.h): between the tp regions
 * each tp rank holds N/tp of a microbatch's N tokens; the all-reduces above become a
 * reduce-scatter (row-parallel outputs, the embedding's output, the input gradients
 * of the column-parallel linears and the head) and an all-gather (the norms' outputs,
 * the residual gradient before o/down and the embedding's backward); pipeline stages
 * send only their N/tp rows; par_reduce_grads all-reduces the norm weight gradients
 * (then partial per rank) over tp, once per step, packed.
 * Pipeline parallelism: the stage's layers (and the embedding on the first, the
 * final norm and head on the last), the 1F1B schedule of par_train_step over the
 * microbatches with activations and their gradients sent over g.pp; the loss is
 * computed on the last stage and broadcast; a tied embedding's first-stage table
 * and last-stage copy get the sum of both gradients (emb) and so stay equal.
 *
 * Context parallelism: every rank of a cp group takes the same sequences (the dp split
 * of the batch is unchanged); each sequence of S tokens is cut into 2C chunks of
 * S/(2C), cp rank i keeping chunks i and 2C-1-i (par_take_batch; their positions feed
 * RoPE and the causal / sliding-window mask). Attention is a ring over g.cp (K/V of
 * the kv heads after RoPE passed C-1 times, partial results merged by log-sum-exp;
 * in backward the visiting blocks' dK/dV travel with them and go home at the end);
 * every other op is token-local. The weight gradients are summed over dp*cp by the
 * ZeRO-1 reduce-scatter (the loss scale counts all B*S tokens of the step), and the
 * step's loss sum is all-reduced over dp*cp (dpcp).
 * Failure: any error on a rank calls MPI_Abort (every rank ends, non-zero); a
 * checkpoint is committed only after every rank reported its shard file whole. */
#ifndef SMP_TRAIN_PAR_H
#define SMP_TRAIN_PAR_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "optim.h"
#include "shard.h"

enum { PAR_HOST = 64 }; /* bytes of a hostname compared between ranks (the rest cut) */

typedef struct {
    int mpi;                 /* 1: launched by mpirun (MPI_Init was called) */
    int rank, size;          /* in the world */
    shard_layout l;
    int stages[SHARD_MAX_PP];
    shard_comm *world;       /* MPI (or self): host values (losses, norms, flags) */
    int read_together;       /* loading: 1 coread.c, 0 each rank alone, -1 (the default)
                              * together when the ranks span more than one host */
    uint64_t moved;          /* loading: bytes this rank sent the others (reading together) */
    int share_weights;       /* loading read-only weights (smp-eval): one copy per host and piece (share.h) */
    shard_comm *host;        /* the ranks of this machine (par_host; NULL until asked) */
    shard_comm *twins;       /* host, when some of its ranks share pieces (NULL: none do) */
    void *shm;               /* this rank's weights, shared pieces mapped in, shm_bytes long */
    size_t shm_bytes;
    int *reader;             /* per tensor: the host rank that reads it (-1: not shared, this rank) */
    shard_groups g;          /* its layout groups */
    /* the groups that move tensors in the backend's memory: g itself on the C
     * backend, NCCL communicators over the same ranks on CUDA (dev comm_for) */
    shard_comm *dworld;
    shard_groups dg;
    int dg_owned;            /* 1: dworld and dg are NCCL communicators of their own */
    dev *dev;
    int ndp;                 /* dp * cp: the ZeRO-1 group's size */
    int kv_rep;              /* tp ranks sharing one kv head (1 when kv heads >= tp) */
    shard_comm *kvc;         /* those ranks (a split of dg.tp; NULL when kv_rep is 1) */
    int stage, nstages;      /* pipeline: this rank's stage (its rank in g.pp) of pp */
    int nslots;              /* activation slots: min(microbatches, pp - stage) */
    shard_comm *emb;         /* tied embeddings with pp > 1: the first and last stage */
    /* per tensor of the model (m->ntensors) */
    shard_piece *pp;         /* shard_partition: the parameter piece held */
    shard_piece *op;         /* shard_partition_optim: the optimizer block held */
    size_t *rowsz;           /* elements per dim-0 row of the local piece */
    size_t *rows;            /* dim-0 rows of the local piece */
    size_t *blkrows;         /* ceil(rows / ndp) */
    size_t *zoff, *zn;       /* this rank's block: element offset in the local tensor, count */
    size_t *zbase;           /* offset of tensor i's block in its group's packed block of zpad[group] elements */
    /* ZeRO-1's groups: 0 the dp*cp ranks of the position (every tensor but the experts
     * under expert parallelism), 1 those that replicate one ep rank's experts (dp*cp/ep:
     * their gradients are summed and their state split over these only) */
    int *zgrp;               /* per tensor: its group */
    int zparts[2];           /* the groups' sizes */
    size_t zpad[2];          /* sum over the group's tensors of blkrows * rowsz */
    shard_comm *erep;        /* group 1 (backend memory); NULL without ep */
    shard_comm *ep_h, *ep_d; /* the ep ranks that exchange tokens (host values, backend memory); NULL without ep */
    size_t zsum;             /* sum of zn: the optimizer state's length on this rank */
    void *send, *recv;       /* backend packing buffers: ndp * zpad and zpad fp32 (or the other way) */
    float *normbuf;          /* backend: the norm gradients packed (sequence parallelism) */
} par_ctx;

/* World communicator (MPI when mpi, else self). */
shard_status par_init_world(par_ctx *p, int mpi);
/* The ranks of this host (by hostname and boot id, in world rank order), made at the
 * first call (collective over the world then) and kept in p->host until par_free. */
shard_status par_host(par_ctx *p, shard_comm **out);
/* Groups of layout l (whose size must be the world's), the per-tensor tables of
 * model m (created with the global description on its backend), and m made this
 * rank's model (model_localize: its shard_partition pieces only; m->tp the tp
 * group of dg). */
shard_status par_setup(par_ctx *p, const shard_layout *l, const int *stages, int micro, model *m);
/* What par_setup made in the backend (buffers, the NCCL groups): before the
 * backend closes. par_free calls it too. */
void par_release(par_ctx *p);
void par_free(par_ctx *p);

/* Read group ("params" or "optim/master") into model_params_host(m): every
 * tensor's piece (*present 0 when the group holds none of the tensors); the caller
 * then sends them to the backend (model_params_upload). */
shard_status par_read_params(par_ctx *p, shard_ckpt *c, model *m, const char *group, int *present);
/* Read this rank's optimizer blocks of group ("optim/exp_avg", "optim/exp_avg_sq",
 * "optim/master") into host dst[zsum] (packed in tensor order). */
shard_status par_read_optim(par_ctx *p, shard_ckpt *c, const model *m, const char *group, float *dst, int *present);
/* Every rank's pieces of group (blocks: the optimizer blocks) read together, into
 * dst: the model's host parameters (optim 0) or the packed blocks (optim 1), as the
 * two above. Collective over the world; a failure on one rank fails all of them
 * (the others' message says so: shard_err_secondhand). */
shard_status par_coread(par_ctx *p, shard_ckpt *c, const model *m, const char *group, int blocks, float *dst);

/* After the backward passes: sum the k/v weight gradients over the tp ranks that
 * share a kv head (kv heads fewer than tp), reduce-scatter the gradients over dpcp (every rank
 * then holds the summed gradient of its blocks in m->grads), return the global
 * gradient norm's square (over the world). */
shard_status par_reduce_grads(par_ctx *p, model *m, double *sumsq);
/* Clip this rank's blocks by the global norm, AdamW them, all-gather the blocks. */
shard_status par_update(par_ctx *p, model *m, optim *o, double norm, float lr);
/* Pack this rank's optimizer blocks of the host parameters (model_params_host) into
 * dst[zsum]: the fp32 master of a bf16 run that starts from parameters alone. */
void par_pack_blocks(const par_ctx *p, const model *m, const float *params, float *dst);
/* The data of microbatch mb of the step: inputs and targets [B*T]. */
typedef shard_status (*par_fill_fn)(void *ctx, int mb, int32_t *in, int32_t *tg);
/* The forward and backward passes of one optimizer step over M microbatches
 * (gradients accumulate in m->grads, zeroed by the caller). pp = 1: each microbatch
 * forward then backward. pp > 1: the 1F1B schedule (warmup of pp - stage - 1
 * forwards, then one forward and one backward in turn, then the remaining
 * backwards), activations sent to the next stage and their gradients back over
 * g.pp. *lsum: the sum of the step's per-token losses on the last stage, 0 on the
 * others. Needs model_alloc_slots(m, ..., p->nslots). */
shard_status par_train_step(par_ctx *p, model *m, int M, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg,
                            float loss_scale, double *lsum);
/* One forward pass of a batch through the pipeline (validation): the loss sum on
 * the last stage, 0 on the others. */
shard_status par_forward(par_ctx *p, model *m, const int32_t *in, const int32_t *tg, double *lsum);
/* A microbatch read (in/tg [rows * S], S = m->T * cp_size) made this rank's: its
 * documents (model_documents, from the whole sequences), then with context
 * parallelism this rank's m->T tokens of each sequence (positions m->pos), packed in
 * place to [rows * m->T]. Returns the targets this rank counts (tg >= 0). */
uint64_t par_take_batch(model *m, int rows, int32_t *in, int32_t *tg);
/* Sum (op SUM) or max of a double over the world. */
shard_status par_allreduce_f64(par_ctx *p, shard_comm *c, double *v, int n, shard_op op);
/* The load-balancing loss's statistics (model_aux_*) summed over the ranks that hold
 * distinct (layer, token) rows: every stage, cp and dp rank, once per tp group. */
shard_status par_aux_reduce(par_ctx *p, model *m);
int par_any(par_ctx *p, int mine); /* max over the world of an int flag */

#endif
