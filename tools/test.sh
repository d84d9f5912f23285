#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (tools/bootstrap.sh),
# builds every variant, runs the C unit tests (optimized and sanitized), the oracle
# tests against torch/transformers/safetensors/ml_dtypes/h5py, the hostile corpus
# under ASan+UBSan, replays the fuzz corpora and fuzzes each parser briefly, runs the
# GPU programs (which skip cleanly where there is no GPU), and checks the CUDA backend
# on the CPU emulator: each op and the backend's table against the C ones (tools/emu-check).
# The oracle tests run a file per core at a time (pytest-xdist), the emulated CUDA
# backend's among them.
#   FUZZ_SECONDS=N   seconds of fresh fuzzing per harness (default 20)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
JOBS=$(nproc)
LOG=build/test-logs
passed=0; failed=0; failures=()
# each step's time, so that a run's log says where the suite's minutes go (CI's budget)
step_name=""; step_t0=$SECONDS
step_time() { [ -z "$step_name" ] || echo "---- $((SECONDS - step_t0)) s: $step_name"; }
step() { step_time; step_name=$*; step_t0=$SECONDS; echo; echo "==== $*"; }
ok()   { passed=$((passed + 1)); echo "PASS: $1"; }
bad()  { failed=$((failed + 1)); failures+=("$1"); echo "FAIL: $1"; }

step "bootstrap"
VENV=$(tools/bootstrap.sh | tail -1) || { echo "bootstrap failed"; exit 1; }
PY="$VENV/bin/python"
mkdir -p "$LOG"

step "build (release, asan, fuzz, emu)"
build_variant() {  # name, scons args...
    local name=$1; shift
    if scons -Q -j"$JOBS" "$@" >"$LOG/build-$name.log" 2>&1; then
        if grep -E "warning:" "$LOG/build-$name.log"; then bad "build $name has warnings"; else ok "build $name"; fi
    else
        tail -30 "$LOG/build-$name.log"; bad "build $name"
    fi
}
build_variant release
build_variant asan variant=asan cuda=0
build_variant fuzz variant=fuzz
build_variant emu variant=emu

step "C unit tests"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for t in build/release/tests/test_* build/asan/tests/test_*; do
    [ -x "$t" ] || continue
    if "$t" >"$LOG/$(echo "$t" | tr / _).log" 2>&1; then ok "$t"; else cat "$LOG/$(echo "$t" | tr / _).log" | tail -30; bad "$t"; fi
done

step "oracle tests (pytest, one worker per core), the CUDA backend on the CPU emulator among them"
# pytest-xdist, a test file per worker at a time (--dist loadfile: a file's tests run in
# order, on one worker, as they do alone). The emulated CUDA backend's file is one of them
# (its tests run single-threaded; its fixture finds the emulator built above). README,
# "Tests", has the figures.
SMP_BUILD="$ROOT/build" SMP_BUILD_SAN="$ROOT/build/asan" "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 \
    -n "$JOBS" --dist loadfile tests/oracle
rc=$?
if [ $rc -eq 0 ]; then ok "pytest tests/oracle"; else bad "pytest tests/oracle (exit $rc)"; fi

step "the commands end to end under ASan + UBSan"
SMP_BUILD="$ROOT/build/asan" "$PY" -m pytest -q -p no:cacheprovider tests/oracle/test_roundtrip.py tests/oracle/test_init.py
rc=$?
if [ $rc -eq 0 ]; then ok "round trips under the sanitizers"; else bad "round trips under the sanitizers (exit $rc)"; fi

step "fuzzers: replay the seed corpus, then ${FUZZ_SECONDS}s of fresh inputs each"
for f in build/fuzz/bin/fuzz_*; do
    [ -x "$f" ] || continue
    name=${f##*/fuzz_}
    work=$(mktemp -d)
    if "$f" -runs=0 "tests/fuzz/corpus/$name" >"$LOG/fuzz-$name-replay.log" 2>&1 &&
       "$f" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
            "$work" "tests/fuzz/corpus/$name" >"$LOG/fuzz-$name.log" 2>&1; then
        runs=$(grep -oE "Done [0-9]+ runs" "$LOG/fuzz-$name.log" | grep -oE "[0-9]+")
        ok "fuzz_$name: corpus replayed, $runs executions without a crash"
    else
        tail -40 "$LOG/fuzz-$name.log"; bad "fuzz_$name"
    fi
    rm -rf "$work"
done

step "GPU programs (skip without a GPU)"
gpu_program() {  # a program that prints SKIP and exits 0 where there is no GPU
    local exe=$1
    if [ ! -x "$exe" ]; then echo "${exe##*/} not built (no nvcc): nothing to run"; return; fi
    out=$("$exe" 2>&1); rc=$?
    echo "$out" | tail -5
    if [ $rc -ne 0 ]; then bad "${exe##*/} (exit $rc)"
    elif echo "$out" | grep -q "SKIP"; then echo "(not counted: no GPU here)"
    else ok "${exe##*/}"; fi
}
gpu_program build/bin/smp-gpu-parity
gpu_program build/bin/smp-nccl-test
gpu_program build/bin/smp-dev-check
gpu_program build/bin/smp-gpu-bench

step "tools/gpu-check's own build, as on a GPU machine without the host's libraries"
# the GPU machine has the CUDA toolkit, gcc and libc, and none of jansson, HDF5, zstd,
# BLAS, MPI or xxhash (the first GPU run's build stopped at jansson.h): their headers, shadowed
# by ones that fail (CPATH comes before the system's folders), must not be needed
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then
    poison=$(mktemp -d)
    for h in jansson.h hdf5.h H5public.h zstd.h cblas.h mpi.h xxhash.h; do
        echo "#error \"$h: not on the GPU machine (tools/gpu-check builds without it)\"" >"$poison/$h"
    done
    if CPATH=$poison GPU_CHECK_BUILD_ONLY=1 GPU_CHECK_E2E=0 tools/gpu-check "$LOG/gpu-check-build" >"$LOG/gpu-check-build.log" 2>&1; then
        ok "gpu-check builds without the host's libraries ($(grep -E '^build:' "$LOG/gpu-check-build/gpu-check.txt"))"
    else
        tail -30 "$LOG/gpu-check-build.log"; bad "gpu-check's build"
    fi
    rm -rf "$poison"
else
    echo "no nvcc: gpu-check's build not tried"
fi

step "the CUDA backend on the CPU emulator: every op against its C op, the backend against the C one"
if tools/emu-check >"$LOG/emu-check.log" 2>&1; then
    ok "emu-check ($(grep -E "^(parity|dev-check|nccl):" "$LOG/emu-check.log" | tr '\n' ' '))"
else
    cat "$LOG/emu-check.log"; bad "emu-check"
fi

step_time
echo
for f in "${failures[@]}"; do echo "failed: $f"; done
echo "time: ${SECONDS} s in all"
echo "suites: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
