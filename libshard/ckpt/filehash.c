/* Whole-file checksums, and the note a shard writer leaves beside a file it closed,
 * so that the commit does not read it again. */
#include "../core/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HASH_BUF (256u << 10) /* read a piece at a time that stays in the core's cache */

shard_status shard_fd_xxh64(int fd, const char *path, uint64_t *hash, uint64_t *bytes)
{
    shard_xxh64_state h;
    char *buf = malloc(HASH_BUF);
    if (!buf) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_xxh64_reset(&h);
    uint64_t total = 0;
    shard_status s = SHARD_OK;
    for (;;) {
        ssize_t r = pread(fd, buf, HASH_BUF, (off_t)total);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { s = shard_fail(SHARD_E_IO, "%s: read failed: %s", path, strerror(errno)); break; }
        if (r == 0) break;
        shard_xxh64_update(&h, buf, (size_t)r);
        total += (uint64_t)r;
    }
    *hash = shard_xxh64_digest(&h);
    *bytes = total;
    free(buf);
    return s;
}

shard_status shard_file_xxh64(const char *path, uint64_t *hash, uint64_t *bytes)
{
    int fd;
    uint64_t size;
    shard_status s = shard_open_regular(path, 1, &fd, &size); /* a file of a checkpoint: no links */
    if (s) return s;
    s = shard_fd_xxh64(fd, path, hash, bytes);
    close(fd);
    return s;
}

/* "<hash> <bytes> <inode> <mtime s> <mtime ns>\n". Not the device: under mpirun on a
 * shared file system, the committing process may see another device number for the
 * same file than the writer did (the inode and times are the file's own). */
static char *note_path(const char *path)
{
    char *n = malloc(strlen(path) + 8);
    if (n) sprintf(n, "%s.xxh64", path);
    return n;
}

shard_status shard_file_hash_note(const char *path, int fd, uint64_t hash, uint64_t bytes)
{
    struct stat st;
    char *np = note_path(path);
    if (!np) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_status s = SHARD_OK;
    FILE *f = NULL;
    if (fstat(fd, &st) != 0 || !(f = fopen(np, "w")) ||
        fprintf(f, "%016" PRIx64 " %" PRIu64 " %" PRIu64 " %lld %ld\n", hash, bytes, (uint64_t)st.st_ino,
                (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec) < 0)
        s = shard_fail(SHARD_E_IO, "%s: cannot write: %s", np, strerror(errno));
    if (f && fclose(f) != 0 && !s) s = shard_fail(SHARD_E_IO, "%s: cannot write: %s", np, strerror(errno));
    if (s) unlink(np);
    free(np);
    return s;
}

int shard_file_hash_noted(const char *path, uint64_t *hash, uint64_t *bytes)
{
    char *np = note_path(path);
    if (!np) return 0;
    FILE *f = fopen(np, "r");
    uint64_t h, n, ino;
    long long sec;
    long nsec;
    struct stat st;
    int ok = f && fscanf(f, "%16" SCNx64 " %" SCNu64 " %" SCNu64 " %lld %ld", &h, &n, &ino, &sec, &nsec) == 5 &&
             stat(path, &st) == 0 && (uint64_t)st.st_size == n && (uint64_t)st.st_ino == ino &&
             (long long)st.st_mtim.tv_sec == sec && (long)st.st_mtim.tv_nsec == nsec;
    if (f) fclose(f);
    unlink(np);
    free(np);
    if (ok) { *hash = h; *bytes = n; }
    return ok;
}
