"""smp-inspect on folders written by transformers' save_pretrained."""
import json

import pytest
from safetensors import safe_open

import models
from conftest import run


@pytest.mark.parametrize("case", list(models.CASES))
def test_inspect_describes_transformers_folders(tmp_path, case):
    model = models.make(case, tmp_path)
    cfg = models.config(tmp_path)
    out = json.loads(run("smp-inspect", tmp_path, "--json", check=0).stdout)
    c = out["config"]
    assert out["architecture"] == cfg["architectures"][0]
    assert out["model_type"] == cfg["model_type"]
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings"]:
        assert c[key] == cfg[key], key
    # GPT-NeoX's configs have no num_key_value_heads (as many as query heads)
    assert c["num_key_value_heads"] == cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    assert c["head_dim"] == cfg.get("head_dim") or c["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    eps = "layer_norm_eps" if "layer_norm_eps" in cfg else "rms_norm_eps"  # GPT-NeoX's LayerNorm
    assert c[eps] == pytest.approx(cfg[eps])
    # transformers >= 5 writes "rope_parameters" (rope_theta inside) and "dtype"; smp-inspect
    # reports the older spelling: rope_theta, rope_scaling (null for the default rope), torch_dtype;
    # GPT-NeoX's rotary fraction as partial_rotary_factor, where it is not 1, and its residual
    rope = dict(cfg["rope_parameters"])
    assert c["rope_theta"] == pytest.approx(rope.pop("rope_theta"))
    factor = rope.pop("partial_rotary_factor", 1.0)
    assert c.get("partial_rotary_factor", 1.0) == pytest.approx(factor)
    assert c.get("use_parallel_residual") == cfg.get("use_parallel_residual")
    assert c["sliding_window"] == cfg.get("sliding_window")
    assert c["torch_dtype"] == cfg["dtype"]
    if rope["rope_type"] != "default":
        assert c["rope_scaling"] == rope
    else:
        assert c["rope_scaling"] is None
    # parameter count as torch counts unique parameters
    assert out["parameters"] == sum(p.numel() for p in model.parameters())
    # every tensor, as the safetensors library sees the files
    seen = {}
    for f in out["files"]:
        with safe_open(str(tmp_path / f["name"]), framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                seen[k] = (t.get_dtype(), list(t.get_shape()), f["name"])
    assert {t["name"]: (t["dtype"], t["shape"], t["file"]) for t in out["tensors"]} == seen
    assert out["indexed"] == (case == "llama-sharded")
    if case == "llama-sharded":
        assert len(out["files"]) > 1
    assert "generation_config.json" in out["other_files"]


def test_inspect_text_output_is_readable(tmp_path):
    models.make("llama-gqa-f32", tmp_path)
    p = run("smp-inspect", tmp_path, check=0)
    assert "LlamaForCausalLM" in p.stdout and "GQA" in p.stdout and "parameters" in p.stdout
    assert p.stderr == ""
