/* Verifying a whole checkpoint (smp-verify): each file is read once, front to back, by
 * one of the checkpoint's threads. Its bytes go through the file's checksum; those that
 * are a chunk are decoded there, checked against the chunk's XXH3 and folded into
 * their piece's XXH64, so that no byte is read twice. */
#include "ckpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GAP_BLOCK (4u << 20)
/* pieces looked up per hold of the checkpoint's lock: a file of 9000 small pieces,
 * each locked alone, cost 2 threads more than one (HDF5's work is serial either way) */
#define PREPARE_RUN 256

typedef struct {
    uint64_t addr, size, k;
    size_t ref; /* which of the file's pieces */
} located;

typedef struct {
    tensor *t;
    piece *p;
    shard_xxh64_state h;
    uint64_t next_k; /* chunks folded into h so far, in order */
    int out_of_order;
} piece_ref;

typedef struct {
    shard_ckpt *c;
    size_t *first, *refs; /* file fi's pieces: refs[first[fi] .. first[fi + 1]), as tensor * 2^32 + piece */
    size_t next_file;     /* atomic */
    uint64_t total;       /* atomic */
} verify_job;

static int by_addr(const void *a, const void *b)
{
    uint64_t x = ((const located *)a)->addr, y = ((const located *)b)->addr;
    return x < y ? -1 : x > y;
}

/* Every chunk of the file's pieces, in file order. */
static shard_status locate_all(shard_ckpt *c, piece_ref *refs, size_t nref, located **out, size_t *nout)
{
    size_t n = 0;
    for (size_t r0 = 0; r0 < nref; r0 += PREPARE_RUN) { /* the lock taken once per run of pieces */
        shard_status s = SHARD_OK;
        pthread_mutex_lock(&c->mu);
        for (size_t r = r0; r < nref && r < r0 + PREPARE_RUN && !s; r++) s = ckpt_prepare_locked(c, refs[r].t, refs[r].p, 1);
        pthread_mutex_unlock(&c->mu);
        if (s) return s;
    }
    for (size_t r = 0; r < nref; r++) n += refs[r].p->ix->g.nchunks;
    located *l = malloc((n + 1) * sizeof *l);
    if (!l) return shard_fail(SHARD_E_NOMEM, "out of memory");
    size_t i = 0;
    for (size_t r = 0; r < nref; r++)
        for (uint64_t k = 0; k < refs[r].p->ix->g.nchunks; k++)
            l[i++] = (located){refs[r].p->ix->loc[k].addr, refs[r].p->ix->loc[k].size, k, r};
    qsort(l, n, sizeof *l, by_addr);
    *out = l;
    *nout = n;
    return SHARD_OK;
}

/* The walk through one shard file. */
static shard_status walk_file(shard_ckpt *c, size_t fi, piece_ref *refs, const located *l, size_t n, const char *path)
{
    shard_fhash_state fh;
    uint8_t *gap = malloc(GAP_BLOCK);
    scratch *s = ckpt_scratch_get(c);
    shard_status st = gap && s ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    const int fd = c->fd[fi];
    uint64_t pos = 0;
    shard_fhash_reset(&fh, c->file_hash_kind);
    for (size_t i = 0; i < n && !st; i++) {
        piece_ref *r = &refs[l[i].ref];
        if (l[i].addr < pos) { st = shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: chunks overlap", path, r->p->dataset); break; }
        if ((st = shard_fd_hash_range(fd, path, pos, l[i].addr, gap, GAP_BLOCK, &fh))) break; /* HDF5's metadata */
        const uint8_t *stored;
        const int in_order = l[i].k == r->next_k; /* else check_pieces hashes the piece again */
        if ((st = ckpt_chunk_check(c, r->p, l[i].k, s, &stored, in_order ? &r->h : NULL))) break;
        shard_fhash_update(&fh, stored, l[i].size);
        if (in_order) r->next_k++;
        else r->out_of_order = 1;
        pos = l[i].addr + l[i].size;
    }
    if (!st) st = shard_fd_hash_range(fd, path, pos, c->file_bytes[fi], gap, GAP_BLOCK, &fh);
    if (!st && shard_fhash_digest(&fh) != c->file_hash[fi]) st = shard_fail(SHARD_E_CORRUPT, "%s: checksum mismatch (file damaged)", path);
    free(gap);
    ckpt_scratch_put(c, s);
    return st;
}

/* The pieces' own checksums, once the walk has folded their chunks in. */
static shard_status check_pieces(shard_ckpt *c, piece_ref *refs, size_t nref, const char *path)
{
    for (size_t r = 0; r < nref; r++) {
        piece *p = refs[r].p;
        if (refs[r].out_of_order || refs[r].next_k != p->ix->g.nchunks) {
            shard_status s = ckpt_verify_piece(c, p); /* chunks not in order in the file: a second pass */
            if (s) return s;
            continue;
        }
        if (shard_xxh64_digest(&refs[r].h) != p->xxh64)
            return shard_fail(SHARD_E_CORRUPT, "%s: dataset %s: checksum mismatch (stored %016llx, read %016llx)", path, p->dataset,
                              (unsigned long long)p->xxh64, (unsigned long long)shard_xxh64_digest(&refs[r].h));
        __atomic_store_n(&p->verified, 1, __ATOMIC_RELEASE);
    }
    return SHARD_OK;
}

static shard_status verify_shard_file(verify_job *j, size_t fi, const char *path)
{
    shard_ckpt *c = j->c;
    size_t nref = j->first[fi + 1] - j->first[fi];
    piece_ref *refs = calloc(nref + 1, sizeof *refs);
    located *l = NULL;
    size_t n = 0;
    shard_status s = refs ? ckpt_open_file(c, fi) : shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t r = 0; r < nref && !s; r++) {
        size_t code = j->refs[j->first[fi] + r];
        refs[r].t = &c->t[code >> 32];
        refs[r].p = &refs[r].t->p[code & 0xffffffffu];
        shard_xxh64_reset(&refs[r].h);
    }
    if (!s) s = locate_all(c, refs, nref, &l, &n);
    if (!s) s = walk_file(c, fi, refs, l, n, path);
    if (!s) s = check_pieces(c, refs, nref, path);
    free(refs);
    free(l);
    return s;
}

shard_status ckpt_check_extra(const shard_ckpt *c, size_t fi, const char *path)
{
    int fd;
    uint64_t size, h, n;
    shard_status s = shard_open_regular(path, 1, &fd, &size);
    if (s) return s;
    if (size != c->file_bytes[fi]) /* before reading: a huge or endless file is not read */
        s = shard_fail(SHARD_E_CORRUPT, "%s: %llu bytes, the manifest says %llu", path, (unsigned long long)size, (unsigned long long)c->file_bytes[fi]);
    if (!s) s = shard_fd_hash(fd, path, c->file_hash_kind, &h, &n);
    close(fd);
    if (!s && (n != c->file_bytes[fi] || h != c->file_hash[fi])) s = shard_fail(SHARD_E_CORRUPT, "%s: checksum mismatch (file damaged)", path);
    return s;
}

shard_status shard_ckpt_check_extra(const shard_ckpt *c, size_t i)
{
    if (i >= c->nextras) return shard_fail(SHARD_E_USAGE, "%s: no extra file %zu", c->dir, i);
    char path[4200];
    ckpt_file_path(c, c->extra_file[i], path, sizeof path);
    return ckpt_check_extra(c, c->extra_file[i], path);
}

static shard_status verify_worker(void *arg, int worker)
{
    (void)worker;
    verify_job *j = arg;
    shard_ckpt *c = j->c;
    for (;;) {
        size_t fi = __atomic_fetch_add(&j->next_file, 1, __ATOMIC_RELAXED);
        if (fi >= c->nfiles) return SHARD_OK;
        char path[4200];
        ckpt_file_path(c, fi, path, sizeof path);
        shard_status s;
        if (!strncmp(c->files[fi], "extra/", 6)) {
            s = ckpt_check_extra(c, fi, path);
        } else {
            s = verify_shard_file(j, fi, path);
        }
        if (s) { __atomic_store_n(&j->next_file, c->nfiles, __ATOMIC_RELAXED); return s; }
        __atomic_add_fetch(&j->total, c->file_bytes[fi], __ATOMIC_RELAXED);
    }
}

shard_status shard_ckpt_verify(shard_ckpt *c, uint64_t *bytes_checked)
{
    /* the pieces of each file (bucketed once: not a scan of every piece per file) */
    verify_job j = {.c = c};
    size_t np = 0;
    for (size_t i = 0; i < c->n; i++) np += c->t[i].t.npieces;
    j.first = calloc(c->nfiles + 2, sizeof *j.first);
    j.refs = malloc((np + 1) * sizeof *j.refs);
    if (!j.first || !j.refs) { free(j.first); free(j.refs); return shard_fail(SHARD_E_NOMEM, "out of memory"); }
    for (size_t i = 0; i < c->n; i++)
        for (size_t q = 0; q < c->t[i].t.npieces; q++) j.first[c->t[i].p[q].file_index + 2]++;
    for (size_t f = 0; f < c->nfiles; f++) j.first[f + 2] += j.first[f + 1];
    for (size_t i = 0; i < c->n; i++)
        for (size_t q = 0; q < c->t[i].t.npieces; q++) j.refs[j.first[c->t[i].p[q].file_index + 1]++] = (i << 32) | q;
    int th = c->threads < (int)c->nfiles ? c->threads : (int)c->nfiles;
    shard_status s = ckpt_parallel(th, verify_worker, &j);
    free(j.first);
    free(j.refs);
    if (!s && bytes_checked) *bytes_checked = j.total;
    return s;
}
