# Sourced by the benchmarks (convert.sh, read.sh) from the repository root: where
# things are. Sets ROOT, CACHE (the first argument, default /tmp/smp-bench), BIN
# (SMP_BIN, default build/bin) and PY (SMP_PY, default the oracle venv under
# ~/.cache/smp, made by tools/bootstrap.sh when missing), and installs GNU time (for
# peak RSS) when it is missing.
ROOT=$PWD
CACHE=${1:-/tmp/smp-bench}
BIN=${SMP_BIN:-$ROOT/build/bin}
PY=${SMP_PY:-$(ls -d "$HOME"/.cache/smp/venv-*/bin/python 2>/dev/null | head -1 || true)}
if [ -z "$PY" ] || [ ! -x "$PY" ]; then PY="$(tools/bootstrap.sh | tail -1)/bin/python"; fi
if [ ! -x /usr/bin/time ]; then
    echo "installing GNU time (for peak RSS)"; apt-get install -y time >/dev/null
fi
