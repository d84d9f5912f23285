/* train/data.c: llm.c token files and the global order of sequences (data.h). */
#include "data.h"

#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void rng_seed(rng_state *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull);
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t rng_next(rng_state *r)
{
    uint64_t *s = r->s, out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

/* uniform in [0, n) without modulo bias (Lemire's method, with rejection) */
static uint64_t rng_below(rng_state *r, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)rng_next(r) * n;
    uint64_t lo = (uint64_t)m;
    if (lo < n) {
        uint64_t thresh = -n % n;
        while (lo < thresh) {
            m = (unsigned __int128)rng_next(r) * n;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

static uint32_t token_at(const data_file *f, const uint8_t *p)
{
    if (f->token_size == 2) return (uint32_t)p[0] | (uint32_t)p[1] << 8;
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int32_t rd32(const uint8_t *p)
{
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* the header's magic, version and count of a file of size bytes (what: its kind) */
static shard_status read_header(int fd, const char *path, uint64_t size, const char *what, int32_t h[3])
{
    if (size < 1024)
        return shard_fail(SHARD_E_INVALID, "%s: %llu bytes: too short for the 1024-byte header of %s", path,
                          (unsigned long long)size, what);
    uint8_t b[12];
    shard_status s = shard_pread_full(fd, path, b, sizeof b, 0);
    if (s) return s;
    for (int k = 0; k < 3; k++) h[k] = rd32(b + 4 * k);
    return SHARD_OK;
}

/* sequences of S + 1 tokens in a file of n (consecutive ones share a token) */
static uint64_t seqs_in(uint64_t n, int S)
{
    return n > 0 ? (n - 1) / (uint64_t)S : 0;
}

/* The largest of n little-endian tokens, kept in 64 lanes whose fixed count lets the
   compiler vectorize the loop at -O2 (a token at a time, the check ran at 1 GB/s). */
#define MAX_TOKEN_OF(T)                                                                                                \
    static uint32_t max_token_##T(const uint8_t *raw, size_t n)                                                        \
    {                                                                                                                  \
        T m[64] = {0}, t;                                                                                              \
        size_t k = 0;                                                                                                  \
        for (; k + 64 <= n; k += 64)                                                                                   \
            for (int j = 0; j < 64; j++) {                                                                             \
                memcpy(&t, raw + (k + (size_t)j) * sizeof t, sizeof t);                                                \
                m[j] = t > m[j] ? t : m[j];                                                                            \
            }                                                                                                          \
        for (; k < n; k++) {                                                                                           \
            memcpy(&t, raw + k * sizeof t, sizeof t);                                                                  \
            m[0] = t > m[0] ? t : m[0];                                                                                \
        }                                                                                                              \
        T top = 0;                                                                                                     \
        for (int j = 0; j < 64; j++) top = m[j] > top ? m[j] : top;                                                    \
        return top;                                                                                                    \
    }
MAX_TOKEN_OF(uint16_t)
MAX_TOKEN_OF(uint32_t)
#if defined(__BYTE_ORDER__)
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "max_token_* read tokens in the host's order: little-endian only");
#endif

/* Tokens [i0, i0 + n) decoded from raw, every one inside the vocabulary. */
static shard_status check_tokens(const data_file *f, const uint8_t *raw, uint64_t i0, size_t n)
{
    const uint32_t top = f->token_size == 2 ? max_token_uint16_t(raw, n) : max_token_uint32_t(raw, n);
    if ((int64_t)top < f->vocab) return SHARD_OK;
    for (size_t k = 0; k < n; k++) { /* which one: the first outside */
        uint32_t t = token_at(f, raw + k * (size_t)f->token_size);
        if ((int64_t)t >= f->vocab)
            return shard_fail(SHARD_E_INVALID, "%s: token %u at position %llu is outside the model's vocabulary (vocab_size %lld)",
                              f->path, t, (unsigned long long)(i0 + k), (long long)f->vocab);
    }
    return SHARD_OK;
}

/* ------------------------------------------------------- checking a whole file */
typedef shard_status (*scan_check)(const data_file *f, const uint8_t *buf, uint64_t i0, size_t n);
static shard_status check_mask(const data_file *f, const uint8_t *m, uint64_t i0, size_t n);

enum { SCAN_BLOCK = 1 << 20 };

/* A scan of count elements of es bytes after fd's 1024-byte header, shared by its threads */
typedef struct {
    const data_file *f;
    int fd;
    const char *path;
    uint64_t count, per; /* elements; elements a block */
    size_t es;
    scan_check check;
    uint64_t *bh;        /* each block's hash */
    uint64_t bad;        /* the first failing block (the block count: none) */
    shard_status bad_s;  /* its failure and message */
    char msg[1024];
} scan_job;

/* Block b read into buf, checked and hashed; a failure's status and message kept when it
 * is the earliest block's yet. */
static void scan_block(scan_job *j, uint8_t *buf, uint64_t b)
{
    const uint64_t i0 = b * j->per;
    const size_t n = j->count - i0 < j->per ? (size_t)(j->count - i0) : (size_t)j->per;
    shard_status s = buf ? shard_pread_full(j->fd, j->path, buf, n * j->es, 1024 + i0 * j->es)
                         : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s) s = j->check(j->f, buf, i0, n);
    if (!s) {
        j->bh[b] = shard_hash64(0, buf, n * j->es);
        return;
    }
    #pragma omp critical(data_scan_fail)
    if (b < j->bad) {
        __atomic_store_n(&j->bad, b, __ATOMIC_RELAXED);
        j->bad_s = s;
        snprintf(j->msg, sizeof j->msg, "%s", shard_errmsg()); /* the message is this thread's */
    }
}

/* The count elements of es bytes after fd's 1024-byte header, checked by check and
 * hashed a block of 1 MiB at a time by the process's OpenMP threads (a file of tens of
 * GB is read at the speed of its storage, not of one core); *hash: shard_hash64 of the
 * blocks' shard_hash64s, in order. A failure is the first block's in file order, the
 * message as one thread would have found it. */
static shard_status scan(const data_file *f, int fd, const char *path, uint64_t count, size_t es, scan_check check,
                         uint64_t *hash)
{
    scan_job j = {.f = f, .fd = fd, .path = path, .count = count, .per = SCAN_BLOCK / es, .es = es, .check = check};
    const uint64_t nb = (count + j.per - 1) / j.per;
    j.bad = nb;
    if (!(j.bh = malloc((nb ? nb : 1) * sizeof *j.bh))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    #pragma omp parallel if (nb > 1)
    {
        uint8_t *buf = malloc(SCAN_BLOCK);
        #pragma omp for schedule(dynamic, 4)
        for (uint64_t b = 0; b < nb; b++)
            if (b < __atomic_load_n(&j.bad, __ATOMIC_RELAXED)) scan_block(&j, buf, b); /* past a failure: no need */
        free(buf);
    }
    shard_status s = j.bad < nb ? shard_fail(j.bad_s, "%s", j.msg) : SHARD_OK;
    if (!s) *hash = shard_hash64(0, j.bh, nb * sizeof *j.bh); /* little-endian only (max_token_*) */
    free(j.bh);
    return s;
}

static shard_status open_file(data_file *f, const char *path, int S, int64_t vocab)
{
    memset(f, 0, sizeof *f);
    f->fd = f->mfd = -1;
    f->vocab = vocab;
    f->path = strdup(path);
    if (!f->path) return shard_fail(SHARD_E_NOMEM, "out of memory");
    uint64_t size;
    shard_status s = shard_open_regular(path, 0, &f->fd, &size); /* a FIFO or device: refused, not waited on */
    if (s) return s;
    int32_t h[3];
    if ((s = read_header(f->fd, path, size, "an llm.c token file", h))) return s;
    const int32_t magic = h[0], version = h[1], count = h[2];
    if (magic == DATA_MAGIC_U16 && version == 1) f->token_size = 2;
    else if (magic == DATA_MAGIC_U32 && version == 7) f->token_size = 4;
    else if (magic == DATA_MAGIC_MASK) /* a glob such as sft*.bin takes sft.mask.bin too */
        return shard_fail(SHARD_E_INVALID, "%s: a loss mask file, not a token file (masks go with --loss-mask)", path);
    else
        return shard_fail(SHARD_E_INVALID,
                          "%s: not an llm.c token file (magic %d version %d; expected 20240520 version 1 "
                          "for uint16 tokens or 20240801 version 7 for uint32)", path, magic, version);
    if (count < 0) return shard_fail(SHARD_E_INVALID, "%s: negative token count %d", path, count);
    f->ntokens = (uint64_t)count;
    uint64_t want = 1024 + f->ntokens * (uint64_t)f->token_size;
    if (size != want)
        return shard_fail(SHARD_E_INVALID, "%s: the header says %llu tokens (%llu bytes with the header) but the file has %llu bytes",
                          path, (unsigned long long)f->ntokens, (unsigned long long)want, (unsigned long long)size);
    /* every token against the vocabulary */
    s = scan(f, f->fd, f->path, f->ntokens, (size_t)f->token_size, check_tokens, &f->hash);
    f->nseq = seqs_in(f->ntokens, S);
    return s;
}

static shard_status add_path(void *ctx, const char *path)
{
    data_set *ds = ctx;
    data_file *nf = realloc(ds->files, (size_t)(ds->nfiles + 1) * sizeof *nf);
    if (!nf) return shard_fail(SHARD_E_NOMEM, "out of memory");
    ds->files = nf;
    data_file *f = &ds->files[ds->nfiles++];
    shard_status s = open_file(f, path, ds->S, ds->vocab);
    if (s) return s;
    f->first_seq = ds->nseq;
    ds->nseq += f->nseq;
    return SHARD_OK;
}

/* fn(ctx, path) for each file of spec: comma-separated paths or globs (each sorted) */
static shard_status each_path(const char *spec, shard_status (*fn)(void *, const char *), void *ctx)
{
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_status s = SHARD_OK;
    for (char *part = strtok_r(copy, ",", &save); part && !s; part = strtok_r(NULL, ",", &save)) {
        if (!*part) continue;
        if (!strpbrk(part, "*?[")) {
            s = fn(ctx, part);
            continue;
        }
        glob_t g;
        int rc = glob(part, 0, NULL, &g);
        if (rc == 0) {
            for (size_t i = 0; i < g.gl_pathc && !s; i++) s = fn(ctx, g.gl_pathv[i]);
            globfree(&g);
        } else {
            s = shard_fail(SHARD_E_USAGE, "%s: no file matches", part);
        }
    }
    free(copy);
    return s;
}

shard_status data_open(data_set *ds, const char *spec, int S, int64_t vocab)
{
    memset(ds, 0, sizeof *ds);
    ds->S = S;
    ds->vocab = vocab;
    ds->perm_epoch = -1;
    if (S < 1) return shard_fail(SHARD_E_USAGE, "the sequence length must be at least 1");
    shard_status s = each_path(spec, add_path, ds);
    if (!s && ds->nfiles == 0) s = shard_fail(SHARD_E_USAGE, "no token file given");
    if (!s && ds->nseq == 0)
        s = shard_fail(SHARD_E_INVALID, "%s: fewer than %d tokens in every file: no sequence of length %d + 1", spec, S + 1, S);
    if (s) data_close(ds);
    return s;
}

/* ---------------------------------------------------------------- loss masks */

/* Mask bytes [i0, i0 + n) of f, each 0 or 1. */
static shard_status check_mask(const data_file *f, const uint8_t *m, uint64_t i0, size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (m[k] > 1)
            return shard_fail(SHARD_E_INVALID, "%s: mask byte %u at position %llu (a mask byte is 0 or 1)", f->mpath,
                              m[k], (unsigned long long)(i0 + k));
    return SHARD_OK;
}

static shard_status read_mask_at(const data_file *f, uint8_t *buf, size_t n, uint64_t i0)
{
    shard_status s = shard_pread_full(f->mfd, f->mpath, buf, n, 1024 + i0);
    return s ? s : check_mask(f, buf, i0, n);
}

typedef struct {
    data_set *ds;
    int next; /* the token file the next mask file belongs to */
} mask_walk;

static shard_status add_mask(void *ctx, const char *path)
{
    mask_walk *w = ctx;
    if (w->next >= w->ds->nfiles) {
        w->next++;
        return SHARD_OK; /* counted, refused once all are seen */
    }
    data_file *f = &w->ds->files[w->next++];
    if (!(f->mpath = strdup(path))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    uint64_t size;
    shard_status s = shard_open_regular(path, 0, &f->mfd, &size);
    if (s) return s;
    int32_t h[3];
    if ((s = read_header(f->mfd, path, size, "a loss mask file", h))) return s;
    const int32_t magic = h[0], version = h[1], count = h[2];
    if (magic == DATA_MAGIC_U16 || magic == DATA_MAGIC_U32)
        return shard_fail(SHARD_E_INVALID, "%s: a token file, not a loss mask file (tokens go with --data)", path);
    if (magic != DATA_MAGIC_MASK || version != 1)
        return shard_fail(SHARD_E_INVALID, "%s: not a loss mask file (magic %d version %d; expected %d version 1)", path,
                          magic, version, DATA_MAGIC_MASK);
    if (count < 0 || size != 1024 + (uint64_t)count)
        return shard_fail(SHARD_E_INVALID, "%s: the header says %d mask bytes but the file has %llu bytes after the header",
                          path, count, (unsigned long long)(size - 1024));
    if ((uint64_t)count != f->ntokens)
        return shard_fail(SHARD_E_INVALID, "%s: %d mask bytes but its token file %s holds %llu tokens (one byte per token)",
                          path, count, f->path, (unsigned long long)f->ntokens);
    uint64_t mh = 0;
    if ((s = scan(f, f->mfd, f->mpath, f->ntokens, 1, check_mask, &mh))) return s;
    f->hash = shard_hash64(f->hash, &mh, sizeof mh); /* the tokens', then the mask's */
    return SHARD_OK;
}

shard_status data_open_masks(data_set *ds, const char *spec)
{
    mask_walk w = {ds, 0};
    shard_status s = each_path(spec, add_mask, &w);
    if (!s && w.next != ds->nfiles)
        s = shard_fail(SHARD_E_USAGE, "%s: %d loss mask files for %d token files (one per token file, in the same order)",
                       spec, w.next, ds->nfiles);
    ds->masked = !s;
    return s;
}

uint64_t data_fingerprint(const data_set *ds)
{
    uint64_t h = 0;
    for (int i = 0; i < ds->nfiles; i++) {
        const data_file *f = &ds->files[i];
        const uint64_t rec[4] = {(uint64_t)f->token_size, f->ntokens, f->hash, f->mpath != NULL};
        h = shard_hash64(h, rec, sizeof rec);
    }
    return h;
}

const char *data_fingerprint_text(const data_set *ds, char *buf)
{
    snprintf(buf, 32, DATA_FINGERPRINT_KIND ":%016llx", (unsigned long long)data_fingerprint(ds));
    return buf;
}

void data_set_documents(data_set *ds, int32_t sep)
{
    ds->documents = 1;
    ds->sep = sep;
}

void data_close(data_set *ds)
{
    for (int i = 0; i < ds->nfiles; i++) {
        if (ds->files[i].fd >= 0) close(ds->files[i].fd);
        if (ds->files[i].mpath && ds->files[i].mfd >= 0) close(ds->files[i].mfd);
        free(ds->files[i].path);
        free(ds->files[i].mpath);
    }
    free(ds->files);
    free(ds->perm);
    free(ds->buf);
    memset(ds, 0, sizeof *ds);
}

void data_set_order(data_set *ds, int shuffle, uint64_t seed)
{
    ds->shuffle = shuffle;
    ds->seed = seed;
    ds->perm_epoch = -1;
}

static shard_status fill_seq(data_set *ds, uint64_t seq, int32_t *in, int32_t *tg)
{
    int lo = 0, hi = ds->nfiles - 1; /* the file holding seq: last with first_seq <= seq */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ds->files[mid].first_seq <= seq) lo = mid;
        else hi = mid - 1;
    }
    while (ds->files[lo].nseq == 0 || seq - ds->files[lo].first_seq >= ds->files[lo].nseq) lo++; /* skip empty files */
    const data_file *f = &ds->files[lo];
    const uint64_t start = (seq - f->first_seq) * (uint64_t)ds->S;
    const size_t n = (size_t)ds->S + 1, ts = (size_t)f->token_size;
    if (!ds->buf && !(ds->buf = malloc(n * 5))) return shard_fail(SHARD_E_NOMEM, "out of memory"); /* tokens, mask */
    uint8_t *mask = ds->buf + n * 4;
    shard_status s = shard_pread_full(f->fd, f->path, ds->buf, n * ts, 1024 + start * ts);
    if (!s) s = check_tokens(f, ds->buf, start, n); /* the file may have changed since it was opened */
    if (!s && f->mpath) s = read_mask_at(f, mask, n, start);
    for (int t = 0; t < ds->S && !s; t++) {
        in[t] = (int32_t)token_at(f, ds->buf + (size_t)t * ts);
        tg[t] = (int32_t)token_at(f, ds->buf + (size_t)(t + 1) * ts);
        if ((f->mpath && !mask[t + 1]) || (ds->documents && in[t] == ds->sep)) tg[t] = -1;
    }
    return s;
}

shard_status data_position_at(const data_set *ds, uint64_t p, int old_S, int sequential, uint64_t *out)
{
    uint64_t nold = 0, idx, at;
    for (int i = 0; i < ds->nfiles; i++) nold += seqs_in(ds->files[i].ntokens, old_S);
    *out = p;
    if (old_S == ds->S || nold == 0) return SHARD_OK;
    const uint64_t epoch = p / nold;
    idx = p % nold;
    if (sequential) {
        int f = 0;
        for (; idx >= seqs_in(ds->files[f].ntokens, old_S); f++) idx -= seqs_in(ds->files[f].ntokens, old_S);
        const data_file *df = &ds->files[f];
        const uint64_t k = (idx * (uint64_t)old_S + (uint64_t)ds->S - 1) / (uint64_t)ds->S; /* no target twice */
        at = df->first_seq + (k < df->nseq ? k : df->nseq);
    } else {
        at = (uint64_t)(((unsigned __int128)idx * ds->nseq + nold - 1) / nold);
    }
    if (epoch > ((uint64_t)DATA_COUNTER_MAX - at) / ds->nseq)
        return shard_fail(SHARD_E_INVALID, "data position %llu at %d tokens a sequence is past the counters' range at %d",
                          (unsigned long long)p, old_S, ds->S);
    *out = epoch * ds->nseq + at;
    return SHARD_OK;
}

shard_status data_fill(data_set *ds, uint64_t first, int count, int32_t *inputs, int32_t *targets)
{
    for (int r = 0; r < count; r++) {
        uint64_t p = first + (uint64_t)r, epoch = p / ds->nseq, idx = p % ds->nseq;
        uint64_t seq = idx;
        if (ds->shuffle) {
            if (ds->perm_epoch != (int64_t)epoch) {
                if (!ds->perm) {
                    ds->perm = malloc(ds->nseq * sizeof *ds->perm);
                    if (!ds->perm) return shard_fail(SHARD_E_NOMEM, "out of memory for the order of %llu sequences",
                                                     (unsigned long long)ds->nseq);
                }
                rng_state rs;
                rng_seed(&rs, ds->seed, epoch);
                for (uint64_t i = 0; i < ds->nseq; i++) ds->perm[i] = i;
                for (uint64_t i = ds->nseq - 1; i > 0; i--) { /* Fisher-Yates */
                    uint64_t j = rng_below(&rs, i + 1), t = ds->perm[i];
                    ds->perm[i] = ds->perm[j];
                    ds->perm[j] = t;
                }
                ds->perm_epoch = (int64_t)epoch;
            }
            seq = ds->perm[idx];
        }
        shard_status s = fill_seq(ds, seq, inputs + (size_t)r * ds->S, targets + (size_t)r * ds->S);
        if (s) return s;
    }
    return SHARD_OK;
}

shard_status data_fill_sequential(data_set *ds, uint64_t first_seq, int count, int32_t *inputs, int32_t *targets)
{
    shard_status s = SHARD_OK;
    for (int r = 0; r < count && !s; r++)
        s = fill_seq(ds, (first_seq + (uint64_t)r) % ds->nseq, inputs + (size_t)r * ds->S, targets + (size_t)r * ds->S);
    return s;
}
