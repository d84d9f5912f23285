"""Save a tiny random Llama (GQA, bf16) with transformers, as a user's model folder would be."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB")
print(f"demo: saved a {sum(p.numel() for p in model.parameters()):,}-parameter LlamaForCausalLM to {out}")
