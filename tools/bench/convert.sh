#!/usr/bin/env bash
# Conversion benchmark on a ~1.5 GB Llama-shaped bf16 model (not a test).
#
#   bash tools/bench/convert.sh [CACHE_DIR]      (default /tmp/smp-bench)
#
# The model is made once into CACHE_DIR/hf by tools/bench/make_model.py (size 1.5g:
# random normal bf16 weights under transformers' names, hidden 2048, intermediate 5632,
# 14 layers, vocab 32000, 16 heads, 4 kv heads: 762 M parameters, 1.52 GB), and reused
# by later runs.
# Page caches cannot be dropped here, so every command runs warm, after one warm-up
# read of the model. Side by side, like with like:
#   (a)  cp -r of the folder
#   (b)  smp-convert hf2smp --compress none --no-fsync --layout tp=2   target: <= 1.5 x (a)
#   (a') cp -r && sync: a durable copy
#   (b') smp-convert hf2smp --compress none --layout tp=2 (durable: fsyncs what it
#        writes, the default)                                          target: <= 1.5 x (a')
#   (c) smp-convert hf2smp (default zstd)  --layout tp=2
#   (d) a Python converter written the obvious way: safetensors.torch.load_file of the
#       whole model, slices for tp=2 as smp cuts them, h5py writes one file per rank
#   (e) peak RSS (/usr/bin/time -v) of every command             target: <= 256 MiB for smp
#   (f) zstd on these bf16 weights: checkpoint bytes / model bytes, and MB/s of (c)
#   (g) (b)'s checkpoint bytes / model bytes: what the format adds (HDF5's metadata, a
#       partial last chunk's padding)                             target: <= 1.01
#   (h) smp-convert init of the model's config.json (a new model of that shape, every
#       weight drawn), --compress none --no-fsync --layout tp=2, side by side with
#   (h') what users run instead: transformers' from_config (torch draws the weights, in
#       the config's dtype) and save_pretrained (no target: it shows what init costs)
# Environment: SMP_BENCH_REPEAT=N runs every command N times, in N rounds of all the
# commands one after another (so that a busy moment of a shared machine hits all of
# them), and keeps each command's fastest run (default 3), SMP_BENCH_MOE=1 (make_model.py's
# moe size instead, in CACHE_DIR/hf-moe: a Qwen3-MoE with Qwen3-30B-A3B's 18867 tensors,
# each small, 634 MB in all: what the per-tensor costs come to; SMP_BENCH_MOE=real: the
# moe-real size, in CACHE_DIR/hf-moe-real: 4 layers of Qwen3-30B-A3B at its real shapes, 6.2 GB),
# SMP_PY (python with torch, transformers, safetensors, h5py; default the oracle venv
# under ~/.cache/smp), SMP_BIN (default build/bin; built if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/bench/common.sh
. tools/bench/common.sh "$@"
if [ ! -x "$BIN/smp-convert" ]; then scons -Q -j"$(nproc)" >/dev/null; fi
mkdir -p "$CACHE"
SIZE=1.5g HF=$CACHE/hf OUT=$CACHE/out
if [ "${SMP_BENCH_MOE:-0}" = 1 ]; then SIZE=moe HF=$CACHE/hf-moe OUT=$CACHE/out-moe; fi
if [ "${SMP_BENCH_MOE:-0}" = real ]; then SIZE=moe-real HF=$CACHE/hf-moe-real OUT=$CACHE/out-moe-real; fi
rm -rf "$OUT"
mkdir -p "$OUT"

# ------------------------------------------------------------------- the model
if [ ! -f "$HF/.complete" ]; then
    echo "making the model in $HF (once) ..."
    rm -rf "$HF"
    "$PY" tools/bench/make_model.py "$HF" "$SIZE"
    touch "$HF/.complete"
fi
"$BIN/smp-inspect" "$HF" >/dev/null  # smp accepts the folder as a model
IN_BYTES=$(du -sb --exclude=.complete "$HF" | cut -f1)

# ------------------------------------------------- the obvious Python converter
NAIVE=$CACHE/naive_convert.py
cat >"$NAIVE" <<'EOF'
"""hf -> tp=2 shard files the obvious way: load everything, slice, write with h5py."""
import json, os, sys
import h5py, numpy as np, torch
from safetensors.torch import load_file
src, dst, T = sys.argv[1], sys.argv[2], 2
cfg = json.load(open(os.path.join(src, "config.json")))
sd = load_file(os.path.join(src, "model.safetensors"))          # the whole model in memory
os.makedirs(dst)
files = [h5py.File(os.path.join(dst, f"shard-{r:05d}.h5"), "w") for r in range(T)]
hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
for name, t in sd.items():
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight", "lm_head.weight")):
        dim = 0        # column-parallel (whole heads: the row counts are multiples of T*hd here), vocab-parallel
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        dim = 1        # row-parallel
    else:
        dim = None     # replicated: written once, by rank 0
    for r in range(T):
        if dim is None and r > 0:
            continue
        if dim is None:
            part, off = t, [0] * t.dim()
        else:
            n = (t.shape[dim] + T - 1) // T
            part = t.narrow(dim, r * n, min(n, t.shape[dim] - r * n))
            off = [0] * t.dim()
            off[dim] = r * n
        raw = part.contiguous().view(torch.int16).numpy().view(np.uint16)  # h5py has no bf16: its bits
        d = files[r].create_dataset(f"params/{name}", data=raw)
        d.attrs["tensor"], d.attrs["dtype"] = name, "BF16"
        d.attrs["offset"], d.attrs["global_shape"] = np.array(off, np.int64), np.array(list(t.shape), np.int64)
for f in files:
    f.close()
EOF

# ------------------------------------------- a new model the way users make one
FRESH=$CACHE/fresh_model.py
cat >"$FRESH" <<'EOF'
"""a new model of a config's shape: transformers' from_config, then save_pretrained."""
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[3]))
cfg = AutoConfig.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype or torch.float32).save_pretrained(sys.argv[2])
EOF

# ------------------------------------------------------------------- measuring
calc() { awk "BEGIN { print $* }"; }
TMPT=$(mktemp)
trap 'rm -f "$TMPT"' EXIT
declare -A T RSS BYTES
# measure KEY OUTPATH CMD...: wall seconds, peak RSS (KiB) and bytes written of one run;
# the fastest run of a key counts, and the largest RSS. The output is removed after
# each run (and everything synced before the next), so that runs do not see each
# other's dirty pages.
REPEAT=${SMP_BENCH_REPEAT:-3}
measure() {
    local key=$1 outp=$2; shift 2
    local t0 t1 dt rss
    rm -rf "$outp"; sync
    t0=$(date +%s.%N)
    if ! /usr/bin/time -v -o "$TMPT" "$@" >/dev/null 2>"$OUT/$key.log"; then
        echo "FAILED: $*"; cat "$OUT/$key.log"; exit 1
    fi
    t1=$(date +%s.%N)
    dt=$(calc "$t1 - $t0")
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$TMPT")
    if [ -z "${T[$key]:-}" ] || [ "$(calc "($dt < ${T[$key]})")" = 1 ]; then T[$key]=$dt; fi
    if [ -z "${RSS[$key]:-}" ] || [ "$rss" -gt "${RSS[$key]}" ]; then RSS[$key]=$rss; fi
    BYTES[$key]=$(du -sb "$outp" | cut -f1)
    if [ "$round" = 1 ]; then  # the outputs are whole checkpoints (once: verifying takes a while)
        case $key in none|durable|zstd|init) "$BIN/smp-verify" "$outp" >/dev/null || { echo "FAILED: smp-verify $outp"; exit 1; } ;; esac
    fi
    rm -rf "$outp"; sync
    printf "  %-8s %7.2f s   peak RSS %8.1f MiB\n" "$key" "$dt" "$(calc "$rss / 1024")"
}

echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, load average $(cut -d' ' -f1-3 /proc/loadavg), $(df -h "$CACHE" | awk 'NR==2 {print $1}')"
echo "model: $HF, $(numfmt --to=iec "$IN_BYTES") ($IN_BYTES bytes), bf16"
echo "warm-up read ..."
cat "$HF"/* >/dev/null
sync

SMP=("$BIN/smp-convert" hf2smp --in "$HF" --layout tp=2)
for ((round = 1; round <= REPEAT; round++)); do
    echo "round $round of $REPEAT (warm):"
    measure cp "$OUT/cp" cp -r "$HF" "$OUT/cp"
    measure none "$OUT/none" "${SMP[@]}" --out "$OUT/none" --compress none --no-fsync
    measure cp+sync "$OUT/cps" bash -c "cp -r '$HF' '$OUT/cps' && sync"
    measure durable "$OUT/durable" "${SMP[@]}" --out "$OUT/durable" --compress none
    measure zstd "$OUT/zstd" "${SMP[@]}" --out "$OUT/zstd"
    measure python "$OUT/py" "$PY" "$NAIVE" "$HF" "$OUT/py"
    measure init "$OUT/init" "$BIN/smp-convert" init --config "$HF/config.json" --out "$OUT/init" --layout tp=2 \
        --compress none --no-fsync
    measure torch-init "$OUT/tinit" "$PY" "$FRESH" "$HF" "$OUT/tinit" "$(nproc)"
done

# ------------------------------------------------------------------- the table
mib() { calc "${RSS[$1]} / 1024"; }
ratio() { calc "${T[$1]} / ${T[${2:-cp}]}"; }
mbs() { calc "$IN_BYTES / ${T[$1]} / 1000000"; }
verdict() { if [ "$(calc "($1 <= $2)")" = 1 ]; then echo "ok"; else echo "MISSED"; fi; }
echo
echo "load average after the runs: $(cut -d' ' -f1-3 /proc/loadavg) (other processes share these cores: see ps)"
printf "%-44s %9s %9s %9s %11s %9s\n" "command (model $(numfmt --to=iec "$IN_BYTES"), tp=2)" "seconds" "x cp" "MB/s" "peak RSS" "out/in"
row() {  # key label
    printf "%-44s %9.2f %9.2f %9.0f %7.0f MiB %9.3f\n" "$2" "${T[$1]}" "$(ratio "$1")" "$(mbs "$1")" "$(mib "$1")" \
        "$(calc "${BYTES[$1]} / $IN_BYTES")"
}
row cp "(a)  cp -r"
row none "(b)  smp-convert --compress none --no-fsync"
row cp+sync "(a') cp -r && sync"
row durable "(b') smp-convert --compress none (durable)"
row zstd "(c)  smp-convert (zstd, default level)"
row python "(d)  python: load_file + slice + h5py"
row init "(h)  smp-convert init (none, no fsync)"
row torch-init "(h') torch: from_config + save_pretrained"
echo
echo "targets (like with like; fastest of $REPEAT runs each):"
printf "  (b)  --compress none --no-fsync <= 1.5 x cp -r:             %.2f x   %s\n" \
    "$(ratio none)" "$(verdict "$(ratio none)" 1.5)"
printf "  (b') --compress none, durable   <= 1.5 x cp -r && sync:     %.2f x   %s\n" \
    "$(ratio durable cp+sync)" "$(verdict "$(ratio durable cp+sync)" 1.5)"
big=$(calc "($(mib none) > $(mib durable) ? $(mib none) : $(mib durable))")
big=$(calc "($big > $(mib zstd) ? $big : $(mib zstd))")
printf "  (e)  smp-convert peak RSS <= 256 MiB:  none %.0f MiB, durable %.0f MiB, zstd %.0f MiB   %s\n" \
    "$(mib none)" "$(mib durable)" "$(mib zstd)" "$(verdict "$big" 256)"
printf "  (g)  --compress none checkpoint/model bytes <= 1.01:          %.3f     %s\n" \
    "$(calc "${BYTES[none]} / $IN_BYTES")" "$(verdict "$(calc "${BYTES[none]} / $IN_BYTES")" 1.01)"
printf "  (d)  python converter: %.2f s (%.2f x smp --compress none --no-fsync), peak RSS %.0f MiB\n" "${T[python]}" \
    "$(calc "${T[python]} / ${T[none]}")" "$(mib python)"
printf "  (h)  smp-convert init: %.2f s, %.2f x transformers from_config + save_pretrained (%.2f s)\n" "${T[init]}" \
    "$(calc "${T[init]} / ${T[torch-init]}")" "${T[torch-init]}"
printf "  (f)  zstd on bf16 weights: checkpoint/model = %.3f (%s of %s), %.0f MB/s of model converted\n" \
    "$(calc "${BYTES[zstd]} / $IN_BYTES")" "$(numfmt --to=iec "${BYTES[zstd]}")" "$(numfmt --to=iec "$IN_BYTES")" "$(mbs zstd)"
