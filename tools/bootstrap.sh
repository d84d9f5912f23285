#!/usr/bin/env bash
# Install what smp needs on a fresh Debian 12 machine; safe to run again.
#   - Debian packages (build tools and libraries, Open MPI, OpenBLAS, python3-venv, valgrind and strace for two tests)
#   - a Python venv with the pinned oracle packages (torch, transformers, ... all from PyPI;
#     torch's wheel brings its CUDA libraries, ~5.8 GB), kept OUTSIDE the clone in
#     ~/.cache/smp/venv-<hash of tests/requirements.txt + python version>, built once per
#     hash, so reruns and fresh clones reuse it
# Prints the venv's path on its last line (callers: VENV=$(tools/bootstrap.sh | tail -1)).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS="scons gcc clang libclang-rt-14-dev pkg-config libhdf5-dev libzstd-dev libjansson-dev libxxhash-dev
      libcmocka-dev libopenblas-dev libopenblas0-openmp libopenmpi-dev openmpi-bin python3-venv valgrind strace"
missing=()
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing Debian packages: ${missing[*]}" >&2
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
fi

PY=/usr/bin/python3  # Debian's python 3.11; the venv does not see its site packages
hash=$( (cat tests/requirements.txt; $PY --version) | sha256sum | cut -c1-16)
VENV="${SMP_VENV:-$HOME/.cache/smp/venv-$hash}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "bootstrap: creating the oracle venv in $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    $PY -m venv "$VENV" >&2
    "$VENV/bin/pip" install -q --disable-pip-version-check -r tests/requirements.txt >&2
    "$VENV/bin/python" -c "import torch, transformers, safetensors, ml_dtypes, h5py, hdf5plugin, numpy, xdist" >&2
    touch "$VENV/.complete"
fi
echo "$VENV"
