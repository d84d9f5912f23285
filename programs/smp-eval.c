/* smp-eval: mean loss and perplexity of a checkpoint over token files, on one rank or
 * (under mpirun, --layout) on the ranks of a parallel layout. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c/blas_pick.h"
#include "cli.h"
#include "launch.h"
#include "opts.h"
#include "progress.h"
#include "ckptio.h"
#include "data.h"
#include "eval.h"
#include "model.h"
#include "par.h"
#include "runcfg.h"

static const char HELP[] =
    "usage: smp-eval --ckpt CKPT|RUN_DIR --data TOKENS --batch B --seq S [--batches N] [--json]\n"
    "       mpirun -np N smp-eval --layout pp=P,tp=T,cp=C,dp=D ...\n"
    "\n"
    "Mean cross-entropy loss and perplexity of the checkpoint's parameters (fp32 compute)\n"
    "over sequential batches laid out as llm.c does: batch i takes B*S+1 consecutive\n"
    "tokens, row r being tokens [r*S, r*S+S] of them, targets shifted by one. With\n"
    "several files (comma-separated paths or globs) a sequence never spans two files.\n"
    "The weights are the checkpoint's parameters as stored (group params, e.g. bf16),\n"
    "not the fp32 master copy of a training checkpoint: what smp-merge exports.\n"
    "\n"
    "  --batches N   evaluate the first N batches (default: every whole batch)\n"
    "  --json        print {\"loss\", \"perplexity\", \"tokens\", \"batches\"} as one JSON object\n"
    "  --documents   the tokens are documents each ended by a separator: attention stays\n"
    "                inside a document, positions restart, a document's first token is\n"
    "                not a target (docs/TRAINING.md \"Fine-tuning\")\n"
    "  --doc-sep ID  the separator token (default: the config's eos_token_id)\n"
    "  --loss-mask FILES  one loss mask file per token file (0: not a target)\n"
    "  --read-together auto|yes|no  under mpirun: the ranks read the checkpoint together,\n"
    "                each chunk by one rank, an all-to-all handing every rank its part\n"
    "                (auto, the default: yes when the ranks span several hosts; ranks of\n"
    "                one host share its page cache and load faster alone)\n"
    "  --share-weights yes|no  under mpirun: the ranks of one host that hold the same\n"
    "                pieces (dp and cp replicas) keep one copy of them in shared memory\n"
    "                (a memfd; /dev/shm where memfd_create is refused), each loading\n"
    "                part of it (default yes)\n"
    "The loss is the mean over the counted targets; \"tokens\" counts them.\n";

/* The loss sum of NB batches of B rows over the ranks of the layout: each dp rank
 * takes its B/dp rows of every batch, each cp rank its tokens of them, the last
 * pipeline stage sums; the total over dp and cp, from the last stage, on every rank. */
static shard_status par_loss_sum(par_ctx *P, model *m, data_set *ds, int B, long long NB, int32_t *in, int32_t *tg,
                                 double *sum, uint64_t *ntok)
{
    const int dp = P->g.dp ? shard_comm_size(P->g.dp) : 1, Bm = B / dp;
    double total[2] = {0.0, 0.0}, one; /* the losses, the counted targets */
    shard_status s;
    for (long long i = 0; i < NB; i++) {
        if ((s = data_fill_sequential(ds, (uint64_t)i * (uint64_t)B + (uint64_t)P->g.me.dp * (uint64_t)Bm, Bm, in, tg))) return s;
        total[1] += (double)par_take_batch(m, Bm, in, tg);
        if ((s = par_forward(P, m, in, tg, &one))) return s;
        total[0] += one;
    }
    if ((s = par_allreduce_f64(P, P->g.dpcp, total, 2, SHARD_OP_SUM))) return s;
    if (P->nstages > 1 && (s = shard_comm_broadcast(P->g.pp, total, 2, SHARD_DT_F64, P->nstages - 1))) return s;
    *sum = total[0];
    *ntok = (uint64_t)total[1];
    return SHARD_OK;
}

static int eval_main(int argc, char **argv, par_ctx *P);

/* JSON has no inf or NaN: null (a perplexity past exp(709) is inf while its loss is finite) */
static const char *json_number(char buf[32], double v)
{
    if (isfinite(v)) snprintf(buf, 32, "%.17g", v);
    else snprintf(buf, 32, "null");
    return buf;
}

int main(int argc, char **argv)
{
    cli_init("smp-eval");
    blas_pick_kernels(argv); /* first: it may start the process again */
    if (cli_std_flags(argc, argv, HELP)) return 0;
    return launch_ranks(argc, argv, eval_main);
}

enum { O_CKPT, O_DATA, O_BATCH, O_SEQ, O_BATCHES, O_LAYOUT, O_JSON, O_DOCS, O_DOC_SEP, O_MASK, O_TOGETHER, O_SHARE, O_COUNT };
static const cli_opt OPTS[O_COUNT] = {{"--ckpt", 0},    {"--data", 0},      {"--batch", 0},
                                      {"--seq", 0},     {"--batches", 0},   {"--layout", 0},
                                      {"--json", 1},    {"--documents", 1}, {"--doc-sep", 0},
                                      {"--loss-mask", 0}, {"--read-together", 0},
                                      {"--share-weights", 0}};

static int eval_main(int argc, char **argv, par_ctx *P)
{
    const char *val[O_COUNT];
    int rc = cli_parse(argc, argv, 1, OPTS, O_COUNT, val, NULL, 0, NULL);
    if (rc) return rc;
    const char *ckpt = val[O_CKPT], *data = val[O_DATA], *layout = val[O_LAYOUT];
    const int json = val[O_JSON] != NULL;
    if (!ckpt || !data || !val[O_BATCH] || !val[O_SEQ]) return cli_usage("--ckpt, --data, --batch and --seq are required");
    int64_t b = 0, sq = 0, nb = -1; /* --batches: every whole batch by default */
    if ((rc = cli_int("--batch", val[O_BATCH], 1, 1 << 24, &b)) || (rc = cli_int("--seq", val[O_SEQ], 1, 1 << 24, &sq)) ||
        (rc = cli_int("--batches", val[O_BATCHES], 1, INT64_MAX, &nb)))
        return rc;
    const long B = (long)b, S = (long)sq;
    long long NB = nb;
    if ((long long)B * S > INT32_MAX / 4) return cli_usage("--batch * --seq is too large");
    shard_layout lay = {1, 1, 1, P->size, 1};
    if (layout && shard_layout_parse(layout, &lay)) return cli_usage("--layout: %s", shard_errmsg());
    if ((rc = launch_read_together(val[O_TOGETHER], P))) return rc;
    static const char *const YESNO[] = {"no", "yes", NULL};
    int share = 1;
    if ((rc = cli_choice("--share-weights", val[O_SHARE], YESNO, &share))) return rc;
    P->share_weights = share;
    char lb[64];
    if (shard_layout_size(&lay) != P->size)
        return cli_usage("--layout %s is a layout of %d ranks, but %d processes run (start them with mpirun -np %d)",
                         shard_layout_format(&lay, lb, sizeof lb), shard_layout_size(&lay), P->size, shard_layout_size(&lay));
    const int par = P->size > 1;
    if (B % lay.dp) return cli_usage("--batch %ld is not divisible by dp = %d", B, lay.dp);
    if (S % (2 * lay.cp) && lay.cp > 1) return cli_usage("--seq %ld is not divisible by 2 x cp = %d", S, 2 * lay.cp);
    const int me0 = P->rank == 0;
    model m;
    memset(&m, 0, sizeof m);
    dev D;
    memset(&D, 0, sizeof D);
    shard_ckpt *ck = NULL;
    data_set ds;
    memset(&ds, 0, sizeof ds);
    int32_t *in = NULL, *tg = NULL;
    int have = 0;
#define OUT(code) do { rc = (code); goto done; } while (0)
    shard_status s = dev_open(&D, "cpu", SHARD_DT_F32, 0);
    if (s) OUT(cli_fail(s));
    if ((s = ckptio_open_model(P->world, ckpt, &ck, &m, &D))) OUT(cli_fail(s));
    if (par) {
        /* every rank on the same checkpoint and settings (shard_agree_check), before the
         * first collective that depends on them */
        const shard_agree_item items[] = {
            {SHARD_AGREE_CKPT, ckpt, shard_ckpt_fingerprint(ck)}, SHARD_AGREE_LAYOUT(&lay),
            {SHARD_AGREE_INT, "--batch", (uint64_t)B}, {SHARD_AGREE_INT, "--seq", (uint64_t)S},
            {SHARD_AGREE_INT, "--batches (-1: all)", (uint64_t)NB},
            {SHARD_AGREE_INT, "--documents", val[O_DOCS] != NULL},
            {SHARD_AGREE_INT, "--read-together (-1: auto)", (uint64_t)(int64_t)P->read_together},
            {SHARD_AGREE_INT, "--share-weights (1: yes)", (uint64_t)P->share_weights},
        };
        if ((s = shard_agree_check(P->world, items, (int)(sizeof items / sizeof items[0]))))
            OUT(s == SHARD_E_USAGE ? cli_usage("%s", shard_errmsg()) : cli_fail(s));
        int stages[SHARD_MAX_PP];
        if ((s = shard_layout_check(&lay, &m.d))) OUT(cli_usage("--layout: %s", shard_errmsg()));
        if (shard_ckpt_layout(ck)->pp == lay.pp) memcpy(stages, shard_ckpt_stages(ck), (size_t)lay.pp * sizeof *stages);
        else if ((s = shard_stages_auto(&m.d, lay.pp, stages))) OUT(cli_fail(s));
        if ((s = par_setup(P, &lay, stages, 1, &m))) OUT(cli_fail(s));
    }
    if (me0) runcfg_warn_positions(cli_name(), S, &m.d);
    /* the inputs checked before the weights load */
    shard_comm *host = NULL; /* the ranks of a host split the checking of the files */
    if (par && (s = par_host(P, &host))) OUT(cli_fail(s));
    progress_watch pw = {0};
    if (me0) progress_watch_begin(&pw, "checking the token files", data_checked_bytes, NULL);
    s = data_open_on(&ds, data, (int)S, m.d.vocab, &(data_open_opts){.host = host});
    if (!s && val[O_MASK]) s = data_open_masks(&ds, val[O_MASK]);
    progress_watch_erase(&pw);
    if (s) OUT(cli_fail(s));
    const shard_agree_item tokens[] = {{SHARD_AGREE_DATA, data, data_fingerprint(&ds)}};
    if (par && (s = shard_agree_check(P->world, tokens, 1))) OUT(cli_fail(s));
    if (val[O_DOCS] || val[O_DOC_SEP]) {
        int32_t sep;
        int64_t given = -1;
        if (!val[O_DOCS]) OUT(cli_usage("--doc-sep is given without --documents"));
        if ((rc = cli_int("--doc-sep", val[O_DOC_SEP], 0, m.d.vocab - 1, &given))) goto done;
        if ((s = runcfg_doc_sep(&m.d, given, &sep))) OUT(cli_usage("%s", shard_errmsg()));
        data_set_documents(&ds, sep);
        model_set_documents(&m, sep);
    }
    const double t_load = now_seconds();
    shard_ckpt_set_threads(ck, ckptio_load_threads(P->size));
    shard_ckpt_set_uncached(ck, 1); /* the weights are read once, into fresh memory */
    if (me0) progress_watch_begin(&pw, "loading", progress_ckpt_bytes, ck);
    s = par ? par_read_params(P, ck, &m, "params", &have) : ckptio_read_group(ck, &m, "params", m.params, &have);
    progress_watch_erase(&pw);
    if (s) OUT(cli_fail(s));
    if (!have) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: holds no parameters", shard_ckpt_dir(ck))));
    if ((s = ckptio_print_load(cli_name(), P->world, ck, now_seconds() - t_load, P->moved))) OUT(cli_fail(s));
    shard_ckpt_unlock(ck); /* all read: a training run's --keep may prune it now */
    if (par) model_params_upload(&m);
    long long avail = (long long)(ds.nseq / (uint64_t)B);
    if (avail < 1)
        OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: %llu sequences of %ld+1 tokens: not one batch of %ld", data,
                                (unsigned long long)ds.nseq, S, B)));
    if (NB < 0) NB = avail;
    if (NB > avail)
        OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: --batches %lld asks for more than the %lld whole batches there are",
                                data, NB, avail)));
    const int rows = (int)B / lay.dp;
    if ((s = par ? model_alloc_slots(&m, rows, (int)S / lay.cp, P->nslots) : model_alloc_acts(&m, (int)B, (int)S))) OUT(cli_fail(s));
    in = malloc((size_t)rows * S * sizeof *in);
    tg = malloc((size_t)rows * S * sizeof *tg);
    if (!in || !tg) OUT(cli_fail(shard_fail(SHARD_E_NOMEM, "out of memory")));
    uint64_t ntok = 0;
    double sum = 0.0;
    model_aux_reset(&m);
    if (par) {
        if ((s = par_loss_sum(P, &m, &ds, (int)B, NB, in, tg, &sum, &ntok))) OUT(cli_fail(s));
    } else {
        model *one = &m;
        lanes ln = lanes_single(&one, (int)B);
        if ((s = eval_loss_sum(&ln, &ds, NB, in, tg, &sum, &ntok))) OUT(cli_fail(s));
    }
    if (!ntok) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: no token of the %lld batches is a counted target (--loss-mask, --documents)", data, NB)));
    double loss = sum / (double)ntok;
    double ppl = exp(loss);
    char aux[64] = ""; /* a mixture of experts: the load-balancing loss over every batch's tokens */
    if (m.E && par && (s = par_aux_reduce(P, &m))) OUT(cli_fail(s));
    char jl[32], jp[32], ja[32];
    if (m.E && json) snprintf(aux, sizeof aux, ", \"aux_loss\": %s", json_number(ja, model_aux_loss(&m)));
    else if (m.E) snprintf(aux, sizeof aux, "  aux loss %.6f", model_aux_loss(&m));
    if (me0 && json)
        printf("{\"loss\": %s, \"perplexity\": %s, \"tokens\": %llu, \"batches\": %lld%s}\n", json_number(jl, loss),
               json_number(jp, ppl), (unsigned long long)ntok, NB, aux);
    else if (me0)
        printf("loss %.6f  perplexity %.4f%s  (%llu tokens, %lld batches of %ld x %ld)\n", loss, ppl, aux,
               (unsigned long long)ntok, NB, B, S);
    if (!isfinite(loss)) OUT(cli_fail(shard_fail(SHARD_E_INVALID, "%s: the loss is not finite", shard_ckpt_dir(ck))));
done:
    free(in);
    free(tg);
    data_close(&ds);
    model_free(&m);
    par_release(P); /* before the backend it lives in */
    dev_close(&D);
    shard_ckpt_close(ck);
    return rc;
}
