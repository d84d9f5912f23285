/* libFuzzer: model.safetensors.index.json on arbitrary bytes, in a folder that
 * also holds two small valid weight files it may point to. */
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static void write_file(const char *name, const void *p, size_t n)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    fwrite(p, 1, n, f);
    fclose(f);
}

static const char *const FILES[3] = {"a.safetensors", "b.safetensors", "model.safetensors.index.json"};

/* at libFuzzer's exit: /dev/shm keeps nothing */
static void remove_dir(void)
{
    char path[128];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, FILES[i]);
        unlink(path);
    }
    rmdir(dir);
}

static void setup(void)
{
    snprintf(dir, sizeof dir, "/dev/shm/smp-fuzz-index-%d", (int)getpid());
    mkdir(dir, 0755);
    atexit(remove_dir);
    const char *const *names = FILES;
    const char *hdrs[2] = {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                           "{\"y\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,4]},\"z\":{\"dtype\":\"I8\",\"shape\":[],\"data_offsets\":[4,5]}}"};
    for (int i = 0; i < 2; i++) {
        uint8_t buf[256] = {0};
        uint64_t n = strlen(hdrs[i]);
        for (int k = 0; k < 8; k++) buf[k] = (uint8_t)(n >> (8 * k));
        memcpy(buf + 8, hdrs[i], n);
        write_file(names[i], buf, 8 + n + (i ? 5 : 8));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0]) setup();
    write_file("model.safetensors.index.json", data, size);
    shard_weights *w;
    shard_status s = shard_weights_open(dir, &w);
    if (s == SHARD_OK) {
        for (size_t i = 0; i < shard_weights_count(w); i++)
            if (shard_weights_find(w, shard_weights_at(w, i)->name) != shard_weights_at(w, i)) abort();
        uint64_t fp; /* what hf2smp's processes compare: reads every tensor's ends */
        if (shard_weights_fingerprint(w, &fp) != SHARD_OK) abort();
        shard_weights_close(w);
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    return 0;
}
