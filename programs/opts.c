/* programs/opts.c: the option parser (opts.h). */
#include "opts.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

int cli_parse(int argc, char **argv, int first, const cli_opt *opts, int n, const char **val, const char **pos,
              int maxpos, int *npos)
{
    int np = 0;
    for (int k = 0; k < n; k++) val[k] = NULL;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (!a[0]) return cli_usage("\"\": an empty argument"); /* a path "" would mean the current or root folder */
        if (a[0] != '-' || !a[1]) {
            if (np >= maxpos) return cli_usage(maxpos ? "unexpected argument \"%s\"" : "unexpected argument \"%s\" (options start with --)", a);
            pos[np++] = a;
            continue;
        }
        int k = 0;
        while (k < n && strcmp(a, opts[k].name)) k++;
        if (k == n) return cli_usage("unknown option %s", a);
        if (opts[k].flag) {
            val[k] = "1";
            continue;
        }
        if (i + 1 >= argc) return cli_usage("%s needs a value", a);
        if (!argv[i + 1][0]) return cli_usage("%s \"\": an empty value", a);
        val[k] = argv[++i];
    }
    if (npos) *npos = np;
    return 0;
}

int cli_int(const char *opt, const char *text, int64_t lo, int64_t hi, int64_t *out)
{
    if (!text) return 0;
    char *end;
    errno = 0;
    long long x = strtoll(text, &end, 10);
    if (errno || end == text || *end || x < lo || x > hi)
        return cli_usage("%s must be an integer in %lld..%lld, got \"%s\"", opt, (long long)lo, (long long)hi, text);
    *out = x;
    return 0;
}

int cli_float(const char *opt, const char *text, double lo, double hi, float *out)
{
    if (!text) return 0;
    char *end;
    double x = strtod(text, &end);
    if (end == text || *end || !(x >= lo && x <= hi))
        return cli_usage("%s must be a number in [%g, %g], got \"%s\"", opt, lo, hi, text);
    *out = (float)x;
    return 0;
}

int cli_choice(const char *opt, const char *text, const char *const *choices, int *out)
{
    if (!text) return 0;
    int n = 0;
    for (; choices[n]; n++)
        if (!strcmp(text, choices[n])) {
            *out = n;
            return 0;
        }
    char list[256] = "";
    size_t len = 0;
    for (int k = 0; k < n && len < sizeof list; k++)
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", k ? (k == n - 1 ? " or " : ", ") : "", choices[k]);
    return cli_usage("%s must be %s, got \"%s\"", opt, list, text);
}
