"""The model families beyond Llama and Mistral, against transformers (fp32, CPU):
Qwen2ForCausalLM (biases on q, k, v; tied and untied), Qwen3ForCausalLM (per-head
q/k RMSNorm before RoPE, an explicit head_dim; YaRN's rope scaling) and GPTNeoXForCausalLM (a fused per-head
qkv, biases on every linear, LayerNorm, exact GELU, partial rotary; parallel and
sequential residuals; tied and untied), as models.py saves them (random biases and norm
gains, so that their use shows).

- smp-eval's loss equals transformers' within 1e-5, and a checkpoint in another layout
  gives the same (test_train's test, for these cases);
- every gradient matches autograd within 1e-4;
- 10 AdamW steps track torch.optim.AdamW (untied Qwen2, Qwen3);
- every parallel layout (tp=2 and tp=4 with replicated kv heads, sequence parallelism,
  pp=2, cp=2, dp=2, a mix) tracks the single-rank run within 2e-4; a run stopped in
  one layout resumes on one rank; --recompute full is exact, FP8 delayed at tp=2
  tracks its single-rank run;
- `smp-convert init` initializes the biases to zero and the norms' gains to one;
- config errors of these families are refused by name (exit 3); GPT-NeoX configs in
  transformers 4's spelling (rotary_pct, rotary_emb_base) and old Pythia checkpoints'
  buffers (attention.bias, masked_bias, rotary_emb.inv_freq) are accepted.
(The round trip hf2smp -> layouts -> reshard -> merge -> transformers is
test_roundtrip's, over every case of models.py, these included.)
"""
import json

import ml_dtypes
import numpy as np
import pytest

import models
import test_train
from conftest import run
from test_parallel import assert_tracks, layout_of, mpirun, resume_on_one_rank
from test_train import datasets, make_ckpt, read_log, write_tokens

CASES = ["qwen2-gqa-tied", "qwen2-untied", "qwen3-gqa-hd", "qwen3-yarn", "neox-parallel", "neox-sequential",
         "neox-full-rotary-tied"]


@pytest.mark.parametrize("case", CASES)
def test_eval_matches_transformers(tmp_path, case):
    test_train.test_eval_loss_matches_transformers(tmp_path, case)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_autograd(tmp_path, case):
    test_train.test_gradients_match_autograd(tmp_path, case, 2, None)


# qwen2-gqa-tied tracks torch 1.13 within the bound but torch 2.15 only within 1.7e-4
# (the tied embedding's rows that few tokens touch: Adam's m/sqrt(v) of tiny gradients)
# GPT-NeoX's final weights within 1e-3, its losses and norms within test_train's 1e-4: in
# layer 1's query_key_value, elements whose gradients are ~1e-5 of the tensor's largest
# (Adam's m/sqrt(v) at eps's scale) move torch's own fp32 run from its fp64 run by
# 1.5e-4 (neox-parallel) and 2.9e-4 (neox-sequential) relative after the 10 steps.
# Two lanes (a microbatch's 2 sequences, one each) and the others' 2e-4: test_train's.
@pytest.mark.parametrize("case", ["qwen2-untied", "qwen3-gqa-hd", "neox-parallel", "neox-sequential"])
def test_adamw_steps_track_torch(tmp_path, case):
    test_train.test_adamw_steps_track_torch(tmp_path, case, 2, weights_tol=1e-3 if case.startswith("neox") else 2e-4)


SEQ = 16
COMMON = ["--batch", 8, "--seq", SEQ, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5]


@pytest.fixture(scope="module")
def fsetup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")

    class Data(dict):  # random tokens below min(89, the case's vocabulary), a file per bound
        def __missing__(self, case):
            bound = min(89, test_train.vocab_of(case))
            self[case] = write_tokens(tmp / f"d{bound}.bin", np.random.default_rng(7).integers(0, bound, size=6000))
            return self[case]
    data = Data()

    class Cks(dict):  # made on first use
        def __missing__(self, case):
            self[case] = make_ckpt(tmp, case, sharp=True)[1]
            return self[case]
    cks = Cks()

    class Refs(dict):
        def __missing__(self, key):
            case, micro = key
            out = tmp / f"ref-{case}-m{micro}"
            run("smp-train", "--ckpt", cks[case], "--data", data[case], "--save-dir", out, "--steps", 6, "--microbatches",
                micro, "--log", out / "log.jsonl", *COMMON, check=0)
            self[key] = read_log(out / "log.jsonl")
            return self[key]
    return tmp, cks, data, Refs()


@pytest.mark.parametrize("case,layout,micro,extra", [
    ("qwen2-gqa-tied", "tp=2", 1, ["--sequence-parallel"]),
    ("qwen2-gqa-tied", "tp=2,pp=2", 2, []),          # tied embeddings across stages
    ("qwen2-untied", "tp=4", 1, []),                 # 4 kv heads over 4 ranks
    ("qwen2-gqa-tied", "cp=2,dp=2", 1, []),
    ("qwen3-gqa-hd", "tp=2", 1, []),
    ("qwen3-gqa-hd", "tp=4", 1, ["--sequence-parallel"]),  # 2 kv heads < tp: replicated, their norms' sums
    ("qwen3-gqa-hd", "pp=2,cp=2", 2, []),
    ("qwen3-gqa-hd", "dp=2", 1, []),
    ("qwen3-yarn", "cp=2,tp=2", 1, []),             # YaRN's tables at a context-parallel rank's positions
    ("neox-parallel", "tp=2", 1, ["--sequence-parallel"]),
    ("neox-parallel", "tp=2,pp=2", 2, []),
    ("neox-parallel", "tp=4", 1, []),                # one head per rank
    ("neox-parallel", "cp=2,dp=2", 1, []),
    ("neox-sequential", "tp=2", 1, ["--sequence-parallel"]),
    ("neox-sequential", "tp=3", 1, []),              # 6 heads; the MLP's 80 rows as 27, 27, 26
    ("neox-sequential", "pp=2,cp=2", 2, []),
    ("neox-sequential", "dp=2", 1, []),
    ("neox-full-rotary-tied", "tp=2,pp=2", 2, []),   # embed_in tied to the head across stages
])
def test_layouts_match_one_rank(fsetup, case, layout, micro, extra):
    tmp, cks, data, refs = fsetup
    lay = layout_of(layout)
    out = tmp / f"run-{case}-{layout}"
    mpirun(lay["pp"] * lay["tp"] * lay["cp"] * lay["dp"], "--ckpt", cks[case], "--data", data[case], "--save-dir", out,
           "--steps", 6, "--layout", layout, "--microbatches", micro, "--log", out / "log.jsonl", *extra, *COMMON)
    assert_tracks(read_log(out / "log.jsonl"), refs[(case, micro * lay["dp"])], 2e-4, f"{case} {layout}")
    assert run("smp-verify", out / "step-000006").returncode == 0


@pytest.mark.parametrize("case", ["qwen2-gqa-tied", "qwen3-gqa-hd", "neox-parallel", "neox-sequential"])
def test_recompute_exact_and_fp8_across_layouts(fsetup, case):
    tmp, cks, data, refs = fsetup
    base = ["--ckpt", cks[case], "--data", data[case], "--steps", 6, *COMMON]
    rc = tmp / f"rc-{case}"
    run("smp-train", *base, "--save-dir", rc, "--recompute", "full", "--log", rc / "log.jsonl", check=0)
    assert [(r["loss"], r["grad_norm"]) for r in read_log(rc / "log.jsonl")] == \
        [(r["loss"], r["grad_norm"]) for r in refs[(case, 1)]]
    # tp=2 (the per-head norms' gradients summed over tp) computes the same bits; layouts
    # that sum in another order (the cp ring's attention, dp's gradients) differ in the
    # last bits, and once one flips an E4M3 rounding the loss moves by ~1e-5 and the norm
    # by ~3e-3 within a few steps, in every family (Llama's cp=2 likewise)
    one, two = tmp / f"fp8-{case}-1", tmp / f"fp8-{case}-tp2"
    run("smp-train", *base, "--save-dir", one, "--fp8", "delayed", "--log", one / "log.jsonl", check=0)
    mpirun(2, *base, "--save-dir", two, "--fp8", "delayed", "--layout", "tp=2", "--log", two / "log.jsonl")
    assert_tracks(read_log(two / "log.jsonl"), read_log(one / "log.jsonl"), 2e-4, f"{case} fp8 delayed tp=2")


@pytest.mark.parametrize("case,layout", [("qwen2-gqa-tied", "tp=2,pp=2"), ("qwen3-gqa-hd", "tp=2,cp=2"),
                                         ("neox-parallel", "tp=2,pp=2")])
def test_resume_across_layouts(fsetup, case, layout):
    """4 ranks stop at step 3; one rank resumes and tracks the straight run"""
    tmp, cks, data, refs = fsetup
    resume_on_one_rank(4, layout, cks[case], data[case], tmp / f"resume-{case}-a", tmp / f"resume-{case}-b",
                       refs[(case, 1)], f"{case} {layout} -> one rank")


@pytest.mark.parametrize("case", ["qwen2-gqa-tied", "qwen3-gqa-hd", "neox-parallel", "neox-full-rotary-tied"])
def test_init_biases_zero_norms_one(tmp_path, case):
    """As transformers initializes them: every bias zero (Qwen2's q, k, v; GPT-NeoX's
    linears and LayerNorms), every norm's gain one, the other weights normal(0, 0.02)."""
    hf = tmp_path / "hf"
    models.make(case, hf)
    run("smp-convert", "init", "--config", hf / "config.json", "--out", tmp_path / "ck", "--layout", "tp=2",
        check=0)
    got = datasets(tmp_path / "ck")
    names = [n for n in got if n.startswith("params/")]
    for name in names:
        t = got[name]
        t = t.view(ml_dtypes.bfloat16).astype(np.float32) if t.dtype == np.uint16 else t  # bf16 as stored
        if name.endswith(".bias"):
            assert not np.any(t), name
        elif "norm" in name:  # q_norm, k_norm, *_layernorm, model.norm, final_layer_norm
            assert np.all(t == 1), name
        else:
            assert t.ndim == 2 and abs(float(t.std()) / 0.02 - 1) < 0.25, (name, float(t.std()))
    # the params hold each case's model, in the files' names (a checkpoint in tp=2: one
    # dataset, or more, per tensor: the names up to the piece's "@")
    tensors = {n.split("/", 1)[1].split("@")[0] for n in names}
    assert tensors == models.saved_names(hf), tensors ^ models.saved_names(hf)
    biases = {n for n in tensors if n.endswith(".bias")}
    if case.startswith("qwen2"):
        assert biases and all("_proj.bias" in n for n in biases)
    elif case.startswith("neox"):
        L = models.CASES[case][1]["num_hidden_layers"]
        assert len(biases) == 6 * L + 1 and "gpt_neox.final_layer_norm.bias" in biases
    else:
        assert not biases
    assert any("q_norm" in n for n in tensors) == case.startswith("qwen3")


_DROP = object()


def _config(tmp_path, case, **edit):
    hf = tmp_path / "hf"
    models.make(case, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if v is not _DROP}
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


def _rope(factor, theta=10000.0):
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}


@pytest.mark.parametrize("case,edit,words", [
    ("qwen2-untied", {"use_sliding_window": True}, ["use_sliding_window"]),
    ("qwen3-gqa-hd", {"use_sliding_window": True, "sliding_window": 8}, ["use_sliding_window"]),
    ("qwen3-gqa-hd", {"layer_types": ["full_attention", "sliding_attention"]}, ["layer_types", "sliding_attention"]),
    ("qwen3-gqa-hd", {"attention_bias": True}, ["attention_bias"]),
    ("qwen2-untied", {"use_sliding_window": "yes"}, ["use_sliding_window", "true or false"]),
    ("qwen2-untied", {"model_type": "llama"}, ["model_type", "qwen2"]),
    ("qwen3-gqa-hd", {"hidden_act": "gelu"}, ["hidden_act"]),
    ("qwen3-gqa-hd", {"layer_types": [1, 2]}, ["layer_types", "strings"]),
    ("qwen2-untied", {"rope_parameters": [1e6]}, ["rope_parameters"]),
    ("qwen2-untied", {"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, ["rope_theta"]),
    ("qwen2-untied", {"rope_parameters": {"rope_theta": 1e6, "rope_type": "dynamic", "factor": 4.0}}, ["dynamic"]),
    ("qwen3-gqa-hd", {"architectures": ["DeepseekV3ForCausalLM"]}, ["DeepseekV3ForCausalLM", "not supported"]),
    ("neox-parallel", {"hidden_act": "gelu_new"}, ["hidden_act", "gelu_new"]),  # the tanh approximation
    ("neox-parallel", {"hidden_act": "relu"}, ["hidden_act", "relu"]),
    ("neox-parallel", {"use_parallel_residual": "yes"}, ["use_parallel_residual", "true or false"]),
    ("neox-sequential", {"attention_bias": False}, ["attention_bias"]),
    ("neox-parallel", {"hidden_dropout": 0.1}, ["hidden_dropout"]),
    ("neox-sequential", {"rope_parameters": _rope(0.375)}, ["partial_rotary_factor", "odd"]),  # head_dim 8: 3
    ("neox-parallel", {"rope_parameters": _rope(1.5)}, ["partial_rotary_factor"]),
    ("neox-parallel", {"rope_parameters": _rope(0.0)}, ["partial_rotary_factor"]),
    ("neox-parallel", {"model_type": "llama"}, ["model_type", "gpt_neox"]),
])
def test_config_errors_are_refused_by_name(tmp_path, case, edit, words):
    hf = _config(tmp_path, case, **edit)
    p = run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "pp=1")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1 and all(w in lines[0] for w in words), p.stderr
    assert not (tmp_path / "ck").exists()


def test_a_qwen2_window_left_off_is_accepted(tmp_path):
    """Qwen2's configs carry sliding_window with use_sliding_window false: no window."""
    hf = _config(tmp_path, "qwen2-untied", use_sliding_window=False, sliding_window=4, max_window_layers=1)
    assert json.loads(run("smp-inspect", hf, "--json", check=0).stdout)["config"]["sliding_window"] is None
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "pp=1", check=0)


@pytest.mark.parametrize("case,edit,words", [
    ("qwen2-untied", ("drop", "model.layers.1.self_attn.k_proj.bias"), ["k_proj.bias", "missing"]),
    ("qwen3-gqa-hd", ("shape", "model.layers.0.self_attn.q_norm.weight"), ["q_norm.weight", "shape"]),
    ("qwen2-untied", ("add", "model.layers.0.self_attn.o_proj.bias"), ["o_proj.bias", "not part of"]),
    ("neox-parallel", ("drop", "gpt_neox.layers.1.attention.query_key_value.bias"), ["query_key_value.bias", "missing"]),
    ("neox-parallel", ("drop", "embed_out.weight"), ["embed_out.weight", "missing"]),
    ("neox-sequential", ("shape", "gpt_neox.final_layer_norm.bias"), ["final_layer_norm.bias", "shape"]),
    ("neox-parallel", ("add", "gpt_neox.layers.0.attention.q_norm.weight"), ["q_norm.weight", "not part of"]),
    ("neox-parallel", ("add", "lm_head.weight"), ["lm_head.weight", "not part of"]),  # the module's name, not the file's
    ("neox-parallel", ("add", "gpt_neox.layers.2.attention.masked_bias"), ["layers.2.attention.masked_bias", "not part of"]),
])
def test_weights_that_do_not_fit_the_family_are_refused(tmp_path, case, edit, words):
    import torch
    from safetensors.torch import load_file, save_file
    hf = tmp_path / "hf"
    models.make(case, hf)
    w = load_file(str(hf / "model.safetensors"))
    what, name = edit
    if what == "drop":
        del w[name]
    elif what == "shape":
        w[name] = torch.ones(w[name].numel() + 2, dtype=w[name].dtype)
    else:
        w[name] = torch.zeros(w[[n for n in w if n.endswith(("embed_tokens.weight", "embed_in.weight"))][0]].shape[1])
    save_file(w, str(hf / "model.safetensors"), metadata={"format": "pt"})
    p = run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "pp=1")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1 and all(x in lines[0] for x in words), p.stderr
    assert not (tmp_path / "ck").exists()


def _eval_matches_transformers(tmp_path, hf, V):
    """smp-eval's loss on hf's model (converted) equals transformers' on the folder."""
    import torch
    import torch.nn.functional as F
    B, S = 3, 32
    toks = np.random.default_rng(5).integers(0, V, size=B * S + 1)
    data = write_tokens(tmp_path / "d.bin", toks)
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "pp=1", check=0)
    got = json.loads(run("smp-eval", "--ckpt", tmp_path / "ck", "--data", data, "--batch", B, "--seq", S, "--json",
                         check=0).stdout)
    model = test_train.torch_model(hf)
    rows = test_train.seqs_of(toks, S, range(B))
    with torch.no_grad():
        ref = F.cross_entropy(model(torch.tensor(rows[:, :-1])).logits.reshape(-1, V),
                              torch.tensor(rows[:, 1:]).reshape(-1)).item()
    assert got["tokens"] == B * S and abs(got["loss"] - ref) <= 1e-5 * ref, (got, ref)
    return model


@pytest.mark.parametrize("edit,rope", [
    # transformers 4's spelling (Pythia's configs): rotary_pct and rotary_emb_base at the top
    (dict(rope_parameters=_DROP, rotary_pct=0.5, rotary_emb_base=2000), _rope(0.5, 2000.0)),
    (dict(rope_parameters=_DROP, rotary_pct=0.25), _rope(0.25)),  # transformers' default base
    (dict(rope_parameters=_DROP, rotary_emb_base=500), _rope(0.25, 500.0)),  # and default fraction
    # rope_parameters without the fraction: transformers' default 0.25, not 1
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), _rope(0.25)),
    # int(head_dim * factor): 8 * 0.3 = 2.4 rotates 2 dims of each head
    (dict(rope_parameters=_rope(0.3)), _rope(0.3)),
])
def test_neox_rotary_spellings_are_read_as_transformers_reads_them(tmp_path, edit, rope):
    hf = _config(tmp_path, "neox-sequential", **edit)
    model = _eval_matches_transformers(tmp_path, hf, test_train.vocab_of("neox-sequential"))
    assert model.config.rope_parameters == rope  # what transformers made of the config


def test_neox_old_checkpoint_buffers_are_ignored(tmp_path):
    """Old Pythia checkpoints hold each layer's causal mask (attention.bias, bool),
    masked_bias (a scalar) and the rotary inv_freq: derived buffers, accepted and
    dropped (transformers ignores them too); the rest converts as it is."""
    import torch
    from safetensors.torch import load_file, save_file
    hf = tmp_path / "hf"
    models.make("neox-parallel", hf)
    w = load_file(str(hf / "model.safetensors"))
    kept = dict(w)
    for i in range(models.CASES["neox-parallel"][1]["num_hidden_layers"]):
        p = f"gpt_neox.layers.{i}.attention."
        w[p + "bias"] = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
        w[p + "masked_bias"] = torch.tensor(-1e9)
        w[p + "rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    save_file(w, str(hf / "model.safetensors"), metadata={"format": "pt"})
    _eval_matches_transformers(tmp_path, hf, test_train.vocab_of("neox-parallel"))
    run("smp-merge", "--in", tmp_path / "ck", "--out", tmp_path / "out", check=0)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(kept) and all(torch.equal(got[k], kept[k]) for k in kept)
