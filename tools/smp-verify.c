/* smp-verify: every checksum (whole files and pieces) and coverage of a checkpoint. */
#include "cli/cli.h"
#include "shard.h"

#include <stdio.h>
#include <string.h>

static const char HELP[] =
    "usage: smp-verify CKPT\n"
    "\n"
    "Check a checkpoint: the manifest's rules (format, version, paths, every element\n"
    "stored exactly once), the xxh64 of every file, and the xxh64 of every piece's data.\n"
    "Names the damaged file. Exit codes: 0 whole, 3 invalid or corrupt, 1 I/O failure.\n";

int main(int argc, char **argv)
{
    cli_init("smp-verify");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    if (argc != 2 || argv[1][0] == '-') return cli_usage("expected exactly one CKPT");
    shard_ckpt *c;
    shard_status s = shard_ckpt_open(argv[1], &c);
    if (s) return cli_fail(s);
    uint64_t bytes = 0;
    s = shard_ckpt_verify(c, &bytes);
    size_t pieces = 0;
    for (size_t i = 0; i < shard_ckpt_tensor_count(c); i++) pieces += shard_ckpt_tensor_at(c, i)->npieces;
    char b[32], l[64];
    if (!s)
        printf("%s: ok: %zu tensors, %zu pieces, %s checked, layout %s\n", argv[1], shard_ckpt_tensor_count(c), pieces,
               cli_bytes(b, (double)bytes), shard_layout_format(shard_ckpt_layout(c), l, sizeof l));
    shard_ckpt_close(c);
    return s ? cli_fail(s) : 0;
}
