#!/usr/bin/env bash
# tools/bench/e2e-gpu.sh BIN_DIR OUTDIR: the end-to-end GPU benchmark of issue 7.
#
# smp-train --backend cuda on one GPU, in five parts (first, where BIN_DIR has them,
# smp-dev-check: the CUDA table against the C one; smp-nccl-test: the NCCL
# communicator on one rank, blocking and stream-ordered):
#   1. a ~1.07 B-parameter Llama-shaped model (hidden 2048, intermediate 5632, 20 layers,
#      16 heads x 128, 8 kv heads, vocab 32000, untied, max_position_embeddings 131072,
#      rope_theta 500000) made with `smp-convert init`, and llm.c token files of random
#      tokens (python3, standard library only);
#   2. parity: a tiny model trained 20 steps with --backend cpu and with --backend cuda
#      --dtype fp32 (max relative loss difference <= 1e-4), --dtype bf16 (<= 1e-2), and
#      --fp8 delayed against the C backend's --fp8 delayed (<= 0.05, informational);
#   2b. families: a tiny GPT-NeoX (fused qkv, LayerNorm, GELU, parallel residual, partial
#      rotary) and a tiny Mixtral (4 experts, 2 per token, the load-balancing loss
#      trained) made with `smp-convert init`, 10 steps each with --backend cpu and cuda
#      fp32 (<= 1e-4) and bf16 (<= 1e-2);
#   3. throughput of the 1B model at seq 4096, --batch 8 --microbatches 8 (8 x 4096
#      tokens a step), bf16 and --fp8 delayed, --recompute none (attention, then full, if
#      that runs out of memory): tokens/s over the steps after the first 3, MFU, the
#      fp8/bf16 ratio; then bf16 with the fused attention backward
#      (SMP_CUDA_ATTN_BWD=fused: one kernel, dQ by atomics) beside the split default;
#   4. the longest sequence that fits with cp=1: batch 1, bf16, --recompute none and
#      then full (from the longest that none ran), sequences 8192, 16384, ... 131072,
#      2 steps each, stopping at the first failure;
#   5. OUTDIR/e2e.txt (the summary, < 60 lines) and OUTDIR/e2e-logs/ (each run's output
#      and --log file).
#
# MFU = tokens/s x F / P, with the flops of a token (training: forward + backward)
#   F = 6 N + 6 L S h_attn
#   N      = the matmul parameters: L x (q, k, v, o, gate, up, down) + the LM head
#            (V x hidden); not the embedding (a lookup) nor the norms
#   6 L S h_attn = 12 L h_attn S / 2: QK^T and PV (2 flops a multiply-add each, 2 S
#            h_attn a layer forward, x 3 for forward + backward), halved by the causal
#            mask; h_attn = heads x head_dim, S = the sequence length
#   P      = 989e12 FLOP/s, the H200 SXM's dense bf16 peak (datasheet), also for the fp8
#            run (a bf16-equivalent MFU). Recomputation is not counted (model flops).
#
# Runs alone (tools/bench/e2e-gpu.sh build/bin /tmp/e2e) or from tools/gpu-check. BIN_DIR
# holds smp-train and smp-convert; their libraries are in BIN_DIR/../lib (libshard,
# libsmpkernels, libsmp_cuda.so; SMP_CUDA_LIB overrides the latter). Where the machine
# lacks a library they need (jansson, HDF5, Open MPI, OpenBLAS, zstd, ...), a bundle made
# here brings them:
#   tools/bench/e2e-gpu.sh --bundle DIR   (DIR/bin, DIR/lib, DIR/deps.tar.xz: ~17 MB)
# and on the GPU machine BIN_DIR=DIR/bin: the missing ones are unpacked into DIR/deps and
# put on LD_LIBRARY_PATH (the machine's own copies are used where it has them).
#
# Environment:
#   E2E_BUDGET_S        wall-clock budget of the whole script (default 300); each run's
#                       time limit is cut to what is left; parts that cannot fit are
#                       skipped (said so in e2e.txt)
#   E2E_DRY=1           no GPU: every run on --backend cpu in fp32, tiny models, few
#                       steps: exercises the runs, parsing and arithmetic (its numbers
#                       mean nothing)
#   E2E_WORK            scratch folder for checkpoints and tokens (default /tmp/smp-e2e;
#                       ~2.2 GB for the 1B model)
#   E2E_PEAK_TFLOPS     the peak of the MFU (default 989)
#   E2E_BATCH, E2E_MICRO, E2E_SEQ, E2E_STEPS   throughput run (default 8, 8, 4096, 12)
#   E2E_SKIP            steps left out of the timing (default 3)
#   E2E_TPUT_MODES      the throughput runs, in order (default "bf16 fp8 bf16-fused"):
#                       bf16 or fp8, then -fused or -fused-8x16 (SMP_CUDA_ATTN_BWD) and/or
#                       -4x16 or -4x32 (SMP_CUDA_ATTN_FWD: the attention forward's blocks)
#   E2E_PARITY_STEPS    (default 20)
#   E2E_MAXSEQ          sequences tried for the longest one (default
#                       "8192 16384 32768 65536 131072"); E2E_MAXSEQ_STEPS (default 2),
#                       E2E_MAXSEQ_TIMEOUT per run (default 120 s); E2E_MAXSEQ_RECOMPUTE
#                       the --recompute modes tried (default "none full")
#   E2E_PARTS           which parts run, default "parity families throughput maxseq"
#
# Exit status: 0 every check ran and passed (performance targets that are missed are
# reported, not failures); 1 a parity check failed or a run broke; 2 usage; 3 skipped:
# smp-train cannot run here or has no CUDA backend (the reason is in e2e.txt).
set -uo pipefail

names() { # DIR: the names of its entries, on one line
    local f o=""
    for f in "$1"/*; do [ -e "$f" ] && o+="${f##*/} "; done
    echo "${o% }"
}

# ------------------------------------------------------------------ --bundle DIR
if [ "${1:-}" = "--bundle" ]; then
    DIR=${2:?usage: tools/bench/e2e-gpu.sh --bundle DIR}
    ROOT=$(cd "$(dirname "$0")/../.." && pwd)
    SRC=${E2E_BUNDLE_BIN:-$ROOT/build/bin}
    for b in smp-train smp-convert; do
        [ -x "$SRC/$b" ] || { echo "e2e-gpu: $SRC/$b missing (scons -Q first)" >&2; exit 2; }
    done
    rm -rf "$DIR"
    mkdir -p "$DIR/bin" "$DIR/lib" "$DIR/deps"
    cp -L "$SRC/smp-train" "$SRC/smp-convert" "$DIR/bin/"
    [ -x "$SRC/smp-dev-check" ] && cp -L "$SRC/smp-dev-check" "$DIR/bin/" # the CUDA table against the C one
    [ -x "$SRC/smp-nccl-test" ] && cp -L "$SRC/smp-nccl-test" "$DIR/bin/" # the NCCL communicator, one rank
    cp -L "$SRC"/../lib/*.so "$DIR/lib/"
    [ -e "$SRC/../lib/libsmp_cuda.so" ] || echo "e2e-gpu: warning: $SRC/../lib/libsmp_cuda.so missing: --backend cuda will not load" >&2
    # every shared library they load that is not the C runtime itself (which the GPU
    # machine has, newer) nor the CUDA runtime (the GPU machine's must be used)
    ldd "$DIR"/bin/* "$DIR"/lib/*.so 2>/dev/null | awk '/=> \// {print $3}' | sort -u |
        grep -v "^$DIR/" |
        grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so' |
        grep -Ev '/lib(cuda|cudart|cublas|cublasLt|nccl|nvidia-ml)\.so' |
        while read -r f; do cp -L "$f" "$DIR/deps/"; done
    tar -C "$DIR" -cJf "$DIR/deps.tar.xz" deps
    rm -rf "$DIR/deps"
    echo "e2e-gpu: bundle in $DIR ($(du -sh "$DIR" | cut -f1)): bin/: $(names "$DIR/bin"); lib/: $(names "$DIR/lib"); deps.tar.xz: $(tar -tJf "$DIR/deps.tar.xz" | grep -c '\.so') libraries"
    echo "on the GPU machine: carry $DIR, then tools/bench/e2e-gpu.sh $DIR/bin OUTDIR (or GPU_CHECK_E2E_BIN=$DIR/bin tools/gpu-check OUTDIR)"
    exit 0
fi

BIN=${1:?usage: tools/bench/e2e-gpu.sh BIN_DIR OUTDIR (or --bundle DIR)}
OUT=${2:?usage: tools/bench/e2e-gpu.sh BIN_DIR OUTDIR}
BIN=$(cd "$BIN" 2>/dev/null && pwd) || { echo "e2e-gpu: $1: no such folder" >&2; exit 2; }
mkdir -p "$OUT/e2e-logs"
OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/e2e-logs
SUM=$OUT/e2e.txt
: >"$SUM"
DRY=${E2E_DRY:-0}
WORK=${E2E_WORK:-/tmp/smp-e2e}
mkdir -p "$WORK"
BUDGET=${E2E_BUDGET_S:-300}
PEAK=${E2E_PEAK_TFLOPS:-989}
PARTS=${E2E_PARTS:-parity families throughput maxseq}
PY=${E2E_PYTHON:-python3}
T0=$(date +%s%N)
ms() { echo $((($(date +%s%N) - T0) / 1000000)); }
el() { echo $(($(ms) / 1000)); }
left() { echo $((BUDGET - $(el))); }
say() { echo "[e2e $(el)s] $*"; }
sum() { echo "$*" >>"$SUM"; echo "  | $*"; }
status=0
CHILD='' INIT_PID=''
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { # the run in progress, and the model's init if it still runs
    [ -n "$CHILD" ] && kill -KILL "$CHILD" 2>/dev/null
    if [ -n "$INIT_PID" ] && kill -0 "$INIT_PID" 2>/dev/null; then
        # shellcheck disable=SC2046 # one pid
        kill -TERM $(cat "$WORK/init.pid" 2>/dev/null) "$INIT_PID" 2>/dev/null
    fi
    return 0
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ------------------------------------------------------------------ python helpers (standard library only)
HELPER='
import array, json, math, random, statistics, sys

def load(p):
    return json.load(open(p))

def dims(c):
    H, L = c["hidden_size"], c["num_hidden_layers"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim") or H // nh
    return H, c["intermediate_size"], L, nh, nkv, hd, c["vocab_size"], c.get("tie_word_embeddings", False)

def counts(c):
    H, F, L, nh, nkv, hd, V, tied = dims(c)
    layer = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 3 * H * F   # q k v o, gate up down
    matmul = L * layer + V * H                                          # + the LM head (tied or not)
    total = L * (layer + 2 * H) + H + V * H + (0 if tied else V * H)    # + norms, embedding, head
    return total, matmul, L, nh * hd

def rows(p):
    out = {}
    try:
        for line in open(p):
            line = line.strip()
            if line:
                r = json.loads(line)
                out[r["step"]] = r
    except FileNotFoundError:
        pass
    return out

cmd, a = sys.argv[1], sys.argv[2:]
if cmd == "config":      # OUT H F L nh nkv hd V maxpos theta
    H, F, L, nh, nkv, hd, V, mp = map(int, a[1:9])
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
         "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": nh,
         "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": V, "max_position_embeddings": mp,
         "rope_theta": float(a[9]), "rms_norm_eps": 1e-5, "initializer_range": 0.02,
         "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}
    json.dump(c, open(a[0], "w"), indent=1)
    total, matmul, L, ha = counts(c)
    print(total, matmul)
elif cmd == "family":    # OUT NAME: a tiny config of another family (vocab 512)
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 512, "max_position_embeddings": 512, "initializer_range": 0.02,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    if a[1] == "neox":
        base.update({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu",
                     "layer_norm_eps": 1e-5, "use_parallel_residual": True,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    else:
        base.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
                     "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "output_router_logits": True, "router_aux_loss_coef": 0.02, "rope_theta": 1e6})
    json.dump(base, open(a[0], "w"), indent=1)
elif cmd == "tokens":    # OUT N VOCAB SEED: llm.c format, uint16 tokens
    n, V = int(a[1]), int(a[2])
    assert V <= 65536
    rng = random.Random(int(a[3]))
    head = array.array("i", [0] * 256)
    head[0], head[1], head[2] = 20240520, 1, n
    body = array.array("H", [rng.randrange(V) for _ in range(n)])
    if sys.byteorder != "little":
        head.byteswap(); body.byteswap()
    with open(a[0], "wb") as f:
        f.write(head.tobytes()); f.write(body.tobytes())
elif cmd == "parity":    # REF.jsonl RUN.jsonl STEPS: "maxrel steps_compared first_step_of_max"
    ref, run, want = rows(a[0]), rows(a[1]), int(a[2])
    worst, at, n = 0.0, 0, 0
    for s in sorted(ref):
        if s not in run: continue
        x, y = ref[s].get("loss"), run[s].get("loss")
        n += 1
        d = math.inf if x is None or y is None or not math.isfinite(y) else abs(y - x) / max(abs(x), 1e-30)
        if at == 0 or d > worst: worst, at = d, s
    print("%.3e %d %d %d" % (worst, n, min(len(ref), len(run)), at))
elif cmd == "speed":     # LOG.jsonl SKIP CONFIG SEQ PEAK_TFLOPS: tokens/s over the steps after SKIP
    r, skip = rows(a[0]), int(a[1])
    steps = sorted(r)
    if len(steps) < skip + 1 or not steps:
        print("nan nan nan nan nan 0"); sys.exit(0)
    tim = [s for s in steps if s > skip]
    if not tim:
        print("nan nan nan nan nan 0"); sys.exit(0)
    # elapsed_s is taken at the end of each step: steps skip+1..last span
    # elapsed[last] - elapsed[skip]; tokens from the tokens counter
    base = r[skip] if skip in r else None
    if base is not None:
        tok = r[tim[-1]]["tokens"] - base["tokens"]
        sec = r[tim[-1]]["elapsed_s"] - base["elapsed_s"]
    else:  # skip == 0: per-step tokens/s
        tok = sum(r[s]["tokens"] - r.get(s - 1, {"tokens": 0})["tokens"] for s in tim)
        sec = sum((r[s]["tokens"] - r.get(s - 1, {"tokens": 0})["tokens"]) / r[s]["tokens_per_s"] for s in tim)
    tps = tok / sec if sec > 0 else float("nan")
    med = statistics.median(r[s]["tokens_per_s"] for s in tim)
    total, matmul, L, ha = counts(load(a[2]))
    S = int(a[3])
    fpt = 6 * matmul + 6 * L * S * ha
    mfu = tps * fpt / (float(a[4]) * 1e12)
    step_s = sec / len(tim)
    print("%.1f %.1f %.4f %.6g %.4f %d" % (tps, med, mfu, fpt, step_s, len(tim)))
elif cmd == "laststep":  # LOG.jsonl: seconds of the last logged step
    r = rows(a[0])
    if not r:
        print("?"); sys.exit(0)
    s = max(r)
    t = r[s]["tokens"] - r.get(s - 1, {"tokens": 0})["tokens"]
    print("%.2f" % (t / r[s]["tokens_per_s"]) if r[s].get("tokens_per_s") else "?")
elif cmd == "flops":     # CONFIG SEQ: flops per token and its two terms
    total, matmul, L, ha = counts(load(a[0]))
    S = int(a[1])
    print("%d %d %d" % (6 * matmul + 6 * L * S * ha, 6 * matmul, 6 * L * S * ha))
elif cmd == "fmt":       # EXPR: evaluate a small arithmetic expression (ratios for the summary)
    print(eval(a[0], {"__builtins__": {}}, {"min": min, "max": max, "round": round, "format": format,
                                             "inf": math.inf, "nan": math.nan}))
'
py() { "$PY" -c "$HELPER" "$@"; }

sum "e2e: $(date -u +%Y-%m-%dT%H:%M:%SZ), smp-train $BIN/smp-train, budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ', DRY RUN (E2E_DRY=1: C backend, tiny models; numbers mean nothing)')"

skip_all() { # reason
    sum "e2e: SKIPPED: $*"
    say "skipped: $*"
    exit 3
}

# ------------------------------------------------------------------ preflight
command -v "$PY" >/dev/null 2>&1 || skip_all "$PY not found (needed for the token file and the arithmetic)"
for b in smp-train smp-convert; do [ -x "$BIN/$b" ] || skip_all "$BIN/$b not found"; done
# a bundle's libraries: unpack once, keep only those the machine lacks
if [ -e "$BIN/../deps.tar.xz" ] && [ ! -d "$BIN/../deps" ]; then
    tar -C "$BIN/.." -xJf "$BIN/../deps.tar.xz" 2>/dev/null ||
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$BIN/../deps.tar.xz" "$BIN/.."
    have=$({ ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | awk '{print $1}')
    for f in "$BIN"/../deps/*; do
        grep -qxF "$(basename "$f")" <<<"$have" && rm -f "$f"
    done
    say "bundled libraries used (the machine lacks them): $(d=$(names "$BIN/../deps"); echo "${d:-none}")"
fi
if [ -d "$BIN/../deps" ]; then
    DEPS=$(cd "$BIN/../deps" && pwd)
    export LD_LIBRARY_PATH="$DEPS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# what the programs (and the CUDA backend) still lack: looked for in the CUDA toolkit,
# the driver's folder and the pip wheels' nvidia/ tree (NCCL, cuBLASLt, the CUDA runtime
# come from there on machines with PyTorch), then put on LD_LIBRARY_PATH
resolve_libs() { # FILES...: sets MISSING to what is still not found
    local lib d f nv
    local dirs=("${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib
        /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu)
    nv=$("$PY" -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null || true)
    for _ in 1 2 3; do
        MISSING=$(ldd "$@" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
        [ -z "$MISSING" ] && return 0
        for lib in $MISSING; do
            f=""
            for d in "${dirs[@]}"; do [ -e "$d/$lib" ] && { f=$d/$lib; break; }; done
            # shellcheck disable=SC2086 # nv: folders without spaces, one word each
            [ -z "$f" ] && [ -n "$nv" ] && f=$(find $nv -name "$lib" 2>/dev/null | head -n 1)
            [ -n "$f" ] && LD_LIBRARY_PATH="$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        done
        export LD_LIBRARY_PATH
    done
    MISSING=$(ldd "$@" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
}
CUDA_LIB=${SMP_CUDA_LIB:-$BIN/../lib/libsmp_cuda.so}
LIBS=("$BIN/smp-train" "$BIN/smp-convert")
[ "$DRY" != 1 ] && [ -e "$CUDA_LIB" ] && LIBS+=("$CUDA_LIB")
resolve_libs "${LIBS[@]}"
[ -n "$MISSING" ] && skip_all "smp-train/smp-convert/libsmp_cuda.so cannot load: ${MISSING}not found (bring them: tools/bench/e2e-gpu.sh --bundle DIR)"
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
# the CUDA backend's table op by op against the C backend's (tests/gpu/dev_check.c)
if [ "$DRY" != 1 ] && [ -x "$BIN/smp-dev-check" ] && [ -e "$CUDA_LIB" ]; then
    if timeout 120 "$BIN/smp-dev-check" "$CUDA_LIB" >"$LOGS/dev-check.log" 2>&1; then
        sum "dev-check (CUDA table vs C table): $(tail -n 1 "$LOGS/dev-check.log")"
    else
        sum "dev-check: FAILED: $(grep -cE '^FAIL' "$LOGS/dev-check.log") failures (e2e-logs/dev-check.log)"
        grep -E '^FAIL' "$LOGS/dev-check.log" | head -n 5 | while read -r l; do sum "  $l"; done
        status=1
    fi
fi
# the NCCL communicator on the real NCCL, one rank (no mpirun there): blocking and
# stream-ordered calls, a split, the abort (tests/nccl/test_nccl.c)
if [ "$DRY" != 1 ] && [ -x "$BIN/smp-nccl-test" ]; then
    if timeout 120 "$BIN/smp-nccl-test" >"$LOGS/nccl-test.log" 2>&1; then
        sum "nccl-test (one rank): $(tail -n 1 "$LOGS/nccl-test.log")"
    else
        sum "nccl-test: FAILED (e2e-logs/nccl-test.log): $(grep -m 3 -E 'FAIL|rank' "$LOGS/nccl-test.log" | tr '\n' ' ')"
        status=1
    fi
fi
HELP=$("$BIN/smp-train" --help 2>&1)
has() { grep -qe "$1" <<<"$HELP"; }
NOTE=""
FLAG_DTYPE=1 FLAG_RECOMP=1
has "--dtype" || FLAG_DTYPE=0
has "--recompute" || FLAG_RECOMP=0
if [ "$DRY" = 1 ]; then
    BACKEND=cpu
    [ $FLAG_DTYPE = 0 ] && NOTE+="--dtype "
    [ $FLAG_RECOMP = 0 ] && NOTE+="--recompute "
    [ -n "$NOTE" ] && sum "NOTE: this smp-train has no ${NOTE}flag: the dry run leaves it out"
else
    BACKEND=cuda
    if [ $FLAG_DTYPE = 0 ] || [ $FLAG_RECOMP = 0 ]; then
        skip_all "this smp-train has no CUDA backend flags (--backend cuda, --dtype, --recompute): the backend has not landed"
    fi
    [ -e "$CUDA_LIB" ] || skip_all "no CUDA backend library: $CUDA_LIB missing (SMP_CUDA_LIB names another)"
    GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
    sum "gpu: ${GPU:-nvidia-smi failed}; peak for MFU: ${PEAK} TFLOP/s dense bf16$(grep -q H200 <<<"${GPU:-}" || echo ' (H200 SXM datasheet; this is not an H200)')"
fi

# ------------------------------------------------------------------ running smp-train
# run NAME LIMIT_S WANT_STEPS args...: smp-train with --log/--save-dir set, output in
# LOGS/NAME.log, its --log in LOGS/NAME.jsonl. WANT_STEPS > 0: killed (SIGKILL: no
# final checkpoint) once that many steps are logged. The limit is cut to the budget
# left. Sets R_STATE (ok, oom, timeout, failed), R_RC, R_S (seconds), R_ERR, R_MEM.
run() {
    local name=$1 lim=$2 want=$3
    shift 3
    local log=$LOGS/$name.log jl=$LOGS/$name.jsonl sd=$WORK/run-$name
    local l
    l=$(left)
    [ "$lim" -gt "$l" ] && lim=$l
    rm -rf "$sd" "$jl"
    R_STATE=failed R_RC=-1 R_S=0 R_ERR="" R_MEM=""
    if [ "$lim" -lt 5 ]; then
        R_STATE=timeout R_ERR="no time left in the budget"
        say "$name: not run (budget)"
        return
    fi
    echo "smp-train $* --log $jl --save-dir $sd --compress none" >"$log"
    say "$name: smp-train $* (limit ${lim}s)"
    local t n=0 killed=""
    t=$(ms)
    "$BIN/smp-train" "$@" --log "$jl" --save-dir "$sd" --compress none >>"$log" 2>&1 &
    CHILD=$!
    while kill -0 "$CHILD" 2>/dev/null; do
        if [ "$want" -gt 0 ] && [ -e "$jl" ]; then
            n=$(wc -l <"$jl")
            if [ "$n" -ge "$want" ]; then killed=steps; kill -KILL "$CHILD" 2>/dev/null; break; fi
        fi
        if [ $(($(ms) - t)) -gt $((lim * 1000)) ]; then killed=timeout; kill -KILL "$CHILD" 2>/dev/null; break; fi
        sleep 0.2
    done
    wait "$CHILD"
    R_RC=$?
    CHILD=
    R_S=$(( ($(ms) - t) / 1000 ))
    R_MEM=$(grep -m 1 'memory:' "$log" | sed 's/.*memory:/memory:/' || true)
    n=0
    [ -e "$jl" ] && n=$(wc -l <"$jl")
    if [ "$killed" = steps ] || { [ -z "$killed" ] && [ $R_RC -eq 0 ]; }; then
        R_STATE=ok
    elif [ "$want" -gt 0 ] && [ "$n" -ge "$want" ]; then
        # every step it was asked for is logged, then it broke (saving, exiting):
        # the measurement stands, the breakage is reported
        R_STATE=ok R_ERR="$(rcname "$R_RC") after its last step: $(tail -n 1 "$log" | cut -c 1-100)"
        WARN+="$name "
        [ -z "$WARN_MSG" ] && WARN_MSG=$R_ERR
    elif [ "$killed" = timeout ]; then
        R_STATE=timeout R_ERR="no result in ${lim}s ($(wc -l <"$jl" 2>/dev/null || echo 0) steps logged)"
    elif grep -qiE 'out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|\bOOM\b' "$log"; then
        R_STATE=oom R_ERR=$(grep -iE 'out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|\bOOM\b' "$log" | tail -n 1 | cut -c 1-160)
    else
        R_STATE=failed R_ERR="$(rcname "$R_RC"): $(grep -iE 'error|fail|abort|fault' "$log" | tail -n 1 | cut -c 1-160)"
        [ "${R_ERR%: }" != "$R_ERR" ] && R_ERR="$R_ERR$(tail -n 1 "$log" | cut -c 1-160)"
    fi
    say "$name: $R_STATE in ${R_S}s${R_ERR:+: $R_ERR}"
}
WARN="" WARN_MSG=""

rcname() { # exit status -> "exit N" or "killed by SIGNAME"
    if [ "$1" -gt 128 ] && [ "$1" -lt 160 ]; then echo "killed by SIG$(kill -l $(($1 - 128)) 2>/dev/null || echo $(($1 - 128)))"
    else echo "exit $1"; fi
}

# flags for a run: TARGET (cpu | gpu) DTYPE FP8 RECOMPUTE
flags() {
    local be=$1 dt=$2 f8=$3 rc=$4
    [ "$be" = gpu ] && be=$BACKEND
    [ "$be" = cpu ] && dt=fp32 # the C backend computes in fp32 (dry runs: every run)
    F=(--backend "$be")
    [ $FLAG_DTYPE = 1 ] && F+=(--dtype "$dt")
    [ "$f8" != off ] && F+=(--fp8 "$f8")
    [ $FLAG_RECOMP = 1 ] && [ "$rc" != - ] && F+=(--recompute "$rc")
    return 0
}

# ------------------------------------------------------------------ 1. models and tokens
if [ "$DRY" = 1 ]; then
    BIG=(128 352 2 4 2 32 512 2048 500000) # hidden inter layers heads kv hd vocab maxpos theta
    SEQ=${E2E_SEQ:-128} BATCH=${E2E_BATCH:-4} MICRO=${E2E_MICRO:-2} STEPS=${E2E_STEPS:-5}
    PSTEPS=${E2E_PARITY_STEPS:-4}
    MAXSEQ=${E2E_MAXSEQ:-256 512 1024}
    NTOK=${E2E_TOKENS:-20000}
else
    BIG=(2048 5632 20 16 8 128 32000 131072 500000)
    SEQ=${E2E_SEQ:-4096} BATCH=${E2E_BATCH:-8} MICRO=${E2E_MICRO:-8} STEPS=${E2E_STEPS:-12}
    PSTEPS=${E2E_PARITY_STEPS:-20}
    MAXSEQ=${E2E_MAXSEQ:-8192 16384 32768 65536 131072}
    NTOK=${E2E_TOKENS:-1100000}
fi
SKIP=${E2E_SKIP:-3}
MSTEPS=${E2E_MAXSEQ_STEPS:-2}
MTIME=${E2E_MAXSEQ_TIMEOUT:-120}
for s in $MAXSEQ; do [ "$s" -gt "${BIG[7]}" ] && BIG[7]=$s; done
# enough tokens for every run: the throughput steps, and the longest sequence's steps
need=$((STEPS * BATCH * SEQ + 1))
[ $((MSTEPS * BIG[7] + 1)) -gt "$need" ] && need=$((MSTEPS * BIG[7] + 1))
[ "$need" -gt "$NTOK" ] && NTOK=$need
TINY=(128 384 3 4 2 32 512 1024 10000)
PSEQ=256 PBATCH=4

read -r NTOTAL NMATMUL < <(py config "$WORK/big.json" "${BIG[@]}")
py config "$WORK/tiny.json" "${TINY[@]}" >/dev/null
read -r FPT F6N FATT < <(py flops "$WORK/big.json" "$SEQ")
sum "model: hidden ${BIG[0]}, intermediate ${BIG[1]}, ${BIG[2]} layers, ${BIG[3]} heads x ${BIG[5]} (${BIG[4]} kv), vocab ${BIG[6]}, untied, max_position_embeddings ${BIG[7]}, rope_theta ${BIG[8]}"
sum "  parameters $(py fmt "format($NTOTAL, ',')") (all); N = $(py fmt "format($NMATMUL, ',')") (matmul: the layers' linears + the LM head)"
sum "  flops/token at seq $SEQ = 6N + 6*L*S*heads*head_dim = $F6N + $FATT = $FPT; MFU = tokens/s * that / ${PEAK}e12"

if grep -qw throughput <<<"$PARTS" || grep -qw maxseq <<<"$PARTS"; then
    # the 1B checkpoint and its tokens, made while the parity runs
    say "making the model (smp-convert init) and tokens in $WORK"
    rm -rf "$WORK/big-ckpt"
    rm -f "$WORK/init.pid"
    (
        s=$(date +%s%N)
        timeout 300 "$BIN/smp-convert" init --config "$WORK/big.json" --out "$WORK/big-ckpt" --layout pp=1,tp=1 \
            --compress none --seed 1 >"$LOGS/init-big.log" 2>&1 &
        echo $! >"$WORK/init.pid"
        wait $!
        rc=$?
        [ $rc -eq 0 ] && { py tokens "$WORK/big-tokens.bin" "$NTOK" "${BIG[6]}" 1 >>"$LOGS/init-big.log" 2>&1; rc=$?; }
        echo "init: exit $rc in $((($(date +%s%N) - s) / 1000000)) ms (smp-convert init, then the tokens)" >>"$LOGS/init-big.log"
        exit $rc
    ) &
    INIT_PID=$!
fi

# ------------------------------------------------------------------ 2. parity
if grep -qw parity <<<"$PARTS"; then
    say "parity: tiny model"
    rm -rf "$WORK/tiny-ckpt"
    timeout 60 "$BIN/smp-convert" init --config "$WORK/tiny.json" --out "$WORK/tiny-ckpt" --layout pp=1,tp=1 \
        --dtype fp32 --compress none --seed 2 >"$LOGS/init-tiny.log" 2>&1 || { sum "parity: FAIL: smp-convert init of the tiny model (see e2e-logs/init-tiny.log)"; status=1; }
    py tokens "$WORK/tiny-tokens.bin" $((PSTEPS * PBATCH * PSEQ + PSEQ + 1)) "${TINY[6]}" 2
    P=(--ckpt "$WORK/tiny-ckpt" --data "$WORK/tiny-tokens.bin" --steps "$PSTEPS" --batch "$PBATCH" --seq "$PSEQ" --lr 1e-3)
    sum "parity: hidden ${TINY[0]}, ${TINY[2]} layers, ${TINY[3]} heads x ${TINY[5]} (${TINY[4]} kv), vocab ${TINY[6]}, $PSTEPS steps of $PBATCH x $PSEQ, lr 1e-3; max over steps of |loss - loss_cpu| / loss_cpu"
    declare -A PRUN=()
    for spec in "gpu fp32 off" "cpu fp32 off" "cpu fp32 delayed" "gpu bf16 off" "gpu bf16 delayed"; do
        read -r be dt f8 <<<"$spec"
        name=parity-$be-$dt-fp8$f8
        flags "$be" "$dt" "$f8" -
        run "$name" 90 "$PSTEPS" "${P[@]}" "${F[@]}"
        PRUN[$be-$dt-$f8]=$R_STATE
        if [ "$R_STATE" != ok ]; then
            sum "parity: FAIL: $name did not complete: $R_STATE${R_ERR:+: $R_ERR}"
            status=1
            # no backend, no device: nothing else can run
            if [ "$be" = gpu ] && grep -qiE 'could not be loaded|not a CUDA backend|no CUDA(-capable)? device|CUDA driver' "$LOGS/$name.log"; then
                sum "e2e: FAILED: the CUDA backend does not start (e2e-logs/$name.log)"
                exit 1
            fi
        fi
    done
    # the log files are named parity-BE-DT-fp8F8.jsonl
    pname() { local be dt f8; IFS=- read -r be dt f8 <<<"$1"; echo "$be-$dt-fp8$f8"; }
    for c in "cuda fp32 vs cpu|cpu-fp32-off|gpu-fp32-off|1e-4|check" "cuda bf16 vs cpu|cpu-fp32-off|gpu-bf16-off|1e-2|check" \
        "cuda bf16 fp8 delayed vs cpu fp8 delayed|cpu-fp32-delayed|gpu-bf16-delayed|0.05|info" \
        "cuda bf16 fp8 delayed vs cpu fp32|cpu-fp32-off|gpu-bf16-delayed|0.05|info"; do
        IFS='|' read -r label ref runn lim kind <<<"$c"
        if [ "${PRUN[$ref]:-}" != ok ] || [ "${PRUN[$runn]:-}" != ok ]; then continue; fi
        read -r mx n _ at < <(py parity "$LOGS/parity-$(pname "$ref").jsonl" "$LOGS/parity-$(pname "$runn").jsonl" "$PSTEPS")
        verdict=$(py fmt "'ok' if $mx <= $lim and $n == $PSTEPS else 'X'" 2>/dev/null || echo X)
        [ "$DRY" = 1 ] && label="$label (dry: both on cpu)"
        if [ "$kind" = check ]; then
            if [ "$verdict" = ok ]; then sum "PASS $label: max rel loss diff $mx (<= $lim), $n steps"
            else sum "FAIL $label: max rel loss diff $mx at step $at (limit $lim), $n of $PSTEPS steps compared"; status=1; fi
        else
            sum "INFO $label: max rel loss diff $mx at step $at (target $lim: $([ "$verdict" = ok ] && echo ok || echo MISSED)), $n steps"
        fi
    done
fi

# ------------------------------------------------------------------ 2b. families
if grep -qw families <<<"$PARTS"; then
    FSTEPS=10
    py tokens "$WORK/fam-tokens.bin" $((FSTEPS * 4 * 128 + 129)) 512 4
    for fam in neox mixtral; do
        say "families: $fam"
        py family "$WORK/$fam.json" "$fam"
        rm -rf "$WORK/$fam-ckpt"
        timeout 60 "$BIN/smp-convert" init --config "$WORK/$fam.json" --out "$WORK/$fam-ckpt" --layout pp=1,tp=1 \
            --dtype fp32 --compress none --seed 3 >"$LOGS/init-$fam.log" 2>&1 || { sum "families: FAIL: smp-convert init of $fam (e2e-logs/init-$fam.log)"; status=1; continue; }
        FP=(--ckpt "$WORK/$fam-ckpt" --data "$WORK/fam-tokens.bin" --steps "$FSTEPS" --batch 4 --seq 128 --lr 1e-3)
        declare -A FRUN=()
        for spec in "cpu fp32" "gpu fp32" "gpu bf16"; do
            read -r be dt <<<"$spec"
            flags "$be" "$dt" off -
            run "fam-$fam-$be-$dt" 90 "$FSTEPS" "${FP[@]}" "${F[@]}"
            FRUN[$be-$dt]=$R_STATE
            [ "$R_STATE" = ok ] || { sum "families: FAIL: $fam $be $dt did not complete: $R_STATE${R_ERR:+: $R_ERR}"; status=1; }
        done
        for c in "gpu-fp32|1e-4" "gpu-bf16|1e-2"; do
            IFS='|' read -r runn lim <<<"$c"
            [ "${FRUN[cpu-fp32]:-}" = ok ] && [ "${FRUN[$runn]:-}" = ok ] || continue
            read -r mx n _ at < <(py parity "$LOGS/fam-$fam-cpu-fp32.jsonl" "$LOGS/fam-$fam-$runn.jsonl" "$FSTEPS")
            verdict=$(py fmt "'ok' if $mx <= $lim and $n == $FSTEPS else 'X'" 2>/dev/null || echo X)
            if [ "$verdict" = ok ]; then sum "PASS $fam cuda ${runn#gpu-} vs cpu: max rel loss diff $mx (<= $lim), $n steps"
            else sum "FAIL $fam cuda ${runn#gpu-} vs cpu: max rel loss diff $mx at step $at (limit $lim), $n of $FSTEPS steps"; status=1; fi
        done
        unset FRUN
    done
fi

if [ -n "$INIT_PID" ]; then
    wait "$INIT_PID"
    irc=$?
    say "model: $(tail -n 1 "$LOGS/init-big.log")"
    if [ $irc -ne 0 ]; then
        sum "model: FAILED: smp-convert init or the token file (see e2e-logs/init-big.log: $(grep -iE 'error' "$LOGS/init-big.log" | tail -n 1 | cut -c 1-120))"
        sum "e2e: FAILED in $(el)s"
        exit 1
    fi
fi
BIGP=(--ckpt "$WORK/big-ckpt" --data "$WORK/big-tokens.bin")

# ------------------------------------------------------------------ 3. throughput
if grep -qw throughput <<<"$PARTS"; then
    TP=("${BIGP[@]}" --steps "$STEPS" --batch "$BATCH" --microbatches "$MICRO" --seq "$SEQ" --lr 1e-4)
    sum "throughput: seq $SEQ, batch $BATCH x $SEQ tokens a step in $MICRO microbatches, $STEPS steps, timed over steps $((SKIP + 1))-$STEPS"
    RECOMP=none
    declare -A TPS=() MFU=()
    for mode in ${E2E_TPUT_MODES:-bf16 fp8 bf16-fused}; do
        f8=off
        [ "${mode%%-*}" = fp8 ] && f8=delayed
        unset SMP_CUDA_ATTN_BWD SMP_CUDA_ATTN_FWD
        case "$mode" in *-fused-8x16*) export SMP_CUDA_ATTN_BWD=fused-8x16 ;; *-fused*) export SMP_CUDA_ATTN_BWD=fused ;; esac
        case "$mode" in *-4x16*) export SMP_CUDA_ATTN_FWD=4x16 ;; *-4x32*) export SMP_CUDA_ATTN_FWD=4x32 ;; esac
        while :; do
            flags gpu bf16 "$f8" "$RECOMP"
            run "tput-$mode-$RECOMP" 150 "$STEPS" "${TP[@]}" "${F[@]}"
            if [ "$R_STATE" = oom ] && [ "$RECOMP" != full ] && [ $FLAG_RECOMP = 1 ]; then
                sum "  $mode with --recompute $RECOMP: out of memory; trying the next"
                [ "$RECOMP" = none ] && RECOMP=attention || RECOMP=full
                continue
            fi
            break
        done
        unset SMP_CUDA_ATTN_BWD SMP_CUDA_ATTN_FWD
        label="$mode$([ $f8 = delayed ] && echo ' delayed'), recompute $RECOMP"
        if [ "$R_STATE" != ok ]; then
            sum "  $label: $R_STATE${R_ERR:+: $R_ERR}"
            status=1
            continue
        fi
        read -r tps med mfu _ step_s nt < <(py speed "$LOGS/tput-$mode-$RECOMP.jsonl" "$SKIP" "$WORK/big.json" "$SEQ" "$PEAK")
        if [ "$nt" = 0 ]; then
            sum "  $label: fewer than $((SKIP + 1)) steps logged"
            status=1
            continue
        fi
        TPS[$mode]=$tps
        MFU[$mode]=$mfu
        sum "  $label: $tps tok/s (median step $med), $step_s s/step, MFU $(py fmt "round(100 * $mfu, 1)")%; ${R_MEM:-memory: (no memory: line)}"
    done
    if [ -n "${MFU[bf16]:-}" ]; then
        m=$(py fmt "round(100 * ${MFU[bf16]}, 1)")
        sum "TARGET bf16 MFU >= 40%: $m% $(py fmt "'ok' if ${MFU[bf16]} >= 0.40 else 'MISSED'")"
    fi
    if [ -n "${TPS[bf16]:-}" ] && [ -n "${TPS[fp8]:-}" ]; then
        r=$(py fmt "round(${TPS[fp8]} / ${TPS[bf16]}, 3)")
        sum "TARGET fp8/bf16 tokens/s >= 1.3: $r $(py fmt "'ok' if $r >= 1.3 else 'MISSED'")"
    fi
    if [ -n "${TPS[bf16]:-}" ] && [ -n "${TPS[bf16-fused]:-}" ]; then
        sum "fused / split attention backward, bf16 tokens/s: $(py fmt "round(${TPS[bf16-fused]} / ${TPS[bf16]}, 3)")"
    fi
fi

# ------------------------------------------------------------------ 4. longest sequence with cp=1
# without recomputation first (it runs out of memory sooner), then with --recompute full
# from the longest that fitted without (less memory: it fits too; the budget goes to the
# lengths that matter)
FITS=0 # the longest sequence a mode has run
maxseq() { # RECOMPUTE
    local m=$1 s best=0 bestmem="" why="" from=$FITS
    sum "longest sequence with cp=1: batch 1, --recompute $m, bf16, $MSTEPS steps each, up from ${MAXSEQ%% *} doubling to the first failure"
    for s in $MAXSEQ; do
        if [ "$s" -lt "$from" ]; then
            sum "  seq $s: not run (ran with less recomputation)"
            continue
        fi
        flags gpu bf16 off "$m"
        run "maxseq-$m-$s" "$MTIME" "$MSTEPS" "${BIGP[@]}" --steps "$MSTEPS" --batch 1 --seq "$s" --lr 1e-4 "${F[@]}"
        if [ "$R_STATE" = ok ]; then
            best=$s bestmem=$R_MEM
            [ "$s" -gt "$FITS" ] && FITS=$s
            sum "  seq $s: ok, last step $(py laststep "$LOGS/maxseq-$m-$s.jsonl") s, ${R_S}s in all (start-up included)"
        else
            why="seq $s: $R_STATE${R_ERR:+: $R_ERR}"
            sum "  $why"
            break
        fi
    done
    if [ "$best" -gt 0 ]; then
        sum "longest sequence, cp=1, --recompute $m: $best$([ -z "$why" ] && echo " (the longest tried)"); ${bestmem:-memory: (no memory: line)}"
    else
        sum "longest sequence, cp=1, --recompute $m: none of $MAXSEQ completed"
        # the shortest failing from a lack of time is the budget's fault, not the program's
        [ "$R_STATE" != timeout ] && [ "$R_STATE" != oom ] && status=1
    fi
    return 0
}
if grep -qw maxseq <<<"$PARTS"; then
    for m in ${E2E_MAXSEQ_RECOMPUTE:-none full}; do maxseq "$m"; done
fi

[ -n "$WARN" ] && sum "WARN broke after their last logged step (results kept): ${WARN% } (first: $WARN_MSG)"
sum "e2e: $([ $status -eq 0 ] && echo OK || echo FAILED) in $(el)s"
[ "$(wc -l <"$SUM")" -gt 60 ] && echo "e2e-gpu: warning: $SUM has more than 60 lines" >&2
exit $status
