"""Tiny random models saved by transformers' save_pretrained: the real thing, small."""
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

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
}


def make(name, path, seed=0):
    family, kw, dtype, save_kw = CASES[name]
    torch.manual_seed(seed)
    cfg = (LlamaConfig if family == "llama" else MistralConfig)(**kw)
    model = (LlamaForCausalLM if family == "llama" else MistralForCausalLM)(cfg).to(dtype)
    model.save_pretrained(str(path), safe_serialization=True, **save_kw)
    return model


def config(path):
    return json.loads((path / "config.json").read_text())
