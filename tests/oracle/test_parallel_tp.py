"""smp-train with tensor parallelism (Megatron's layout) under mpirun: every layout
trains the same model as one rank does.

- tp=2, tp=4 with kv heads fewer than tp (each kv head replicated, its weight gradient
  summed over the ranks sharing it), tp=4 with one kv head and a sliding window, a tied
  embedding, vocabularies and MLP widths that tp does not divide (the last rank's block
  shorter), and tp=2 x dp=2 with gradient accumulation: 6 steps with the same global batch
  log per-step losses within 2e-4 relative of the single-rank run (gradient norms within
  2e-3; also with the vocabulary-parallel loss in chunks of 23 tokens), and the
  checkpoint, written by every rank (its own boxes), verifies;
- a checkpoint saved at tp=2,dp=2 resumes at tp=1 and at tp=4, one saved at tp=4 resumes
  at tp=2,dp=2, tracking the straight run within 5e-4;
- the logged bytes_tp (and bytes_dp) equal the formulas of tp_bytes (and dp_bytes) below,
  with the loss's logits whole and in chunks (--logits-chunk);
- layouts that cannot hold the model are refused.
"""
import json

import numpy as np
import pytest
import torch

import models
from conftest import run
from test_parallel import assert_tracks, layout_of, mpirun, resume_on_one_rank
from test_train import make_ckpt, read_log, write_tokens

# 8 query heads, 2 kv heads (tp=4 > kv), vocab 103 (tp=2: 52 + 51 rows, tp=4: 26 x 3 + 25),
# intermediate 70 (tp=4: 18 x 3 + 16 rows)
models.CASES.setdefault("llama-tp-kv2", ("llama", dict(vocab_size=103, hidden_size=32, intermediate_size=70,
                                                       num_hidden_layers=2, num_attention_heads=8,
                                                       num_key_value_heads=2), torch.float32, {}))
CASES = ["llama-tp-kv2", "llama-gqa-f32", "llama-tied-bf16-llama3", "mistral-gqa-f16-window"]
SEQ = 16
COMMON = ["--batch", 8, "--seq", SEQ, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    V = min(models.CASES[c][1]["vocab_size"] for c in CASES)
    data = write_tokens(tmp / "d.bin", np.random.default_rng(7).integers(0, V, size=6000))
    cks, refs = {}, {}
    for case in CASES:
        _, cks[case] = make_ckpt(tmp, case, sharp=False)
        ref = tmp / f"ref-{case}"
        run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", ref, "--steps", 6,
            "--log", ref / "log.jsonl", *COMMON, check=0)
        refs[case] = read_log(ref / "log.jsonl")
    return tmp, cks, data, refs


@pytest.mark.parametrize("case,layout,np_,micro,chunk", [
    ("llama-tp-kv2", "tp=2", 2, 1, None),
    ("llama-tp-kv2", "tp=4", 4, 1, None),             # kv heads 2 < tp 4
    ("llama-tp-kv2", "tp=2,dp=2", 4, 2, None),        # with ZeRO-1 over dp and 2 microbatches
    ("llama-gqa-f32", "tp=2", 2, 1, None),            # 6 heads, 2 kv heads, vocab 101
    ("llama-tied-bf16-llama3", "tp=2", 2, 1, None),   # tied embedding, llama3 RoPE
    ("llama-tied-bf16-llama3", "tp=2", 2, 1, 23),     # the vocabulary-parallel loss 23 tokens at a time
    ("mistral-gqa-f16-window", "tp=4", 4, 1, None),   # one kv head on 4 ranks, sliding window
])
def test_tensor_parallel_matches_one_rank(setup, case, layout, np_, micro, chunk):
    tmp, cks, data, refs = setup
    out = tmp / f"run-{case}-{layout}-m{micro}-c{chunk}"
    mpirun(np_, "--ckpt", cks[case], "--data", data, "--save-dir", out, "--steps", 6, "--layout", layout,
           "--microbatches", micro, "--log", out / "log.jsonl", *COMMON,
           *(["--logits-chunk", chunk] if chunk else []))
    rows = read_log(out / "log.jsonl")
    assert_tracks(rows, refs[case], 2e-4, f"{case} {layout} microbatches {micro}")
    assert all(r["bytes_tp"] > 0 and r["bytes_cp"] == 0 and r["bytes_pp"] == 0 for r in rows)
    ckdir = out / "step-000006"
    man = json.loads((ckdir / "smp.json").read_text())
    assert man["layout"] == layout_of(layout)
    # every rank holds a distinct part to store: its own shard file
    assert sorted(p.name for p in ckdir.glob("shard-*.h5")) == [f"shard-{r:05d}.h5" for r in range(np_)]
    run("smp-verify", ckdir, check=0)


def test_resume_across_tp_layouts(setup):
    tmp, cks, data, refs = setup
    case, ref = "llama-tp-kv2", refs["llama-tp-kv2"]
    # saved at tp=2,dp=2, resumed at tp=1 (one rank) and at tp=4
    a = tmp / "resume-a"
    resume_on_one_rank(4, "tp=2,dp=2", cks[case], data, a, tmp / "resume-b", ref, "tp=2,dp=2 -> tp=1")
    c = tmp / "resume-c"
    mpirun(4, "--ckpt", a / "step-000003", "--data", data, "--save-dir", c, "--layout", "tp=4",
           "--log", c / "log.jsonl")
    assert_tracks(read_log(a / "log.jsonl")[:3] + read_log(c / "log.jsonl"), ref, 5e-4, "tp=2,dp=2 -> tp=4")
    # saved at tp=4 (kv heads replicated, stored once), resumed at tp=2,dp=2
    d = tmp / "resume-d"
    mpirun(4, "--ckpt", cks[case], "--data", data, "--save-dir", d, "--steps", 6, "--stop-at", 2,
           "--layout", "tp=4", "--log", d / "log.jsonl", *COMMON)
    run("smp-verify", d / "step-000002", check=0)
    mpirun(4, "--ckpt", d, "--data", data, "--save-dir", d, "--layout", "tp=2,dp=2", "--log", d / "log.jsonl")
    assert_tracks(read_log(d / "log.jsonl"), ref, 5e-4, "tp=4 -> tp=2,dp=2")


def ceil(a, b):
    return -(-a // b)


def allreduce_bytes(n, g, size=4):
    """What the communicator counts for one all-reduce of n elements over g ranks."""
    return 2 * (g - 1) * n * size // g if g > 1 else 0


def tp_bytes(kw, T, N, M, chunk=None):
    """bytes_tp per step and rank, with N = B/(dp*M)*S tokens per microbatch, M microbatches:
    per microbatch, all-reduces over tp of
      forward:  the embedding output [N,H], each layer's o_proj and down_proj outputs [N,H],
                the cross-entropy's row max [n] and (sum of exp, target logit) [2n] for each
                chunk of n tokens (--logits-chunk: the last chunk shorter);
      backward: the head's input gradient [N,H], each layer's input gradients of gate/up and
                of q/k/v [N,H];
    and per step, with kv heads fewer than T, each layer's k_proj and v_proj weight gradients
    [hd,H] summed over the T/kv ranks that share the kv head."""
    H, L, nh, nkv = kw["hidden_size"], kw["num_hidden_layers"], kw["num_attention_heads"], kw["num_key_value_heads"]
    hd = kw.get("head_dim") or H // nh
    chunks = [min(chunk or N, N - r0) for r0 in range(0, N, chunk or N)]
    per_mb = 2 * (1 + 2 * L) * allreduce_bytes(N * H, T) + sum(allreduce_bytes(n, T) + allreduce_bytes(2 * n, T)
                                                               for n in chunks)
    kv = 2 * L * allreduce_bytes(hd * H, T // nkv) if nkv < T else 0
    return M * per_mb + kv


def block(n, parts, r):
    b = ceil(n, parts)
    lo = min(r * b, n)
    return min(lo + b, n) - lo


def dp_bytes(kw, T, D):
    """bytes_dp of tp rank 0: the ZeRO-1 reduce-scatter and all-gather of its local pieces'
    blocks (every tensor's dim 0 cut in ceil(rows / D) rows, Z elements packed) and the loss
    all-reduce over dp: 2 (D-1) Z 4 + 2 (D-1) 8 / D."""
    V, H, F, L = kw["vocab_size"], kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"]
    nh, nkv = kw["num_attention_heads"], kw["num_key_value_heads"]
    hd = kw.get("head_dim") or H // nh
    q, kv, f, v = nh // T * hd, (nkv // T if nkv >= T else 1) * hd, block(F, T, 0), block(V, T, 0)
    per_layer = [(q, H), (kv, H), (kv, H), (H, q), (f, H), (f, H), (H, f), (H, 1), (H, 1)]
    tensors = [(v, H)] + per_layer * L + [(H, 1)] + ([] if kw.get("tie_word_embeddings") else [(v, H)])
    Z = sum(ceil(r, D) * c for r, c in tensors)
    return 2 * (D - 1) * Z * 4 + 2 * (D - 1) * 8 // D if D > 1 else 0


@pytest.mark.parametrize("case,T,D,M,chunk", [("llama-tp-kv2", 2, 1, 1, None), ("llama-tp-kv2", 4, 1, 2, None),
                                              ("llama-tp-kv2", 2, 2, 2, None), ("mistral-gqa-f16-window", 4, 1, 1, None),
                                              ("llama-tp-kv2", 4, 1, 2, 13)])
def test_logged_tp_bytes_match_formulas(setup, case, T, D, M, chunk):
    tmp, cks, data, _ = setup
    out = tmp / f"bytes-{case}-{T}-{D}-{M}-{chunk}"
    mpirun(T * D, "--ckpt", cks[case], "--data", data, "--save-dir", out, "--steps", 2, "--layout", f"tp={T},dp={D}",
           "--microbatches", M, "--log", out / "log.jsonl", *COMMON, *(["--logits-chunk", chunk] if chunk else []))
    kw = models.CASES[case][1]
    N = 8 // (D * M) * SEQ
    want = (tp_bytes(kw, T, N, M, chunk), 0, 0, dp_bytes(kw, T, D))
    rows = read_log(out / "log.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert (r["bytes_tp"], r["bytes_cp"], r["bytes_pp"], r["bytes_dp"]) == want, (r, want)


def test_tensor_parallel_fp8_delayed(setup):
    """Delayed scaling under tp: the amaxes (of weight pieces, and of activations and
    gradients) are reduced (max) over all ranks, so the scales, and the losses, follow
    the single rank's."""
    tmp, cks, data, _ = setup
    case = "llama-tp-kv2"
    one, two = tmp / "f8-1", tmp / "f8-tp2"
    run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", one, "--steps", 6, "--fp8", "delayed",
        "--log", one / "log.jsonl", *COMMON, check=0)
    mpirun(2, "--ckpt", cks[case], "--data", data, "--save-dir", two, "--steps", 6, "--fp8", "delayed",
           "--layout", "tp=2", "--log", two / "log.jsonl", *COMMON)
    assert_tracks(read_log(two / "log.jsonl"), read_log(one / "log.jsonl"), 2e-4, "tp=2 fp8 delayed")


def test_tp_refusals(setup):
    tmp, cks, data, _ = setup
    # 6 heads: tp=4 does not divide them
    p = mpirun(4, "--ckpt", cks["llama-gqa-f32"], "--data", data, "--save-dir", tmp / "x", "--steps", 2,
               "--layout", "tp=4", *COMMON, check=False)
    assert p.returncode == 2 and "--layout" in p.stderr and "head" in p.stderr, p.stderr
    p = mpirun(2, "--ckpt", cks["llama-tp-kv2"], "--data", data, "--save-dir", tmp / "y", "--steps", 2,
               "--layout", "tp=2", "--fp8", "current", *COMMON, check=False)
    assert p.returncode == 2 and "--fp8 current" in p.stderr
    p = mpirun(2, "--ckpt", cks["llama-tp-kv2"], "--data", data, "--save-dir", tmp / "z", "--steps", 2,
               "--layout", "cp=2", *COMMON, "--seq", 14, check=False)   # 14 not divisible by 2 x cp
    assert p.returncode == 2 and "context" in p.stderr
    assert not any((tmp / d).exists() and (tmp / d / "latest").exists() for d in "xyz")
