"""smp-convert init against transformers' own initialization."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import run
from test_roundtrip import tensors_of


@pytest.fixture
def config(tmp_path):
    cfg = LlamaConfig(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, initializer_range=0.05, pad_token_id=3)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    (tmp_path / "cfg").mkdir()
    cfg.to_json_file(str(tmp_path / "cfg" / "config.json"))
    return cfg, tmp_path / "cfg" / "config.json"


def merged(tmp_path, cfg_path, layout, seed, name):
    run("smp-convert", "init", "--config", cfg_path, "--out", tmp_path / f"ck-{name}", "--layout", layout, "--seed", seed, check=0)
    run("smp-merge", "--in", tmp_path / f"ck-{name}", "--out", tmp_path / f"hf-{name}", check=0)
    return tmp_path / f"hf-{name}"


def test_init_is_distributed_as_transformers_does(tmp_path, config):
    cfg, path = config
    ours = tensors_of(merged(tmp_path, path, "tp=2", 1, "a"))
    torch.manual_seed(0)
    ref = dict(LlamaForCausalLM(cfg).named_parameters())
    assert set(ours) == set(ref)
    for name, t in ours.items():
        r = ref[name].detach()
        assert t.shape == r.shape and t.dtype == torch.float32, name
        if "norm" in name:
            assert torch.equal(t, r), name  # ones, exactly
            continue
        if name == "model.embed_tokens.weight":
            assert torch.count_nonzero(t[cfg.pad_token_id]) == 0 and torch.count_nonzero(r[cfg.pad_token_id]) == 0
            t, r = torch.cat([t[:3], t[4:]]), torch.cat([r[:3], r[4:]])
        # same distribution: mean ~ 0, std ~ initializer_range, normal tails
        n = t.numel()
        assert abs(t.mean().item()) < 4 * cfg.initializer_range / n ** 0.5, name
        assert abs(t.std().item() / r.std().item() - 1) < 6 / (2 * n) ** 0.5 + 0.01, name
        frac_ours = (t.abs() > 2 * cfg.initializer_range).float().mean().item()
        frac_ref = (r.abs() > 2 * cfg.initializer_range).float().mean().item()
        assert abs(frac_ours - frac_ref) < 0.02, name


def test_init_is_the_same_in_every_layout_and_differs_by_seed(tmp_path, config):
    _, path = config
    a = tensors_of(merged(tmp_path, path, "pp=1", 7, "a"))
    b = tensors_of(merged(tmp_path, path, "pp=2,tp=6,dp=2", 7, "b"))
    c = tensors_of(merged(tmp_path, path, "tp=2,cp=2", 8, "c"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if "norm" not in k:
            assert not torch.equal(a[k], c[k]), k


def test_init_loads_in_transformers(tmp_path, config):
    _, path = config
    out = merged(tmp_path, path, "tp=2", 5, "a")
    m = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        logits = m(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    assert json.loads((out / "config.json").read_text())["initializer_range"] == 0.05
