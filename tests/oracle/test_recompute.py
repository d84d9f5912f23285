"""smp-train --recompute none|attention|full: recomputation changes the memory, never
the numbers.

- one rank: the gradients of a step (--dump-grads) are bit for bit those without
  recomputation (the recomputed tensors come from the same ops on the same inputs),
  and they equal torch autograd's (so recomputation is checked against an outside
  implementation, not only against ourselves); with --fp8 delayed too;
- 4 steps on tensor-, sequence-, context- and pipeline-parallel layouts log the same
  losses and gradient norms as without recomputation, bit for bit;
- the memory line printed at start shows activations full < attention < none, and the
  parameters, gradients and optimizer state unchanged.
"""
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import run
from test_parallel import mpirun
from test_train import make_ckpt, read_log, torch_model, vocab_of, write_tokens

CASE = "llama-gqa-f32"
SEQ = 16
COMMON = ["--batch", 4, "--seq", SEQ, "--lr", 3e-3, "--seed", 3]
GRAD_ARGS = ["--batch", 4, "--seq", SEQ]  # sequential order: the step's batch is sequences 0..3
MODES = ["none", "attention", "full"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rc")
    hf, ck = make_ckpt(tmp, CASE, sharp=True)
    toks = np.random.default_rng(5).integers(0, vocab_of(CASE), size=4000)
    return tmp, hf, ck, write_tokens(tmp / "d.bin", toks), toks


def grads(tmp, ck, data, mode, *extra):
    out = tmp / f"g-{mode}-{'-'.join(map(str, extra))}"
    p = run("smp-train", "--ckpt", ck, "--data", data, "--dump-grads", out, "--steps", 1, "--recompute", mode,
            *GRAD_ARGS, *extra, check=0)
    return load_file(str(out / "grads.safetensors")), p.stderr


@pytest.mark.parametrize("extra", [(), ("--fp8", "delayed"), ("--microbatches", 2)])
def test_gradients_identical_and_match_autograd(setup, extra):
    tmp, hf, ck, data, toks = setup
    ref, _ = grads(tmp, ck, data, "none", *extra)
    for mode in MODES[1:]:
        got, _ = grads(tmp, ck, data, mode, *extra)
        assert set(got) == set(ref)
        for name in ref:
            assert np.array_equal(got[name], ref[name]), (mode, extra, name)
    if extra:
        return
    # the same gradients from torch autograd on the same batch (sequential order: rows 0..3)
    model = torch_model(hf)
    seqs = torch.tensor(np.stack([toks[j * SEQ:j * SEQ + SEQ + 1] for j in range(4)]).astype(np.int64))
    out = model(seqs[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), seqs[:, 1:].reshape(-1))
    loss.backward()
    got, _ = grads(tmp, ck, data, "full")
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.numpy()
        worst = max(worst, float(np.abs(got[name] - g).max() / (np.abs(g).max() + 1e-12)))
    print(f"--recompute full vs autograd: max relative gradient difference {worst:.3g}")
    assert worst < 1e-4


def memory_line(stderr):
    m = re.search(r"memory: ([\d.]+) MiB per rank \(params ([\d.]+), grads ([\d.]+), optimizer ([\d.]+), "
                  r"activations ([\d.]+) MiB with --recompute (\w+)\)", stderr)
    assert m, stderr
    return [float(x) for x in m.groups()[:5]] + [m.group(6)]


def test_memory_line_shrinks(setup):
    tmp, hf, ck, data, toks = setup
    seen = {}
    for mode in MODES:
        out = tmp / f"mem-{mode}"
        p = run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", out, "--steps", 1, "--recompute", mode,
                "--batch", 8, "--seq", 64, check=0)
        seen[mode] = memory_line(p.stderr)
        assert seen[mode][5] == mode
    print({k: v[4] for k, v in seen.items()})
    assert seen["full"][4] < seen["attention"][4] < seen["none"][4]
    for k in (1, 2, 3):  # params, grads, optimizer: recomputation leaves them alone
        assert seen["full"][k] == seen["attention"][k] == seen["none"][k]
    p = run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", tmp / "bad", "--steps", 1,
            "--recompute", "some", check=2)
    assert "--recompute must be none, attention or full" in p.stderr


@pytest.mark.parametrize("layout,np_,extra", [
    ("tp=2", 2, ["--sequence-parallel"]),
    ("cp=2", 2, []),
    ("pp=2,dp=2", 4, ["--microbatches", 2]),
])
def test_parallel_layouts_identical(setup, layout, np_, extra):
    tmp, hf, ck, data, toks = setup
    logs = {}
    for mode in ("none", "full", "attention"):
        out = tmp / f"run-{layout}-{mode}"
        mpirun(np_, "--ckpt", ck, "--data", data, "--save-dir", out, "--steps", 4, "--layout", layout,
               "--recompute", mode, "--log", out / "log.jsonl", *COMMON, *extra)
        logs[mode] = [(r["loss"], r["grad_norm"]) for r in read_log(out / "log.jsonl")]
    assert len(logs["none"]) == 4
    assert logs["full"] == logs["none"], layout
    assert logs["attention"] == logs["none"], layout
