/* Parallel layouts: "pp=P,tp=T,cp=C,dp=D", rank <-> coordinates, and the check
 * that a layout can hold a model. Rank order, fastest first: tp, cp, dp, pp. */
#include "../core/internal.h"

#include <stdio.h>
#include <string.h>

enum { DIM_LIMIT = 65536, SIZE_LIMIT = 1 << 20 };

enum { NKEYS = 5 };
static const char *const KEYS[NKEYS] = {"pp", "tp", "cp", "dp", "ep"};

static int *field(shard_layout *l, int k)
{
    switch (k) {
    case 0: return &l->pp;
    case 1: return &l->tp;
    case 2: return &l->cp;
    case 3: return &l->dp;
    default: return &l->ep;
    }
}

int shard_layout_ep(const shard_layout *l) { return l->ep > 1 ? l->ep : 1; }

static int get(const shard_layout *l, int k)
{
    return k == 0 ? l->pp : k == 1 ? l->tp : k == 2 ? l->cp : k == 3 ? l->dp : shard_layout_ep(l);
}

int shard_layout_ep_rank(const shard_layout *l, shard_coords c)
{
    return (c.dp * l->cp + c.cp) % shard_layout_ep(l);
}

/* 1 when every count is in [1, DIM_LIMIT] and the product within SIZE_LIMIT. */
static int in_bounds(const shard_layout *l)
{
    long long size = 1;
    for (int k = 0; k < NKEYS; k++) {
        if (get(l, k) < 1 || get(l, k) > DIM_LIMIT) return 0;
        if (k < 4) size *= get(l, k); /* ep is not a dimension of its own */
    }
    return size <= SIZE_LIMIT;
}

/* Parse one "key=value" item of length n at s into out. */
static shard_status parse_item(const char *text, const char *s, size_t n, shard_layout *out, int *seen)
{
    if (n == 0) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": empty item (expected key=value pairs separated by commas)", text);
    const char *eq = memchr(s, '=', n);
    if (!eq) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": \"%.*s\" is not key=value", text, (int)(n > 40 ? 40 : n), s);
    size_t klen = (size_t)(eq - s);
    int k = -1;
    for (int i = 0; i < NKEYS; i++)
        if (klen == 2 && memcmp(s, KEYS[i], 2) == 0) k = i;
    if (k < 0)
        return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": unknown key \"%.*s\" (expected pp, tp, cp, dp or ep)", text, (int)(klen > 40 ? 40 : klen), s);
    if (seen[k]) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %s is given twice", text, KEYS[k]);
    seen[k] = 1;
    const char *v = eq + 1, *end = s + n;
    if (v == end) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %s has no value", text, KEYS[k]);
    /* Digits only: no sign, space, exponent or suffix; stop counting past the
     * limit so that a long string cannot overflow. */
    long long x = 0;
    for (const char *p = v; p < end; p++) {
        if (*p < '0' || *p > '9')
            return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %s=\"%.*s\" is not a positive integer", text, KEYS[k], (int)(end - v > 40 ? 40 : end - v), v);
        if (x <= DIM_LIMIT) x = x * 10 + (*p - '0');
    }
    if (x < 1) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %s must be at least 1", text, KEYS[k]);
    if (x > DIM_LIMIT) return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %s exceeds %d", text, KEYS[k], DIM_LIMIT);
    *field(out, k) = (int)x;
    return SHARD_OK;
}

shard_status shard_layout_parse(const char *text, shard_layout *out)
{
    if (!text || !out) return shard_fail(SHARD_E_USAGE, "shard_layout_parse: NULL argument");
    shard_layout l = {1, 1, 1, 1, 1};
    int seen[NKEYS] = {0};
    if (!*text) return shard_fail(SHARD_E_USAGE, "layout \"\": empty (expected e.g. \"pp=2,tp=4\")");
    const char *s = text;
    for (;;) {
        const char *c = strchr(s, ',');
        size_t n = c ? (size_t)(c - s) : strlen(s);
        shard_status st = parse_item(text, s, n, &l, seen);
        if (st) return st;
        if (!c) break;
        s = c + 1;
    }
    long long size = (long long)l.pp * l.tp * l.cp * l.dp; /* each <= 2^16: fits */
    if (size > SIZE_LIMIT)
        return shard_fail(SHARD_E_USAGE, "layout \"%.200s\": %lld ranks exceeds the limit of %d", text, size, SIZE_LIMIT);
    *out = l;
    return SHARD_OK;
}

const char *shard_layout_format(const shard_layout *l, char *buf, size_t cap)
{
    if (buf && cap) {
        int n = snprintf(buf, cap, "pp=%d,tp=%d,cp=%d,dp=%d", l->pp, l->tp, l->cp, l->dp);
        if (shard_layout_ep(l) > 1 && n >= 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, ",ep=%d", l->ep);
    }
    return buf;
}

/* 0 for a layout out of bounds, so that no rank is valid in it. */
int shard_layout_size(const shard_layout *l) { return in_bounds(l) ? l->pp * l->tp * l->cp * l->dp : 0; }

/* Out-of-range ranks give all -1, which shard_layout_rank refuses in turn. */
shard_coords shard_layout_coords(const shard_layout *l, int rank)
{
    shard_coords c = {-1, -1, -1, -1};
    if (rank < 0 || rank >= shard_layout_size(l)) return c;
    c.tp = rank % l->tp; rank /= l->tp;
    c.cp = rank % l->cp; rank /= l->cp;
    c.dp = rank % l->dp; rank /= l->dp;
    c.pp = rank;
    return c;
}

int shard_layout_rank(const shard_layout *l, shard_coords c)
{
    if (!in_bounds(l) || c.pp < 0 || c.pp >= l->pp || c.tp < 0 || c.tp >= l->tp || c.cp < 0 || c.cp >= l->cp || c.dp < 0 || c.dp >= l->dp)
        return -1;
    return ((c.pp * l->dp + c.dp) * l->cp + c.cp) * l->tp + c.tp;
}

/* SHARD_E_USAGE throughout: the layout is the user's argument, the model is the
 * input it must fit. */
shard_status shard_layout_check(const shard_layout *l, const shard_model_desc *d)
{
    if (!l || !d) return shard_fail(SHARD_E_USAGE, "shard_layout_check: NULL argument");
    char name[96];
    shard_layout_format(l, name, sizeof name);
    for (int k = 0; k < NKEYS; k++) {
        int v = get(l, k);
        if (v < 1 || v > DIM_LIMIT)
            return shard_fail(SHARD_E_USAGE, "layout %s: %s=%d is out of range [1, %d]", name, KEYS[k], v, DIM_LIMIT);
    }
    long long size = (long long)l->pp * l->tp * l->cp * l->dp;
    if (size > SIZE_LIMIT) return shard_fail(SHARD_E_USAGE, "layout %s: %lld ranks exceeds the limit of %d", name, size, SIZE_LIMIT);
    if (d->heads < 1 || d->kv_heads < 1 || d->layers < 1)
        return shard_fail(SHARD_E_USAGE, "layout %s: the model description has %lld heads, %lld kv heads, %lld layers", name,
                          (long long)d->heads, (long long)d->kv_heads, (long long)d->layers);
    if (d->heads % l->tp)
        return shard_fail(SHARD_E_USAGE, "layout %s: tp=%d does not divide the %lld attention heads", name, l->tp, (long long)d->heads);
    if (d->kv_heads % l->tp && l->tp % d->kv_heads)
        return shard_fail(SHARD_E_USAGE, "layout %s: tp=%d neither divides nor is a multiple of the %lld key/value heads", name, l->tp,
                          (long long)d->kv_heads);
    if (l->pp > d->layers)
        return shard_fail(SHARD_E_USAGE, "layout %s: pp=%d exceeds the %lld layers (every stage needs at least one)", name, l->pp,
                          (long long)d->layers);
    if (l->pp > SHARD_MAX_PP) return shard_fail(SHARD_E_USAGE, "layout %s: pp=%d exceeds the limit of %d stages", name, l->pp, SHARD_MAX_PP);
    const int ep = shard_layout_ep(l);
    if (ep > SHARD_MAX_EP) return shard_fail(SHARD_E_USAGE, "layout %s: ep=%d exceeds the limit of %d", name, ep, SHARD_MAX_EP);
    if (ep > 1 && !d->experts)
        return shard_fail(SHARD_E_USAGE, "layout %s: ep=%d, but the model has no experts", name, ep);
    if (ep > 1 && (l->dp * l->cp) % ep)
        return shard_fail(SHARD_E_USAGE, "layout %s: ep=%d does not divide dp x cp = %d (the ranks that split the experts)",
                          name, ep, l->dp * l->cp);
    if (ep > 1 && d->experts % ep)
        return shard_fail(SHARD_E_USAGE, "layout %s: ep=%d does not divide the %lld experts", name, ep, (long long)d->experts);
    return SHARD_OK;
}
