"""Crash safety: kill -9 hf2smp, reshard and merge at random instants.

A model saved by transformers (Llama, hidden 256, 8 layers, vocab 4000, f32: ~27 MB),
converted with `--compress zstd:19` so that hf2smp and reshard run for a few seconds.
Each command is first run once uninterrupted (its duration, and the reference output);
then every trial starts it again into a new output path and sends SIGKILL at an instant
drawn uniformly between 0 and that duration. Afterwards the output path either does not
exist, or it is whole:
- hf2smp / reshard: `smp-verify` passes on it, and its manifest lists the very tensors
  and pieces (offsets, shapes, xxh64 of the data) of the uninterrupted run;
- merge: the folder loads with safetensors and holds tensors equal to the reference.
After the trials, the leftovers of the killed runs (staging folders) are still there, and
one more uninterrupted run into the name of a run killed in staging must succeed.
hf2smp and merge are also tried with --no-fsync: without the fsyncs, a killed process
must still never leave a whole-looking output (only a crash of the machine may).

SMP_CRASH_SEED=N replays the instants of a failing run (the seed is in every message).
"""
import json
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import BUILD, run

SEED = int(os.environ.get("SMP_CRASH_SEED", random.SystemRandom().randrange(1 << 30)))
TRIALS = {"hf2smp": 6, "reshard": 6, "merge": 10, "hf2smp --no-fsync": 4, "merge --no-fsync": 4}
LAYOUT, RESHARD_LAYOUT = "pp=2,tp=2", "tp=4"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("crash")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"), safe_serialization=True)
    ref = load_file(str(root / "hf" / "model.safetensors"))
    assert sum(v.nbytes for v in ref.values()) > 20e6
    # the checkpoint that reshard and merge read (default compression: quick to make)
    timed(cmd_line("hf2smp", root, root / "ck-ref", compress="zstd"))
    return root, ref


def cmd_line(what, root, out, compress="zstd:19"):
    """what: the command, then any flags ("hf2smp --no-fsync")."""
    exe = lambda c: str(BUILD / "bin" / c)  # noqa: E731
    what, *flags = what.split()
    if what == "hf2smp":
        return [exe("smp-convert"), "hf2smp", "--in", str(root / "hf"), "--out", str(out), "--layout", LAYOUT,
                "--compress", compress, *flags]
    if what == "reshard":
        return [exe("smp-convert"), "reshard", "--in", str(root / "ck-ref"), "--out", str(out), "--layout",
                RESHARD_LAYOUT, "--compress", compress, *flags]
    return [exe("smp-merge"), "--in", str(root / "ck-ref"), "--out", str(out), *flags]


def timed(argv):
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{argv}: exit {p.returncode}\n{p.stderr}"
    return time.monotonic() - t0


def pieces(ck):
    m = json.loads((ck / "smp.json").read_text())
    return sorted((t["group"], t["name"], t["dtype"], tuple(t["shape"]),
                   tuple(sorted((tuple(p["offset"]), tuple(p["shape"]), p["xxh64"]) for p in t["pieces"])))
                  for t in m["tensors"])


def merged_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_whole(what, out, expect, why):
    """The output of a trial is absent or whole; a list of problems."""
    if not os.path.lexists(out):
        return []
    if what.split()[0] in ("hf2smp", "reshard"):
        p = run("smp-verify", out)
        if p.returncode != 0:
            return [f"{why}: {out.name} exists but smp-verify says: exit {p.returncode} {p.stderr.strip()}"]
        if pieces(out) != expect:
            return [f"{why}: {out.name} verifies but does not hold the uninterrupted run's tensors and pieces"]
        return []
    try:
        got = merged_tensors(out)
        cfg = json.loads((out / "config.json").read_text())
    except Exception as e:  # noqa: BLE001  (any failure to load is the finding)
        return [f"{why}: {out.name} exists but does not load: {type(e).__name__}: {e}"]
    if set(got) != set(expect) or cfg.get("num_hidden_layers") != 8:
        return [f"{why}: {out.name} loads but holds {len(got)} tensors, expected {len(expect)}"]
    bad = [k for k in expect if got[k].dtype != expect[k].dtype or not np.array_equal(got[k], expect[k])]
    return [f"{why}: {out.name}: tensors differ from the reference: {bad[:3]}"] if bad else []


@pytest.mark.parametrize("what", list(TRIALS))
def test_kill_at_random_instants(setup, what):
    root, ref = setup
    work = root / f"trials-{what.replace(' --', '-')}"
    work.mkdir()
    merge = what.startswith("merge")
    # the uninterrupted run: its duration and the reference output
    duration = timed(cmd_line(what, root, work / "uninterrupted"))
    expect = pieces(work / "uninterrupted") if not merge else ref
    if not merge:
        assert run("smp-verify", work / "uninterrupted").returncode == 0
    else:
        assert not check_whole("merge", work / "uninterrupted", ref, "the uninterrupted run")
    rng = random.Random(f"{SEED}-{what}")
    problems, killed, absent = [], 0, 0
    for i in range(TRIALS[what]):
        out = work / f"out{i}"
        at = rng.uniform(0, duration)
        why = f"{what} trial {i} (SMP_CRASH_SEED={SEED}, SIGKILL at {at:.3f}s of {duration:.3f}s)"
        p = subprocess.Popen(cmd_line(what, root, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(at)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            killed += 1
        p.wait(timeout=60)
        problems += check_whole(what, out, expect, why)
        absent += not os.path.lexists(out)
    print(f"{what}: {TRIALS[what]} trials over {duration:.2f}s, {killed} killed mid-run, {absent} left no output, "
          f"{TRIALS[what] - absent} left a whole one (SMP_CRASH_SEED={SEED})")
    assert not problems, "\n".join(problems)
    # the trials did kill runs mid-way, before they committed (on a loaded machine a run
    # may end sooner than the uninterrupted one did, so not every trial is a kill)
    assert killed and absent, f"{killed} trials killed, {absent} left no output (SMP_CRASH_SEED={SEED})"
    # one more: killed as soon as its staging folder appears, so that a stale staging
    # folder of that very name is left behind ...
    out = work / "stale"
    p = subprocess.Popen(cmd_line(what, root, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < duration + 10:
        if [e for e in os.listdir(work) if ".tmp-" in e and "stale" in e]:
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, f"{what} finished before its staging folder was seen ({p.returncode})"
    assert not check_whole(what, out, expect, "the run killed in staging")
    stale = [e for e in os.listdir(work) if ".tmp-" in e and "stale" in e]
    assert stale and not os.path.lexists(out), os.listdir(work)
    # ... and it does not stand in the way of a new, uninterrupted run into that name
    # (without compression, to save time: the pieces' xxh64 are of the raw data), which
    # names it (hidden, and as large as what was written before the kill)
    p = subprocess.run(cmd_line(what, root, out, compress="none"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cmd = "smp-merge" if what.startswith("merge") else "smp-convert"
    notes = [ln for ln in p.stderr.splitlines() if ": note: " in ln]
    assert len(notes) == 1 and notes[0].startswith(f"{cmd}: note: {work / stale[0]} (") and notes[0].endswith(
        f") is left from an earlier write of {out} that did not finish; delete it unless that write is still "
        "running"), p.stderr
    assert os.path.isdir(out) and os.path.isdir(work / stale[0])  # noted, not removed
    assert not check_whole(what, out, expect, "the run after the trials")
    # and the checkpoint that the killed readers were reading is untouched
    if not what.startswith("hf2smp"):
        p = run("smp-verify", root / "ck-ref")
        assert p.returncode == 0, p.stderr


def test_training_killed_mid_save_leaves_no_staging_after_resume(tmp_path):
    """smp-train killed while saving (SIGKILL, a lost node, a job's time limit) leaves the
    hidden staging folder of that save, a whole checkpoint's size; the resumed run, which
    holds the run folder's lock, removes it with a note."""
    from test_train import make_ckpt, vocab_of, write_tokens
    _, ck = make_ckpt(tmp_path, "llama-gqa-f32", sharp=False)
    data = write_tokens(tmp_path / "a.bin", np.random.default_rng(1).integers(0, vocab_of("llama-gqa-f32"), 4000))
    out = tmp_path / "run"
    argv = [str(BUILD / "bin" / "smp-train"), "--data", str(data), "--save-dir", str(out), "--steps", "400",
            "--batch", "4", "--seq", "16", "--save-every", "1", "--keep", "2"]
    p = subprocess.Popen([*argv, "--ckpt", str(ck)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = lambda: [e for e in os.listdir(out) if e.startswith(".tmp-step-")] if out.is_dir() else []  # noqa: E731
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < 120:
        if (out / "latest").exists() and staging():  # a save after the first one, in flight
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.0005)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, f"smp-train ended before a save was seen in flight ({p.returncode})"
    left = staging()
    assert len(left) == 1, os.listdir(out)
    r = subprocess.run([*argv, "--ckpt", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "staging" in ln]
    assert len(notes) == 1 and notes[0].startswith(f"smp-train: note: {out / left[0]}: removed, the staging folder of "
                                                   "a save that did not finish ("), r.stderr
    assert not staging() and (out / "latest").read_text().strip() == "step-000400"
