#include "progress.h"

#include "cli.h"
#include "shard.h"

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
    if (!p->total) /* a total not known in advance: what is done and how fast */
        fprintf(stderr, "\r%s: %s %s  %s/s   ", cli_name(), p->label, cli_bytes(a, (double)p->done), cli_bytes(r, rate));
    else
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
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += 200000000;
        if (t.tv_nsec >= 1000000000) { t.tv_sec++; t.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&w->wake, &w->mu, &t);
        if (w->stop) break;
        const uint64_t d = w->count(w->arg);
        if (d > w->p.done) progress_add(&w->p, d - w->p.done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

void progress_watch_start(progress_watch *w, const char *label, uint64_t total, uint64_t (*count)(const void *),
                          const void *arg)
{
    *w = (progress_watch){.count = count, .arg = arg};
    progress_start(&w->p, label, total);
    if (!w->p.tty) return;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->wake, &ca);
    pthread_condattr_destroy(&ca);
    w->running = pthread_create(&w->thread, NULL, watch, w) == 0;
    if (!w->running) { pthread_cond_destroy(&w->wake); pthread_mutex_destroy(&w->mu); }
}

static int watch_join(progress_watch *w)
{
    if (!w->running) return 0;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->mu);
    w->running = 0;
    return 1;
}

void progress_watch_stop(progress_watch *w, int done)
{
    if (!watch_join(w)) return;
    if (done) w->p.done = w->p.total;
    progress_end(&w->p);
}

uint64_t progress_ckpt_bytes(const void *ckpt) { return shard_ckpt_bytes_read(ckpt); }

void progress_watch_begin(void *w, const char *label, uint64_t (*count)(const void *), const void *arg)
{
    progress_watch_start(w, label, 0, count, arg);
}

void progress_watch_erase(void *w)
{
    if (watch_join(w)) fputs("\r\033[K", stderr); /* the line goes: the load's own line follows */
}
