"""Tiny random models saved by transformers' save_pretrained: the real thing, small."""
import json
import re

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
    # Qwen3 with YaRN, as Qwen's model cards extend its context (factor 4 over the
    # original window; here 32 tokens, so that the sequences of the tests pass it)
    "qwen3-yarn": ("qwen3", dict(vocab_size=93, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                  "original_max_position_embeddings": 32}),
                   torch.float32, {}),
    # GPT-NeoX (Pythia): fused per-head [q; k; v] with biases, biased dense/MLP, LayerNorm
    # with biases, exact GELU, partial rotary; a parallel and a sequential residual
    "neox-parallel": ("gpt_neox", dict(vocab_size=83, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, use_parallel_residual=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}), torch.float32, {}),
    "neox-sequential": ("gpt_neox", dict(vocab_size=89, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                         num_attention_heads=6, use_parallel_residual=False,  # head_dim 8: rotary 2
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.25}), torch.bfloat16, {}),
    "neox-full-rotary-tied": ("gpt_neox", dict(vocab_size=79, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=3, num_attention_heads=2, tie_word_embeddings=True,
                                               layer_norm_eps=1e-6,
                                               rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                                "partial_rotary_factor": 1.0}), torch.float32, {}),
    # Mixture of experts: every layer's MLP a router over SwiGLU experts, top-k of them
    # weighted by their router probabilities (Mixtral's renormalized, Qwen3-MoE's by
    # norm_topk_prob); make() draws the routers sharp, so that the routing is decisive
    "mixtral-k2": ("mixtral", dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2), torch.float32, {}),
    "mixtral-k1-tied-bf16": ("mixtral", dict(vocab_size=91, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=1, num_local_experts=3,
                                             num_experts_per_tok=1, tie_word_embeddings=True), torch.bfloat16, {}),
    # Qwen3-MoE: Qwen3's attention (q/k norms, head_dim); intermediate_size is its dense
    # MLP's, unused when every layer is sparse (moe_intermediate_size is the experts')
    "qwen3moe-k2-norm": ("qwen3_moe", dict(vocab_size=101, hidden_size=32, intermediate_size=56,
                                           moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                         torch.float32, {}),
    "qwen3moe-k1": ("qwen3_moe", dict(vocab_size=89, hidden_size=32, intermediate_size=64, moe_intermediate_size=20,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                      num_experts=6, num_experts_per_tok=1, norm_topk_prob=False), torch.float32, {}),
    # test_cuda_backend's: every width a multiple of 16, as the CUDA backend's FP8 GEMMs
    # need (an expert's routed rows are not); head_dim 32 runs the bf16 attention's
    # tensor-core (mma.sync) kernels
    "llama-cuda": ("llama", dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2), torch.float32, {}),
    "mixtral-cuda": ("mixtral", dict(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2), torch.float32, {}),
}
# family: the prefix of transformers' classes (<prefix>Config, <prefix>ForCausalLM)
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt_neox": "GPTNeoX",
            "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}
# Parameters that save_pretrained writes under another name than the module's (transformers
# 5's checkpoint conversion mapping, reversed on save): GPT-NeoX's head is the module
# lm_head, the file's embed_out (as Pythia's checkpoints have it)
SAVED_AS = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}
# ... and a mixture of experts' layers: transformers 5's modules hold a layer's experts
# fused, model.layers.N.mlp.experts.gate_up_proj [E, 2F, H] (each expert's [gate; up]) and
# .down_proj [E, H, F], which save_pretrained writes per expert; the router is mlp.gate.
# model_type: (the block's name in the files, expert e's gate, up and down in the files)
EXPERTS = {"mixtral": ("block_sparse_moe", "experts.{}.w1.weight", "experts.{}.w3.weight", "experts.{}.w2.weight"),
           "qwen3_moe": ("mlp", "experts.{}.gate_proj.weight", "experts.{}.up_proj.weight",
                         "experts.{}.down_proj.weight")}


def available(name):
    """transformers has the case's family (Qwen3 came with 4.51)"""
    return hasattr(transformers, FAMILIES[CASES[name][0]] + "ForCausalLM")


def saved_as(model, name, t):
    """What save_pretrained writes of model's parameter `name` when t is its value (the
    parameter itself, or its gradient: anything of its shape): [(file name, view of t)]."""
    mt = model.config.model_type
    if name in SAVED_AS.get(mt, {}):
        return [(SAVED_AS[mt][name], t)]
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.(.+)", name) if mt in EXPERTS else None
    if not m:
        return [(name, t)]
    block, gate, up, down = EXPERTS[mt]
    pre, rest = f"{m.group(1)}.{block}.", m.group(2)
    if rest == "experts.gate_up_proj":  # [E, 2F, H]
        F = t.shape[1] // 2
        return [(pre + w.format(e), t[e, :F] if w == gate else t[e, F:]) for e in range(t.shape[0]) for w in (gate, up)]
    if rest == "experts.down_proj":  # [E, H, F]
        return [(pre + down.format(e), t[e]) for e in range(t.shape[0])]
    return [(pre + rest, t)]  # the router, mlp.gate.weight


def named_parameters(model, of=lambda p: p):
    """model's parameters by the names of its files: {saved name: of(parameter)}, cut as
    save_pretrained cuts them (of=lambda p: p.grad: the gradients, likewise)."""
    return {n: v for name, p in model.named_parameters() for n, v in saved_as(model, name, of(p))}


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
    if family in ("qwen3", "qwen3_moe"):  # and sets the q/k norms to one
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if family == "gpt_neox":  # biases zero and LayerNorms one and zero, every one of them
        with torch.no_grad():
            for layer in model.gpt_neox.layers:
                for lin in (layer.attention.query_key_value, layer.attention.dense, layer.mlp.dense_h_to_4h,
                            layer.mlp.dense_4h_to_h):
                    lin.bias.normal_(0, 0.5)
            for ln in [m for layer in model.gpt_neox.layers for m in (layer.input_layernorm,
                                                                        layer.post_attention_layernorm)] + \
                    [model.gpt_neox.final_layer_norm]:
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0, 0.2)
    if family in EXPERTS:  # sharp routers: near-ties between experts would let layouts flip routings on last bits
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True, **save_kw)
    return model


def saved_names(path):
    """The tensor names of the safetensors files in path."""
    from safetensors import safe_open
    out = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out |= set(sf.keys())
    return out


def config(path):
    return json.loads((path / "config.json").read_text())
