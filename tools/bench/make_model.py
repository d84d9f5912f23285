"""make_model.py OUT SIZE: a Llama-shaped model folder for the benchmarks (not a test).

SIZE: small (hidden 512, 4 layers, vocab 8000: ~21 M parameters, 42 MB), 1.5g (hidden
2048, intermediate 5632, 14 layers, vocab 32000, 16 heads, 4 kv heads: 762 M
parameters, 1.52 GB), 8b (Llama-3-8B's shapes: hidden 4096, intermediate 14336, 32
layers, vocab 128256, 32 heads, 8 kv heads: 8.03 G parameters, 16.1 GB) or moe (a
Qwen3-MoE with Qwen3-30B-A3B's tensor count, small tensors: 48 layers of 128 experts,
8 a token, hidden 256, an expert's intermediate 64, 8 heads of 32, 4 kv heads, vocab
8000: 18867 tensors, 317 M parameters, 634 MB) or moe-real (4 of Qwen3-30B-A3B's 48 layers at
its real shapes: hidden 2048, 128 experts of intermediate 768, 32 heads of 128, 4 kv heads,
vocab 151936: 1575 tensors, 3.11 G parameters, 6.23 GB; what a real MoE's pieces cost).
config.json comes from transformers'
LlamaConfig (Qwen3MoeConfig); model.safetensors holds random normal weights
(std 0.02, as transformers initializes; norms one) in bf16 under transformers' names.
The safetensors file is written here, tensor by tensor and block of rows by block (the
format is a JSON header and the raw bytes), so that making the 8B model needs little
memory; hf2smp and transformers read it like any other.
"""
import json
import os
import sys
import time

import numpy as np
from transformers import LlamaConfig, Qwen3MoeConfig

SIZES = {  # hidden, intermediate, vocab, layers, heads, kv heads
    "small": (512, 1408, 8000, 4, 8, 4),
    "1.5g": (2048, 5632, 32000, 14, 16, 4),
    "8b": (4096, 14336, 128256, 32, 32, 8),
}


def shapes(H, F, V, L, nq, nkv):
    hd = H // nq
    out = {"model.embed_tokens.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nq * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nq * hd),
                    p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                    p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out


# the moe size: layers, experts, experts a token, hidden, an expert's intermediate, heads, kv heads, head dim, vocab
MOE = (48, 128, 8, 256, 64, 8, 4, 32, 8000)
MOE_REAL = (4, 128, 8, 2048, 768, 32, 4, 128, 151936)


def moe_shapes(L, E, k, H, F, nq, nkv, hd, V):
    out = {"model.embed_tokens.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nq * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nq * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate.weight": (E, H), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (F, H), q + "up_proj.weight": (F, H), q + "down_proj.weight": (H, F)})
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    return out


def bf16_bits(x):
    """float32 -> bf16 bit patterns, rounded to nearest even (as torch and ml_dtypes do)."""
    u = x.view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def main():
    out, size = sys.argv[1], sys.argv[2]
    os.makedirs(out)
    if size in ("moe", "moe-real"):
        L, E, k, H, F, nq, nkv, hd, V = MOE if size == "moe" else MOE_REAL
        Qwen3MoeConfig(vocab_size=V, hidden_size=H, intermediate_size=4 * H, moe_intermediate_size=F,
                       num_hidden_layers=L, num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
                       num_experts=E, num_experts_per_tok=k, norm_topk_prob=True, max_position_embeddings=4096,
                       tie_word_embeddings=False, dtype="bfloat16",
                       architectures=["Qwen3MoeForCausalLM"]).to_json_file(os.path.join(out, "config.json"))
        sh = moe_shapes(L, E, k, H, F, nq, nkv, hd, V)
    else:
        H, F, V, L, nq, nkv = SIZES[size]
        LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=nq,
                    num_key_value_heads=nkv, max_position_embeddings=4096, dtype="bfloat16",
                    architectures=["LlamaForCausalLM"]).to_json_file(os.path.join(out, "config.json"))
        sh = shapes(H, F, V, L, nq, nkv)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for k, s in sh.items():
        n = 2 * int(np.prod(s))
        header[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    rng, t0 = np.random.default_rng(0), time.time()
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(len(hj).to_bytes(8, "little") + hj)
        for k, s in sh.items():
            if len(s) == 1:
                f.write(np.full(s, 0x3F80, "<u2").tobytes())  # ones
                continue
            for r0 in range(0, s[0], 1024):
                rows = min(1024, s[0] - r0)
                f.write(bf16_bits(rng.standard_normal((rows, s[1]), dtype=np.float32) * np.float32(0.02)).tobytes())
    print(f"  {off / 2 / 1e6:.0f} M parameters, {off / 1e9:.2f} GB, made in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
