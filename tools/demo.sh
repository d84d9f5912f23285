#!/usr/bin/env bash
# The main job, end to end on this machine:
#   1. build smp; save a tiny Llama (GQA, bf16, sharded safetensors + index, a tokenizer
#      file) with transformers; look at it with smp-inspect
#   2. smp-convert hf2smp into pp=2,tp=2,cp=2 (with 4 MPI processes), verify, inspect
#   3. reshard it to tp=4,dp=2, then merge it back into a Hugging Face folder
#   4. check the export with transformers: same tensors bit for bit, same logits
# Training (smp-train under mpirun, resume in another layout) joins as it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/bootstrap.sh | tail -1)
scons -Q -j"$(nproc)" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${1:-build/demo}
rm -rf "$OUT"; mkdir -p "$OUT"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "a model folder, as transformers saves it"
"$VENV/bin/python" tools/demo/make_model.py "$OUT/hf"
echo '{"model_max_length": 512}' > "$OUT/hf/tokenizer_config.json"
build/bin/smp-inspect "$OUT/hf"

say "hf2smp into pp=2,tp=2,cp=2 (8 ranks), 4 processes"
mpirun --oversubscribe --bind-to none -np 4 build/bin/smp-convert hf2smp \
    --in "$OUT/hf" --out "$OUT/ckpt" --layout pp=2,tp=2,cp=2
build/bin/smp-verify "$OUT/ckpt"
build/bin/smp-inspect "$OUT/ckpt" | sed -n 1,12p

say "reshard to tp=4,dp=2, merge back to Hugging Face safetensors"
build/bin/smp-convert reshard --in "$OUT/ckpt" --out "$OUT/ckpt-tp4" --layout tp=4,dp=2
build/bin/smp-verify "$OUT/ckpt-tp4"
build/bin/smp-merge --in "$OUT/ckpt-tp4" --out "$OUT/export"

say "the export, checked with transformers"
"$VENV/bin/python" tools/demo/check_export.py "$OUT/hf" "$OUT/export"
echo "demo: ok"
