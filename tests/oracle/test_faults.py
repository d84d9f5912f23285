"""Faults of the output disk: every command that writes, on a full or a read-only disk.

The output location of each command is a small tmpfs, mounted under tmp_path (and
unmounted after each test, whatever happened). Each command is first run once into a
big tmpfs: the space its output really takes (statvfs, whole pages) sizes the faults:
- early: a few KiB, so that only the staging folder fits;
- middle: about half of the output;
- close: all but the output's last few pages before its tail (manifest, extra files):
  for the HDF5 writers, with one shard file (pp=1), the metadata that closing the shard
  file flushes; for smp-merge, the last pages of the weights;
- end: one page short of the whole output (the manifest or the last file fails);
- read-only: a tmpfs mounted (or remounted) ro.
Every command (`smp-convert hf2smp`, `reshard`, `init`, `smp-merge`, and smp-train's
save into --save-dir) must then fail as the project promises (README, "Every command
shares one error convention"; docs/FORMAT.md, "The commit protocol"):
- exit code 1 (an I/O fault): no crash, no hang (every command runs under a timeout);
- exactly one stderr line `smp-<cmd>: error: ...` that names a path on the faulty disk,
  and no HDF5 error stack (HDF5-DIAG) besides it;
- no sanitizer report (the middle and close cases also run the ASan + UBSan build);
- nothing whole-looking left: no output folder, no smp.json or model.safetensors
  anywhere on the disk, no `.tmp-*` staging folder in the output's parent;
- smp-train: the run folder already holds a good step checkpoint and `latest` (a
  first run with room); the resumed run's save hits the fault; afterwards `latest`
  and the checkpoint it names are untouched (byte for byte), smp-verify accepts it,
  and once space is freed (or the disk is writable again) the same resume succeeds.

Needs root (mount). Without it, or where tmpfs cannot be mounted, the module skips.
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from conftest import BUILD, BUILD_SAN

TIMEOUT = 120          # seconds per command: a hang is a failure
PAGE = 4096
BIG = 256 << 20        # the tmpfs of the reference runs
EARLY = 2 * PAGE       # room for the staging folder, not for the output
COMMANDS = ["hf2smp", "reshard", "init", "merge", "train"]
POINTS = ["early", "middle", "close", "end"]
TRAIN = ["--batch", 4, "--seq", 16, "--lr", 1e-3, "--warmup", 1, "--seed", 3]
FIRST_STOP, STEPS = 2, 4  # the first run saves step 2; the resumed one would save step 4


# ---------------------------------------------------------------- helpers
def _mount_cmd(*args):
    return subprocess.run(["mount", *map(str, args)], capture_output=True, text=True, timeout=30)


def _used(d):
    st = os.statvfs(d)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _pages(n):
    return max(PAGE, (int(n) + PAGE - 1) // PAGE * PAGE)


class Mounts:
    """tmpfs mounts made by one test (or module), unmounted by close()."""

    def __init__(self, base):
        self.base, self.dirs = base, []

    def mount(self, name, size, ro=False):
        d = self.base / name
        d.mkdir(parents=True)
        opts = f"size={_pages(size) // 1024}k,mode=0755" + (",ro" if ro else "")
        p = _mount_cmd("-t", "tmpfs", "-o", opts, "tmpfs", d)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs on {d} ({opts}): {p.stderr.strip()}")
        self.dirs.append(d)
        return d

    def remount(self, d, size=None, ro=None):
        opts = ["remount"]
        if size is not None:
            opts.append(f"size={_pages(size) // 1024}k")
        if ro is not None:
            opts.append("ro" if ro else "rw")
        p = _mount_cmd("-o", ",".join(opts), d)
        assert p.returncode == 0, f"mount -o {','.join(opts)} {d}: {p.stderr.strip()}"

    def close(self):
        for d in reversed(self.dirs):
            if subprocess.run(["umount", str(d)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
        self.dirs = []


def sh(cmd, *args, san=False):
    """One command of the build (or the ASan build), bounded by TIMEOUT."""
    exe = (BUILD_SAN if san else BUILD) / "bin" / cmd
    if san and not exe.exists():
        pytest.skip(f"{exe} is not built (scons variant=asan)")
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    argv = [str(exe), *map(str, args)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(argv)}: still running after {TIMEOUT} s (a hang)\nstderr: {e.stderr}")


def ok(cmd, *args, san=False):
    p = sh(cmd, *args, san=san)
    assert p.returncode == 0, f"{cmd} {' '.join(map(str, args))}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def write_tokens(path, toks):
    """llm.c's token file, uint16 (as test_train.write_tokens)."""
    toks = np.asarray(toks)
    h = np.zeros(256, dtype="<i4")
    h[:3] = (20240520, 1, len(toks))
    path.write_bytes(h.tobytes() + toks.astype("<u2").tobytes())
    return path


def tree(d):
    """Every entry under d (relative), for messages."""
    if not os.path.isdir(d):
        return []
    return sorted(str(p.relative_to(d)) + ("/" if p.is_dir() else f" ({p.stat().st_size} B)")
                  for p in pathlib.Path(d).rglob("*"))


def digest(d):
    """Every file under d and its sha256: what `intact` means."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(d).rglob("*")) if p.is_file()}


def expect_fault(p, cmd, disk, what):
    """The failed command kept the promise: exit 1, one error line naming a path, no report."""
    name = "smp-" + cmd if cmd in ("merge", "train") else "smp-convert"
    msg = f"{what}: exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}\nleft on the disk: {tree(disk)}"
    assert p.returncode >= 0 and p.returncode not in (134, 139), f"crashed (signal) — {msg}"
    for marker in ("Sanitizer", "runtime error:", "SUMMARY:"):
        assert marker not in p.stderr, f"a sanitizer report — {msg}"
    assert p.returncode != 0, f"succeeded on a faulty disk — {msg}"
    assert p.returncode == 1, f"expected exit 1 (an I/O fault) — {msg}"
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith(f"{name}: error: ")]
    assert len(errs) == 1, f"expected exactly one '{name}: error: ' line, got {len(errs)} — {msg}"
    assert str(disk) in errs[0], f"the error line does not name a path on {disk} — {msg}"
    # one line, not a library's own error stack besides it
    assert "HDF5-DIAG" not in p.stderr, f"HDF5's error stack printed besides the error line — {msg}"
    print(f"{what}: exit 1: {errs[0]}")


def expect_nothing_whole(disk, parent, out, what):
    """No output, no whole-looking folder anywhere on the disk, no staging folder left."""
    msg = f"{what}: left on the disk: {tree(disk)}"
    assert not os.path.lexists(out), f"the output {out.name} exists after a failed write — {msg}"
    whole = [str(p.relative_to(disk)) for n in ("smp.json", "model.safetensors", "model.safetensors.index.json")
             for p in pathlib.Path(disk).rglob(n)]
    assert not whole, f"whole-looking files left: {whole} — {msg}"
    staging = [e for e in os.listdir(parent) if ".tmp-" in e]
    assert not staging, f"staging folders left in {parent}: {staging} — {msg}"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def mountable(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the fault suite mounts tmpfs: it needs root")
    if not shutil.which("mount") or not shutil.which("umount"):
        pytest.skip("the fault suite needs mount(8) and umount(8)")
    m = Mounts(tmp_path_factory.mktemp("probe"))
    try:
        d = m.mount("t", 16 * PAGE)
        (d / "x").write_bytes(b"x")
        r = _mount_cmd("-o", "remount,ro", d)
        if r.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only ({d}): {r.stderr.strip()}")
        try:
            (d / "y").write_bytes(b"y")
            pytest.skip("a tmpfs remounted ro still takes writes here (not a real ro mount)")
        except OSError:
            pass
    finally:
        m.close()


@pytest.fixture
def disks(tmp_path, mountable):
    m = Mounts(tmp_path / "mnt")
    yield m
    m.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, mountable):
    """Models and checkpoints on the ordinary disk: only outputs go to the tmpfs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import models
    root = tmp_path_factory.mktemp("faults")
    # a few MB (f32, ~1M parameters): hf2smp/reshard/init --compress none and merge write
    # ~4 MB, so that "middle" is well inside the shard files
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"), safe_serialization=True)
    ok("smp-convert", "hf2smp", "--in", root / "hf", "--out", root / "ck", "--layout", "pp=1", "--compress", "none",
       "--no-fsync")
    # smp-train: the tiny one (its checkpoint with the optimizer state: ~1 MB)
    models.make("llama-gqa-f32", root / "hf-tiny")
    ok("smp-convert", "hf2smp", "--in", root / "hf-tiny", "--out", root / "ck-tiny", "--layout", "pp=1", "--no-fsync")
    vocab = models.CASES["llama-gqa-f32"][1]["vocab_size"]
    write_tokens(root / "d.bin", np.random.default_rng(1).integers(0, vocab, size=4000))
    return root


LAYOUTS = {"hf2smp": "pp=2,tp=2", "reshard": "tp=2", "init": "pp=2"}


def argv(cmd, root, out, single=False):
    """The command line (name, args) writing `out`; single: one shard file (pp=1)."""
    lay = "pp=1" if single else LAYOUTS.get(cmd)
    if cmd == "hf2smp":
        return "smp-convert", ["hf2smp", "--in", root / "hf", "--out", out, "--layout", lay, "--compress", "none"]
    if cmd == "reshard":
        return "smp-convert", ["reshard", "--in", root / "ck", "--out", out, "--layout", lay, "--compress", "none"]
    if cmd == "init":
        return "smp-convert", ["init", "--config", root / "hf" / "config.json", "--out", out, "--layout", lay,
                               "--seed", 1, "--compress", "none"]
    if cmd == "merge":
        return "smp-merge", ["--in", root / "ck", "--out", out]
    raise ValueError(cmd)


def train_first(root, run_dir):
    return ok("smp-train", "--ckpt", root / "ck-tiny", "--data", root / "d.bin", "--save-dir", run_dir,
              "--steps", STEPS, "--stop-at", FIRST_STOP, *TRAIN)


def train_resume(root, run_dir, san=False):
    return sh("smp-train", "--ckpt", run_dir, "--data", root / "d.bin", "--save-dir", run_dir, san=san)


def tail_pages(out):
    """The pages of what is written after the weights: the manifest (or config.json),
    the index, the extra files."""
    if (out / "smp.json").is_file():  # a checkpoint
        files = [out / "smp.json", *(out / "extra").glob("*")]
    else:  # smp-merge's export: all but the weights
        files = [f for f in out.iterdir() if f.is_file() and not f.name.endswith(".safetensors")]
    return sum(_pages(f.stat().st_size) // PAGE for f in files if f.is_file())


@pytest.fixture(scope="module")
def sizes(inputs, tmp_path_factory):
    """(cmd, single) -> (the space the output takes on tmpfs, in bytes (whole pages);
    the pages of its tail), each measured once by a run with room."""
    m = Mounts(tmp_path_factory.mktemp("ref"))
    out = {}
    try:
        for cmd in COMMANDS:
            for single in ((False,) if cmd in ("merge", "train") else (False, True)):
                d = m.mount(f"{cmd}{'-single' if single else ''}", BIG)
                if cmd == "train":
                    train_first(inputs, d / "run")
                    first = _used(d)
                    p = train_resume(inputs, d / "run")
                    assert p.returncode == 0, p.stderr
                    assert (d / "run" / "latest").read_text() == f"step-{STEPS:06d}\n"
                    need, tail = _used(d) - first, tail_pages(d / "run" / f"step-{STEPS:06d}")
                else:
                    exe, args = argv(cmd, inputs, d / "out", single)
                    ok(exe, *args)
                    need, tail = _used(d), tail_pages(d / "out")
                assert need > 64 * PAGE, f"{cmd}: the output takes only {need} bytes"
                out[cmd, single] = (need, tail)
    finally:
        m.close()
    return out


def room(cmd, point, need, tail):
    """The free space a fault point leaves for an output that needs `need` bytes."""
    if point == "early":
        return EARLY
    if point == "middle":
        return _pages(need // 2)
    if point == "close":
        # the weights written, not the last pages of the (last) shard file: for HDF5, the
        # metadata that H5Fclose flushes (a window of ~5 pages after the tail)
        return need - PAGE * (tail + 3)
    # end: one page short: the converters write the same bytes every run; smp-train's
    # manifest holds elapsed_s (a few bytes of jitter), so two pages short there
    return need - PAGE * (2 if cmd == "train" else 1)


# ---------------------------------------------------------------- the cases
CASES = [(c, pt, False) for c in COMMANDS for pt in POINTS] + [(c, "middle", True) for c in COMMANDS] + \
    [(c, "close", True) for c in COMMANDS if c != "merge"]


@pytest.mark.parametrize("cmd,point,san", CASES,
                         ids=[f"{c}-{pt}{'-asan' if s else ''}" for c, pt, s in CASES])
def test_disk_full(inputs, sizes, disks, cmd, point, san):
    single = point == "close" and cmd in LAYOUTS
    need, tail = sizes[cmd, single]
    free = room(cmd, point, need, tail)
    assert 0 < free < need, f"{cmd} ({point}): {free} bytes of room for an output of {need} ({tail} pages of tail)"
    what = (f"{cmd}{' --layout pp=1' if single else ''} with {free} bytes free of the {need} its output takes "
            f"({point}{', asan' if san else ''})")
    if cmd == "train":
        fault_train(inputs, disks, what, san, room_bytes=free)
        return
    disk = disks.mount("out", free)
    exe, args = argv(cmd, inputs, disk / "out", single)
    p = sh(exe, *args, san=san)
    expect_fault(p, cmd, disk, what)
    expect_nothing_whole(disk, disk, disk / "out", what)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_read_only(inputs, sizes, disks, cmd):
    what = f"{cmd} onto a read-only tmpfs"
    if cmd == "train":
        fault_train(inputs, disks, what, False, ro=True)
        return
    disk = disks.mount("out", BIG, ro=True)
    exe, args = argv(cmd, inputs, disk / "out")
    p = sh(exe, *args)
    expect_fault(p, cmd, disk, what)
    expect_nothing_whole(disk, disk, disk / "out", what)


def fault_train(root, disks, what, san, room_bytes=None, ro=False):
    """A run folder with a good step checkpoint and `latest`; the resumed run's save faults."""
    disk = disks.mount("run", BIG)
    run_dir = disk / "run"
    train_first(root, run_dir)
    good = f"step-{FIRST_STOP:06d}"
    assert (run_dir / "latest").read_text() == good + "\n"
    before, listing = digest(run_dir), sorted(os.listdir(run_dir))
    if ro:
        disks.remount(disk, ro=True)
    else:
        disks.remount(disk, size=_used(disk) + room_bytes)
    p = train_resume(root, run_dir, san=san)
    expect_fault(p, "train", disk, what)
    # the failed save left nothing: no new step folder, no staging folder, no temporary latest
    new = run_dir / f"step-{STEPS:06d}"
    assert not os.path.lexists(new), f"{what}: {new.name} exists after a failed save: {tree(disk)}"
    left = sorted(set(os.listdir(run_dir)) - set(listing))
    assert not left, f"{what}: the failed save left {left} in the run folder: {tree(disk)}"
    staging = [e for e in os.listdir(run_dir) if ".tmp" in e]
    assert not staging, f"{what}: staging left in the run folder: {staging}: {tree(disk)}"
    # the previous checkpoint and `latest` are intact, byte for byte, and verify
    assert (run_dir / "latest").read_text() == good + "\n", f"{what}: latest changed: {tree(disk)}"
    after = digest(run_dir)
    # .lock: the run folder's lock, which each run takes and writes its pid into
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k) and k != ".lock")
    assert not changed, f"{what}: the failed save changed {changed} in the run folder"
    v = sh("smp-verify", run_dir / good)
    assert v.returncode == 0, f"{what}: smp-verify refuses the previous checkpoint: {v.stderr}"
    # once the disk has room (or takes writes) again, the same resume goes on from it
    disks.remount(disk, size=BIG, ro=False)
    p = train_resume(root, run_dir)
    assert p.returncode == 0, f"{what}: the resume after freeing space failed: exit {p.returncode}\n{p.stderr}"
    assert (run_dir / "latest").read_text() == f"step-{STEPS:06d}\n"
    st = json.loads((new / "smp.json").read_text())["training"]
    assert st["step"] == STEPS, st
    v = sh("smp-verify", new)
    assert v.returncode == 0, f"{what}: smp-verify refuses the resumed run's checkpoint: {v.stderr}"
    assert not [e for e in os.listdir(run_dir) if ".tmp" in e], tree(disk)
