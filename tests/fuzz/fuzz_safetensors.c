/* libFuzzer: the safetensors reader on arbitrary bytes (written to a file in
 * /dev/shm, since the reader maps files). Every input must be accepted or refused
 * with a message; ASan/UBSan catch the rest. Accepted files are read in full. */
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char path[64];

static void remove_file(void) { unlink(path); } /* at libFuzzer's exit: /dev/shm keeps nothing */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!path[0]) {
        snprintf(path, sizeof path, "/dev/shm/smp-fuzz-st-%d.safetensors", (int)getpid());
        atexit(remove_file);
    }
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    shard_st_file *st;
    shard_status s = shard_st_open(path, &st);
    if (s == SHARD_OK) {
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < shard_st_count(st); i++) {
            const shard_st_tensor *t = shard_st_at(st, i);
            if (shard_st_find(st, t->name) != t) abort();
            if (t->nbytes) sink ^= ((const uint8_t *)t->data)[t->nbytes - 1];
        }
        for (size_t i = 0; i < shard_st_metadata_count(st); i++) {
            const char *k, *v;
            shard_st_metadata_at(st, i, &k, &v);
            sink ^= (uint8_t)strlen(k) ^ (uint8_t)strlen(v);
        }
        (void)sink;
        shard_st_close(st);
    } else if (!shard_errmsg()[0]) {
        abort(); /* every refusal carries a message */
    }
    return 0;
}
