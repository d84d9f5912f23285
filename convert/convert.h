/* convert/: what smp-convert and smp-merge do beyond their options and messages.
 * convert.c: hf2smp, reshard and init, one loop (a source, a target layout); merge.c:
 * a checkpoint into a Hugging Face model folder (merge.h). A library below the
 * commands: it reports through return values and the callbacks here, and prints
 * nothing. */
#ifndef SMP_CONVERT_H
#define SMP_CONVERT_H

#include "shard.h"

/* Progress of a long write: start once with the bytes to come, add as they are written
 * (one call at a time), end once. Any of them may be NULL. */
typedef struct {
    void (*start)(void *ctx, uint64_t total_bytes);
    void (*add)(void *ctx, uint64_t bytes);
    void (*end)(void *ctx);
    void *ctx;
} convert_progress;

/* Where the weights come from: a Hugging Face model folder (hf2smp), a checkpoint
 * (reshard), or a config.json and a seed (init). Opened by one of the convert_open_*
 * (not to be copied after: d may point into it), closed by convert_source_close. */
typedef struct {
    const char *path;         /* as given: the folder, checkpoint or config.json (messages) */
    const shard_model_desc *d;
    const char *config;       /* config.json's text, as the checkpoint stores it */
    size_t config_len;
    shard_weights *w;         /* hf2smp */
    const char *dir;          /* hf2smp: the model folder, whose other files travel along */
    shard_ckpt *c;            /* reshard */
    int init;                 /* init: random weights from seed */
    uint64_t seed;
    shard_model_desc model;   /* hf2smp, init: what d points to */
    char *text;               /* hf2smp, init: config's storage */
} convert_source;

shard_status convert_open_hf(const char *dir, convert_source *src);
/* (world: the processes under mpirun, each opening the checkpoint; NULL: this one) */
shard_status convert_open_ckpt(const char *dir, shard_comm *world, convert_source *src);
shard_status convert_open_init(const char *config_path, uint64_t seed, convert_source *src);
void convert_source_close(convert_source *src);

typedef struct {
    const char *out;      /* the new checkpoint; refused when it exists */
    const char *layout;   /* "pp=2,tp=2" (shard_layout_parse) */
    const char *stages;   /* "auto" or "8,8,7,9" (shard_stages_parse) */
    const char *compress; /* "zstd", "zstd:N" or "none" (shard_compress_parse) */
    shard_dtype dtype;    /* of the parameters; SHARD_DT_INVALID: the source's (init:
                           * config.json's torch_dtype when bf16, else fp32) */
    int threads;          /* worker threads: fill, shuffle, compress, checksum */
    int no_fsync;
    shard_comm *world;    /* the processes sharing the work (output rank r: process r mod
                           * size; process 0 makes the staging folder and commits);
                           * NULL: this process alone */
    convert_progress progress;
} convert_opts;

/* Write o->out from src. Every process returns the run's outcome: its own failure,
 * else another's (SHARD_E_* with "another process failed"; *secondhand, which may be
 * NULL, is then 1). */
shard_status convert_run(const convert_opts *o, const convert_source *src, int *secondhand);

#endif
