#include "cli.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *g_cmd = "smp";

void cli_init(const char *cmd) { g_cmd = cmd; }
const char *cli_name(void) { return g_cmd; }

int cli_fail(shard_status s)
{
    const char *m = shard_errmsg();
    fprintf(stderr, "%s: error: %s\n", g_cmd, m && m[0] ? m : shard_status_name(s));
    return shard_status_exit_code(s);
}

int cli_usage(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: error: ", g_cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see %s --help)\n", g_cmd);
    return 2;
}

int cli_std_flags(int argc, char **argv, const char *help)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(help, stdout); return 1; }
        if (!strcmp(argv[i], "--version")) {
            printf("%s (smp) %s\nbackends: cpu%s\n", g_cmd, SHARD_VERSION_STRING,
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

int cli_parse_threads(const char *text)
{
    char *end;
    long th = strtol(text, &end, 10);
    return *end || end == text || th < 1 || th > 64 ? 0 : (int)th;
}
