/* libFuzzer: a checkpoint's shard file (HDF5) on arbitrary bytes, under a fixed,
 * valid manifest, through what every reading command does: open, read each tensor
 * whole, verify. Byte 0 picks the manifest (tests/fuzz/shard/: 0 none.json, else
 * zstd.json: a one-layer Llama made by `smp-convert init`, uncompressed or zstd), the
 * rest is shard-00000.h5. What a read returns must be the seed's tensor, bit for bit
 * (a changed byte is either not read or caught: no silent corruption), and verify must
 * pass exactly when the file is the seed's (the manifest holds its checksum: none.json
 * is a format-1 manifest, the whole file's XXH64; zstd.json a format-2 one, the XXH64
 * of its blocks' XXH3s, so that both are fuzzed). The seeds
 * (tests/fuzz/corpus/shard/seed-none, seed-zstd) give the reference tensors; run from
 * the repository root, or with SMP_FUZZ_ROOT set to it. */
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    char *json, *seed;    /* the manifest's text, the seed file's bytes */
    size_t json_len, seed_len;
    size_t n;             /* tensors */
    void **ref;           /* each tensor whole, in its dtype */
    size_t *ref_bytes;
} variant;

/* HDF5 1.10.8 (Debian 12's) leaks a message's copy when H5Dopen2 meets a malformed
 * layout message (128 bytes, allocated and lost inside libhdf5: H5D__layout_oh_read ->
 * H5O_msg_read): not ours to fix. Leaks whose allocation passes through libhdf5 are
 * not reported; smp's own still are. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libhdf5_serial\n"; }

/* HDF5 sizes its allocations from the file's numbers: a huge one fails (NULL, an
 * error HDF5 reports) as it does without the sanitizer, instead of stopping the run. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static variant var[2];
static char dir[64], man[96], file[96];

/* a whole file (libshard's reader), or the run stops saying which */
static char *slurp(const char *path, size_t *len)
{
    char *buf;
    if (shard_read_file(path, 1u << 20, &buf, len)) {
        fprintf(stderr, "fuzz_shard: %s (run from the repository root, or set SMP_FUZZ_ROOT)\n", shard_errmsg());
        abort();
    }
    return buf;
}

static void put(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) abort();
}

static void remove_dir(void)
{
    unlink(man);
    unlink(file);
    rmdir(dir);
}

static size_t whole(const shard_ckpt_tensor *t, shard_box *b)
{
    size_t n = shard_dtype_size(t->dtype);
    memset(b, 0, sizeof *b);
    b->ndim = t->ndim;
    for (int k = 0; k < t->ndim; k++) b->len[k] = t->shape[k], n *= (size_t)t->shape[k];
    return n;
}

static void load_reference(const char *root, int v, const char *name)
{
    char path[512];
    variant *x = &var[v];
    snprintf(path, sizeof path, "%s/tests/fuzz/shard/%s.json", root, name);
    x->json = slurp(path, &x->json_len);
    snprintf(path, sizeof path, "%s/tests/fuzz/corpus/shard/seed-%s", root, name);
    char *seed = slurp(path, &x->seed_len);
    x->seed = seed + 1, x->seed_len -= 1; /* past the variant byte */
    put(man, x->json, x->json_len);
    put(file, x->seed, x->seed_len);
    shard_ckpt *c;
    if (shard_ckpt_open(dir, &c) || shard_ckpt_verify(c, NULL)) {
        fprintf(stderr, "fuzz_shard: the %s seed does not open and verify: %s\n", name, shard_errmsg());
        abort();
    }
    x->n = shard_ckpt_tensor_count(c);
    x->ref = calloc(x->n, sizeof *x->ref);
    x->ref_bytes = calloc(x->n, sizeof *x->ref_bytes);
    for (size_t i = 0; i < x->n; i++) {
        const shard_ckpt_tensor *t = shard_ckpt_tensor_at(c, i);
        shard_box b;
        x->ref_bytes[i] = whole(t, &b);
        if (!(x->ref[i] = malloc(x->ref_bytes[i] + 1)) || shard_ckpt_read(c, i, &b, x->ref[i], t->dtype)) abort();
    }
    shard_ckpt_close(c);
}

static void init(void)
{
    snprintf(dir, sizeof dir, "/tmp/smp-fuzz-shard-XXXXXX");
    if (!mkdtemp(dir)) abort();
    snprintf(man, sizeof man, "%s/smp.json", dir);
    snprintf(file, sizeof file, "%s/shard-00000.h5", dir);
    atexit(remove_dir);
    const char *root = getenv("SMP_FUZZ_ROOT") ? getenv("SMP_FUZZ_ROOT") : ".";
    load_reference(root, 0, "none");
    load_reference(root, 1, "zstd");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0]) init();
    if (size < 1) return 0;
    const variant *x = &var[data[0] != 0];
    put(man, x->json, x->json_len);
    put(file, data + 1, size - 1);
    const int same = size - 1 == x->seed_len && !memcmp(data + 1, x->seed, x->seed_len);
    shard_ckpt *c;
    if (shard_ckpt_open(dir, &c)) {
        if (same || !shard_errmsg()[0]) abort(); /* the open checks the file's size, not its bytes */
        return 0;
    }
    for (size_t i = 0; i < x->n; i++) {
        const shard_ckpt_tensor *t = shard_ckpt_tensor_at(c, i);
        shard_box b;
        const size_t n = whole(t, &b);
        void *got = malloc(n + 1);
        if (!got) abort();
        if (shard_ckpt_read(c, i, &b, got, t->dtype) == SHARD_OK) {
            if (n != x->ref_bytes[i] || memcmp(got, x->ref[i], n)) abort(); /* silently wrong data */
        } else if (same || !shard_errmsg()[0]) {
            abort();
        }
        free(got);
    }
    if ((shard_ckpt_verify(c, NULL) == SHARD_OK) != same) abort();
    if (!same && !shard_errmsg()[0]) abort();
    shard_ckpt_close(c);
    return 0;
}
