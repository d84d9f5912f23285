"""smp-eval under mpirun (--layout): every layout gives the single rank's loss, from a
checkpoint stored in any layout, and each rank reads only the chunks its pieces touch.

The single rank's loss is transformers' (test_train.py checks that within 1e-5); here
every layout must give it within 1e-8 relative. The bytes each run reads are printed
on its "loaded" line: a model whose embedding spans several chunks shows that the
ranks of a split layout read about the checkpoint once between them, not once each.
"""
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import BUILD, run
from test_parallel import ckpt_and_data, mpirun
from test_train import write_tokens

# setup's model: test_parallel.CASE (llama-gqa-f32: 3 layers, 6 heads, 2 kv heads, vocab 101)
LOADED = re.compile(r"smp-eval: loaded .*: (\d+) bytes in ([0-9.]+) s")


def mpirun_eval(np_, *args):
    return mpirun(np_, *args, exe="smp-eval")


def eval_args(ck, data):
    return ["--ckpt", ck, "--data", data, "--batch", 8, "--seq", 16, "--json"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peval")
    ck, data = ckpt_and_data(tmp)
    one = json.loads(run("smp-eval", *eval_args(ck, data), check=0).stdout)
    return tmp, ck, data, one


@pytest.mark.parametrize("layout,np_", [("dp=2", 2), ("tp=2", 2), ("pp=3", 3), ("cp=2", 2), ("tp=2,dp=2", 4),
                                        ("pp=2,tp=2,cp=2", 8)])
def test_every_layout_gives_the_single_rank_loss(setup, layout, np_):
    _, ck, data, one = setup
    p = mpirun_eval(np_, "--layout", layout, *eval_args(ck, data))
    got = json.loads(p.stdout)  # rank 0 alone prints
    assert got["tokens"] == one["tokens"] and got["batches"] == one["batches"]
    assert abs(got["loss"] - one["loss"]) <= 1e-8 * abs(one["loss"]), (layout, got, one)
    assert LOADED.search(p.stderr), p.stderr


def test_a_checkpoint_of_another_layout(setup):
    tmp, ck, data, one = setup
    other = tmp / "ck-pp3-tp2"
    run("smp-convert", "reshard", "--in", ck, "--out", other, "--layout", "pp=3,tp=2", check=0)
    got = json.loads(mpirun_eval(8, "--layout", "tp=2,cp=2,dp=2", *eval_args(other, data)).stdout)
    assert abs(got["loss"] - one["loss"]) <= 1e-8 * abs(one["loss"])


def test_refusals(setup):
    _, ck, data, _ = setup
    p = run("smp-eval", "--layout", "tp=2", *eval_args(ck, data))
    assert p.returncode == 2 and "mpirun -np 2" in p.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", str(BUILD / "bin" / "smp-eval"), "--layout", "dp=2",
                        "--ckpt", str(ck), "--data", str(data), "--batch", "3", "--seq", "16"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode != 0 and "not divisible by dp" in p.stderr


@pytest.fixture(scope="module")
def chunky(tmp_path_factory):
    """An embedding of 3 chunks (5000 x 128 f32, chunks of 2048 rows) and a head of 3,
    stored at pp=1, uncompressed; the single rank's load bytes (every chunk once)."""
    tmp = tmp_path_factory.mktemp("chunky")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=5000, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    hf = tmp / "hf"
    LlamaForCausalLM(cfg).save_pretrained(str(hf), safe_serialization=True)
    ck = tmp / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=1", "--compress", "none", check=0)
    stored = sum(f["bytes"] for f in json.loads((ck / "smp.json").read_text())["files"])
    data = write_tokens(tmp / "d.bin", np.random.default_rng(1).integers(0, 5000, size=300))
    args = ["--ckpt", ck, "--data", data, "--batch", 2, "--seq", 16, "--batches", 1, "--json"]
    one = run("smp-eval", *args, check=0)
    read1 = int(LOADED.search(one.stderr).group(1))
    assert 0.9 * stored < read1 <= stored  # everything once (the file's metadata is not read by the load)
    return ck, args, read1, json.loads(one.stdout)["loss"]


SHARING = re.compile(r"^smp-eval: (\d+) ranks keep one copy of their weights per host and piece: "
                     r"([0-9.]+) MB in memory instead of ([0-9.]+) MB$", re.M)


def sharing(p):
    """(ranks, MB kept, MB a copy per rank would take) from rank 0's line, or None"""
    m = SHARING.search(p.stderr)
    return (int(m.group(1)), float(m.group(2)), float(m.group(3))) if m else None


def shared_by(p, ranks, fraction):
    """the line says `ranks` share, keeping `fraction` of a copy per rank (within the
    pages each shared piece is rounded to and the line's 0.1 MB)"""
    got = sharing(p)
    assert got is not None and got[0] == ranks, p.stderr
    assert abs(got[1] - fraction * got[2]) <= 0.15, (got, fraction)


def loaded(p):
    return int(LOADED.search(p.stderr).group(1))


def moved(p):
    """the bytes the ranks sent each other while loading (reading together)"""
    m = re.search(r"smp-eval: loaded .*, (\d+) bytes between the ranks$", p.stderr, re.M)
    return int(m.group(1)) if m else 0


def test_ranks_read_only_the_chunks_they_need(chunky):
    """Under pp=2 each embedding chunk is read by one stage, under tp=2 each rank reads
    the chunks of its half of the vocabulary (plus the one they share); whole-piece
    reads would read every piece once per rank."""
    _, args, read1, want = chunky
    for layout in ("pp=2", "tp=2"):
        p = mpirun_eval(2, "--layout", layout, *args)
        read = loaded(p)
        assert read < 1.6 * read1, (layout, read, read1)  # whole pieces per rank: 2x
        # within fp32 rounding: tp adds the row-parallel partial sums in another order, and
        # the ranks run on other thread counts (1e-8 held with one CPU's BLAS kernels only)
        got = json.loads(p.stdout)["loss"]
        assert abs(got - want) <= 1e-6 * want, (layout, got, want)


@pytest.mark.parametrize("layout,np_", [("dp=2", 2), ("tp=2", 2), ("pp=2,dp=2", 4), ("pp=2,tp=2,cp=2", 8)])
def test_reading_together_reads_each_chunk_once(chunky, layout, np_):
    """--read-together yes: the run reads every stored chunk exactly once between its
    ranks (the single rank's bytes), and every rank gets the same bits as reading
    alone (the losses are equal, not close). Reading alone with each rank's own copy
    (--share-weights no), a dp replica reads its chunks again."""
    _, args, read1, _ = chunky
    alone = mpirun_eval(np_, "--layout", layout, "--share-weights", "no", *args)
    together = mpirun_eval(np_, "--layout", layout, "--read-together", "yes", *args)
    assert loaded(together) == read1, (layout, loaded(together), read1)
    assert json.loads(together.stdout)["loss"] == json.loads(alone.stdout)["loss"], layout
    if "dp=2" in layout:
        assert loaded(alone) > 1.9 * read1, (layout, loaded(alone), read1)


def stale_shm_objects():
    """smp-weights-PID-RANK objects in /dev/shm whose creator is gone (another test's
    run, still going, may hold one for a moment: not counted)."""
    return sorted(p.name for p in Path("/dev/shm").glob("smp-weights-*")
                  if not Path(f"/proc/{p.name.split('-')[2]}").exists())


@pytest.mark.parametrize("layout,np_,alone", [("dp=2", 2, None), ("cp=2", 2, None), ("tp=2,dp=2", 4, "tp=2"),
                                              ("pp=2,tp=2,cp=2", 8, "pp=2,tp=2")])
def test_twins_keep_one_copy(chunky, layout, np_, alone):
    """The ranks of a host that hold the same pieces (dp, cp replicas) share one copy of
    them (the default): between them they read each piece once (the bytes of the layout
    without the replicas, `alone`), each reading part of it, and every rank computes with
    all of it: the loss is bit for bit that of each rank reading its own copy. Nothing
    is left in /dev/shm. Rank 0 says how many copies the ranks keep."""
    _, args, read1, _ = chunky
    shared = mpirun_eval(np_, "--layout", layout, *args)
    own = mpirun_eval(np_, "--layout", layout, "--share-weights", "no", *args)
    want = read1 if alone is None else loaded(mpirun_eval(np_ // 2, "--layout", alone, *args))
    assert loaded(shared) == want, (layout, loaded(shared), want)
    assert loaded(own) > 1.9 * want, (layout, loaded(own), want)
    assert json.loads(shared.stdout)["loss"] == json.loads(own.stdout)["loss"], layout
    assert "note:" not in shared.stderr, shared.stderr
    shared_by(shared, np_, 0.5)
    assert sharing(own) is None and "copy" not in own.stderr, own.stderr
    # reading together, only the twin that reads a tensor receives it: each chunk read once, the same
    # bits, and about half the bytes between the ranks of each rank taking its own copy
    together = mpirun_eval(np_, "--layout", layout, "--read-together", "yes", *args)
    apart = mpirun_eval(np_, "--layout", layout, "--read-together", "yes", "--share-weights", "no", *args)
    assert loaded(together) == read1 == loaded(apart), (layout, loaded(together), loaded(apart), read1)
    assert json.loads(together.stdout)["loss"] == json.loads(own.stdout)["loss"], layout
    assert sharing(together) == sharing(shared), together.stderr
    assert 0 < moved(together) < 0.6 * moved(apart), (layout, moved(together), moved(apart))
    assert stale_shm_objects() == []


NO_MEMFD = (BUILD / "release" / "tests" / "no-memfd" if (BUILD / "release").exists()
            else BUILD / "tests" / "no-memfd")


def eval_under(prefix, np_, layout, args, each=None):
    """smp-eval under mpirun, run by `prefix` (a shell line whose "$@" is the mpirun
    command, or None), each rank by `each` (a bash line whose "$@" is the rank's
    smp-eval command, or None); MPI kept on self and tcp, off /dev/shm."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    exe = [str(BUILD / "bin" / "smp-eval")]
    if each:
        exe = ["bash", "-c", each, "bash", *exe]
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,tcp", "-np", str(np_),
           *exe, "--layout", layout, *[str(a) for a in args]]
    if prefix:
        cmd = ["sh", "-c", prefix, "sh", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return p


def small_shm(under=""):
    """the prefix of eval_under that runs the command with a 1 MiB /dev/shm, under `under`"""
    return f'exec {under} unshare --mount sh -c \'mount -t tmpfs -o size=1M tmpfs /dev/shm && exec "$@"\' sh "$@"'


def need_small_shm():
    probe = ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"]
    if subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs a mount namespace of its own (unshare --mount, mount -t tmpfs: root) to shrink /dev/shm")


def need_no_memfd():
    p = subprocess.run([str(NO_MEMFD), "true"], capture_output=True, text=True)
    if p.returncode == 125:
        pytest.skip(f"a seccomp filter cannot be installed here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr


def test_a_small_dev_shm_does_not_stop_the_twins(chunky):
    """Containers mount a small /dev/shm (Docker: 64 MB); the twins' copy is a memfd,
    not a file there: under a 1 MiB /dev/shm (a tmpfs in a mount namespace of its own)
    the two twin groups of tp=2,dp=2 still share, with the bytes and the loss of the
    default run, and no note."""
    need_small_shm()
    _, args, _, _ = chunky
    shared = eval_under(None, 4, "tp=2,dp=2", args)
    p = eval_under(small_shm(), 4, "tp=2,dp=2", args)
    assert sharing(p) == sharing(shared), p.stderr
    assert "note:" not in p.stderr, p.stderr
    assert loaded(p) == loaded(shared)
    assert json.loads(p.stdout)["loss"] == json.loads(shared.stdout)["loss"]


def test_without_memfd_the_twins_share_through_dev_shm(chunky):
    """Where memfd_create is refused (a seccomp filter, as old kernels and some sandboxes
    have it), the twins share a POSIX object in /dev/shm instead: the same bytes and loss,
    and the object unlinked once mapped (nothing left)."""
    need_no_memfd()
    _, args, _, _ = chunky
    shared = eval_under(None, 4, "tp=2,dp=2", args)
    p = eval_under(f'exec {NO_MEMFD} "$@"', 4, "tp=2,dp=2", args)
    assert sharing(p) == sharing(shared), p.stderr
    assert "note:" not in p.stderr, p.stderr
    assert loaded(p) == loaded(shared)
    assert json.loads(p.stdout)["loss"] == json.loads(shared.stdout)["loss"]
    assert stale_shm_objects() == []


def test_twins_without_shared_memory_keep_a_copy_each(chunky):
    """Neither a memfd nor room in /dev/shm (1 MiB): the run says so once, on one line
    naming the two twin groups of tp=2,dp=2 and the reason, and the ranks load their own
    copies: the loss and bytes of --share-weights no."""
    need_small_shm()
    need_no_memfd()
    _, args, _, _ = chunky
    own = mpirun_eval(4, "--layout", "tp=2,dp=2", "--share-weights", "no", *args)
    p = eval_under(small_shm(NO_MEMFD), 4, "tp=2,dp=2", args)
    notes = [ln for ln in p.stderr.splitlines() if "note:" in ln]
    assert len(notes) == 1 and notes[0].startswith("smp-eval: note: 4 ranks hold pieces that other ranks of their "
                                                   "host hold too but keep a copy each: "), p.stderr
    assert "No space left" in notes[0], p.stderr
    assert loaded(p) == loaded(own) and sharing(p) is None
    assert json.loads(p.stdout)["loss"] == json.loads(own.stdout)["loss"]


def need_pid_namespaces():
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("needs PID namespaces of its own (unshare --pid --mount-proc: root)")


def test_a_twin_in_another_pid_namespace_does_not_map_the_wrong_object(chunky, tmp_path):
    """The twins find their creator's memfd as /proc/PID/fd/N. Every rank here runs in a
    PID namespace of its own (as ranks in separate containers of one host do), so that
    path names, in the twins' namespace, a descriptor of their own: ranks 2 and 3 (the
    twins of ranks 0 and 1 under tp=2,dp=2, dp outermost) hold a decoy file, big enough
    to be mapped, on every low descriptor. They must see that it is not their creator's
    object (its device and inode) and share through /dev/shm instead: the loss and bytes
    of the default run, the decoy never written, nothing left in /dev/shm. Without the
    check, each twin would load its half into the decoy and the forward would read zeros
    in the other half."""
    need_pid_namespaces()
    _, args, _, _ = chunky
    decoy = tmp_path / "decoy"
    with open(decoy, "wb") as f:
        f.truncate(64 << 20)  # sparse zeros, more than the whole model's 6 MB of fp32
    hold = f'for fd in $(seq 3 60); do eval "exec $fd<>{shlex.quote(str(decoy))}"; done'
    each = f'if [ "$OMPI_COMM_WORLD_RANK" -ge 2 ]; then {hold}; fi; exec unshare --pid --fork --mount-proc "$@"'
    shared = eval_under(None, 4, "tp=2,dp=2", args)
    p = eval_under(None, 4, "tp=2,dp=2", args, each=each)
    assert sharing(p) == sharing(shared), p.stderr
    assert "note:" not in p.stderr, p.stderr
    assert loaded(p) == loaded(shared)
    assert json.loads(p.stdout)["loss"] == json.loads(shared.stdout)["loss"]
    with open(decoy, "rb") as f:
        assert f.read().count(0) == 64 << 20, "a twin wrote into its own descriptor's file"
    assert stale_shm_objects() == []


def test_reading_together_catches_a_corrupt_chunk(chunky, tmp_path):
    """A flipped byte in the embedding's second chunk: the rank that reads it names the
    file, the run says it once and fails; the others stay silent."""
    import shutil
    import h5py
    src, args, _, _ = chunky
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    m = json.loads((ck / "smp.json").read_text())
    piece = [t for t in m["tensors"] if t["name"] == "model.embed_tokens.weight"][0]["pieces"][0]
    with h5py.File(ck / piece["file"], "r") as f:
        info = f[piece["dataset"]].id.get_chunk_info_by_coord((2048, 0))
    with open(ck / piece["file"], "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        b = fh.read(1)
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(bytes([b[0] ^ 0x10]))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    a = [str(x) for x in args]
    a[a.index("--ckpt") + 1] = str(ck)
    p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "4", str(BUILD / "bin" / "smp-eval"),
                        "--layout", "tp=2,dp=2", "--read-together", "yes", *a], capture_output=True, text=True, env=env,
                       timeout=120)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "smp-eval: error:" in ln]
    assert p.returncode != 0 and len(lines) == 1, (p.returncode, p.stderr)
    assert piece["file"] in lines[0] and "another process" not in lines[0], lines[0]


def test_one_error_line_for_the_run(setup, tmp_path):
    """Every rank fails on the same bad input: the run says it once (the first rank in
    rank order), not once per rank, and each line is whole."""
    _, ck, data, _ = setup
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "smp.json").write_text("{}")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for cmd, extra in (("smp-eval", ["--batch", "8", "--seq", "16"]), ("smp-train", ["--save-dir", str(tmp_path / "run"), "--steps", "1"])):
        p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "4", str(BUILD / "bin" / cmd),
                            "--layout", "dp=4", "--ckpt", str(bad), "--data", str(data), *extra],
                           capture_output=True, text=True, env=env, timeout=120)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if f"{cmd}: error:" in ln]
        assert p.returncode != 0 and len(lines) == 1, (cmd, p.returncode, p.stderr)
        assert lines[0].startswith(f"{cmd}: error: ") and "smp.json" in lines[0]
    # smp-convert: every process fails on the same model folder
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{")
    p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "3", str(BUILD / "bin" / "smp-convert"),
                        "hf2smp", "--in", str(hf), "--out", str(tmp_path / "ck"), "--layout", "tp=3"],
                       capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "smp-convert: error:" in ln]
    assert p.returncode == 3 and len(lines) == 1 and "config.json" in lines[0], (p.returncode, p.stderr)
