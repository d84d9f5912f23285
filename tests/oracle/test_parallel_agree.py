"""The ranks of a run must load the same checkpoint, read the same token files and take
the same settings. Each rank opens them itself, so on a cluster a host's stale copy of
the checkpoint (or another `latest`), another copy of a token file, or a launch that
gives a rank other flags used to train silently on a mix of them; a rank whose copy of
the run was already over ended at once while the others waited for it forever. Here an
MPMD launch (`mpirun -np 1 A : -np 1 B`) gives rank 1 other inputs than rank 0: the run
is refused in one line, before anything is written, and identical copies by other paths
are accepted."""
import os
import shutil
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
