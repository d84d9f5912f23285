/* The transfer thread of comm.h (comm_worker): a call handed over, run while the
 * owner computes, its status and message handed back (shard_errmsg is per thread,
 * so the message is carried over and raised again on the owner's). */
#include "comm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct comm_worker {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* both ways: a call posted, a call done, quit */
    shard_status (*fn)(void *arg);
    void *arg;
    int posted, quit; /* posted: handed over and not yet returned */
    shard_status s;
    char msg[2048];
};

static void *run(void *p)
{
    comm_worker *w = p;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->posted && !w->quit) pthread_cond_wait(&w->cv, &w->mu);
        if (!w->posted) break; /* quit, nothing left to run */
        pthread_mutex_unlock(&w->mu);
        shard_status s = w->fn(w->arg);
        pthread_mutex_lock(&w->mu);
        w->s = s;
        if (s) snprintf(w->msg, sizeof w->msg, "%s", shard_errmsg());
        w->posted = 0;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

shard_status comm_worker_start(comm_worker **out)
{
    comm_worker *w = calloc(1, sizeof *w);
    if (!w) return shard_fail(SHARD_E_NOMEM, "out of memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int rc = pthread_create(&w->th, NULL, run, w);
    if (rc) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return shard_fail(SHARD_E_IO, "cannot start the communicator's transfer thread: %s", strerror(rc));
    }
    *out = w;
    return SHARD_OK;
}

void comm_worker_post(comm_worker *w, shard_status (*fn)(void *arg), void *arg)
{
    pthread_mutex_lock(&w->mu);
    w->fn = fn;
    w->arg = arg;
    w->posted = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

shard_status comm_worker_wait(comm_worker *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->posted) pthread_cond_wait(&w->cv, &w->mu);
    const shard_status s = w->s;
    w->s = SHARD_OK;
    pthread_mutex_unlock(&w->mu);
    return s ? shard_fail(s, "%s", w->msg) : SHARD_OK;
}

void comm_worker_free(comm_worker *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->quit = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
