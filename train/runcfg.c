/* train/runcfg.c: a run's configuration (runcfg.h). */
#include "runcfg.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void runcfg_defaults(run_cfg *c, const shard_model_desc *d)
{
    *c = (run_cfg){.batch = 8, .micro = 1, .seq = 256, .lr = 3e-4f, .cosine = 1, .clip = 1.0f, .wd = 0.1f,
                   .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .max_bad = 5, .fp8 = FP8_OFF, .fp8_hist = 1024,
                   .val_batches = 8};
    if (d->max_positions > 0 && c->seq > d->max_positions) c->seq = d->max_positions;
}

shard_status runcfg_resume(run_cfg *c, shard_ckpt *ck, int *resumed)
{
    const char *tr = shard_ckpt_training_json(ck);
    *resumed = 0;
    if (!tr) return SHARD_OK;
    shard_status s = state_parse(shard_ckpt_dir(ck), tr, strlen(tr), c);
    if (!s) *resumed = 1;
    return s;
}

void runcfg_merge(run_cfg *c, const runcfg_flags *f)
{
    if (f->has_lr_min) {
        c->lr_min = f->lr_min;
        c->lr_min_set = 1;
    } else if (!c->lr_min_set || f->has_lr) {
        c->lr_min = c->lr / 10.0f;
    }
    if (f->schedule >= 0) c->cosine = f->schedule;
    if (f->has_seed) {
        c->shuffle = 1;
        c->seed = f->seed;
    }
    if (f->fp8 >= 0) c->fp8 = (fp8_mode)f->fp8;
    if (f->logits_chunk >= 0) c->logits_chunk = f->logits_chunk;
    if (f->lanes >= 0) { /* auto: resolved again, as for a new run */
        c->lanes = f->lanes;
        c->lanes_given = f->lanes > 0;
    }
}

shard_status runcfg_check(const run_cfg *c, const shard_layout *l)
{
    if (c->steps < 1) return shard_fail(SHARD_E_USAGE, "--steps is required for a new run");
    if (c->fp8 == FP8_CURRENT && l->tp > 1)
        return shard_fail(SHARD_E_USAGE,
                          "--fp8 current with tp > 1: current scaling takes each tensor's amax where it is used, and "
                          "a tensor-parallel rank sees only its piece (use --fp8 delayed, whose amaxes are reduced over "
                          "all ranks)");
    if (c->batch % ((int64_t)l->dp * c->micro))
        return shard_fail(SHARD_E_USAGE, "--batch %lld is not divisible by dp %d x --microbatches %lld",
                          (long long)c->batch, l->dp, (long long)c->micro);
    if (l->cp > 1 && c->seq % (2 * l->cp))
        return shard_fail(SHARD_E_USAGE,
                          "--seq %lld is not divisible by 2 x cp = %d: context parallelism cuts each sequence into 2 "
                          "x cp chunks of equal length", (long long)c->seq, 2 * l->cp);
    if ((int64_t)c->batch / c->micro * c->seq > INT32_MAX / 4)
        return shard_fail(SHARD_E_USAGE, "--batch / --microbatches * --seq is too large");
    return SHARD_OK;
}

optim_hparams runcfg_hparams(const run_cfg *c)
{
    return (optim_hparams){c->lr, c->lr_min, c->warmup, c->steps, c->cosine, c->beta1, c->beta2, c->eps, c->wd, c->clip};
}

void runcfg_warn_positions(const char *cmd, int64_t seq, const shard_model_desc *d)
{
    if (d->max_positions > 0 && seq > d->max_positions)
        fprintf(stderr, "%s: warning: --seq %lld exceeds max_position_embeddings %lld (positions the model was not "
                        "trained at)\n", cmd, (long long)seq, (long long)d->max_positions);
}

int runcfg_rows(const run_cfg *c, const shard_layout *l)
{
    return (int)(c->batch / l->dp / c->micro);
}

shard_status runcfg_check_sp(const run_cfg *c, const shard_layout *l, int seqpar)
{
    const int Bm = runcfg_rows(c, l), S = (int)c->seq;
    if (seqpar && l->tp > 1 && ((int64_t)Bm * (S / l->cp)) % l->tp)
        return shard_fail(SHARD_E_USAGE,
                          "--sequence-parallel: a microbatch holds %lld tokens per rank (--batch / dp / --microbatches "
                          "= %d sequences of --seq / cp = %d tokens), not divisible by tp = %d: sequence parallelism "
                          "splits them over the tp ranks", (long long)Bm * (S / l->cp), Bm, S / l->cp, l->tp);
    return SHARD_OK;
}

shard_status runcfg_check_fp8_cuda(const run_cfg *c, const model *m)
{
    if (c->fp8 == FP8_OFF) return SHARD_OK;
    /* Hopper's FP8 GEMMs take widths that are multiples of 16 (any rows: gemm.cu pads
     * the last ones, so tokens per microbatch and an expert's routed rows are free) */
    const long long dims[4] = {m->H, m->E ? m->FE : m->F, (long long)m->nh * m->hd, (long long)m->nkv * m->hd};
    for (int k = 0; k < 4; k++)
        if (dims[k] % 16)
            return shard_fail(SHARD_E_USAGE,
                              "--fp8 on cuda: the FP8 GEMMs need every width (hidden %lld, %s %lld, local q %lld and "
                              "kv %lld) to be a multiple of 16",
                              dims[0], m->E ? "an expert's local intermediate" : "local intermediate", dims[1], dims[2],
                              dims[3]);
    return SHARD_OK;
}

shard_status runcfg_doc_sep(const shard_model_desc *d, int64_t given, int32_t *sep)
{
    if (given < 0 && d->eos_token_id < 0)
        return shard_fail(SHARD_E_USAGE, "--documents: the model's config.json has no eos_token_id in its vocabulary: "
                                         "give the separator with --doc-sep ID");
    *sep = (int32_t)(given >= 0 ? given : d->eos_token_id);
    return SHARD_OK;
}

/* path appended to the array a, absolute (a resume from another folder compares them) */
static void absolute_into(json_t *a, const char *path)
{
    char *abs = realpath(path, NULL);
    json_array_append_new(a, json_string(abs ? abs : path));
    free(abs);
}

/* a file's stamp as the state keeps it: its inode and hash in hex (64-bit unsigned) */
static json_t *stamp_json(const data_stamp *st)
{
    char ino[24], h[24];
    snprintf(ino, sizeof ino, "%llx", (unsigned long long)st->ino);
    snprintf(h, sizeof h, "%016llx", (unsigned long long)st->hash);
    return json_pack("{s:s,s:I,s:I,s:I,s:s}", "inode", ino, "size", (json_int_t)st->size, "ctime_ns",
                     (json_int_t)st->ctime_ns, "mtime_ns", (json_int_t)st->mtime_ns, "hash", h);
}

/* what the run checked of each token file (and its mask) of ds, appended to a: a
 * resume that finds them as they were need not read them again (data_seen) */
static json_t *checked_json(json_t *a, const data_set *ds)
{
    for (int i = 0; i < ds->nfiles; i++) {
        const data_file *f = &ds->files[i];
        json_array_append_new(a, json_pack("{s:o,s:I,s:o}", "tokens", stamp_json(&f->stamp), "vocab",
                                           (json_int_t)ds->vocab, "mask", f->mpath ? stamp_json(&f->mstamp) : json_null()));
    }
    return a;
}

/* 1 when j is a stamp of stamp_json's form, read into st */
static int stamp_parse(const json_t *j, data_stamp *st)
{
    const char *ino = json_string_value(json_object_get(j, "inode")), *h = json_string_value(json_object_get(j, "hash"));
    const json_t *size = json_object_get(j, "size"), *ct = json_object_get(j, "ctime_ns"), *mt = json_object_get(j, "mtime_ns");
    if (!ino || !h || !json_is_integer(size) || !json_is_integer(ct) || !json_is_integer(mt) || json_integer_value(size) < 0 ||
        strlen(ino) < 1 || strlen(ino) > 16 || strlen(h) != 16 || strspn(ino, "0123456789abcdef") != strlen(ino) ||
        strspn(h, "0123456789abcdef") != 16)
        return 0;
    st->ino = strtoull(ino, NULL, 16);
    st->hash = strtoull(h, NULL, 16);
    st->size = (uint64_t)json_integer_value(size);
    st->ctime_ns = json_integer_value(ct);
    st->mtime_ns = json_integer_value(mt);
    return 1;
}

shard_status runcfg_seen(const shard_ckpt *ck, data_seen **out, int *n)
{
    const json_t *data = json_object_get(json_object_get(shard_ckpt_manifest_json(ck), "training"), "data");
    const json_t *a = json_object_get(data, "checked");
    *out = NULL;
    *n = 0;
    if (!json_is_array(a) || !json_array_size(a) || json_array_size(a) > INT32_MAX) return SHARD_OK;
    if (!(*out = calloc(json_array_size(a), sizeof **out))) return shard_fail(SHARD_E_NOMEM, "out of memory");
    for (size_t i = 0; i < json_array_size(a); i++) {
        const json_t *e = json_array_get(a, i), *v = json_object_get(e, "vocab"), *m = json_object_get(e, "mask");
        data_seen *r = &(*out)[*n];
        r->has_mask = json_is_object(m);
        if (json_is_integer(v) && json_integer_value(v) > 0 && stamp_parse(json_object_get(e, "tokens"), &r->tok) &&
            (!r->has_mask || stamp_parse(m, &r->mask))) {
            r->vocab = json_integer_value(v);
            (*n)++; /* a record of another form: its file is read */
        }
    }
    return SHARD_OK;
}

char *runcfg_state_json(const run_cfg *c, const data_set *ds, const data_set *vs, const fp8_state *f8, double elapsed)
{
    json_t *files = json_array(), *masks = ds->masked ? json_array() : json_null();
    for (int i = 0; i < ds->nfiles; i++) {
        absolute_into(files, ds->files[i].path);
        if (ds->masked) absolute_into(masks, ds->files[i].mpath);
    }
    json_t *t = json_object();
    json_object_set_new(t, "step", json_integer(c->step));
    json_object_set_new(t, "tokens", json_integer((json_int_t)c->tokens));
    json_object_set_new(t, "data_position", json_integer(c->position));
    json_object_set_new(t, "optimizer_step", json_integer(c->opt_step));
    json_object_set_new(t, "batch", json_integer(c->batch));
    json_object_set_new(t, "microbatches", json_integer(c->micro));
    json_object_set_new(t, "seq", json_integer(c->seq));
    json_object_set_new(t, "schedule", json_pack("{s:s,s:f,s:f,s:I,s:I}", "kind", c->cosine ? "cosine" : "constant",
                                                 "lr", (double)c->lr, "lr_min", (double)c->lr_min, "warmup",
                                                 (json_int_t)c->warmup, "steps", (json_int_t)c->steps));
    json_object_set_new(t, "optimizer", json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:s}", "name", "adamw", "beta1",
                                                  (double)c->beta1, "beta2", (double)c->beta2, "eps", (double)c->eps,
                                                  "weight_decay", (double)c->wd, "clip", (double)c->clip,
                                                  "weight_decay_applies_to", "matrices"));
    /* what the run read its targets with (a record: the flags give them on resume, as --data) */
    char fp[32]; /* the files' bytes: a resume on changed files says so */
    json_object_set_new(t, "data", json_pack("{s:o,s:s,s:I,s:o,s:s,s:o,s:o,s:o}", "files", files, "fingerprint",
                                             data_fingerprint_text(ds, fp), "sequences",
                                             (json_int_t)ds->nseq, "seed",
                                             c->shuffle ? json_integer((json_int_t)c->seed) : json_null(),
                                             "order", c->shuffle ? "shuffled" : "sequential", "loss_masks", masks,
                                             "document_separator",
                                             ds->documents ? json_integer(ds->sep) : json_null(), "checked",
                                             checked_json(checked_json(json_array(), ds), vs)));
    /* the only randomness of a run is the data order: epoch e's permutation comes
     * from a generator seeded by (seed, e), so (seed, position) is the whole state */
    json_object_set_new(t, "rng", json_pack("{s:s,s:o,s:I}", "generator", "xoshiro256** seeded by splitmix64(seed, epoch)",
                                            "seed", c->shuffle ? json_integer((json_int_t)c->seed) : json_null(),
                                            "epoch", (json_int_t)(ds->nseq ? (uint64_t)c->position / ds->nseq : 0)));
    json_object_set_new(t, "fp8", json_pack("{s:s,s:I,s:f,s:s}", "mode", fp8_mode_name(c->fp8), "history",
                                            (json_int_t)c->fp8_hist, "margin", (double)c->fp8_margin, "tensors",
                                            f8 ? "fp8/fp8.amax_history, fp8/fp8.scale" : "none"));
    json_object_set_new(t, "max_bad_steps", json_integer(c->max_bad));
    json_object_set_new(t, "lanes", json_integer(c->lanes > 0 ? c->lanes : 1));
    json_object_set_new(t, "logits_chunk", c->logits_chunk > 0 ? json_integer(c->logits_chunk)
                                                               : json_string(c->logits_chunk ? "whole" : "auto"));
    json_object_set_new(t, "elapsed_s", json_real(elapsed));
    char *text = json_dumps(t, JSON_COMPACT | JSON_REAL_PRECISION(17));
    json_decref(t);
    return text;
}
