/* train/runcfg.h: a run's configuration (run_cfg, state.h): the defaults of a new
 * run, the training state of the checkpoint it continues, the flags over them, the
 * checks between the settings and the layout, and the training state a save writes
 * (smp.json "training", which state_parse reads back).
 *
 * The checks return SHARD_E_USAGE with the message (the command line is at fault);
 * the command prints it as a usage error. */
#ifndef SMP_TRAIN_RUNCFG_H
#define SMP_TRAIN_RUNCFG_H

#include <stdint.h>

#include "data.h"
#include "fp8.h"
#include "model.h"
#include "optim.h"
#include "shard.h"
#include "state.h"

/* A new run's settings for the model d: batch 8 x 256 tokens (at most
 * max_position_embeddings), AdamW 3e-4 cosine, clipping 1.0, FP8 off, ... */
void runcfg_defaults(run_cfg *c, const shard_model_desc *d);
/* The checkpoint's training state over them, when it has one (*resumed = 1). */
shard_status runcfg_resume(run_cfg *c, shard_ckpt *ck, int *resumed);

/* The flags that are not plain numbers of run_cfg (those the command converts into
 * it directly, held to STATE_RANGE). */
typedef struct {
    int has_lr;           /* --lr was given */
    int has_lr_min;       /* --lr-min was given: lr_min */
    float lr_min;
    int schedule;         /* --schedule: -1 not given, 0 constant, 1 cosine */
    int has_seed;         /* --seed was given: seed (the order is then shuffled) */
    uint64_t seed;
    int fp8;              /* --fp8: -1 not given, else an fp8_mode */
    int64_t lanes;        /* --lanes: -1 not given, 0 auto, else the count */
    int64_t logits_chunk; /* --logits-chunk: -1 not given, 0 auto, else the tokens */
} runcfg_flags;
/* The flags over the defaults and the saved state: lr_min follows lr (lr / 10) unless
 * it was given, or saved and lr was not given. */
void runcfg_merge(run_cfg *c, const runcfg_flags *f);

/* The settings against each other and the layout: --steps given (a new run), --fp8
 * current with tp 1, the batch divisible by dp x microbatches, the sequence by 2 x
 * cp, a microbatch's tokens in range. */
shard_status runcfg_check(const run_cfg *c, const shard_layout *l);
/* The optimizer's settings of c. */
optim_hparams runcfg_hparams(const run_cfg *c);
/* cmd's warning (stderr; rank 0 calls it) when seq exceeds max_position_embeddings of d. */
void runcfg_warn_positions(const char *cmd, int64_t seq, const shard_model_desc *d);
/* --sequence-parallel with tp > 1: a microbatch's tokens of one rank divide by tp. */
shard_status runcfg_check_sp(const run_cfg *c, const shard_layout *l, int seqpar);
/* --fp8 on CUDA: the GEMMs' widths of this rank's model m (after par_setup)
 * multiples of 16 (hidden, intermediate or an expert's, q and kv). */
shard_status runcfg_check_fp8_cuda(const run_cfg *c, const model *m);
/* --documents' separator: --doc-sep's id (given, checked against d's vocabulary by
 * the command; -1: not given), else the config's eos_token_id (SHARD_E_USAGE when
 * there is neither). */
shard_status runcfg_doc_sep(const shard_model_desc *d, int64_t given, int32_t *sep);
/* Sequences of a microbatch on one replica: batch / dp / microbatches. */
int runcfg_rows(const run_cfg *c, const shard_layout *l);

/* The records of the token files that the checkpoint's run checked (its
 * training.data.checked; none in states before 2026-12-07), malloc'ed into *out (*n
 * of them; records of another form left out: their files are read). */
shard_status runcfg_seen(const shard_ckpt *ck, data_seen **out, int *n);
/* The training state a save writes (JSON text, malloc'ed; NULL when out of memory):
 * the settings, the counters, the data order (ds), the records of the files checked
 * (ds's, then the validation set vs's) and FP8 (f8: NULL when off). */
char *runcfg_state_json(const run_cfg *c, const data_set *ds, const data_set *vs, const fp8_state *f8, double elapsed);

#endif
