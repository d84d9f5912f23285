/* train/loop.c: a training run and its loop (loop.h). */
#include "loop.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptio.h"
#include "eval.h"
#include "fp8.h"
#include "prefault.h"
#include "runcfg.h"

/* ---------------------------------------------------------------- setting up */

/* the failure in shard_errmsg() as the command line's: "<what>: <message>" */
static shard_status usage_of(train_run *r, const char *what)
{
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", shard_errmsg());
    r->usage = 1;
    return shard_fail(SHARD_E_USAGE, "%s: %s", what, msg);
}

shard_status loop_open(train_run *r, par_ctx *P, const loop_args *a)
{
    memset(r, 0, sizeof *r);
    r->P = P;
    r->a = a;
    r->saved_step = -1;
    r->lock_fd = -1;
    shard_status s = dev_open(&r->D, a->backend, a->dtype, !strcmp(a->backend, "cuda") ? shard_comm_local_rank() : 0);
    if (s) return s;
    if ((s = ckptio_open_model(P->world, a->ckpt, &r->ck, &r->m, &r->D))) return s;
    r->m.recompute = a->recompute;
    if ((s = shard_layout_check(&a->layout, &r->m.d))) return usage_of(r, "--layout");
    runcfg_defaults(&r->c, &r->m.d);
    if ((s = runcfg_resume(&r->c, r->ck, &r->resumed))) return s;
    if (r->resumed) r->saved_step = r->c.step;
    return SHARD_OK;
}

/* every input checked before the weights load: the token files, and the extra files
 * a save will carry (a bad one fails now, not at the first save; rank 0 carries them) */
static shard_status open_files(train_run *r, const data_open_opts *o)
{
    const loop_args *a = r->a;
    run_cfg *c = &r->c;
    shard_status s = data_open_on(&r->ds, a->data, r->S, r->m.d.vocab, o);
    if (s) return s;
    data_set_order(&r->ds, c->shuffle, c->seed);
    /* resumed at another --seq: the position counts sequences of the saved length */
    uint64_t p = (uint64_t)c->position;
    r->position_saved = c->position;
    if (r->resumed && (s = data_position_at(&r->ds, p, (int)c->saved.seq, !c->shuffle && !c->saved.shuffle, &p)))
        return s;
    c->position = (int64_t)p;
    if (a->loss_mask && (s = data_open_masks(&r->ds, a->loss_mask))) return s;
    if (a->val_data && (s = data_open_on(&r->vs, a->val_data, r->S, r->m.d.vocab, o))) return s;
    if (a->val_loss_mask && (s = data_open_masks(&r->vs, a->val_loss_mask))) return s;
    if (a->documents) {
        data_set_documents(&r->ds, a->doc_sep);
        data_set_documents(&r->vs, a->doc_sep);
        model_set_documents(&r->m, a->doc_sep);
    }
    for (size_t i = 0; r->P->rank == 0 && i < shard_ckpt_extra_count(r->ck); i++)
        if ((s = shard_ckpt_check_extra(r->ck, i))) return s;
    return SHARD_OK;
}

/* the same, the ranks of a host splitting the reading of the files, and the files
 * that a resumed run's records (training.data.checked) saw as they are not read */
static shard_status open_inputs(train_run *r)
{
    data_open_opts o = {0};
    data_seen *seen = NULL;
    shard_status s = r->P->size > 1 ? par_host(r->P, &o.host) : SHARD_OK;
    if (!s && r->resumed) s = runcfg_seen(r->ck, &seen, &o.nseen);
    o.seen = seen;
    if (!s) s = open_files(r, &o);
    r->ds.seen = r->vs.seen = NULL; /* borrowed while opening: freed now */
    r->ds.nseen = r->vs.nseen = 0;
    free(seen);
    return s;
}

/* the same under rank 0's progress line (a data set of hundreds of GB is minutes of reading) */
static shard_status open_data(train_run *r)
{
    const int watch = r->P->rank == 0 && r->a->watch_start;
    if (watch) r->a->watch_start(r->a->watch_ctx, "checking the token files", data_checked_bytes, NULL);
    shard_status s = open_inputs(r);
    if (watch) r->a->watch_end(r->a->watch_ctx);
    return s;
}

shard_status loop_agree(train_run *r)
{
    const run_cfg *c = &r->c;
    const loop_args *a = r->a;
    const shard_agree_item items[] = {
        {SHARD_AGREE_CKPT, a->ckpt, shard_ckpt_fingerprint(r->ck)}, SHARD_AGREE_LAYOUT(&a->layout),
        {SHARD_AGREE_INT, "--steps", (uint64_t)c->steps}, {SHARD_AGREE_INT, "--batch", (uint64_t)c->batch},
        {SHARD_AGREE_INT, "--microbatches", (uint64_t)c->micro}, {SHARD_AGREE_INT, "--seq", (uint64_t)c->seq},
        {SHARD_AGREE_INT, "--warmup", (uint64_t)c->warmup},
        {SHARD_AGREE_INT, "--schedule (1: cosine)", (uint64_t)c->cosine},
        {SHARD_AGREE_INT, "--seed (-1: none)", c->shuffle ? c->seed : UINT64_MAX},
        {SHARD_AGREE_INT, "--max-bad", (uint64_t)c->max_bad},
        {SHARD_AGREE_INT, "--fp8 (0 off, 1 delayed, 2 current)", (uint64_t)c->fp8},
        {SHARD_AGREE_INT, "--fp8-history", (uint64_t)c->fp8_hist},
        {SHARD_AGREE_INT, "--save-every", (uint64_t)c->save_every}, {SHARD_AGREE_INT, "--keep", (uint64_t)c->keep},
        {SHARD_AGREE_INT, "--val-every", (uint64_t)c->val_every},
        {SHARD_AGREE_INT, "--val-batches", (uint64_t)c->val_batches},
        {SHARD_AGREE_INT, "--stop-at", (uint64_t)c->stop_at},
        {SHARD_AGREE_INT, "--documents", (uint64_t)a->documents},
        {SHARD_AGREE_INT, "--doc-sep", (uint64_t)a->doc_sep},
        {SHARD_AGREE_INT, "--sequence-parallel", (uint64_t)a->seqpar},
        {SHARD_AGREE_INT, "--recompute (0: none)", (uint64_t)a->recompute},
        {SHARD_AGREE_INT, "--logits-chunk (0: auto, -1: whole)", (uint64_t)c->logits_chunk},
        {SHARD_AGREE_DTYPE, "--dtype", (uint64_t)a->dtype},
        {SHARD_AGREE_INT, "--dump-grads (1: given)", (uint64_t)(a->dump_grads != NULL)},
        {SHARD_AGREE_INT, "--backend (1: cuda)", (uint64_t)!strcmp(a->backend, "cuda")},
        {SHARD_AGREE_INT, "--read-together (-1: auto)", (uint64_t)(int64_t)r->P->read_together},
        shard_agree_float("--lr", c->lr), shard_agree_float("--lr-min", c->lr_min),
        shard_agree_float("--clip", c->clip), shard_agree_float("--weight-decay", c->wd),
        shard_agree_float("--beta1", c->beta1), shard_agree_float("--beta2", c->beta2),
        shard_agree_float("--eps", c->eps), shard_agree_float("--fp8-margin", c->fp8_margin),
    };
    return shard_agree_check(r->P->world, items, (int)(sizeof items / sizeof items[0]));
}

/* the token files and the layers of each pipeline stage against rank 0's (shard_agree_check) */
static shard_status agree_data_and_stages(train_run *r, const int *stages)
{
    shard_agree_item items[2 + SHARD_MAX_PP] = {
        {SHARD_AGREE_DATA, r->a->data, data_fingerprint(&r->ds)},
        {SHARD_AGREE_DATA, r->a->val_data ? r->a->val_data : "--val-data", r->vs.nfiles ? data_fingerprint(&r->vs) : 0},
    };
    const int pp = r->a->layout.pp; /* agreed before (loop_agree) */
    for (int k = 0; k < pp; k++)
        items[2 + k] = (shard_agree_item){SHARD_AGREE_INT, "--stages (a stage's layers)", (uint64_t)stages[k]};
    shard_status s = shard_agree_check(r->P->world, items, 2 + pp);
    r->usage = s == SHARD_E_USAGE;
    return s;
}

/* layers per stage: --stages, else the checkpoint's when it has as many stages, else auto */
static shard_status choose_stages(train_run *r, int *stages)
{
    const int pp = r->a->layout.pp;
    if (r->a->stages)
        return shard_stages_parse(r->a->stages, &r->m.d, pp, stages) ? usage_of(r, "--stages") : SHARD_OK;
    if (shard_ckpt_layout(r->ck)->pp == pp) {
        memcpy(stages, shard_ckpt_stages(r->ck), (size_t)pp * sizeof *stages);
        return SHARD_OK;
    }
    return shard_stages_auto(&r->m.d, pp, stages);
}

/* The optimizer and its state: Adam's moments when saved (both or neither count), the
 * fp32 master of a bf16 run from the weights; *moments: both were read. */
static shard_status load_optim(train_run *r, int *moments)
{
    par_ctx *P = r->P;
    const run_cfg *c = &r->c;
    optim *opt = &r->opt;
    int have_m = 0, have_v = 0;
    const optim_hparams h = runcfg_hparams(c);
    shard_status s;
    /* without saved moments the backend's zeroed buffers stand: no host copies of zeros
     * to upload (8 bytes a parameter, 8 GB for a 1B model on the CUDA backend) */
    const int saved = ckptio_group_count(r->ck, &r->m, "optim/exp_avg") > 0 ||
                      ckptio_group_count(r->ck, &r->m, "optim/exp_avg_sq") > 0;
    if ((s = optim_create(opt, &h, P->zsum, &r->D)) || (s = optim_host(opt, saved))) return s;
    if (!saved && !r->D.cuda && !r->a->dump_grads) { /* --dump-grads takes no step: left untouched */
        /* fresh host moments, faulted in writable now: the first step reads them before
         * it writes them, and a page of calloc's read first maps the zero page, whose
         * write then copies it and flushes the TLB of every core the run's threads use
         * (an IPI a page, a VM exit on a VM: that step of a 762 M model took 30 s on 2 cores) */
        const prefault_span fresh[2] = {{opt->m, P->zsum * sizeof(float)}, {opt->v, P->zsum * sizeof(float)}};
        prefault_spans(fresh, 2, ckptio_load_threads(P->size));
    }
    if ((s = par_read_optim(P, r->ck, &r->m, "optim/exp_avg", opt->hm, &have_m)) ||
        (s = par_read_optim(P, r->ck, &r->m, "optim/exp_avg_sq", opt->hv, &have_v)) ||
        (s = state_check_moments(shard_ckpt_dir(r->ck), have_m ? opt->hm : NULL, have_v ? opt->hv : NULL, P->zsum)))
        return s;
    if (opt->hmaster) par_pack_blocks(P, &r->m, model_params_host(&r->m), opt->hmaster); /* bf16: the fp32 master */
    optim_upload(opt);
    *moments = have_m && have_v;
    return dev_status(&r->D);
}

static shard_status read_state(train_run *r)
{
    par_ctx *P = r->P;
    model *m = &r->m;
    const run_cfg *c = &r->c;
    const char *dir = shard_ckpt_dir(r->ck);
    int have_master = 0, have_p = 0, moments = 0;
    shard_ckpt_set_threads(r->ck, ckptio_load_threads(P->size));
    shard_ckpt_set_uncached(r->ck, 1); /* the weights are read once, into fresh memory */
    shard_status s = par_read_params(P, r->ck, m, "optim/master", &have_master);
    if (!s && !have_master) s = par_read_params(P, r->ck, m, "params", &have_p);
    if (!s && !have_master && !have_p) s = shard_fail(SHARD_E_INVALID, "%s: holds no parameters", dir);
    /* the fp32 master of a saved run must be finite; a model's own NaN parameters are
     * the run's business (its steps are skipped, and it stops: --max-bad) */
    if (!s && have_master) s = state_check_weights(dir, "optim/master", model_params_host(m), m->nparams);
    if (s) return s;
    model_params_upload(m);
    if (!(r->pdt = calloc(m->ntensors, sizeof *r->pdt))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    ckptio_param_dtypes(r->ck, m, r->pdt);
    if ((s = load_optim(r, &moments))) return s;
    if (r->resumed && c->opt_step > 0 && !(have_master && moments))
        return shard_fail(SHARD_E_INVALID, "%s: the training state is at optimizer step %lld but the optimizer "
                                           "state (optim/master, exp_avg, exp_avg_sq) is missing",
                          dir, (long long)c->opt_step);
    r->opt.t = moments ? c->opt_step : 0;
    if (c->fp8 != FP8_OFF) {
        if (!(m->fp8 = fp8_create(c->fp8, model_fp8_linears(m), (int)c->fp8_hist, c->fp8_margin)))
            return shard_fail(SHARD_E_NOMEM, "out of memory");
        if ((s = ckptio_read_fp8(r->ck, m->fp8))) return s;
    }
    return SHARD_OK;
}

static uint64_t ckpt_bytes(const void *ck)
{
    return shard_ckpt_bytes_read(ck);
}

/* This rank's state from the checkpoint, read and checked: the weights (the fp32
 * master copy when saved, else the parameters), the optimizer, the FP8 scaling
 * state (on a terminal with a progress line); then the load's line. */
static shard_status load_state(train_run *r)
{
    const int watch = r->P->rank == 0 && r->a->watch_start;
    const double t_load = r->a->now();
    if (watch) r->a->watch_start(r->a->watch_ctx, "loading", ckpt_bytes, r->ck);
    shard_status s = read_state(r);
    if (watch) r->a->watch_end(r->a->watch_ctx);
    if (s) return s;
    return ckptio_print_load("smp-train", r->P->world, r->ck, r->a->now() - t_load, r->P->moved); /* all of it read and checked */
}

/* The lane count: --lanes N, refused where lanes cannot run; a resumed run's, where
 * they can; else (auto, or the saved count refused by a new layout) lanes_auto's. */
static shard_status choose_lanes(train_run *r)
{
    run_cfg *c = &r->c;
    const char *why = lanes_refusal(&r->m, &r->a->layout, r->Bm, (int)c->lanes);
    if (why && c->lanes_given) {
        r->usage = 1;
        return shard_fail(SHARD_E_USAGE, "--lanes %lld: %s", (long long)c->lanes, why);
    }
    if (c->lanes < 1 || why) c->lanes = lanes_auto(&r->m, &r->a->layout, r->Bm);
    return SHARD_OK;
}

shard_status loop_load(train_run *r)
{
    const loop_args *a = r->a;
    par_ctx *P = r->P;
    model *m = &r->m;
    const int me0 = P->rank == 0;
    int stages[SHARD_MAX_PP];
    r->Bm = runcfg_rows(&r->c, &a->layout);
    r->S = (int)r->c.seq;
    shard_status s = open_data(r);
    if (!s) s = choose_stages(r, stages);
    if (!s) s = agree_data_and_stages(r, stages);
    if (!s) s = par_setup(P, &a->layout, stages, (int)r->c.micro, m);
    if (!s) s = load_state(r);
    if (s) return s;
    /* read: --keep may prune it (rank 0 carries its extra/ files into the first save) */
    if (!me0) shard_ckpt_unlock(r->ck);
    m->sp = a->seqpar;
    if (!strcmp(a->backend, "cuda") && (s = runcfg_check_fp8_cuda(&r->c, m))) {
        r->usage = 1;
        return s;
    }
    m->logits_chunk = (int)r->c.logits_chunk; /* before lanes_open allocates the activations */
    if ((s = choose_lanes(r)) || (s = lanes_open(&r->ln, m, (int)r->c.lanes, r->Bm, r->S / a->layout.cp, P->nslots)))
        return s;
    if (m->fp8) r->D.ops->fp8_scales_changed(&r->D, m->fp8);
    if ((s = dev_status(&r->D))) return s;
    if (me0 && !a->dump_grads && (s = ckptio_prepare(a->save_dir, &r->lock_fd))) return s;
    if (!a->dump_grads && (s = ckptio_check_shared(a->save_dir, P))) {
        r->usage = s == SHARD_E_USAGE && !shard_err_secondhand(); /* the rank that does not see it says so */
        return s;
    }
    if ((s = steplog_open(&r->log, me0 ? a->log : NULL, a->log_fd, me0 && isatty(2), P))) return s; /* perhaps in it */
    r->in = malloc((size_t)r->Bm * r->S * sizeof *r->in);
    r->tg = malloc((size_t)r->Bm * r->S * sizeof *r->tg);
    return r->in && r->tg ? SHARD_OK : shard_fail(SHARD_E_NOMEM, "out of memory");
}

void loop_close(train_run *r)
{
    steplog_close(&r->log);
    if (r->lock_fd >= 0) close(r->lock_fd);
    free(r->in);
    free(r->tg);
    free(r->pdt);
    data_close(&r->ds);
    data_close(&r->vs);
    optim_free(&r->opt);
    lanes_close(&r->ln);
    model_free(&r->m);
    par_release(r->P);
    dev_close(&r->D);
    shard_ckpt_close(r->ck);
    shard_ckpt_close(r->carry);
}

/* ---------------------------------------------------------------- a step */

/* the sequences of microbatch mb of a step: this replica's, from `first` on */
typedef struct {
    data_set *ds;
    uint64_t first;
    int rows;
    model *m; /* its documents; context parallelism: this rank's tokens of each sequence (NULL: the lanes
               * take their parts themselves) */
} step_data;

static shard_status fill_step(void *ctx, int mb, int32_t *in, int32_t *tg)
{
    step_data *sd = ctx;
    shard_status s = data_fill(sd->ds, sd->first + (uint64_t)mb * (uint64_t)sd->rows, sd->rows, in, tg);
    if (!s && sd->m) par_take_batch(sd->m, sd->rows, in, tg);
    return s;
}

/* The step's counted targets over every replica: B*S, or with documents or loss masks
 * those of the step's sequences (read once more here, since the scale of the loss
 * must be known before the first backward pass of the pipeline's schedule). */
static shard_status step_targets(train_run *r, const step_data *sd, double *count)
{
    const run_cfg *c = &r->c;
    *count = (double)c->batch * (double)c->seq;
    if (!r->ds.documents && !r->ds.masked) return SHARD_OK;
    uint64_t n = 0;
    for (int mb = 0; mb < (int)c->micro; mb++) {
        shard_status s = data_fill(sd->ds, sd->first + (uint64_t)mb * (uint64_t)sd->rows, sd->rows, r->in, r->tg);
        if (s) return s;
        for (size_t i = 0; i < (size_t)sd->rows * (size_t)r->S; i++) n += r->tg[i] >= 0;
    }
    *count = (double)n; /* whole sequences: the same on every cp rank and stage; summed over dp */
    return r->a->layout.dp > 1 ? par_allreduce_f64(r->P, r->P->g.dp, count, 1, SHARD_OP_SUM) : SHARD_OK;
}

/* A mixture of experts whose config adds the load-balancing loss to the loss
 * (output_router_logits): its gradient needs the step's routing over every layer and
 * token before the first backward, so a forward-only pass over the step's
 * microbatches computes the statistics first (the step costs one forward more). */
static shard_status aux_prepass(train_run *r, step_data *sd)
{
    model *m = &r->m;
    const double coef = m->d.output_router_logits ? m->d.router_aux_loss_coef : 0.0;
    model_aux_reset(m);
    if (coef == 0.0) return model_aux_set_gradient(m, 0.0);
    if (m->fp8) m->fp8->frozen = 1; /* as validation: the FP8 history sees the step once */
    shard_status s = SHARD_OK;
    double one;
    for (int mb = 0; !s && mb < (int)r->c.micro; mb++)
        if (!(s = fill_step(sd, mb, r->in, r->tg))) s = par_forward(r->P, m, r->in, r->tg, &one);
    if (m->fp8) m->fp8->frozen = 0;
    if (!s) s = par_aux_reduce(r->P, m);
    if (!s) s = model_aux_set_gradient(m, coef);
    model_aux_reset(m);
    return s;
}

/* The step's passes: its gradients reduced, the loss (the mean over the step's
 * counted targets, on every rank) and the global gradient norm. No passes when the
 * step has no counted target (res->empty). */
static shard_status passes(train_run *r, step_result *res)
{
    par_ctx *P = r->P;
    const run_cfg *c = &r->c;
    const shard_layout *l = &r->a->layout;
    steplog_reset_bytes(&r->log);
    double lsum = 0.0, sumsq, tokens;
    /* replica r takes its contiguous B/D of the step's sequences */
    step_data sd = {&r->ds, (uint64_t)c->position + (uint64_t)P->g.me.dp * (uint64_t)(c->batch / l->dp), r->Bm, &r->m};
    shard_status s = step_targets(r, &sd, &tokens);
    if (s) return s;
    res->targets = (uint64_t)tokens;
    if (tokens == 0) {
        res->empty = 1;
        res->loss = NAN;
        return SHARD_OK;
    }
    if (r->m.E && (s = aux_prepass(r, &sd))) return s;
    model_zero_grads(&r->m);
    if (r->ln.n > 1) sd.m = NULL;
    s = lanes_train_step(&r->ln, P, (int)c->micro, fill_step, &sd, r->in, r->tg, (float)(1.0 / tokens), &lsum);
    if (s) return s;
    if (r->m.E && (s = par_aux_reduce(P, &r->m))) return s;
    res->aux_loss = r->m.E ? model_aux_loss(&r->m) : NAN;
    if (P->rank == r->a->fail_rank && c->step + 1 == r->a->fail_step)
        return shard_fail(SHARD_E_IO, "rank %d: injected failure (--inject-fail) in step %lld", P->rank,
                          (long long)c->step + 1);
    /* the sum over the replicas' sequences and (cp) over each sequence's parts */
    if (P->ndp > 1 && (s = par_allreduce_f64(P, P->g.dpcp, &lsum, 1, SHARD_OP_SUM))) return s;
    /* the loss, computed on the last stage, to every stage (rank 0 logs it) */
    if (l->pp > 1 && (s = shard_comm_broadcast(P->g.pp, &lsum, 1, SHARD_DT_F64, l->pp - 1))) return s;
    res->loss = lsum / tokens;
    for (int k = 0; k < r->a->ninject; k++)
        if (r->a->inject_nan[k] == c->step + 1) res->loss = NAN;
    if ((s = par_reduce_grads(P, &r->m, &sumsq))) return s;
    res->grad_norm = sqrt(sumsq);
    return SHARD_OK;
}

/* The update, or the step skipped when its loss or norm is not finite; the step
 * counted either way, and the FP8 scales moved on. */
static shard_status update(train_run *r, step_result *res)
{
    par_ctx *P = r->P;
    run_cfg *c = &r->c;
    model *m = &r->m;
    dev *D = &r->D;
    shard_status s;
    res->lr = optim_lr(&r->opt.h, c->step);
    res->skipped = !res->empty && (!isfinite(res->loss) || !isfinite(res->grad_norm));
    /* delayed scaling: every rank's amaxes of the step (the activations and
     * gradients of its sequences) reduced to the max over all, as one rank sees */
    if (m->fp8 && !res->empty) D->ops->fp8_collect(D, m->fp8); /* the device's amaxes of the step, into step_amax */
    if (m->fp8 && !res->empty && P->size > 1 &&
        (s = shard_comm_allreduce(P->world, m->fp8->step_amax, (size_t)m->fp8->nlin * FP8_ROLES, SHARD_DT_F32,
                                  SHARD_OP_MAX)))
        return s;
    c->step++;
    c->position += c->batch;
    c->tokens += (uint64_t)c->batch * (uint64_t)c->seq;
    if (res->skipped) {
        r->bad_run++;
        if (P->rank == 0)
            fprintf(stderr, "%ssmp-train: warning: step %lld: loss %g, gradient norm %g: not finite; step skipped "
                            "(%lld in a row)\n", steplog_clear(&r->log), (long long)c->step, res->loss, res->grad_norm,
                    (long long)r->bad_run);
    } else if (!res->empty) {
        r->bad_run = 0;
        if ((s = par_update(P, m, &r->opt, res->grad_norm, res->lr))) return s;
        c->opt_step = r->opt.t;
    }
    if (m->fp8 && !res->empty) {
        fp8_step_end(m->fp8, res->skipped);
        D->ops->fp8_scales_changed(D, m->fp8);
    }
    return SHARD_OK;
}

/* the sum of the losses of nb batches through the pipeline and their counted targets
 * (sum[0], sum[1], on every stage), each cp rank on its tokens (summed over cp) */
static shard_status pipeline_loss_sum(train_run *r, int64_t nb, double sum[2])
{
    par_ctx *P = r->P;
    const shard_layout *l = &r->a->layout;
    shard_status s;
    double one;
    sum[0] = sum[1] = 0.0;
    for (int64_t i = 0; i < nb; i++) {
        if ((s = data_fill_sequential(&r->vs, (uint64_t)i * (uint64_t)r->Bm, r->Bm, r->in, r->tg))) return s;
        sum[1] += (double)par_take_batch(&r->m, r->Bm, r->in, r->tg);
        if ((s = par_forward(P, &r->m, r->in, r->tg, &one))) return s;
        sum[0] += one;
    }
    if (l->cp > 1 && (s = par_allreduce_f64(P, P->g.cp, sum, 2, SHARD_OP_SUM))) return s;
    if (l->pp > 1 && (s = shard_comm_broadcast(P->g.pp, sum, 2, SHARD_DT_F64, l->pp - 1))) return s;
    return SHARD_OK;
}

shard_status loop_validate(train_run *r, double *val)
{
    model *m = &r->m;
    const int single = r->a->layout.pp == 1 && r->a->layout.cp == 1; /* the model alone: eval.c */
    int64_t nb = r->c.val_batches;
    if ((uint64_t)nb * r->Bm > r->vs.nseq) nb = (int64_t)(r->vs.nseq / (uint64_t)r->Bm);
    double sum[2] = {0.0, 0.0}; /* the losses, the counted targets */
    uint64_t ntok = 0;
    shard_status s = SHARD_OK;
    if (m->fp8) m->fp8->frozen = 1; /* validation leaves the FP8 history alone */
    if (nb > 0 && single) s = eval_loss_sum(&r->ln, &r->vs, nb, r->in, r->tg, &sum[0], &ntok);
    sum[1] = (double)ntok;
    if (!s && m->comm_err) s = m->comm_err;
    if (!s) s = dev_status(&r->D);
    if (!s && nb > 0 && !single) s = pipeline_loss_sum(r, nb, sum);
    if (s) return s;
    if (sum[1] > 0) *val = sum[0] / sum[1];
    if (m->fp8) m->fp8->frozen = 0;
    return SHARD_OK;
}

shard_status loop_step(train_run *r, step_result *res, int *save)
{
    run_cfg *c = &r->c;
    memset(res, 0, sizeof *res);
    res->val_loss = res->aux_loss = NAN;
    const double t0 = r->a->now();
    shard_status s = passes(r, res);
    if (!s) s = update(r, res);
    if (s) return s;
    const double t1 = r->a->now(), dt = t1 - t0;
    res->step = c->step;
    res->tokens = c->tokens;
    res->seconds = dt;
    res->tokens_per_s = (double)c->batch * c->seq / (dt > 0 ? dt : 1e-9);
    res->elapsed = t1 - r->t_start;
    /* periodic saves wait for a good step; skipped steps leave the weights as they
     * were, so the end of the run (or a signal) saves in any case */
    /* one reading of the flag a step, agreed by the ranks: a signal landing after it waits
     * for the next step, so a stop always comes with its save (and every rank stops) */
    r->stopping = *r->a->stop;
    if (r->P->size > 1) r->stopping = par_any(r->P, r->stopping);
    *save = (!r->bad_run && c->save_every && c->step % c->save_every == 0) || r->stopping || c->step == c->steps ||
            (c->stop_at && c->step >= c->stop_at);
    if (r->vs.nfiles && !r->bad_run &&
        ((c->val_every && c->step % c->val_every == 0) || (!c->val_every && *save) || c->step == c->steps) &&
        (s = loop_validate(r, &res->val_loss)))
        return s;
    res->bytes = steplog_bytes(&r->log);
    return SHARD_OK;
}

/* ---------------------------------------------------------------- the loop */

static shard_status save(train_run *r)
{
    const run_cfg *c = &r->c;
    char *tj = runcfg_state_json(c, &r->ds, &r->vs, r->m.fp8, c->elapsed_before + (r->a->now() - r->t_start));
    if (!tj) return shard_fail(SHARD_E_NOMEM, "out of memory");
    const char *cfg = shard_ckpt_config_json(r->ck);
    const shard_ckpt *extras = r->carry ? r->carry : r->ck;
    const ckptio_save_args sa = {r->a->save_dir, c->step, cfg, strlen(cfg), extras, r->pdt, r->a->compress, tj};
    const double t0 = r->a->now();
    model_params_download(&r->m); /* the host copies that the checkpoint writes (CUDA) */
    optim_download(&r->opt);
    shard_status s = dev_status(&r->D);
    if (!s) {
        s = ckptio_save(&sa, &r->m, &r->opt, r->P);
        if (s) steplog_end_line(&r->log);
    }
    free(tj);
    if (s) return s;
    r->saved_step = c->step;
    if (r->P->rank == 0) {
        steplog_end_line(&r->log); /* on a terminal the step line stays, the saved line below it */
        ckptio_print_save(r->a->save_dir, c->step, r->a->now() - t0);
        ckptio_follow(r->a->save_dir, c->step, &r->carry);
        if (r->carry) shard_ckpt_unlock(r->ck); /* the extra/ files come from the newest save now */
        ckptio_prune(r->a->save_dir, (int)c->keep, &r->held);
    }
    return SHARD_OK;
}

shard_status loop_run(train_run *r, loop_end *end)
{
    run_cfg *c = &r->c;
    const int me0 = r->P->rank == 0;
    shard_status s;
    *end = LOOP_DONE;
    r->t_start = r->a->now();
    while (c->step < c->steps && !(c->stop_at && c->step >= c->stop_at)) {
        step_result res;
        int do_save;
        if ((s = loop_step(r, &res, &do_save))) return s;
        steplog_step(&r->log, &res, c->steps);
        if (r->P->rank == r->a->signal_rank && c->step == r->a->signal_step) raise(SIGTERM); /* after the agreement */
        if (r->bad_run >= c->max_bad) {
            steplog_end_line(&r->log);
            char last[64] = "none in this run";
            if (r->saved_step >= 0) snprintf(last, sizeof last, "step %lld", (long long)r->saved_step);
            if (me0)
                fprintf(stderr, "smp-train: error: %lld steps in a row had a non-finite loss or gradient (the last at "
                                "step %lld); stopping without saving (last checkpoint: %s)\n",
                        (long long)r->bad_run, (long long)c->step, last);
            *end = LOOP_BAD;
            return SHARD_OK;
        }
        if (do_save && (s = save(r))) return s;
        if (r->stopping) {
            steplog_end_line(&r->log);
            if (me0)
                fprintf(stderr, "smp-train: stopped by a signal after step %lld; saved %s/step-%06lld\n",
                        (long long)c->step, r->a->save_dir, (long long)c->step);
            *end = LOOP_STOPPED;
            return SHARD_OK;
        }
    }
    return SHARD_OK;
}

shard_status loop_dump_grads(train_run *r)
{
    step_result res = {0};
    r->t_start = r->a->now();
    shard_status s = passes(r, &res);
    if (!s && res.empty) s = shard_fail(SHARD_E_INVALID, "--dump-grads: the step has no counted target");
    if (!s) s = ckptio_write_grads(r->a->dump_grads, &r->m, res.loss);
    if (s) return s;
    printf("step %lld: loss %.9g, gradients in %s/grads.safetensors\n", (long long)r->c.step + 1, res.loss,
           r->a->dump_grads);
    return SHARD_OK;
}
