/* Status codes and the per-thread error message. */
#include "core.h"

#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

static _Thread_local char errbuf[2048];
static _Thread_local int secondhand;

const char *shard_errmsg(void) { return errbuf; }
int shard_err_secondhand(void) { return secondhand; }
void shard_set_secondhand(void) { secondhand = 1; }

shard_status shard_fail(shard_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, sizeof errbuf, fmt, ap);
    va_end(ap);
    secondhand = 0;
    return s;
}

const char *shard_status_name(shard_status s)
{
    switch (s) {
    case SHARD_OK: return "ok";
    case SHARD_E_IO: return "I/O error";
    case SHARD_E_NOMEM: return "out of memory";
    case SHARD_E_USAGE: return "usage error";
    case SHARD_E_INVALID: return "invalid input";
    case SHARD_E_UNSUPPORTED: return "unsupported input";
    case SHARD_E_CORRUPT: return "corrupt data";
    case SHARD_E_INTERNAL: return "internal error";
    case SHARD_E_CANCELLED: return "cancelled";
    }
    return "unknown status";
}

int shard_status_exit_code(shard_status s)
{
    switch (s) {
    case SHARD_OK: return 0;
    case SHARD_E_USAGE: return 2;
    case SHARD_E_INVALID:
    case SHARD_E_UNSUPPORTED:
    case SHARD_E_CORRUPT: return 3;
    case SHARD_E_CANCELLED: return 130;
    default: return 1;
    }
}

static atomic_int cancel_sig; /* lock-free: stored from a signal handler, read by the writers */

void shard_cancel(int sig) { atomic_store_explicit(&cancel_sig, sig ? sig : -1, memory_order_relaxed); }
int shard_cancelled(void) { return atomic_load_explicit(&cancel_sig, memory_order_relaxed); }

shard_status shard_fail_cancelled(void)
{
    const int sig = shard_cancelled();
    const char *name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : NULL;
    if (name) return shard_fail(SHARD_E_CANCELLED, "interrupted by %s", name);
    if (sig > 0) return shard_fail(SHARD_E_CANCELLED, "interrupted by signal %d", sig);
    return shard_fail(SHARD_E_CANCELLED, "cancelled");
}
