/* kernels/embedding.c: vocab-parallel token embedding (portable C). */
#include "ops.h"

#include <string.h>

void op_embedding_forward(float *out, const int32_t *tokens, const float *wte,
                          int N, int H, int vocab_start, int vocab_local)
{
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *o = out + (size_t)n * H;
        int t = tokens[n];
        if (t >= vocab_start && t - vocab_start < vocab_local)
            memcpy(o, wte + (size_t)(t - vocab_start) * H, (size_t)H * sizeof(float));
        else
            memset(o, 0, (size_t)H * sizeof(float)); /* owned by another tp rank */
    }
}

void op_embedding_backward(float *dwte, const float *dout, const int32_t *tokens,
                           int N, int H, int vocab_start, int vocab_local)
{
    /* The same token may occur in many rows, so threads split the hidden
     * dimension (never the rows): each column block has one writer. */
    enum { CB = 64 };
    int nblk = (H + CB - 1) / CB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblk; b++) {
        int j0 = b * CB, j1 = j0 + CB < H ? j0 + CB : H;
        for (int n = 0; n < N; n++) {
            int t = tokens[n];
            if (t < vocab_start || t - vocab_start >= vocab_local)
                continue;
            float *d = dwte + (size_t)(t - vocab_start) * H;
            const float *g = dout + (size_t)n * H;
            for (int j = j0; j < j1; j++)
                d[j] += g[j];
        }
    }
}
