/* A progress line on a terminal: "label  done/total  rate/s  ETA". Silent when
 * stderr is not a terminal (logs stay clean). */
#ifndef SMP_PROGRESS_H
#define SMP_PROGRESS_H
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
#endif
