"""smp-train with pipeline parallelism under mpirun: the 1F1B schedule over
--microbatches, stages from --stages, the checkpoint or the cost model, activations and
their gradients sent between stages, the loss on the last stage, tied embeddings summed
between the first and last stage. Every layout trains the same model as one rank does.

- pp=2 (1 and 4 microbatches), pp=3 (explicit and automatic stages), pp=4, pp=2 with a tied
  embedding, pp=2,tp=2 and pp=2,tp=2,dp=2 (8 ranks): 6 steps with the same global batch
  log per-step losses (and validation losses) within 2e-4 relative of the single-rank run;
- a checkpoint saved at pp=2,tp=2 resumes at pp=1 (one rank), one saved by one rank
  resumes at pp=2,dp=2, tracking the straight run within 5e-4;
- the logged bytes_pp (and bytes_tp, bytes_dp) of rank 0 equal the formulas below.
"""
import json

import pytest

import models
import partest
from conftest import run
from partest import COMMON, SEQ
from test_parallel import assert_tracks, mpirun, rel
from test_parallel_tp import allreduce_bytes, block, ceil
from test_train import read_log

CASES = ["llama-tp-kv2", "llama-gqa-f32", "llama-tied-bf16-llama3", "llama-sharded"]
setup = partest.setup_fixture("pp", CASES)


@pytest.mark.parametrize("case,layout,np_,micro,stages", [
    ("llama-tp-kv2", "pp=2", 2, 1, None),
    ("llama-tp-kv2", "pp=2", 2, 4, None),
    ("llama-gqa-f32", "pp=3", 3, 4, None),            # auto stages: 1,1,1
    ("llama-sharded", "pp=4", 4, 4, None),            # 4 layers, one per stage
    ("llama-gqa-f32", "pp=2", 2, 2, "2,1"),
    ("llama-tied-bf16-llama3", "pp=2", 2, 2, None),   # tied: first and last stage's copies summed
    ("llama-tp-kv2", "pp=2,tp=2", 4, 2, None),
    ("llama-tp-kv2", "pp=2,tp=2,dp=2", 8, 2, None),
])
def test_pipeline_matches_one_rank(setup, case, layout, np_, micro, stages):
    tmp, cks, data, val, refs = setup
    out = tmp / f"run-{case}-{layout}-m{micro}-{stages}"
    extra = ["--stages", stages] if stages else []
    mpirun(np_, "--ckpt", cks[case], "--data", data, "--save-dir", out, "--steps", 6, "--layout", layout,
           "--microbatches", micro, "--val-data", val, "--val-every", 3, "--val-batches", 2,
           "--log", out / "log.jsonl", *extra, *COMMON)
    # validation runs batches of B/(dp*M) sequences (the same ones on every replica):
    # the single-rank run with dp*M microbatches validates the same sequences
    dp = int(dict(kv.split("=") for kv in layout.split(",")).get("dp", 1))
    rows, ref = read_log(out / "log.jsonl"), refs[case, micro * dp]
    assert_tracks(rows, ref, 2e-4, f"{case} {layout} microbatches {micro} stages {stages}")
    vals = [(r["val_loss"], q["val_loss"]) for r, q in zip(rows, ref) if "val_loss" in q]
    assert len(vals) == 2 and all("val_loss" in r for r, q in zip(rows, ref) if "val_loss" in q)
    assert max(rel(a, b) for a, b in vals) < 2e-4, vals
    assert all(r["bytes_pp"] > 0 for r in rows)
    ckdir = out / "step-000006"
    man = json.loads((ckdir / "smp.json").read_text())
    assert man["layout"]["pp"] == int(layout.split(",")[0][3:])
    if stages:
        assert man["stages"] == [int(x) for x in stages.split(",")], man["stages"]
    run("smp-verify", ckdir, check=0)


def test_resume_across_pp_layouts(setup):
    tmp, cks, data, val, refs = setup
    case = "llama-tp-kv2"
    ref = refs[case, 1]
    a = tmp / "resume-a"
    mpirun(4, "--ckpt", cks[case], "--data", data, "--save-dir", a, "--steps", 6, "--stop-at", 3,
           "--layout", "pp=2,tp=2", "--microbatches", 2, "--log", a / "log.jsonl", *COMMON)
    run("smp-verify", a / "step-000003", check=0)
    run("smp-train", "--ckpt", a, "--data", data, "--save-dir", a, "--log", a / "log.jsonl", check=0)
    assert_tracks(read_log(a / "log.jsonl"), ref, 5e-4, "pp=2,tp=2 -> one rank")
    b = tmp / "resume-b"
    run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", b, "--steps", 6, "--stop-at", 2,
        "--microbatches", 2, "--log", b / "log.jsonl", *COMMON, check=0)
    mpirun(4, "--ckpt", b, "--data", data, "--save-dir", b, "--layout", "pp=2,dp=2", "--log", b / "log.jsonl")
    assert_tracks(read_log(b / "log.jsonl"), ref, 5e-4, "one rank -> pp=2,dp=2")


def stage0_bytes(kw, T, D, M, L0, pp):
    """Rank 0's bytes per step (stage 0 of pp, tp rank 0), N = B/(D*M)*S tokens per microbatch:
    bytes_pp = M * N*H*4 (each microbatch's output sent to stage 1; the input gradients come
               back, sent by stage 1) + with a tied embedding, the all-reduce of the
               embedding piece's gradient [ceil(V/T), H] over the first and last stage;
    bytes_tp = M * (1 + 4*L0) all-reduces of [N,H] (embedding output, each of the L0 layers'
               o/down outputs and gate-up/qkv input gradients; no head or cross-entropy
               here) + with kv heads fewer than T, 2*L0 all-reduces of [hd,H] over T/kv ranks;
    bytes_dp = ZeRO-1 over the stage's pieces (embedding, L0 layers) and the loss all-reduce."""
    V, H, F = kw["vocab_size"], kw["hidden_size"], kw["intermediate_size"]
    nh, nkv = kw["num_attention_heads"], kw["num_key_value_heads"]
    hd = kw.get("head_dim") or H // nh
    N = 8 // (D * M) * SEQ
    v = block(V, T, 0)
    bpp = M * N * H * 4 + (allreduce_bytes(v * H, 2) if kw.get("tie_word_embeddings") and pp > 1 else 0)
    btp = M * (1 + 4 * L0) * allreduce_bytes(N * H, T) + (2 * L0 * allreduce_bytes(hd * H, T // nkv) if nkv < T else 0)
    q, kv, f = nh // T * hd, (nkv // T if nkv >= T else 1) * hd, block(F, T, 0)
    tensors = [(v, H)] + [(q, H), (kv, H), (kv, H), (H, q), (f, H), (f, H), (H, f), (H, 1), (H, 1)] * L0
    Z = sum(ceil(r, D) * c for r, c in tensors)
    bdp = 2 * (D - 1) * Z * 4 + 2 * (D - 1) * 8 // D if D > 1 else 0
    return btp, bpp, bdp


@pytest.mark.parametrize("case,P,T,D,M", [("llama-tp-kv2", 2, 1, 1, 4), ("llama-tied-bf16-llama3", 2, 1, 1, 2),
                                          ("llama-tp-kv2", 2, 2, 2, 2), ("llama-gqa-f32", 3, 1, 1, 2)])
def test_logged_pp_bytes_match_formulas(setup, case, P, T, D, M):
    tmp, cks, data, _, _ = setup
    out = tmp / f"bytes-{case}-{P}-{T}-{D}-{M}"
    mpirun(P * T * D, "--ckpt", cks[case], "--data", data, "--save-dir", out, "--steps", 2,
           "--layout", f"pp={P},tp={T},dp={D}", "--microbatches", M, "--log", out / "log.jsonl", *COMMON)
    stages = json.loads((out / "step-000002" / "smp.json").read_text())["stages"]
    btp, bpp, bdp = stage0_bytes(models.CASES[case][1], T, D, M, stages[0], P)
    rows = read_log(out / "log.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert (r["bytes_tp"], r["bytes_cp"], r["bytes_pp"], r["bytes_dp"]) == (btp, 0, bpp, bdp), r


def test_pp_refusals(setup):
    tmp, cks, data, _, _ = setup
    p = mpirun(2, "--ckpt", cks["llama-gqa-f32"], "--data", data, "--save-dir", tmp / "x", "--steps", 2,
               "--layout", "pp=2", "--stages", "1,1,1", *COMMON, check=False)
    assert p.returncode == 2 and "--stages" in p.stderr, p.stderr
    p = mpirun(4, "--ckpt", cks["llama-tp-kv2"], "--data", data, "--save-dir", tmp / "y", "--steps", 2,
               "--layout", "pp=4", *COMMON, check=False)
    assert p.returncode == 2 and "--layout" in p.stderr, p.stderr
    assert not (tmp / "x" / "latest").exists() and not (tmp / "y" / "latest").exists()


def test_pipeline_fp8_delayed(setup):
    """Delayed scaling over stages: each step's amaxes are reduced (max) over all ranks,
    so every stage's scales, and the losses, follow the single rank's."""
    tmp, cks, data, _, _ = setup
    case = "llama-tp-kv2"
    one, two = tmp / "f8-1", tmp / "f8-pp2tp2"
    args = ["--steps", 6, "--fp8", "delayed", "--microbatches", 2, *COMMON]
    run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", one, "--log", one / "log.jsonl", *args,
        check=0)
    mpirun(4, "--ckpt", cks[case], "--data", data, "--save-dir", two, "--layout", "pp=2,tp=2",
           "--log", two / "log.jsonl", *args)
    assert_tracks(read_log(two / "log.jsonl"), read_log(one / "log.jsonl"), 2e-4, "pp=2,tp=2 fp8 delayed")
