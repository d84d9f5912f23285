/* kernels/norm.h (internal to kernels/): the row normalization RMSNorm and LayerNorm
 * share (portable C, kernels/layernorm.c). RMSNorm is LayerNorm without the centering
 * and the bias: mean == NULL leaves the rows uncentered (the mean is taken as 0, which
 * gives RMSNorm's arithmetic to the bit), bias == NULL adds none.
 *
 * forward: out = (x - mean) * rstd * weight (+ bias), rstd = 1/sqrt(var + eps), var
 *   the biased variance about the mean (about 0 when mean == NULL: mean(x^2));
 *   mean[N] (if not NULL) and rstd[N] are written.
 * backward: accumulates; any of dinp, dweight, dbias may be NULL to skip it. dweight
 *   and dbias are column sums over the N rows in double, each column's rows added in
 *   order by one thread: the same bits for any thread count. */
#ifndef SMP_KERNELS_NORM_H
#define SMP_KERNELS_NORM_H

void norm_rows_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int N, int H, float eps);
void norm_rows_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, const float *mean, const float *rstd, int N, int H);

#endif
