/* Files, JSON and paths: the small helpers every reader of outside files needs. */
#include "../core/internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

shard_status shard_open_regular(const char *path, int nofollow, int *fd, uint64_t *size)
{
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (nofollow ? O_NOFOLLOW : 0)); /* a FIFO: no wait */
    if (*fd < 0) {
        int e = errno;
        if (e == ELOOP && nofollow) return shard_fail(SHARD_E_INVALID, "%s: a symbolic link (refused: it may point outside the folder)", path);
        if (e == ENOENT || e == ENOTDIR) return shard_fail(SHARD_E_INVALID, "%s: missing", path);
        return shard_fail(SHARD_E_IO, "%s: cannot open: %s", path, strerror(e));
    }
    struct stat st;
    const char *what = NULL;
    if (fstat(*fd, &st) != 0) what = strerror(errno);
    else if (S_ISDIR(st.st_mode)) what = "a directory, not a file";
    else if (!S_ISREG(st.st_mode)) what = S_ISFIFO(st.st_mode) ? "a FIFO, not a regular file" : "not a regular file (a device or socket)";
    if (what) {
        close(*fd);
        *fd = -1;
        return shard_fail(SHARD_E_INVALID, "%s: %s", path, what);
    }
    fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) & ~O_NONBLOCK);
    *size = (uint64_t)st.st_size;
    return SHARD_OK;
}

shard_status shard_read_file(const char *path, size_t max_bytes, char **buf, size_t *len)
{
    return shard_read_file_in(path, max_bytes, 0, buf, len);
}

shard_status shard_read_file_in(const char *path, size_t max_bytes, int nofollow, char **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    int fd;
    uint64_t size;
    shard_status s = shard_open_regular(path, nofollow, &fd, &size);
    if (s) return s;
    s = shard_read_fd(fd, path, size, max_bytes, buf, len);
    close(fd);
    return s;
}

shard_status shard_read_fd(int fd, const char *path, uint64_t size, size_t max_bytes, char **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    if (size > max_bytes)
        return shard_fail(SHARD_E_INVALID, "%s: too large (%llu bytes; at most %zu accepted)", path,
                          (unsigned long long)size, max_bytes);
    char *b = malloc((size_t)size + 1);
    if (!b) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_status s = shard_pread_full(fd, path, b, (size_t)size, 0);
    if (s) { free(b); return s; }
    b[size] = 0;
    *buf = b;
    *len = (size_t)size;
    return SHARD_OK;
}

shard_status shard_pread_full(int fd, const char *path, void *buf, size_t n, uint64_t off)
{
    for (size_t done = 0; done < n;) {
        ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return shard_fail(SHARD_E_IO, "%s: read failed: %s", path, strerror(errno));
        if (r == 0) return shard_fail(SHARD_E_IO, "%s: shorter than when it was opened (changed while in use)", path);
        done += (size_t)r;
    }
    return SHARD_OK;
}

shard_status shard_json_parse(const char *text, size_t len, const char *path, json_t **out)
{
    json_error_t err;
    /* jansson rejects trailing garbage (only JSON whitespace may follow), invalid
     * UTF-8 and \u0000; JSON_REJECT_DUPLICATES catches repeated keys; nesting is
     * capped by the library (2048 levels). */
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (!j)
        return shard_fail(SHARD_E_INVALID, "%s: invalid JSON at line %d column %d: %s", path, err.line,
                          err.column, err.text);
    *out = j;
    return SHARD_OK;
}

char *shard_path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (a && dir[a - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

int shard_path_is_contained(const char *name)
{
    if (!name[0] || name[0] == '/') return 0;
    const char *s = name;
    while (*s) {
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.')) return 0;
        if (memchr(s, '\\', n)) return 0;
        if (!e) break;
        s = e + 1;
    }
    return 1;
}

shard_status shard_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    shard_status s = SHARD_OK;
    if (fd < 0 || fsync(fd) != 0) s = shard_fail(SHARD_E_IO, "%s: fsync of the folder failed: %s", dir, strerror(errno));
    if (fd >= 0) close(fd);
    return s;
}

/* The folder that holds d (d is changed): "/" for "/x", "." for "x" */
static const char *parent_of(char *d)
{
    char *slash = strrchr(d, '/');
    if (slash == d) slash[1] = 0;
    else if (slash) *slash = 0;
    else return ".";
    return d;
}

/* 1 when folder dir holds a checkpoint's manifest (smp.json, a link too), -1 out of memory */
static int holds_manifest(const char *dir)
{
    char *m = shard_path_join(dir, "smp.json");
    struct stat st;
    const int yes = m ? lstat(m, &st) == 0 : -1;
    free(m);
    return yes;
}

/* An output inside a checkpoint's folder is lost with it: smp-train's --keep prunes
 * whole step folders, and a checkpoint is replaced or copied as one folder. */
static shard_status check_not_in_checkpoint(const char *path, const char *d)
{
    char *p = strdup(d);
    const char *parent = p ? parent_of(p) : NULL;
    const int in = parent ? holds_manifest(parent) : -1;
    shard_status s = in < 0 ? shard_fail(SHARD_E_NOMEM, "out of memory") : SHARD_OK;
    if (in > 0)
        s = shard_fail(SHARD_E_USAGE, "%s: inside the checkpoint %s (pruning or replacing that checkpoint "
                                      "would delete it): put it beside the checkpoint", path, parent);
    free(p);
    return s;
}

static shard_status check_output(const char *path, char *d, shard_out_kind kind)
{
    const char *base = strrchr(d, '/') ? strrchr(d, '/') + 1 : d;
    struct stat st;
    shard_status s = check_not_in_checkpoint(path, d);
    if (s) return s;
    if (kind == SHARD_OUT_NEW_DIR && (!strcmp(base, ".") || !strcmp(base, "..") || !strcmp(d, "/")))
        return shard_fail(SHARD_E_USAGE, "%s: not the name of a new folder", path);
    if (lstat(d, &st) == 0) {
        if (kind == SHARD_OUT_NEW_DIR) /* a link too, even a dangling one: the rename would replace it */
            return shard_fail(SHARD_E_USAGE, "%s: already exists (refusing to replace it)", path);
        if (stat(d, &st) != 0) return shard_fail(SHARD_E_USAGE, "%s: a link to nothing", path);
        if (kind == SHARD_OUT_DIR && !S_ISDIR(st.st_mode)) return shard_fail(SHARD_E_USAGE, "%s: not a folder", path);
        if (kind == SHARD_OUT_DIR && holds_manifest(d) > 0) /* its files would go inside the checkpoint */
            return shard_fail(SHARD_E_USAGE, "%s: a checkpoint, not a run folder (give a folder of its own)", path);
        if (kind == SHARD_OUT_FILE && S_ISDIR(st.st_mode)) return shard_fail(SHARD_E_USAGE, "%s: a folder, not a file", path);
        return SHARD_OK;
    }
    if (errno != ENOENT) /* ENOTDIR: a file on the way */
        return shard_fail(errno == EACCES || errno == EIO ? SHARD_E_IO : SHARD_E_USAGE, "%s: %s", path, strerror(errno));
    if (kind != SHARD_OUT_NEW_DIR) return SHARD_OK; /* a run folder is made with its parents, a log may be in it */
    const char *parent = parent_of(d);
    if (stat(parent, &st) != 0) return shard_fail(SHARD_E_USAGE, "%s: its folder %s: %s", path, parent, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return shard_fail(SHARD_E_USAGE, "%s: %s is not a folder", path, parent);
    return SHARD_OK;
}

shard_status shard_check_output(const char *path, shard_out_kind kind)
{
    if (!path[0]) return shard_fail(SHARD_E_USAGE, "\"\": an empty path");
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "out/" is the folder out */
    char *d = strndup(path, n);
    if (!d) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_status s = check_output(path, d, kind);
    free(d);
    return s;
}

/* The folder that holds output folder final_dir (trailing slashes aside) and its name:
 * both malloc'd; 0 when out of memory. */
static int split_output(const char *final_dir, char **parent, char **base)
{
    size_t n = strlen(final_dir);
    while (n > 1 && final_dir[n - 1] == '/') n--;
    char *d = strndup(final_dir, n);
    const char *slash = d ? strrchr(d, '/') : NULL;
    *base = d ? strdup(slash ? slash + 1 : d) : NULL;
    *parent = d && *base ? strdup(parent_of(d)) : NULL;
    free(d);
    if (*parent) return 1;
    free(*base);
    *base = NULL;
    return 0;
}

/* parent/name ("/name" in "/") */
static char *in_folder(const char *parent, const char *name)
{
    char *out = malloc(strlen(parent) + strlen(name) + 2);
    if (out) sprintf(out, "%s%s%s", parent, strcmp(parent, "/") ? "/" : "", name);
    return out;
}

char *shard_staging_path(const char *final_dir)
{
    char *parent, *base, name[4200];
    if (!split_output(final_dir, &parent, &base)) return NULL;
    snprintf(name, sizeof name, ".tmp-%.4096s-%ld-%ld", base, (long)getpid(), (long)time(NULL));
    char *out = in_folder(parent, name);
    free(parent);
    free(base);
    return out;
}

static int is_staging_of(const char *name, void *base) { return shard_is_staging_name(name, base); }

shard_status shard_staging_leftovers(const char *final_dir, char ***paths, size_t *n)
{
    *paths = NULL;
    *n = 0;
    char *parent, *base, **names = NULL;
    size_t k = 0;
    if (!split_output(final_dir, &parent, &base)) return shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_status s = *base ? shard_list_dir(parent, is_staging_of, base, &names, &k) : SHARD_OK;
    for (size_t i = 0; i < k && !s; i++) {
        char *p = in_folder(parent, names[i]);
        struct stat st;
        char **grown = p ? realloc(*paths, (*n + 1) * sizeof **paths) : NULL;
        if (!grown) { free(p); s = shard_fail(SHARD_E_NOMEM, "out of memory"); break; }
        *paths = grown;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) (*paths)[(*n)++] = p;
        else free(p);
    }
    shard_free_names(names, k);
    free(parent);
    free(base);
    return s;
}

/* s: digits, a '-', digits, and nothing else */
static int pid_and_time(const char *s)
{
    const char *d = s;
    while (*d >= '0' && *d <= '9') d++;
    if (d == s || *d++ != '-') return 0;
    const char *t = d;
    while (*d >= '0' && *d <= '9') d++;
    return d > t && !*d;
}

int shard_is_staging_name(const char *entry, const char *name)
{
    if (strncmp(entry, ".tmp-", 5)) return 0;
    entry += 5;
    if (name) {
        const size_t n = strlen(name);
        return !strncmp(entry, name, n) && entry[n] == '-' && pid_and_time(entry + n + 1);
    }
    /* any name: the last two dash-separated fields are the pid and the time */
    const char *last = strrchr(entry, '-');
    if (!last) return 0;
    const char *dash = last;
    while (dash > entry && dash[-1] != '-') dash--;
    return dash > entry + 1 && pid_and_time(dash);
}

shard_status shard_fsync_dir_of(const char *path)
{
    char *d = strdup(path);
    if (!d) return shard_fail(SHARD_E_NOMEM, "%s: out of memory", path);
    shard_status s = shard_fsync_dir(parent_of(d));
    free(d);
    return s;
}

void shard_start_writeback(int fd, shard_flusher **f, uint64_t *unsynced, size_t n, int no_fsync)
{
    *unsynced += n;
    if (fd < 0 || no_fsync || *unsynced < (64u << 20)) return;
    sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    if (!*f) *f = shard_flusher_start(fd); /* its first 64 MiB: a file worth flushing as it grows */
    shard_flusher_kick(*f);
    *unsynced = 0;
}

int shard_pwrite_all(int fd, const void *p, size_t n, uint64_t off)
{
    const char *c = p;
    while (n) {
        ssize_t r = pwrite(fd, c, n < SHARD_WRITE_MAX ? n : SHARD_WRITE_MAX, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : ENOSPC;
        c += r;
        off += (uint64_t)r;
        n -= (size_t)r;
    }
    return 0;
}

int shard_reserve_blocks(int fd, uint64_t off, uint64_t len)
{
    if (len == 0 || off > INT64_MAX || len > (uint64_t)INT64_MAX - off) return 0;
    return fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len) != 0 && errno == ENOSPC ? ENOSPC : 0;
}

static int cmp_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

void shard_free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

shard_status shard_list_dir(const char *dir, int (*keep)(const char *name, void *ctx), void *ctx, char ***out,
                            size_t *count)
{
    *out = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d) return shard_fail(SHARD_E_IO, "%s: cannot list: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    shard_status s = SHARD_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !keep(e->d_name, ctx)) continue;
        if (n == cap) {
            char **grown = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof *names);
            if (!grown) { s = shard_fail(SHARD_E_NOMEM, "out of memory"); break; }
            names = grown;
        }
        if (!(names[n] = strdup(e->d_name))) s = shard_fail(SHARD_E_NOMEM, "out of memory");
        else n++;
    }
    closedir(d);
    if (s) { shard_free_names(names, n); return s; }
    if (n) qsort(names, n, sizeof *names, cmp_name);
    *out = names;
    *count = n;
    return SHARD_OK;
}
