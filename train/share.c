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

/* How the sharers come to map one object. First an anonymous memfd that the others
 * open through /proc/PID/fd: it has no name to leave behind when a rank is killed, and
 * no /dev/shm to fill (containers mount a 64 MB one). Else, where memfd_create or /proc
 * is refused (old kernels, sandboxes), a POSIX object in /dev/shm, unlinked once mapped. */
enum { BY_MEMFD, BY_SHM, BY_END };

/* A rank's piece of one tensor, as the ranks of a host compare them (unused dims 0) */
typedef struct {
    int64_t holds, off[SHARD_MAX_DIMS], len[SHARD_MAX_DIMS];
} piece_key;

/* Which of a host's pieces are held once (the same on every rank of the host): the
 * groups, each the ranks that hold the same piece of some tensors, with one object
 * holding those pieces page by page; for this rank's tensors, the group (-1: no
 * other rank of the host holds its piece), the place in the group's object, and the
 * host rank that reads it. */
typedef struct {
    int H, me;            /* the host's ranks, this one's index */
    size_t W;             /* bytes of a set of host ranks */
    size_t ngroups, cap;
    unsigned char *set;   /* [ngroups][W]: each group's ranks */
    size_t *bytes;        /* [ngroups]: its object's size */
    int *leader;          /* [ngroups]: its lowest rank, who makes the object */
    int *gid;             /* [ntensors] */
    size_t *roff;         /* [ntensors] */
    int *reader;          /* [ntensors] */
    size_t shared, held;  /* this rank's bytes in groups, and in all */
} plan;

static void plan_free(plan *pl)
{
    free(pl->set);
    free(pl->bytes);
    free(pl->leader);
    free(pl->gid);
    free(pl->roff);
    free(pl->reader);
    memset(pl, 0, sizeof *pl);
}

static size_t round_page(size_t n)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

/* One host rank's piece of tensor i, in the order the plan sorts them */
typedef struct {
    const piece_key *k;
    int r;
} entry;

static int by_piece(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    const int c = memcmp(x->k, y->k, sizeof *x->k);
    return c ? c : (x->r > y->r) - (x->r < y->r);
}

/* The group of ranks `set` (one made when new): its index, or -1 out of memory */
static long group_of(plan *pl, const unsigned char *set, int leader)
{
    for (size_t g = 0; g < pl->ngroups; g++)
        if (!memcmp(pl->set + g * pl->W, set, pl->W)) return (long)g;
    if (pl->ngroups == pl->cap) {
        const size_t cap = pl->cap ? 2 * pl->cap : 8;
        unsigned char *s = realloc(pl->set, cap * pl->W);
        if (s) pl->set = s;
        size_t *b = realloc(pl->bytes, cap * sizeof *b);
        if (b) pl->bytes = b;
        int *l = realloc(pl->leader, cap * sizeof *l);
        if (l) pl->leader = l;
        if (!s || !b || !l) return -1;
        pl->cap = cap;
    }
    memcpy(pl->set + pl->ngroups * pl->W, set, pl->W);
    pl->bytes[pl->ngroups] = 0;
    pl->leader[pl->ngroups] = leader;
    return (long)pl->ngroups++;
}

static int in_set(const unsigned char *set, int r)
{
    return set[r / 8] >> (r % 8) & 1;
}

/* Tensor i's piece held by the n ranks e[0..n) (set: scratch): its group when n > 1 (a
 * new one for a new set of ranks), its place in the group's object, and its reader,
 * the rank of those with the fewest elements to read so far (load, per host rank; in
 * tensor order, so that every rank of the host computes the same). */
static void place(plan *pl, const model *m, size_t i, const entry *e, int n, size_t *load, unsigned char *set)
{
    size_t numel = 1;
    for (int d = 0; d < m->spec[i].ndim && d < SHARD_MAX_DIMS; d++) numel *= (size_t)e[0].k->len[d];
    const size_t bytes = numel * m->dev->es;
    if (!numel || pl->ngroups == (size_t)-1) return;
    if (n == 1) {
        load[e[0].r] += numel;
        if (e[0].r == pl->me) pl->held += bytes;
        return;
    }
    memset(set, 0, pl->W);
    int best = e[0].r;
    for (int j = 0; j < n; j++) {
        set[e[j].r / 8] |= (unsigned char)(1u << (e[j].r % 8));
        if (load[e[j].r] < load[best]) best = e[j].r;
    }
    load[best] += numel;
    const long g = group_of(pl, set, e[0].r);
    if (g < 0) {
        pl->ngroups = (size_t)-1; /* out of memory, told by make_plan */
        return;
    }
    if (in_set(set, pl->me)) {
        pl->gid[i] = (int)g;
        pl->roff[i] = pl->bytes[g];
        pl->reader[i] = best;
        pl->shared += bytes;
        pl->held += bytes;
    }
    pl->bytes[g] += round_page(bytes);
}

/* The host's plan from every host rank's pieces (gathered). Collective over host. */
static shard_status make_plan(shard_comm *host, const par_ctx *p, const model *m, plan *pl)
{
    const size_t nt = m->ntensors;
    memset(pl, 0, sizeof *pl);
    pl->H = shard_comm_size(host);
    pl->me = shard_comm_rank(host);
    pl->W = ((size_t)pl->H + 7) / 8;
    piece_key *all = calloc((size_t)pl->H * nt + 1, sizeof *all), *mine = calloc(nt + 1, sizeof *mine);
    entry *e = malloc((size_t)pl->H * sizeof *e);
    size_t *load = calloc((size_t)pl->H, sizeof *load);
    unsigned char *set = malloc(pl->W);
    pl->gid = malloc((nt + 1) * sizeof *pl->gid);
    pl->roff = calloc(nt + 1, sizeof *pl->roff);
    pl->reader = malloc((nt + 1) * sizeof *pl->reader);
    shard_status s = all && mine && e && load && set && pl->gid && pl->roff && pl->reader
                         ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; !s && i < nt; i++) {
        const shard_piece *q = &p->pp[i];
        mine[i].holds = q->holds && m->numel[i];
        for (int d = 0; mine[i].holds && d < m->spec[i].ndim && d < SHARD_MAX_DIMS; d++) {
            mine[i].off[d] = q->box.off[d];
            mine[i].len[d] = q->box.len[d];
        }
        pl->gid[i] = -1;
        pl->reader[i] = pl->me;
    }
    s = shard_comm_agree(host, s, "another process ran out of memory", NULL);
    if (!s) s = shard_comm_allgather(host, mine, all, nt * sizeof *mine, SHARD_DT_U8);
    for (size_t i = 0; !s && i < nt && pl->ngroups != (size_t)-1; i++) {
        int n = 0;
        for (int r = 0; r < pl->H; r++)
            if (all[(size_t)r * nt + i].holds) e[n++] = (entry){&all[(size_t)r * nt + i], r};
        qsort(e, (size_t)n, sizeof *e, by_piece);
        for (int a = 0, b; a < n; a = b) { /* each run of equal pieces */
            for (b = a + 1; b < n && !memcmp(e[b].k, e[a].k, sizeof *e[a].k); b++) {}
            place(pl, m, i, e + a, b - a, load, set);
        }
    }
    if (!s) /* a rank out of memory in place() */
        s = shard_comm_agree(host, pl->ngroups == (size_t)-1 ? shard_fail(SHARD_E_NOMEM, "out of memory") : SHARD_OK,
                             "another process ran out of memory", NULL);
    free(all);
    free(mine);
    free(e);
    free(load);
    free(set);
    return s;
}

/* What a group's leader tells the others: where its object is, and which it is (a
 * /proc/PID/fd path names another process's descriptor where the ranks do not share a
 * PID namespace; an object in another container's /dev/shm is another). */
typedef struct {
    char name[NAME];
    uint64_t dev, ino;
} object_id;

/* Group g's object, made by its leader, its size fixed and *id filled in; -1 with
 * errno on failure. */
static int create_object(int by, size_t g, size_t bytes, object_id *id)
{
    int fd;
    struct stat st;
    if (by == BY_MEMFD) {
        fd = memfd_create("smp-weights", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0) return -1; /* errno: memfd_create's */
        snprintf(id->name, NAME, "/proc/%ld/fd/%d", (long)getpid(), fd);
    } else {
        snprintf(id->name, NAME, "/smp-weights-%ld-%zu", (long)getpid(), g);
        fd = shm_open(id->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    }
    /* sealed at its size: no process can shrink it under the others' mappings (SIGBUS) */
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

/* The other ranks' side: the object their leader made, opened and checked to be it. */
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

/* The objects of the groups this rank is in: made by their leaders, named to the
 * host (gathered), opened by the others. fds[g]: -1 where this rank is not in g;
 * names[g]: the name of each object this rank made. *bad and *why on this rank's
 * failure. Fails only when a collective does. Collective over host. */
static shard_status open_groups(shard_comm *host, const plan *pl, int by, int *fds, char *names, int *bad, char *why,
                                size_t whysz)
{
    const size_t G = pl->ngroups;
    object_id *ids = calloc(G, sizeof *ids), *all = calloc(G * (size_t)pl->H, sizeof *all);
    shard_status s = ids && all ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    s = shard_comm_agree(host, s, "another process ran out of memory", NULL);
    *bad = 0;
    for (size_t g = 0; !s && g < G; g++) {
        if (pl->leader[g] != pl->me) continue;
        if ((fds[g] = create_object(by, g, pl->bytes[g], &ids[g])) >= 0) {
            memcpy(names + g * NAME, ids[g].name, NAME);
            continue;
        }
        if (by == BY_SHM) snprintf(why, whysz, "shm_open %s: %s", ids[g].name, strerror(errno));
        else snprintf(why, whysz, "memfd_create: %s", strerror(errno));
        ids[g].name[0] = 0; /* nothing for the others to open */
        *bad = 1;
    }
    if (!s) s = shard_comm_allgather(host, ids, all, G * sizeof *ids, SHARD_DT_U8);
    for (size_t g = 0; !s && !*bad && g < G; g++) {
        object_id id = all[(size_t)pl->leader[g] * G + g];
        id.name[NAME - 1] = 0;
        if (pl->leader[g] == pl->me || !in_set(pl->set + g * pl->W, pl->me)) continue;
        if (!id.name[0]) snprintf(why, whysz, "another rank could not make the shared object");
        if (!id.name[0] || (fds[g] = open_object(by, &id, why, whysz)) < 0) *bad = 1;
    }
    free(ids);
    free(all);
    return s;
}

/* This rank's weights (bytes long): private memory, with the pages of each tensor a
 * group holds mapped from the group's object (a run of tensors that follow each
 * other in both, one mapping), and those of the tensors it reads allocated there
 * (MADV_POPULATE_WRITE, Linux 5.14: one pass, where posix_fallocate and the load's
 * faults would take two; it fails instead of the SIGBUS a full /dev/shm would raise
 * later). The tensors' offsets are whole pages (model_localize's align). NULL with
 * *why set on failure. */
static void *map_weights(const plan *pl, const model *m, const int *fds, int by, size_t bytes, char *why, size_t whysz)
{
    const size_t es = m->dev->es, page = (size_t)sysconf(_SC_PAGESIZE);
    char *at = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) {
        snprintf(why, whysz, "mmap: %s (%zu bytes of weights)", strerror(errno), bytes);
        return NULL;
    }
    int e = 0;
    const char *what = "mmap";
    for (size_t i = 0, j; !e && i < m->ntensors; i = j) {
        const int g = pl->gid[i];
        const size_t a = m->offset[i] * es, r = pl->roff[i];
        size_t len = round_page(m->numel[i] * es);
        for (j = i + 1; g >= 0 && j < m->ntensors && pl->gid[j] == g && m->offset[j] * es == a + len && pl->roff[j] == r + len; j++)
            len += round_page(m->numel[j] * es);
        if (g < 0) continue;
        if (a % page) e = EINVAL; /* not whole pages: a model without the alignment */
        else if (mmap(at + a, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[g], (off_t)r) == MAP_FAILED) e = errno;
    }
    for (size_t i = 0; !e && i < m->ntensors; i++) {
        if (pl->gid[i] < 0 || pl->reader[i] != pl->me) continue;
        const size_t a = m->offset[i] * es, len = round_page(m->numel[i] * es);
        what = by == BY_SHM ? "/dev/shm" : "memfd";
        if (!madvise(at + a, len, MADV_POPULATE_WRITE)) continue;
        e = errno == EINVAL ? posix_fallocate(fds[pl->gid[i]], (off_t)pl->roff[i], (off_t)len) : errno; /* an older kernel */
        if (e == EFAULT) e = by == BY_SHM ? ENOSPC : ENOMEM; /* the page could not be had */
    }
    if (!e) return at;
    snprintf(why, whysz, "%s: %s (%zu bytes of weights)", what, strerror(e), bytes);
    munmap(at, bytes);
    return NULL;
}

/* Whether a rank of c failed (ok 0 there): *failed, and the lowest such rank's reason
 * in why on every rank of c. Collective over c. */
static shard_status first_failure(shard_comm *c, int ok, char *why, size_t whysz, int *failed)
{
    const int size = shard_comm_size(c);
    int32_t v = ok ? 0 : size - shard_comm_rank(c); /* the largest: the lowest failing rank */
    shard_status s = shard_comm_allreduce(c, &v, 1, SHARD_DT_I32, SHARD_OP_MAX);
    *failed = !s && v > 0;
    if (*failed) s = shard_comm_broadcast(c, why, whysz, SHARD_DT_U8, size - v);
    return s;
}

/* bytes, as a person reads them */
static const char *human(double b, char *buf, size_t n)
{
    if (b < 1e9) snprintf(buf, n, "%.1f MB", b / 1e6);
    else snprintf(buf, n, "%.2f GB", b / 1e9);
    return buf;
}

/* What the run's ranks did, said once by world rank 0: how many ranks share, and the
 * bytes of weights they keep against those of a copy per rank; how many ranks could
 * not share, with the first one's reason. Collective over the world (kept: this
 * rank's host shares). */
static shard_status say_sharing(par_ctx *p, const plan *pl, int kept, char *why, size_t whysz, const char *cmd)
{
    int64_t objects = 0;
    for (size_t g = 0; g < pl->ngroups; g++) objects += pl->leader[g] == pl->me ? (int64_t)pl->bytes[g] : 0;
    int failed = 0;
    shard_status s = first_failure(p->world, kept || !pl->shared, why, whysz, &failed);
    const int64_t in = pl->shared > 0, own = (int64_t)(pl->held - pl->shared);
    int64_t v[4] = {kept ? in : 0, kept ? 0 : in, kept ? objects + (in ? own : 0) : 0, kept && in ? (int64_t)pl->held : 0};
    if (!s) s = shard_comm_allreduce(p->world, v, 4, SHARD_DT_I64, SHARD_OP_SUM);
    char a[32], b[32];
    if (!s && p->rank == 0 && v[0])
        fprintf(stderr, "%s: %lld ranks keep one copy of their weights per host and piece: %s in memory instead of %s\n",
                cmd, (long long)v[0], human((double)v[2], a, sizeof a), human((double)v[3], b, sizeof b));
    if (!s && failed && p->rank == 0)
        fprintf(stderr, "%s: note: %lld ranks hold pieces that other ranks of their host hold too but keep a copy each: %s\n",
                cmd, (long long)v[1], why);
    return s;
}

/* The host's objects made, opened and mapped, a memfd else /dev/shm; *at NULL when
 * some rank of the host could not (why: the first one's reason). Collective over host. */
static shard_status map_shared(shard_comm *host, const plan *pl, const model *m, size_t bytes, void **at, char *why,
                               size_t whysz)
{
    int *fds = malloc((pl->ngroups + 1) * sizeof *fds);
    char *names = calloc(pl->ngroups + 1, NAME);
    shard_status s = fds && names ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
    s = shard_comm_agree(host, s, "another process ran out of memory", NULL);
    int failed = 1;
    *at = NULL;
    for (int by = 0; !s && failed && by < BY_END; by++) {
        int bad = 0;
        for (size_t g = 0; g < pl->ngroups; g++) {
            fds[g] = -1;
            names[g * NAME] = 0;
        }
        s = open_groups(host, pl, by, fds, names, &bad, why, whysz);
        if (!s && !bad) *at = map_weights(pl, m, fds, by, bytes, why, whysz);
        if (!s) s = first_failure(host, *at != NULL, why, whysz, &failed);
        for (size_t g = 0; g < pl->ngroups; g++) { /* mapped by all (or given up): no descriptor or name needed */
            if (fds[g] >= 0) close(fds[g]);
            if (by == BY_SHM && names[g * NAME]) shm_unlink(names + g * NAME);
        }
        if ((s || failed) && *at) {
            munmap(*at, bytes);
            *at = NULL;
        }
    }
    free(fds);
    free(names);
    return s;
}

shard_status share_weights(par_ctx *p, model *m, const char *cmd)
{
    if (p->size == 1 || m->dev->cuda || p->twins) return SHARD_OK;
    shard_comm *host = NULL;
    plan pl;
    memset(&pl, 0, sizeof pl);
    char why[256] = "out of memory";
    shard_status s = par_host(p, &host);
    if (!s) s = make_plan(host, p, m, &pl);
    const size_t bytes = round_page((m->nparams ? m->nparams : 1) * m->dev->es);
    void *at = NULL;
    if (!s && pl.ngroups) s = map_shared(host, &pl, m, bytes, &at, why, sizeof why);
    if (!s) s = say_sharing(p, &pl, !pl.ngroups || at, why, sizeof why, cmd);
    if (!s && at) {
        for (size_t i = 0; i < m->ntensors; i++)
            if (pl.gid[i] < 0) pl.reader[i] = -1; /* no twin on this host: its own pages, read by it */
        p->twins = host;
        p->shm = at;
        p->shm_bytes = bytes;
        p->reader = pl.reader;
        pl.reader = NULL;
        plan_free(&pl);
        return model_adopt_params(m, at);
    }
    if (at) munmap(at, bytes);
    plan_free(&pl);
    return s;
}

int share_reads(const par_ctx *p, size_t i)
{
    return !p->reader || p->reader[i] < 0 || p->reader[i] == shard_comm_rank(p->twins);
}

int share_mapped(const par_ctx *p, size_t i)
{
    return p->reader && p->reader[i] >= 0;
}

shard_status share_seal(par_ctx *p, shard_status mine)
{
    if (!p->twins) return mine;
    shard_status s = shard_comm_agree(p->twins, mine, "another process failed", NULL);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the other ranks' writes, seen after the agreement */
    if (!s && mprotect(p->shm, p->shm_bytes, PROT_READ))
        s = shard_fail(SHARD_E_IO, "mprotect of the shared weights: %s", strerror(errno));
    return s;
}

void share_release(par_ctx *p)
{
    if (p->shm) munmap(p->shm, p->shm_bytes);
    free(p->reader); /* twins is p->host: par_free's */
    p->shm = NULL;
    p->shm_bytes = 0;
    p->reader = NULL;
    p->twins = NULL;
}
