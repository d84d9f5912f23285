/* What every smp command shares: the error line, exit codes, --help/--version. */
#ifndef SMP_CLI_H
#define SMP_CLI_H

#include "shard.h"

/* Name the command ("smp-inspect") for messages. */
void cli_init(const char *cmd);
const char *cli_name(void);
/* Under mpirun: this process's rank, so that a run's ranks print one error line
 * between them (see cli.c). */
void cli_set_rank(int rank);
/* Hold the next error line instead of printing it; cli_deferred(1) prints it, (0)
 * drops it (a process whose line another process prints for the run). */
void cli_defer(void);
void cli_deferred(int print);
/* Print "smp-x: error: <libshard's message>" and return the status's exit code. */
int cli_fail(shard_status s);
/* For the commands that write an output folder: SIGINT, SIGTERM and SIGHUP stop the
 * writers (shard_cancel), whose failure path removes the staging folder; a second
 * signal ends the process at once. cli_end(rc) at the end of main: after such a stop,
 * the process ends by the same signal (as a shell expects of an interrupted command). */
void cli_cancel_on_signals(void);
int cli_end(int rc);
/* Print "smp-x: error: <message>" plus a hint to --help; return 2. */
int cli_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Handle --help and --version anywhere in argv: print and return 1 (exit 0). */
int cli_std_flags(int argc, char **argv, const char *help);
/* Human-readable sizes: "1.50 GiB", "12.0 KiB", "512 B" (buf of 32 bytes). */
const char *cli_bytes(char buf[32], double bytes);
/* Thousands separators: "1,234,567" (buf of 32 bytes). */
const char *cli_count(char buf[32], unsigned long long n);

/* For the commands that write an output folder, before they start: a note for each
 * staging folder that an earlier write of out left beside it (killed before its commit:
 * a second Ctrl-C, SIGKILL, a crash), hidden and often a whole checkpoint's size.
 * Noted, not removed: it may be another process's write still running. */
void cli_note_leftovers(const char *out);

/* Worker threads by default: the cores, at most 16 (--threads: cli_int, 1..64). */
int cli_default_threads(void);

#endif
