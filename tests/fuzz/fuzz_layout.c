/* libFuzzer: the layout strings of every command's --layout ("pp=2,tp=4,..."), on
 * arbitrary bytes: what parses is in bounds, survives its own format, and maps every
 * rank to coordinates and back. */
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
    free(text);
    return 0;
}
