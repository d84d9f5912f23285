#include "progress.h"

#include "cli.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

double now_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

void progress_start(progress *p, const char *label, uint64_t total)
{
    p->label = label;
    p->total = total;
    p->done = 0;
    p->start = p->last = now_seconds();
    p->tty = isatty(2);
}

static void draw(progress *p, double t)
{
    char a[32], b[32], r[32];
    double el = t - p->start, rate = el > 0 ? p->done / el : 0;
    double eta = rate > 0 ? (p->total - p->done) / rate : 0;
    fprintf(stderr, "\r%s: %s %s / %s  %s/s  ETA %.0fs   ", cli_name(), p->label, cli_bytes(a, (double)p->done),
            cli_bytes(b, (double)p->total), cli_bytes(r, rate), eta);
}

void progress_add(progress *p, uint64_t bytes)
{
    p->done += bytes;
    if (!p->tty) return;
    double t = now_seconds();
    if (t - p->last < 0.2) return;
    p->last = t;
    draw(p, t);
}

void progress_end(progress *p)
{
    if (p->tty) { draw(p, now_seconds()); fputc('\n', stderr); }
}

void progress_cb_start(void *p, uint64_t total) { progress_start(p, ((progress *)p)->label, total); }
void progress_cb_add(void *p, uint64_t bytes) { progress_add(p, bytes); }
void progress_cb_end(void *p) { progress_end(p); }

static void *watch(void *arg)
{
    progress_watch *w = arg;
    while (!__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
        usleep(200000);
        const uint64_t d = w->count(w->arg);
        if (d > w->p.done) progress_add(&w->p, d - w->p.done);
    }
    return NULL;
}

void progress_watch_start(progress_watch *w, const char *label, uint64_t total, uint64_t (*count)(const void *),
                          const void *arg)
{
    *w = (progress_watch){.count = count, .arg = arg};
    progress_start(&w->p, label, total);
    w->running = w->p.tty && pthread_create(&w->thread, NULL, watch, w) == 0;
}

void progress_watch_stop(progress_watch *w, int done)
{
    if (!w->running) return;
    __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
    pthread_join(w->thread, NULL);
    w->running = 0;
    if (done) w->p.done = w->p.total;
    progress_end(&w->p);
}
