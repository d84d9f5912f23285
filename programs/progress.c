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
