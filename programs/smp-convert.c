/* smp-convert: Hugging Face weights -> SMP checkpoint (hf2smp), any SMP layout -> any
 * other (reshard), a new model (init); the work is convert/'s (convert.h), under
 * mpirun shared by the processes. Here: the options, the launch and the messages. */
#include "cli.h"
#include "convert.h"
#include "launch.h"
#include "opts.h"
#include "progress.h"
#include "shard.h"

#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char HELP[] =
    "usage: smp-convert hf2smp  --in HF_DIR --out CKPT --layout pp=P,tp=T[,cp=C][,dp=D]\n"
    "                           [--stages auto|8,8,7,9] [--dtype keep|bf16|fp32] [--compress zstd[:N]|none]\n"
    "                           [--threads N] [--no-fsync]\n"
    "       smp-convert reshard --in CKPT --out CKPT2 --layout ... [--stages ...] [--dtype ...] [--compress ...]\n"
    "       smp-convert init    --config config.json --out CKPT --layout ... [--seed N] [--dtype ...] [...]\n"
    "\n"
    "hf2smp   shard a Hugging Face model folder (config.json, safetensors weights, tokenizer\n"
    "         and other files) into an SMP checkpoint laid out for pp x tp x cp x dp ranks.\n"
    "reshard  turn a checkpoint of any layout into one of another layout (--in a run\n"
    "         folder: the checkpoint its latest names).\n"
    "init     a new model from a config.json, initialized as transformers does (normal\n"
    "         weights with std initializer_range, norms at one), the same in every layout.\n"
    "\n"
    "--threads N  worker threads that convert, shuffle and compress chunks (default: cores, <= 16)\n"
    "--no-fsync   do not fsync (nor start writeback of) the files and folders written: the\n"
    "             output still appears only when whole, but is not yet safe from a power loss\n"
    "             or an OS crash. For scratch disks, outputs made durable by a later `sync`,\n"
    "             and benchmarks that compare with a plain `cp` (which does not fsync).\n"
    "\n"
    "The output appears only when whole (written under a temporary name, then renamed;\n"
    "SIGINT, SIGTERM or SIGHUP remove the unfinished one);\n"
    "by default every file and folder is fsynced before the rename, and the parent after.\n"
    "Exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid or corrupt input.\n";

static const char *const SUBCOMMANDS[] = {"hf2smp", "reshard", "init", NULL};
enum { HF2SMP, RESHARD, INIT };

/* the options; the last two are init's alone */
enum { O_IN, O_OUT, O_LAYOUT, O_STAGES, O_DTYPE, O_COMPRESS, O_THREADS, O_NO_FSYNC, O_SEED, O_CONFIG, O_COUNT };
static const cli_opt OPTS[O_COUNT] = {
    {"--in", 0}, {"--out", 0}, {"--layout", 0}, {"--stages", 0}, {"--dtype", 0}, {"--compress", 0},
    {"--threads", 0}, {"--no-fsync", 1}, {"--seed", 0}, {"--config", 0},
};

typedef struct {
    int cmd;          /* HF2SMP, RESHARD or INIT */
    const char *in;   /* init: the config.json */
    uint64_t seed;
    convert_opts o;
} args;

static int parse_args(int argc, char **argv, int cmd, args *a)
{
    const char *val[O_COUNT] = {0}; /* hf2smp and reshard parse only up to O_SEED: the rest stays NULL */
    int rc = cli_parse(argc, argv, 2, OPTS, cmd == INIT ? O_COUNT : O_SEED, val, NULL, 0, NULL);
    if (rc) return rc;
    memset(a, 0, sizeof *a);
    a->cmd = cmd;
    a->in = val[O_CONFIG] ? val[O_CONFIG] : val[O_IN];
    a->o = (convert_opts){.out = val[O_OUT], .layout = val[O_LAYOUT], .stages = val[O_STAGES] ? val[O_STAGES] : "auto",
                          .compress = val[O_COMPRESS] ? val[O_COMPRESS] : "zstd", .dtype = SHARD_DT_INVALID,
                          .threads = cli_default_threads(), .no_fsync = val[O_NO_FSYNC] != NULL};
    if (!a->in || !a->o.out || !a->o.layout)
        return cli_usage(cmd == INIT ? "--config, --out and --layout are required" : "--in, --out and --layout are required");
    static const char *const dtypes[] = {"keep", "bf16", "fp32", NULL};
    static const shard_dtype as[] = {SHARD_DT_INVALID, SHARD_DT_BF16, SHARD_DT_F32};
    int dt = 0;
    int64_t threads = a->o.threads;
    if ((rc = cli_choice("--dtype", val[O_DTYPE], dtypes, &dt)) || (rc = cli_int("--threads", val[O_THREADS], 1, 64, &threads)))
        return rc;
    a->o.dtype = as[dt];
    a->o.threads = (int)threads;
    const char *seed = val[O_SEED] ? val[O_SEED] : "0";
    char *end;
    a->seed = strtoull(seed, &end, 10); /* the full 64 bits: more than cli_int's range */
    if (*end || !seed[0]) return cli_usage("--seed must be a non-negative integer");
    return 0;
}

/* Under mpirun the output ranks are split over the processes (rank r is written by
 * process r mod size); process 0 makes the staging folder and commits. Without
 * mpirun there is no MPI at all (no singleton start-up cost). */
static int run_command(const args *a, shard_comm *world, int *secondhand)
{
    const int me = world ? shard_comm_rank(world) : 0;
    double t0 = now_seconds();
    convert_source src;
    shard_status s = a->cmd == INIT ? convert_open_init(a->in, a->seed, &src)
                     : a->cmd == HF2SMP ? convert_open_hf(a->in, &src) : convert_open_ckpt(a->in, world, &src);
    if (world) s = shard_comm_agree(world, s, "another process failed", secondhand); /* all go on, or none */
    if (!s && me == 0) cli_note_leftovers(a->o.out);
    progress pg = {.label = "writing"};
    convert_opts o = a->o;
    o.world = world;
    o.progress = (convert_progress){progress_cb_start, progress_cb_add, progress_cb_end, &pg};
    if (!s) s = convert_run(&o, &src, secondhand);
    convert_source_close(&src);
    if (s) return s == SHARD_E_USAGE ? cli_usage("%s", shard_errmsg()) : cli_fail(s); /* a process's other flags */
    if (me == 0)
        fprintf(stderr, "%s: %s written in %.2fs%s\n", cli_name(), o.out, now_seconds() - t0, world ? " (several processes)" : "");
    return 0;
}

int main(int argc, char **argv)
{
    cli_init("smp-convert");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    if (argc < 2) return cli_usage("missing subcommand (hf2smp, reshard or init)");
    int cmd = 0;
    for (; SUBCOMMANDS[cmd] && strcmp(argv[1], SUBCOMMANDS[cmd]); cmd++) {}
    if (!SUBCOMMANDS[cmd]) return cli_usage("unknown subcommand \"%s\" (hf2smp, reshard or init)", argv[1]);
    args a;
    int rc = parse_args(argc, argv, cmd, &a);
    if (rc) return rc;
    const int mpi = launched_by_mpirun();
    shard_comm *world = NULL;
    if (mpi) {
        MPI_Init(&argc, &argv);
        shard_status s = shard_comm_mpi_world(&world);
        if (s) { rc = cli_fail(s); MPI_Abort(MPI_COMM_WORLD, rc); return rc; }
        if (shard_comm_size(world) == 1) { shard_comm_free(world); world = NULL; }
    }
    cli_cancel_on_signals(); /* after MPI_Init: ours, not the library's */
    if (!world) {
        rc = run_command(&a, NULL, NULL);
    } else {
        const int me = shard_comm_rank(world), procs = shard_comm_size(world);
        cli_defer(); /* one error line for the run: the lowest process that failed first-hand prints its own */
        int secondhand = 0;
        rc = run_command(&a, world, &secondhand);
        int32_t v = rc && !secondhand ? procs - me : 0, code = rc; /* the highest v: the lowest such process */
        if (shard_comm_allreduce(world, &v, 1, SHARD_DT_I32, SHARD_OP_MAX)) {
            cli_deferred(1); /* no agreement: each speaks for itself */
        } else {
            const int first = v ? procs - (int)v : 0; /* none: the commit happened on process 0 */
            cli_deferred(v && first == me);
            if (!shard_comm_broadcast(world, &code, 1, SHARD_DT_I32, first)) rc = code; /* everyone ends with its code */
        }
        shard_comm_free(world);
    }
    if (mpi) MPI_Finalize();
    return cli_end(rc);
}
