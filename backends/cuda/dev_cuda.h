/* backends/cuda/dev_cuda.h: internal to the CUDA backend (dev_cuda.c, dev_cuda_fp8.c,
 * dev_cuda_comm.c), which is built into libsmp_cuda.so alone: nothing else
 * includes this header.
 *
 * libsmp_cuda.so is self-contained: it is linked with -z defs (every symbol it
 * uses resolved by the libraries it names) and exports one symbol, DEV_CUDA_ENTRY;
 * so it loads with RTLD_NOW into any program, whether or not that program exports
 * its own symbols. That is why it is built with its own copy of backends/dev_err.c
 * (dev_fail, dev_status: the first failure wins and is kept in d->err and
 * d->errmsg) and not against the program's (dev.c beside it holds dev_open, which
 * needs the C backend). */
#ifndef SMP_TRAIN_DEV_CUDA_H
#define SMP_TRAIN_DEV_CUDA_H

#include <cuda_runtime_api.h>

#include "dev.h"
#include "ops_cuda.h"

enum { CU_STAGE_SLOTS = 4, CU_STAGE_BYTES = 1 << 20 }; /* pinned staging for small uploads */

typedef struct cu_fp8 cu_fp8;

typedef struct {
    cudaStream_t st;          /* every op of the backend runs on it */
    cuda_gemm *gemm;
    size_t gemm_fp8_bytes;    /* the gemm's FP8 backward scratch */
    double *d_sum;            /* device scalar for sumsq and the loss sum */
    unsigned char *stage;     /* [CU_STAGE_SLOTS][CU_STAGE_BYTES] pinned host memory */
    cudaEvent_t stage_ev[CU_STAGE_SLOTS];
    int stage_next;
    cu_fp8 *fp8;              /* dev_cuda_fp8.c */
    void *scratch;            /* the ops' scratch (attention's tables, the experts' grouping), */
    size_t scratch_bytes;     /* grown as needed, used in stream order */
    shard_comm **comms;       /* NCCL communicators enqueued on st (dev_cuda_comm.c): */
    int ncomms;               /* the backend's waits watch them (cu_wait) */
    char desc[256];
} cu_impl;

static inline cu_impl *cu_of(dev *d) { return (cu_impl *)d->impl; }
static inline cudaDataType_t cu_dt(const dev *d) { return d->dt == SHARD_DT_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

/* The result of a cuda_op_* / cuda_gemm_* call: on failure, its cuda_op_errmsg(). */
void cu_op(dev *d, cudaError_t e);
/* The result of a CUDA runtime call `what`. */
void cu_rt(dev *d, cudaError_t e, const char *what);

/* FP8 (dev_cuda_fp8.c): the dev_ops members of the same names, and the release of
 * the backend's FP8 buffers. */
shard_status cu_fp8_reserve(dev *d, fp8_state *s, int N, int maxdim);
void cu_fp8_linear_forward(dev *d, fp8_state *s, int idx, void *out, const void *inp, const void *w, int N, int IN,
                           int OUT);
void cu_fp8_linear_backward(dev *d, fp8_state *s, int idx, void *dinp, float *dw, const void *dout, const void *inp,
                            const void *w, int N, int IN, int OUT);
void cu_fp8_collect(dev *d, fp8_state *s);
void cu_fp8_scales_changed(dev *d, fp8_state *s);
void cu_fp8_free(dev *d);

/* Communicators (dev_cuda_comm.c): the dev_ops member comm_for. */
shard_status cu_comm_for(dev *d, shard_comm *host, shard_comm **out, int *owned);
/* an NCCL communicator enqueued on the backend's stream, watched by cu_wait from now
 * on (until unwatched, before it is freed) */
shard_status cu_comm_watch(dev *d, shard_comm *nccl);
void cu_comm_unwatch(dev *d, shard_comm *nccl);
/* Waits on the host until ev (NULL: all the stream's work) is done; a failure goes to
 * d->err (what: the call, for its message). With watched communicators it polls,
 * and a failed or hung NCCL call (shard_comm_nccl_check) ends the wait as a failure;
 * once the backend has failed it waits no more (the GPU may never finish). */
void cu_wait(dev *d, cudaEvent_t ev, const char *what);

#endif
