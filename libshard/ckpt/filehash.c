/* Whole-file checksums; a shard writer's record of the blocks it hashed from memory;
 * and the note it leaves beside a file it closed, so that the commit does not read it
 * again. */
#include "../core/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HASH_BUF (256u << 10) /* read a piece at a time that stays in the core's cache */

shard_status shard_fd_hash_range(int fd, const char *path, uint64_t from, uint64_t to, void *buf, size_t cap,
                                 shard_fhash_state *h)
{
    while (from < to) {
        size_t n = to - from < cap ? (size_t)(to - from) : cap;
        ssize_t r = pread(fd, buf, n, (off_t)from);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return shard_fail(SHARD_E_IO, "%s: read failed: %s", path, strerror(errno));
        if (r == 0) return shard_fail(SHARD_E_CORRUPT, "%s: truncated", path);
        shard_fhash_update(h, buf, (size_t)r);
        from += (uint64_t)r;
    }
    return SHARD_OK;
}

shard_status shard_fd_hash(int fd, const char *path, shard_fhash_kind kind, uint64_t *hash, uint64_t *bytes)
{
    shard_fhash_state h;
    char *buf = malloc(HASH_BUF);
    if (!buf) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_fhash_reset(&h, kind);
    uint64_t total = 0;
    shard_status s = SHARD_OK;
    for (;;) {
        ssize_t r = pread(fd, buf, HASH_BUF, (off_t)total);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { s = shard_fail(SHARD_E_IO, "%s: read failed: %s", path, strerror(errno)); break; }
        if (r == 0) break;
        shard_fhash_update(&h, buf, (size_t)r);
        total += (uint64_t)r;
    }
    *hash = shard_fhash_digest(&h);
    *bytes = total;
    free(buf);
    return s;
}

shard_status shard_file_hash(const char *path, shard_fhash_kind kind, uint64_t *hash, uint64_t *bytes)
{
    int fd;
    uint64_t size;
    shard_status s = shard_open_regular(path, 1, &fd, &size); /* a file of a checkpoint: no links */
    if (s) return s;
    s = shard_fd_hash(fd, path, kind, hash, bytes);
    close(fd);
    return s;
}

/* ------------------------------------------------------ the writer's block map */
void shard_blockmap_init(shard_blockmap *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void shard_blockmap_free(shard_blockmap *m)
{
    free(m->dig);
    free(m->known);
    pthread_mutex_destroy(&m->mu);
    memset(m, 0, sizeof *m);
}

/* room for blocks [0, n) (m->mu held); 0 when there is none (then nothing is kept) */
static int blockmap_grow(shard_blockmap *m, uint64_t n)
{
    if (n <= m->cap) return 1;
    uint64_t cap = m->cap ? m->cap : 1024;
    while (cap < n) cap *= 2;
    uint64_t *d = realloc(m->dig, cap * sizeof *d);
    if (d) m->dig = d;
    uint8_t *k = d ? realloc(m->known, cap) : NULL;
    if (!k) return 0;
    memset(k + m->cap, 0, cap - m->cap);
    m->known = k;
    m->cap = cap;
    return 1;
}

#define RECORD_BATCH 256 /* digests computed outside the lock, then stored under it */

void shard_blockmap_record(shard_blockmap *m, uint64_t at, const void *buf, size_t n)
{
    const uint64_t B = SHARD_FHASH_BLOCK;
    uint64_t b = (at + B - 1) / B, end = (at + n) / B; /* the blocks wholly inside */
    uint64_t d[RECORD_BATCH];
    while (b < end) {
        uint64_t k = end - b < RECORD_BATCH ? end - b : RECORD_BATCH;
        for (uint64_t i = 0; i < k; i++) d[i] = shard_xxh3((const uint8_t *)buf + ((b + i) * B - at), B);
        pthread_mutex_lock(&m->mu);
        if (blockmap_grow(m, b + k)) {
            memcpy(m->dig + b, d, k * sizeof *d);
            memset(m->known + b, 1, k);
        }
        pthread_mutex_unlock(&m->mu);
        b += k;
    }
}

shard_status shard_blockmap_finish(shard_blockmap *m, int fd, const char *path, uint64_t *hash, uint64_t *bytes)
{
    struct stat st;
    if (fstat(fd, &st) != 0) return shard_fail(SHARD_E_IO, "%s: cannot stat: %s", path, strerror(errno));
    const uint64_t size = (uint64_t)st.st_size, B = SHARD_FHASH_BLOCK, nb = (size + B - 1) / B;
    char *buf = malloc(HASH_BUF);
    if (!buf) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_fhash_state h;
    shard_fhash_reset(&h, SHARD_FHASH_XXH3_BLOCKS);
    shard_status s = SHARD_OK;
    for (uint64_t b = 0; b < nb && !s;) {
        if (b < m->cap && m->known[b] && (b + 1) * B <= size) { shard_fhash_add_digest(&h, m->dig[b++]); continue; }
        uint64_t e = b + 1; /* a run of blocks to read, whole blocks but the file's last */
        while (e < nb && (e - b) * B < HASH_BUF && !(e < m->cap && m->known[e])) e++;
        s = shard_fd_hash_range(fd, path, b * B, e * B < size ? e * B : size, buf, HASH_BUF, &h);
        b = e;
    }
    *hash = shard_fhash_digest(&h);
    *bytes = size;
    free(buf);
    return s;
}

/* "<hash> <bytes> <inode> <mtime s> <mtime ns>\n". Not the device: under mpirun on a
 * shared file system, the committing process may see another device number for the
 * same file than the writer did (the inode and times are the file's own). */
static char *note_path(const char *path)
{
    char *n = malloc(strlen(path) + 8);
    if (n) sprintf(n, "%s.fhash", path);
    return n;
}

shard_status shard_file_hash_note(const char *path, int fd, uint64_t hash, uint64_t bytes, const char *pieces, size_t n)
{
    struct stat st;
    char *np = note_path(path);
    if (!np) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_status s = SHARD_OK;
    FILE *f = NULL;
    if (fstat(fd, &st) != 0 || !(f = fopen(np, "w")) ||
        fprintf(f, "%016" PRIx64 " %" PRIu64 " %" PRIu64 " %lld %ld\n", hash, bytes, (uint64_t)st.st_ino,
                (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec) < 0 ||
        (n && fwrite(pieces, 1, n, f) != n))
        s = shard_fail(SHARD_E_IO, "%s: cannot write: %s", np, strerror(errno));
    if (f && fclose(f) != 0 && !s) s = shard_fail(SHARD_E_IO, "%s: cannot write: %s", np, strerror(errno));
    if (s) unlink(np);
    free(np);
    return s;
}

/* path's note, open past its first line, when it still describes the file (else NULL) */
static FILE *open_note(const char *path, uint64_t *hash, uint64_t *bytes)
{
    char *np = note_path(path);
    FILE *f = np ? fopen(np, "r") : NULL;
    free(np);
    uint64_t h, n, ino;
    long long sec;
    long nsec;
    struct stat st;
    int ok = f && fscanf(f, "%16" SCNx64 " %" SCNu64 " %" SCNu64 " %lld %ld", &h, &n, &ino, &sec, &nsec) == 5 &&
             fgetc(f) == '\n' && stat(path, &st) == 0 && (uint64_t)st.st_size == n && (uint64_t)st.st_ino == ino &&
             (long long)st.st_mtim.tv_sec == sec && (long)st.st_mtim.tv_nsec == nsec;
    if (!ok) {
        if (f) fclose(f);
        return NULL;
    }
    *hash = h;
    *bytes = n;
    return f;
}

int shard_file_hash_noted(const char *path, uint64_t *hash, uint64_t *bytes)
{
    FILE *f = open_note(path, hash, bytes);
    if (f) fclose(f);
    char *np = note_path(path);
    if (np) unlink(np);
    free(np);
    return f != NULL;
}

char *shard_file_note_pieces(const char *path, size_t *n)
{
    uint64_t hash, bytes;
    FILE *f = open_note(path, &hash, &bytes);
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0, got = 1;
    char *buf = malloc(cap);
    while (buf && got) {
        if (cap - len < 2) {
            char *grown = realloc(buf, cap * 2);
            if (!grown) { free(buf); buf = NULL; break; }
            buf = grown;
            cap *= 2;
        }
        got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
    }
    if (buf && ferror(f)) { free(buf); buf = NULL; }
    fclose(f);
    if (!buf || !len) { free(buf); return NULL; }
    buf[len] = 0;
    *n = len;
    return buf;
}

/* "a,b,c" (1..SHARD_MAX_DIMS non-negative ints, ending at the field's end) into v; their count, or -1 */
static int note_ints(const char *field, int64_t *v)
{
    int n = 0;
    for (const char *q = field; n < SHARD_MAX_DIMS;) {
        if (*q < '0' || *q > '9') return -1;
        char *end;
        errno = 0;
        long long x = strtoll(q, &end, 10);
        if (errno || x < 0) return -1;
        v[n++] = x;
        if (*end == 0) return n;
        if (*end != ',') return -1;
        q = end + 1;
    }
    return -1;
}

int shard_note_piece_parse(char *line, shard_note_piece *out)
{
    char *f[7];
    int nf = 0;
    for (char *q = line; nf < 7; nf++) {
        f[nf] = q;
        char *tab = strchr(q, '\t');
        if (!tab) { nf++; break; }
        *tab = 0;
        q = tab + 1;
    }
    if (nf != 7 || !f[0][0] || !f[1][0] || strlen(f[0]) >= 256 || strlen(f[1]) >= 1024 || strchr(f[1], '/') ||
        strchr(f[6], '\n') || strlen(f[2]) >= 32 || strlen(f[6]) != 16)
        return -1;
    out->group = f[0], out->name = f[1], out->dtype = f[2], out->hex = f[6];
    out->ndim = note_ints(f[3], out->off);
    return out->ndim >= 1 && note_ints(f[4], out->len) == out->ndim && note_ints(f[5], out->gshape) == out->ndim ? 0 : -1;
}
