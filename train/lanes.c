/* train/lanes.c: a rank's microbatch split over its CPU threads (lanes.h). */
#include "lanes.h"

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

static int threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

const char *lanes_refusal(const model *m, const shard_layout *l, int rows, int n)
{
    if (n <= 1) return NULL;
    if (n > LANES_MAX) return "more lanes than 1024";
    if (m->dev->cuda) return "the CUDA backend runs a rank's microbatch on its GPU (lanes are the C backend's)";
    if (l->pp > 1 || l->tp > 1 || l->cp > 1 || l->ep > 1) return "lanes take pp = tp = cp = 1 and no ep";
    if (m->E) return "a mixture of experts takes one lane (its routing statistics are the rank's)";
    if (m->fp8) return "--fp8 takes one lane (its scaling history is the rank's)";
    if (rows % n) return "the lanes do not divide a microbatch's sequences (--batch / dp / --microbatches)";
    return NULL;
}

/* an eighth of the machine's memory (0 when unknown) */
static uint64_t memory_share(void)
{
    const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size / 8 : 0;
}

int lanes_auto(const model *m, const shard_layout *l, int rows)
{
    const int n = threads();
    /* the extra lanes' gradient copies: a small model's (where lanes pay), not a large one's */
    const uint64_t extra = (uint64_t)(n > 1 ? n - 1 : 0) * m->nparams * sizeof(float);
    return n > 1 && !lanes_refusal(m, l, rows, n) && extra <= memory_share() ? n : 1;
}

lanes lanes_single(model **m, int rows)
{
    return (lanes){1, rows, m};
}

shard_status lanes_open(lanes *ln, model *m, int n, int rows, int T, int nslots)
{
    *ln = (lanes){n, rows / n, calloc((size_t)n, sizeof(model *))};
    if (!ln->m) return shard_fail(SHARD_E_NOMEM, "out of memory");
    ln->m[0] = m;
    for (int i = 1; i < n; i++) {
        model *x = calloc(1, sizeof *x);
        shard_status s = x ? model_lane(x, m) : shard_fail(SHARD_E_NOMEM, "out of memory for lane %d", i);
        if (s) {
            free(x);
            ln->n = i; /* lanes_close frees those made */
            return s;
        }
        ln->m[i] = x;
    }
    for (int i = 0; i < n; i++) {
        shard_status s = model_alloc_slots(ln->m[i], ln->rows, T, nslots);
        if (s) return s;
    }
#ifdef _OPENMP
    if (n > 1) omp_set_max_active_levels(1); /* each lane's ops on its own thread, not a team of their own */
#endif
    return SHARD_OK;
}

void lanes_close(lanes *ln)
{
    for (int i = 1; ln->m && i < ln->n; i++) {
        model_free(ln->m[i]);
        free(ln->m[i]);
    }
    free(ln->m);
    *ln = (lanes){0, 0, NULL};
}

/* Each lane's part of the microbatch in in/tg: its documents, its forward (part[i]:
 * the loss sum), with backward its backward; counted[i]: its counted targets */
static void run_lanes(lanes *ln, int32_t *in, int32_t *tg, int backward, float loss_scale, double *part,
                      uint64_t *counted)
{
    #pragma omp parallel for num_threads(ln->n) schedule(static, 1) if (ln->n > 1)
    for (int i = 0; i < ln->n; i++) {
#ifdef _OPENMP
        if (ln->n > 1) omp_set_num_threads(1); /* this lane's ops ask for their threads: one (this task's setting) */
#endif
        model *x = ln->m[i];
        const size_t off = (size_t)i * (size_t)ln->rows * (size_t)x->T;
        counted[i] = par_take_batch(x, ln->rows, in + off, tg + off);
        part[i] = backward ? model_forward_train(x, in + off, tg + off, loss_scale) : model_forward(x, in + off, tg + off);
        if (backward) model_backward(x, in + off);
    }
}

static double sum_of(const lanes *ln, const double *part, const uint64_t *counted, uint64_t *tokens)
{
    double s = 0.0;
    for (int i = 0; i < ln->n; i++) {
        s += part[i];
        if (tokens) *tokens += counted[i];
    }
    return s;
}

shard_status lanes_train_step(lanes *ln, par_ctx *p, int M, par_fill_fn fill, void *ctx, int32_t *in, int32_t *tg,
                              float loss_scale, double *lsum)
{
    model *m = ln->m[0];
    if (ln->n == 1) return par_train_step(p, m, M, fill, ctx, in, tg, loss_scale, lsum);
    double part[LANES_MAX];
    uint64_t counted[LANES_MAX];
    *lsum = 0.0;
    for (int i = 1; i < ln->n; i++) model_zero_grads(ln->m[i]);
    for (int mb = 0; mb < M; mb++) {
        shard_status s = fill(ctx, mb, in, tg);
        if (s) return s;
        run_lanes(ln, in, tg, 1, loss_scale, part, counted);
        *lsum += sum_of(ln, part, counted, NULL);
        if ((s = dev_status(m->dev))) return s;
    }
    /* lane by lane, in order: the same sum for any thread count */
    for (int i = 1; i < ln->n; i++) m->dev->ops->add(m->dev, m->grads, m->grads, ln->m[i]->grads, m->nparams);
    return dev_status(m->dev);
}

double lanes_forward(lanes *ln, int32_t *in, int32_t *tg, uint64_t *tokens)
{
    double part[LANES_MAX];
    uint64_t counted[LANES_MAX];
    run_lanes(ln, in, tg, 0, 0.0f, part, counted);
    return sum_of(ln, part, counted, tokens);
}

void lanes_memory(const lanes *ln, size_t *grads, size_t *acts)
{
    *grads = *acts = 0;
    for (int i = 1; i < ln->n; i++) {
        size_t p, g, a;
        model_memory(ln->m[i], &p, &g, &a);
        *grads += g;
        *acts += a;
    }
}
