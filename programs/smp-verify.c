/* smp-verify: every checksum (whole files and pieces) and coverage of a checkpoint. */
#include "cli.h"
#include "opts.h"
#include "progress.h"
#include "shard.h"

#include <jansson.h>
#include <stdio.h>

static const char HELP[] =
    "usage: smp-verify [--threads N] CKPT\n"
    "\n"
    "Check a checkpoint (a run folder: the checkpoint its latest names): the manifest's\n"
    "rules (format, version, paths, every element stored exactly once), the checksum of\n"
    "every file (format 2: the xxh64 of its 4 KiB blocks' xxh3; format 1: its xxh64), and\n"
    "the xxh64 of every piece's data.\n"
    "Each file is read once, front to back: its bytes go through the file's checksum, and\n"
    "each chunk of data is decoded there and checked against its own xxh3 and its piece's\n"
    "xxh64. --threads N: files checked at once (default: cores, <= 16). On a terminal, a\n"
    "progress line.\n"
    "Names the damaged file. Exit codes: 0 whole, 3 invalid or corrupt, 1 I/O failure.\n";

int main(int argc, char **argv)
{
    cli_init("smp-verify");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    static const cli_opt opts[] = {{"--threads", 0}};
    const char *threads_text, *pos[2];
    int npos, rc = cli_parse(argc, argv, 1, opts, 1, &threads_text, pos, 2, &npos);
    if (rc) return rc;
    int64_t threads = cli_default_threads();
    if ((rc = cli_int("--threads", threads_text, 1, 64, &threads))) return rc;
    if (npos != 1) return cli_usage("expected exactly one CKPT");
    const char *dir = pos[0];
    shard_ckpt *c;
    shard_status s = shard_ckpt_open_any(dir, &c);
    if (s) return cli_fail(s);
    shard_ckpt_set_threads(c, (int)threads);
    uint64_t bytes = 0, stored = 0;
    size_t fi;
    json_t *f;
    json_array_foreach(json_object_get(shard_ckpt_manifest_json(c), "files"), fi, f)
        stored += (uint64_t)json_integer_value(json_object_get(f, "bytes"));
    progress_watch pw; /* a terminal sees the chunks' bytes go by */
    progress_watch_start(&pw, "verifying", stored, progress_ckpt_bytes, c);
    s = shard_ckpt_verify(c, &bytes);
    progress_watch_stop(&pw, !s);
    size_t pieces = 0;
    for (size_t i = 0; i < shard_ckpt_tensor_count(c); i++) pieces += shard_ckpt_tensor_at(c, i)->npieces;
    char b[32], l[64];
    if (!s)
        printf("%s: ok: %zu tensors, %zu pieces, %s checked, layout %s\n", shard_ckpt_dir(c), shard_ckpt_tensor_count(c), pieces,
               cli_bytes(b, (double)bytes), shard_layout_format(shard_ckpt_layout(c), l, sizeof l));
    shard_ckpt_close(c);
    return s ? cli_fail(s) : 0;
}
