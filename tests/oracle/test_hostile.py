"""A hostile corpus: malformed model folders, each breaking one rule.

Every case must give exit code 3 and ONE line on stderr, `smp-inspect: error: ...`,
naming the offending file, under the AddressSanitizer + UBSan build. Cases about the
safetensors layer are also fed to the reference library, which must refuse them too
(our rules are the reference's, not stricter by accident)."""
import json
import shutil
import struct

import pytest
import safetensors

import models
from conftest import run


def st_bytes(header, data=b"", n=None, pad=True):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad and len(h) % 8:
        h += b" " * (8 - len(h) % 8)
    return struct.pack("<Q", len(h) if n is None else n) + h + data


def one(name, dtype="F32", shape=(2,), offsets=None, data=None):
    nbytes = 4 * (shape[0] if shape else 1)
    hdr = {name: {"dtype": dtype, "shape": list(shape), "data_offsets": offsets or [0, nbytes]}}
    return st_bytes(hdr, data if data is not None else b"\0" * nbytes)


# Safetensors-level cases: (id, bytes of model.safetensors)
ST_CASES = {
    "empty-file": b"",
    "shorter-than-length": b"\x10\0\0",
    "header-too-large": struct.pack("<Q", 100_000_001) + b"{}" + b" " * 6,
    "header-past-eof": struct.pack("<Q", 1 << 40) + b"{}",
    "header-not-object": st_bytes(b"[1,2,3]"),
    "header-not-json": st_bytes(b"{not json"),
    "trailing-garbage-after-json": st_bytes(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}x', b"\0" * 4),
    "invalid-utf8": st_bytes(b'{"\xff\xfe":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "duplicate-key": st_bytes(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8),
    "unknown-dtype": one("a", dtype="F128"),
    "dtype-not-string": st_bytes({"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "negative-shape": st_bytes({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "float-shape": st_bytes({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4),
    "shape-overflows": st_bytes({"a": {"dtype": "F32", "shape": [2**32, 2**32, 2**10], "data_offsets": [0, 4]}}, b"\0" * 4),
    "bytes-overflow": st_bytes({"a": {"dtype": "F64", "shape": [2**62], "data_offsets": [0, 8]}}, b"\0" * 8),
    "offsets-wrong-size": one("a", offsets=[0, 12], data=b"\0" * 12),
    "offsets-not-from-zero": st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "offsets-gap": st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12),
    "offsets-overlap": st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    "offsets-reversed": st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
    "offsets-three-numbers": st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 4),
    "trailing-bytes": one("a", data=b"\0" * 12),
    "truncated-data": one("a", data=b"\0" * 5),
    "metadata-not-strings": st_bytes({"__metadata__": {"a": 1}, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "metadata-not-object": st_bytes({"__metadata__": "x", "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "deeply-nested-json": st_bytes(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"),
}


def made_model(case, name):
    """The module's fixture `name`: the folder of models' case, made once."""
    @pytest.fixture(scope="module", name=name)
    def made(tmp_path_factory):
        d = tmp_path_factory.mktemp(name)
        models.make(case, d)
        return d
    return made


good = made_model("llama-gqa-f32", "good")
sharded = made_model("llama-sharded", "sharded")
good_neox = made_model("neox-parallel", "good_neox")  # hidden 32, 4 heads (head_dim 8), rotary 0.5
good_mixtral = made_model("mixtral-k2", "good_mixtral")  # 4 experts, top-2
good_qwen3moe = made_model("qwen3moe-k2-norm", "good_qwen3moe")  # 8 experts, top-2, moe_intermediate_size 24


def copy_model(good, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


def expect_refused(folder, must_name):
    p = run("smp-inspect", folder, san=True)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3, f"exit {p.returncode}: {p.stderr}"
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("smp-inspect: error: "), lines[0]
    assert must_name in lines[0], lines[0]
    assert "Sanitizer" not in p.stderr and "runtime error" not in p.stderr
    return lines[0]


@pytest.mark.parametrize("case", list(ST_CASES))
def test_malformed_safetensors(good, tmp_path, case):
    d = copy_model(good, tmp_path)
    (d / "model.safetensors").write_bytes(ST_CASES[case])
    expect_refused(d, "model.safetensors")


@pytest.mark.parametrize("case", [c for c in ST_CASES if c not in ("duplicate-key",)])
def test_reference_library_refuses_them_too(case):
    # duplicate keys: the reference keeps the last one silently; the spec forbids them
    with pytest.raises(Exception):
        safetensors.deserialize(ST_CASES[case])


def test_valid_file_that_is_not_the_model(good, tmp_path):
    # a legal safetensors file (200,000 dimensions of size 1) that holds none of the model
    d = copy_model(good, tmp_path)
    data = st_bytes({"a": {"dtype": "F32", "shape": [1] * 200000, "data_offsets": [0, 4]}}, b"\0" * 4)
    safetensors.deserialize(data)  # the reference accepts the file itself
    (d / "model.safetensors").write_bytes(data)
    expect_refused(d, "model.embed_tokens.weight")


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


_DELETE = object()
CONFIG_CASES = {
    "hidden-size-string": dict(hidden_size="48"),
    "layers-negative": dict(num_hidden_layers=-2),
    "layers-zero": dict(num_hidden_layers=0),
    "heads-float": dict(num_attention_heads=6.5),
    "kv-heads-not-dividing": dict(num_key_value_heads=4),
    "vocab-too-large": dict(vocab_size=2**40),
    "vocab-missing": dict(vocab_size=_DELETE),
    "eps-negative": dict(rms_norm_eps=-1e-5),
    "eps-string": dict(rms_norm_eps="1e-5"),
    "rope-theta-zero": dict(rope_theta=0),
    "unknown-rope-scaling": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "yarn-missing-factor": dict(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 64}),
    "yarn-factor-string": dict(rope_scaling={"rope_type": "yarn", "factor": "4"}),
    "yarn-truncate-string": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": "no"}),
    "yarn-beta-negative": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}),
    "linear-factor-zero": dict(rope_scaling={"rope_type": "linear", "factor": 0}),
    "rope-scaling-not-object": dict(rope_scaling=[1, 2]),
    "llama3-missing-field": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
    # the same in transformers 5's spelling: rope_parameters, dtype
    "rope-parameters-theta-zero": dict(rope_parameters={"rope_type": "default", "rope_theta": 0}),
    "unknown-rope-parameters": dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
    "rope-parameters-not-object": dict(rope_parameters=[1, 2]),
    "llama3-parameters-missing-field": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
    "unknown-dtype": dict(dtype="int4"),
    "attention-bias": dict(attention_bias=True),
    "mlp-bias": dict(mlp_bias=True),
    "gelu": dict(hidden_act="gelu"),
    "unknown-architecture": dict(architectures=["GPT2LMHeadModel"]),
    "two-architectures": dict(architectures=["LlamaForCausalLM", "MistralForCausalLM"]),
    "model-type-mismatch": dict(model_type="mistral"),
    "tie-not-bool": dict(tie_word_embeddings="yes"),
    "quantized": dict(quantization_config={"quant_method": "gptq"}),
    "unknown-torch-dtype": dict(torch_dtype="int4"),
    "shape-mismatch-intermediate": dict(intermediate_size=96),
    "sliding-window-on-llama": dict(sliding_window=128),
    "odd-head-dim": dict(head_dim=7),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(good, tmp_path, case):
    d = copy_model(good, tmp_path)
    edit_config(d, **CONFIG_CASES[case])
    # shape mismatches are found against the weights and name the folder
    expect_refused(d, "config.json" if case != "shape-mismatch-intermediate" else str(d))


def _neox_rope(factor, theta=10000.0):
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}


# GPT-NeoX's own keys, malformed or unsupported; and transformers 4's spelling of its
# rotary (rotary_pct, rotary_emb_base, without rope_parameters) malformed
NEOX_CONFIG_CASES = {
    "parallel-residual-string": dict(use_parallel_residual="yes"),
    "parallel-residual-number": dict(use_parallel_residual=1),
    "layer-norm-eps-negative": dict(layer_norm_eps=-1e-5),
    "layer-norm-eps-string": dict(layer_norm_eps="1e-5"),
    "rotary-factor-string": dict(rope_parameters=_neox_rope("0.5")),
    "rotary-factor-negative": dict(rope_parameters=_neox_rope(-0.5)),
    "rotary-factor-zero": dict(rope_parameters=_neox_rope(0)),
    "rotary-factor-above-one": dict(rope_parameters=_neox_rope(1.5)),
    "rotary-dim-odd": dict(rope_parameters=_neox_rope(0.375)),  # int(8 * 0.375) = 3
    "rotary-dim-zero": dict(rope_parameters=_neox_rope(0.1)),  # int(8 * 0.1) = 0: no rotary at all
    "rotary-theta-zero": dict(rope_parameters=_neox_rope(0.5, 0)),
    "rotary-dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.5}),
    "rotary-pct-string": dict(rope_parameters=_DELETE, rotary_pct="0.25"),
    "rotary-pct-above-one": dict(rope_parameters=_DELETE, rotary_pct=2),
    "rotary-pct-odd": dict(rope_parameters=_DELETE, rotary_pct=0.375),
    "rotary-emb-base-zero": dict(rope_parameters=_DELETE, rotary_emb_base=0),
    "rotary-emb-base-string": dict(rope_parameters=_DELETE, rotary_emb_base="10000"),
    "gelu-new": dict(hidden_act="gelu_new"),
    "silu": dict(hidden_act="silu"),
    "hidden-act-not-string": dict(hidden_act=["gelu"]),
    "attention-bias-false": dict(attention_bias=False),
    "attention-bias-string": dict(attention_bias="true"),
    "hidden-dropout": dict(hidden_dropout=0.1),
    "hidden-dropout-string": dict(hidden_dropout="0"),
    "attention-dropout": dict(attention_dropout=0.1),
    "model-type-llama": dict(model_type="llama"),
    "heads-not-dividing-hidden": dict(num_attention_heads=5),
    "sliding-window": dict(sliding_window=16),
    "quantized": dict(quantization_config={"quant_method": "gptq"}),
    "shape-mismatch-intermediate": dict(intermediate_size=96),
}


@pytest.mark.parametrize("case", list(NEOX_CONFIG_CASES))
def test_bad_neox_config(good_neox, tmp_path, case):
    d = copy_model(good_neox, tmp_path)
    edit_config(d, **NEOX_CONFIG_CASES[case])
    expect_refused(d, "config.json" if case != "shape-mismatch-intermediate" else str(d))


def test_neox_missing_and_extra_tensors(good_neox, tmp_path):
    import numpy as np
    d = copy_model(good_neox, tmp_path)
    edit_weights(d, lambda t: t.pop("gpt_neox.layers.1.mlp.dense_4h_to_h.bias"))
    expect_refused(d, "gpt_neox.layers.1.mlp.dense_4h_to_h.bias")
    d = copy_model(good_neox, tmp_path / "b")
    edit_weights(d, lambda t: t.update({"gpt_neox.layers.01.attention.masked_bias": np.zeros((), np.float32)}))
    expect_refused(d, "gpt_neox.layers.01.attention.masked_bias")  # not a layer's name: not a buffer smp drops


# The mixtures of experts' keys, malformed or unsupported (model: the case it edits)
MOE_CONFIG_CASES = {
    "experts-missing": ("mixtral", dict(num_local_experts=_DELETE)),
    "experts-zero": ("mixtral", dict(num_local_experts=0)),
    "experts-negative": ("mixtral", dict(num_local_experts=-4)),
    "experts-huge": ("mixtral", dict(num_local_experts=2**40)),
    "experts-string": ("mixtral", dict(num_local_experts="4")),
    "experts-float": ("mixtral", dict(num_local_experts=4.5)),
    "top-k-above-experts": ("mixtral", dict(num_experts_per_tok=5)),
    "top-k-zero": ("mixtral", dict(num_experts_per_tok=0)),
    "top-k-string": ("mixtral", dict(num_experts_per_tok="2")),
    "jitter-noise": ("mixtral", dict(router_jitter_noise=0.01)),
    "jitter-noise-string": ("mixtral", dict(router_jitter_noise="0")),
    "aux-coef-negative": ("mixtral", dict(router_aux_loss_coef=-0.1)),
    "aux-coef-string": ("mixtral", dict(router_aux_loss_coef="0.01")),
    "router-logits-string": ("mixtral", dict(output_router_logits="true")),
    "mixtral-as-qwen3moe": ("mixtral", dict(model_type="qwen3_moe")),
    "qwen3moe-experts-missing": ("qwen3moe", dict(num_local_experts=_DELETE)),
    "qwen3moe-num-experts-zero": ("qwen3moe", dict(num_local_experts=_DELETE, num_experts=0)),
    "moe-intermediate-missing": ("qwen3moe", dict(moe_intermediate_size=_DELETE)),
    "moe-intermediate-zero": ("qwen3moe", dict(moe_intermediate_size=0)),
    "norm-topk-string": ("qwen3moe", dict(norm_topk_prob="yes")),
    "sparse-step-2": ("qwen3moe", dict(decoder_sparse_step=2)),
    "sparse-step-zero": ("qwen3moe", dict(decoder_sparse_step=0)),
    "mlp-only-layers": ("qwen3moe", dict(mlp_only_layers=[0])),
    "mlp-only-layers-string": ("qwen3moe", dict(mlp_only_layers="x")),
    "mlp-only-layers-nested": ("qwen3moe", dict(mlp_only_layers=[[[[1]]]])),
    "qwen3moe-sliding-window": ("qwen3moe", dict(use_sliding_window=True, sliding_window=8)),
    "qwen3moe-shape-mismatch-moe-intermediate": ("qwen3moe", dict(moe_intermediate_size=32)),
    "qwen3moe-more-experts-than-weights": ("qwen3moe", dict(num_local_experts=9)),
}


@pytest.mark.parametrize("case", list(MOE_CONFIG_CASES))
def test_bad_moe_config(good_mixtral, good_qwen3moe, tmp_path, case):
    which, edit = MOE_CONFIG_CASES[case]
    d = copy_model(good_mixtral if which == "mixtral" else good_qwen3moe, tmp_path)
    edit_config(d, **edit)
    # shapes that do not fit the weights are found against them and name the folder
    against_weights = "shape-mismatch" in case or "than-weights" in case
    expect_refused(d, str(d) if against_weights else "config.json")


def test_moe_missing_and_extra_experts(good_mixtral, good_qwen3moe, tmp_path):
    import numpy as np
    d = copy_model(good_mixtral, tmp_path)
    edit_weights(d, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    expect_refused(d, "model.layers.1.block_sparse_moe.experts.2.w3.weight")
    d = copy_model(good_mixtral, tmp_path / "b")
    edit_weights(d, lambda t: t.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": np.zeros((40, 32), np.float32)}))
    expect_refused(d, "experts.4.w1.weight")
    d = copy_model(good_qwen3moe, tmp_path / "c")
    edit_weights(d, lambda t: t.update({"model.layers.0.mlp.experts.01.gate_proj.weight": np.zeros((24, 32), np.float32)}))
    expect_refused(d, "experts.01.gate_proj.weight")  # not an expert's name
    d = copy_model(good_qwen3moe, tmp_path / "d")
    edit_weights(d, lambda t: t.pop("model.layers.1.mlp.gate.weight"))
    expect_refused(d, "model.layers.1.mlp.gate.weight")


def test_config_not_json(good, tmp_path):
    d = copy_model(good, tmp_path)
    (d / "config.json").write_text('{"hidden_size": 48,')
    expect_refused(d, "config.json")


def test_config_deeply_nested(good, tmp_path):
    d = copy_model(good, tmp_path)
    (d / "config.json").write_text('{"x": ' + "[" * 50000 + "]" * 50000 + "}")
    expect_refused(d, "config.json")


def test_config_huge(good, tmp_path):
    d = copy_model(good, tmp_path)
    with open(d / "config.json", "w") as f:
        f.write('{"x": "' + "a" * (17 << 20) + '"}')
    expect_refused(d, "config.json")


def test_missing_weights(good, tmp_path):
    d = copy_model(good, tmp_path)
    (d / "model.safetensors").unlink()
    expect_refused(d, "model.safetensors")


def edit_weights(d, fn):
    """fn(tensors) edits the tensors of d's model.safetensors (name: numpy array), saved back."""
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(good, tmp_path):
    d = copy_model(good, tmp_path)
    edit_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_refused(d, "model.layers.1.mlp.up_proj.weight")


def test_extra_tensor_refused_by_name(good, tmp_path):
    import numpy as np
    d = copy_model(good, tmp_path)
    edit_weights(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(48, np.float32)}))
    expect_refused(d, "q_proj.bias")


def test_integer_weights_refused(good, tmp_path):
    import numpy as np
    d = copy_model(good, tmp_path)
    edit_weights(d, lambda t: t.update({"model.norm.weight": np.zeros(48, np.int32)}))
    expect_refused(d, "model.norm.weight")


def edit_index(d, fn):
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx)
    p.write_text(json.dumps(idx))


INDEX_CASES = {
    "path-traversal": lambda i: i["weight_map"].update({"model.norm.weight": "../model.safetensors"}),
    "absolute-path": lambda i: i["weight_map"].update({"model.norm.weight": "/etc/passwd"}),
    "subfolder": lambda i: i["weight_map"].update({"model.norm.weight": "sub/x.safetensors"}),
    "points-to-missing-file": lambda i: i["weight_map"].update({"model.norm.weight": "nope.safetensors"}),
    "points-to-missing-tensor": lambda i: i["weight_map"].update({"model.ghost.weight": next(iter(i["weight_map"].values()))}),
    "tensor-unlisted": lambda i: i["weight_map"].pop("model.norm.weight"),
    "weight-map-not-object": lambda i: i.update({"weight_map": ["a"]}),
    "weight-map-missing": lambda i: i.pop("weight_map"),
    "file-not-string": lambda i: i["weight_map"].update({"model.norm.weight": 3}),
    "empty-weight-map": lambda i: i.update({"weight_map": {}}),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index(sharded, tmp_path, case):
    d = copy_model(sharded, tmp_path)
    edit_index(d, INDEX_CASES[case])
    must = "model.safetensors.index.json" if case != "points-to-missing-file" else "nope.safetensors"
    expect_refused(d, must)


def test_tensor_in_two_files(sharded, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = copy_model(sharded, tmp_path)
    files = sorted(p for p in d.glob("model-*.safetensors"))
    a, b = load_file(str(files[0])), load_file(str(files[1]))
    k = next(iter(a))
    b[k] = a[k]
    save_file(b, str(files[1]), metadata={"format": "pt"})
    expect_refused(d, k)


def test_both_weight_layouts_from_two_saves(tmp_path):
    """save_pretrained into a folder saved before deletes the other layout's numbered
    shards but neither model.safetensors nor the index. Saved whole, then sharded, the
    folder keeps a stale model.safetensors, which transformers loads before the index
    (smp read the index: another model than transformers'); saved sharded, then whole,
    it keeps an index of deleted shards. Both are refused, naming the two files; an
    index that names model.safetensors alone (some hub repositories) is one model."""
    model = models.make("llama-gqa-f32", tmp_path / "base")
    whole_then_sharded, sharded_then_whole = tmp_path / "ws", tmp_path / "sw"
    model.save_pretrained(str(whole_then_sharded))
    model.save_pretrained(str(whole_then_sharded), max_shard_size="20KB")
    model.save_pretrained(str(sharded_then_whole), max_shard_size="20KB")
    model.save_pretrained(str(sharded_then_whole))
    for d, why in [(whole_then_sharded, "the index names other files"), (sharded_then_whole, "the index fails: ")]:
        assert (d / "model.safetensors").exists() and (d / "model.safetensors.index.json").exists()
        line = expect_refused(d, f"{d}: holds both model.safetensors and model.safetensors.index.json, and {why}")
        assert line.endswith("(one is a leftover of an earlier save; transformers would load model.safetensors): "
                             "remove the one that is not the model"), line
        p = run("smp-convert", "hf2smp", "--in", d, "--out", tmp_path / "out", "--layout", "tp=1")
        assert p.returncode == 3 and not (tmp_path / "out").exists(), p.stderr
    assert not list(sharded_then_whole.glob("model-0*.safetensors"))
    one = tmp_path / "one"
    shutil.copytree(tmp_path / "base", one)
    from safetensors import safe_open
    with safe_open(str(one / "model.safetensors"), "np") as f:
        names = list(f.keys())
    (one / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    assert run("smp-inspect", one).returncode == 0


def test_tied_head_stored_with_other_values(tmp_path):
    """tie_word_embeddings with lm_head.weight stored too: the same values (any dtype)
    are one tensor; other values are refused, naming both. transformers keeps both then,
    untied (shown here), so converting the embedding as the head (as smp did, dropping
    the stored head) gave another model than transformers'."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    d = tmp_path / "m"
    models.make("llama-tied-bf16-llama3", d)
    t = {k: v for k, v in load_file(str(d / "model.safetensors")).items()}
    emb = t["model.embed_tokens.weight"]
    assert "lm_head.weight" not in t
    for head, ok in [(emb.clone(), True), (emb.float(), True), (emb.float() * 2, False)]:
        save_file({**t, "lm_head.weight": head}, str(d / "model.safetensors"), metadata={"format": "pt"})
        if ok:
            assert run("smp-inspect", d).returncode == 0
            continue
        expect_refused(d, f"{d}: config.json ties the head to the embedding (tie_word_embeddings), but "
                          "\"lm_head.weight\" differs from \"model.embed_tokens.weight\" (transformers then keeps both, "
                          "untied): set tie_word_embeddings to false in config.json")
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        assert not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)


def test_corpus_is_large_enough():
    n = len(ST_CASES) + len(CONFIG_CASES) + len(NEOX_CONFIG_CASES) + len(MOE_CONFIG_CASES) + len(INDEX_CASES) + 9
    assert n >= 30, n
