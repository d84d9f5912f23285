/* backends/c/dev_c.h: internal to the C backend (dev_c.c, fp8_c.c). */
#ifndef SMP_BACKENDS_DEV_C_H
#define SMP_BACKENDS_DEV_C_H

#include "dev.h"

/* d->impl of the C backend: made by the first fp8_reserve (NULL until then), freed by
 * fini */
typedef struct {
    float *fp8_scratch; /* the dequantized operands of one FP8 linear layer */
    size_t fp8_floats;  /* its length */
} c_impl;

/* FP8 (fp8_c.c): the dev_ops members of the same names */
shard_status c_fp8_reserve(dev *d, fp8_state *s, int N, int maxdim);
void c_fp8_linear_forward(dev *d, fp8_state *s, int idx, void *out, const void *inp, const void *w, int N, int IN,
                          int OUT);
void c_fp8_linear_backward(dev *d, fp8_state *s, int idx, void *dinp, float *dw, const void *dout, const void *inp,
                           const void *w, int N, int IN, int OUT);

#endif
