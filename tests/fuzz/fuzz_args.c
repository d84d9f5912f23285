/* libFuzzer: the strings of the commands' arguments that libshard parses, on arbitrary
 * bytes: --layout ("pp=2,tp=4,..."): what parses is in bounds, survives its own
 * format, and maps ranks to coordinates and back; --stages ("auto" or layer counts, for
 * a 12-layer model): what parses gives each stage a layer or more, all 12 in all;
 * --compress ("none", "zstd", "zstd:N"): what parses is a level of 0..19. */
#include "shard.h"

#include <stdlib.h>
#include <string.h>

static void check_ranks(const shard_layout *l)
{
    const int n = shard_layout_size(l);
    if (n < 1 || n > (1 << 20)) abort();
    const int probe[] = {0, 1, n / 2, n - 2, n - 1};
    for (size_t i = 0; i < sizeof probe / sizeof *probe; i++) {
        if (probe[i] < 0 || probe[i] >= n) continue;
        const shard_coords c = shard_layout_coords(l, probe[i]);
        if (c.pp < 0 || c.pp >= l->pp || c.tp < 0 || c.tp >= l->tp || c.cp < 0 || c.cp >= l->cp || c.dp < 0 ||
            c.dp >= l->dp || shard_layout_rank(l, c) != probe[i])
            abort();
    }
    const shard_coords out = shard_layout_coords(l, n); /* one past the last rank: none */
    if (out.pp != -1 || shard_layout_rank(l, out) >= 0) abort();
}

static void check_stages(const char *text, int pp)
{
    shard_model_desc d;
    memset(&d, 0, sizeof d);
    d.hidden = 64; d.intermediate = 128; d.layers = 12; d.heads = 4; d.kv_heads = 2; d.head_dim = 16; d.vocab = 100;
    int st[SHARD_MAX_PP];
    if (shard_stages_parse(text, &d, pp, st) == SHARD_OK) {
        long long sum = 0;
        for (int i = 0; i < pp; i++) {
            if (st[i] < 1) abort();
            sum += st[i];
        }
        if (sum != d.layers) abort();
    } else if (!shard_errmsg()[0]) {
        abort();
    }
}

static void check_compress(const char *text)
{
    shard_compress c;
    if (shard_compress_parse(text, &c) == SHARD_OK) {
        if (c.zstd_level < 0 || c.zstd_level > 19 || c.threads != 1 || c.no_fsync) abort();
    } else if (!shard_errmsg()[0]) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    shard_layout l;
    if (shard_layout_parse(text, &l) == SHARD_OK) {
        const int dims[] = {l.pp, l.tp, l.cp, l.dp};
        for (int i = 0; i < 4; i++)
            if (dims[i] < 1 || dims[i] > 65536) abort();
        if (shard_layout_ep(&l) < 1 || shard_layout_ep(&l) > 65536) abort(); /* SHARD_MAX_EP: shard_layout_check's */
        check_ranks(&l);
        char buf[96];
        shard_layout back;
        if (shard_layout_parse(shard_layout_format(&l, buf, sizeof buf), &back) != SHARD_OK || back.pp != l.pp ||
            back.tp != l.tp || back.cp != l.cp || back.dp != l.dp || shard_layout_ep(&back) != shard_layout_ep(&l))
            abort();
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    check_stages(text, size ? 1 + data[0] % 14 : 1); /* pp past the 12 layers too */
    check_compress(text);
    free(text);
    return 0;
}
