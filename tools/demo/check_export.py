"""Check the demo's export: same tensor names, shapes and files as the original
folder; transformers loads it and its loss on the validation batches equals smp-eval's;
the training loss fell across the reshard and resume."""
import json
import pathlib
import sys

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

src, out, val, evalj, log1, log2 = map(pathlib.Path, sys.argv[1:7])


def tensors(folder):
    d = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            d.update({k: sf.get_tensor(k) for k in sf.keys()})
    return d


a, b = tensors(src), tensors(out)
assert set(a) == set(b), "tensor names differ"
assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a), "shapes or dtypes differ"
assert sum(not torch.equal(a[k], b[k]) for k in a) > 0, "training changed nothing"
for name in ["config.json", "generation_config.json", "tokenizer_config.json"]:
    assert (src / name).read_bytes() == (out / name).read_bytes(), name

# transformers' loss on smp-eval's batches (batch i: B*S+1 consecutive tokens)
raw = np.fromfile(val, dtype=np.uint8)
toks = np.frombuffer(raw[1024:].tobytes(), dtype="<u2").astype(np.int64)
ev = json.loads(evalj.read_text())
B, S, nb = 4, 64, 4
model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
losses = []
with torch.no_grad():
    for i in range(nb):
        chunk = torch.from_numpy(toks[i * B * S: i * B * S + B * S + 1])
        x, y = chunk[:-1].view(B, S), chunk[1:].view(B, S)
        logits = model(x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)).item())
hf_loss = float(np.mean(losses))
assert abs(hf_loss - ev["loss"]) <= 1e-4 * abs(ev["loss"]), (hf_loss, ev["loss"])

l1 = [json.loads(l) for l in log1.read_text().splitlines()]
l2 = [json.loads(l) for l in log2.read_text().splitlines()]
first, last = l1[0]["loss"], l2[-1]["loss"]
assert last < first - 0.5, (first, last)
print(f"export: {len(b)} tensors in the original's names, shapes and dtypes; config and tokenizer files unchanged")
print(f"training loss {first:.3f} -> {l1[-1]['loss']:.3f} (pp=2,tp=2,cp=2, step {l1[-1]['step']}) "
      f"-> {last:.3f} (resumed at tp=4,dp=2, step {l2[-1]['step']})")
print(f"validation loss: smp-eval {ev['loss']:.5f}, transformers on the export {hf_loss:.5f}")
