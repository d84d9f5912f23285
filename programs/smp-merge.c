/* smp-merge: an SMP checkpoint of any layout -> a Hugging Face model folder
 * (config.json, safetensors weights with an index when split, the extra files),
 * ready for transformers.from_pretrained. The work is convert/'s (merge.h); here:
 * the options and the messages. */
#include "cli.h"
#include "merge.h"
#include "opts.h"
#include "progress.h"
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char HELP[] =
    "usage: smp-merge --in CKPT --out HF_DIR [--dtype keep|bf16|fp16|fp32] [--max-shard-size 5GB]\n"
    "                 [--threads N] [--no-fsync]\n"
    "\n"
    "Merge a checkpoint (any layout; a run folder: the checkpoint its latest names) into a\n"
    "Hugging Face model folder: config.json as it was given to hf2smp (its torch_dtype, or\n"
    "dtype, set to the weights' dtype where --dtype or hf2smp changed it), the weights as\n"
    "safetensors (split into files of at most --max-shard-size, with\n"
    "model.safetensors.index.json, when larger), and the model folder's other files\n"
    "(tokenizer, generation config, ...). --dtype fp16 refuses a weight beyond +-65504,\n"
    "which fp16 would store as inf. The folder appears only when whole (written under a\n"
    "temporary name, every file and the folder fsynced, then renamed; SIGINT, SIGTERM or\n"
    "SIGHUP remove the unfinished one). --no-fsync skips the fsyncs: the folder still\n"
    "appears only when whole, but is not yet safe from a power loss or an OS crash (scratch\n"
    "disks, a later `sync`). --threads N: threads that read, decompress and check the\n"
    "checkpoint's chunks (default: cores + 1, <= 17: one more beside the writer thread).\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    uint64_t mul = 1;
    if (!strcmp(end, "") || !strcmp(end, "B")) mul = 1;
    else if (!strcmp(end, "KB")) mul = 1000;
    else if (!strcmp(end, "MB")) mul = 1000000;
    else if (!strcmp(end, "GB")) mul = 1000000000;
    else if (!strcmp(end, "KiB")) mul = 1024;
    else if (!strcmp(end, "MiB")) mul = 1 << 20;
    else if (!strcmp(end, "GiB")) mul = 1 << 30;
    else return -1;
    double b = v * (double)mul; /* nan, inf and sizes under one byte or over 2^62 are refused */
    if (!(b >= 1.0 && b <= 4.6e18)) return -1;
    *out = (uint64_t)b;
    return 0;
}

enum { O_IN, O_OUT, O_DTYPE, O_MAX_SHARD_SIZE, O_THREADS, O_NO_FSYNC, O_COUNT };
static const cli_opt OPTS[O_COUNT] = {{"--in", 0}, {"--out", 0}, {"--dtype", 0}, {"--max-shard-size", 0}, {"--threads", 0}, {"--no-fsync", 1}};

int main(int argc, char **argv)
{
    cli_init("smp-merge");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    const char *val[O_COUNT];
    int rc = cli_parse(argc, argv, 1, OPTS, O_COUNT, val, NULL, 0, NULL);
    if (rc) return rc;
    const char *in = val[O_IN], *out = val[O_OUT], *maxs = val[O_MAX_SHARD_SIZE] ? val[O_MAX_SHARD_SIZE] : "5GB";
    if (!in || !out) return cli_usage("--in and --out are required");
    char out_buf[4096]; /* "export/" is the folder export */
    size_t ol = strlen(out);
    if (ol >= sizeof out_buf) return cli_usage("--out: path too long");
    memcpy(out_buf, out, ol + 1);
    while (ol > 1 && out_buf[ol - 1] == '/') out_buf[--ol] = 0;
    out = out_buf;
    /* One reader more than the cores: the writer thread takes a core from a reader
     * while the others wait for it at the block's end. On 2 cores (by hand, 2026-12-05,
     * 1.5 GB): 0.54-0.61 -> 0.50-0.52 s, zstd 0.85-0.93 -> 0.81-0.84 s (the cores busy
     * 1.45 -> 1.55 of 2); 4 readers 0.52-0.54 s. */
    int64_t threads = cli_default_threads() + 1;
    static const char *const dtypes[] = {"keep", "bf16", "fp16", "fp32", NULL};
    static const shard_dtype as[] = {SHARD_DT_INVALID, SHARD_DT_BF16, SHARD_DT_F16, SHARD_DT_F32};
    int dt = 0;
    if ((rc = cli_int("--threads", val[O_THREADS], 1, 64, &threads)) || (rc = cli_choice("--dtype", val[O_DTYPE], dtypes, &dt)))
        return rc;
    progress pg = {.label = "merging"};
    merge_opts o = {as[dt], 0, (int)threads, val[O_NO_FSYNC] != NULL, {progress_cb_start, progress_cb_add, progress_cb_end, &pg}};
    if (parse_size(maxs, &o.max_file_bytes)) return cli_usage("--max-shard-size \"%s\": expected e.g. 5GB, 500MB, 200KB", maxs);
    double t0 = now_seconds();
    int nfiles = 0;
    cli_cancel_on_signals();
    cli_note_leftovers(out);
    shard_status s = merge_run(in, out, &o, &nfiles);
    if (s) return cli_end(cli_fail(s));
    fprintf(stderr, "%s: %s written in %.2fs (%d file%s)\n", cli_name(), out, now_seconds() - t0, nfiles, nfiles == 1 ? "" : "s");
    return 0;
}
