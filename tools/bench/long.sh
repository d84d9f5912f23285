#!/usr/bin/env bash
# tools/bench/long.sh [CACHE]: long sequences with context parallelism (ring attention)
# on this machine's cores, in one run:
#   1. one training step of a 131,072-token sequence on a small Llama (1 layer, hidden
#      64, 4 heads of 16, vocab 256) with cp=8 over 8 MPI ranks: the step's time and
#      each rank's memory (smp-train's own memory line: parameters, gradients,
#      optimizer, activations) and peak RSS; beside it the same step in PyTorch (one
#      process, attn_implementation="sdpa", torch's fused causal attention);
#   2. the same model at 32,768 tokens with cp=1, 2, 4 and 8: time and memory per rank.
# Environment: LONG_SEQ (default 131072), LONG_SHORT (default 32768), LONG_TORCH=0 skips
# torch. The step time is smp-train's elapsed time of its one step (the JSONL's
# elapsed_s), torch's the wall time of its step; peak RSS by GNU time.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
SEQ=${LONG_SEQ:-131072}
SHORT=${LONG_SHORT:-32768}
W=$CACHE/long
rm -rf "$W"; mkdir -p "$W"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPI="mpirun --oversubscribe --bind-to none"

"$PY" - "$W" "$SEQ" <<'EOF'
import json, sys, numpy as np
w, seq = sys.argv[1], int(sys.argv[2])
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
       "max_position_embeddings": seq, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
       "tie_word_embeddings": False, "torch_dtype": "float32"}
json.dump(cfg, open(f"{w}/config.json", "w"))
toks = np.random.default_rng(0).integers(0, 256, size=seq + 1)
h = np.zeros(256, dtype="<i4"); h[:3] = (20240520, 1, len(toks))
open(f"{w}/tokens.bin", "wb").write(h.tobytes() + toks.astype("<u2").tobytes())
EOF
"$BIN/smp-convert" init --config "$W/config.json" --out "$W/ckpt" --layout pp=1 --seed 1 >/dev/null

# smp-train: one step at SEQ tokens over CP ranks; prints "time_s act_mib total_mib rss_mib"
smp_step() {
    local seq=$1 cp=$2 out=$W/run-$1-$2 thr=$(($(nproc) / $2))
    [ "$thr" -ge 1 ] || thr=1 # the cores shared by the ranks
    OMP_NUM_THREADS=$thr /usr/bin/time -f "%M" -o "$out.rss" $MPI -np "$cp" "$BIN/smp-train" --ckpt "$W/ckpt" --data "$W/tokens.bin" \
        --save-dir "$out" --layout "cp=$cp" --steps 1 --batch 1 --seq "$seq" --lr 1e-3 --log "$out.jsonl" \
        >"$out.txt" 2>&1 || { echo "smp-train cp=$cp seq=$seq failed (see $out.txt)" >&2; tail -3 "$out.txt" >&2; return 1; }
    "$PY" - "$out.jsonl" "$out.txt" "$out.rss" "$cp" <<'EOF'
import json, re, sys
step = [json.loads(l) for l in open(sys.argv[1])][-1]
mem = re.search(r"memory: ([0-9.]+) ([KMG])iB per rank \(params ([0-9.]+), grads ([0-9.]+), optimizer ([0-9.]+), "
                r"activations ([0-9.]+) ([KMG])iB", open(sys.argv[2]).read())
scale = {"K": 1 / 1024, "M": 1, "G": 1024}
total = float(mem.group(1)) * scale[mem.group(2)]
act = float(mem.group(6)) * scale[mem.group(7)]
rss = int(open(sys.argv[3]).read().split()[-1]) / 1024  # GNU time's max RSS of the processes (mpirun's children: the largest)
print(f"{step['elapsed_s']:.2f} {act:.1f} {total:.1f} {rss:.0f}")
EOF
}

echo "long.sh: a 1-layer Llama (hidden 64, 4 heads x 16, vocab 256), fp32, AdamW, this machine's $(nproc) cores"
printf '%-34s %10s %14s %14s\n' "" "step (s)" "activations" "memory/rank"
read -r t8 a8 m8 r8 < <(smp_step "$SEQ" 8)
printf '%-34s %10s %11s MiB %11s MiB\n' "smp-train cp=8, $SEQ tokens" "$t8" "$a8" "$m8"
if [ "${LONG_TORCH:-1}" = 1 ]; then
    /usr/bin/time -f "%M" -o "$W/torch.rss" "$PY" - "$W" "$SEQ" "$(nproc)" >"$W/torch.txt" 2>&1 <<'EOF' || { echo "torch failed:"; tail -3 "$W/torch.txt"; }
import json, sys, time, numpy as np, torch, torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
w, seq, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
cfg = LlamaConfig(**{k: v for k, v in json.load(open(f"{w}/config.json")).items() if k not in ("architectures", "model_type", "torch_dtype")})
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
toks = torch.from_numpy(np.fromfile(f"{w}/tokens.bin", dtype="<u2", offset=1024).astype(np.int64))[None]
t0 = time.perf_counter()
loss = F.cross_entropy(model(toks[:, :-1]).logits.reshape(-1, 256), toks[:, 1:].reshape(-1))
loss.backward()
opt.step()
print(f"TORCH {time.perf_counter() - t0:.2f}")
EOF
    if grep -q TORCH "$W/torch.txt"; then
        tt=$(grep TORCH "$W/torch.txt" | cut -d' ' -f2)
        tr=$(($(cat "$W/torch.rss" | tail -1) / 1024))
        printf '%-34s %10s %14s %11s MiB\n' "torch sdpa, one process, $SEQ" "$tt" "-" "$tr"
        "$PY" -c "print(f'smp cp=8 / torch time: {$t8 / $tt:.2f}x')"
    fi
fi
echo
echo "$SHORT tokens:"
printf '%-34s %10s %14s %14s\n' "" "step (s)" "activations" "memory/rank"
for cp in 1 2 4 8; do
    read -r t a m r < <(smp_step "$SHORT" "$cp")
    printf '%-34s %10s %11s MiB %11s MiB\n' "smp-train cp=$cp" "$t" "$a" "$m"
    [ "$cp" = 1 ] && a1=$a
    [ "$cp" = 8 ] && "$PY" -c "print(f'activations per rank, cp=8 / cp=1: {$a / $a1:.3f}')"
done
