/* train/steplog.c: the step log and the progress line (steplog.h). */
#include "steplog.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

shard_status steplog_open(steplog *l, const char *path, int fd, int tty, const par_ctx *P)
{
    memset(l, 0, sizeof *l);
    l->tty = tty;
    l->path = path;
    l->bytes = P->size > 1;
    l->comms = (step_comms){.tp = P->dg.tp, .kv = P->kvc, .cp = P->dg.cp, .pp = P->dg.pp, .emb = P->emb,
                            .dp = P->dg.dp, .dpcp = P->dg.dpcp, .ep = P->ep_d, .erep = P->erep};
    if (!path) return SHARD_OK;
    /* O_NONBLOCK: a FIFO without a reader is refused (ENXIO) instead of waited on forever;
     * with one (a monitor reading the log) the writes then block as usual */
    if (fd < 0) fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0 && errno == ENXIO) return shard_fail(SHARD_E_USAGE, "%s: a FIFO that nobody reads", path);
    if (fd < 0 || fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || !(l->f = fdopen(fd, "a"))) {
        const int e = errno;
        if (fd >= 0) close(fd);
        return shard_fail(SHARD_E_IO, "%s: cannot open: %s", path, strerror(e));
    }
    return SHARD_OK;
}

void steplog_close(steplog *l)
{
    if (l->f) fclose(l->f);
    l->f = NULL;
}

/* A line that was not written: said once, then the run goes on without its log */
static void lose(steplog *l, int64_t step, int e)
{
    l->lost = step;
    l->lost_errno = e;
    steplog_close(l);
    fprintf(stderr, "%ssmp-train: warning: %s: writing the log failed (%s); the steps from %lld on are not in it\n",
            steplog_clear(l), l->path, strerror(e), (long long)step);
}

shard_status steplog_finish(steplog *l)
{
    const int closed = !l->f || fclose(l->f) == 0, e = errno;
    l->f = NULL;
    if (l->lost_errno)
        return shard_fail(SHARD_E_IO, "%s: the log lacks the steps from %lld on: %s", l->path, (long long)l->lost,
                          strerror(l->lost_errno));
    return closed ? SHARD_OK : shard_fail(SHARD_E_IO, "%s: closing the log failed: %s", l->path, strerror(e));
}

static void reset(shard_comm *c)
{
    if (c) shard_comm_reset_bytes(c);
}

static uint64_t sent(shard_comm *c)
{
    return c ? shard_comm_bytes(c) : 0;
}

void steplog_reset_bytes(const steplog *l)
{
    const step_comms *k = &l->comms;
    reset(k->tp); reset(k->cp); reset(k->pp); reset(k->dp); reset(k->dpcp); reset(k->kv); reset(k->emb);
    reset(k->ep); reset(k->erep);
}

step_bytes steplog_bytes(const steplog *l)
{
    const step_comms *k = &l->comms;
    return (step_bytes){.tp = sent(k->tp) + sent(k->kv), .cp = sent(k->cp), .pp = sent(k->pp) + sent(k->emb),
                        .dp = sent(k->dp) + sent(k->dpcp) + sent(k->erep), .ep = sent(k->ep)};
}

static void log_num(FILE *f, const char *key, double v, const char *fmt)
{
    fprintf(f, ",\"%s\":", key);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

static void log_line(FILE *f, const step_result *r, int bytes)
{
    fprintf(f, "{\"step\":%lld", (long long)r->step);
    log_num(f, "loss", r->loss, "%.17g");
    log_num(f, "lr", r->lr, "%.9g");
    log_num(f, "grad_norm", r->grad_norm, "%.17g");
    log_num(f, "tokens_per_s", r->tokens_per_s, "%.1f");
    log_num(f, "elapsed_s", r->elapsed, "%.3f");
    fprintf(f, ",\"tokens\":%llu,\"targets\":%llu,\"skipped\":%s", (unsigned long long)r->tokens,
            (unsigned long long)r->targets, r->skipped || r->empty ? "true" : "false");
    if (bytes)
        fprintf(f, ",\"bytes_tp\":%llu,\"bytes_cp\":%llu,\"bytes_pp\":%llu,\"bytes_dp\":%llu",
                (unsigned long long)r->bytes.tp, (unsigned long long)r->bytes.cp, (unsigned long long)r->bytes.pp,
                (unsigned long long)r->bytes.dp);
    if (bytes && r->bytes.ep) fprintf(f, ",\"bytes_ep\":%llu", (unsigned long long)r->bytes.ep);
    if (!isnan(r->val_loss)) log_num(f, "val_loss", r->val_loss, "%.17g");
    if (!isnan(r->aux_loss)) log_num(f, "aux_loss", r->aux_loss, "%.17g");
    fputs("}\n", f);
}

/* "1h05m", "3m07s"; "--" when unknown */
static void fmt_eta(char *buf, size_t cap, double s)
{
    if (!(s >= 0) || s > 1e7) snprintf(buf, cap, "--");
    else if (s >= 3600) snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
    else snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
}

void steplog_step(steplog *l, const step_result *r, int64_t steps)
{
    if (l->f) {
        log_line(l->f, r, l->bytes);
        const int flushed = fflush(l->f) == 0, e = errno; /* a line a step: a monitor sees it at once */
        if (!flushed || ferror(l->f)) lose(l, r->step, !flushed && e ? e : EIO);
    }
    if (!l->tty) return;
    l->ema_dt = l->ema_dt > 0 ? 0.9 * l->ema_dt + 0.1 * r->seconds : r->seconds;
    char eta[32];
    fmt_eta(eta, sizeof eta, l->ema_dt * (double)(steps - r->step));
    char loss[32] = "--"; /* a step without counted targets has none */
    if (isfinite(r->loss)) snprintf(loss, sizeof loss, "%.4f", r->loss);
    fprintf(stderr, "\r\033[Kstep %lld/%lld  loss %s  lr %.3g  %.0f tok/s  ETA %s", (long long)r->step,
            (long long)steps, loss, r->lr, r->tokens_per_s, eta);
    if (!isnan(r->val_loss)) fprintf(stderr, "  val %.4f", r->val_loss);
    l->drawn = 1;
}

void steplog_end_line(steplog *l)
{
    if (l->tty && l->drawn) fputc('\n', stderr);
    l->drawn = 0;
}

const char *steplog_clear(const steplog *l)
{
    return l->tty ? "\r\033[K" : "";
}
