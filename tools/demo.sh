#!/usr/bin/env bash
# The main job, end to end on this machine. Today: build smp, save a tiny Llama with
# transformers (sharded safetensors + index), and look at it with smp-inspect, text
# and JSON, checked against what the safetensors library reads. Each later stage
# (hf2smp, smp-train under mpirun, reshard, resume, smp-merge) joins this script as
# it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/bootstrap.sh | tail -1)
scons -Q -j"$(nproc)" >/dev/null
OUT=${1:-build/demo}
rm -rf "$OUT"; mkdir -p "$OUT"
"$VENV/bin/python" tools/demo/make_model.py "$OUT/hf"
echo
build/bin/smp-inspect "$OUT/hf"
build/bin/smp-inspect "$OUT/hf" --json > "$OUT/inspect.json"
"$VENV/bin/python" - "$OUT" <<'PY'
import json, sys, pathlib
from safetensors import safe_open
out = pathlib.Path(sys.argv[1])
info = json.loads((out / "inspect.json").read_text())
seen = {}
for f in info["files"]:
    with safe_open(str(out / "hf" / f["name"]), framework="pt") as sf:
        for k in sf.keys():
            seen[k] = list(sf.get_slice(k).get_shape())
ours = {t["name"]: t["shape"] for t in info["tensors"]}
assert ours == seen, "smp-inspect and safetensors disagree"
print(f"\ndemo: smp-inspect and the safetensors library agree on all {len(ours)} tensors in {len(info['files'])} files")
PY
echo "demo: ok"
