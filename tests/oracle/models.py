"""Tiny random models saved by transformers' save_pretrained: the real thing, small."""
import json

import torch
import transformers

CASES = {
    # name: (family, config kwargs, dtype, save kwargs)
    "llama-gqa-f32": ("llama", dict(vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=3,
                                    num_attention_heads=6, num_key_value_heads=2), torch.float32, {}),
    "llama-tied-bf16-llama3": ("llama", dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                                             max_position_embeddings=256,
                                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                              "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64}),
                               torch.bfloat16, {}),
    "mistral-gqa-f16-window": ("mistral", dict(vocab_size=67, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=1, sliding_window=16,
                                               head_dim=12), torch.float16, {}),
    "llama-sharded": ("llama", dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4), torch.float32,
                      {"max_shard_size": "60KB"}),
    # Qwen2: biases on q, k, v; rope_theta 1e6; tied on the small sizes
    "qwen2-gqa-tied": ("qwen2", dict(vocab_size=89, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                     num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                       torch.bfloat16, {}),
    "qwen2-untied": ("qwen2", dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}), torch.float32, {}),
    # Qwen3: per-head q/k RMSNorm, an explicit head_dim (not hidden / heads)
    "qwen3-gqa-hd": ("qwen3", dict(vocab_size=91, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                     torch.float32, {}),
}
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def available(name):
    """transformers has the case's family (Qwen3 came with 4.51)"""
    return hasattr(transformers, FAMILIES[CASES[name][0]] + "ForCausalLM")


def classes(family):
    p = FAMILIES[family]
    return getattr(transformers, p + "Config"), getattr(transformers, p + "ForCausalLM")


def make(name, path, seed=0):
    family, kw, dtype, save_kw = CASES[name]
    torch.manual_seed(seed)
    config_cls, model_cls = classes(family)
    model = model_cls(config_cls(**kw)).to(dtype)
    if family == "qwen2":  # transformers zeroes the biases: random ones test their use
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3":  # and sets the q/k norms to one
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True, **save_kw)
    return model


def config(path):
    return json.loads((path / "config.json").read_text())
