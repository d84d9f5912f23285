/* train/model.h: the model of one rank (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX: the
 * description's features, never the family's name, choose the ops), assembled from
 * the ops of a backend (dev.h: the C ops of kernels/ops.h, or the CUDA ones).
 *
 * Parameters are held per tensor, in shard_model_tensor order (the embedding, then each
 * layer's tensors as the family's table lists them, an expert's role once per expert,
 * then the final norm and the head), all in one array in the backend's compute dtype (so
 * the optimizer and the gradient norm see one flat vector), with an fp32 gradient
 * array of the same shape. Every buffer lives in the backend's memory.
 * With tied embeddings there is no head tensor: the head reads the embedding, and
 * both uses accumulate into the embedding's gradient (backward ops accumulate).
 *
 * model_create makes the single-rank model: every local size equals the global one
 * and the vocabulary-parallel pieces run with vocab_start = 0, vocab_local = V;
 * model_localize and model_set_stage make it one tensor-/pipeline-parallel rank's,
 * and m->tp adds the tp all-reduces between the ops (par.h). The fields
 * that a tensor-, pipeline- or context-parallel split changes (local heads, local
 * vocabulary, layers held, positions) are kept apart from the global description
 * so that the split is a matter of filling them differently and adding the
 * communication between the ops.
 *
 * Compute is in dev->dt (fp32, or bf16 on CUDA). Activations are kept for backward
 * or recomputed (recompute_mode). A forward/backward runs on one microbatch of B sequences of T
 * tokens; the caller zeroes the gradients at the start of an optimizer step and the
 * backward passes accumulate into them.
 */
#ifndef SMP_TRAIN_MODEL_H
#define SMP_TRAIN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "dev.h"
#include "ops.h"
#include "shard.h"

typedef struct fp8_state fp8_state; /* the FP8 recipe of the blocks' linear layers (fp8.h) */

/* a layer's weights (the compute dtype) and their gradients (fp32): one field per
 * layer tensor role, the same names in both */
typedef struct {
    void *q, *k, *v, *o, *gate, *up, *down, *norm_attn, *norm_mlp;
    void *q_bias, *k_bias, *v_bias; /* Qwen2; NULL in the other families */
    void *q_norm, *k_norm;          /* Qwen3 [head_dim]; NULL in the others */
    /* GPT-NeoX (NULL in the others): the fused qkv projection (q, k, v NULL; gate NULL),
     * the biases of the linears and the LayerNorms' */
    void *qkv, *qkv_bias, *o_bias, *up_bias, *down_bias, *norm_attn_bias, *norm_mlp_bias;
    /* a mixture of experts (gate, up, down NULL): the router [E, H] and each expert's */
    void *router;
    void **egate, **eup, **edown; /* [E] */
} layer_params;
typedef struct {
    float *q, *k, *v, *o, *gate, *up, *down, *norm_attn, *norm_mlp;
    float *q_bias, *k_bias, *v_bias;
    float *q_norm, *k_norm;
    float *qkv, *qkv_bias, *o_bias, *up_bias, *down_bias, *norm_attn_bias, *norm_mlp_bias;
    float *router;
    float **egate, **eup, **edown;
} layer_grads;

/* Activation recomputation: what backward recomputes instead of keeping.
 *   none:      every layer keeps all of the tensors below;
 *   attention: a layer keeps x and the MLP's tensors; backward recomputes the
 *              attention half (norm, q/k/v, RoPE, attention: xn1, q, k, v, att, lse,
 *              rstd1) from x, into one shared set;
 *   full:      a layer keeps only x; backward recomputes the whole layer. */
typedef enum { RECOMPUTE_NONE = 0, RECOMPUTE_ATTENTION, RECOMPUTE_FULL } recompute_mode;

typedef struct {
    /* per layer, [N = B*T rows]; void *: the compute dtype, float *: fp32 */
    void *x;         /* [N,H] residual stream entering the layer */
    float *rstd1;    /* [N] */
    void *xn1;       /* [N,H] input_layernorm output */
    void *q;         /* [N,nh*hd] after RoPE */
    void *k, *v;     /* [N,nkv*hd] (k after RoPE) */
    void *att;       /* [N,nh*hd] attention output */
    float *lse;      /* [B,nh,T] */
    void *xmid;      /* [N,H] residual after attention */
    float *rstd2;    /* [N] */
    void *xn2;       /* [N,H] */
    void *gate, *up; /* [N,F] (no gate in a GELU MLP); experts: [N*k, FE] the routed rows */
    void *act;       /* [N,F] silu(gate) * up, or gelu(up); experts: [N*k, FE] */
    float *mean1, *mean2;    /* [N] LayerNorm's means (GPT-NeoX; empty otherwise) */
    /* a mixture of experts (empty otherwise): the router's softmax, each token's k
     * experts and weights; the N*k (token, choice) rows grouped by expert (rows: the
     * token of each, slot: the row of each choice), xn2's rows in that order and the
     * experts' outputs */
    float *probs;            /* [N,E] */
    float *wts;              /* [N,k] */
    int32_t *idx, *rows, *slot; /* [N*k] */
    void *xs, *ys;           /* [N*k, H]; with expert parallelism xs (and gate, up, act) hold the rows this
                                rank's experts received, by expert: up to ep*N*k */
    int32_t *erows, *einv;   /* expert parallelism: the received rows by expert (their place as received),
                                and its inverse [ep*N*k] */
    /* the per-head q/k norm (Qwen3; empty otherwise): q and k before it, and its rstd */
    void *q_pre, *k_pre;     /* [N,nh*hd], [N,nkv*hd] */
    float *rstd_q, *rstd_k;  /* [N*nh], [N*nkv] */
} layer_acts;

/* The activations of one microbatch in flight (a pipeline stage keeps up to
 * pp - stage of them; one otherwise). model_use_slot points the model's fields
 * (acts, xL, ...) at one of them. */
typedef struct {
    layer_acts *acts;        /* [L]; only the held layers' are allocated */
    void *xL, *xnf, *logits;
    float *rstdf, *meanf, *rowmax, *sumexp, *losses;
} act_slot;

typedef struct model_s {
    shard_model_desc d;
    /* sizes of this rank's part (= global on one rank) */
    int V, H, F, L, nh, nkv, hd, rd, window; /* rd: the rotary dims of a head */
    int E, topk, FE;         /* experts, per token, an expert's intermediate size (this rank's part) */
    int vocab_start, vocab_local;
    /* pipeline stage: layers [l0, l1); first: the embedding runs here; last: the
     * final norm, head and loss (one rank: 0, L, 1, 1) */
    int l0, l1, first, last;
    float eps;
    /* parameters, in shard_model_tensor order */
    size_t ntensors;
    shard_tensor_spec *spec;
    size_t *offset;          /* element offset of tensor i in params/grads */
    size_t *numel;
    size_t nparams;
    /* the backend (dev.h) that holds every tensor below and runs the ops */
    dev *dev;
    /* a lane (lanes.h, model_lane): the model whose parameters (and spec, offset,
     * numel, inv_freq) this one reads; its gradients and activations are its own */
    const struct model_s *shares;
    void *params;            /* [nparams] in dev->dt: the compute copy */
    int params_lent;         /* params are the caller's (model_adopt_params): not freed here */
    float *grads;            /* [nparams] fp32 */
    float *hparams;          /* host fp32 copy for checkpoints (model_params_host) */
    void *embed, *norm_final, *head;       /* head == embed when tied */
    float *dembed, *dnorm_final, *dhead;
    void *norm_final_bias;                 /* LayerNorm's (GPT-NeoX), else NULL */
    float *dnorm_final_bias;
    layer_params *lw;        /* weights, per layer */
    layer_grads *lg;         /* their gradients */
    float *inv_freq;         /* [rd/2], host */
    float *inv_freq_d;       /* the same in the backend */
    float rope_scale;        /* the tables' factor: YaRN's attention factor, else 1 */
    recompute_mode recompute; /* set before model_alloc_acts */
    size_t act_bytes;        /* backend bytes of the activations and scratch */
    layer_acts rc;           /* recompute: the shared set of the recomputed tensors */
    layer_acts wk;           /* recompute: the layer in hand (its kept tensors + rc) */
    /* activations for a microbatch of B x T (allocated by model_alloc_acts), the
     * fields below pointing at slot `slot` of nslots */
    int B, T, nslots, slot;
    act_slot *slots;
    layer_acts *acts;
    void *xL, *xnf;          /* final residual, final norm */
    float *rstdf, *meanf;
    void *logits;            /* [head_rows,Vl] one chunk's logits, in training then their gradient */
    int logits_chunk;        /* tokens whose logits are computed at a time (0: auto, < 0: all); before model_alloc_acts */
    int head_rows;           /* what it came to for this microbatch size */
    float *rowmax, *losses;  /* [N] */
    float *sumexp;           /* [2N] by head_loss's chunks: the chunk's sums of exps, then its target logits */
    int32_t *pos;            /* [T] positions of this rank's tokens in the sequence (host) */
    int32_t *pos_d;          /* the same in the backend */
    int32_t *tok_d, *tgt_d;  /* [N] the microbatch's tokens and targets in the backend */
    /* RoPE: the position of each of the N tokens (the sequence's, or with documents
     * the document's) and the tables of those positions */
    int32_t *rpos, *rpos_d;  /* [N] host, backend */
    float *cos_t, *sin_t;    /* [N,hd] */
    /* packed documents (model_set_documents before model_alloc_acts; docs.c): a token
     * attends only to its document's tokens, and its RoPE position restarts at the
     * document's first token. model_documents sets them from each microbatch's
     * sequences. */
    int docs;
    int32_t sep;             /* the token that ends a document (and belongs to it) */
    int32_t *doc, *doc_d;    /* [C*N] the document id (its first token's position in the sequence)
                                of every cp rank's tokens, rank i's at i*N; host, backend */
    int32_t *seq_scratch;    /* [2*S] one whole sequence's positions and ids */
    uint8_t *ring_need;      /* [C] 1: some query of this rank may see a key of cp rank i's block
                                (the ring skips the others' attention) */
    /* backward scratch */
    void *dx, *dxn, *dq, *dk, *dv, *datt, *dgate, *dup, *dact;
    void *dqk_pre;           /* [N*(nh+nkv)*hd] the gradients of q and k before the q/k norm (Qwen3) */
    void *qkv;               /* [N*3*nh*hd] the fused projection's output, in backward its gradient (GPT-NeoX) */
    void *dres;              /* [local rows, H] the gradient of a layer's output, kept for the attention
                                branch of a parallel residual (GPT-NeoX) */
    /* a mixture of experts */
    void **ew;               /* [L * 3 * E] the experts' weights' views (lw[l].egate ...) */
    float **eg;              /* the same for the gradients */
    void *rlogits;           /* [N,E] the router's logits; in backward their gradient */
    float *dwts;             /* [N*k] */
    void *dxs;               /* [N*k, H] the gradient of the experts' outputs, then of their inputs */
    int32_t *eoff;           /* host [nslots][L][E+1]: each layer's first row of each expert */
    int32_t *hcur;           /* host [E]: expert parallelism's counts sent */
    /* expert parallelism (model_set_ep): the ep ranks exchanging tokens, this one's
     * experts [ep_rank * E/ep, +E/ep) */
    int ep_size, ep_rank;
    shard_comm *ep_h, *ep_d; /* host values, backend memory */
    int32_t *epc;            /* host [nslots][L][ep * E/ep]: the rows received from each rank for each of ours */
    int32_t *hem, *hinv;     /* host [ep*N*k] scratch of erows, einv */
    int32_t *hloff;          /* host [E+1] scratch: this rank's experts' first received rows */
    void *epa, *epb;         /* [ep*N*k, H] exchange scratch */
    /* the load-balancing loss (model_aux_*): over the forwards since the last reset,
     * each expert's top-k count and router probability sum and the routed rows
     * (layers x tokens) [2E + 1], host */
    double *aux;
    int aux_collect;         /* model_forward's own passes, not backward's recomputation */
    float *hprobs;           /* host [N*E] (CUDA) */
    float *dprobs;           /* [N*E] the loss's gradient on the router's probabilities, NULL when off */
    /* FP8 (NULL when off): model_fp8_linears(m) linear layers, every rank the same */
    fp8_state *fp8;
    /* tensor parallelism: the tp group (NULL or tp_size 1 on one rank). A failed
     * collective inside forward or backward is recorded in comm_err (the pass goes
     * on with wrong numbers; the caller checks comm_err and ends the run). */
    int tp_size;
    shard_comm *tp;
    shard_status comm_err;
    /* sequence parallelism (Megatron; set before model_alloc_acts, effective with
     * tp_size > 1): between the tensor-parallel regions (embedding output, residual
     * stream, norms) this rank holds only its N / tp_size of the microbatch's N = B*T
     * tokens, rows [r N/tp, (r+1) N/tp) for tp rank r, at the start of x, xmid,
     * rstd1/2, xL, rstdf and dx; the row-parallel outputs (o, down, the embedding) are
     * reduce-scattered over the tokens instead of all-reduced, the norms' outputs
     * all-gathered before the column-parallel linears (xn1, xn2, xnf hold all N
     * rows); backward swaps the two. The norm weight gradients are then partial
     * (this rank's tokens) and par_reduce_grads sums them over tp. */
    int sp;
    void *sp_loc;            /* [N/tp, H]: a local slice between the collectives */
    /* context parallelism: the cp group (NULL or cp_size 1 on one rank). Each
     * sequence of S = T * cp_size tokens is cut into 2 * cp_size chunks of T / 2; this
     * rank (cp_rank i) holds chunks i and 2 cp_size - 1 - i, in that order, as its T
     * tokens (pos). Attention is a ring over cp (model.c): K/V blocks travel around
     * the group, the partial results merge by log-sum-exp; in backward the visiting
     * block's dK/dV travel with it and return to their owner at the end. */
    int cp_size, cp_rank;
    shard_comm *cp;
    int32_t *cp_pos;         /* [cp_size * T]: the positions of every cp rank's tokens (host) */
    int32_t *cp_pos_d;       /* the same in the backend */
    void *ring[2];           /* [4 * N * nkv * hd] each: K, V, dK, dV of a visiting block */
    void *ring_out;          /* [N * nh * hd]: one block's partial attention */
    float *ring_lse;         /* [B * nh * T] */
} model;

/* Allocate a model for description d on backend dv (parameters uninitialised,
 * gradients zero). dv outlives the model. */
shard_status model_create(model *m, const shard_model_desc *d, dev *dv);
/* A lane of m (lanes.h): a model over m's parameters, with gradients of its own (zero)
 * and no activations yet; before model_alloc_slots of m (m then holds none either).
 * m outlives the lane. */
shard_status model_lane(model *lane, const model *m);
void model_free(model *m);
/* Make m the model of one tensor-parallel rank: tensor i becomes the box
 * pieces[i].box of the global tensor (shard_partition), and the local sizes follow
 * from them (query and kv heads, intermediate size, vocab rows and their start).
 * Parameters are reallocated (uninitialised), before model_alloc_acts. Every
 * tensor that the rank does not hold (another stage's) gets no elements. Each held
 * tensor starts at a multiple of align elements (1: packed; smp-eval's ranks ask for
 * a page, to map shared pieces by whole pages: share.h). */
shard_status model_localize(model *m, const shard_piece *pieces, int tp, size_t align);
/* A pipeline stage (before model_alloc_acts, after model_localize): layers [l0, l1),
 * first and last as in the model's fields. */
void model_set_stage(model *m, int l0, int l1, int first, int last);
/* Context parallelism (before model_alloc_acts): the cp group, its size and this
 * rank's index in it. */
void model_set_cp(model *m, shard_comm *cp, int cp_size, int cp_rank);
/* Expert parallelism (before model_alloc_acts): the ep ranks that exchange tokens
 * (host and backend communicators), their count, this rank's index. */
void model_set_ep(model *m, shard_comm *h, shard_comm *d, int ep, int rank);
/* The linear layers the FP8 recipe scales (train/fp8.h's nlin): the blocks' seven
 * dense ones (q, k, v, o, gate, up, down) per layer, then gate, up and down of each
 * expert of each layer. */
int model_fp8_linears(const model *m);
/* Packed documents ended by token sep (before model_alloc_acts). */
void model_set_documents(model *m, int32_t sep);
/* The documents of a microbatch: in[rows * S] its whole sequences (S = T * cp_size,
 * before each cp rank keeps its tokens): every rank's document ids, this rank's RoPE
 * positions and tables, and the ring blocks to compute. Before each forward and
 * backward of the microbatch. Nothing without documents. */
void model_documents(model *m, int rows, const int32_t *in);
/* The RoPE positions of the sequence (no documents) and the ring's blocks: at
 * allocation (model.c). */
void model_positions(model *m);
/* Activations and scratch for microbatches of B sequences of T tokens (T: this
 * rank's tokens of a sequence, the sequence length / cp_size; with cp_size > 1, T
 * must be even; with sequence parallelism, B*T must be divisible by tp_size). */
shard_status model_alloc_acts(model *m, int B, int T);
/* The same with nslots activation slots (slot 0 in use). */
shard_status model_alloc_slots(model *m, int B, int T, int nslots);
/* Rows of the residual stream that this rank holds: B*T, or B*T / tp_size with
 * sequence parallelism (what a pipeline stage sends and receives). */
size_t model_local_rows(const model *m);
void model_use_slot(model *m, int k);

/* Forward of one microbatch: tokens and targets [B*T] (targets < 0 are ignored).
 * Fills losses[B*T] (per token) and returns their sum (in double, summed in row
 * order, so that the result does not depend on the thread count). */
double model_forward(model *m, const int32_t *tokens, const int32_t *targets);
/* The same for training: on the last stage the loss's end of the backward too (the
 * head's logits become their gradient a chunk at a time, so their memory is one
 * chunk's), leaving the gradient of xL in dx as a stage before the last receives it;
 * loss_scale multiplies d(sum of per-token losses), e.g. 1 / (tokens in the
 * optimizer step). model_backward goes on from there. */
double model_forward_train(model *m, const int32_t *tokens, const int32_t *targets, float loss_scale);
/* Pipeline stages: a stage other than the first takes its input [B*T, H] in
 * model_stage_input(m) (the current slot's) before model_forward; a stage other
 * than the last leaves its output in xL (and returns 0), and takes the gradient of
 * that output in dx before model_backward; after model_backward, dx holds the
 * gradient of the stage's input (to send to the stage before). */
void *model_stage_input(model *m);
/* Host fp32 view of the parameters for checkpoint I/O: the parameters themselves on
 * the C backend; on CUDA a host buffer, filled from the device by
 * model_params_download and sent to it by model_params_upload. NULL on out of memory. */
float *model_params_host(model *m);
/* The parameters moved into buf (nparams elements of the compute dtype, on the C
 * backend, the caller's until after model_free): the model's own are freed and every
 * view rebound. Before model_alloc_acts or any lane. */
shard_status model_adopt_params(model *m, void *buf);
void model_params_download(model *m);
void model_params_upload(model *m);
/* Bytes of the parameters, gradients and activations (all slots and scratch),
 * for the memory line smp-train prints at start */
void model_memory(const model *m, size_t *params, size_t *grads, size_t *acts);
/* Backward of the last model_forward_train: accumulates into grads. */
void model_backward(model *m, const int32_t *tokens);
void model_zero_grads(model *m);
/* The load-balancing loss of a mixture of experts, as transformers' load_balancing_loss_func
 * computes it over all of its rows (every layer's tokens): E * sum_e f_e P_e, f_e the share
 * of the top-k choices that went to expert e and P_e its mean router probability. The
 * statistics of the forwards since model_aux_reset (par_aux_reduce sums them over ranks);
 * 0 for a dense model. */
void model_aux_reset(model *m);
double model_aux_loss(const model *m);
/* From the statistics: backward adds coef * the loss's gradient (through the router's
 * probabilities: coef * E * f_e / rows for expert e, every row alike); coef 0: off. */
shard_status model_aux_set_gradient(model *m, double coef);

#endif
