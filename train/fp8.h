/* train/fp8.h: the FP8 recipe of the transformer blocks' linear layers, as
 * TransformerEngine's: forward GEMMs take E4M3 inputs and weights, backward GEMMs
 * take the E5M2 output gradient (with the E4M3 weight for dgrad, the E4M3 input
 * for wgrad); one scale per tensor role of each linear layer:
 *   delayed: scale = fp8_max / max(amax history) / 2^margin, the history taking
 *            one amax per optimizer step (the max over its microbatches), the scale
 *            updated after the step (so a step's result does not depend on how it
 *            is split into microbatches);
 *   current: scale = fp8_max / amax(tensor) / 2^margin, from the tensor itself.
 * A scale stays as it was while the amax is 0 or not finite.
 *
 * This is the recipe only: the scaling state on the host and its rules. The GEMMs
 * are the backends' (dev.h's fp8_* ops): emulated exactly on the C backend
 * (backends/c/fp8_c.c: saturating quantize, dequantize, fp32 GEMM), cuBLASLt's FP8
 * GEMMs on CUDA (backends/cuda/dev_cuda_fp8.c). */
#ifndef SMP_TRAIN_FP8_H
#define SMP_TRAIN_FP8_H

#include <stddef.h>
#include <stdint.h>

typedef enum { FP8_OFF = 0, FP8_DELAYED, FP8_CURRENT } fp8_mode;

enum { FP8_ROLE_INPUT = 0, FP8_ROLE_WEIGHT = 1, FP8_ROLE_GRAD = 2, FP8_ROLES = 3 };

typedef struct fp8_state fp8_state;
struct fp8_state {
    fp8_mode mode;
    int nlin;          /* linear layers (model_fp8_linears: 7 per block, 3 per expert) */
    int hist_len;
    float margin;
    float *hist;       /* [nlin][3][hist_len], newest first */
    float *scale;      /* [nlin][3] */
    float *step_amax;  /* [nlin][3]: max over the current step's microbatches */
    int frozen;        /* 1: forward only (validation): the state is left as it is */
};

/* NULL on out of memory. */
fp8_state *fp8_create(fp8_mode mode, int nlin, int hist_len, float margin);
void fp8_free(fp8_state *s);
/* The scale of (idx, role) for a tensor whose max |x| is amax, as one call of a
 * linear layer uses it: recorded in the step's amaxes (current scaling: the scale
 * updated from it first), unless frozen. */
float fp8_use_scale(fp8_state *s, int idx, int role, float amax);
/* After an optimizer step: push the step's amaxes into the history and update the
 * delayed scales. discard: the step was skipped (non-finite), forget its amaxes. */
void fp8_step_end(fp8_state *s, int discard);
const char *fp8_mode_name(fp8_mode m);

#endif
