/* backends/dev_err.c: a backend's failures (dev.h): the first one is kept in d->err
 * and d->errmsg. Built into libsmptrain.a (the programs, the C backend) and into
 * libsmp_cuda.so, which resolves every symbol itself (-z defs) and so cannot use
 * the program's copy. */
#include "dev.h"

#include <stdarg.h>
#include <stdio.h>

void dev_fail(dev *d, shard_status s, const char *fmt, ...)
{
    if (d->err) return; /* the first failure is the one to report */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->errmsg, sizeof d->errmsg, fmt, ap);
    va_end(ap);
    d->err = s ? s : SHARD_E_INTERNAL;
}

shard_status dev_status(dev *d)
{
    if (!d->err) return SHARD_OK;
    return shard_fail(d->err, "%s backend: %s", d->ops ? d->ops->name : "?", d->errmsg);
}
