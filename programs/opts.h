/* programs/opts.h: the one option parser of every smp command: a table of options
 * (a value option or a flag), the last occurrence of an option winning, and checked
 * conversions of the values. Every function that can fail prints the usage line
 * (cli_usage) and returns its exit code, 2; 0 on success. */
#ifndef SMP_OPTS_H
#define SMP_OPTS_H

#include <stdint.h>

typedef struct {
    const char *name; /* "--in" */
    int flag;         /* 1: takes no value (its value becomes "1") */
} cli_opt;

/* argv[first..argc) against opts[n]: val[k] = the value of opts[k] or NULL. Words
 * that are not options go to pos[] (at most maxpos of them; pos may be NULL with
 * maxpos 0); *npos their count (npos may be NULL). A lone "-" is a word. */
int cli_parse(int argc, char **argv, int first, const cli_opt *opts, int n, const char **val, const char **pos,
              int maxpos, int *npos);

/* text (the value of option `opt`, which may be NULL: nothing happens) as an integer
 * in [lo, hi] / a finite number in [lo, hi] / one of choices[] (NULL-terminated:
 * *out = its index). */
int cli_int(const char *opt, const char *text, int64_t lo, int64_t hi, int64_t *out);
int cli_float(const char *opt, const char *text, double lo, double hi, float *out);
int cli_choice(const char *opt, const char *text, const char *const *choices, int *out);

#endif
