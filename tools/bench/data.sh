#!/usr/bin/env bash
# The check of --data at start (not a test): smp-train reads every byte of its token
# files once before training (each token against the vocabulary, and the files'
# fingerprint that a resume and the ranks compare). Under mpirun the ranks of a host
# split that reading (train/data.c); this prints what the check costs at 1 and 8 ranks
# of one host, side by side with the physical anchor (one `cat FILES >/dev/null` of the
# warm files) and with what a Python loader would do to check it (numpy: np.fromfile,
# then max, in one process), medians of REPEAT rounds.
#
#   bash tools/bench/data.sh [CACHE]     (SMP_BENCH_DATA_GB: GB of tokens, in 1 GB files, default 4;
#                                         SMP_BENCH_REPEAT, default 3; SMP_BIN: other binaries)
#
# The check's time is smp-train's whole run (a tiny model, one step of 8 x 64 tokens)
# on the big files minus the same run on a file of 1 M tokens: the start-up of 8 MPI
# processes on 2 cores is seconds by itself, and cancels out. The "resumed" rows time
# the run's second step resumed from its first's save (REPEAT times a round): a resume
# does not read again the files its run checked while they are unchanged.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/bench/common.sh
. tools/bench/common.sh
GB=${SMP_BENCH_DATA_GB:-4}
REPEAT=${SMP_BENCH_REPEAT:-3}
D=$CACHE/data
mkdir -p "$D"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
NTOK=$((GB * 500000000))
for ((k = 0; k < GB; k++)); do # 1 GB files (an llm.c header counts at most 2^31 - 1 tokens)
    [ -f "$D/tok-$k.bin" ] && continue
    echo "writing $D/tok-$k.bin: 1 GB of uint16 tokens"
    "$PY" - "$D/tok-$k.bin" "$k" <<'EOF'
import os, sys, numpy as np
path, n = sys.argv[1], 500_000_000
h = np.zeros(256, dtype="<i4"); h[:3] = (20240520, 1, n)
rng = np.random.default_rng(int(sys.argv[2]))
with open(path + ".part", "wb") as f:
    f.write(h.tobytes())
    for k in range(0, n, 50_000_000):
        f.write(rng.integers(0, 32000, 50_000_000, dtype="<u2").tobytes())
os.replace(path + ".part", path)
EOF
done
FILES=$(for ((k = 0; k < GB; k++)); do printf '%s,' "$D/tok-$k.bin"; done)
FILES=${FILES%,}
"$PY" - "$D/small.bin" <<'EOF'
import sys, numpy as np
h = np.zeros(256, dtype="<i4"); h[:3] = (20240520, 1, 1_000_000)
open(sys.argv[1], "wb").write(h.tobytes() + np.random.default_rng(1).integers(0, 32000, 1_000_000, dtype="<u2").tobytes())
EOF
cat > "$D/config.json" <<'EOF'
{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":32000,"rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":2048,"initializer_range":0.02,"torch_dtype":"bfloat16","tie_word_embeddings":false}
EOF
rm -rf "$D/ck" "$D/run"
"$BIN/smp-convert" init --config "$D/config.json" --out "$D/ck" --layout dp=1 --no-fsync >/dev/null
cat ${FILES//,/ } >/dev/null # warm

secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N); calc "$t1 - $t0"; }
calc() { awk "BEGIN {print $1}"; }
train() { # $1 ranks, $2 token files: a new run of one step
    rm -rf "$D/run"
    mpirun --oversubscribe --bind-to none -np "$1" "$BIN/smp-train" --ckpt "$D/ck" --data "$2" --save-dir "$D/run" \
        --steps 2 --stop-at 1 --batch 8 --seq 64
}
resume() { # $1 ranks, $2 token files: its second step, resumed from the first's save
    rm -rf "$D/run/step-000002"
    echo step-000001 >"$D/run/latest"
    mpirun --oversubscribe --bind-to none -np "$1" "$BIN/smp-train" --ckpt "$D/run" --data "$2" --save-dir "$D/run"
}
declare -A T
for ((r = 0; r < REPEAT; r++)); do
    T[cat]+="$(secs cat ${FILES//,/ }) "
    T[np]+="$(secs "$PY" -c "import numpy as np, sys
for f in sys.argv[1:]: assert np.fromfile(f, dtype='<u2', offset=1024).max() < 32000" ${FILES//,/ }) "
    for n in 1 8; do
        T[s$n]+="$(secs train $n "$D/small.bin") "
        for ((k = 0; k < REPEAT; k++)); do T[rs$n]+="$(secs resume $n "$D/small.bin") "; done
        T[b$n]+="$(secs train $n "$FILES") "
        for ((k = 0; k < REPEAT; k++)); do T[rb$n]+="$(secs resume $n "$FILES") "; done
    done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
cat_s=$(echo "${T[cat]}" | median)
echo "host: $(nproc) cores; $GB files of 1 GB of uint16 tokens ($NTOK in all), page cache warm; medians of $REPEAT"
printf '%-44s %8s %8s\n' "" "seconds" "x cat"
printf '%-44s %8.2f %8.2f\n' "cat FILES >/dev/null (the anchor)" "$cat_s" 1
x=$(echo "${T[np]}" | median)
printf '%-44s %8.2f %8.2f\n' "numpy: np.fromfile + max, one process" "$x" "$(calc "$x / $cat_s")"
for n in 1 8; do
    b=$(echo "${T[b$n]}" | median); s=$(echo "${T[s$n]}" | median)
    c=$(calc "$b - $s")
    printf '%-44s %8.2f %8.2f   (runs of %.2f s - %.2f s)\n' "smp-train's check, $n rank(s) of one host" "$c" \
        "$(calc "$c / $cat_s")" "$b" "$s"
    b=$(echo "${T[rb$n]}" | median); s=$(echo "${T[rs$n]}" | median)
    c=$(calc "$b - $s")
    printf '%-44s %8.2f %8.2f   (runs of %.2f s - %.2f s)\n' "  resumed (the files as its run checked them)" "$c" \
        "$(calc "$c / $cat_s")" "$b" "$s"
done
rm -rf "$D/run"
