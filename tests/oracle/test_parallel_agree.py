"""The ranks of a run must load the same checkpoint, read the same token files and take
the same settings. Each rank opens them itself, so on a cluster a host's stale copy of
the checkpoint (or another `latest`), another copy of a token file, or a launch that
gives a rank other flags used to train silently on a mix of them; a rank whose copy of
the run was already over ended at once while the others waited for it forever. Here an
MPMD launch (`mpirun -np 1 A : -np 1 B`) gives rank 1 other inputs than rank 0: the run
is refused in one line, before anything is written, and identical copies by other paths
are accepted."""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

from conftest import BUILD, run
from test_train import make_ckpt, vocab_of, write_tokens

CASE = "llama-gqa-f32"
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    _, ck = make_ckpt(tmp, CASE, sharp=False)
    toks = np.random.default_rng(4).integers(0, vocab_of(CASE), size=3000)
    a = write_tokens(tmp / "a.bin", toks)
    other = toks.copy()
    other[1234] = (other[1234] + 1) % vocab_of(CASE)  # one token of a host's copy differs
    b = write_tokens(tmp / "b.bin", other)
    os.makedirs(tmp / "host2")
    shutil.copytree(ck, tmp / "host2" / "ck")  # identical copies by other paths
    shutil.copy(a, tmp / "host2" / "a.bin")
    done = tmp / "done"  # a run that is over (step 2 of 2)
    run("smp-train", "--ckpt", ck, "--data", a, "--save-dir", done, "--steps", 2, "--batch", 4, "--seq", 16, check=0)
    return tmp, ck, a, b, done


def mpmd(cmd, rank0, rank1, timeout=120):
    exe = str(BUILD / "bin" / cmd)
    argv = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "1", exe, *map(str, rank0), ":", "-np", "1", exe,
            *map(str, rank1)]
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=timeout)


def errors(p):
    return [ln for ln in p.stderr.splitlines() if ": error: " in ln]


def refusal(cmd, what, a, ck, setting=None):
    """(exit code, error line) of cmd refusing rank 1's other input"""
    if what == "data":
        return 3, (f"{cmd}: error: {a}: rank 1 and rank 0 read different token files (other files, or other bytes in a "
                   "host's copy); every rank must read the same ones")
    if what == "ckpt":
        return 3, (f"{cmd}: error: {ck}: rank 1 and rank 0 loaded different checkpoints (their smp.json differ: another "
                   "copy on a host, or another `latest`); every rank must load the same one")
    return 2, f"{cmd}: error: {setting}: every rank of a run takes the same settings (see {cmd} --help)"


TRAIN = ["--steps", 2, "--batch", 4, "--seq", 16, "--layout", "dp=2"]


@pytest.mark.parametrize("what", ["data", "ckpt", "finished", "lr", "layout", "together", "stages", "same"])
def test_train_ranks_agree_on_their_inputs(inputs, tmp_path, what):
    tmp, ck, a, b, done = inputs
    out = tmp_path / "run"
    rank0 = ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN]
    if what == "stages":  # two pipeline stages over the model's 3 layers, split otherwise
        rank0 = ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN[:-2], "--layout", "pp=2", "--microbatches", 2,
                 "--stages", "2,1"]
    rank1 = {"data": ["--ckpt", ck, "--data", b, "--save-dir", out, *TRAIN],
             "ckpt": ["--ckpt", done, "--data", a, "--save-dir", out, *TRAIN[:-2], "--layout", "dp=2", "--steps", 3],
             "finished": ["--ckpt", done, "--data", a, "--save-dir", out, *TRAIN],
             "lr": ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN, "--lr", 1e-3],
             "layout": ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN[:-2], "--layout", "tp=2"],
             "together": ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN, "--read-together", "yes"],
             "stages": ["--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN[:-2], "--layout", "pp=2", "--microbatches", 2,
                        "--stages", "1,2"],
             "same": ["--ckpt", tmp / "host2" / "ck", "--data", tmp / "host2" / "a.bin", "--save-dir", out, *TRAIN]}[what]
    p = mpmd("smp-train", rank0, rank1)
    if what == "same":
        assert p.returncode == 0, p.stderr
        assert (out / "latest").read_text().strip() == "step-000002"
        return
    setting = {"lr": "rank 1 runs with --lr 0.001, rank 0 with 0.0003",
               "layout": "rank 1 runs with --layout's tp 2, rank 0 with 1",
               "together": "rank 1 runs with --read-together (-1: auto) 1, rank 0 with -1",
               "stages": "rank 1 runs with --stages (a stage's layers) 1, rank 0 with 2"}.get(what)
    code, line = refusal("smp-train", "ckpt" if what == "finished" else what, a, ck, setting)
    assert p.returncode == code and errors(p) == [line], p.stderr
    assert not out.exists()  # nothing written


EVAL = ["--batch", 4, "--seq", 16, "--layout", "dp=2"]


@pytest.mark.parametrize("what", ["data", "ckpt", "batches", "share", "same"])
def test_eval_ranks_agree_on_their_inputs(inputs, what):
    tmp, ck, a, b, done = inputs
    rank0 = ["--ckpt", ck, "--data", a, *EVAL]
    rank1 = {"data": ["--ckpt", ck, "--data", b, *EVAL], "ckpt": ["--ckpt", done, "--data", a, *EVAL],
             "batches": ["--ckpt", ck, "--data", a, *EVAL, "--batches", 2],
             "share": ["--ckpt", ck, "--data", a, *EVAL, "--share-weights", "no"],
             "same": ["--ckpt", tmp / "host2" / "ck", "--data", tmp / "host2" / "a.bin", *EVAL]}[what]
    p = mpmd("smp-eval", rank0, rank1)
    if what == "same":
        one = run("smp-eval", "--ckpt", ck, "--data", a, "--batch", 4, "--seq", 16, check=0)
        assert p.returncode == 0, p.stderr
        assert float(p.stdout.split()[1]) == pytest.approx(float(one.stdout.split()[1]), rel=1e-6)
        return
    code, line = refusal("smp-eval", what, a, ck, {"batches": "rank 1 runs with --batches (-1: all) 2, rank 0 with -1",
                                                   "share": "rank 1 runs with --share-weights (1: yes) 0, rank 0 with 1"}.get(what))
    assert p.returncode == code and errors(p) == [line], p.stderr


@pytest.mark.parametrize("cmd", ["smp-eval", "smp-convert"])
def test_ranks_take_latest_as_rank_0_read_it(inputs, tmp_path, cmd):
    """A run folder's `latest` is read once, by rank 0, and every rank opens that step
    under its own path: ranks that each read it could load two checkpoints when a run
    training there saved between their looks (refused as different checkpoints, or
    worse). Rank 1's copy of the run folder here has `latest` one step behind."""
    tmp, ck, a, b, done = inputs
    runs = tmp_path / "a", tmp_path / "b"
    for r in runs:
        shutil.copytree(done, r)
    shutil.copytree(ck, runs[1] / "step-000001")
    (runs[1] / "latest").write_text("step-000001\n")  # as rank 1 would have read it a save earlier
    if cmd == "smp-eval":
        p = mpmd(cmd, ["--ckpt", runs[0], "--data", a, *EVAL], ["--ckpt", runs[1], "--data", a, *EVAL])
        one = run("smp-eval", "--ckpt", done, "--data", a, "--batch", 4, "--seq", 16, check=0)
        assert p.returncode == 0, p.stderr
        assert float(p.stdout.split()[1]) == pytest.approx(float(one.stdout.split()[1]), rel=1e-6)
    else:
        out = tmp_path / "out"
        p = mpmd(cmd, ["reshard", "--in", runs[0], "--out", out, "--layout", "tp=2"],
                 ["reshard", "--in", runs[1], "--out", out, "--layout", "tp=2"])
        assert p.returncode == 0, p.stderr
        run("smp-convert", "reshard", "--in", done, "--out", tmp_path / "one", "--layout", "tp=2")
        got, want = (json.loads((d / "smp.json").read_text())["tensors"] for d in (out, tmp_path / "one"))
        assert got == want
    # a copy that lacks the step rank 0 loaded: said as such (not another checkpoint loaded)
    shutil.rmtree(runs[1] / "step-000002")
    p = mpmd("smp-eval", ["--ckpt", runs[0], "--data", a, *EVAL], ["--ckpt", runs[1], "--data", a, *EVAL])
    assert p.returncode == 3 and errors(p) == [
        f"smp-eval: error: {runs[1]}: has no folder step-000002, the step that rank 0 loaded through its latest (every "
        "rank loads the same checkpoint)"], p.stderr


# smp-convert under mpirun: each process opens the source and parses its flags itself,
# and the output ranks are split over the processes; a host with another copy of the
# model folder (another revision, a fine-tune under the same name) or of the checkpoint
# wrote, silently, a checkpoint whose pieces came from two models.
CONV = "llama-sharded"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import torch
    import models
    tmp = tmp_path_factory.mktemp("agree-convert")
    m = models.make(CONV, tmp / "hf")
    m.save_pretrained(str(tmp / "resplit"), safe_serialization=True, max_shard_size="200KB")  # the same weights
    with torch.no_grad():  # a fine-tune: every weight moved a little, the shapes and config the same
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    m.save_pretrained(str(tmp / "tuned"), safe_serialization=True, max_shard_size="60KB")
    for name, hf in (("ck", "hf"), ("ck-tuned", "tuned")):
        run("smp-convert", "hf2smp", "--in", tmp / hf, "--out", tmp / name, "--layout", "tp=2")
    shutil.copytree(tmp / "ck", tmp / "ck-copy")
    return tmp


CONVERT = ["--layout", "pp=2,tp=2", "--stages", "3,1"]


@pytest.mark.parametrize("what", ["model", "layout", "stages", "compress", "dtype", "resplit", "ckpt", "ckpt-same"])
def test_convert_processes_agree_on_their_inputs(sources, tmp_path, what):
    tmp = sources
    out = tmp_path / "out"
    sub, src = ("reshard", tmp / "ck") if what.startswith("ckpt") else ("hf2smp", tmp / "hf")
    rank0 = [sub, "--in", src, "--out", out, *CONVERT]
    other = {"model": ["--in", tmp / "tuned"], "layout": ["--layout", "pp=2,tp=1"], "stages": ["--stages", "1,3"],
             "compress": ["--compress", "none"], "dtype": ["--dtype", "bf16"], "resplit": ["--in", tmp / "resplit"],
             "ckpt": ["--in", tmp / "ck-tuned"], "ckpt-same": ["--in", tmp / "ck-copy"]}[what]
    p = mpmd("smp-convert", rank0, rank0[:1] + [*rank0[1:], *other], timeout=180)  # the last flag given wins
    if what in ("resplit", "ckpt-same"):  # copies of the same source by other paths (and other files)
        assert p.returncode == 0, p.stderr
        run("smp-convert", sub, "--in", src, "--out", tmp_path / "one", *CONVERT)
        a, b = (json.loads((d / "smp.json").read_text())["tensors"] for d in (out, tmp_path / "one"))
        assert a == b  # the same pieces with the same checksums
        return
    if what in ("model", "ckpt"):
        kind = ("read different model folders (their config.json or weights differ: another copy on a host); every "
                "rank must read the same one") if what == "model" else (
                "loaded different checkpoints (their smp.json differ: another copy on a host, or another `latest`); "
                "every rank must load the same one")
        code, line = 3, f"smp-convert: error: {src}: rank 1 and rank 0 {kind}"
    else:
        setting = {"layout": "--layout's tp 1, rank 0 with 2", "stages": "--stages (a stage's layers) 1, rank 0 with 3",
                   "compress": "--compress (its zstd level) 0, rank 0 with 1",
                   "dtype": "--dtype BF16, rank 0 with (not given)"}[what]
        code, line = 2, (f"smp-convert: error: rank 1 runs with {setting}: every rank of a run takes the same settings "
                         "(see smp-convert --help)")
    assert p.returncode == code and errors(p) == [line], p.stderr
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))  # nothing written, no staging left


def own_disk(tmp_path):
    """A folder that rank 1 sees as an empty tmpfs of its own (a host's local disk): a
    mount namespace (unshare -m). None where this machine does not allow one."""
    shared = tmp_path / "shared"
    shared.mkdir()
    p = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {shared} && touch {shared}/x"],
                       capture_output=True, text=True)
    return shared if p.returncode == 0 and not (shared / "x").exists() else None


def on_own_disk(shared, argv):
    exe = str(BUILD / "bin" / argv[0])
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none {shared} && exec "$0" "$@"', exe, *map(str, argv[1:])]


@pytest.mark.parametrize("cmd", ["smp-train", "smp-convert"])
def test_output_folder_not_shared_between_ranks(inputs, tmp_path, cmd):
    """Every rank writes its part of a checkpoint into the folder that rank 0 made: where
    --save-dir (--out) is on a host's own disk, smp-train trained to its first save and
    failed there ("cannot create the HDF5 file", every step lost); smp-convert said the
    same. Now each rank checks that it sees rank 0's folder first: one line, exit 2."""
    tmp, ck, a, b, done = inputs
    shared = own_disk(tmp_path)
    if shared is None:
        pytest.skip("no mount namespaces here (unshare -m): cannot give rank 1 a folder of its own")
    out = shared / "out"
    argv = (["smp-train", "--ckpt", ck, "--data", a, "--save-dir", out, *TRAIN] if cmd == "smp-train" else
            ["smp-convert", "reshard", "--in", ck, "--out", out, "--layout", "tp=2"])
    p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "1", str(BUILD / "bin" / cmd),
                        *map(str, argv[1:]), ":", "-np", "1", *on_own_disk(shared, argv)],
                       capture_output=True, text=True, env=ENV, timeout=120)
    if cmd == "smp-train":
        want = (f"smp-train: error: {out}: rank 1 does not see the run folder that rank 0 made (its .lock, written by "
                "rank 0, is missing there): --save-dir must be on a file system every rank shares (each save writes "
                "every rank's part into it) (see smp-train --help)")
    else:
        want = re.compile(re.escape(f"smp-convert: error: {out}: rank 1 does not see the staging folder that rank 0 "
                                    f"made ({shared}/.tmp-out-") + r"\d+-\d+" + re.escape(
            "): --out must be on a file system every rank shares (see smp-convert --help)"))
    assert p.returncode == 2 and len(errors(p)) == 1, p.stderr
    assert errors(p)[0] == want if isinstance(want, str) else want.fullmatch(errors(p)[0]), p.stderr
    assert not any(x.name.startswith("step-") or x.name.startswith(".tmp-") for x in shared.iterdir())
    assert not out.exists() if cmd == "smp-convert" else not list(out.glob("step-*"))


def _files_fingerprint(files):
    """train/data.h's fingerprint of token files (and their masks), recomputed here with
    libxxhash's XXH64: each 1 MiB block hashed, then the blocks' hashes; a mask's hash
    chained after its tokens'; the files' token sizes, counts and hashes."""
    from test_hardening import _h64

    def blocks(raw):
        return _h64(0, b"".join(struct.pack("<Q", _h64(0, raw[o:o + (1 << 20)])) for o in range(0, len(raw), 1 << 20)))
    h = 0
    for tok, mask in files:
        raw = tok.read_bytes()[1024:]
        es = 4 if struct.unpack("<i", tok.read_bytes()[:4])[0] == 20240801 else 2
        fh = blocks(raw)
        if mask:
            fh = _h64(fh, struct.pack("<Q", blocks(mask.read_bytes()[1024:])))
        h = _h64(h, struct.pack("<4Q", es, len(raw) // es, fh, mask is not None))
    return "xxh64-mib:%016x" % h


def test_host_ranks_split_the_checking_of_the_token_files(tmp_path):
    """The ranks of a host split the reading and hashing of the token and mask files
    (each a run of the files' 1 MiB blocks, all files in one list; the bytes a host
    reads once, not once per rank): the state's fingerprint is the one recomputed here
    from the files (uint16 and uint32 files, several blocks, masks) whatever the rank
    count, and a bad token or mask byte in any rank's run is said in one line naming
    the file and the position, exit 3, nothing written."""
    from test_documents import write_mask
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    V = vocab_of(CASE)
    rng = np.random.default_rng(5)
    sizes = [(700000, False), (1500000, True), (300000, False)]  # 2, 6 and 1 blocks of tokens; 1, 2, 1 of masks
    toks = [rng.integers(0, V, size=n) for n, _ in sizes]
    masks = [(rng.random(n) < 0.8).astype(np.uint8) for n, _ in sizes]
    files = [(write_tokens(tmp_path / f"t{i}.bin", t, u32=u), write_mask(tmp_path / f"t{i}.mask.bin", m))
             for i, (t, m, (_, u)) in enumerate(zip(toks, masks, sizes))]
    data = ",".join(str(t) for t, _ in files)
    mask = ",".join(str(m) for _, m in files)
    want = _files_fingerprint(files)
    for n in (1, 2, 3):
        out = tmp_path / f"run{n}"
        p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n), str(BUILD / "bin" / "smp-train"),
                            "--ckpt", str(ck), "--data", data, "--loss-mask", mask, "--save-dir", str(out), "--steps", "1",
                            "--batch", "6", "--seq", "16", "--layout", f"dp={n}"],
                           capture_output=True, text=True, env=ENV, timeout=180)
        assert p.returncode == 0, p.stderr
        m = json.loads((out / "step-000001" / "smp.json").read_text())
        assert m["training"]["data"]["fingerprint"] == want, n
    # faults in rank 2's run (the last blocks: t1.bin's end, t2.bin) and in rank 0's (t0.bin's start)
    bad = toks[2].copy()
    bad[123456] = V + 7
    write_tokens(tmp_path / "t2.bin", bad)
    late = f"{tmp_path / 't2.bin'}: token {V + 7} at position 123456 is outside the model's vocabulary (vocab_size {V})"
    m0 = masks[0].copy()
    m0[4321] = 2
    early = f"{tmp_path / 't0.mask.bin'}: mask byte 2 at position 4321 (a mask byte is 0 or 1)"
    for cmd, extra, line in (("smp-train", ["--save-dir", tmp_path / "bad"], late), ("smp-eval", [], late),
                             ("smp-train", ["--save-dir", tmp_path / "bad"], early)):
        if line is early:
            write_tokens(tmp_path / "t2.bin", toks[2])
            write_mask(tmp_path / "t0.mask.bin", m0)
        args = [str(a) for a in ("--ckpt", ck, "--data", data, "--loss-mask", mask, "--batch", 6, "--seq", 16,
                                 "--layout", "dp=3", *extra)] + (["--steps", "1"] if cmd == "smp-train" else [])
        p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "3", str(BUILD / "bin" / cmd), *args],
                           capture_output=True, text=True, env=ENV, timeout=180)
        assert p.returncode == 3 and errors(p) == [f"{cmd}: error: {line}"], (cmd, p.stderr)
    assert not (tmp_path / "bad").exists()
