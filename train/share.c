/* train/share.c: one copy of read-only weights per host and piece (share.h). */
#include "share.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack the name */
#endif

enum { NAME = 64 };

/* How the twins come to map one object. First an anonymous memfd that the others open
 * through /proc/PID/fd: it has no name to leave behind when a rank is killed, and no
 * /dev/shm to fill (containers mount a 64 MB one). Else, where memfd_create or /proc is
 * refused (old kernels, sandboxes), a POSIX object in /dev/shm, unlinked once mapped. */
enum { BY_MEMFD, BY_SHM, BY_END };

/* this rank's weights, flattened: the element count and size, then per tensor
 * whether it holds a piece and the piece's box; twins have equal ones */
static int64_t *signature(const par_ctx *p, const model *m, size_t *n)
{
    int64_t *v = malloc((2 + m->ntensors * (1 + 2 * 2)) * sizeof *v);
    if (!v) return NULL;
    size_t k = 0;
    v[k++] = (int64_t)m->nparams;
    v[k++] = (int64_t)m->dev->es;
    for (size_t i = 0; i < m->ntensors; i++) {
        const shard_piece *q = &p->pp[i];
        v[k++] = q->holds;
        for (int d = 0; d < 2; d++) {
            const int in = q->holds && d < m->spec[i].ndim;
            v[k++] = in ? q->box.off[d] : 0;
            v[k++] = in ? q->box.len[d] : 0;
        }
    }
    *n = k;
    return v;
}

/* c split so that each part holds the ranks whose `bytes`-long key (gathered) equals
 * that of the part's lowest rank. Collective over c. */
static shard_status split_by(shard_comm *c, const void *key, size_t bytes, shard_comm **out)
{
    const int me = shard_comm_rank(c), size = shard_comm_size(c);
    unsigned char *all = malloc((size_t)size * bytes);
    shard_status s = all ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    s = shard_comm_agree(c, s, "another process ran out of memory", NULL);
    if (!s) s = shard_comm_allgather(c, key, all, bytes, SHARD_DT_U8);
    int color = me;
    for (int r = 0; !s && r < me; r++)
        if (!memcmp(all + (size_t)r * bytes, key, bytes)) {
            color = r;
            break;
        }
    free(all);
    return s ? s : shard_comm_split(c, color, me, out);
}

/* The ranks of this host that hold exactly this rank's pieces, in world rank order
 * (the hostname, then the signature, compared whole). Collective over the world. */
static shard_status twins_of(par_ctx *p, const int64_t *sig, size_t n, shard_comm **out)
{
    char host[PAR_HOST] = {0};
    (void)gethostname(host, PAR_HOST - 1);
    shard_comm *h = NULL;
    *out = NULL;
    shard_status s = split_by(p->world, host, PAR_HOST, &h);
    if (!s) s = split_by(h, sig, n * sizeof *sig, out);
    shard_comm_free(h);
    return s;
}

/* Who reads tensor i: the twin with the fewest bytes so far, in tensor order (every
 * twin computes the same table). */
static int *readers(const model *m, int twins)
{
    int *r = malloc((m->ntensors ? m->ntensors : 1) * sizeof *r);
    size_t *load = calloc((size_t)twins, sizeof *load);
    if (!r || !load) {
        free(r);
        free(load);
        return NULL;
    }
    for (size_t i = 0; i < m->ntensors; i++) {
        int best = 0;
        for (int t = 1; t < twins; t++)
            if (load[t] < load[best]) best = t;
        r[i] = best;
        load[best] += m->numel[i];
    }
    free(load);
    return r;
}

/* The pages of the tensors this twin reads, allocated in the object and mapped
 * (MADV_POPULATE_WRITE, Linux 5.14: one pass, where posix_fallocate and the load's
 * faults would take two; it fails instead of the SIGBUS a full /dev/shm would raise
 * later). The twins together cover the object; a page that two tensors share is
 * populated twice, harmlessly. 0, or the errno of the first failure. */
static int allocate_mine(int fd, char *at, const par_ctx *p, const model *m, const int *reader, int me, int by)
{
    const size_t es = m->dev->es, page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < m->ntensors; i++) {
        if (reader[i] != me || !m->numel[i] || !p->pp[i].holds) continue;
        const size_t a = m->offset[i] * es / page * page, b = ((m->offset[i] + m->numel[i]) * es + page - 1) / page * page;
        if (!madvise(at + a, b - a, MADV_POPULATE_WRITE)) continue;
        const int e = errno == EINVAL ? posix_fallocate(fd, (off_t)a, (off_t)(b - a)) : errno; /* an older kernel */
        if (e) return e != EFAULT ? e : by == BY_SHM ? ENOSPC : ENOMEM; /* EFAULT: the page could not be had */
    }
    return 0;
}

/* What the group's first rank tells the others: where its object is, and which it is
 * (a /proc/PID/fd path names another process's descriptor where the twins do not
 * share a PID namespace; an object in another container's /dev/shm is another). */
typedef struct {
    char name[NAME];
    uint64_t dev, ino;
} object_id;

/* The object, made by the group's first rank, its size fixed and *id filled in; -1
 * with errno on failure. */
static int create_object(int by, const par_ctx *p, size_t bytes, object_id *id)
{
    int fd;
    struct stat st;
    if (by == BY_MEMFD) {
        fd = memfd_create("smp-weights", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0) return -1; /* errno: memfd_create's */
        snprintf(id->name, NAME, "/proc/%ld/fd/%d", (long)getpid(), fd);
    } else {
        snprintf(id->name, NAME, "/smp-weights-%ld-%d", (long)getpid(), p->rank);
        fd = shm_open(id->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    }
    /* sealed at its size: no process can shrink it under the twins' mappings (SIGBUS) */
    if (fd >= 0 && (ftruncate(fd, (off_t)bytes) || fstat(fd, &st) ||
                    (by == BY_MEMFD && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)))) {
        const int e = errno;
        close(fd);
        if (by == BY_SHM) shm_unlink(id->name);
        errno = e;
        return -1;
    }
    if (fd >= 0) {
        id->dev = (uint64_t)st.st_dev;
        id->ino = (uint64_t)st.st_ino;
    }
    return fd;
}

/* The other twins' side: the object their first rank made, opened and checked to be it. */
static int open_object(int by, const object_id *id, char *why, size_t whysz)
{
    struct stat st;
    int fd = by == BY_MEMFD ? open(id->name, O_RDWR | O_CLOEXEC) : shm_open(id->name, O_RDWR, 0);
    if (fd < 0) {
        snprintf(why, whysz, "%s %s: %s", by == BY_MEMFD ? "open" : "shm_open", id->name, strerror(errno));
    } else if (fstat(fd, &st) || (uint64_t)st.st_dev != id->dev || (uint64_t)st.st_ino != id->ino) {
        snprintf(why, whysz, "%s is not the object its creator made (another PID namespace or /dev/shm)", id->name);
        close(fd);
        fd = -1;
    }
    return fd;
}

/* The group's shared object (made `by` its first rank), opened and mapped by every
 * twin, each allocating the pages it will write. NULL and *why set on this rank's
 * failure. *fd: the object, open, for the caller to close once every twin has opened
 * it (a memfd lives through its creator's descriptor until then); name: the POSIX
 * object's, for the caller to unlink. */
static void *map_object(const par_ctx *p, shard_comm *tw, const model *m, const int *reader, size_t bytes, int by, char *name,
                        int *fd, char *why, size_t whysz)
{
    const int first = shard_comm_rank(tw) == 0;
    object_id id = {{0}, 0, 0};
    if (first && (*fd = create_object(by, p, bytes, &id)) < 0) {
        if (by == BY_SHM) snprintf(why, whysz, "shm_open %s: %s", id.name, strerror(errno));
        else snprintf(why, whysz, "memfd_create: %s", strerror(errno));
        id.name[0] = 0; /* nothing for the others to open */
    }
    if (shard_comm_broadcast(tw, &id, sizeof id, SHARD_DT_U8, 0)) id.name[0] = 0;
    id.name[NAME - 1] = 0;
    memcpy(name, id.name, NAME);
    if (!first) *fd = id.name[0] ? open_object(by, &id, why, whysz) : -1;
    if (*fd < 0) return NULL;
    void *at = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    int e = at == MAP_FAILED ? errno : allocate_mine(*fd, at, p, m, reader, shard_comm_rank(tw), by);
    if (!e) return at;
    snprintf(why, whysz, "%s: %s (%zu bytes of weights)", at == MAP_FAILED ? "mmap" : by == BY_SHM ? "/dev/shm" : "memfd",
             strerror(e), bytes);
    if (at != MAP_FAILED) munmap(at, bytes);
    return NULL;
}

/* Whether a rank of c failed (ok 0 there): *failed, the lowest such rank's reason in
 * why on every rank of c, and how many failed (*count; may be NULL). Collective over c. */
static shard_status first_failure(shard_comm *c, int ok, char *why, size_t whysz, int *failed, int *count)
{
    const int size = shard_comm_size(c);
    int32_t v[2] = {ok ? 0 : size - shard_comm_rank(c), !ok}; /* the largest v[0]: the lowest failing rank */
    shard_status s = shard_comm_allreduce(c, &v[0], 1, SHARD_DT_I32, SHARD_OP_MAX);
    if (!s && count) s = shard_comm_allreduce(c, &v[1], 1, SHARD_DT_I32, SHARD_OP_SUM);
    *failed = !s && v[0] > 0;
    if (count) *count = v[1];
    if (*failed) s = shard_comm_broadcast(c, why, whysz, SHARD_DT_U8, size - v[0]);
    return s;
}

/* What the run's twins did, said once by world rank 0: how many ranks share how
 * many copies, and how many groups could not share, with the first one's reason.
 * Collective over the world (lead: this rank leads a group of `twins` ranks; kept:
 * that group shares). */
static shard_status say_sharing(par_ctx *p, int lead, int twins, int kept, char *why, size_t whysz, const char *cmd)
{
    int failed = 0, groups = 0;
    shard_status s = first_failure(p->world, !lead || kept, why, whysz, &failed, &groups);
    int32_t shared[2] = {lead && kept, lead && kept ? twins : 0}; /* groups that share, their ranks */
    if (!s) s = shard_comm_allreduce(p->world, shared, 2, SHARD_DT_I32, SHARD_OP_SUM);
    if (!s && p->rank == 0 && shared[0])
        fprintf(stderr, "%s: %d ranks keep their weights in %d shared copies (one per host and piece)\n", cmd,
                shared[1], shared[0]);
    if (!s && failed && p->rank == 0)
        fprintf(stderr, "%s: note: %d group(s) of ranks on one host hold the same weights but keep a copy per rank: %s\n",
                cmd, groups, why);
    return s;
}

shard_status share_weights(par_ctx *p, model *m, const char *cmd)
{
    if (p->size == 1 || m->dev->cuda || p->twins) return SHARD_OK;
    size_t n = 0;
    int64_t *sig = signature(p, m, &n);
    shard_status s = sig ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    shard_comm *tw = NULL;
    s = shard_comm_agree(p->world, s, "another process ran out of memory", NULL);
    if (!s) s = twins_of(p, sig, n, &tw);
    free(sig);
    char name[NAME] = "", why[256] = "out of memory";
    if (s || shard_comm_size(tw) == 1) {
        shard_comm_free(tw);
        return s ? s : say_sharing(p, 0, 1, 0, why, sizeof why, cmd);
    }
    const size_t bytes = (m->nparams ? m->nparams : 1) * m->dev->es;
    int *reader = readers(m, shard_comm_size(tw)), bad = 1;
    void *at = NULL;
    for (int by = 0; !s && bad && by < BY_END; by++) { /* a memfd, else /dev/shm */
        int fd = -1;
        at = reader ? map_object(p, tw, m, reader, bytes, by, name, &fd, why, sizeof why) : NULL;
        s = first_failure(tw, at != NULL, why, sizeof why, &bad, NULL);
        if (fd >= 0) close(fd); /* mapped by all (or given up): no descriptor or name needed */
        if (by == BY_SHM && shard_comm_rank(tw) == 0 && name[0]) shm_unlink(name);
        if (bad && at) {
            munmap(at, bytes);
            at = NULL;
        }
    }
    if (!s) s = say_sharing(p, shard_comm_rank(tw) == 0, shard_comm_size(tw), !bad, why, sizeof why, cmd);
    if (!s && !bad) {
        p->twins = tw;
        p->shm = at;
        p->shm_bytes = bytes;
        p->reader = reader;
        return model_adopt_params(m, at);
    }
    if (at) munmap(at, bytes);
    free(reader);
    shard_comm_free(tw);
    return s;
}

int share_reads(const par_ctx *p, size_t i)
{
    return !p->reader || p->reader[i] == shard_comm_rank(p->twins);
}

shard_status share_seal(par_ctx *p, shard_status mine)
{
    if (!p->twins) return mine;
    shard_status s = shard_comm_agree(p->twins, mine, "another process failed", NULL);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the twins' writes, seen after the agreement */
    if (!s && mprotect(p->shm, p->shm_bytes, PROT_READ))
        s = shard_fail(SHARD_E_IO, "mprotect of the shared weights: %s", strerror(errno));
    return s;
}

void share_release(par_ctx *p)
{
    if (p->shm) munmap(p->shm, p->shm_bytes);
    free(p->reader);
    shard_comm_free(p->twins);
    p->shm = NULL;
    p->shm_bytes = 0;
    p->reader = NULL;
    p->twins = NULL;
}
