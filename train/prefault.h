/* train/prefault.c: a load's destination pages faulted in before the load writes them. */
#ifndef SMP_TRAIN_PREFAULT_H
#define SMP_TRAIN_PREFAULT_H

#include <stddef.h>

/* A range of host memory that a load is about to write whole. */
typedef struct {
    void *p;
    size_t bytes;
} prefault_span;

/* Fault in the pages of spans[0..n) (the pages they cover whole; the edge pages are
 * left to the load), split evenly over `threads` threads: madvise(MADV_POPULATE_WRITE),
 * Linux 5.14 and later; elsewhere, or under 16 MiB in all, nothing happens and the load
 * faults its pages in as it writes. No error: a page it could not fault in is faulted
 * by the load, as before. */
void prefault_spans(const prefault_span *spans, size_t n, int threads);

#endif
