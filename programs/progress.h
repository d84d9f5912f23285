/* A progress line on a terminal: "label  done/total  rate/s  ETA". Silent when
 * stderr is not a terminal (logs stay clean). */
#ifndef SMP_PROGRESS_H
#define SMP_PROGRESS_H
#include <pthread.h>
#include <stdint.h>
typedef struct {
    const char *label;
    uint64_t total, done;
    double start, last;
    int tty;
} progress;
void progress_start(progress *p, const char *label, uint64_t total_bytes);
void progress_add(progress *p, uint64_t bytes);
void progress_end(progress *p);
double now_seconds(void);
/* The same as callbacks (arg: a progress whose label is set), for libraries that report
 * their progress that way (convert/: convert_progress). */
void progress_cb_start(void *p, uint64_t total_bytes);
void progress_cb_add(void *p, uint64_t bytes);
void progress_cb_end(void *p);

/* A progress line for work that counts its own bytes (count(arg): done so far, read
 * from any thread): a thread polls it five times a second while stderr is a terminal,
 * and none is started otherwise. total 0: not known (the line says what is done and
 * how fast, no ETA). */
typedef struct {
    progress p;
    uint64_t (*count)(const void *arg);
    const void *arg;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake; /* stop wakes the poller at once: a stop never waits out a tick */
    int running, stop;
} progress_watch;
void progress_watch_start(progress_watch *w, const char *label, uint64_t total, uint64_t (*count)(const void *),
                          const void *arg);
/* Stops the thread; done: the line ends at the total, else it stops where it was. */
void progress_watch_stop(progress_watch *w, int done);
/* A checkpoint's stored bytes read so far (shard_ckpt_bytes_read): what a watch counts. */
uint64_t progress_ckpt_bytes(const void *ckpt);
/* A watched line of work that a command's own line follows (a load, the check of the
 * token files), w a progress_watch: loop_args' watch_start and watch_end for
 * smp-train, and smp-eval's own. The end erases the line. */
void progress_watch_begin(void *w, const char *label, uint64_t (*count)(const void *), const void *arg);
void progress_watch_erase(void *w);
#endif
