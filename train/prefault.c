/* train/prefault.c: a load's destination pages faulted in before the load writes them
 * (prefault.h).
 *
 * Why: a load writes fp32 weights into memory fresh from the kernel, and every 4 KiB
 * page of it faults once: on the 2-core VM of the benchmarks that first touch, not the
 * reading, set the load's time (3 GB of fp32: 1.7-2.1 s in one thread). Asking the
 * kernel to fault the pages in (MADV_POPULATE_WRITE) spares the trap of each fault:
 * the same 3 GB in 0.9-1.2 s in one thread (by hand, a C program). smp-eval's load of
 * the 1.5 GB benchmark checkpoint (3 GB of fp32, 2 threads): 0.86-0.95 s -> 0.70-0.85 s
 * (five alternating pairs); 8 ranks under tp=4,dp=2: 2.9-5.1 s -> 1.67-1.83 s (four
 * pairs; by hand, 2026-12-04). Huge pages are not asked for (docs/DESIGN.md: a VM's
 * host backs them slowly). */
#include "prefault.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack the name */
#endif

enum { MAX_THREADS = 16 };
#define MIN_BYTES ((size_t)16 << 20) /* below this, the load faults its few pages in itself */

typedef struct {
    const prefault_span *spans;
    size_t n, page;
    size_t from, to; /* this thread's share: bytes [from, to) of the spans end to end */
} share;

/* span s's pages that lie whole within [lo, hi) of its own bytes */
static void populate(const prefault_span *s, size_t lo, size_t hi, size_t page)
{
    uintptr_t a = ((uintptr_t)s->p + lo + page - 1) / page * page, b = ((uintptr_t)s->p + hi) / page * page;
    if (b > a) (void)madvise((void *)a, b - a, MADV_POPULATE_WRITE); /* failing: the load faults them in */
}

static void *share_main(void *arg)
{
    const share *w = arg;
    size_t at = 0; /* where span i starts, end to end */
    for (size_t i = 0; i < w->n && at < w->to; at += w->spans[i++].bytes) {
        const size_t end = at + w->spans[i].bytes;
        if (end <= w->from) continue;
        populate(&w->spans[i], (w->from > at ? w->from : at) - at, (w->to < end ? w->to : end) - at, w->page);
    }
    return NULL;
}

void prefault_spans(const prefault_span *spans, size_t n, int threads)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += spans[i].bytes;
    if (total < MIN_BYTES) return;
    const long pg = sysconf(_SC_PAGESIZE);
    const size_t page = pg > 0 ? (size_t)pg : 4096;
    const int nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    share w[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < nt; t++) {
        /* each share takes the pages lying whole in it; a page that two shares split is
         * left to the load */
        w[t] = (share){spans, n, page, total / (size_t)nt * (size_t)t / page * page,
                       t + 1 == nt ? total : total / (size_t)nt * (size_t)(t + 1) / page * page};
        if (t > 0) started[t] = pthread_create(&th[t], NULL, share_main, &w[t]) == 0;
    }
    share_main(&w[0]);
    for (int t = 1; t < nt; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else share_main(&w[t]); /* no thread: this one does its share */
    }
}
