/* smp-eval: mean loss and perplexity of a checkpoint over token files (one rank). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tools/cli/cli.h"
#include "../tools/cli/progress.h"
#include "ckptio.h"
#include "data.h"
#include "eval.h"
#include "model.h"

static const char HELP[] =
    "usage: smp-eval --ckpt CKPT|RUN_DIR --data TOKENS --batch B --seq S [--batches N] [--json]\n"
    "\n"
    "Mean cross-entropy loss and perplexity of the checkpoint's parameters (fp32 compute)\n"
    "over sequential batches laid out as llm.c does: batch i takes B*S+1 consecutive\n"
    "tokens, row r being tokens [r*S, r*S+S] of them, targets shifted by one. With\n"
    "several files (comma-separated paths or globs) a sequence never spans two files.\n"
    "The weights are the checkpoint's parameters as stored (group params, e.g. bf16),\n"
    "not the fp32 master copy of a training checkpoint: what smp-merge exports.\n"
    "\n"
    "  --batches N   evaluate the first N batches (default: every whole batch)\n"
    "  --json        print {\"loss\", \"perplexity\", \"tokens\", \"batches\"} as one JSON object\n";

int main(int argc, char **argv)
{
    cli_init("smp-eval");
    if (cli_std_flags(argc, argv, HELP)) return 0;
    const char *ckpt = NULL, *data = NULL, *batch = NULL, *seq = NULL, *batches = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char **slot = NULL;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--ckpt")) slot = &ckpt;
        else if (!strcmp(argv[i], "--data")) slot = &data;
        else if (!strcmp(argv[i], "--batch")) slot = &batch;
        else if (!strcmp(argv[i], "--seq")) slot = &seq;
        else if (!strcmp(argv[i], "--batches")) slot = &batches;
        else return cli_usage("unknown option %s", argv[i]);
        if (i + 1 >= argc) return cli_usage("%s needs a value", argv[i]);
        *slot = argv[++i];
    }
    if (!ckpt || !data || !batch || !seq) return cli_usage("--ckpt, --data, --batch and --seq are required");
    char *end;
    long B = strtol(batch, &end, 10);
    if (*end || B < 1 || B > (1 << 24)) return cli_usage("--batch must be a positive integer");
    long S = strtol(seq, &end, 10);
    if (*end || S < 1 || S > (1 << 24)) return cli_usage("--seq must be a positive integer");
    if ((long long)B * S > INT32_MAX / 4) return cli_usage("--batch * --seq is too large");
    long long NB = -1;
    if (batches) {
        NB = strtoll(batches, &end, 10);
        if (*end || NB < 1) return cli_usage("--batches must be a positive integer");
    }
    model m;
    memset(&m, 0, sizeof m);
    dev D;
    memset(&D, 0, sizeof D);
    shard_ckpt *ck = NULL;
    data_set ds;
    memset(&ds, 0, sizeof ds);
    int32_t *in = NULL, *tg = NULL;
    int rc = 0, have = 0;
#define OUT(code) do { rc = (code); goto done; } while (0)
    shard_status s = dev_open(&D, "cpu", SHARD_DT_F32, 0);
    if (s) OUT(cli_fail(s));
    if ((s = ckptio_open_model(ckpt, &ck, &m, &D))) OUT(cli_fail(s));
    const double t_load = now_seconds();
    shard_ckpt_set_threads(ck, ckptio_load_threads(1));
    if ((s = ckptio_read_group(ck, &m, "params", m.params, &have))) OUT(cli_fail(s));
    if (!have) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: holds no parameters", shard_ckpt_dir(ck))));
    if ((s = ckptio_print_load(NULL, ck, now_seconds() - t_load))) OUT(cli_fail(s));
    if ((s = data_open(&ds, data, (int)S, m.d.vocab))) OUT(cli_fail(s));
    long long avail = (long long)(ds.nseq / (uint64_t)B);
    if (avail < 1)
        OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: %llu sequences of %ld+1 tokens: not one batch of %ld", data,
                                (unsigned long long)ds.nseq, S, B)));
    if (NB < 0) NB = avail;
    if (NB > avail)
        OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: --batches %lld asks for more than the %lld whole batches there are",
                                data, NB, avail)));
    if ((s = model_alloc_acts(&m, (int)B, (int)S))) OUT(cli_fail(s));
    in = malloc((size_t)B * S * sizeof *in);
    tg = malloc((size_t)B * S * sizeof *tg);
    if (!in || !tg) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));
    uint64_t ntok;
    double loss = eval_loss_sum(&m, &ds, (int)B, NB, in, tg, &ntok) / (double)ntok;
    double ppl = exp(loss);
    if (json)
        printf("{\"loss\": %.17g, \"perplexity\": %.17g, \"tokens\": %llu, \"batches\": %lld}\n", loss, ppl,
               (unsigned long long)ntok, NB);
    else
        printf("loss %.6f  perplexity %.4f  (%llu tokens, %lld batches of %ld x %ld)\n", loss, ppl,
               (unsigned long long)ntok, NB, B, S);
    if (!isfinite(loss)) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: the loss is not finite", shard_ckpt_dir(ck))));
done:
    free(in);
    free(tg);
    data_close(&ds);
    model_free(&m);
    dev_close(&D);
    shard_ckpt_close(ck);
    return rc;
}
