#!/usr/bin/env bash
# The oracle suite's wall time under OpenBLAS's own kernel pick and under smp's (not a
# test): tests/oracle, all but the emulated CUDA backend (as tools/test.sh runs it),
# twice per round, in turns (the first round OpenBLAS's pick first, the next smp's), so
# that a busy moment of the machine hits both.
#
#   bash tools/bench/suite.sh [ROUNDS]      (default 1; build first: scons -Q)
#
# "OpenBLAS's pick": OPENBLAS_CORETYPE set to the core OpenBLAS picks alone on this CPU
# (smp-train keeps a setting it finds), so the suite runs as it did before smp made its
# own pick (backends/c/blas_pick.c). "smp's pick": OPENBLAS_CORETYPE unset. Where the
# two are the same kernels (OpenBLAS knows the CPU) the script says so and stops.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/bench/common.sh
. tools/bench/common.sh
ROUNDS=${1:-1}
unset OPENBLAS_CORETYPE
alone=$(env -u OPENBLAS_CORETYPE "$PY" -c "import ctypes, re, subprocess
lib = re.search(r'(/\S*libopenblas\S*)', subprocess.run(['ldd', '$BIN/smp-train'], capture_output=True, text=True).stdout).group(1)
f = ctypes.CDLL(lib).openblas_get_corename; f.restype = ctypes.c_char_p; print(f().decode())")
ours=$("$BIN/smp-train" --version | sed -n 's/.*(OpenBLAS \([^ ]*\) kernels).*/\1/p')
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); OpenBLAS alone: $alone; smp-train: $ours"
if [ "$alone" = "$ours" ]; then echo "the same kernels both ways: nothing to compare"; exit 0; fi
export SMP_BUILD="$ROOT/build" SMP_BUILD_SAN="$ROOT/build/asan" HF_HUB_OFFLINE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
declare -A T
suite() { # $1: label, $2: OPENBLAS_CORETYPE or empty
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    env ${2:+OPENBLAS_CORETYPE=$2} "$PY" -m pytest -q -p no:cacheprovider --ignore=tests/oracle/test_cuda_backend.py \
        tests/oracle >"/tmp/smp-suite-$1.log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    local s
    s=$(awk "BEGIN {print $t1 - $t0}")
    echo "  $1: $(printf %.1f "$s") s, $(tail -1 "/tmp/smp-suite-$1.log" | sed 's/=//g;s/^ *//') (exit $rc)"
    T[$1]="${T[$1]:-} $s"
}
for r in $(seq 1 "$ROUNDS"); do
    echo "round $r of $ROUNDS:"
    if [ $((r % 2)) = 1 ]; then suite alone "$alone"; suite smp ""; else suite smp ""; suite alone "$alone"; fi
done
med() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
a=$(echo "${T[alone]}" | med) s=$(echo "${T[smp]}" | med)
printf "oracle suite (median of %d): OpenBLAS's %s kernels %.1f s, smp's pick (%s) %.1f s: %.2fx\n" \
    "$ROUNDS" "$alone" "$a" "$ours" "$s" "$(awk "BEGIN {print $s / $a}")"
