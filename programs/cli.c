#include "cli.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *openblas_get_corename(void); /* OpenBLAS's; not declared in every cblas.h */

static const char *g_cmd = "smp";

static void error_line(const char *msg, const char *tail, int secondhand);

/* Output that was not written is a failure, not a success with a short file
 * (`smp-eval --json > r.json` on a full disk): checked once at exit, as coreutils'
 * close_stdout does. */
static void check_stdout(void)
{
    const int flushed = fflush(stdout) == 0, e = errno;
    if (flushed && !ferror(stdout)) return;
    char msg[256];
    snprintf(msg, sizeof msg, "standard output: a write failed%s%s", flushed ? "" : ": ", flushed ? "" : strerror(e));
    error_line(msg, "", 0);
    _exit(1);
}

void cli_init(const char *cmd)
{
    g_cmd = cmd;
    atexit(check_stdout);
}
const char *cli_name(void) { return g_cmd; }

static int g_rank = 0; /* under mpirun: this process's rank (cli_set_rank) */
static int g_defer = 0;  /* keep the error line until cli_deferred says whether to print it */
static char g_deferred[4096];

void cli_set_rank(int rank) { g_rank = rank; }
void cli_defer(void) { g_defer = 1; }

void cli_deferred(int print)
{
    if (print && g_deferred[0]) (void)!write(2, g_deferred, strlen(g_deferred));
    g_deferred[0] = 0;
    g_defer = 0;
}

/* One error line, in one write (ranks sharing a terminal do not interleave inside a
 * line). Under mpirun, rank r > 0 waits r x 100 ms first: a rank that fails earlier in
 * rank order (all of them, when the input is bad for all) prints and ends the run
 * (MPI_Abort) before the others print theirs, so the run says it once; a rank that
 * only learned of another's failure (shard_err_secondhand) waits longest. */
static void error_line(const char *msg, const char *tail, int secondhand)
{
    char line[4096];
    int n = snprintf(line, sizeof line, "%s: error: %s%s\n", g_cmd, msg, tail);
    if (n < 0) return;
    if (n >= (int)sizeof line) { n = (int)sizeof line - 1; line[n - 1] = '\n'; }
    if (g_defer) { memcpy(g_deferred, line, (size_t)n + 1); return; }
    if (g_rank > 0) usleep((useconds_t)(g_rank < 64 ? g_rank : 64) * 100000u);
    /* another rank's failure: that rank prints its own line and ends the run; this
     * one speaks only if it did not. 20 s: on a loaded 2-core machine Open MPI took
     * more than 7 s (the wait before) to kill the others after rank 0's MPI_Abort, and
     * the run printed its one line twice */
    if (secondhand) usleep(200 * 100000u);
    fflush(stderr);
    (void)!write(2, line, (size_t)n);
}

int cli_fail(shard_status s)
{
    const char *m = shard_errmsg();
    error_line(m && m[0] ? m : shard_status_name(s), s == SHARD_E_CANCELLED ? "; the unfinished output was removed" : "",
               shard_err_secondhand());
    return shard_status_exit_code(s);
}

static void on_cancel(int sig) { shard_cancel(sig); }

void cli_cancel_on_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_cancel;
    sa.sa_flags = SA_RESETHAND; /* the second one: the default, at once */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

int cli_end(int rc)
{
    const int sig = shard_cancelled();
    if (!rc || sig <= 0) return rc;
    fflush(stdout);
    signal(sig, SIG_DFL);
    raise(sig);
    return rc; /* a signal whose default is not to end the process */
}

int cli_usage(const char *fmt, ...)
{
    char msg[3072], tail[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(tail, sizeof tail, " (see %s --help)", g_cmd);
    error_line(msg, tail, 0);
    return 2;
}

int cli_std_flags(int argc, char **argv, const char *help)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(help, stdout); return 1; }
        if (!strcmp(argv[i], "--version")) {
            printf("%s (smp) %s\nbackends: cpu (OpenBLAS %s kernels)%s\n", g_cmd, SHARD_VERSION_STRING,
                   openblas_get_corename(),
#ifdef SMP_HAVE_CUDA
                   ", cuda"
#else
                   ""
#endif
            );
            return 1;
        }
    }
    return 0;
}

const char *cli_bytes(char buf[32], double b)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int k = 0;
    while (b >= 1024 && k < 5) { b /= 1024; k++; }
    if (k == 0) snprintf(buf, 32, "%.0f B", b);
    else snprintf(buf, 32, b < 10 ? "%.2f %s" : b < 100 ? "%.1f %s" : "%.0f %s", b, u[k]);
    return buf;
}

void cli_note_leftovers(const char *out)
{
    char **paths, b[32];
    size_t n;
    if (shard_staging_leftovers(out, &paths, &n)) return; /* a note only */
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, "%s: note: %s (%s) is left from an earlier write of %s that did not finish; delete it unless "
                        "that write is still running\n", g_cmd, paths[i], cli_bytes(b, (double)shard_tree_bytes(paths[i])), out);
    shard_free_names(paths, n);
}

const char *cli_count(char buf[32], unsigned long long n)
{
    char t[32];
    int len = snprintf(t, sizeof t, "%llu", n), o = 0;
    for (int i = 0; i < len; i++) {
        buf[o++] = t[i];
        if ((len - i - 1) % 3 == 0 && i != len - 1) buf[o++] = ',';
    }
    buf[o] = 0;
    return buf;
}

int cli_default_threads(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 16 ? 16 : (int)n;
}
