"""tools/bench/e2e-gpu.sh, dry (E2E_DRY=1: the C backend, tiny models): the script the
GPU runs only where a GPU is lent, and where a broken line costs a lease's minutes. The
script's own figures are checked against the logs it kept and against the flops
formula worked out here, not against its summary alone."""
import json
import os
import re
import subprocess

from conftest import BUILD, ROOT


def rows(path):
    return {r["step"]: r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())}


def test_e2e_gpu_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, E2E_DRY="1", E2E_WORK=str(tmp_path / "work"))
    p = subprocess.run([str(ROOT / "tools/bench/e2e-gpu.sh"), str(BUILD / "bin"), str(out)], capture_output=True,
                       text=True, env=env, timeout=600)
    summary = (out / "e2e.txt").read_text()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"^e2e: OK in \d+s$", summary, re.M), summary

    # the flops of a token: the dry model's dims (hidden 128, intermediate 352, 2 layers,
    # 4 heads x 32, 2 kv heads, vocab 512) at seq 128
    H, F, L, nh, nkv, hd, V, S = 128, 352, 2, 4, 2, 32, 512, 128
    n = L * (H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 3 * H * F) + V * H
    fpt = 6 * n + 6 * L * S * nh * hd
    assert f"N = {n:,}" in summary and f"= {6 * n} + {6 * L * S * nh * hd} = {fpt};" in summary, summary

    # the parity lines: max over steps of |loss - loss_cpu| / loss_cpu, from the logs
    logs = out / "e2e-logs"
    ref = rows(logs / "parity-cpu-fp32-fp8off.jsonl")
    for dtype in ("fp32", "bf16"):
        got = rows(logs / f"parity-gpu-{dtype}-fp8off.jsonl")
        assert sorted(got) == sorted(ref) and len(ref) == 4
        diff = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref)
        m = re.search(rf"^PASS cuda {dtype} vs cpu .*max rel loss diff (\S+) ", summary, re.M)
        assert m and abs(float(m.group(1)) - diff) <= 1e-3 * diff + 1e-12, summary
    # both dry parity runs above are the C backend (a difference of 0); the fp8 one against
    # fp32 is not, so the script's arithmetic is checked on a figure that can be wrong
    got = rows(logs / "parity-gpu-bf16-fp8delayed.jsonl")
    diffs = {s: abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref}
    at = max(diffs, key=diffs.get)
    m = re.search(r"^INFO cuda bf16 fp8 delayed vs cpu fp32 .*max rel loss diff (\S+) at step (\d+) ", summary, re.M)
    assert diffs[at] > 0 and m, summary
    assert abs(float(m.group(1)) - diffs[at]) <= 1e-3 * diffs[at] and int(m.group(2)) == at, (diffs, summary)
    for fam in ("neox", "mixtral"):
        assert re.search(rf"^PASS {fam} cuda fp32 vs cpu", summary, re.M), summary

    # the longest sequence: without recomputation, then with --recompute full from there
    assert "longest sequence, cp=1, --recompute none: 1024 (the longest tried)" in summary, summary
    assert "longest sequence, cp=1, --recompute full: 1024 (the longest tried)" in summary, summary
    full = summary[summary.index("--recompute full, bf16"):]
    assert "seq 256: not run (ran with less recomputation)" in full and "seq 512: not run" in full, summary
    assert (logs / "maxseq-none-512.jsonl").exists() and not (logs / "maxseq-full-512.jsonl").exists()
    assert len(rows(logs / "maxseq-full-1024.jsonl")) == 2
    assert len(summary.splitlines()) < 60
