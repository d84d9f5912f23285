#!/usr/bin/env python3
"""bench/attention.py: the C attention ops alone (op_attention_forward and _backward of
build/lib/libsmpkernels.so, causal, fp32), best of a few calls, at the shapes of
tools/bench/train.py's rows. Not a test.

    OMP_NUM_THREADS=2 python3 tools/bench/attention.py [LIB ...]

Several libraries (e.g. a copy of an older build's libsmpkernels.so) run side by side,
in rounds, so that a busy moment of the machine hits each of them. OPENBLAS_CORETYPE is
set as train.py sets it for smp-train.
"""
import ctypes
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPES = [  # B, T, heads, kv heads, head dim, calls
    (8, 256, 8, 4, 32, 20),
    (1, 4096, 8, 4, 32, 5),
    (1, 4096, 8, 4, 64, 3),
    (1, 16384, 4, 4, 16, 2),  # tools/bench/long.sh's heads of 16, a cp rank's share of its sequence
]


def run(lib, B, T, nh, nkv, hd, calls):
    r = np.random.default_rng(0)
    q, g = (r.standard_normal((B, T, nh, hd), dtype=np.float32) for _ in range(2))
    k, v = (r.standard_normal((B, T, nkv, hd), dtype=np.float32) for _ in range(2))
    out, lse = np.zeros_like(q), np.zeros((B, nh, T), np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    pos = np.arange(T, dtype=np.int32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    dims = [ctypes.c_int(x) for x in (B, T, T, nh, nkv, hd, 0)]
    fwd = lambda: lib.op_attention_forward(p(out), p(lse), p(q), p(k), p(v), p(pos), p(pos), None, None, *dims)
    bwd = lambda: lib.op_attention_backward(p(dq), p(dk), p(dv), p(g), p(q), p(k), p(v), p(out), p(lse),
                                            p(pos), p(pos), None, None, *dims)
    fwd()
    best = [float("inf"), float("inf")]
    for _ in range(calls):
        for n, f in enumerate((fwd, bwd)):
            t0 = time.perf_counter()
            f()
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def load_libs():
    """The libraries named on the command line (default: this build's), and their paths;
    OPENBLAS_CORETYPE set first, as train.py sets it for smp-train."""
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    if "OPENBLAS_CORETYPE" not in os.environ and "avx512f" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"  # read by OpenBLAS when it loads
    paths = sys.argv[1:] or [str(ROOT / "build" / "lib" / "libsmpkernels.so")]
    return paths, [ctypes.CDLL(x) for x in paths]


def main():
    paths, libs = load_libs()
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'all')}, OPENBLAS_CORETYPE "
          f"{os.environ.get('OPENBLAS_CORETYPE', 'auto')}; best of the calls, ms")
    for *shape, calls in SHAPES:
        for path, lib in zip(paths, libs):
            f, b = run(lib, *shape, calls)
            print(f"B,T,heads,kv,hd = {','.join(map(str, shape)):18s} forward {f * 1e3:7.1f}  "
                  f"backward {b * 1e3:7.1f}   {path}")


if __name__ == "__main__":
    main()
