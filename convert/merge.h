/* convert/merge.h: an SMP checkpoint of any layout -> a Hugging Face model folder
 * (config.json, safetensors weights with an index when split, the extra files). */
#ifndef SMP_MERGE_H
#define SMP_MERGE_H

#include "convert.h"

typedef struct {
    shard_dtype dtype;       /* of the weights; SHARD_DT_INVALID: each tensor's stored one */
    uint64_t max_file_bytes; /* a new weight file when the next tensor would overflow this */
    int threads;             /* threads that read, decompress and check the chunks */
    int no_fsync;            /* skip the fsyncs (the folder still appears only when whole) */
    convert_progress progress;
} merge_opts;

/* Merge checkpoint `in` into the new folder `out` (no trailing '/'; refused when it
 * exists), written under a temporary name beside it and renamed into place when
 * whole. *nfiles: the weight files written. */
shard_status merge_run(const char *in, const char *out, const merge_opts *o, int *nfiles);

#endif
