/* train/state.c: a run's settings and state, their ranges, and the training state
 * a checkpoint carries (smp.json "training"), read and checked in one place.
 *
 * The command-line flags and the state read from a checkpoint are held to the same
 * ranges (STATE_RANGE): a checkpoint cannot make a run do what no flag could. */
#ifndef SMP_TRAIN_STATE_H
#define SMP_TRAIN_STATE_H

#include <stdint.h>

#include "fp8.h"
#include "shard.h"

typedef struct {
    /* settings (resolved: flag, else the checkpoint's training state, else default) */
    int64_t steps, batch, micro, seq, warmup, max_bad, fp8_hist, save_every, keep, val_every, val_batches, stop_at;
    float lr, lr_min, clip, wd, beta1, beta2, eps, fp8_margin;
    int cosine, shuffle, lr_min_set;
    /* lanes (lanes.h): 0 until resolved (a new run's auto); saved, kept on resume */
    int64_t lanes;
    int lanes_given; /* --lanes N: refused (not replaced by 1) where lanes cannot run */
    /* tokens whose logits are computed at a time (model.h): 0 auto, -1 the whole
     * microbatch (a state written before the chunks, as it ran); saved, kept on resume */
    int64_t logits_chunk;
    uint64_t seed;
    fp8_mode fp8;
    /* state */
    int64_t step, opt_step, position;
    uint64_t tokens;
    double elapsed_before;
    /* the data order as the training state saved it (flags may change it on resume:
     * the loop then re-expresses the position, docs/TRAINING.md "Checkpoints and resume") */
    struct {
        int64_t seq;
        int shuffle;
        uint64_t seed;
    } saved;
} run_cfg;

typedef enum {
    R_STEPS, R_BATCH, R_MICRO, R_SEQ, R_WARMUP, R_MAX_BAD, R_FP8_HIST, R_SAVE_EVERY, R_KEEP, R_VAL_EVERY, R_VAL_BATCHES,
    R_STOP_AT, R_LANES, R_LOGITS_CHUNK, R_LR, R_LR_MIN, R_CLIP, R_WD, R_BETA1, R_BETA2, R_EPS, R_FP8_MARGIN, R_COUNT
} range_id;
typedef struct {
    double lo, hi;
} state_range;
extern const state_range STATE_RANGE[R_COUNT];

/* The checkpoint's training state (JSON text of len bytes, from ckdir) into c: every
 * key present and of its type, every number finite and in its range, and consistent
 * (optimizer_step <= step, microbatches divide batch, a known schedule and fp8 mode).
 * SHARD_E_INVALID naming ckdir and the key otherwise. */
shard_status state_parse(const char *ckdir, const char *text, size_t len, run_cfg *c);

/* The tensors of a resumed run as read: weights and first moments finite, second
 * moments finite and >= 0 (n: their lengths; any pointer may be NULL), FP8 amax
 * history finite and >= 0, scales finite and > 0. SHARD_E_INVALID naming dir. */
shard_status state_check_weights(const char *dir, const char *group, const float *w, size_t n);
shard_status state_check_moments(const char *dir, const float *m, const float *v, size_t n);
shard_status state_check_fp8(const char *dir, const float *hist, size_t nh, const float *scale, size_t ns);

#endif
