/* libFuzzer: a checkpoint's manifest (smp.json) on arbitrary bytes, through
 * shard_ckpt_open as a command opens it: written into a scratch folder each time. */
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64], path[96];

static void remove_dir(void)
{
    unlink(path);
    rmdir(dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0]) { /* gone at exit */
        snprintf(dir, sizeof dir, "/tmp/fuzz-manifest-%ld", (long)getpid());
        mkdir(dir, 0755);
        snprintf(path, sizeof path, "%s/smp.json", dir);
        atexit(remove_dir);
    }
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    shard_ckpt *c = NULL;
    shard_status s = shard_ckpt_open(dir, &c);
    if (s == SHARD_OK) {
        /* a manifest that opened must be usable: look every tensor up, read nothing
         * (there are no shard files: any read must fail cleanly, naming one) */
        for (size_t i = 0; i < shard_ckpt_tensor_count(c); i++) {
            const shard_ckpt_tensor *t = shard_ckpt_tensor_at(c, i);
            if (shard_ckpt_find(c, t->group, t->name) != (long)i) abort();
        }
        if (shard_ckpt_tensor_count(c) > 0) {
            const shard_ckpt_tensor *t = shard_ckpt_tensor_at(c, 0);
            shard_box one = {.ndim = t->ndim};
            for (int k = 0; k < t->ndim; k++) one.len[k] = t->shape[k] > 0 ? 1 : 0;
            float x[1];
            if (shard_ckpt_read(c, 0, &one, x, SHARD_DT_F32) == SHARD_OK && t->shape[0] > 0) abort();
        }
        shard_ckpt_close(c);
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    return 0;
}
