/* train/data.c: llm.c token files and the global order of sequences (data.h). */
#include "data.h"

#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
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

/* ------------------------------------------------------- checking whole files */
typedef shard_status (*scan_check)(const data_file *f, const uint8_t *buf, uint64_t i0, size_t n);
static shard_status check_mask(const data_file *f, const uint8_t *m, uint64_t i0, size_t n);

enum { SCAN_BLOCK = 1 << 20 };

/* One file of a scan: count elements of es bytes after fd's 1024-byte header */
typedef struct {
    data_file *f;
    int fd;
    const char *path;
    size_t es;
    uint64_t count, per; /* elements; elements a block */
    uint64_t first, nb;  /* its first block in the scan's list; its blocks */
} scan_file;

/* A scan of every file's blocks, one list in file order, shared by the process's
 * OpenMP threads and split over the ranks of a host */
typedef struct {
    scan_file *sf;
    int nf;
    scan_check check;
    uint64_t nb;         /* blocks in all */
    uint64_t *bh;        /* each block's hash (0 where another rank hashed it) */
    uint64_t bad;        /* the first failing block (nb: none) */
    shard_status bad_s;  /* its failure and message */
    char msg[1024];
} scan_job;

/* the file of block b (the last whose first block is at most b) */
static const scan_file *file_of(const scan_job *j, uint64_t b)
{
    int lo = 0, hi = j->nf - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (j->sf[mid].first <= b) lo = mid;
        else hi = mid - 1;
    }
    return &j->sf[lo];
}

static uint64_t checked_bytes; /* read by this process's scans so far: data_checked_bytes */

uint64_t data_checked_bytes(const void *unused)
{
    (void)unused;
    return __atomic_load_n(&checked_bytes, __ATOMIC_RELAXED);
}

/* Block b read into buf, checked and hashed; a failure's status and message kept when it
 * is the earliest block's yet. */
static void scan_block(scan_job *j, uint8_t *buf, uint64_t b)
{
    const scan_file *f = file_of(j, b);
    const uint64_t i0 = (b - f->first) * f->per;
    const size_t n = f->count - i0 < f->per ? (size_t)(f->count - i0) : (size_t)f->per;
    shard_status s = buf ? shard_pread_full(f->fd, f->path, buf, n * f->es, 1024 + i0 * f->es)
                         : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (!s) s = j->check(f->f, buf, i0, n);
    if (!s) {
        j->bh[b] = shard_hash64(0, buf, n * f->es);
        __atomic_fetch_add(&checked_bytes, n * f->es, __ATOMIC_RELAXED);
        return;
    }
    #pragma omp critical(data_scan_fail)
    if (b < j->bad) {
        __atomic_store_n(&j->bad, b, __ATOMIC_RELAXED);
        j->bad_s = s;
        snprintf(j->msg, sizeof j->msg, "%s", shard_errmsg()); /* the message is this thread's */
    }
}

/* Blocks [lo, hi) of the list, by the process's threads */
static void scan_blocks(scan_job *j, uint64_t lo, uint64_t hi)
{
    #pragma omp parallel if (hi - lo > 1)
    {
        uint8_t *buf = malloc(SCAN_BLOCK);
        #pragma omp for schedule(dynamic, 4)
        for (uint64_t b = lo; b < hi; b++)
            if (b < __atomic_load_n(&j->bad, __ATOMIC_RELAXED)) scan_block(j, buf, b); /* past a failure: no need */
        free(buf);
    }
}

/* The ranks of the host (collective over it) learn whether one failed, then every
 * block's hash. A rank that failed returns its failure, the others one that says
 * another rank failed (shard_err_secondhand): the lowest failing rank's line, its
 * run's blocks being the earliest, is the run's. */
static shard_status scan_gather(scan_job *j, shard_comm *host)
{
    shard_status s = j->bad < j->nb ? shard_fail(j->bad_s, "%s", j->msg) : SHARD_OK;
    s = shard_comm_agree(host, s, "another rank of this host found a fault in these files", NULL);
    return s ? s : shard_comm_allreduce(host, j->bh, j->nb, SHARD_DT_U64, SHARD_OP_SUM);
}

/* Whether every rank of host opened the very same files (device and inode, in the
 * same order; what sizes they have follows): only then may they split the blocks and
 * trust each other's hashes. Ranks of one host given other copies (an MPMD launch,
 * or paths that name copies) each read their files whole, and the ranks' agreement
 * on the fingerprints (shard_agree_check) compares the copies. Collective over host. */
static shard_status same_files(shard_comm *host, const scan_job *j, int *same)
{
    uint64_t h = shard_hash64(0, &j->nb, sizeof j->nb);
    for (int i = 0; i < j->nf; i++) {
        struct stat st;
        if (fstat(j->sf[i].fd, &st)) memset(&st, 0, sizeof st); /* its reading says why */
        const uint64_t id[3] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino, j->sf[i].count};
        h = shard_hash64(h, id, sizeof id);
    }
    uint64_t both[2] = {h, ~h}; /* the largest of each: all equal exactly when both are h's */
    shard_status s = shard_comm_allreduce(host, both, 2, SHARD_DT_U64, SHARD_OP_MAX);
    *same = !s && both[0] == h && both[1] == ~h;
    return s;
}

/* The files' elements checked by check and hashed a block of 1 MiB at a time, the
 * blocks of all files in one list split in contiguous runs over the ranks of host
 * (NULL: this process alone) and each run over the process's OpenMP threads: a host
 * reads tens of GB once, at the speed of its storage, not once per rank. hash(f, h):
 * file f's hash, shard_hash64 of its blocks' shard_hash64s in order. A failure is the
 * first block's in file order, the message as one thread would have found it. */
static shard_status scan(scan_file *sf, int nf, scan_check check, shard_comm *host,
                         void (*hash)(scan_file *f, uint64_t h))
{
    scan_job j = {.sf = sf, .nf = nf, .check = check};
    for (int i = 0; i < nf; i++) {
        sf[i].per = SCAN_BLOCK / sf[i].es;
        sf[i].first = j.nb;
        sf[i].nb = (sf[i].count + sf[i].per - 1) / sf[i].per;
        j.nb += sf[i].nb;
    }
    j.bad = j.nb;
    int n = host ? shard_comm_size(host) : 1, r = host ? shard_comm_rank(host) : 0, same = 1;
    shard_status s = (j.bh = calloc(j.nb ? j.nb : 1, sizeof *j.bh)) ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    if (n > 1) s = shard_comm_agree(host, s, "another process ran out of memory", NULL);
    if (n > 1 && !s) s = same_files(host, &j, &same);
    if (!same) n = 1, r = 0; /* each its own files, whole */
    if (!s) {
        scan_blocks(&j, j.nb * (uint64_t)r / (uint64_t)n, j.nb * (uint64_t)(r + 1) / (uint64_t)n);
        s = n > 1 ? scan_gather(&j, host) : j.bad < j.nb ? shard_fail(j.bad_s, "%s", j.msg) : SHARD_OK;
    }
    for (int i = 0; !s && i < nf; i++) /* little-endian only (max_token_*) */
        hash(&sf[i], shard_hash64(0, j.bh + sf[i].first, sf[i].nb * sizeof *j.bh));
    free(j.bh);
    return s;
}

/* fd's file as it is now (size: the one opening it read), its hash not yet known */
static void stamp_of(int fd, uint64_t size, data_stamp *st)
{
    struct stat s;
    memset(st, 0, sizeof *st);
    st->size = size;
    if (fstat(fd, &s)) return; /* an inode 0 matches no record: read */
    st->ino = (uint64_t)s.st_ino;
    st->ctime_ns = (int64_t)s.st_ctim.tv_sec * 1000000000 + s.st_ctim.tv_nsec;
    st->mtime_ns = (int64_t)s.st_mtim.tv_sec * 1000000000 + s.st_mtim.tv_nsec;
}

static uint64_t ino_of(const data_seen *r, int mask)
{
    return mask ? r->mask.ino : r->tok.ino;
}

static int by_tok_ino(const void *a, const void *b)
{
    const uint64_t x = ino_of(*(const data_seen *const *)a, 0), y = ino_of(*(const data_seen *const *)b, 0);
    return (x > y) - (x < y);
}

static int by_mask_ino(const void *a, const void *b)
{
    const uint64_t x = ino_of(*(const data_seen *const *)a, 1), y = ino_of(*(const data_seen *const *)b, 1);
    return (x > y) - (x < y);
}

/* ds->seen's records, sorted by the inode of their token file (mask 0) or mask file
 * (mask 1; records without one left out), for seen_as: a data set of 100,000 files
 * would otherwise compare 10^10 pairs. NULL with *n 0 when there are none (or no memory:
 * every file is then read). */
static const data_seen **seen_sorted(const data_set *ds, int mask, int *n)
{
    const data_seen **v = ds->nseen ? malloc((size_t)ds->nseen * sizeof *v) : NULL;
    *n = 0;
    for (int i = 0; v && i < ds->nseen; i++)
        if (!mask || ds->seen[i].has_mask) v[(*n)++] = &ds->seen[i];
    if (v) qsort(v, (size_t)*n, sizeof *v, mask ? by_mask_ino : by_tok_ino);
    return v;
}

/* the record of v[n] (seen_sorted's) that matches st (a token file's, or a mask
 * file's), or NULL */
static const data_seen *seen_as(const data_set *ds, const data_seen **v, int n, const data_stamp *st, int mask)
{
    int lo = 0, hi = n; /* the first whose inode is st's or above */
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (ino_of(v[mid], mask) < st->ino) lo = mid + 1;
        else hi = mid;
    }
    for (; st->ino && lo < n && ino_of(v[lo], mask) == st->ino; lo++) {
        const data_seen *r = v[lo];
        const data_stamp *x = mask ? &r->mask : &r->tok;
        if ((mask || r->vocab <= ds->vocab) && x->size == st->size && x->ctime_ns == st->ctime_ns &&
            x->mtime_ns == st->mtime_ns)
            return r;
    }
    return NULL;
}

/* Descriptors kept free after the data files' for what opens later (the checkpoint's
 * files, MPI's and NCCL's). */
#define FD_SPARE 64

/* After opening descriptor fd for path: room for FD_SPARE more. A data set keeps one
 * descriptor per token file and one per mask file (their identity checked at open,
 * then read by pread), and llm.c-style data sets come in a thousand shards or more,
 * past the soft limit of 1024 that most systems set: the soft limit is raised toward
 * the hard one (doubled each time); where the hard limit leaves no room, refused,
 * saying which limit. */
static shard_status fd_room(const char *path, int fd)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) || r.rlim_cur == RLIM_INFINITY || (rlim_t)fd + FD_SPARE < r.rlim_cur)
        return SHARD_OK;
    rlim_t want = r.rlim_cur * 2 > (rlim_t)fd + FD_SPARE ? r.rlim_cur * 2 : (rlim_t)fd + FD_SPARE + 1;
    if (r.rlim_max != RLIM_INFINITY && want > r.rlim_max) want = r.rlim_max;
    if (want > r.rlim_cur) {
        struct rlimit w = {want, r.rlim_max};
        if (!setrlimit(RLIMIT_NOFILE, &w)) r.rlim_cur = want;
    }
    if ((rlim_t)fd + FD_SPARE < r.rlim_cur) return SHARD_OK;
    return shard_fail(SHARD_E_IO,
                      "%s: too many files: descriptor %d of at most %llu open files (`ulimit -n`; its hard limit is "
                      "%llu), with %d kept for the checkpoint and MPI: raise the limit, or join the token files into fewer",
                      path, fd, (unsigned long long)r.rlim_cur,
                      (unsigned long long)(r.rlim_max == RLIM_INFINITY ? r.rlim_cur : r.rlim_max), FD_SPARE);
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
    if (s || (s = fd_room(path, f->fd))) return s;
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
    stamp_of(f->fd, size, &f->stamp);
    f->nseq = seqs_in(f->ntokens, S);
    return SHARD_OK;
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

static void token_hash(scan_file *f, uint64_t h)
{
    f->f->hash = f->f->stamp.hash = h;
}

static void mask_hash(scan_file *f, uint64_t h)
{
    f->f->mstamp.hash = h;
    f->f->hash = shard_hash64(f->f->hash, &h, sizeof h); /* the tokens', then the mask's */
}

/* Every token of every file against the vocabulary (mask 0) or every mask byte 0 or 1
 * (mask 1), and hashed (scan), but in files a record has seen as they are */
static shard_status scan_files(data_set *ds, int mask)
{
    scan_file *sf = calloc((size_t)ds->nfiles, sizeof *sf);
    if (!sf) return shard_fail(SHARD_E_NOMEM, "out of memory");
    void (*const hash)(scan_file *, uint64_t) = mask ? mask_hash : token_hash;
    int n = 0, nv;
    const data_seen **v = seen_sorted(ds, mask, &nv);
    for (int i = 0; i < ds->nfiles; i++) {
        data_file *f = &ds->files[i];
        const data_seen *r = seen_as(ds, v, nv, mask ? &f->mstamp : &f->stamp, mask);
        int *seen = mask ? &f->mseen : &f->seen;
        if ((*seen = r != NULL)) hash(&(scan_file){.f = f}, mask ? r->mask.hash : r->tok.hash);
        else if (mask) sf[n++] = (scan_file){.f = f, .fd = f->mfd, .path = f->mpath, .es = 1, .count = f->ntokens};
        else sf[n++] = (scan_file){.f = f, .fd = f->fd, .path = f->path, .es = (size_t)f->token_size, .count = f->ntokens};
    }
    shard_status s = scan(sf, n, mask ? check_mask : check_tokens, ds->host, hash);
    free(sf);
    free(v);
    return s;
}

uint64_t data_seen_bytes(const data_set *ds)
{
    uint64_t n = 0;
    for (int i = 0; i < ds->nfiles; i++) {
        const data_file *f = &ds->files[i];
        n += (f->seen ? f->ntokens * (uint64_t)f->token_size : 0) + (f->mseen ? f->ntokens : 0);
    }
    return n;
}

shard_status data_open_on(data_set *ds, const char *spec, int S, int64_t vocab, const data_open_opts *o)
{
    memset(ds, 0, sizeof *ds);
    ds->S = S;
    ds->vocab = vocab;
    ds->perm_epoch = -1;
    if (o) {
        ds->host = o->host && shard_comm_size(o->host) > 1 ? o->host : NULL;
        ds->seen = o->seen;
        ds->nseen = o->seen ? o->nseen : 0;
    }
    if (S < 1) return shard_fail(SHARD_E_USAGE, "the sequence length must be at least 1");
    shard_status s = each_path(spec, add_path, ds);
    if (!s && ds->nfiles == 0) s = shard_fail(SHARD_E_USAGE, "no token file given");
    if (!s) s = scan_files(ds, 0);
    if (!s && ds->nseq == 0)
        s = shard_fail(SHARD_E_INVALID, "%s: fewer than %d tokens in every file: no sequence of length %d + 1", spec, S + 1, S);
    if (s) data_close(ds);
    return s;
}

shard_status data_open(data_set *ds, const char *spec, int S, int64_t vocab)
{
    return data_open_on(ds, spec, S, vocab, NULL);
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
    if (s || (s = fd_room(path, f->mfd))) return s;
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
    stamp_of(f->mfd, size, &f->mstamp);
    return SHARD_OK;
}

shard_status data_open_masks(data_set *ds, const char *spec)
{
    mask_walk w = {ds, 0};
    shard_status s = each_path(spec, add_mask, &w);
    if (!s && w.next != ds->nfiles)
        s = shard_fail(SHARD_E_USAGE, "%s: %d loss mask files for %d token files (one per token file, in the same order)",
                       spec, w.next, ds->nfiles);
    if (!s) s = scan_files(ds, 1);
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

/* Fisher-Yates over perm[0, n) of type T (the identity first), j drawn from rs for i =
 * n-1 down to 1. The draws depend on the generator alone, so a block of them is drawn
 * first and the entries they swap prefetched, then swapped in order: the same
 * permutation, with the block's cache misses in flight together (one at a time, 125 M
 * sequences took 4.3 s). */
enum { SHUFFLE_AHEAD = 32 };
#define SHUFFLE_OF(T)                                                                                                  \
    static void shuffle_##T(T *perm, uint64_t n, rng_state *rs)                                                      \
    {                                                                                                                  \
        uint64_t js[SHUFFLE_AHEAD];                                                                                   \
        for (uint64_t i = 0; i < n; i++) perm[i] = (T)i;                                                               \
        for (uint64_t i = n ? n - 1 : 0; i > 0;) {                                                                     \
            const uint64_t m = i < SHUFFLE_AHEAD ? i : SHUFFLE_AHEAD;                                                 \
            for (uint64_t k = 0; k < m; k++) {                                                                         \
                js[k] = rng_below(rs, i - k + 1);                                                                      \
                __builtin_prefetch(&perm[js[k]], 1);                                                                   \
            }                                                                                                          \
            for (uint64_t k = 0; k < m; k++, i--) {                                                                    \
                const T t = perm[i];                                                                                   \
                perm[i] = perm[js[k]];                                                                                 \
                perm[js[k]] = t;                                                                                       \
            }                                                                                                          \
        }                                                                                                              \
    }
SHUFFLE_OF(uint32_t)
SHUFFLE_OF(uint64_t)

/* epoch's permutation in ds->perm: 4-byte entries while the indices fit (half the memory) */
static shard_status permute(data_set *ds, uint64_t epoch)
{
    const int wide = ds->nseq > (uint64_t)UINT32_MAX + 1;
    if (!ds->perm && !(ds->perm = malloc(ds->nseq * (wide ? sizeof(uint64_t) : sizeof(uint32_t)))))
        return shard_fail(SHARD_E_NOMEM, "out of memory for the order of %llu sequences", (unsigned long long)ds->nseq);
    rng_state rs;
    rng_seed(&rs, ds->seed, epoch);
    if (wide) shuffle_uint64_t(ds->perm, ds->nseq, &rs);
    else shuffle_uint32_t(ds->perm, ds->nseq, &rs);
    ds->perm_epoch = (int64_t)epoch;
    return SHARD_OK;
}

shard_status data_fill(data_set *ds, uint64_t first, int count, int32_t *inputs, int32_t *targets)
{
    for (int r = 0; r < count; r++) {
        uint64_t p = first + (uint64_t)r, epoch = p / ds->nseq, idx = p % ds->nseq;
        uint64_t seq = idx;
        if (ds->shuffle) {
            shard_status s = ds->perm_epoch != (int64_t)epoch ? permute(ds, epoch) : SHARD_OK;
            if (s) return s;
            seq = ds->nseq > (uint64_t)UINT32_MAX + 1 ? ((const uint64_t *)ds->perm)[idx] : ((const uint32_t *)ds->perm)[idx];
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
