/* train/state.c: the ranges of a run's settings and the training state of a
 * checkpoint, read and checked (state.h). */
#include "state.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "data.h"

const state_range STATE_RANGE[R_COUNT] = {
    [R_STEPS] = {1, INT32_MAX},      [R_BATCH] = {1, 1 << 24},       [R_MICRO] = {1, 1 << 24},
    [R_SEQ] = {1, 1 << 24},          [R_WARMUP] = {0, INT32_MAX},    [R_MAX_BAD] = {1, 1 << 30},
    [R_FP8_HIST] = {1, 1 << 20},     [R_SAVE_EVERY] = {0, INT32_MAX}, [R_KEEP] = {0, 1 << 20},
    [R_VAL_EVERY] = {0, INT32_MAX},  [R_VAL_BATCHES] = {1, 1 << 30}, [R_STOP_AT] = {1, INT32_MAX},
    [R_LANES] = {1, 1024},           [R_LOGITS_CHUNK] = {1, 1 << 24},
    [R_LR] = {0, 1e3},               [R_LR_MIN] = {0, 1e3},
    [R_CLIP] = {0, 1e30},            [R_WD] = {0, 1e3},              [R_BETA1] = {0, 0.9999999},
    [R_BETA2] = {0, 0.9999999},      [R_EPS] = {1e-30, 1},           [R_FP8_MARGIN] = {0, 64},
};

typedef struct {
    const char *dir;
    shard_status s;
} reader;

static int bad(reader *r, const char *key, const char *what)
{
    if (!r->s) r->s = shard_fail(SHARD_E_INVALID, "%s: training state: \"%s\" %s", r->dir, key, what);
    return 0;
}

static int get_int(reader *r, json_t *o, const char *key, double lo, double hi, int64_t *out)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v)) return bad(r, key, "is missing or not an integer");
    json_int_t x = json_integer_value(v);
    if ((double)x < lo || (double)x > hi) return bad(r, key, "is out of range");
    *out = x;
    return 1;
}

static int get_num(reader *r, json_t *o, const char *key, range_id id, float *out)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_number(v)) return bad(r, key, "is missing or not a number");
    double x = json_number_value(v);
    if (!isfinite(x) || x < STATE_RANGE[id].lo || x > STATE_RANGE[id].hi) return bad(r, key, "is out of range");
    *out = (float)x;
    return 1;
}

static int get_range(reader *r, json_t *o, const char *key, range_id id, int64_t *out)
{
    return get_int(r, o, key, STATE_RANGE[id].lo, STATE_RANGE[id].hi, out);
}

static void read_schedule(reader *r, json_t *sc, run_cfg *c)
{
    if (!json_is_object(sc)) { bad(r, "schedule", "is missing or not an object"); return; }
    json_t *kind = json_object_get(sc, "kind");
    const char *k = json_is_string(kind) ? json_string_value(kind) : "";
    if (strcmp(k, "cosine") && strcmp(k, "constant")) bad(r, "schedule.kind", "is neither cosine nor constant");
    c->cosine = !strcmp(k, "cosine");
    get_num(r, sc, "lr", R_LR, &c->lr);
    get_num(r, sc, "lr_min", R_LR_MIN, &c->lr_min);
    get_range(r, sc, "warmup", R_WARMUP, &c->warmup);
    get_range(r, sc, "steps", R_STEPS, &c->steps);
    c->lr_min_set = 1;
}

static void read_optimizer(reader *r, json_t *op, run_cfg *c)
{
    if (!json_is_object(op)) { bad(r, "optimizer", "is missing or not an object"); return; }
    get_num(r, op, "beta1", R_BETA1, &c->beta1);
    get_num(r, op, "beta2", R_BETA2, &c->beta2);
    get_num(r, op, "eps", R_EPS, &c->eps);
    get_num(r, op, "weight_decay", R_WD, &c->wd);
    get_num(r, op, "clip", R_CLIP, &c->clip);
}

static void read_fp8(reader *r, json_t *f8, run_cfg *c)
{
    if (!json_is_object(f8)) { bad(r, "fp8", "is missing or not an object"); return; }
    json_t *mode = json_object_get(f8, "mode");
    const char *m = json_is_string(mode) ? json_string_value(mode) : "";
    if (!strcmp(m, "off")) c->fp8 = FP8_OFF;
    else if (!strcmp(m, "delayed")) c->fp8 = FP8_DELAYED;
    else if (!strcmp(m, "current")) c->fp8 = FP8_CURRENT;
    else { bad(r, "fp8.mode", "is not off, delayed or current"); return; }
    get_range(r, f8, "history", R_FP8_HIST, &c->fp8_hist);
    get_num(r, f8, "margin", R_FP8_MARGIN, &c->fp8_margin);
}

/* "auto", "whole" or a token count; absent (a state written before the chunks): whole */
static void read_logits_chunk(reader *r, json_t *v, run_cfg *c)
{
    const state_range g = STATE_RANGE[R_LOGITS_CHUNK];
    if (!v || (json_is_string(v) && !strcmp(json_string_value(v), "whole"))) c->logits_chunk = -1;
    else if (json_is_string(v) && !strcmp(json_string_value(v), "auto")) c->logits_chunk = 0;
    else if (!json_is_integer(v) || (double)json_integer_value(v) < g.lo || (double)json_integer_value(v) > g.hi)
        bad(r, "logits_chunk", "is not \"auto\", \"whole\" or a token count in range");
    else c->logits_chunk = json_integer_value(v);
}

/* The data order: shuffled with a seed or sequential without one, and the generator's
 * record (rng) agreeing with it: a state that contradicts itself is refused, not
 * resumed one way or the other. */
static void read_data(reader *r, json_t *da, json_t *rng, run_cfg *c)
{
    if (!json_is_object(da)) { bad(r, "data", "is missing or not an object"); return; }
    json_t *seed = json_object_get(da, "seed"), *order = json_object_get(da, "order");
    if (!json_is_integer(seed) && !json_is_null(seed)) { bad(r, "data.seed", "is neither an integer nor null"); return; }
    c->shuffle = json_is_integer(seed);
    if (c->shuffle && json_integer_value(seed) < 0) { bad(r, "data.seed", "is negative"); return; }
    c->seed = c->shuffle ? (uint64_t)json_integer_value(seed) : 0;
    const char *o = json_is_string(order) ? json_string_value(order) : "";
    if (strcmp(o, c->shuffle ? "shuffled" : "sequential")) { bad(r, "data.order", c->shuffle ? "is not \"shuffled\" although data.seed is set" : "is not \"sequential\" although data.seed is null"); return; }
    if (!json_is_object(rng)) { bad(r, "rng", "is missing or not an object"); return; }
    json_t *rs = json_object_get(rng, "seed");
    if (!json_equal(rs, seed)) { bad(r, "rng.seed", "is not data.seed"); return; }
    int64_t nseq = 0, epoch = 0;
    if (!get_int(r, da, "sequences", 0, (double)DATA_COUNTER_MAX, &nseq) || !get_int(r, rng, "epoch", 0, (double)DATA_COUNTER_MAX, &epoch)) return;
    if (nseq > 0 && epoch != c->position / nseq) bad(r, "rng.epoch", "is not data_position / data.sequences");
}

shard_status state_parse(const char *ckdir, const char *text, size_t len, run_cfg *c)
{
    json_error_t je;
    json_t *t = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(t)) {
        json_decref(t);
        return shard_fail(SHARD_E_INVALID, "%s: the training state is not a JSON object", ckdir);
    }
    reader r = {ckdir, SHARD_OK};
    int64_t tok = 0;
    get_int(&r, t, "step", 0, INT32_MAX, &c->step);
    get_int(&r, t, "optimizer_step", 0, INT32_MAX, &c->opt_step);
    get_int(&r, t, "data_position", 0, (double)DATA_COUNTER_MAX, &c->position);
    get_int(&r, t, "tokens", 0, (double)DATA_COUNTER_MAX, &tok);
    get_range(&r, t, "batch", R_BATCH, &c->batch);
    get_range(&r, t, "microbatches", R_MICRO, &c->micro);
    get_range(&r, t, "seq", R_SEQ, &c->seq);
    c->tokens = (uint64_t)tok;
    read_schedule(&r, json_object_get(t, "schedule"), c);
    read_optimizer(&r, json_object_get(t, "optimizer"), c);
    read_data(&r, json_object_get(t, "data"), json_object_get(t, "rng"), c);
    read_fp8(&r, json_object_get(t, "fp8"), c);
    c->saved.seq = c->seq;
    c->saved.shuffle = c->shuffle;
    c->saved.seed = c->seed;
    if (json_object_get(t, "max_bad_steps")) get_range(&r, t, "max_bad_steps", R_MAX_BAD, &c->max_bad);
    c->lanes = 1; /* a state written before lanes: one, as it ran */
    if (json_object_get(t, "lanes")) get_range(&r, t, "lanes", R_LANES, &c->lanes);
    read_logits_chunk(&r, json_object_get(t, "logits_chunk"), c);
    json_t *el = json_object_get(t, "elapsed_s");
    if (el && (!json_is_number(el) || !isfinite(json_number_value(el)) || json_number_value(el) < 0)) bad(&r, "elapsed_s", "is not a time");
    else if (el) c->elapsed_before = json_number_value(el);
    if (!r.s && c->opt_step > c->step) bad(&r, "optimizer_step", "exceeds step");
    if (!r.s && c->steps < c->step) bad(&r, "schedule.steps", "is below step");
    if (!r.s && c->batch % c->micro) bad(&r, "microbatches", "does not divide batch");
    json_decref(t);
    return r.s;
}

/* 1 when x fails: not finite, or negative (nonneg), or not above 0 (positive) */
static int bad_one(float x, int positive, int nonneg)
{
    return !isfinite(x) || (nonneg && x < 0) || (positive && !(x > 0));
}

enum { CHECK_BLOCK = 1 << 16 };

/* whether any of a block's CHECK_BLOCK elements fails, with no early exit and a known
 * count: a loop -O2 vectorizes (x - x is 0 for every finite x, NaN for infinities and
 * NaNs) */
static int block_bad(const float *x, int positive, int nonneg)
{
    int bad = 0;
    for (size_t i = 0; i < CHECK_BLOCK; i++) {
        const float v = x[i];
        bad |= v - v != 0.0f;
        bad |= nonneg & (v < 0.0f);
        bad |= positive & !(v > 0.0f);
    }
    return bad;
}

/* the first element of x[n] that fails, or n. A resumed run checks its master weights
 * and moments (12 bytes a parameter): blocks of 64 Ki elements on the process's threads,
 * each vectorized, the first failing block then searched element by element (a
 * scalar loop with an early exit took ~0.3 s a GB on one core). */
static size_t first_bad(const float *x, size_t n, int positive, int nonneg)
{
    const size_t nb = (n + CHECK_BLOCK - 1) / CHECK_BLOCK;
    size_t first = nb;
    #pragma omp parallel for schedule(static) reduction(min : first) if (nb > 4)
    for (size_t b = 0; b < nb; b++) {
        const size_t i0 = b * CHECK_BLOCK;
        int bad = 0;
        if (n - i0 >= CHECK_BLOCK) bad = block_bad(x + i0, positive, nonneg);
        else
            for (size_t i = i0; i < n; i++) bad |= bad_one(x[i], positive, nonneg); /* the last, partial block */
        if (bad && b < first) first = b;
    }
    for (size_t i = first * CHECK_BLOCK; i < n; i++)
        if (bad_one(x[i], positive, nonneg)) return i;
    return n;
}

shard_status state_check_weights(const char *dir, const char *group, const float *w, size_t n)
{
    size_t i = w ? first_bad(w, n, 0, 0) : n;
    return i < n ? shard_fail(SHARD_E_INVALID, "%s: %s holds a value that is not finite (element %zu of this rank's)", dir, group, i) : SHARD_OK;
}

shard_status state_check_moments(const char *dir, const float *m, const float *v, size_t n)
{
    size_t i = m ? first_bad(m, n, 0, 0) : n;
    if (i < n) return shard_fail(SHARD_E_INVALID, "%s: optim/exp_avg holds a value that is not finite (element %zu of this rank's)", dir, i);
    i = v ? first_bad(v, n, 0, 1) : n;
    if (i < n) return shard_fail(SHARD_E_INVALID, "%s: optim/exp_avg_sq holds a negative or non-finite value (element %zu of this rank's)", dir, i);
    return SHARD_OK;
}

shard_status state_check_fp8(const char *dir, const float *hist, size_t nh, const float *scale, size_t ns)
{
    if (first_bad(hist, nh, 0, 1) < nh) return shard_fail(SHARD_E_INVALID, "%s: fp8/fp8.amax_history holds a negative or non-finite value", dir);
    if (first_bad(scale, ns, 1, 0) < ns) return shard_fail(SHARD_E_INVALID, "%s: fp8/fp8.scale holds a value that is not finite and positive", dir);
    return SHARD_OK;
}
