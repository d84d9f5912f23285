#!/usr/bin/env bash
# Checkpoint READ benchmark on a ~1.5 GB Llama-shaped bf16 model (not a test).
#
#   bash tools/bench/read.sh [CACHE_DIR]      (default /tmp/smp-bench)
#
# The model is the one of tools/bench/convert.sh, made once into CACHE_DIR/hf by
# tools/bench/make_model.py (size 1.5g: random normal bf16 weights under transformers'
# names, hidden 2048, intermediate 5632, 14 layers, vocab 32000, 16 heads, 4 kv heads:
# 762 M parameters, 1.52 GB), so that both scripts share it. SMP_BENCH_SMALL=1 uses its
# small size instead (~21 M parameters, 42 MB, in CACHE_DIR/hf-small): a smoke test in
# a minute. SMP_BENCH_8B=1: its 8b size (below).
#
# Set-up, not timed: two checkpoints of the model, `smp-convert hf2smp --layout
# pp=2,tp=2 --no-fsync`, CK_NONE (--compress none) and CK_ZSTD (the default zstd), and
# a token file of 4096 random uint16 tokens < vocab in llm.c's format (header of 256
# int32: magic 20240520, version 1, count). Page caches cannot be dropped here, so
# every command runs warm, after one warm-up read of both checkpoints. Side by side,
# like with like (every reshard writes --compress none, so that its output costs what
# cp's does and the rows measure reading):
#   (a)  cp -r CK_NONE: the physical anchor ("x cp" in the table)
#   (a') cp -r CK_NONE && sync: a durable copy
#   (b)  smp-convert reshard --in CK_NONE --layout tp=4 --compress none --no-fsync
#                                                                  target: <= 1.5 x (a)
#   (b') the same, durable (no --no-fsync)                         target: <= 1.2 x (a')
#   (c)  smp-merge --in CK_NONE --no-fsync                         target: <= 1.5 x (a)
#   (c') smp-merge, durable                                        target: <= 1.2 x (a')
#   (d)  smp-verify CK_NONE                                        target: <= 1.0 x (a)
#   (e)  smp-eval --ckpt CK_NONE, one batch of 1 x 16 tokens: the whole command, and
#        the load time it prints on stderr (rank 0, after the load:
#        "smp-eval: loaded <dir>: <bytes> bytes in <seconds> s (<GB/s> GB/s)"; an older
#        binary without that line: the whole command, said so)  target: load <= 1.5 x (a)
#   (f)  mpirun -np 8 smp-eval --layout tp=4,dp=2 (8 ranks, a layout other than the
#        stored pp=2,tp=2; one batch of 2 x 16 tokens): the largest load time printed
#        over the ranks, and the whole command (skipped, said so, when smp-eval has no
#        --layout)                                                 target: load <= 1.5 x (a)
#   (f'') (f) with --read-together yes (each chunk read once by one rank, an all-to-all
#        hands the ranks their parts; when smp-eval has it): its load and the bytes the
#        ranks read, beside (f)'s
#   (f''') (f) with --share-weights no (each rank keeps its own copy of its weights, as
#        before smp-eval shared them; when smp-eval has the option): its load and bytes
#   (f') the physical anchor of (f): 8 processes (mpirun, as (f)) each writing, for the
#        first time, as many bytes of fresh memory as its rank allocates for the fp32
#        weights: the model's fp32 bytes / 8 when smp-eval shares them between the ranks
#        of a host that hold the same pieces (the model once, split over the ranks), else
#        / (tp x pp) of the layout (each rank its own pieces): the largest time printed
#   (g)  (b), (c), (d), (e) on CK_ZSTD                 target: <= 2.0 x the CK_NONE run
#   (h)  a Python merge written the obvious way (h5py + hdf5plugin + numpy: read every
#        piece of every shard file, place it by its `offset`/`global_shape` attributes,
#        bf16 kept as its U16 bits; safetensors.numpy.save_file), on CK_NONE and CK_ZSTD
#   (e') the physical anchor of (e): a process writing, for the first time, as many
#        bytes of fresh memory as (e)'s fp32 weights (2 x the checkpoint's bf16 data;
#        Python: one bytes object, the time it prints). A load cannot be faster than its
#        destination's first touch; on a VM the host's backing of guest memory makes
#        that touch cost from 0.3 to several seconds per GB, varying from run to run,
#        and the second of two runs reuses memory the first just freed before the host
#        takes it back: (e) and (e'), (f) and (f') take turns running first (the load in
#        odd rounds, the anchor in even ones), and each runs right after an unmeasured
#        run of its anchor, so both meet the host in one state (without that, whichever
#        ran first paid for it: (f)'s load 2.7-5.7 s against 1.5 s by hand, 2026-12-04)
#   (h') what a user would do for (e)'s fp32 weights: torch loads the model's safetensors
#        (safetensors.torch.load_file) and converts to float32; the load time it prints
#   (i)  peak RSS (/usr/bin/time -v; under mpirun the largest process) of every command
#                                           target: <= 256 MiB for reshard, merge, verify
# Checked once (round 1, not timed): smp-verify of every reshard output; the tensors
# of smp-merge (durable, zstd) and of both Python merges are byte for byte those of
# smp-merge --no-fsync of CK_NONE (names, shapes, bytes; Python's bf16 are U16).
# The binaries are copied once, at start, out of SMP_BIN (and its ../lib) and run from
# the copy, so a rebuild of the tree during the run changes nothing; when some are
# missing (a rebuild in progress) the script waits for them, up to 5 minutes.
# Environment: SMP_BENCH_REPEAT=N runs every command N times, in N rounds of all the
# commands one after another (so that a busy moment of a shared machine hits all of
# them), and reports each command's median run (default 3) and its largest RSS,
# SMP_BENCH_SMALL=1 (the small model above), SMP_BENCH_8B=1 (an 8B-shaped model instead:
# Llama-3-8B's shapes, hidden 4096, intermediate 14336, 32 layers, vocab 128256, 32
# heads, 8 kv heads: 8.0 G parameters, 16 GB of bf16, in CACHE_DIR/hf-8b; (e), (f) and
# (h) are skipped there: they would hold the model in fp32, or whole, in memory; it needs
# ~62 GB of disk, checked at start), SMP_BENCH_MOE=1 (make_model.py's moe size instead: a
# Qwen3-MoE with Qwen3-30B-A3B's 18867 tensors, each small, 634 MB in all, in
# CACHE_DIR/hf-moe: what a checkpoint's per-tensor and per-piece costs come to),
# SMP_BENCH_MOE=real (make_model.py's moe-real size: 4 of Qwen3-30B-A3B's layers at its real
# shapes, 6.2 GB, in CACHE_DIR/hf-moe-real; (e), (f) and (h) skipped as for the 8B shape;
# ~28 GB of disk),
# SMP_BENCH_EVAL_LAYOUT (the layout of (f), 8 ranks; default tp=4,dp=2), SMP_PY (python with torch, transformers,
# safetensors, h5py, hdf5plugin; default the oracle venv under ~/.cache/smp), SMP_BIN
# (default build/bin; not built here: build it first).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/bench/common.sh
. tools/bench/common.sh "$@"
SMALL=${SMP_BENCH_SMALL:-0}
BIG=${SMP_BENCH_8B:-0}
MOE=${SMP_BENCH_MOE:-0}
# BIG: a model whose fp32 weights (e, f) or whole tensors (h) would not fit in memory
if [ "$MOE" = real ]; then BIG=1; fi
EVAL_LAYOUT=${SMP_BENCH_EVAL_LAYOUT:-tp=4,dp=2}
REPEAT=${SMP_BENCH_REPEAT:-3}
# the ranks that split one replica of the weights in (f): tp x pp of its layout (8, all
# of them, when smp-eval shares the weights of a host: set below)
EVAL_SPLIT=$(tr ',' '\n' <<<"$EVAL_LAYOUT" | awk -F= '$1 == "tp" || $1 == "pp" { n *= $2 } BEGIN { n = 1 } END { print n }')
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
if [ "$SMALL" = 1 ]; then SIZE=small
elif [ "$MOE" = real ]; then SIZE=moe-real
elif [ "$BIG" = 1 ]; then SIZE=8b
elif [ "$MOE" = 1 ]; then SIZE=moe
else SIZE=1.5g; fi
HF=$CACHE/hf-$SIZE; OUT=$CACHE/out-read-$SIZE
case $SIZE in 1.5g) HF=$CACHE/hf; OUT=$CACHE/out-read ;; esac
rm -rf "$OUT"
mkdir -p "$OUT"
# the disk the run needs, the model's folder included: 4 copies of the model's bytes
# (model, CK_NONE, CK_ZSTD ~0.7, an output), checked before anything is written (an 8B
# run once filled a disk after its first rows, when round 1's merge was kept whole)
NEED=$(case $SIZE in small) echo 1 ;; 8b) echo 62 ;; moe-real) echo 28 ;; *) echo 7 ;; esac)
HAVE=$(( ($(df -B1 --output=avail "$CACHE" | tail -1) + $(du -sb "$HF" 2>/dev/null | cut -f1 || echo 0)) >> 30 ))
if [ "$HAVE" -lt "$NEED" ]; then
    echo "read.sh: $CACHE has ${HAVE} GB for the run (its model folder included), it needs ~$NEED GB"; exit 1
fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# ------------------------------------------------------------------- the binaries
SNAP=$OUT/smp   # smp/bin (RUNPATH $ORIGIN/../lib finds smp/lib)
CMDS=(smp-convert smp-merge smp-verify smp-eval smp-inspect)
for ((try = 1; ; try++)); do
    ok=1
    rm -rf "$SNAP"; mkdir -p "$SNAP/bin" "$SNAP/lib"
    for c in "${CMDS[@]}"; do cp "$BIN/$c" "$SNAP/bin/" 2>/dev/null || ok=0; done
    if [ -d "$BIN/../lib" ]; then cp "$BIN"/../lib/*.so "$SNAP/lib/" 2>/dev/null || ok=0; fi
    if [ "$ok" = 1 ]; then
        for c in "${CMDS[@]}"; do "$SNAP/bin/$c" --version >/dev/null 2>&1 || ok=0; done
    fi
    if [ "$ok" = 1 ]; then break; fi
    if [ "$try" -ge 30 ]; then echo "FAILED: the smp commands in $BIN are missing or do not run (build them: scons -j2)"; exit 1; fi
    echo "  waiting for $BIN (being rebuilt?) ..."; sleep 10
done
BIN=$SNAP/bin

# ------------------------------------------------------------------- the model
if [ ! -f "$HF/.complete" ]; then
    echo "making the model in $HF (once) ..."
    rm -rf "$HF"
    "$PY" tools/bench/make_model.py "$HF" "$SIZE"
    touch "$HF/.complete"
fi
"$BIN/smp-inspect" "$HF" >/dev/null  # smp accepts the folder as a model
MODEL_BYTES=$(du -sb --exclude=.complete "$HF" | cut -f1)

# ------------------------------------------- the checkpoints and the tokens (not timed)
CKN=$OUT/ck-none
CKZ=$OUT/ck-zstd
TOK=$OUT/tokens.bin
echo "making the checkpoints (hf2smp --layout pp=2,tp=2 --no-fsync: --compress none, zstd) ..."
"$BIN/smp-convert" hf2smp --in "$HF" --out "$CKN" --layout pp=2,tp=2 --compress none --no-fsync >/dev/null
"$BIN/smp-convert" hf2smp --in "$HF" --out "$CKZ" --layout pp=2,tp=2 --no-fsync >/dev/null
"$PY" - "$HF/config.json" "$TOK" <<'EOF'
import json, sys
import numpy as np
vocab = json.load(open(sys.argv[1]))["vocab_size"]
toks = np.random.default_rng(0).integers(0, min(vocab, 65536), size=4096).astype("<u2")
header = np.zeros(256, "<i4")
header[:3] = 20240520, 1, len(toks)  # llm.c's uint16 token files (train/data.c)
with open(sys.argv[2], "wb") as f:
    f.write(header.tobytes())
    f.write(toks.tobytes())
EOF
sync
CKN_BYTES=$(du -sb "$CKN" | cut -f1)
CKZ_BYTES=$(du -sb "$CKZ" | cut -f1)

# ---------------------------------------------------- the obvious Python merge
NAIVE=$OUT/naive_merge.py
cat >"$NAIVE" <<'EOF'
"""SMP checkpoint -> model.safetensors the obvious way: h5py reads every piece, numpy assembles."""
import glob, os, sys
import h5py, hdf5plugin, numpy as np  # noqa: F401 (hdf5plugin: the zstd filter)
from safetensors.numpy import save_file
src, dst = sys.argv[1], sys.argv[2]
tensors = {}
def place(_, d):
    if not isinstance(d, h5py.Dataset):
        return
    name = d.attrs["tensor"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    off = [int(x) for x in d.attrs["offset"]]
    gshape = tuple(int(x) for x in d.attrs["global_shape"])
    data = d[()]                                  # bf16 comes as its U16 bits: kept as is
    if name not in tensors:
        tensors[name] = np.empty(gshape, data.dtype)
    tensors[name][tuple(slice(o, o + n) for o, n in zip(off, data.shape))] = data
for path in sorted(glob.glob(os.path.join(src, "shard-*.h5"))):
    with h5py.File(path, "r") as f:
        if "params" in f:
            f["params"].visititems(place)
os.makedirs(dst)
save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
EOF
# what a user would do to get the same fp32 weights: torch loads the model's safetensors
# and converts to float32 (the load time it prints, after importing torch)
TORCHLOAD='
import sys, time, torch
from safetensors.torch import load_file
t0 = time.time()
sd = {k: v.float() for k, v in load_file(sys.argv[1]).items()}
n = sum(v.numel() for v in sd.values())
print(f"torch {torch.__version__}: loaded {sys.argv[1]}: {2 * n} bytes in {time.time() - t0:.3f} s", file=sys.stderr)
'
# (e'): the first touch of N bytes of fresh memory, printed like a load line
TOUCH='
import sys, time
t0 = time.time()
b = b"\x01" * int(sys.argv[1])  # malloc + memset: every page written once
print(f"loaded fresh memory: {len(b)} bytes in {time.time() - t0:.3f} s", file=sys.stderr)
'
SAME=$OUT/same_tensors.py
cat >"$SAME" <<'EOF'
"""same_tensors.py --digest FOLDER OUT: each tensor of FOLDER's safetensors files (name, element width,
shape, BLAKE2b of its bytes) into OUT; same_tensors.py DIGEST FOLDER: FOLDER holds those tensors, byte for
byte. (A digest, not a kept folder: the 16 GB run would need another 16 GB of disk for it.)"""
import glob, hashlib, json, mmap, os, struct, sys
WIDTH = {"BF16": 2, "F16": 2, "U16": 2, "I16": 2, "F32": 4, "U32": 4, "I32": 4, "F64": 8, "U64": 8, "I64": 8,
         "U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
def tensors(folder):
    out = {}
    for p in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            n = struct.unpack("<Q", mm[:8])[0]
            view = memoryview(mm)
            for k, v in json.loads(mm[8:8 + n]).items():
                if k != "__metadata__":
                    a, b = v["data_offsets"]
                    h = hashlib.blake2b(view[8 + n + a:8 + n + b], digest_size=16).hexdigest()
                    out[k] = [WIDTH[v["dtype"]], list(v["shape"]), h]
            view.release()
    return out
if sys.argv[1] == "--digest":
    json.dump(tensors(sys.argv[2]), open(sys.argv[3], "w"))
    sys.exit(0)
A, B = json.load(open(sys.argv[1])), tensors(sys.argv[2])
if sorted(A) != sorted(B):
    sys.exit(f"different tensors: {sorted(set(A) ^ set(B))[:5]}")
for k in A:
    if A[k] != B[k]:
        sys.exit(f"{k}: differs ({A[k][0]}-byte {A[k][1]} vs {B[k][0]}-byte {B[k][1]})")
EOF

# ------------------------------------------------------------------- measuring
calc() { awk "BEGIN { print $* }"; }
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
TMPT=$(mktemp)
trap 'rm -f "$TMPT"' EXIT
KEEP=$OUT/keep-merge.json   # round 1: the tensors of smp-merge --no-fsync of CK_NONE, the checks' reference
declare -A TS LS RSS NLOAD T LT
fail() { echo "FAILED: $*"; exit 1; }
# check KEY OUTPATH: round 1 only, not timed
check() {
    case $1 in
        rs|rs-d|rs-z) "$BIN/smp-verify" "$2" >/dev/null || fail "smp-verify $2 (the output of $1)" ;;
        mg) "$PY" "$SAME" --digest "$2" "$KEEP" ;;
        mg-d|mg-z|py|py-z) "$PY" "$SAME" "$KEEP" "$2" || fail "$1: not the tensors of smp-merge of CK_NONE" ;;
    esac
}
# measure KEY OUTPATH|- CMD...: wall seconds and peak RSS (KiB) of one run, and the
# largest load time any rank printed ("loaded DIR: N bytes in S s"); the median of a
# key's runs counts, and its largest RSS. The output is removed after each run (and
# everything synced before the next), so that runs do not see each other's dirty pages.
measure() {
    local key=$1 outp=$2; shift 2
    local t0 t1 dt rss lt n
    if [ "$outp" != - ]; then rm -rf "$outp"; fi
    sync
    t0=$(date +%s.%N)
    if ! /usr/bin/time -v -o "$TMPT" "$@" >"$OUT/$key.out" 2>"$OUT/$key.log"; then
        echo "FAILED: $*"; cat "$OUT/$key.log"; cat "$OUT/$key.out"; exit 1
    fi
    t1=$(date +%s.%N)
    dt=$(calc "$t1 - $t0")
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$TMPT")
    TS[$key]="${TS[$key]:-} $dt"
    if [ -z "${RSS[$key]:-}" ] || [ "$rss" -gt "${RSS[$key]}" ]; then RSS[$key]=$rss; fi
    lt=$( (grep -oE 'loaded .*: [0-9]+ bytes in [0-9.]+ s' "$OUT/$key.log" || true) |
        sed -E 's/.*: [0-9]+ bytes in ([0-9.]+) s$/\1/' | sort -g | tail -1)
    n=$( (grep -cE 'loaded .*: [0-9]+ bytes in [0-9.]+ s' "$OUT/$key.log" || true) | head -1)
    NLOAD[$key]=${n:-0}
    if [ -n "$lt" ]; then LS[$key]="${LS[$key]:-} $lt"; fi
    if [ "$round" = 1 ] && [ "$outp" != - ]; then check "$key" "$outp"; fi
    if [ "$outp" != - ]; then rm -rf "$outp"; fi
    sync
    printf "  %-6s %7.2f s%s   peak RSS %8.1f MiB\n" "$key" "$dt" "${lt:+   (load $lt s)}" "$(calc "$rss / 1024")"
}

# pair ROUND KEY1 CMD1... -- KEY2 CMD2...: both measured (no output folder), KEY1 first in
# odd rounds, KEY2 first in even ones, each right after an unmeasured run of CMD2 (the
# anchor: a first touch of as much fresh memory), so that both meet the host in the same
# state (the one run first otherwise pays the host's backing of the memory: 1-4 s here)
PRIME=()
prime() { if [ ${#PRIME[@]} -gt 0 ]; then "${PRIME[@]}" >/dev/null 2>&1 || true; fi; }
pair() {
    local round=$1 k1=$2 k2; shift 2
    local a=() b=()
    while [ "$1" != -- ]; do a+=("$1"); shift; done
    shift; k2=$1; shift; b=("$@")
    PRIME=("${b[@]}")
    if [ $((round % 2)) = 1 ]; then prime; measure "$k1" - "${a[@]}"; prime; measure "$k2" - "${b[@]}"
    else prime; measure "$k2" - "${b[@]}"; prime; measure "$k1" - "${a[@]}"; fi
}

HAVE_LAYOUT=0 HAVE_TOGETHER=0 HAVE_SHARE=0
if "$BIN/smp-eval" --help 2>&1 | grep -q -- '--layout'; then HAVE_LAYOUT=1; fi
if "$BIN/smp-eval" --help 2>&1 | grep -q -- '--read-together'; then HAVE_TOGETHER=1; fi
if "$BIN/smp-eval" --help 2>&1 | grep -q -- '--share-weights'; then HAVE_SHARE=1; EVAL_SPLIT=8; fi
echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, load average $(cut -d' ' -f1-3 /proc/loadavg), $(df -h "$CACHE" | awk 'NR==2 {print $1}')"
damon_note
echo "model: $HF, $(numfmt --to=iec "$MODEL_BYTES") ($MODEL_BYTES bytes), bf16; binaries: $("$BIN/smp-convert" --version 2>&1 | head -1)"
echo "CK_NONE: $(numfmt --to=iec "$CKN_BYTES") ($CKN_BYTES bytes); CK_ZSTD: $(numfmt --to=iec "$CKZ_BYTES") ($CKZ_BYTES bytes); pp=2,tp=2"
echo "warm-up read ..."
find "$CKN" "$CKZ" -type f -exec cat {} + >/dev/null
sync

EVAL=(--data "$TOK" --batch 1 --seq 16 --batches 1)
MPI=(mpirun -np 8 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
for ((round = 1; round <= REPEAT; round++)); do
    echo "round $round of $REPEAT (warm):"
    measure cp "$OUT/x" cp -r "$CKN" "$OUT/x"
    measure rs "$OUT/x" "$BIN/smp-convert" reshard --in "$CKN" --out "$OUT/x" --layout tp=4 --compress none --no-fsync
    measure mg "$OUT/x" "$BIN/smp-merge" --in "$CKN" --out "$OUT/x" --no-fsync
    measure vf - "$BIN/smp-verify" "$CKN"
    # a load and its anchor, in turns first, each after a run of the anchor (see (e') above)
    if [ "$BIG" = 0 ]; then
        pair "$round" ev "$BIN/smp-eval" --ckpt "$CKN" "${EVAL[@]}" -- mem "$PY" -c "$TOUCH" "$((2 * MODEL_BYTES))"
    fi
    if [ "$HAVE_LAYOUT" = 1 ] && [ "$BIG" = 0 ]; then
        pair "$round" evp "${MPI[@]}" "$BIN/smp-eval" --layout "$EVAL_LAYOUT" --ckpt "$CKN" --data "$TOK" --batch 2 --seq 16 \
            --batches 1 -- memp "${MPI[@]}" "$PY" -c "$TOUCH" "$((2 * MODEL_BYTES / EVAL_SPLIT))"
        if [ "$HAVE_TOGETHER" = 1 ]; then
            prime # the anchor of (f), as before (f) itself
            measure evt - "${MPI[@]}" "$BIN/smp-eval" --layout "$EVAL_LAYOUT" --read-together yes --ckpt "$CKN" --data "$TOK" \
                --batch 2 --seq 16 --batches 1
        fi
        if [ "$HAVE_SHARE" = 1 ]; then
            prime
            measure evn - "${MPI[@]}" "$BIN/smp-eval" --layout "$EVAL_LAYOUT" --share-weights no --ckpt "$CKN" --data "$TOK" \
                --batch 2 --seq 16 --batches 1
        fi
    fi
    measure cps "$OUT/x" bash -c "cp -r '$CKN' '$OUT/x' && sync"
    measure rs-d "$OUT/x" "$BIN/smp-convert" reshard --in "$CKN" --out "$OUT/x" --layout tp=4 --compress none
    measure mg-d "$OUT/x" "$BIN/smp-merge" --in "$CKN" --out "$OUT/x"
    measure rs-z "$OUT/x" "$BIN/smp-convert" reshard --in "$CKZ" --out "$OUT/x" --layout tp=4 --compress none --no-fsync
    measure mg-z "$OUT/x" "$BIN/smp-merge" --in "$CKZ" --out "$OUT/x" --no-fsync
    measure vf-z - "$BIN/smp-verify" "$CKZ"
    if [ "$BIG" = 0 ]; then
        PRIME=("$PY" -c "$TOUCH" "$((2 * MODEL_BYTES))")
        prime # as before (e), which it is compared with
        measure ev-z - "$BIN/smp-eval" --ckpt "$CKZ" "${EVAL[@]}"
        prime # (h'), torch's load, is compared with (e) too
        measure tl - "$PY" -c "$TORCHLOAD" "$HF/model.safetensors"
        measure py "$OUT/x" "$PY" "$NAIVE" "$CKN" "$OUT/x"
        measure py-z "$OUT/x" "$PY" "$NAIVE" "$CKZ" "$OUT/x"
    fi
    if [ "$round" = 1 ]; then
        rm -f "$KEEP"
        echo "  checked: smp-verify of the 3 reshard outputs; smp-merge (durable, zstd)$(if [ "$BIG" = 0 ]; then echo " and both Python merges"; fi) give the tensors of smp-merge of CK_NONE"
    fi
done

# ------------------------------------------------------------------- the table
for k in "${!TS[@]}"; do T[$k]=$(median "${TS[$k]}"); done
for k in "${!LS[@]}"; do LT[$k]=$(median "${LS[$k]}"); done
# the load time of an eval key, or its whole command where the binary prints none
load() { echo "${LT[$1]:-${T[$1]}}"; }
loadnote() { if [ -n "${LT[$1]:-}" ]; then echo ""; else echo "   (no load line: whole command)"; fi; }
mib() { calc "${RSS[$1]} / 1024"; }
readbytes() { grep -oE 'loaded .*: [0-9]+ bytes' "$OUT/$1.log" | tail -1 | sed -E 's/.*: ([0-9]+) bytes/\1/'; }
verdict() { if [ "$(calc "($1 <= $2)")" = 1 ]; then echo "ok"; else echo "MISSED"; fi; }
echo
echo "load average after the runs: $(cut -d' ' -f1-3 /proc/loadavg) (other processes share these cores: see ps)"
printf "%-52s %8s %7s %8s %10s  %s\n" "command (checkpoint pp=2,tp=2, $(numfmt --to=iec "$CKN_BYTES"))" "seconds" "x cp" "MB/s" "peak RSS" "like with like"
row() {  # label seconds ckpt_bytes rss_key like
    printf "%-52s %8.2f %7.2f %8.0f %6.0f MiB  %s\n" "$1" "$2" "$(calc "$2 / ${T[cp]}")" "$(calc "$3 / $2 / 1000000")" \
        "$(mib "$4")" "${5:-}"
}
like() { printf "%.2f x %s" "$(calc "$1 / $2")" "$3"; }
row "(a)  cp -r CK_NONE" "${T[cp]}" "$CKN_BYTES" cp
row "(b)  reshard tp=4 --no-fsync" "${T[rs]}" "$CKN_BYTES" rs "$(like "${T[rs]}" "${T[cp]}" "(a)")"
row "(c)  smp-merge --no-fsync" "${T[mg]}" "$CKN_BYTES" mg "$(like "${T[mg]}" "${T[cp]}" "(a)")"
row "(d)  smp-verify" "${T[vf]}" "$CKN_BYTES" vf "$(like "${T[vf]}" "${T[cp]}" "(a)")"
if [ "$BIG" = 0 ]; then
row "(e)  smp-eval, whole command" "${T[ev]}" "$CKN_BYTES" ev
row "(e)  smp-eval, load$(if [ -z "${LT[ev]:-}" ]; then echo " (no line: whole)"; fi)" "$(load ev)" "$CKN_BYTES" ev \
    "$(like "$(load ev)" "${T[cp]}" "(a)")"
row "(e') first touch of (e)'s fp32 bytes, fresh memory" "$(load mem)" "$CKN_BYTES" mem \
    "$(like "$(load ev)" "$(load mem)" "(e) load / (e')")"
fi
if [ "$HAVE_LAYOUT" = 1 ] && [ "$BIG" = 0 ]; then
    row "(f)  mpirun -np 8 smp-eval $EVAL_LAYOUT, whole" "${T[evp]}" "$CKN_BYTES" evp
    row "(f)  ... load, largest of ${NLOAD[evp]} rank line(s)$(if [ -z "${LT[evp]:-}" ]; then echo " (none: whole)"; fi)" \
        "$(load evp)" "$CKN_BYTES" evp "$(like "$(load evp)" "${T[cp]}" "(a)")"
    row "(f') 8 ranks' first touch of their fp32 bytes" "$(load memp)" "$CKN_BYTES" memp \
        "$(like "$(load evp)" "$(load memp)" "(f) load / (f')")"
    if [ "$HAVE_TOGETHER" = 1 ]; then
        row "(f'') (f) with --read-together yes, load" "$(load evt)" "$CKN_BYTES" evt "$(like "$(load evt)" "$(load evp)" "(f) load")"
        echo "       bytes read by the 8 ranks: (f) $(readbytes evp), (f'') $(readbytes evt) (the checkpoint: $CKN_BYTES)"
    fi
    if [ "$HAVE_SHARE" = 1 ]; then
        row "(f''') (f) with --share-weights no, load" "$(load evn)" "$CKN_BYTES" evn "$(like "$(load evn)" "$(load evp)" "(f) load")"
        echo "       bytes read by the 8 ranks: (f) $(readbytes evp), (f''') $(readbytes evn)"
    fi
fi
row "(a') cp -r CK_NONE && sync" "${T[cps]}" "$CKN_BYTES" cps
row "(b') reshard tp=4, durable" "${T[rs-d]}" "$CKN_BYTES" rs-d "$(like "${T[rs-d]}" "${T[cps]}" "(a')")"
row "(c') smp-merge, durable" "${T[mg-d]}" "$CKN_BYTES" mg-d "$(like "${T[mg-d]}" "${T[cps]}" "(a')")"
row "(g)  CK_ZSTD reshard tp=4 --no-fsync" "${T[rs-z]}" "$CKZ_BYTES" rs-z "$(like "${T[rs-z]}" "${T[rs]}" "(b)")"
row "(g)  CK_ZSTD smp-merge --no-fsync" "${T[mg-z]}" "$CKZ_BYTES" mg-z "$(like "${T[mg-z]}" "${T[mg]}" "(c)")"
row "(g)  CK_ZSTD smp-verify" "${T[vf-z]}" "$CKZ_BYTES" vf-z "$(like "${T[vf-z]}" "${T[vf]}" "(d)")"
if [ "$BIG" = 0 ]; then
row "(g)  CK_ZSTD smp-eval, whole command" "${T[ev-z]}" "$CKZ_BYTES" ev-z "$(like "${T[ev-z]}" "${T[ev]}" "(e) whole")"
row "(g)  CK_ZSTD smp-eval, load$(if [ -z "${LT[ev-z]:-}" ]; then echo " (no line: whole)"; fi)" "$(load ev-z)" "$CKZ_BYTES" ev-z \
    "$(like "$(load ev-z)" "$(load ev)" "(e) load")"
row "(h)  python merge (h5py + numpy), CK_NONE" "${T[py]}" "$CKN_BYTES" py "$(like "${T[py]}" "${T[mg]}" "(c)")"
row "(h)  python merge (h5py + numpy), CK_ZSTD" "${T[py-z]}" "$CKZ_BYTES" py-z "$(like "${T[py-z]}" "${T[mg-z]}" "(g) merge")"
row "(h') torch: load_file + float() of the model, load" "$(load tl)" "$MODEL_BYTES" tl "$(like "$(load ev)" "$(load tl)" "smp-eval's load / torch's")"
fi
echo "  (MB/s: bytes of the checkpoint read, on disk, per second; x cp: seconds / (a); median of $REPEAT runs each)"
echo
echo "targets (like with like; median of $REPEAT runs each):"
tgt() {  # label ratio limit [note]
    printf "  %-58s %6.2f x   %-6s%s\n" "$1 <= $3 x:" "$2" "$(verdict "$2" "$3")" "${4:-}"
}
# cp -r itself moves between rounds here (0.4-3.6 s in one run: the host, DAMON): beside
# each ratio to the median cp -r, the ratio to the run's fastest one, the stricter figure
CPMIN=$(tr ' ' '\n' <<<"${TS[cp]}" | grep . | sort -g | head -1)
strict() { printf "   (fastest cp -r, %.2f s: %.2f x)" "$CPMIN" "$(calc "$1 / $CPMIN")"; }
tgt "(b)  reshard --no-fsync / (a) cp -r" "$(calc "${T[rs]} / ${T[cp]}")" 1.5 "$(strict "${T[rs]}")"
tgt "(b') reshard durable / (a') cp -r && sync" "$(calc "${T[rs-d]} / ${T[cps]}")" 1.2
tgt "(c)  smp-merge --no-fsync / (a)" "$(calc "${T[mg]} / ${T[cp]}")" 1.5 "$(strict "${T[mg]}")"
tgt "(c') smp-merge durable / (a')" "$(calc "${T[mg-d]} / ${T[cps]}")" 1.2
tgt "(d)  smp-verify / (a)" "$(calc "${T[vf]} / ${T[cp]}")" 1.0 "$(strict "${T[vf]}")"
if [ "$BIG" = 1 ]; then
    echo "  (e), (f), (h): skipped for the $SIZE model (fp32 weights, or the whole model, in memory)"
else
    tgt "(e)  smp-eval load / (a)" "$(calc "$(load ev) / ${T[cp]}")" 1.5 \
        "$(loadnote ev)$(strict "$(load ev)")   (its anchor (e'), fresh memory's first touch, alone: $(printf "%.2f" "$(calc "$(load mem) / ${T[cp]}")") x (a))"
fi
if [ "$BIG" = 1 ]; then :
elif [ "$HAVE_LAYOUT" = 1 ]; then
    tgt "(f)  8-rank smp-eval $EVAL_LAYOUT load / (a)" "$(calc "$(load evp) / ${T[cp]}")" 1.5 \
        "$(if [ -n "${LT[evp]:-}" ]; then echo "   (largest of ${NLOAD[evp]} rank line(s))"; else loadnote evp; fi)$(strict "$(load evp)")   (its anchor (f') alone: $(printf "%.2f" "$(calc "$(load memp) / ${T[cp]}")") x (a))"
else
    echo "  (f)  8-rank smp-eval: skipped: this smp-eval has no --layout (one rank only)"
fi
tgt "(g)  CK_ZSTD / CK_NONE reshard" "$(calc "${T[rs-z]} / ${T[rs]}")" 2.0
tgt "(g)  CK_ZSTD / CK_NONE smp-merge" "$(calc "${T[mg-z]} / ${T[mg]}")" 2.0
tgt "(g)  CK_ZSTD / CK_NONE smp-verify" "$(calc "${T[vf-z]} / ${T[vf]}")" 2.0
if [ "$BIG" = 0 ]; then tgt "(g)  CK_ZSTD / CK_NONE smp-eval load" "$(calc "$(load ev-z) / $(load ev)")" 2.0 "$(loadnote ev-z)"; fi
big=0
list=""
for k in rs rs-d mg mg-d vf rs-z mg-z vf-z; do
    big=$(calc "($(mib "$k") > $big ? $(mib "$k") : $big)")
    list="$list $k $(printf "%.0f" "$(mib "$k")"),"
done
printf "  (i)  peak RSS <= 256 MiB (reshard, merge, verify): largest %.0f MiB   %s\n       (MiB:%s)\n" \
    "$big" "$(verdict "$big" 256)" "${list%,}"
if [ "$BIG" = 1 ]; then exit 0; fi
printf "       (eval %.0f MiB, eval zstd %.0f MiB%s)\n" "$(mib ev)" "$(mib ev-z)" \
    "$(if [ "$HAVE_LAYOUT" = 1 ]; then printf ", 8-rank eval %.0f per process" "$(mib evp)"; fi)"
printf "  (h') smp-eval's load of CK_NONE into fp32: %.2f s; torch (%s) loading the same weights from the model's safetensors into fp32: %.2f s (%.2f x smp)\n" \
    "$(load ev)" "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" "$(load tl)" "$(calc "$(load tl) / $(load ev)")"
printf "  (h)  python merge: %.2f s on CK_NONE (%.2f x smp-merge), %.2f s on CK_ZSTD (%.2f x smp-merge), peak RSS %.0f / %.0f MiB\n" \
    "${T[py]}" "$(calc "${T[py]} / ${T[mg]}")" "${T[py-z]}" "$(calc "${T[py-z]} / ${T[mg-z]}")" "$(mib py)" "$(mib py-z)"
if [ -n "${LT[ev]:-}" ]; then
    echo "  smp-eval's load line (last run): $(grep -oE 'loaded .*' "$OUT/ev.log" | tail -1)"
fi
