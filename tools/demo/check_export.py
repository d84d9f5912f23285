"""Compare an export with the original folder: tensors bit for bit, files, logits."""
import sys
import pathlib

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

src, out = map(pathlib.Path, sys.argv[1:3])


def tensors(folder):
    d = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            d.update({k: sf.get_tensor(k) for k in sf.keys()})
    return d


a, b = tensors(src), tensors(out)
assert set(a) == set(b), "tensor names differ"
assert all(torch.equal(a[k], b[k]) for k in a), "tensor values differ"
for name in ["config.json", "generation_config.json", "tokenizer_config.json"]:
    assert (src / name).read_bytes() == (out / name).read_bytes(), name
ids = torch.tensor([[1, 17, 42, 7, 99, 3, 250]])
with torch.no_grad():
    la = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32)(ids).logits
    lb = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)(ids).logits
assert torch.equal(la, lb), "logits differ"
print(f"export: {len(a)} tensors identical bit for bit, config and tokenizer files unchanged, "
      f"transformers gives identical logits (max |logit| {la.abs().max():.3f})")
