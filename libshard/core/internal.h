/* Internal helpers shared by libshard's parts; not part of the public API. */
#ifndef SHARD_INTERNAL_H
#define SHARD_INTERNAL_H

#include "shard.h"

#include <jansson.h>
#include <stdbool.h>

/* Parse JSON text strictly: one value, duplicate keys rejected, only whitespace
 * after it; errors name path and the position. */
shard_status shard_json_parse(const char *text, size_t len, const char *path, json_t **out);
/* "dir/name" into a fresh string (NULL on overflow of memory). */
char *shard_path_join(const char *dir, const char *name);
/* 1 when name is a plain relative path that stays inside its folder. */
int shard_path_is_contained(const char *name);
/* fsync the folder that holds path (makes a rename durable). */
shard_status shard_fsync_dir_of(const char *path);
/* Overflow-checked arithmetic: false on overflow. */
static inline bool shard_mul_u64(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline bool shard_add_u64(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_add_overflow(a, b, r); }

#endif
