"""A hostile corpus of runs: what test_ckpt_hostile.py does not cover.

Every case starts from good inputs (a tiny Llama, "llama-gqa-f32": hf2smp at pp=1; a run
folder that smp-train saved at step 2 of 6, one plain and one with FP8 delayed scaling;
a good token file) and breaks ONE thing, everything else kept consistent (an edited
shard file gets its bytes and checksum fixed in the manifest, through test_ckpt_hostile's
helpers). The classes:

- state:   smp.json "training" out of the ranges the flags accept, of the wrong JSON
           type, missing, or inconsistent (read by smp-train resuming the run);
- tensors: optimizer and FP8 state holding NaN, inf, negative second moments, zero
           scales (read by smp-train resuming the run; the checksums are right);
- run:     run folders whose `latest` is hostile or names something that is not a whole
           checkpoint (smp-train --ckpt RUN, smp-eval --ckpt RUN, and smp-verify,
           smp-inspect, smp-merge --in and smp-convert reshard --in, which take a run
           folder too);
- data:    token files (--data of smp-train and smp-eval) that are malformed or not
           regular files (a FIFO must not make anything hang);
- special: smp.json, a shard file or an extra file that is a FIFO, a symlink to
           /dev/zero or /dev/urandom or to nothing, a symlink to a regular file outside the checkpoint
           folder, or a directory (every command that reads it: smp-verify, smp-merge,
           smp-convert reshard, smp-inspect, smp-eval, smp-train);
- args:    flag values out of range or not numbers (exit 2), and extra files whose
           names would land in a merged export beside (or over) the real weights
           (expected: refused, exit 3, no export).

Each command runs from the ASan + UBSan build (build/asan) with a time limit of its own
(LIMIT_S: a command still running then is a hang, and fails the case). Expected, as the
project promises: exit 3 for invalid input (2 for bad arguments), exactly one stderr line
`smp-<cmd>: error: ...` naming the offending path (or flag), no sanitizer report, and
nothing whole-looking written: no new step checkpoint, `latest` unchanged, no export or
reshard output (nor a staging folder, unless the command was killed at the limit).

The cases run side by side from one module fixture (each case's commands together, as
test_ckpt_hostile.run_san_together runs them; several cases at once), so a hang costs
the limit once, not once per case. While the module runs, files the commands write
are capped at FSIZE_CAP (RLIMIT_FSIZE): a command that copies /dev/zero into an output
is stopped by SIGXFSZ instead of filling the disk (it still fails its case).
"""
import concurrent.futures
import json
import os
import resource
import shutil
import stat
import time

import h5py
import hdf5plugin  # noqa: F401  (the zstd filter 32015)
import numpy as np
import pytest

import models
from conftest import run, set_file_entry, xxh3
from test_ckpt_hostile import entries, load, refresh, refusal_problems, replace_dataset, run_san_together, save
from test_train import write_tokens

CASE_MODEL = "llama-gqa-f32"
VOCAB = models.CASES[CASE_MODEL][1]["vocab_size"]  # 101
LIMIT_S = 30  # seconds a command may take to refuse a case of this size
FSIZE_CAP = 64 << 20  # bytes any file written while the module runs may reach
STEP = "step-000002"  # the base runs' checkpoint: step 2 of 6
B, S = 2, 8  # batch and sequence of the fresh runs and evals here


# ------------------------------------------------------------------ registry
# name -> (class, function(ctx, d) -> Plan, may_block). may_block: a case whose broken
# input may make a command block or spin until the limit (FIFOs, devices); those start
# first, side by side, so that their limits overlap.
CASES = {}
CLASSES = ("state", "tensors", "run", "data", "special", "args")


class Plan:
    """What to run for a case and what to expect of it."""

    def __init__(self, cmds, code=3, names=(), train_dir=None, outs=()):
        self.cmds = [tuple(str(a) for a in c) for c in cmds]
        self.code = code  # the exit code every command must give
        self.names = tuple(str(n) for n in names)  # the error line names one of these
        self.train_dir = train_dir  # smp-train's --save-dir: no new step folder, `latest` kept
        self.outs = list(outs)  # (command, output path) that must not appear


def case(name, cls, may_block=False):
    assert cls in CLASSES

    def reg(fn):
        assert name not in CASES, name
        CASES[name] = (cls, fn, may_block)
        return fn
    return reg


class Ctx:
    pass


# ------------------------------------------------------------------ helpers
def copy_run(src, d):
    dst = d / "run"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def resume_cmd(ctx, rdir):
    """smp-train resuming the run folder in place (its settings from the state)."""
    return ("smp-train", "--ckpt", rdir, "--data", ctx.data, "--save-dir", rdir)


def fresh_train_cmd(ctx, ck, data, save_dir):
    return ("smp-train", "--ckpt", ck, "--data", data, "--save-dir", save_dir, "--steps", 1, "--batch", B, "--seq", S)


def eval_cmd(ck, data):
    return ("smp-eval", "--ckpt", ck, "--data", data, "--batch", B, "--seq", S, "--batches", 1)


def dig(obj, path):
    *head, last = path.split(".")
    for k in head:
        obj = obj[k]
    return obj, last


def edit_tensor(ck, group, name, fn):
    """Replace the values of tensor (group, name) by fn(values), everything else kept
    consistent: through test_ckpt_hostile.replace_dataset (which finds tensors by name
    only: it is handed a view of the manifest holding just this group's entry and the
    real files list, so its fixes of the piece's and the file's checksums land in the
    manifest), then the dataset's chunk_xxh3 (replace_dataset keeps the old one). The
    pieces edited here are under 1 MiB: one chunk (docs/FORMAT.md, "Chunks")."""
    m = load(ck)
    t = next(t for t in m["tensors"] if t["group"] == group and t["name"] == name)
    p = t["pieces"][0]
    with h5py.File(ck / p["file"], "r") as f:
        data = np.array(f[p["dataset"]][()])
    new = np.ascontiguousarray(fn(data.copy()), dtype=data.dtype)
    assert new.shape == data.shape and new.nbytes <= 1 << 20
    replace_dataset(ck, {"tensors": [t], "files": m["files"]}, name, new)
    raw = new.astype(new.dtype.newbyteorder("<")).tobytes()
    with h5py.File(ck / p["file"], "r+") as f:
        f[p["dataset"]].attrs["chunk_xxh3"] = np.array([xxh3(raw)], dtype=np.uint64)
    refresh(ck, m, p["file"])
    save(ck, m)


def add_extra(ck, name, data):
    """A file extra/NAME, listed in the manifest with its right size and checksum."""
    (ck / "extra" / name).write_bytes(data)
    m = load(ck)
    m["files"].append({"name": f"extra/{name}"})
    set_file_entry(m["files"][-1], data)
    save(ck, m)


def replace_by_fifo(p):
    if os.path.lexists(p):
        os.unlink(p)
    os.mkfifo(p)


def replace_by_symlink(p, target):
    if os.path.lexists(p):
        os.unlink(p)
    os.symlink(target, p)


def replace_by_dir(p):
    if os.path.lexists(p):
        os.unlink(p)
    os.mkdir(p)


def replace_by_outside_copy(p, d):
    """p becomes a symlink to an identical regular file outside the checkpoint folder
    (every size and checksum still right: only the rule may stop it)."""
    out = d / "outside"
    out.mkdir(exist_ok=True)
    shutil.copyfile(p, out / p.name)
    os.unlink(p)
    os.symlink(out / p.name, p)


def tokens_header(magic=20240520, version=1, count=0):
    h = np.zeros(256, dtype="<i4")
    h[:3] = (magic, version, count)
    return h.tobytes()


def run_snapshot(d):
    """What a run folder holds, enough to tell a new step folder or a changed `latest`."""
    if not os.path.lexists(d) or not os.path.isdir(d):
        return {}
    snap = {}
    for e in os.listdir(d):
        p = os.path.join(d, e)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            snap[e] = ("link", os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            snap[e] = ("file", st.st_size, open(p, "rb").read(1 << 16) if e == "latest" else None)
        elif stat.S_ISDIR(st.st_mode):
            snap[e] = ("dir", tuple(sorted(os.listdir(p))) if e.startswith("step-") else None)
        else:
            snap[e] = ("other", stat.S_IFMT(st.st_mode))
    return snap


# ------------------------------------------------------------------ (a) training state
def state_case(name, mutate, fp8=False):
    @case(name, "state")
    def _(ctx, d):
        rdir = copy_run(ctx.run8 if fp8 else ctx.run, d)
        m = load(rdir / STEP)
        mutate(m["training"])
        save(rdir / STEP, m)  # json.dumps: a NaN is written as NaN (not JSON)
        return Plan([resume_cmd(ctx, rdir)], names=[rdir / STEP], train_dir=rdir)


def set_(path, value):
    def f(tr):
        o, k = dig(tr, path)
        o[k] = value
    return f


def del_(path):
    def f(tr):
        o, k = dig(tr, path)
        del o[k]
    return f


def both(*fns):
    def f(tr):
        for fn in fns:
            fn(tr)
    return f


# out of the flags' ranges (smp-train's option table: --lr [0, 1e3], --beta1/--beta2
# [0, 0.9999999], --eps [0, 1], --weight-decay [0, 1e3], --clip [0, 1e30], --batch,
# --microbatches, --seq 1..2^24, --warmup 0..2^31-1, --max-bad 1..2^30, --fp8-history
# 1..2^20, --fp8-margin [0, 64], --steps 1..2^31-1, --seed 0..2^63-1, --lanes 1..1024,
# --logits-chunk 1..2^24)
state_case("lr-1e39", set_("schedule.lr", 1e39))  # a double, not a float
state_case("lr-negative", set_("schedule.lr", -3e-3))
state_case("lr-nan", set_("schedule.lr", float("nan")))  # NaN: written as JSON cannot hold it
state_case("lr-min-negative", set_("schedule.lr_min", -3e-4))
state_case("beta1-above-one", set_("optimizer.beta1", 1.5))
state_case("beta2-two", set_("optimizer.beta2", 2.0))
state_case("beta2-one", set_("optimizer.beta2", 1.0))
state_case("eps-zero", set_("optimizer.eps", 0.0))
state_case("eps-negative", set_("optimizer.eps", -1e-8))
state_case("weight-decay-negative", set_("optimizer.weight_decay", -0.1))
state_case("clip-negative", set_("optimizer.clip", -1.0))
state_case("step-near-2^63", set_("step", 2**63 - 1))
state_case("step-negative", set_("step", -1))
state_case("data-position-near-2^63", set_("data_position", 2**63 - 1))
state_case("data-position-negative", set_("data_position", -8))
state_case("tokens-negative", set_("tokens", -64))
state_case("batch-near-2^63", set_("batch", 2**63 - 2))  # even: a multiple of the 2 microbatches
state_case("batch-negative", set_("batch", -4))
state_case("batch-not-multiple-of-microbatches", set_("batch", 3))
state_case("microbatches-zero", set_("microbatches", 0))
state_case("seq-zero", set_("seq", 0))
state_case("seq-huge", set_("seq", 2**40))
state_case("warmup-negative", set_("schedule.warmup", -1))
state_case("schedule-steps-near-2^63", set_("schedule.steps", 2**63 - 1))
state_case("schedule-steps-below-step", set_("schedule.steps", 1))  # at step 2 of 1
state_case("optimizer-step-past-step", set_("optimizer_step", 5))  # 5 updates in 2 steps
state_case("max-bad-steps-zero", set_("max_bad_steps", 0))
state_case("lanes-zero", set_("lanes", 0))
state_case("lanes-2000", set_("lanes", 2000))  # --lanes 1..1024
state_case("lanes-string", set_("lanes", "2"))
state_case("logits-chunk-zero", set_("logits_chunk", 0))  # --logits-chunk 1..2^24, "auto" or (a state) "whole"
state_case("logits-chunk-2^40", set_("logits_chunk", 2**40))
state_case("logits-chunk-unknown-word", set_("logits_chunk", "half"))
state_case("logits-chunk-float", set_("logits_chunk", 512.0))
state_case("schedule-kind-unknown", set_("schedule.kind", "linear"))
state_case("seed-negative", both(set_("data.seed", -3), set_("rng.seed", -3)))
state_case("fp8-mode-unknown", set_("fp8.mode", "fp4"), fp8=True)
state_case("fp8-margin-not-a-number", set_("fp8.margin", "1"), fp8=True)
state_case("fp8-margin-negative", set_("fp8.margin", -1.0), fp8=True)
state_case("fp8-history-zero", set_("fp8.history", 0), fp8=True)
# missing keys
state_case("missing-step", del_("step"))
state_case("missing-data-position", del_("data_position"))
state_case("missing-schedule-kind", del_("schedule.kind"))
state_case("missing-optimizer-eps", del_("optimizer.eps"))
state_case("missing-data", del_("data"))  # the order (seed) of the run
state_case("missing-fp8", del_("fp8"), fp8=True)
state_case("training-empty-object", lambda tr: tr.clear())
# wrong JSON types
state_case("step-string", set_("step", "2"))
state_case("batch-float", set_("batch", 4.0))
state_case("lr-string", set_("schedule.lr", "3e-3"))
state_case("schedule-not-object", set_("schedule", ["cosine", 0.003, 0.0003, 1, 6]))
state_case("seed-string", both(set_("data.seed", "3"), set_("rng.seed", "3")))
state_case("fp8-not-object", set_("fp8", "delayed"), fp8=True)
# a data order that does not match itself
state_case("order-shuffled-without-seed", both(set_("data.seed", None), set_("rng.seed", None)))
state_case("order-sequential-with-seed", set_("data.order", "sequential"))
state_case("order-unknown", set_("data.order", "random"))
state_case("rng-seed-vs-data-seed", set_("rng.seed", 4))
state_case("rng-epoch-vs-data-position", set_("rng.epoch", 5))  # position 8 of 249 sequences: epoch 0


# ------------------------------------------------------------------ (b) tensors
def tensor_case(name, group, tname, fn, fp8=False):
    @case(name, "tensors")
    def _(ctx, d):
        rdir = copy_run(ctx.run8 if fp8 else ctx.run, d)
        edit_tensor(rdir / STEP, group, tname, fn)
        return Plan([resume_cmd(ctx, rdir)], names=[rdir / STEP], train_dir=rdir)


def at0(v):
    def f(a):
        a.reshape(-1)[0] = v
        return a
    return f


NORM, Q = "model.norm.weight", "model.layers.1.self_attn.q_proj.weight"
tensor_case("exp-avg-nan", "optim/exp_avg", Q, at0(np.nan))
tensor_case("exp-avg-inf", "optim/exp_avg", Q, at0(np.inf))
tensor_case("exp-avg-sq-nan", "optim/exp_avg_sq", Q, at0(np.nan))
tensor_case("exp-avg-sq-inf", "optim/exp_avg_sq", NORM, at0(np.inf))
tensor_case("exp-avg-sq-negative", "optim/exp_avg_sq", NORM, at0(-1e-3))
tensor_case("master-nan", "optim/master", NORM, at0(np.nan))
tensor_case("master-inf", "optim/master", Q, at0(-np.inf))
tensor_case("fp8-scale-nan", "fp8", "fp8.scale", at0(np.nan), fp8=True)
tensor_case("fp8-scale-negative", "fp8", "fp8.scale", at0(-1.0), fp8=True)
tensor_case("fp8-scale-zero", "fp8", "fp8.scale", at0(0.0), fp8=True)
tensor_case("fp8-scale-inf", "fp8", "fp8.scale", at0(np.inf), fp8=True)
tensor_case("fp8-amax-history-nan", "fp8", "fp8.amax_history", at0(np.nan), fp8=True)
tensor_case("fp8-amax-history-negative", "fp8", "fp8.amax_history", at0(-5.0), fp8=True)


# ------------------------------------------------------------------ (c) run folders
def run_case(name, may_block=False):
    """fn(ctx, rdir, d) breaks the copied run folder and returns the names the error
    line may give."""
    def reg(fn):
        @case(name, "run", may_block)
        def _(ctx, d):
            rdir = copy_run(ctx.run, d)
            names = fn(ctx, rdir, d)
            reads = [("smp-verify", rdir), ("smp-inspect", rdir), ("smp-merge", "--in", rdir, "--out", d / "merged"),
                     ("smp-convert", "reshard", "--in", rdir, "--out", d / "re", "--layout", "tp=1")]
            return Plan([resume_cmd(ctx, rdir), eval_cmd(rdir, ctx.data), *reads], names=names, train_dir=rdir,
                        outs=[("smp-merge", d / "merged"), ("smp-convert", d / "re")])
        return fn
    return reg


def write_latest(rdir, text):
    (rdir / "latest").unlink()
    (rdir / "latest").write_bytes(text if isinstance(text, bytes) else text.encode())


@run_case("latest-names-missing-folder")
def _(ctx, rdir, d):
    write_latest(rdir, "step-000099\n")
    return [rdir / "latest", rdir / "step-000099"]


@case("latest-names-dotdot", "run")
def _(ctx, d):
    # the parent folder is a checkpoint too: only the rule may stop it. The outputs go beside it: inside a
    # checkpoint's folder they are refused first (exit 2), smp-train's run folder too
    rdir = copy_run(ctx.run, d)
    shutil.copytree(rdir / STEP, d, dirs_exist_ok=True)
    write_latest(rdir, "..\n")
    out = d.parent / f"{d.name}-out"
    out.mkdir()
    reads = [("smp-verify", rdir), ("smp-inspect", rdir), ("smp-merge", "--in", rdir, "--out", out / "merged"),
             ("smp-convert", "reshard", "--in", rdir, "--out", out / "re", "--layout", "tp=1")]
    train = ("smp-train", "--ckpt", rdir, "--data", ctx.data, "--save-dir", out / "run")
    return Plan([train, eval_cmd(rdir, ctx.data), *reads], names=[rdir / "latest"],
                outs=[("smp-merge", out / "merged"), ("smp-convert", out / "re"), ("smp-train", out / "run")])


@run_case("latest-names-absolute-path")
def _(ctx, rdir, d):
    shutil.copytree(rdir / STEP, d / "elsewhere")
    write_latest(rdir, f"{d / 'elsewhere'}\n")
    return [rdir / "latest"]


@run_case("latest-names-path-with-slash")
def _(ctx, rdir, d):
    (rdir / "sub").mkdir()
    shutil.move(rdir / STEP, rdir / "sub" / STEP)
    write_latest(rdir, f"sub/{STEP}\n")
    return [rdir / "latest"]


def latest_case(name, text):
    """A case whose `latest` holds text, and the error line names it."""
    @run_case(name)
    def _(ctx, rdir, d):
        write_latest(rdir, text)
        return [rdir / "latest"]


latest_case("latest-names-dot", ".\n")
latest_case("latest-names-itself", "latest\n")
latest_case("latest-empty", "")
latest_case("latest-huge", STEP + "x" * (4 << 20) + "\n")  # 4 MiB on one line that starts with the right name
latest_case("latest-second-line", STEP + "\nstep-000001\n")  # the right name, then more
latest_case("latest-nul", (STEP + "\0junk\n").encode())  # the right name, a NUL, then more


@run_case("latest-fifo", may_block=True)
def _(ctx, rdir, d):
    replace_by_fifo(rdir / "latest")
    return [rdir / "latest"]


@run_case("latest-symlink-out-of-the-folder")
def _(ctx, rdir, d):
    (d / "outside").mkdir()
    (d / "outside" / "latest").write_text(STEP + "\n")
    replace_by_symlink(rdir / "latest", d / "outside" / "latest")
    return [rdir / "latest"]


@run_case("latest-directory")
def _(ctx, rdir, d):
    replace_by_dir(rdir / "latest")
    return [rdir / "latest"]


@run_case("latest-names-step-without-manifest")
def _(ctx, rdir, d):
    # a step folder that is not whole (never committed): everything but smp.json
    (rdir / STEP / "smp.json").unlink()
    return [rdir / STEP, rdir / "latest"]


@run_case("step-folder-symlink-out-of-the-folder")
def _(ctx, rdir, d):
    shutil.move(rdir / STEP, d / "elsewhere")
    os.symlink(d / "elsewhere", rdir / STEP)
    return [rdir / STEP, rdir / "latest"]


# ------------------------------------------------------------------ (d) token files
def data_case(name, may_block=False):
    """fn(path) makes the token file at path (or what stands there)."""
    def reg(fn):
        @case(name, "data", may_block)
        def _(ctx, d):
            t = d / "t.bin"
            fn(t)
            return Plan([fresh_train_cmd(ctx, ctx.ck, t, d / "run"), eval_cmd(ctx.ck, t)], names=[t],
                        train_dir=d / "run")
        return fn
    return reg


GOOD_TOKENS = (np.arange(200) * 7) % VOCAB


@data_case("tokens-wrong-magic")
def _(t):
    t.write_bytes(tokens_header(magic=20240521, count=200) + GOOD_TOKENS.astype("<u2").tobytes())


@data_case("tokens-wrong-version")
def _(t):
    t.write_bytes(tokens_header(version=7, count=200) + GOOD_TOKENS.astype("<u2").tobytes())


@data_case("tokens-u32-magic-u16-version")
def _(t):
    t.write_bytes(tokens_header(magic=20240801, version=1, count=200) + GOOD_TOKENS.astype("<u4").tobytes())


@data_case("tokens-count-larger-than-file")
def _(t):
    t.write_bytes(tokens_header(count=300) + GOOD_TOKENS.astype("<u2").tobytes())


@data_case("tokens-count-negative")
def _(t):
    t.write_bytes(tokens_header(count=-1) + GOOD_TOKENS.astype("<u2").tobytes())


@data_case("tokens-count-huge")
def _(t):
    t.write_bytes(tokens_header(count=2**31 - 1) + GOOD_TOKENS.astype("<u2").tobytes())


@data_case("tokens-header-truncated")
def _(t):
    t.write_bytes(tokens_header(count=200)[:500])


@data_case("tokens-id-outside-vocab")
def _(t):
    toks = GOOD_TOKENS.copy()
    toks[150] = VOCAB
    write_tokens(t, toks)


@data_case("tokens-u32-id-2^32-1")
def _(t):
    toks = GOOD_TOKENS.astype(np.uint64)
    toks[77] = 2**32 - 1  # -1 as an int32
    write_tokens(t, toks, u32=True)


@data_case("tokens-fewer-than-one-sequence")
def _(t):
    write_tokens(t, GOOD_TOKENS[:S])


@data_case("tokens-empty-file")
def _(t):
    t.write_bytes(b"")


@data_case("tokens-directory")
def _(t):
    t.mkdir()


@data_case("tokens-fifo", may_block=True)
def _(t):
    os.mkfifo(t)


@data_case("tokens-symlink-dev-zero", may_block=True)
def _(t):
    os.symlink("/dev/zero", t)


@case("val-tokens-fifo", "data", may_block=True)
def _(ctx, d):
    t = d / "val.bin"
    os.mkfifo(t)
    cmd = fresh_train_cmd(ctx, ctx.ck, ctx.data, d / "run") + ("--val-data", t)
    return Plan([cmd], names=[t], train_dir=d / "run")


# ------------------------------------------------------------------ (e) special files
EXTRA = "extra/generation_config.json"


def special_case(name, target, make):
    """target: "smp.json", "shard-00000.h5" or EXTRA; make(path, d) replaces it."""
    block = make is not make_outside and make is not make_dir

    @case(name, "special", may_block=block)
    def _(ctx, d):
        ck = d / "ck"
        shutil.copytree(ctx.ck, ck)
        make(ck / target, d)
        cmds = [("smp-verify", ck), ("smp-merge", "--in", ck, "--out", d / "merged"),
                ("smp-convert", "reshard", "--in", ck, "--out", d / "re", "--layout", "tp=1")]
        if target == "smp.json":
            cmds.append(("smp-inspect", ck))
        if target != EXTRA:  # smp-eval reads the manifest and the parameters
            cmds.append(eval_cmd(ck, ctx.data))
        cmds.append(fresh_train_cmd(ctx, ck, ctx.data, d / "run"))  # its saves carry the extra files
        return Plan(cmds, names=[ck / target], train_dir=d / "run",
                    outs=[("smp-merge", d / "merged"), ("smp-convert", d / "re")])


def make_fifo(p, d):
    replace_by_fifo(p)


def make_zero(p, d):
    replace_by_symlink(p, "/dev/zero")


def make_urandom(p, d):
    replace_by_symlink(p, "/dev/urandom")


def make_outside(p, d):
    replace_by_outside_copy(p, d)


def make_dir(p, d):
    replace_by_dir(p)


def make_dangling(p, d):
    replace_by_symlink(p, d / "nowhere")


for _target, _tag in (("smp.json", "manifest"), ("shard-00000.h5", "shard"), (EXTRA, "extra")):
    for _kind, _make in (("fifo", make_fifo), ("symlink-dev-zero", make_zero), ("symlink-dev-urandom", make_urandom),
                         ("symlink-outside-regular-file", make_outside), ("directory", make_dir),
                         ("symlink-dangling", make_dangling)):
        special_case(f"{_tag}-{_kind}", _target, _make)


# ------------------------------------------------------------------ (f) arguments
def arg_case(name, cmd, flag, value):
    """cmd: train, eval or merge; the flag given `value` (out of range, not a number)."""
    @case(name, "args")
    def _(ctx, d):
        if cmd == "train":
            base = list(fresh_train_cmd(ctx, ctx.ck, ctx.data, d / "run"))
        elif cmd == "eval":
            base = list(eval_cmd(ctx.ck, ctx.data))
        else:
            base = ["smp-merge", "--in", ctx.ck, "--out", d / "merged"]
        if flag in base:
            base[base.index(flag) + 1] = value
        else:
            base += [flag, value]
        return Plan([base], code=2, names=[flag], train_dir=d / "run" if cmd == "train" else None,
                    outs=[("smp-merge", d / "merged")] if cmd == "merge" else [])


for _flag, _vals in (("--batch", ["0", "-4", "x", "99999999999999999999", str(2**25)]),
                     ("--seq", ["0", "8.5", str(2**40)]),
                     ("--steps", ["0", "-1", "abc", str(2**31)]),
                     ("--lr", ["nan", "inf", "-1e-3", "1e39", "abc", ""])):
    for _v in _vals:
        arg_case(f"train{_flag}-{_v or 'empty'}", "train", _flag, _v)
for _flag, _vals in (("--batch", ["0", "abc", str(2**40)]), ("--seq", ["", "-8"]), ("--batches", ["0"]),
                     ("--share-weights", ["maybe", ""])):
    for _v in _vals:
        arg_case(f"eval{_flag}-{_v or 'empty'}", "eval", _flag, _v)
for _v in ["nan", "inf", "1e-9", "-5GB", "1e30GB", "", "5XB"]:
    arg_case(f"merge--max-shard-size-{_v or 'empty'}", "merge", "--max-shard-size", _v)


def export_name_case(name, fname, make_bytes):
    """An extra file whose name is one smp-merge writes itself: it must not land in the
    export beside (or over) the real weights. Expected: refused, exit 3, no export."""
    @case(name, "args")
    def _(ctx, d):
        ck = d / "ck"
        shutil.copytree(ctx.ck, ck)
        add_extra(ck, fname, make_bytes(ctx))
        return Plan([("smp-merge", "--in", ck, "--out", d / "merged")], names=[f"extra/{fname}"],
                    outs=[("smp-merge", d / "merged")])


export_name_case("extra-named-model.safetensors", "model.safetensors",
                 lambda ctx: (ctx.hf / "model.safetensors").read_bytes())
export_name_case("extra-named-model.safetensors.index.json", "model.safetensors.index.json",
                 lambda ctx: json.dumps({"metadata": {"total_size": 4},
                                         "weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}).encode())
export_name_case("extra-named-config.json", "config.json",
                 lambda ctx: json.dumps(dict(json.loads((ctx.hf / "config.json").read_text()), vocab_size=7)).encode())


# ------------------------------------------------------------------ controls
# The same commands accept the unbroken inputs (and the edits that change nothing):
# the refusals above are the breakage's doing, not the harness's.
CONTROLS = {}


def control(name):
    def reg(fn):
        CONTROLS[name] = fn
        return fn
    return reg


@control("resume-plain")
def _(ctx, d):
    rdir = copy_run(ctx.run, d)
    return Plan([resume_cmd(ctx, rdir) + ("--stop-at", 3), eval_cmd(rdir, ctx.data)], code=0)


@control("resume-fp8")
def _(ctx, d):
    rdir = copy_run(ctx.run8, d)
    return Plan([resume_cmd(ctx, rdir) + ("--stop-at", 3)], code=0)


@control("resume-after-harmless-edits")
def _(ctx, d):
    # the state rewritten as it is, tensors rewritten with their own values
    rdir = copy_run(ctx.run8, d)
    save(rdir / STEP, load(rdir / STEP))
    for g, n in (("optim/exp_avg_sq", NORM), ("optim/master", Q), ("fp8", "fp8.scale")):
        edit_tensor(rdir / STEP, g, n, lambda a: a)
    return Plan([resume_cmd(ctx, rdir) + ("--stop-at", 3), ("smp-verify", rdir / STEP)], code=0)


@control("resume-after-harmless-value-edits")
def _(ctx, d):
    # new values that are fine (a larger second moment, a smaller scale, a new amax): the
    # edits themselves keep the checkpoint whole, so the refusals of the tensors cases
    # are the values' doing
    rdir = copy_run(ctx.run8, d)
    edit_tensor(rdir / STEP, "optim/exp_avg_sq", NORM, lambda a: a * 2 + 1e-6)
    edit_tensor(rdir / STEP, "optim/master", Q, lambda a: a * 0.5)
    edit_tensor(rdir / STEP, "fp8", "fp8.scale", lambda a: a * 0.5)
    edit_tensor(rdir / STEP, "fp8", "fp8.amax_history", at0(3.0))
    return Plan([("smp-verify", rdir / STEP), resume_cmd(ctx, rdir) + ("--stop-at", 3)], code=0)


@control("checkpoint-commands")
def _(ctx, d):
    ck = d / "ck"
    shutil.copytree(ctx.ck, ck)
    return Plan([("smp-verify", ck), ("smp-merge", "--in", ck, "--out", d / "merged", "--max-shard-size", "100KB"),
                 ("smp-convert", "reshard", "--in", ck, "--out", d / "re", "--layout", "tp=1"), ("smp-inspect", ck),
                 eval_cmd(ck, ctx.data), fresh_train_cmd(ctx, ck, ctx.data, d / "run")], code=0)


@control("token-files")
def _(ctx, d):
    t16, t32 = write_tokens(d / "t16.bin", GOOD_TOKENS), write_tokens(d / "t32.bin", GOOD_TOKENS, u32=True)
    return Plan([eval_cmd(ctx.ck, t16), eval_cmd(ctx.ck, t32), fresh_train_cmd(ctx, ctx.ck, t32, d / "run")], code=0)


# ------------------------------------------------------------------ running them
def command_problems(p, cmd, plan):
    """What is wrong with one command's outcome (an empty list when it is right)."""
    if p is None:
        return [f"{cmd}: still running after {LIMIT_S}s (a hang; killed)"]
    if plan.code == 0:
        if p.returncode != 0 or "Sanitizer" in p.stderr or "runtime error" in p.stderr:
            return [f"{cmd}: exit {p.returncode} on good input: {p.stderr.strip()[-1500:]}"]
        return []
    out = refusal_problems(p, cmd, plan.names)  # exit 3, one line, names, no sanitizer report
    if plan.code != 3:
        out = [x for x in out if not x.startswith(f"{cmd}: exit ")]
        lines = p.stderr.strip().splitlines()
        if p.returncode != plan.code:
            out.append(f"{cmd}: exit {p.returncode}, expected {plan.code}: {p.stderr.strip()[-1500:]}")
        if len(lines) > 1 and not any("lines on stderr" in x for x in out):
            out.append(f"{cmd}: {len(lines)} lines on stderr: {p.stderr.strip()[-1500:]}")
    return out


def describe(p):
    if p is None:
        return f"killed after {LIMIT_S}s"
    err = p.stderr.strip().splitlines()
    return f"exit {p.returncode}, {len(err)} stderr lines: " + " | ".join(err[:3])[:600]


def execute(ctx, d, plan):
    before_dir = entries(d)
    train_before = run_snapshot(plan.train_dir) if plan.train_dir else None
    t0 = time.monotonic()
    res = run_san_together(*plan.cmds, timeout=LIMIT_S)
    wall = time.monotonic() - t0
    probs = []
    for c, p in zip(plan.cmds, res):
        cmd = c[0]
        label = " ".join(c[:2]) if cmd == "smp-convert" else cmd
        probs += [f"[{label}] {x}" for x in command_problems(p, cmd, plan)]
    killed = {c[0] for c, p in zip(plan.cmds, res) if p is None}
    if plan.code != 0:
        # nothing whole-looking: no output folder; no staging folder from a command that
        # ended by itself
        new = sorted(entries(d) - before_dir)
        for cmd, out in plan.outs:
            if out.exists():
                probs.append(f"[{cmd}] wrote {out.name}/ ({sorted(os.listdir(out))[:6]})")
            stray = [e for e in new if e != out.name and (e.startswith(out.name + ".tmp") or
                                                           e.startswith(f".tmp-{out.name}"))]
            if stray and cmd not in killed:
                probs.append(f"[{cmd}] left {stray}")
        if plan.train_dir is not None:
            after = run_snapshot(plan.train_dir)
            for e in sorted(set(after) | set(train_before)):
                if after.get(e) == train_before.get(e):
                    continue
                if e.startswith("step-") or e == "latest":
                    probs.append(f"[smp-train] {'wrote' if e not in train_before else 'changed'} "
                                 f"{os.path.basename(plan.train_dir)}/{e}")
                elif (e.startswith(".tmp-") or e.startswith(".latest")) and "smp-train" not in killed:
                    probs.append(f"[smp-train] left {os.path.basename(plan.train_dir)}/{e}")
    return dict(problems=probs, outcome=[(" ".join(c[:2]) if c[0] == "smp-convert" else c[0], describe(p))
                                         for c, p in zip(plan.cmds, res)], wall=wall)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = Ctx()
    root = tmp_path_factory.mktemp("hostile-runs")
    c.root = root
    c.hf = root / "hf"
    models.make(CASE_MODEL, c.hf)
    c.ck = root / "ck"
    run("smp-convert", "hf2smp", "--in", c.hf, "--out", c.ck, "--layout", "pp=1", check=0)
    assert (c.ck / EXTRA).is_file()
    c.data = write_tokens(root / "d.bin", np.random.default_rng(1).integers(0, VOCAB, size=2000))
    common = ["--data", c.data, "--steps", 6, "--stop-at", 2, "--batch", 4, "--microbatches", 2, "--seq", S,
              "--lr", 3e-3, "--warmup", 1, "--seed", 3]
    c.run, c.run8 = root / "run", root / "run8"
    run("smp-train", "--ckpt", c.ck, "--save-dir", c.run, *common, check=0)
    run("smp-train", "--ckpt", c.ck, "--save-dir", c.run8, *common, "--fp8", "delayed", "--fp8-history", 4, check=0)
    for r in (c.run, c.run8):
        assert (r / "latest").read_text() == STEP + "\n"
    m8 = load(c.run8 / STEP)
    assert {t["name"] for t in m8["tensors"] if t["group"] == "fp8"} == {"fp8.amax_history", "fp8.scale"}
    return c


@pytest.fixture(scope="module")
def results(ctx):
    """Every case and control prepared, then run: the cases that may block side by side
    (their limits overlap), the others a few at a time beside them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (min(FSIZE_CAP, hard) if hard != resource.RLIM_INFINITY else FSIZE_CAP,
                                               hard))
    try:
        jobs = []
        for name, (cls, fn, may_block) in CASES.items():
            d = ctx.root / "cases" / name
            d.mkdir(parents=True)
            jobs.append((name, may_block, d, fn(ctx, d)))
        for name, fn in CONTROLS.items():
            d = ctx.root / "controls" / name
            d.mkdir(parents=True)
            jobs.append(("control:" + name, False, d, fn(ctx, d)))
        out = {}
        blocking = [j for j in jobs if j[1]]
        rest = [j for j in jobs if not j[1]]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(blocking))) as pa, \
                concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pb:
            futs = {pa.submit(execute, ctx, d, plan): name for name, _, d, plan in blocking}
            futs.update({pb.submit(execute, ctx, d, plan): name for name, _, d, plan in rest})
            for f in concurrent.futures.as_completed(futs):
                out[futs[f]] = f.result()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    yield out
    shutil.rmtree(ctx.root / "cases", ignore_errors=True)  # FIFOs, devices' copies, killed outputs
    shutil.rmtree(ctx.root / "controls", ignore_errors=True)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_run(results, name):
    r = results[name]
    print(f"{name}:\n" + "\n".join(f"  {c}: {o}" for c, o in r["outcome"]))
    assert not r["problems"], f"{CASES[name][0]} case {name}:\n" + "\n".join(r["problems"]) + \
        "\noutcomes:\n" + "\n".join(f"  {c}: {o}" for c, o in r["outcome"])


@pytest.mark.parametrize("name", list(CONTROLS))
def test_unbroken_inputs_pass(results, name):
    r = results["control:" + name]
    assert not r["problems"], "\n".join(r["problems"])


def test_corpus_size():
    assert len(CASES) >= 45
    assert {cls for cls, _, _ in CASES.values()} == set(CLASSES)
