"""Expert parallelism (layout key ep=E) for a mixture of experts, against the single
rank and against transformers:

- smp-eval at ep layouts (with dp, cp, tp) gives the single rank's loss and
  load-balancing loss, which equal transformers';
- training at ep=2 and ep=4, composed with tp, pp, cp and the load-balancing loss's
  gradient, tracks the single-rank run (loss, gradient norm and aux_loss within 2e-4);
  with --fp8 delayed (every expert's linears quantized) at dp=2/4, tp, pp and cp under
  ep, its one-rank FP8 run (losses within 2e-4); the JSONL counts the all-to-all's
  bytes (bytes_ep), exactly the formula over transformers' routing;
- the checkpoint stores each expert once, written by the first of its replicas
  (ep rank i's experts in rank i's shard file); smp-inspect shows experts per rank;
  hf2smp at an ep layout -> reshard -> smp-merge gives every tensor bit for bit;
- a run stopped at ep=4 resumes after a reshard at ep=2, and on one rank, exactly
  where the straight run goes;
- layouts that cannot split the experts are refused (exit 2).
"""
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from conftest import run
from test_parallel import assert_fp8_tracks, assert_tracks, layout_of, mpirun, rel
from test_train import datasets, read_log, write_tokens

V, SEQ = 89, 16
COMMON = ["--batch", 8, "--seq", SEQ, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5]


def make_moe(path, family, aux=False):
    """A tiny random Mixtral (4 experts, 2 per token) or Qwen3-MoE (8 experts, 2 per
    token, renormalized), its routers sharpened so that routing is decisive (a near tie
    would flip on the last bit of a sum taken in another order)."""
    torch.manual_seed(1)
    extra = dict(output_router_logits=True, router_aux_loss_coef=0.3) if aux else {}
    if family == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, **extra)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                          **extra)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.float().save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    data = write_tokens(tmp / "d.bin", np.random.default_rng(7).integers(0, V, size=6000))

    class Cks(dict):  # (family, aux) -> (hf folder, checkpoint), made on first use
        def __missing__(self, key):
            family, aux = key
            hf = tmp / f"hf-{family}-{aux}"
            make_moe(hf, family, aux)
            ck = tmp / f"ck-{family}-{aux}"
            run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=1", check=0)
            self[key] = (hf, ck)
            return self[key]
    cks = Cks()

    class Refs(dict):  # (family, aux, microbatches) -> the single rank's log
        def __missing__(self, key):
            family, aux, micro = key
            out = tmp / f"ref-{family}-{aux}-m{micro}"
            run("smp-train", "--ckpt", cks[(family, aux)][1], "--data", data, "--save-dir", out, "--steps", 6,
                "--microbatches", micro, "--log", out / "log.jsonl", *COMMON, check=0)
            self[key] = read_log(out / "log.jsonl")
            return self[key]
    return tmp, cks, data, Refs()


def ranks(layout):
    """the world size of a layout: ep splits dp x cp, it is not a dimension of its own"""
    lay = layout_of(layout)
    return lay["pp"] * lay["tp"] * lay["cp"] * lay["dp"]


@pytest.mark.parametrize("family,layout", [("mixtral", "dp=2,ep=2"), ("mixtral", "dp=2,cp=2,ep=4"),
                                           ("qwen3moe", "tp=2,dp=2,ep=2"), ("qwen3moe", "dp=4,ep=4")])
def test_eval_matches_one_rank_and_transformers(ep, family, layout):
    tmp, cks, data, _ = ep
    hf, ck = cks[(family, False)]
    args = ["--ckpt", ck, "--data", data, "--batch", 4, "--seq", SEQ, "--batches", 2, "--json"]
    one = json.loads(run("smp-eval", *args, check=0).stdout)
    got = json.loads(mpirun(ranks(layout), *args, "--layout", layout, exe="smp-eval").stdout)
    assert rel(got["loss"], one["loss"]) < 1e-7 and rel(got["aux_loss"], one["aux_loss"]) < 1e-7, (got, one)
    # transformers over the same two batches (the load-balancing loss over both at once, as smp-eval)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    toks = np.fromfile(data, dtype="<u2", offset=1024).astype(np.int64)
    rows = torch.tensor(np.stack([toks[j * SEQ:j * SEQ + SEQ + 1] for j in range(8)]))
    with torch.no_grad():
        out = model(rows[:, :-1], output_router_logits=True)
    ref = F.cross_entropy(out.logits.reshape(-1, V), rows[:, 1:].reshape(-1)).item()
    assert rel(one["loss"], ref) < 1e-5 and rel(one["aux_loss"], float(out.aux_loss)) < 1e-5, (one, ref, out.aux_loss)


@pytest.mark.parametrize("family,layout,alone", [("qwen3moe", "dp=4,ep=4", None), ("qwen3moe", "dp=4,ep=2", None),
                                                  ("mixtral", "tp=2,dp=2,ep=2", "tp=2")])
def test_eval_ep_ranks_share_what_they_hold_alike(ep, family, layout, alone):
    """smp-eval's ranks of one host keep one copy of each piece that several of them
    hold: under ep, the ranks of one tp position hold the same attention, norms,
    routers, embedding and head but other experts. Between them they read every piece
    once (the bytes of one rank, or of the layout without dp, `alone`), where a copy per
    rank (--share-weights no) reads the common pieces once per rank; the loss is bit
    for bit the same, reading alone or together, and rank 0 says how many ranks share."""
    tmp, cks, _, _ = ep
    hf, _ = cks[(family, False)]
    ck = tmp / f"ck-{family}-none"
    if not ck.exists():
        run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=1", "--compress", "none", check=0)
    data = write_tokens(tmp / "d-share.bin", np.random.default_rng(8).integers(0, V, size=600))
    args = ["--ckpt", ck, "--data", data, "--batch", 4, "--seq", SEQ, "--batches", 1, "--json"]
    n = ranks(layout)
    shared = mpirun(n, *args, "--layout", layout, exe="smp-eval")
    own = mpirun(n, *args, "--layout", layout, "--share-weights", "no", exe="smp-eval")
    base = run("smp-eval", *args, check=0) if alone is None else mpirun(2, *args, "--layout", alone, exe="smp-eval")
    read = [int(re.search(r"smp-eval: loaded .*: (\d+) bytes in", p.stderr).group(1)) for p in (shared, own, base)]
    assert read[0] == read[2] < read[1], (layout, read)  # a copy each: the common pieces once per rank
    together = mpirun(n, *args, "--layout", layout, "--read-together", "yes", exe="smp-eval")
    assert json.loads(shared.stdout)["loss"] == json.loads(own.stdout)["loss"] == json.loads(together.stdout)["loss"]
    line = f"smp-eval: {n} ranks keep one copy of their weights per host and piece: "
    assert any(ln.startswith(line) for ln in shared.stderr.splitlines()), shared.stderr
    assert any(ln.startswith(line) for ln in together.stderr.splitlines()), together.stderr
    assert "note:" not in shared.stderr and "per host" not in own.stderr, (shared.stderr, own.stderr)


@pytest.mark.parametrize("family,aux,layout,micro", [
    ("mixtral", False, "dp=2,ep=2", 1),
    ("mixtral", False, "tp=2,dp=2,ep=2", 1),
    ("mixtral", True, "pp=2,dp=2,ep=2", 2),          # the aux gradient's pre-pass through the pipeline
    ("qwen3moe", False, "dp=4,ep=4", 1),             # 2 of the 8 experts per rank
    ("qwen3moe", True, "cp=2,dp=2,ep=4", 1),
    ("qwen3moe", False, "dp=4,ep=2", 1),             # each ep rank's experts on 2 replicas: their ZeRO-1 group
])
def test_training_tracks_one_rank(ep, family, aux, layout, micro):
    tmp, cks, data, refs = ep
    out = tmp / f"run-{family}-{aux}-{layout}"
    dp = layout_of(layout)["dp"]
    mpirun(ranks(layout), "--ckpt", cks[(family, aux)][1], "--data", data, "--save-dir", out, "--steps", 6,
           "--layout", layout, "--microbatches", micro, "--log", out / "log.jsonl", *COMMON)
    rows, ref = read_log(out / "log.jsonl"), refs[(family, aux, micro * dp)]
    assert_tracks(rows, ref, 2e-4, f"{family} {layout}")
    assert max(rel(r["aux_loss"], q["aux_loss"]) for r, q in zip(rows, ref)) < 2e-4
    assert all(r["bytes_ep"] > 0 for r in rows)  # the tokens' all-to-all, counted
    assert run("smp-verify", out / "step-000006").returncode == 0


@pytest.mark.parametrize("family,layout", [("mixtral", "dp=2,ep=2"), ("qwen3moe", "dp=4,ep=2"),
                                           ("qwen3moe", "dp=4,ep=4")])
def test_bytes_ep_is_the_formula_over_transformers_routing(ep, family, layout):
    """Step 1's bytes_ep (the checkpoint's own weights, which transformers routes alike)
    is docs/TRAINING.md's formula over transformers' top-k choices: rank 0 sends its
    rows for the other ep ranks' experts and the results of the rows they routed to its
    own, forward and backward (rows of H fp32), and each layer's counts (E/ep int32 to
    each other ep rank); replica r holds the step's r-th B/dp sequences (no --seed:
    the file's order)"""
    tmp, cks, data, _ = ep
    hf, ck = cks[(family, False)]
    lay = layout_of(layout)
    D, EP, B = lay["dp"], lay["ep"], 8
    out = tmp / f"bytes-{family}-{layout}"
    unseeded = [a for i, a in enumerate(COMMON) if "--seed" not in (a, COMMON[i - 1])]
    mpirun(D, "--ckpt", ck, "--data", data, "--save-dir", out, "--steps", 1, "--layout", layout, "--log",
           out / "log.jsonl", *unseeded)
    got = read_log(out / "log.jsonl")[0]["bytes_ep"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    cfg = model.config
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    k, H, El, per = cfg.num_experts_per_tok, cfg.hidden_size, E // EP, B // D * SEQ
    toks = np.fromfile(data, dtype="<u2", offset=1024).astype(np.int64)
    rows = torch.tensor(np.stack([toks[j * SEQ:j * SEQ + SEQ + 1] for j in range(B)]))
    with torch.no_grad():
        logits = model(rows[:, :-1], output_router_logits=True).router_logits
    want = 0
    for lg in logits:  # a layer's [B * SEQ, E], the tokens batch-major
        owner = (torch.topk(lg.softmax(-1), k).indices // El).numpy()  # the ep rank of each choice's expert
        for r in range(1, EP):
            sent = (owner[:per] == r).sum()                       # rank 0's rows for rank r's experts
            came = (owner[r * per:(r + 1) * per] == 0).sum()      # rank r's rows for rank 0's experts
            want += 2 * int(sent + came) * H * 4                  # rows out, results back; forward and backward
        want += (EP - 1) * El * 4                                  # the counts
    assert got == want, (got, want)


@pytest.mark.parametrize("layout,extra", [
    ("dp=2,ep=2", ["--recompute", "full"]),                             # the exchange again in backward
    ("tp=2,dp=2,ep=2", ["--recompute", "attention", "--sequence-parallel"]),
])
def test_recompute_with_expert_parallelism_tracks_one_rank(ep, layout, extra):
    tmp, cks, data, refs = ep
    out = tmp / f"rc-{layout}-{extra[1]}"
    mpirun(ranks(layout), "--ckpt", cks[("mixtral", False)][1], "--data", data, "--save-dir", out, "--steps", 6,
           "--layout", layout, "--log", out / "log.jsonl", *extra, *COMMON)
    assert_tracks(read_log(out / "log.jsonl"), refs[("mixtral", False, 2)], 2e-4, f"{layout} {extra}")


FP8_ONE = {}  # microbatches -> the one-rank FP8 run's folder


def fp8_one_rank(ep, micro):
    tmp, cks, data, _ = ep
    if micro not in FP8_ONE:
        one = tmp / f"fp8-one-m{micro}"
        run("smp-train", "--ckpt", cks[("mixtral", False)][1], "--data", data, "--save-dir", one, "--steps", 6,
            "--microbatches", micro, "--fp8", "delayed", "--log", one / "log.jsonl", *COMMON, check=0)
        FP8_ONE[micro] = one
    return FP8_ONE[micro]


@pytest.mark.parametrize("layout,micro", [("dp=2,ep=2", 1), ("tp=2,dp=2,ep=2", 1), ("pp=2,dp=2,ep=2", 2),
                                          ("cp=2,dp=2,ep=4", 1), ("dp=4,ep=4", 1)])
def test_fp8_with_expert_parallelism_tracks_its_one_rank_run(ep, layout, micro):
    """--fp8 delayed (the attention linears and every expert's, each expert on the rows
    every ep rank sends it) under ep, with tp, pp and cp, against the single rank's fp8
    run over the same microbatches (assert_fp8_tracks: losses within 2e-4 over the 6
    steps); the saved scaling state is the one rank's (an expert's amaxes come from the
    rank that holds it, the step's max over the ranks)"""
    tmp, cks, data, _ = ep
    one, two = fp8_one_rank(ep, micro * layout_of(layout)["dp"]), tmp / f"fp8-{layout}"
    mpirun(ranks(layout), "--ckpt", cks[("mixtral", False)][1], "--data", data, "--save-dir", two, "--steps", 6,
           "--layout", layout, "--microbatches", micro, "--fp8", "delayed", "--log", two / "log.jsonl", *COMMON)
    assert_fp8_tracks(read_log(two / "log.jsonl"), read_log(one / "log.jsonl"), f"fp8 delayed {layout}",
                      ("loss", "grad_norm", "aux_loss"))
    a, b = (datasets(one / "step-000006"), datasets(two / "step-000006"))
    hist = [k for k in a if k.startswith("fp8/") and a[k].ndim == 2][0]
    L, E = 2, 4  # the fixture's Mixtral
    assert a[hist].shape[0] == 3 * L * (7 + 3 * E) and b[hist].shape == a[hist].shape
    assert (a[hist][3 * L * 7:, 0] > 0).all()  # each expert's three linears ran and were scaled
    # the history, newest first: the first two steps' amaxes as tight as their losses
    np.testing.assert_allclose(b[hist][:, 4:6], a[hist][:, 4:6], rtol=1e-5)
    np.testing.assert_allclose(b[hist], a[hist], rtol=0.1)


def test_the_aux_gradient_moves_the_router(ep):
    """output_router_logits: the load-balancing loss is trained (the runs differ)"""
    _, _, _, refs = ep
    plain, aux = refs[("mixtral", False, 1)], refs[("mixtral", True, 1)]
    assert plain[0]["loss"] == aux[0]["loss"] and plain[0]["grad_norm"] != aux[0]["grad_norm"]


def test_checkpoint_stores_each_expert_once(ep):
    tmp, cks, _, _ = ep
    hf, _ = cks[("qwen3moe", False)]
    ck = tmp / "ck-ep4"
    mpirun(2, "hf2smp", "--in", hf, "--out", ck, "--layout", "dp=4,ep=4", exe="smp-convert")
    man = json.loads((ck / "smp.json").read_text())
    assert man["layout"]["ep"] == 4
    for t in man["tensors"]:
        files = [p["file"] for p in t["pieces"]]
        if ".experts." in t["name"]:
            e = int(t["name"].split(".experts.")[1].split(".")[0])
            assert files == [f"shard-{e // 2:05d}.h5"], (t["name"], files)  # 8 experts, 2 per ep rank
        else:
            assert files == ["shard-00000.h5"], (t["name"], files)
    info = json.loads(run("smp-inspect", ck, "--json", check=0).stdout)
    assert info["experts_per_rank"] == 2 and info["layout"]["ep"] == 4
    # reshard to another ep and back to one rank, merge: every tensor bit for bit
    run("smp-convert", "reshard", "--in", ck, "--out", tmp / "ck-ep2", "--layout", "tp=2,dp=2,ep=2", check=0)
    run("smp-merge", "--in", tmp / "ck-ep2", "--out", tmp / "export", check=0)
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp / "export" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_across_expert_layouts(ep):
    """ep=4 stops at step 3; resharded to ep=2 it resumes, and so it does on one rank:
    both exactly where the straight single-rank run goes"""
    tmp, cks, data, refs = ep
    ck = cks[("qwen3moe", False)][1]
    a, b, c = tmp / "res-a", tmp / "res-b", tmp / "res-c"
    mpirun(4, "--ckpt", ck, "--data", data, "--save-dir", a, "--steps", 6, "--stop-at", 3, "--layout", "dp=4,ep=4",
           "--log", a / "log.jsonl", *COMMON)
    b.mkdir()
    run("smp-convert", "reshard", "--in", a / "step-000003", "--out", b / "step-000003", "--layout", "dp=2,ep=2",
        check=0)
    (b / "latest").write_text("step-000003\n")
    mpirun(2, "--ckpt", b, "--data", data, "--save-dir", b, "--layout", "dp=2,ep=2", "--log", b / "log.jsonl")
    run("smp-train", "--ckpt", a, "--data", data, "--save-dir", c, "--log", c / "log.jsonl", check=0)
    ref = refs[("qwen3moe", False, 4)][3:]
    assert_tracks(read_log(b / "log.jsonl"), ref, 5e-4, "ep=4 -> reshard -> ep=2")
    assert_tracks(read_log(c / "log.jsonl"), ref, 5e-4, "ep=4 -> one rank")


@pytest.mark.parametrize("family,layout,words", [
    ("mixtral", "dp=2,ep=4", ["ep=4", "dp x cp"]),
    ("qwen3moe", "dp=3,ep=3", ["ep=3", "8 experts"]),
])
def test_layouts_that_cannot_split_the_experts_are_refused(ep, family, layout, words):
    tmp, cks, data, _ = ep
    p = run("smp-convert", "reshard", "--in", cks[(family, False)][1], "--out", tmp / "bad", "--layout", layout)
    assert p.returncode == 2 and all(w in p.stderr for w in words), p.stderr
    assert not (tmp / "bad").exists()


def test_ep_on_a_dense_model_is_refused(tmp_path):
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                                           num_hidden_layers=1, num_attention_heads=4)).save_pretrained(
        str(hf))
    p = run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "dp=2,ep=2")
    assert p.returncode == 2 and "no experts" in p.stderr, p.stderr
