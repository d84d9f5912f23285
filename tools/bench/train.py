#!/usr/bin/env python3
"""bench/train.py: smp-train against a plain PyTorch eager training loop of the same
model, batch and optimizer, on this machine's cores, in one run. Prints tokens/s,
the first step's time (a fresh optimizer's moments are first touched there) and peak
memory (max RSS) of each, and the save at the end of the run: smp-train's (its "saved"
line) against torch.save of the model's and the optimizer's state dicts, fsynced, and
against `cp -r` + sync of smp-train's step folder (the physical anchor).

    python tools/bench/train.py [--hidden 256 --layers 4 --heads 8 --kv-heads 4 --vocab 4096
                                 --batch 8 --seq 256 --steps 20 --threads N --sdpa --repeat N
                                 --experts E --top-k K --logits-chunk N --also BUILD]

Both sides: fp32, AdamW, gradient clipping 1.0, the same random tokens; tokens/s is
measured over the steps after the first two (warm-up). torch runs in its own process
so its peak memory is its own. --sdpa adds a second torch run with
attn_implementation="sdpa" (torch's fused attention) beside the eager one; --repeat N runs
every side N times, in rounds, and reports the median round of each (this machine's
figures move by up to 20% between runs). --experts E makes the model a Mixtral of E
experts a layer (--intermediate: an expert's), --top-k of them a token. --also BUILD
adds the smp-train of another build folder (an earlier commit's) as a side of its own;
--logits-chunk goes to this build's smp-train. Vocabularies past 65535 write uint32
tokens. Needs the oracle venv (torch, transformers).
"""
import argparse
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("SMP_BUILD", ROOT / "build")) / "bin"

TORCH_LOOP = r"""
import json, os, sys, time, resource
import numpy as np, torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
model = AutoModelForCausalLM.from_pretrained(a["hf"], dtype=torch.float32, attn_implementation=a["attn"])
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
toks = np.fromfile(a["data"], dtype="<u4" if a["u32"] else "<u2", offset=1024).astype(np.int64)
B, S = a["batch"], a["seq"]
times = []
for step in range(a["steps"]):
    t0 = time.perf_counter()
    rows = np.stack([toks[(step * B + r) * S:(step * B + r) * S + S + 1] for r in range(B)])
    x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).logits.reshape(-1, model.config.vocab_size), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
t0 = time.perf_counter()  # the state a resume needs, durable as smp-train's save is
with open(a["save"], "wb") as f:
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
    f.flush()
    os.fsync(f.fileno())
save_s = time.perf_counter() - t0
print(json.dumps({"tokens_per_s": B * S * (len(times) - 2) / sum(times[2:]), "loss": loss.item(),
                  "first_step_s": times[0], "save_s": save_s, "save_bytes": os.path.getsize(a["save"]),
                  "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=0, help="default: 8/3 hidden rounded to 64")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=0, help="a Mixtral-shaped model of this many experts a layer "
                    "(--intermediate: an expert's; default 0, a dense Llama)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--sdpa", action="store_true", help="also run torch with attn_implementation=sdpa")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every run; the median round counts")
    ap.add_argument("--logits-chunk", help="smp-train's --logits-chunk (this build's)")
    ap.add_argument("--also", metavar="BUILD", help="another build folder whose smp-train runs as a side of its own")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (made, kept: the model, tokens and checkpoint "
                    "for profiling smp-train by hand) instead of a temporary folder")
    a = ap.parse_args()
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    inter = a.intermediate or (a.hidden * 8 // 3 + 63) // 64 * 64
    with tempfile.TemporaryDirectory() as scratch:
        tmp = pathlib.Path(a.keep or scratch)
        if a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        torch.manual_seed(0)
        shape = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=inter, num_hidden_layers=a.layers,
                     num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                     max_position_embeddings=max(a.seq, 128))
        if a.experts:
            model = MixtralForCausalLM(MixtralConfig(num_local_experts=a.experts, num_experts_per_tok=a.top_k,
                                                     **shape))
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape))
        nparams = sum(p.numel() for p in model.parameters())
        model.save_pretrained(str(tmp / "hf"), safe_serialization=True)
        del model
        n = a.batch * a.seq * a.steps + 1
        toks = np.random.default_rng(0).integers(0, a.vocab, size=n)
        h = np.zeros(256, "<i4")
        u32 = a.vocab > 65535
        h[:3] = (20240801, 7, n) if u32 else (20240520, 1, n)
        (tmp / "d.bin").write_bytes(h.tobytes() + toks.astype("<u4" if u32 else "<u2").tobytes())
        subprocess.run([str(BIN / "smp-convert"), "hf2smp", "--in", str(tmp / "hf"), "--out", str(tmp / "ck"),
                        "--layout", "pp=1"], check=True, capture_output=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        # smp-train picks OpenBLAS kernels as wide as the CPU's vectors itself where
        # OpenBLAS 0.3.21 does not know the CPU (backends/c/blas_pick.c), as a user gets
        # them; PyPI's torch brings its own BLAS (MKL on x86)
        ver = subprocess.run([str(BIN / "smp-train"), "--version"], env=env, capture_output=True, text=True).stdout
        blas = next((ln.split("(", 1)[1].split(")")[0] for ln in ver.splitlines() if "OpenBLAS" in ln), "?")
        # a wrapper process, so that the peak is smp-train's alone
        # (and its stderr, for the "saved" line)
        wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], check=True, capture_output=True, "
                "text=True); sys.stdout.write(r.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        smp_runs, sides, saves = [], {}, {}
        for _ in range(a.repeat):  # rounds of every side, so that a busy moment hits them all
            if a.also:
                sides.setdefault("also", []).append(smp_side(wrap, pathlib.Path(a.also) / "bin", tmp, a, env, []))
            p, rows = smp_run(wrap, BIN, tmp, a, env, ["--logits-chunk", a.logits_chunk] if a.logits_chunk else [])
            last = tmp / "run" / (tmp / "run" / "latest").read_text().strip()
            lanes = json.loads((last / "smp.json").read_text())["training"]["lanes"]  # auto's pick (--lanes)
            smp_runs.append((tokens_per_s(a, rows), int(p.stdout.split()[-1]), rows[0]["elapsed_s"]))
            saved = re.search(r"saved \S+: (\d+) bytes in ([0-9.]+) s", p.stdout)
            shutil.rmtree(tmp / "copy", ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(last), str(tmp / "copy")], check=True)
            os.sync()
            saves.setdefault("smp", []).append((float(saved[2]), int(saved[1])) if saved else (math.nan, 0))
            saves.setdefault("cp", []).append((time.perf_counter() - t0, int(saved[1]) if saved else 0))
            shutil.rmtree(tmp / "copy", ignore_errors=True)
            for attn in ["eager"] + (["sdpa"] if a.sdpa else []):
                p = subprocess.run([sys.executable, "-c", TORCH_LOOP, json.dumps(dict(
                    hf=str(tmp / "hf"), data=str(tmp / "d.bin"), batch=a.batch, seq=a.seq, steps=a.steps,
                    threads=a.threads, attn=attn, save=str(tmp / "torch.pt"), u32=u32))], check=True, capture_output=True,
                    text=True, env=env)
                sides.setdefault(attn, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
                r = sides[attn][-1]
                saves.setdefault("torch " + attn, []).append((r["save_s"], r["save_bytes"]))
                (tmp / "torch.pt").unlink(missing_ok=True)
        # each side's median round (tokens/s) and its largest peak
        smp_tps = statistics.median(t for t, _, _ in smp_runs)
        smp_rss = max(r for _, r, _ in smp_runs)
        smp_first = statistics.median(f for _, _, f in smp_runs)
        side_runs = {attn: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                             "max_rss_kib": max(r["max_rss_kib"] for r in runs),
                             "first_step_s": statistics.median(r["first_step_s"] for r in runs),
                             "all": [r["tokens_per_s"] for r in runs]} for attn, runs in sides.items()}
    moe = f", {a.experts} experts a layer, {a.top_k} a token" if a.experts else ""
    print(f"model: {nparams / 1e6:.2f} M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads, "
          f"{a.kv_heads} kv heads, intermediate {inter}{moe}, vocab {a.vocab}); batch {a.batch} x {a.seq} tokens; "
          f"{a.threads} threads; fp32, AdamW; smp-train: {blas}, {lanes} lane{'s' if lanes > 1 else ''}"
          + (f" (OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} from the environment)" if "OPENBLAS_CORETYPE" in env else ""))
    print(f"{'':12s} {'tokens/s':>10s} {'first step':>10s} {'peak RSS':>10s}" + ("   (median of %d rounds; each round)" % a.repeat
                                                              if a.repeat > 1 else ""))
    each = lambda xs: "   " + " ".join(f"{x:.0f}" for x in xs) if a.repeat > 1 else ""
    print(f"{'smp-train':12s} {smp_tps:10.0f} {smp_first:9.2f}s {smp_rss / 1024:9.0f}M" + each(t for t, _, _ in smp_runs))
    for attn, t in side_runs.items():
        print(f"{'torch ' + attn if attn != 'also' else 'smp (--also)':12s} {t['tokens_per_s']:10.0f} {t['first_step_s']:9.2f}s "
              f"{t['max_rss_kib'] / 1024:9.0f}M" + each(t["all"]))
    for attn, t in side_runs.items():
        print(f"speed ratio smp/{'torch ' + attn if attn != 'also' else '--also'}: {smp_tps / t['tokens_per_s']:.2f}x; "
              f"memory ratio: {smp_rss / t['max_rss_kib']:.2f}x")
    # the saves: each side's median round, seconds and GB/s of what it wrote
    med = {k: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v)) for k, v in saves.items()}
    print("save at the end of the run, durable (median of %d): " % a.repeat + "; ".join(
        f"{k} {t:.2f} s ({b / 1e9:.2f} GB, {b / t / 1e9 if t > 0 else 0:.2f} GB/s)" for k, (t, b) in med.items()))
    if "smp" in med and med["cp"][0] > 0:
        print(f"save ratio smp / (cp -r && sync of its step folder): {med['smp'][0] / med['cp'][0]:.2f}x" + "".join(
            f"; smp / {k}: {med['smp'][0] / t:.2f}x" for k, (t, _) in med.items() if k.startswith("torch") and t > 0))


def smp_run(wrap, bindir, tmp, a, env, extra):
    """bindir's smp-train over the benchmark's checkpoint and tokens: the wrapper's
    process (its stdout: smp-train's stderr, then the peak RSS) and the step log."""
    shutil.rmtree(tmp / "run", ignore_errors=True)
    (tmp / "log.jsonl").unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-c", wrap, str(bindir / "smp-train"), "--ckpt", str(tmp / "ck"),
                        "--data", str(tmp / "d.bin"), "--save-dir", str(tmp / "run"), "--steps",
                        str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq), "--schedule", "constant",
                        "--log", str(tmp / "log.jsonl"), "--compress", "none", *map(str, extra)], check=True,
                       capture_output=True, text=True, env=env)
    return p, [json.loads(x) for x in (tmp / "log.jsonl").read_text().splitlines()]


def tokens_per_s(a, rows):
    """over the steps after the first two"""
    return a.batch * a.seq * (len(rows) - 2) / sum(a.batch * a.seq / r["tokens_per_s"] for r in rows[2:])


def smp_side(wrap, bindir, tmp, a, env, extra):
    """another build's smp-train as a side, in the torch sides' form"""
    p, rows = smp_run(wrap, bindir, tmp, a, env, extra)
    return {"tokens_per_s": tokens_per_s(a, rows), "first_step_s": rows[0]["elapsed_s"],
            "max_rss_kib": int(p.stdout.split()[-1]), "save_s": math.nan, "save_bytes": 0}


if __name__ == "__main__":
    main()
