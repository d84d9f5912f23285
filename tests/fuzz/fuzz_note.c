/* libFuzzer: the piece lines of a shard writer's note (libshard/ckpt/filehash.c,
 * shard_note_piece_parse), which the commit takes instead of scanning the file, on
 * arbitrary bytes: each line parses or is refused, and what parses is a piece. */
#include "../../libshard/core/internal.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    for (char *line = text, *nl; line; line = nl ? nl + 1 : NULL) {
        if ((nl = strchr(line, '\n'))) *nl = 0;
        char *end = line + strlen(line);
        shard_note_piece q;
        if (shard_note_piece_parse(line, &q)) continue;
        /* what was taken: names inside the line, non-empty, no '/' in the tensor's;
         * 1..SHARD_MAX_DIMS dims, none negative; a 16-character checksum */
        const char *s[4] = {q.group, q.name, q.dtype, q.hex};
        for (int k = 0; k < 4; k++)
            if (s[k] < line || s[k] > end) abort();
        if (!q.group[0] || !q.name[0] || strchr(q.name, '/') || strlen(q.hex) != 16 || q.ndim < 1 || q.ndim > SHARD_MAX_DIMS)
            abort();
        for (int k = 0; k < q.ndim; k++)
            if (q.off[k] < 0 || q.len[k] < 0 || q.gshape[k] < 0) abort();
    }
    free(text);
    return 0;
}
