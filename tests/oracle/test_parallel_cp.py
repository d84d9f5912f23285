"""smp-train with context parallelism under mpirun: each sequence of S tokens cut into 2C
chunks of S/(2C), cp rank i holding chunks i and 2C-1-i (explicit positions for RoPE and
the causal / sliding-window mask), ring attention passing K/V around the cp group and
merging partial results by log-sum-exp, dK/dV travelling with their block and returning
home. Every layout trains the same model as one rank does.

- cp=2 (1 and 2 microbatches), cp=4, cp=2,dp=2, tp=2,cp=2,dp=2 and pp=2,tp=2,cp=2 (8 ranks),
  pp=2,cp=2, tp=4,cp=2 (kv heads fewer than tp), and a Mistral model whose sliding window
  (5) is shorter than the sequence and not a multiple of the chunk length: 6 steps with the same global batch log per-step losses (and validation
  losses) within 2e-4 relative of the single-rank run; so do cp=2 and tp=2,cp=2 with FP8
  delayed scaling;
- a checkpoint saved at cp=2 resumes at cp=1 (one rank), one saved by one rank resumes at
  tp=2,cp=2, tracking the straight run within 5e-4;
- the logged bytes_cp of rank 0 equals cp_bytes below (and bytes_dp the ZeRO-1 formula
  with D = dp*cp);
- a sequence length that 2C does not divide is refused.
"""
import json

import pytest
import torch

import models
import partest
from conftest import run
from partest import COMMON, SEQ
from test_parallel import assert_tracks, layout_of, mpirun, rel, resume_on_one_rank
from test_parallel_tp import dp_bytes
from test_train import read_log

# sliding window 5 < SEQ 16, not a multiple of any chunk length (8, 4, 2)
models.CASES.setdefault("mistral-cp-window5", ("mistral", dict(vocab_size=67, hidden_size=40, intermediate_size=72,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               num_key_value_heads=2, sliding_window=5, head_dim=12),
                                               torch.float32, {}))
models.CASES.setdefault("llama-tp-kv2", ("llama", dict(vocab_size=103, hidden_size=32, intermediate_size=70,
                                                       num_hidden_layers=2, num_attention_heads=8,
                                                       num_key_value_heads=2), torch.float32, {}))
CASES = ["llama-tp-kv2", "llama-gqa-f32", "mistral-cp-window5"]
setup = partest.setup_fixture("cp", CASES, sharp=lambda case: case.startswith("mistral"))


def train_at(setup, prefix, case, layout, micro, steps, *extra):
    """smp-train under mpirun at layout (on its ranks) from case's checkpoint: `steps` steps
    of micro microbatches into tmp/PREFIX-CASE-LAYOUT-mMICRO, extra options before the
    log's; (that folder, the layout as a dict)."""
    tmp, cks, data, _, _ = setup
    lay = layout_of(layout)
    out = tmp / f"{prefix}-{case}-{layout}-m{micro}"
    mpirun(lay["pp"] * lay["tp"] * lay["cp"] * lay["dp"], "--ckpt", cks[case], "--data", data, "--save-dir", out,
           "--steps", steps, "--layout", layout, "--microbatches", micro, *extra, "--log", out / "log.jsonl", *COMMON)
    return out, lay


@pytest.mark.parametrize("case,layout,micro", [
    ("llama-tp-kv2", "cp=2", 1),
    ("llama-tp-kv2", "cp=2", 2),
    ("llama-tp-kv2", "cp=4", 1),
    ("llama-gqa-f32", "cp=2,dp=2", 1),
    ("llama-tp-kv2", "tp=2,cp=2,dp=2", 2),      # 8 ranks
    ("llama-tp-kv2", "pp=2,cp=2", 2),
    ("llama-tp-kv2", "tp=4,cp=2", 1),           # kv heads 2 < tp 4: a replicated kv head on the ring
    ("llama-tp-kv2", "pp=2,tp=2,cp=2", 2),      # 8 ranks
    ("mistral-cp-window5", "cp=2", 1),          # sliding window shorter than the sequence
    ("mistral-cp-window5", "cp=4", 1),          # chunks of 2 tokens, window 5 spans three
])
def test_context_parallel_matches_one_rank(setup, case, layout, micro):
    _, _, _, val, refs = setup
    out, lay = train_at(setup, "run", case, layout, micro, 6, "--val-data", val, "--val-every", 3, "--val-batches", 2)
    # validation runs batches of B/(dp*M) sequences (the same ones on every replica):
    # the single-rank run with dp*M microbatches validates the same sequences
    rows, ref = read_log(out / "log.jsonl"), refs[(case, micro * lay["dp"])]
    assert_tracks(rows, ref, 2e-4, f"{case} {layout} microbatches {micro}")
    vals = [(r["val_loss"], q["val_loss"]) for r, q in zip(rows, ref) if "val_loss" in q]
    assert len(vals) == 2 and all("val_loss" in r for r, q in zip(rows, ref) if "val_loss" in q)
    worst_val = max(rel(a, b) for a, b in vals)
    print(f"{case} {layout}: max relative difference val loss {worst_val:.3g}")
    assert worst_val < 2e-4
    assert all(r["bytes_cp"] > 0 for r in rows)
    ckdir = out / "step-000006"
    man = json.loads((ckdir / "smp.json").read_text())
    assert man["layout"] == lay
    run("smp-verify", ckdir, check=0)


@pytest.mark.parametrize("layout", ["cp=2", "tp=2,cp=2"])
def test_context_parallel_fp8_delayed(setup, layout):
    """FP8 delayed scaling: every amax reduced over the world, so the scales (and the
    losses) equal the single-rank run's."""
    tmp, cks, data, val, refs = setup
    case, lay = "llama-tp-kv2", layout_of(layout)
    fp8 = ["--fp8", "delayed", *COMMON]
    ref = tmp / "ref-fp8"
    if not (ref / "log.jsonl").exists():
        run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", ref, "--steps", 6,
            "--log", ref / "log.jsonl", *fp8, check=0)
    out = tmp / f"fp8-{layout}"
    mpirun(lay["tp"] * lay["cp"], "--ckpt", cks[case], "--data", data, "--save-dir", out, "--steps", 6,
           "--layout", layout, "--log", out / "log.jsonl", *fp8)
    assert_tracks(read_log(out / "log.jsonl"), read_log(ref / "log.jsonl"), 2e-4, f"fp8 delayed {layout}")


def test_resume_cp2_at_cp1(setup):
    tmp, cks, data, val, refs = setup
    case = "llama-tp-kv2"
    resume_on_one_rank(2, "cp=2", cks[case], data, tmp / "resume-a", tmp / "resume-b", refs[(case, 1)], "cp=2 -> cp=1")


def test_resume_one_rank_at_tp2_cp2(setup):
    tmp, cks, data, val, refs = setup
    case = "llama-tp-kv2"
    a = tmp / "resume-c"
    run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", a, "--steps", 6, "--stop-at", 2,
        "--log", a / "log.jsonl", *COMMON, check=0)
    mpirun(4, "--ckpt", a, "--data", data, "--save-dir", a, "--layout", "tp=2,cp=2", "--log", a / "log.jsonl")
    assert_tracks(read_log(a / "log.jsonl"), refs[(case, 1)], 5e-4, "one rank -> tp=2,cp=2")
    man = json.loads((a / "step-000006" / "smp.json").read_text())
    assert man["layout"] == dict(pp=1, tp=2, cp=2, dp=1)
    run("smp-verify", a / "step-000006", check=0)


def cp_bytes(kw, T, C, D, M, layers, B=8, S=SEQ):
    """bytes_cp per step of a rank holding `layers` layers, with N = B/(D*M) * S/C tokens per
    microbatch and KD = (kv heads / T, at least 1) * head_dim: per microbatch and layer,
      forward:  C-1 ring passes of the K and V block, 2 N KD floats each;
      backward: C-1 ring passes of K, V and the dK, dV accumulated so far (4 N KD floats),
                then one pass of dK, dV home (2 N KD floats);
    that is (6 (C-1) + 2) N KD 4 bytes. (The step's loss sum is all-reduced over dp*cp and
    counts in bytes_dp; with validation, each validation batch adds its forward passes and
    an all-reduce of its loss sum over cp.)"""
    H, nh, nkv = kw["hidden_size"], kw["num_attention_heads"], kw["num_key_value_heads"]
    hd = kw.get("head_dim") or H // nh
    KD = max(nkv // T, 1) * hd
    N = B // (D * M) * S // C
    return M * layers * (6 * (C - 1) + 2) * N * KD * 4


@pytest.mark.parametrize("case,layout,micro", [("llama-tp-kv2", "cp=2", 1), ("llama-tp-kv2", "cp=4", 2),
                                               ("llama-tp-kv2", "tp=2,cp=2,dp=2", 2),
                                               ("llama-tp-kv2", "pp=2,cp=2", 2),
                                               ("llama-tp-kv2", "tp=4,cp=2", 1),
                                               ("mistral-cp-window5", "cp=2", 1)])
def test_logged_cp_bytes_match_formula(setup, case, layout, micro):
    out, lay = train_at(setup, "bytes", case, layout, micro, 2)
    kw = models.CASES[case][1]
    stages = json.loads((out / "step-000002" / "smp.json").read_text()).get("stages")
    layers = stages[0] if lay["pp"] > 1 else kw["num_hidden_layers"]
    want = cp_bytes(kw, lay["tp"], lay["cp"], lay["dp"], micro, layers)
    # ZeRO-1 over dp*cp, with the loss all-reduce (tp rank 0's pieces; one stage)
    want_dp = dp_bytes(kw, lay["tp"], lay["dp"] * lay["cp"]) if lay["pp"] == 1 else None
    for r in read_log(out / "log.jsonl"):
        assert r["bytes_cp"] == want, (r["bytes_cp"], want)
        assert want_dp is None or r["bytes_dp"] == want_dp, (r["bytes_dp"], want_dp)


def test_cp_refusals(setup):
    tmp, cks, data, val, refs = setup
    # S = 12 is not divisible by 2 x cp = 8
    p = mpirun(4, "--ckpt", cks["llama-tp-kv2"], "--data", data, "--save-dir", tmp / "x", "--steps", 2,
               "--layout", "cp=4", *COMMON[:2], "--seq", 12, check=False)
    assert p.returncode == 2 and "--seq" in p.stderr and "cp" in p.stderr, p.stderr
    assert not (tmp / "x" / "latest").exists()
