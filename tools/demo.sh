#!/usr/bin/env bash
# The main job, end to end on this machine (CPU backend, MPI ranks on the local cores):
#   1. save a tiny Llama (GQA, bf16, sharded safetensors + index, a tokenizer file)
#      with transformers; smp-inspect it
#   2. smp-convert hf2smp into pp=2,tp=2,cp=2 with 4 processes; verify; inspect
#   3. train it under mpirun, 8 ranks, pp=2,tp=2,cp=2, on English text (byte tokens)
#   4. reshard the run's checkpoint (weights, optimizer and training state) to tp=4,dp=2
#      and resume there for more steps
#   5. smp-eval; merge into a Hugging Face folder; transformers loads it and gives the
#      same loss as smp-eval
#   6. fine-tune the export on chats (tools/prepare_sft.py: a chat template, loss masks):
#      packed documents under cp=2,dp=2, the masked validation loss before and after
#   7. a mixture of experts: a tiny Mixtral trained under pp=2,tp=2 with its load-balancing
#      loss, merged, and checked against transformers (loss and load-balancing loss)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/bootstrap.sh | tail -1)
PY="$VENV/bin/python"
scons -Q -j"$(nproc)" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
MPI="mpirun --oversubscribe --bind-to none"
OUT=${1:-build/demo}
rm -rf "$OUT"; mkdir -p "$OUT"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "1. a model folder, as transformers saves it"
"$PY" tools/demo/make_model.py "$OUT/hf"
echo '{"model_max_length": 512}' > "$OUT/hf/tokenizer_config.json"
build/bin/smp-inspect "$OUT/hf"

say "2. hf2smp into pp=2,tp=2,cp=2 (8 ranks' shard files), 4 processes"
$MPI -np 4 build/bin/smp-convert hf2smp --in "$OUT/hf" --out "$OUT/ckpt" --layout pp=2,tp=2,cp=2
build/bin/smp-verify "$OUT/ckpt"
build/bin/smp-inspect "$OUT/ckpt" | sed -n 1,6p

say "3. train under mpirun: 8 ranks, pp=2,tp=2,cp=2 (ring attention)"
"$PY" tools/text2tokens.py "$OUT/train.bin" README.md docs/*.md --val-fraction 0.1 --val-out "$OUT/val.bin"
$MPI -np 8 build/bin/smp-train --ckpt "$OUT/ckpt" --data "$OUT/train.bin" --val-data "$OUT/val.bin" \
    --save-dir "$OUT/run" --layout pp=2,tp=2,cp=2 --steps 40 --stop-at 24 --batch 8 --microbatches 2 \
    --seq 64 --lr 1e-2 --warmup 4 --seed 1 --log "$OUT/run/log.jsonl"
build/bin/smp-verify "$OUT/run"

say "4. reshard the run to tp=4,dp=2 and resume there"
mkdir -p "$OUT/run2"
build/bin/smp-convert reshard --in "$OUT/run" --out "$OUT/run2/step-000024" --layout tp=4,dp=2
echo step-000024 > "$OUT/run2/latest"
$MPI -np 8 build/bin/smp-train --ckpt "$OUT/run2" --data "$OUT/train.bin" --val-data "$OUT/val.bin" \
    --save-dir "$OUT/run2" --layout tp=4,dp=2 --log "$OUT/run2/log.jsonl"
build/bin/smp-verify "$OUT/run2"
"$PY" tools/plot_log.py "$OUT/run/log.jsonl" -o "$OUT/loss.png" >/dev/null && echo "plot: $OUT/loss.png"

say "5. evaluate, merge, check the export with transformers"
build/bin/smp-eval --ckpt "$OUT/run2" --data "$OUT/val.bin" --batch 4 --seq 64 --batches 4 --json | tee "$OUT/eval.json"
build/bin/smp-merge --in "$OUT/run2" --out "$OUT/export"
"$PY" tools/demo/check_export.py "$OUT/hf" "$OUT/export" "$OUT/val.bin" "$OUT/eval.json" "$OUT/run/log.jsonl" "$OUT/run2/log.jsonl"

say "6. fine-tune the export on chats: packed documents, loss on the answers, cp=2,dp=2"
"$PY" tools/demo/make_sft.py "$OUT/tok" "$OUT/chat.jsonl" "$OUT/chat-val.jsonl"
"$PY" tools/prepare_sft.py --tokenizer "$OUT/tok" "$OUT/chat.jsonl" "$OUT/sft.bin" | tee "$OUT/sft.txt"
"$PY" tools/prepare_sft.py --tokenizer "$OUT/tok" "$OUT/chat-val.jsonl" "$OUT/sft-val.bin" >/dev/null
SEP=$(grep -o -- '--doc-sep [0-9]*' "$OUT/sft.txt" | cut -d' ' -f2)
DOCS=(--documents --doc-sep "$SEP")
build/bin/smp-convert hf2smp --in "$OUT/export" --out "$OUT/sft-ckpt" --layout cp=2,dp=2
build/bin/smp-eval --ckpt "$OUT/sft-ckpt" --data "$OUT/sft-val.bin" --loss-mask "$OUT/sft-val.mask.bin" "${DOCS[@]}" \
    --batch 4 --seq 128 --json | tee "$OUT/sft-before.json"
$MPI -np 4 build/bin/smp-train --ckpt "$OUT/sft-ckpt" --data "$OUT/sft.bin" --loss-mask "$OUT/sft.mask.bin" "${DOCS[@]}" \
    --save-dir "$OUT/sft" --layout cp=2,dp=2 --steps 30 --batch 8 --seq 128 --lr 3e-3 --warmup 3 --seed 2 \
    --log "$OUT/sft/log.jsonl"
build/bin/smp-eval --ckpt "$OUT/sft" --data "$OUT/sft-val.bin" --loss-mask "$OUT/sft-val.mask.bin" "${DOCS[@]}" \
    --batch 4 --seq 128 --json | tee "$OUT/sft-after.json"
"$PY" - "$OUT/sft-before.json" "$OUT/sft-after.json" <<'PYEOF'
import json, sys
before, after = (json.load(open(p)) for p in sys.argv[1:3])
print(f"masked validation loss (answers only): {before['loss']:.3f} before, {after['loss']:.3f} after fine-tuning")
assert after["loss"] < 0.8 * before["loss"], (before, after)
PYEOF

say "7. a mixture of experts: Mixtral, pp=2,tp=2, the load-balancing loss trained"
"$PY" tools/demo/moe.py make "$OUT/moe-hf"
build/bin/smp-convert hf2smp --in "$OUT/moe-hf" --out "$OUT/moe-ckpt" --layout pp=2,tp=2
$MPI -np 4 build/bin/smp-train --ckpt "$OUT/moe-ckpt" --data "$OUT/train.bin" --save-dir "$OUT/moe" --layout pp=2,tp=2 \
    --steps 20 --batch 8 --microbatches 2 --seq 64 --lr 1e-2 --warmup 3 --seed 3 --log "$OUT/moe/log.jsonl"
build/bin/smp-merge --in "$OUT/moe" --out "$OUT/moe-export"
build/bin/smp-eval --ckpt "$OUT/moe" --data "$OUT/val.bin" --batch 4 --seq 64 --batches 2 --json | tee "$OUT/moe-eval.json"
"$PY" tools/demo/moe.py check "$OUT/moe-export" "$OUT/val.bin" "$OUT/moe-eval.json" "$OUT/moe/log.jsonl"
echo "demo: ok"
