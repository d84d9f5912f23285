/* train/agree.h: what the ranks of a run must hold alike, compared once before the
 * load. Each rank opens the checkpoint, reads the token files and parses the flags
 * itself; on a cluster a host with a stale copy of the checkpoint (or another
 * `latest`), another copy of a token file, or an MPMD launch with other flags would
 * otherwise train, silently, on a mix of them (or hang in the first collective of a
 * layout the others do not share). */
#ifndef SMP_TRAIN_AGREE_H
#define SMP_TRAIN_AGREE_H

#include <stdint.h>

#include "shard.h"

typedef enum {
    AGREE_CKPT,  /* a checkpoint's fingerprint (shard_ckpt_fingerprint) */
    AGREE_DATA,  /* token files' fingerprint (data_fingerprint) */
    AGREE_INT,   /* a setting: an integer */
    AGREE_FLOAT, /* a setting: a float's bits */
} agree_kind;

typedef struct {
    agree_kind kind;
    const char *name; /* the path (AGREE_CKPT), the flag (--data, --seq, ...) */
    uint64_t v;
} agree_item;

agree_item agree_float(const char *name, float x);
/* the items of a layout, inside an array's initializer */
#define AGREE_LAYOUT(l)                                                                                         \
    {AGREE_INT, "--layout's pp", (uint64_t)(l)->pp}, {AGREE_INT, "--layout's tp", (uint64_t)(l)->tp},             \
        {AGREE_INT, "--layout's cp", (uint64_t)(l)->cp}, {AGREE_INT, "--layout's dp", (uint64_t)(l)->dp},         \
        {AGREE_INT, "--layout's ep", (uint64_t)(l)->ep}

/* items[n] (the same names in the same order on every rank) against rank 0's, over
 * world: the first item and rank that differ, as one failure every rank returns
 * alike (SHARD_E_INVALID for a checkpoint or token files, SHARD_E_USAGE for a
 * setting), naming both ranks' values. */
shard_status agree_check(shard_comm *world, const agree_item *items, int n);

#endif
