"""The demo's mixture of experts.
  moe.py make OUT            save a tiny random Mixtral (4 experts, 2 per token, the
                             load-balancing loss in the loss) with transformers
  moe.py check HF VAL EVAL LOG
                             transformers loads the export HF and gives smp-eval's loss
                             and load-balancing loss (EVAL) on the validation batches; the
                             training loss fell and the run logged the load-balancing loss"""
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM


def make(out):
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=512, output_router_logits=True, router_aux_loss_coef=0.02)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    print(f"demo: saved a {sum(p.numel() for p in model.parameters()):,}-parameter MixtralForCausalLM to {out}")


def check(hf, val, evalj, log):
    got = json.load(open(evalj))
    model = AutoModelForCausalLM.from_pretrained(hf).float().eval()
    raw = open(val, "rb").read()
    n = int(np.frombuffer(raw[:12], dtype="<i4")[2])
    toks = np.frombuffer(raw[1024:1024 + 2 * n], dtype="<u2").astype(np.int64)
    B, S, NB = 4, 64, 2  # smp-eval's --batch 4 --seq 64 --batches 2: batch i is B*S+1 tokens from i*B*S
    total, count, router = 0.0, 0, []
    with torch.no_grad():
        for i in range(NB):
            rows = torch.tensor(np.stack([toks[(i * B + r) * S:(i * B + r) * S + S + 1] for r in range(B)]))
            out = model(rows[:, :-1], output_router_logits=True)
            total += F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), rows[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += rows[:, 1:].numel()
            router.append(out.router_logits)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    layers = tuple(torch.cat([r[l] for r in router]) for l in range(len(router[0])))  # all batches at once, as smp-eval
    aux = float(load_balancing_loss_func(layers, model.config.num_local_experts, model.config.num_experts_per_tok))
    loss = total / count
    print(f"demo: transformers on the export: loss {loss:.6f}, load-balancing loss {aux:.6f}; "
          f"smp-eval: {got['loss']:.6f}, {got['aux_loss']:.6f}")
    assert abs(loss - got["loss"]) <= 1e-5 * loss and abs(aux - got["aux_loss"]) <= 1e-5 * aux, (loss, aux, got)
    steps = [json.loads(line) for line in open(log)]
    assert all("aux_loss" in s for s in steps) and steps[-1]["loss"] < steps[0]["loss"], steps
    print(f"demo: MoE training loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}, "
          f"load-balancing loss {steps[0]['aux_loss']:.3f} -> {steps[-1]['aux_loss']:.3f}")


if __name__ == "__main__":
    make(sys.argv[2]) if sys.argv[1] == "make" else check(*sys.argv[2:6])
