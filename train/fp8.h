/* train/fp8.h: the FP8 recipe of the transformer blocks' linear layers, as
 * TransformerEngine's: forward GEMMs take E4M3 inputs and weights, backward GEMMs
 * take the E5M2 output gradient (with the E4M3 weight for dgrad, the E4M3 input
 * for wgrad); one scale per tensor role of each linear layer:
 *   delayed: scale = fp8_max / max(amax history) / 2^margin, the history taking
 *            one amax per optimizer step (the max over its microbatches), the scale
 *            updated after the step (so a step's result does not depend on how it
 *            is split into microbatches);
 *   current: scale = fp8_max / amax(tensor) / 2^margin, from the tensor itself.
 * A scale stays as it was while the amax is 0 or not finite. On the C backend the
 * GEMMs are emulated exactly: saturating quantize, dequantize, fp32 GEMM. */
#ifndef SMP_TRAIN_FP8_H
#define SMP_TRAIN_FP8_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

enum { FP8_ROLE_INPUT = 0, FP8_ROLE_WEIGHT = 1, FP8_ROLE_GRAD = 2, FP8_ROLES = 3 };

struct fp8_state {
    fp8_mode mode;
    int nlin;          /* linear layers (7 per transformer block) */
    int hist_len;
    float margin;
    float *hist;       /* [nlin][3][hist_len], newest first */
    float *scale;      /* [nlin][3] */
    float *step_amax;  /* [nlin][3]: max over the current step's microbatches */
    float *scratch;    /* dequantized operands */
    size_t scratch_cap;
    int frozen;        /* 1: forward only (validation): the state is left as it is */
    uint8_t *qbuf;     /* quantized bytes */
    size_t qbuf_cap;
};

/* NULL on out of memory. */
fp8_state *fp8_create(fp8_mode mode, int nlin, int hist_len, float margin);
void fp8_free(fp8_state *s);
/* Scratch for the largest layer (model_alloc_acts calls it), so that the ops
 * never allocate. */
shard_status fp8_reserve(fp8_state *s, size_t floats, size_t bytes);
void fp8_linear_forward(fp8_state *s, int idx, float *out, const float *inp, const float *w,
                        int N, int IN, int OUT);
/* dinp may be NULL (accumulates like op_linear_backward). */
void fp8_linear_backward(fp8_state *s, int idx, float *dinp, float *dw, const float *dout,
                         const float *inp, const float *w, int N, int IN, int OUT);
/* After an optimizer step: push the step's amaxes into the history and update the
 * delayed scales. discard: the step was skipped (non-finite), forget its amaxes. */
void fp8_step_end(fp8_state *s, int discard);
const char *fp8_mode_name(fp8_mode m);

#endif
