/* libFuzzer: smp-train's and smp-eval's token files and loss-mask files (train/data.c,
 * llm.c's format and smp's masks) on arbitrary bytes, through the reader alone.
 *
 * Input: byte 0 flags (bit 0: a mask file follows, bit 1: documents, bit 2: shuffled),
 * byte 1 the sequence length - 1 (mod 64), bytes 2-3 the vocabulary - 1 (little-endian),
 * bytes 4-5 where the token file's bytes end and the mask's begin (mod what is left),
 * then the bytes. What opens yields sequences whose inputs lie in the vocabulary and
 * whose targets lie in it or are -1 (not counted). */
#include "data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[64], tokens[96], masks[96];

static int put(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    const int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void check(const int32_t *in, const int32_t *tg, size_t n, int64_t vocab)
{
    for (size_t i = 0; i < n; i++)
        if (in[i] < 0 || in[i] >= vocab || tg[i] < -1 || tg[i] >= vocab) abort();
}

/* up to 3 sequences at a few places of the order and of the files: files that opened
 * (and did not change since) serve every position */
static void read_some(data_set *ds, int64_t vocab)
{
    const int S = ds->S;
    int32_t *in = malloc(3 * (size_t)S * sizeof *in), *tg = malloc(3 * (size_t)S * sizeof *tg);
    if (!in || !tg) abort();
    const int n = ds->nseq < 3 ? (int)ds->nseq : 3;
    const uint64_t at[] = {0, ds->nseq, 5 * ds->nseq + 1}; /* epochs past the first: the shuffle's */
    for (size_t k = 0; k < sizeof at / sizeof *at && n > 0; k++) {
        if (data_fill(ds, at[k], n, in, tg) != SHARD_OK) abort();
        check(in, tg, (size_t)n * S, vocab);
    }
    if (n > 0) {
        if (data_fill_sequential(ds, ds->nseq - (uint64_t)n, n, in, tg) != SHARD_OK) abort();
        check(in, tg, (size_t)n * S, vocab);
    }
    free(in);
    free(tg);
}

static void remove_dir(void)
{
    unlink(tokens);
    unlink(masks);
    rmdir(dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 6) return 0;
    if (!dir[0]) { /* the two files, rewritten by every input; gone at exit */
        snprintf(dir, sizeof dir, "/tmp/smp-fuzz-data-XXXXXX");
        if (!mkdtemp(dir)) abort();
        snprintf(tokens, sizeof tokens, "%s/tokens.bin", dir);
        snprintf(masks, sizeof masks, "%s/tokens.mask", dir);
        atexit(remove_dir);
    }
    const int flags = data[0], S = 1 + data[1] % 64;
    const int64_t vocab = 1 + (int64_t)(data[2] | data[3] << 8);
    const uint8_t *body = data + 6;
    const size_t n = size - 6, split = (flags & 1) && n ? (size_t)(data[4] | data[5] << 8) % (n + 1) : n;
    if (put(tokens, body, split) || put(masks, body + split, n - split)) abort();
    data_set ds;
    shard_status s = data_open(&ds, tokens, S, vocab);
    if (s == SHARD_OK && (flags & 1)) s = data_open_masks(&ds, masks);
    if (s == SHARD_OK) {
        if (flags & 2) data_set_documents(&ds, (int32_t)(vocab - 1));
        data_set_order(&ds, (flags & 4) != 0, 1234);
        read_some(&ds, vocab);
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    data_close(&ds); /* (a data set data_open refused is closed and zeroed already) */
    return 0;
}
