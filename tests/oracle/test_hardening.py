"""Hardening that the hostile corpora do not reach with one broken file: pruning by
commit order, pruning beside readers, paths with trailing slashes, special files in a model folder, a token
file truncated under a running trainer, and smp-inspect on a tensor of many huge
dimensions."""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

import models
from conftest import BUILD, run, xxh64
from test_ckpt_hostile import refusal_problems, run_san
from test_train import make_ckpt, vocab_of, write_tokens

CASE = "llama-gqa-f32"


def train(ck, data, run_dir, steps, *extra):
    return run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", run_dir, "--steps", steps, "--batch", 2,
               "--seq", 16, *extra)


def test_keep_prunes_by_commit_order_and_keeps_latest(tmp_path):
    """--keep 1 on a run resumed from an older step: the checkpoint latest names (the
    newest commit, a lower step number than the abandoned ones) survives, and the
    run resumes from it."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    assert train(ck, data, r, 4, "--save-every", 1).returncode == 0           # step-1 .. step-4, latest = 4
    assert (r / "latest").read_text().strip() == "step-000004"
    # resume from step 2 in the same folder, one more step: step-3 again, newer than step-4
    assert train(r / "step-000002", data, r, 3, "--keep", 1).returncode == 0
    assert (r / "latest").read_text().strip() == "step-000003"
    assert (r / "step-000003" / "smp.json").exists(), sorted(os.listdir(r))
    assert not (r / "step-000004").exists() and not (r / "step-000001").exists(), sorted(os.listdir(r))
    assert sorted(os.listdir(r)) == [".lock", "latest", "step-000003"]  # the step-3 it replaced: gone, not aside
    assert run("smp-verify", r / "step-000003").returncode == 0
    assert train(r, data, r, 4).returncode == 0                              # resumable



def test_keep_leaves_a_checkpoint_that_a_reader_holds(tmp_path):
    """A reader (smp-merge, smp-eval, ... of a run folder while it trains) holds a shared
    flock on the checkpoint's smp.json: --keep leaves that step folder, with a note, and
    prunes it at a save after the reader is done. One that a pruner holds (exclusively)
    is refused as being removed."""
    import fcntl
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    assert train(ck, data, r, 1).returncode == 0
    with open(r / "step-000001" / "smp.json", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # what shard_ckpt_open takes
        p = train(r, data, r, 3, "--save-every", 1, "--keep", 1)
        assert p.returncode == 0, p.stderr
        assert sorted(x.name for x in r.glob("step-*")) == ["step-000001", "step-000003"]
        notes = [ln for ln in p.stderr.splitlines() if "kept for now" in ln]
        assert notes == [f"smp-train: note: {r}/step-000001: kept for now, another process is reading it; a later "
                         "save prunes it (--keep)"], p.stderr  # said once, not at every save
    assert train(r, data, r, 4, "--keep", 1).returncode == 0
    assert sorted(x.name for x in r.glob("step-*")) == ["step-000004"] and not list(r.glob(".tmp-*"))
    with open(r / "step-000004" / "smp.json", "rb") as pruning:
        fcntl.flock(pruning, fcntl.LOCK_EX)  # what the pruner takes before it removes the folder
        p = run("smp-verify", r / "step-000004")
        assert p.returncode == 3 and p.stderr.strip() == (
            f"smp-verify: error: {r}/step-000004: removed while being opened (an older checkpoint of a run that keeps "
            "only its newest: --keep)"), p.stderr


def test_keep_removes_a_linked_step_folder_not_what_it_points_at(tmp_path):
    """A step folder of the run that is a symbolic link to a checkpoint kept elsewhere:
    --keep removes the link, never the checkpoint it points at."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    kept = tmp_path / "kept"
    shutil.copytree(ck, kept)
    r = tmp_path / "run"
    r.mkdir()
    os.symlink(kept, r / "step-000000")
    before = sorted((p.name, p.stat().st_size) for p in kept.rglob("*"))
    assert train(ck, data, r, 3, "--save-every", 1, "--keep", 1).returncode == 0
    assert sorted(os.listdir(r)) == [".lock", "latest", "step-000003"]
    assert sorted((p.name, p.stat().st_size) for p in kept.rglob("*")) == before
    assert run("smp-verify", kept).returncode == 0

def test_inspect_table_columns_line_up(tmp_path):
    """smp-inspect's tensor table: the name column is as wide as the longest name (the
    optimizer's, "optim/exp_avg/...post_attention_layernorm.weight", overran a fixed
    52 characters and pushed its row's dtype, shape and pieces out of line)."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    assert train(ck, data, tmp_path / "run", 1).returncode == 0
    lines = run("smp-inspect", tmp_path / "run", check=0).stdout.splitlines()
    rows = lines[lines.index("  tensors") + 1:lines.index("  files")]
    assert len(rows) > 30 and max(len(r.split()[0]) for r in rows[1:]) > 52
    header = rows[0]
    for r in rows[1:]:
        name, dtype = r.split()[:2]
        assert r.index(dtype, 4 + len(name)) == header.index("dtype"), r

def test_reading_a_run_folder_while_it_trains_with_keep(tmp_path):
    """smp-merge, smp-eval and smp-verify of a run folder (its latest) while smp-train saves
    every step with --keep 1: each reads a whole checkpoint. They used to fail (exit 3,
    "extra/...: missing", "shard-00000.h5: missing", "no smp.json") on a checkpoint pruned
    under them: 8 of 80 such reads here before."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    assert train(ck, data, r, 1).returncode == 0
    trainer = subprocess.Popen([str(BUILD / "bin" / "smp-train"), "--ckpt", str(r), "--data", str(data), "--save-dir",
                                str(r), "--steps", "100000", "--batch", "2", "--seq", "16", "--save-every", "1",
                                "--keep", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    failures, reads = [], 0
    try:
        for i in range(20):
            for argv in (["smp-merge", "--in", r, "--out", tmp_path / f"hf-{i}", "--no-fsync"],
                         ["smp-eval", "--ckpt", r, "--data", data, "--batch", 2, "--seq", 16, "--batches", 1],
                         ["smp-verify", r]):
                p = run(*argv)
                reads += 1
                if p.returncode != 0:
                    failures.append(p.stderr.strip())
        assert trainer.poll() is None  # it trained (and pruned) all along
    finally:
        trainer.send_signal(signal.SIGTERM)  # saves, then ends
        err = trainer.communicate(timeout=120)[1]
    assert trainer.returncode == 0, err
    assert not failures, f"{len(failures)} of {reads} reads failed: {failures[:3]}"
    assert len(list(r.glob("step-*"))) >= 1 and not list(r.glob(".tmp-*"))


def test_trailing_slashes(tmp_path):
    hf = tmp_path / "hf"
    models.make(CASE, hf)
    ck, ex = tmp_path / "ck", tmp_path / "export"
    assert run("smp-convert", "hf2smp", "--in", f"{hf}/", "--out", f"{ck}/", "--layout", "tp=2").returncode == 0
    p = run("smp-merge", "--in", f"{ck}/", "--out", f"{ex}/")
    assert p.returncode == 0, p.stderr
    assert (ex / "model.safetensors").exists() and not [e for e in os.listdir(tmp_path) if e.startswith(".tmp")]


def test_output_paths_refused_before_any_work(tmp_path):
    """An --out that cannot name a new folder: empty, ".", "..", "/", something there
    already (a dangling link too: the rename would replace it), a parent that is missing
    or a file. Each command refuses it first: exit 2, one line naming it, nothing
    written, the link still a link."""
    hf, ck = tmp_path / "hf", tmp_path / "ck"
    models.make(CASE, hf)
    assert run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=2", "--no-fsync").returncode == 0
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    (tmp_path / "file").write_text("x")
    commands = {
        "hf2smp": ("smp-convert", "hf2smp", "--in", hf, "--layout", "tp=1"),
        "reshard": ("smp-convert", "reshard", "--in", ck, "--layout", "tp=1"),
        "init": ("smp-convert", "init", "--config", hf / "config.json", "--layout", "tp=1"),
        "merge": ("smp-merge", "--in", ck),
    }
    outs = {"": '--out "": an empty value', ".": ".", "..": "..", "/": "/", str(ck): str(ck), f"{ck}/": str(ck), str(dangling): str(dangling),
            str(tmp_path / "no" / "out"): str(tmp_path / "no"), str(tmp_path / "file" / "out"): str(tmp_path / "file"),
            f"{tmp_path}/new/.": f"{tmp_path}/new/.",
            # inside a checkpoint: lost when it is pruned (smp-train --keep) or replaced
            str(ck / "inner"): f"{ck / 'inner'}: inside the checkpoint {ck} (pruning or replacing that checkpoint would "
                               "delete it): put it beside the checkpoint"}
    before, in_ck = sorted(os.listdir(tmp_path)), sorted(os.listdir(ck))
    for what, cmd in commands.items():
        for out, named in outs.items():
            p = run(*cmd, "--out", out, "--no-fsync")
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{cmd[0]}: error: {named}"), \
                (what, out, p.returncode, p.stderr)
    assert sorted(os.listdir(tmp_path)) == before and os.readlink(dangling) == str(tmp_path / "nowhere")
    assert sorted(os.listdir(ck)) == in_ck


def test_run_folders_and_logs_refused_before_loading(tmp_path):
    """smp-train's --save-dir (empty, a file, a path through a file, a dangling link, a
    checkpoint: its step folders used to go inside it) and
    --log (empty, a folder, a path through a file, a dangling link): exit 2 and one line
    naming it before the checkpoint is loaded (no "loaded" line), nothing written. A log
    that is a FIFO nobody reads: exit 2 at once (it waited forever); one that is read gets
    the steps. (The FIFO used to be refused after the load, leaving an empty run
    folder.) A new nested run folder is made at the first save, a log in it works."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.mkfifo(tmp_path / "fifo")
    before = sorted(os.listdir(tmp_path))
    runs = [("--save-dir", bad, ()) for bad in ("", tmp_path / "file", tmp_path / "file" / "run", tmp_path / "dangling", ck,
                                                 ck / "run")]
    runs += [("--log", bad, ("--log", bad)) for bad in ("", tmp_path, tmp_path / "file" / "log", tmp_path / "dangling",
                                                        ck / "log.jsonl")]
    # --dump-grads: refused after the load, exit 1 (a file, a path through one)
    runs += [("--dump-grads", bad, ("--dump-grads", bad)) for bad in (tmp_path / "file", tmp_path / "file" / "g", ck / "g")]
    for opt, bad, extra in runs:
        p = train(ck, data, bad if opt == "--save-dir" else tmp_path / "run", 1, *extra)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (opt, bad, p.returncode, p.stderr)
        assert lines[0].startswith(f"smp-train: error: {opt} {bad if bad != '' else chr(34) * 2}:"), lines
    p = subprocess.run([str(BUILD / "bin" / "smp-train"), "--ckpt", str(ck), "--data", str(data), "--save-dir",
                        str(tmp_path / "run"), "--steps", "1", "--batch", "2", "--seq", "16", "--log",
                        str(tmp_path / "fifo")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == \
        [f"smp-train: error: --log {tmp_path / 'fifo'}: a FIFO that nobody reads (see smp-train --help)"], p.stderr
    assert sorted(os.listdir(tmp_path)) == before  # refused before the load: no run folder made
    rd = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # a reader before the writer comes
    try:
        assert train(ck, data, tmp_path / "run", 2, "--log", tmp_path / "fifo").returncode == 0
        got = os.read(rd, 1 << 16).decode()  # two lines: within the pipe's buffer
    finally:
        os.close(rd)
    assert [json.loads(x)["step"] for x in got.splitlines()] == [1, 2], got
    assert train(ck, data, f"{tmp_path}/new/run/", 1, "--log", tmp_path / "new" / "run" / "log.jsonl").returncode == 0
    assert (tmp_path / "new" / "run" / "latest").read_text().strip() == "step-000001"
    assert json.loads((tmp_path / "new" / "run" / "log.jsonl").read_text())["step"] == 1


def test_special_files_in_a_model_folder(tmp_path):
    """config.json, a weight file or the index as a FIFO: refused at once (exit 3, one
    line naming it), not waited on."""
    src = tmp_path / "src"
    models.make("llama-sharded", src)
    for name in ("config.json", "model.safetensors.index.json", sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[0]):
        hf = tmp_path / f"hf-{name}"
        shutil.copytree(src, hf)
        os.unlink(hf / name)
        os.mkfifo(hf / name)
        p = run_san("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / f"ck-{name}", "--layout", "tp=1", timeout=60)
        assert not refusal_problems(p, "smp-convert", (name,)), refusal_problems(p, "smp-convert", (name,))
        assert not (tmp_path / f"ck-{name}").exists()


def test_token_file_truncated_under_a_run(tmp_path):
    """The trainer reads token files with pread: a file cut short while it runs ends
    the run with one error line naming it (exit 1), not SIGBUS, and the last whole
    checkpoint stays."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=200000))
    r = tmp_path / "run"
    proc = subprocess.Popen([str(BUILD / "bin" / "smp-train"), "--ckpt", str(ck), "--data", str(data), "--save-dir", str(r),
                             "--steps", "100000", "--batch", "2", "--seq", "16", "--save-every", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (r / "latest").exists() and time.time() < deadline:
        time.sleep(0.05)
    with open(data, "r+b") as f:
        f.truncate(2048)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("smp-train: error: ")]
    assert len(lines) == 1 and "d.bin" in lines[0], err[-2000:]
    latest = (r / "latest").read_text().strip()
    assert run("smp-verify", r / latest).returncode == 0


def test_inspect_many_huge_dimensions(tmp_path):
    """A tensor of 8 dimensions of 19 digits (one of them 0, so it holds nothing and is
    valid) is shown by smp-inspect without overflowing its buffers."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    m = json.loads((ck / "smp.json").read_text())
    m["tensors"].append({"name": "fp8.huge", "group": "fp8", "dtype": "F32", "shape": [0] + [9223372036854775807] * 7,
                         "pieces": []})
    (ck / "smp.json").write_text(json.dumps(m))
    p = run_san("smp-inspect", ck, timeout=60)
    assert p is not None and "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, p and p.stderr[-2000:]
    assert p.returncode == 0, p.stderr
    assert "[0, " + ", ".join(["9223372036854775807"] * 7) + "]" in p.stdout


def test_output_that_cannot_be_written(tmp_path):
    """Standard output on a full disk (/dev/full) or closed: exit 1 and one line saying
    so, not exit 0 with a short file (`smp-eval --json > r.json`). smp-train's --log on a
    full disk, or a FIFO whose monitor stops reading: the run warns once, trains and
    saves to the end, then exits 1 naming the first step the log lacks (the FIFO's writes
    used to kill it with SIGPIPE, losing every step since its last checkpoint)."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    printing = [("smp-verify", ck), ("smp-inspect", ck), ("smp-inspect", "--json", ck), ("smp-convert", "--help"),
                ("smp-eval", "--ckpt", ck, "--data", data, "--batch", 2, "--seq", 16, "--batches", 1, "--json")]
    sinks = [("closed", {"preexec_fn": lambda: os.close(1)})]
    if os.path.exists("/dev/full"):
        sinks.append(("/dev/full", {"stdout": open("/dev/full", "w")}))
    for what, how in sinks:
        for cmd, *args in printing:
            p = subprocess.run([str(BUILD / "bin" / cmd), *map(str, args)], stderr=subprocess.PIPE, text=True,
                               timeout=120, **how)
            errs = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
            assert p.returncode == 1 and errs == [f"{cmd}: error: " + errs[0].split(": error: ")[1]], (what, cmd, p.stderr)
            assert errs[0].startswith(f"{cmd}: error: standard output: a write failed"), (what, cmd, p.stderr)
    if os.path.exists("/dev/full"):
        p = train(ck, data, tmp_path / "full", 3, "--log", "/dev/full")
        assert p.returncode == 1, p.stderr
        assert "smp-train: warning: /dev/full: writing the log failed (No space left on device); the steps from 1 on" \
            in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1] == \
            "smp-train: error: /dev/full: the log lacks the steps from 1 on: No space left on device", p.stderr
        assert (tmp_path / "full" / "latest").read_text().strip() == "step-000003"
    fifo = tmp_path / "monitor"
    os.mkfifo(fifo)
    rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proc = subprocess.Popen([str(BUILD / "bin" / "smp-train"), "--ckpt", str(ck), "--data", str(data), "--save-dir",
                             str(tmp_path / "run"), "--steps", "400", "--batch", "2", "--seq", "16", "--log", str(fifo)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        got, deadline = b"", time.time() + 60
        while b"\n" not in got and time.time() < deadline:  # the monitor reads the first step's line, then quits
            try:
                got += os.read(rd, 4096)
            except BlockingIOError:
                time.sleep(0.001)
    finally:
        os.close(rd)
    _, err = proc.communicate(timeout=120)
    assert json.loads(got.split(b"\n")[0])["step"] == 1
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"smp-train: error: {fifo}: the log lacks the steps from ") and last.endswith(": Broken pipe"), err
    assert 1 < int(last.split("steps from ")[1].split()[0]) <= 400, last
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000400"
    assert run("smp-verify", tmp_path / "run" / "step-000400").returncode == 0


def big_model(path, layers=6):
    """~200 MB of bf16 (hidden 1024, 6 layers, vocab 16000): writing it takes long enough
    to be stopped midway."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    H, F, V, nq, nkv = 1024, 2816, 16000, 16, 4
    path.mkdir()
    LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=layers, num_attention_heads=nq,
                num_key_value_heads=nkv, dtype="bfloat16", architectures=["LlamaForCausalLM"]).to_json_file(path / "config.json")
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (H * nkv // nq, H),
                       p + "self_attn.v_proj.weight": (H * nkv // nq, H), p + "self_attn.o_proj.weight": (H, H),
                       p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                       p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    # bit patterns of bf16 values in [0, 1): random, so zstd works for real
    save_file({k: torch.randint(0, 0x3F80, s, generator=g, dtype=torch.int16).view(torch.bfloat16) for k, s in shapes.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def stop_midway(cmd, parent, sig):
    """Start cmd, freeze it (SIGSTOP) once its staging folder under parent holds a
    written file, send sig, let it go on: the signal lands while the output is
    unfinished whatever the machine's speed."""
    proc = subprocess.Popen([str(BUILD / "bin" / cmd[0]), *map(str, cmd[1:])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        staged = [f for d in parent.glob(".tmp-*") for f in d.iterdir() if f.is_file() and f.stat().st_size > 0]
        if staged:
            break
        time.sleep(0.0005)
    os.kill(proc.pid, signal.SIGSTOP)
    assert staged and proc.poll() is None, "the command ended before it could be stopped"
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_interrupted_writers_leave_nothing(tmp_path):
    """SIGINT, SIGTERM or SIGHUP (Ctrl-C, a scheduler, a closed terminal) during hf2smp
    (raw and zstd), reshard and smp-merge: the writers stop at their next chunk, the
    staging folder is removed (it used to stay: a hidden .tmp-* folder of up to the
    model's size per interruption), one error line, and the process ends by that signal
    as a shell expects; the input is untouched."""
    hf, out = tmp_path / "hf", tmp_path / "out"
    big_model(hf)
    out.mkdir()
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "tp=2", "--compress", "none", check=0)
    names = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
    cases = [(["smp-convert", "hf2smp", "--in", hf, "--out", out / "a", "--layout", "pp=2,tp=2", "--compress", "none"], signal.SIGINT),
             (["smp-convert", "hf2smp", "--in", hf, "--out", out / "b", "--layout", "tp=4"], signal.SIGTERM),
             (["smp-convert", "reshard", "--in", tmp_path / "ck", "--out", out / "c", "--layout", "tp=4"], signal.SIGHUP),
             (["smp-merge", "--in", tmp_path / "ck", "--out", out / "d"], signal.SIGINT)]
    for cmd, sig in cases:
        rc, err = stop_midway(cmd, out, sig)
        assert rc == -sig, (cmd, rc, err)
        assert err.strip().splitlines() == [f"{cmd[0]}: error: interrupted by {names[sig]}; the unfinished output was removed"], (cmd, err)
        assert os.listdir(out) == [], (cmd, os.listdir(out))
    assert run("smp-verify", tmp_path / "ck").returncode == 0
    # a signal after the work is done changes nothing: the output is whole and kept
    run("smp-convert", "reshard", "--in", tmp_path / "ck", "--out", out / "e", "--layout", "tp=1", check=0)
    assert run("smp-verify", out / "e").returncode == 0


def test_one_run_at_a_time_in_a_run_folder(tmp_path):
    """A second smp-train saving into a run folder that a running one saves into (a job
    started twice) is refused: exit 2, one line naming the folder and the first run's
    pid (the two used to replace each other's step folders and `latest`). Once the
    first ends, however it ends, the folder is free. A lock that is a link or a FIFO is
    refused (exit 3), not followed or waited on."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r, log = tmp_path / "run", tmp_path / "log.jsonl"
    first = subprocess.Popen([str(BUILD / "bin" / "smp-train"), "--ckpt", str(ck), "--data", str(data), "--save-dir", str(r),
                              "--steps", "100000", "--batch", "2", "--seq", "16", "--log", str(log)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (not log.exists() or not log.read_text()):
            time.sleep(0.01)
        p = train(ck, data, r, 3)
        assert p.returncode == 2, p.stderr
        errs = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
        assert errs == [f"smp-train: error: {r}: another smp-train is saving into this run folder "
                        f"(pid {first.pid} on host {os.uname().nodename})"], p.stderr
    finally:
        first.kill()  # SIGKILL: the lock goes with the process
        first.communicate(timeout=60)
    assert train(ck, data, r, 3).returncode == 0
    assert (r / "latest").read_text().strip() == "step-000003"
    for bad, make in (("link", lambda p: os.symlink(tmp_path / "elsewhere", p)), ("fifo", os.mkfifo)):
        rb = tmp_path / f"run-{bad}"
        rb.mkdir()
        make(rb / ".lock")
        p = train(ck, data, rb, 1)
        errs = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
        assert p.returncode == 3 and len(errs) == 1 and f"{rb}/.lock" in errs[0], (bad, p.returncode, p.stderr)
        assert not (tmp_path / "elsewhere").exists() and not (rb / "latest").exists()


def test_every_reader_takes_a_run_folder(tmp_path):
    """smp-verify, smp-inspect, smp-merge --in and smp-convert reshard --in take a run
    folder as smp-train and smp-eval do, reading the checkpoint its `latest` names (they
    used to refuse it: "no smp.json"); the export equals the one from the step folder."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    assert train(ck, data, r, 3, "--save-every", 1).returncode == 0
    step = r / "step-000003"
    v = run("smp-verify", r, check=0)
    assert v.stdout.startswith(f"{step}: ok: "), v.stdout
    assert json.loads(run("smp-inspect", "--json", r, check=0).stdout) == json.loads(run("smp-inspect", "--json", step, check=0).stdout)
    run("smp-merge", "--in", r, "--out", tmp_path / "from-run", check=0)
    run("smp-merge", "--in", step, "--out", tmp_path / "from-step", check=0)
    a, b = (tmp_path / "from-run" / "model.safetensors").read_bytes(), (tmp_path / "from-step" / "model.safetensors").read_bytes()
    assert a == b
    run("smp-convert", "reshard", "--in", r, "--out", tmp_path / "re", "--layout", "tp=2", check=0)
    run("smp-verify", tmp_path / "re", check=0)


def on_a_terminal(args):
    """Run a command with stderr on a pseudo-terminal; what it wrote there."""
    import pty  # noqa: F401  (os.openpty needs it on some platforms)
    master, slave = os.openpty()
    try:
        p = subprocess.run([str(BUILD / "bin" / args[0]), *map(str, args[1:])], stdout=subprocess.PIPE, stderr=slave,
                           timeout=120)
    finally:
        os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed and its data read
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return p.returncode, out.decode()


def test_progress_lines_on_a_terminal_only(tmp_path):
    """hf2smp, smp-verify (new: it said nothing while it read) and smp-merge draw a
    progress line ("label done / total") on a terminal, ending at the total; smp-eval's
    and smp-train's loads (new) a "loading" line, erased for the "loaded" line, and the
    check of the token files before it (new) a "checking the token files" line, erased
    too (its watch erases even where the check ended before its first tick); with
    stderr not a terminal (a log) there is none."""
    hf = tmp_path / "hf"
    models.make("llama-sharded", hf)
    ck = tmp_path / "ck"
    cmds = [(("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=2"), "smp-convert: writing "),
            (("smp-verify", ck), "smp-verify: verifying "), (("smp-merge", "--in", ck, "--out", tmp_path / "m"), "smp-merge: merging ")]
    for args, label in cmds:
        rc, text = on_a_terminal(args)
        assert rc == 0, text
        last = [ln for ln in text.replace("\r", "\n").splitlines() if ln.startswith(label)]
        assert last, (args, text)
        done, total = last[-1][len(label):].split("/s")[0].split(" / ")[:2]
        assert done.strip() == total.split("  ")[0].strip(), last[-1]
    p = run("smp-verify", ck, check=0)
    assert "\r" not in p.stderr and "verifying" not in p.stderr, p.stderr
    # the loads: a "loading" line while the checkpoint is read, erased for the "loaded" line
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, 200, size=2000))
    for args in (("smp-eval", "--ckpt", ck, "--data", data, "--batch", 1, "--seq", 16, "--batches", 1),
                 ("smp-train", "--ckpt", ck, "--data", data, "--save-dir", tmp_path / "run", "--steps", 1, "--batch", 2,
                  "--seq", 16, "--layout", "pp=1")):
        rc, text = on_a_terminal(args)
        # the check's line, then the "loading" line, erased first
        assert rc == 0 and f"\r\x1b[K\r\x1b[K{args[0]}: loaded " in text, text
    p = run("smp-eval", "--ckpt", ck, "--data", data, "--batch", 1, "--seq", 16, "--batches", 1, check=0)
    assert "loading" not in p.stderr and "\r" not in p.stderr and "\x1b" not in p.stderr, p.stderr


def test_each_save_is_said_with_its_bytes_and_time(tmp_path):
    """smp-train says each save ("saved RUN/step-N: B bytes in T s (R GB/s)", B the bytes
    of the step folder's files; new: saves were silent, the last one named by the final
    line only); on a terminal below the step line, which it ends, with no blank line."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    p = train(ck, data, r, 3, "--save-every", 2)
    assert p.returncode == 0, p.stderr
    saved = [ln for ln in p.stderr.splitlines() if ": saved " in ln]
    assert len(saved) == 2, p.stderr
    for ln, step in zip(saved, (2, 3)):
        folder = r / f"step-{step:06d}"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        m = re.fullmatch(rf"smp-train: saved {re.escape(str(folder))}: (\d+) bytes in ([0-9.]+) s \(([0-9.]+) GB/s\)", ln)
        assert m and int(m[1]) == size and float(m[2]) > 0, (ln, size)
    rc, text = on_a_terminal(("smp-train", "--ckpt", ck, "--data", data, "--save-dir", tmp_path / "tty", "--steps", 2,
                              "--save-every", 1, "--batch", 2, "--seq", 16))
    text = text.replace("\r\n", "\n")
    assert rc == 0 and re.search(r"step 1/2 [^\r\n]*\nsmp-train: saved [^\n]*step-000001: \d+ bytes", text), text
    assert re.search(r"step 2/2 [^\r\n]*\nsmp-train: saved [^\n]*step-000002: [^\n]*\nsmp-train: step 2 of 2", text), text
    assert "\n\n" not in text, text


def test_a_resumed_run_whose_schedule_changes_says_so(tmp_path):
    """Flags given again override the run's (a longer run, another --lr): allowed, now
    said once, with the learning rate the run goes on at and the one it had, each the rate
    a run straight through logs at that step."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(0).integers(0, vocab_of(CASE), size=4000))
    sched = ("--lr", "1e-3", "--warmup", 1)
    logs = {}
    for name, steps in (("four", 4), ("eight", 8)):  # straight through: the rates of each schedule
        assert train(ck, data, tmp_path / name, steps, *sched, "--log", tmp_path / f"{name}.jsonl").returncode == 0
        logs[name] = [json.loads(x)["lr"] for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    r = tmp_path / "run"
    assert train(ck, data, r, 4, *sched, "--stop-at", 2).returncode == 0
    p = train(r, data, r, 8)
    assert p.returncode == 0, p.stderr
    notes = [ln for ln in p.stderr.splitlines() if "schedule changes" in ln]
    m = re.fullmatch(r"smp-train: note: the run's learning-rate schedule changes at step 2, --steps 8 \(was 4\): "
                     r"its rate there (\S+), was (\S+)", notes[0] if len(notes) == 1 else "")
    assert m, p.stderr
    assert abs(float(m[1]) / logs["eight"][2] - 1) < 1e-5 and abs(float(m[2]) / logs["four"][2] - 1) < 1e-5, (m[0], logs)
    p = train(r, data, r, 8, "--lr", "1e-3")  # resumed again, nothing changed: nothing said (finished: nothing to do)
    assert "schedule" not in p.stderr, p.stderr
    r2 = tmp_path / "run2"
    assert train(ck, data, r2, 4, *sched, "--stop-at", 2).returncode == 0
    p = train(r2, data, r2, 4, "--lr", "1e-3", "--warmup", 1)
    assert p.returncode == 0 and "schedule" not in p.stderr, p.stderr


def test_empty_arguments_are_usage_errors(tmp_path):
    """An empty path ("", as an unset shell variable gives) is exit 2 and one line in
    every command: it used to be read as a path ("/config.json": the root folder's,
    "": no smp.json, exit 3) or to fall through to "required" messages."""
    cases = [("smp-verify", ""), ("smp-inspect", ""), ("smp-inspect", "--json", ""),
             ("smp-merge", "--in", "", "--out", tmp_path / "m"), ("smp-merge", "--in", tmp_path, "--out", ""),
             ("smp-convert", "hf2smp", "--in", "", "--out", tmp_path / "o", "--layout", "tp=1"),
             ("smp-convert", "reshard", "--in", "", "--out", tmp_path / "o", "--layout", "tp=1"),
             ("smp-eval", "--ckpt", "", "--data", tmp_path / "d.bin", "--batch", 1, "--seq", 8),
             ("smp-train", "--ckpt", tmp_path, "--data", "", "--save-dir", tmp_path / "r", "--steps", 1)]
    for cmd, *args in cases:
        p = run(cmd, *args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and '"": an empty ' in lines[0], (cmd, args, p.returncode, p.stderr)
    assert sorted(os.listdir(tmp_path)) == []


def test_eval_json_stays_json_when_the_perplexity_overflows(tmp_path):
    """A model whose loss is finite but past 709 nats (its head scaled by 3000): the loss
    as transformers computes it, and a perplexity of null in --json (it printed `inf`,
    which no JSON parser reads, with exit 0)."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = tmp_path / "hf"
    model = models.make(CASE, hf)
    with torch.no_grad():
        model.lm_head.weight.mul_(3000.0)
    model.save_pretrained(str(hf))
    ck = tmp_path / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=1", check=0)
    toks = np.random.default_rng(1).integers(0, vocab_of(CASE), size=400)
    data = write_tokens(tmp_path / "d.bin", toks)
    p = run("smp-eval", "--ckpt", ck, "--data", data, "--batch", 1, "--seq", 16, "--batches", 1, "--json", check=0)
    got = json.loads(p.stdout)
    ids = torch.tensor(toks[:17], dtype=torch.long)[None]
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(ids[:, :16]).logits[0], ids[0, 1:]).item()
    assert want > 709 and abs(got["loss"] - want) <= 1e-4 * want, (got, want)
    assert got["perplexity"] is None and got["tokens"] == 16


def test_resume_on_other_data_is_said(tmp_path):
    """A run resumed with other token files than it trained on goes on (a new stage of
    training) and says so once; the same file by another path (a relative one from
    another folder) is not other data; the same file with other bytes is said too."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    rng = np.random.default_rng(0)
    a = write_tokens(tmp_path / "a.bin", rng.integers(0, vocab_of(CASE), size=4000))
    b = write_tokens(tmp_path / "b.bin", rng.integers(0, vocab_of(CASE), size=4000))
    r = tmp_path / "run"
    assert train(ck, a, r, 10, "--stop-at", 2).returncode == 0
    p = run("smp-train", "--ckpt", r, "--data", b, "--save-dir", r, "--stop-at", 4, check=0)
    notes = [ln for ln in p.stderr.splitlines() if ": note: " in ln]
    assert notes == [f"smp-train: note: --data is not what the run trained on ({a}); it goes on at data position 4 "
                     "in the new files"], p.stderr
    exe = BUILD / "bin" / "smp-train"
    p = subprocess.run([str(exe), "--ckpt", str(r), "--data", "b.bin", "--save-dir", str(r), "--stop-at", "6"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and ": note: " not in p.stderr, p.stderr
    # the same file with other bytes (regenerated, say): the state's fingerprint tells
    write_tokens(tmp_path / "b.bin", rng.integers(0, vocab_of(CASE), size=4000))
    p = run("smp-train", "--ckpt", r, "--data", b, "--save-dir", r, "--stop-at", 8, check=0)
    notes = [ln for ln in p.stderr.splitlines() if ": note: " in ln]
    assert notes == ["smp-train: note: --data holds other bytes than when the run trained on it (the same files, "
                     "changed since); it goes on at data position 12 in them"], p.stderr


def _run_reading(*args):
    """smp-train's (one process) exit, stderr and the bytes it read (rchar of
    /proc/PID/io, read while it is a zombie: every read(2) and pread(2) it made)"""
    p = subprocess.Popen([str(BUILD / "bin" / "smp-train"), *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.stdout.read(), p.stderr.read()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    io = dict(ln.split(": ") for ln in open(f"/proc/{p.pid}/io").read().splitlines())
    return p.wait(), err, int(io["rchar"])


def test_resume_does_not_read_again_the_files_it_checked(tmp_path):
    """A save records each token, mask and validation file it checked (inode, size, change and
    modification times, hash, the vocabulary); a resume that finds a file so does not
    read it again (a data set of hundreds of GB was read whole at every start) and says
    so: the resumed process reads fewer bytes than the token file holds. A file touched
    (or rewritten: its change time moves with any write) is read again, and a file
    rewritten with other bytes is still said as such. Under mpirun the same, and the
    fingerprint is the one a fresh check computes."""
    from test_documents import write_mask
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    rng = np.random.default_rng(8)
    toks = rng.integers(0, vocab_of(CASE), size=3_000_000)  # 6 MB
    a = write_tokens(tmp_path / "a.bin", toks)
    b = write_tokens(tmp_path / "b.bin", toks[:5000])
    mask = write_mask(tmp_path / "a.mask.bin", (rng.random(len(toks)) < 0.9).astype(np.uint8))
    mb = write_mask(tmp_path / "b.mask.bin", np.ones(5000, np.uint8))
    v = write_tokens(tmp_path / "v.bin", toks[:20000])  # validation tokens: recorded too
    r = tmp_path / "run"
    flags = ["--data", f"{a},{b}", "--loss-mask", f"{mask},{mb}", "--val-data", v, "--save-dir", r]
    rc, err, read = _run_reading("--ckpt", ck, *flags, "--steps", 10, "--batch", 2, "--seq", 16, "--stop-at", 1)
    assert rc == 0 and read > a.stat().st_size + mask.stat().st_size, (err, read)  # the first start reads them all
    rc, err, read = _run_reading("--ckpt", r, *flags, "--stop-at", 2)
    assert rc == 0 and read < a.stat().st_size, (err, read)
    assert "smp-train: 3 of 3 token files as the run checked them (inode, size and times unchanged): 8.64 MiB not " \
           "read again" in err.splitlines(), err
    fp = json.loads((r / "step-000002" / "smp.json").read_text())["training"]["data"]["fingerprint"]
    assert fp == json.loads((r / "step-000001" / "smp.json").read_text())["training"]["data"]["fingerprint"]
    os.utime(mask)  # touched: read again (its tokens are not)
    rc, err, read = _run_reading("--ckpt", r, *flags, "--stop-at", 3)
    assert rc == 0 and mask.stat().st_size < read < a.stat().st_size, (err, read)
    assert "3 of 3 token files" in err and "8.64 MiB" not in err, err
    t2 = toks.copy()
    t2[-1] = (t2[-1] + 1) % vocab_of(CASE)  # other bytes, the same size: read, and said
    write_tokens(a, t2)
    rc, err, read = _run_reading("--ckpt", r, *flags, "--stop-at", 4)
    assert rc == 0 and read > a.stat().st_size and "2 of 3 token files" in err, (err, read)
    assert "--data holds other bytes than when the run trained on it" in err, err
    # two ranks: the records of the last save, then those of a save by two ranks
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpi = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", str(BUILD / "bin" / "smp-train")]
    for stop in (5, 6):
        p = subprocess.run([*mpi, "--ckpt", str(r), *map(str, flags), "--layout", "dp=2", "--stop-at", str(stop)],
                           capture_output=True, text=True, env=env, timeout=180)
        assert p.returncode == 0 and "3 of 3 token files" in p.stderr, p.stderr
    fresh = run("smp-train", "--ckpt", ck, *flags[:-2], "--save-dir", tmp_path / "fresh", "--steps", 10, "--batch", 2,
                "--seq", 16, "--stop-at", 1, check=0)
    assert fresh.returncode == 0, fresh.stderr
    fps = [json.loads((d / "smp.json").read_text())["training"]["data"]["fingerprint"]
           for d in (r / "step-000006", tmp_path / "fresh" / "step-000001")]
    assert fps[0] == fps[1]


def _h64(h, data):
    """libshard's shard_hash64: XXH64 (seed 0) of h's 8 little-endian bytes, then data."""
    return int(xxh64(struct.pack("<Q", h) + data), 16)


def test_data_fingerprint_kind(tmp_path):
    """The state's data fingerprint is "xxh64-mib:" and 16 hex digits, recomputed here from
    the token file's bytes by train/data.h's rule with libxxhash's XXH64 (each 1 MiB block
    hashed, then the blocks' hashes; the files' sizes and hashes); a state written before
    2026-12-07 (kind "xxh64", a chain over the blocks) is not compared: resuming on the
    same files says nothing."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    rng = np.random.default_rng(2)
    a = write_tokens(tmp_path / "a.bin", rng.integers(0, vocab_of(CASE), size=700000))  # 2 blocks of uint16
    r = tmp_path / "run"
    assert train(ck, a, r, 10, "--stop-at", 2).returncode == 0
    step = r / (r / "latest").read_text().strip()
    m = json.loads((step / "smp.json").read_text())
    raw = a.read_bytes()[1024:]
    blocks = b"".join(struct.pack("<Q", _h64(0, raw[o:o + (1 << 20)])) for o in range(0, len(raw), 1 << 20))
    rec = struct.pack("<4Q", 2, len(raw) // 2, _h64(0, blocks), 0)
    assert m["training"]["data"]["fingerprint"] == "xxh64-mib:%016x" % _h64(0, rec)
    m["training"]["data"]["fingerprint"] = "xxh64:0123456789abcdef"
    (step / "smp.json").write_text(json.dumps(m))
    p = run("smp-train", "--ckpt", r, "--data", a, "--save-dir", r, "--stop-at", 4, check=0)
    assert ": note: " not in p.stderr, p.stderr


def test_validation_on_training_tokens_is_said(tmp_path):
    """--val-data naming a --data file (by any path) measures the training tokens: a
    note says so; separate files say nothing."""
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    rng = np.random.default_rng(1)
    a = write_tokens(tmp_path / "a.bin", rng.integers(0, vocab_of(CASE), size=2000))
    b = write_tokens(tmp_path / "b.bin", rng.integers(0, vocab_of(CASE), size=2000))
    os.symlink(a, tmp_path / "same.bin")
    p = train(ck, f"{b},{a}", tmp_path / "r1", 1, "--val-data", tmp_path / "same.bin")
    notes = [ln for ln in p.stderr.splitlines() if ": note: " in ln]
    assert p.returncode == 0 and notes == [f"smp-train: note: --val-data {tmp_path / 'same.bin'} is also in --data: "
                                           "val_loss is measured on training tokens"], p.stderr
    p = train(ck, a, tmp_path / "r2", 1, "--val-data", b)
    assert p.returncode == 0 and ": note: " not in p.stderr, p.stderr


def test_inputs_of_the_wrong_kind_are_named(tmp_path):
    """hf2smp given a file, nothing or a checkpoint says so (it said "FILE/config.json:
    missing"); a checkpoint reader given a Hugging Face model folder says that is what
    it is, and how to make a checkpoint of it. Exit 3, one line, nothing written."""
    hf = tmp_path / "hf"
    models.make(CASE, hf)
    weights = sorted(hf.glob("*.safetensors"))[0]
    cases = [(("smp-convert", "hf2smp", "--in", weights, "--out", tmp_path / "o", "--layout", "tp=1"), f"{weights}: not a folder (a model folder: config.json and its safetensors)"),
             (("smp-convert", "hf2smp", "--in", tmp_path / "nothing", "--out", tmp_path / "o", "--layout", "tp=1"),
              f"{tmp_path / 'nothing'}: no such folder")]
    for cmd in (("smp-verify", hf), ("smp-merge", "--in", hf, "--out", tmp_path / "o"),
                ("smp-convert", "reshard", "--in", hf, "--out", tmp_path / "o", "--layout", "tp=1"),
                ("smp-eval", "--ckpt", hf, "--data", hf / "config.json", "--batch", 1, "--seq", 8)):
        cases.append((cmd, f"{hf}: a Hugging Face model folder, not a checkpoint (smp-convert hf2smp makes one of it)"))
    ck = tmp_path / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=1", check=0)
    cases.append((("smp-convert", "hf2smp", "--in", ck, "--out", tmp_path / "o", "--layout", "tp=2"),
                  f"{ck}: an SMP checkpoint or run folder, not a model folder (smp-convert reshard changes its layout, "
                  "smp-merge exports it)"))
    for cmd, says in cases:
        p = run(*cmd)
        assert p.returncode == 3 and p.stderr.strip().splitlines() == [f"{cmd[0]}: error: {says}"], (cmd, p.stderr)
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]


def test_more_token_files_than_the_soft_open_file_limit(tmp_path):
    """A data set keeps a descriptor per token and mask file, and llm.c-style data sets
    come in a thousand shards: 600 token files with their 600 masks under a soft limit of
    1024 open files (most systems' default) are read, the soft limit raised toward the
    hard one (they failed with "Too many open files"); where the hard limit is 1024 too,
    one line that names the limit, exit 1, before the checkpoint's load."""
    import resource
    from test_documents import write_mask
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    rng = np.random.default_rng(11)
    d = tmp_path / "d"
    d.mkdir()
    for k in range(600):
        write_tokens(d / ("t-%04d.bin" % k), rng.integers(0, vocab_of(CASE), size=40))
        write_mask(d / ("t-%04d.mask.bin" % k), np.ones(40, np.uint8))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip("the hard limit of open files (%d) leaves no room to raise the soft one past 1200" % hard)
    args = ["--ckpt", ck, "--data", d / "t-????.bin", "--loss-mask", d / "t-????.mask.bin", "--batch", 2, "--seq", 16,
            "--json"]
    soft = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # noqa: E731
    both = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))  # noqa: E731
    p = subprocess.run([str(BUILD / "bin" / "smp-eval"), *map(str, args)], capture_output=True, text=True,
                       preexec_fn=soft)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == 600 * 2 * 16  # every file's two sequences of 16 + 1
    p = subprocess.run([str(BUILD / "bin" / "smp-eval"), *map(str, args)], capture_output=True, text=True,
                       preexec_fn=both)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert re.match(r"smp-eval: error: .*/d/t-\d{4}(\.mask)?\.bin: too many files: descriptor \d+ of at most 1024 "
                    r"open files \(`ulimit -n`; its hard limit is 1024\), with 64 kept", lines[0]), lines
    assert "loaded" not in p.stderr
