#!/usr/bin/env python3
"""bench/attention.py: the C attention ops alone (op_attention_forward and _backward of
build/lib/libsmpkernels.so, causal, fp32), best of a few calls, at the shapes of
tools/bench/train.py's rows. Not a test.

    OMP_NUM_THREADS=2 python3 tools/bench/attention.py [--rounds N] [--shape B,T,H,KV,HD ...] [LIB ...]

Several libraries (e.g. a copy of an older build's libsmpkernels.so) run side by side:
each round runs every shape with each library in turn, the libraries' order reversed
every other round, so that a busy moment of the machine hits each of them; each
library's figure is the median over the rounds of its best call in the round (--rounds
1, the default: that best call), and with --rounds > 1 each round's figures follow.
OPENBLAS_CORETYPE is set as train.py sets it for smp-train.
"""
import argparse
import ctypes
import os
import statistics
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


def load_libs(paths=None):
    """The libraries named on the command line (default: this build's), and their paths;
    OPENBLAS_CORETYPE set first, as train.py sets it for smp-train."""
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    if "OPENBLAS_CORETYPE" not in os.environ and "avx512f" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"  # read by OpenBLAS when it loads
    paths = (sys.argv[1:] if paths is None else paths) or [str(ROOT / "build" / "lib" / "libsmpkernels.so")]
    return paths, [ctypes.CDLL(x) for x in paths]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every shape and library; medians reported")
    ap.add_argument("--shape", action="append", metavar="B,T,H,KV,HD",
                    help="a shape instead of the default ones (repeatable); calls: 3")
    ap.add_argument("libs", nargs="*", metavar="LIB", help="libsmpkernels.so files (default: this build's)")
    a = ap.parse_args()
    paths, libs = load_libs(a.libs)
    shapes = [tuple(int(x) for x in sh.split(",")) + (3,) for sh in a.shape] if a.shape else SHAPES
    if any(len(sh) != 6 for sh in shapes):
        ap.error("--shape takes five integers: B,T,H,KV,HD")
    times = {}  # (shape, path) -> [(forward, backward) of each round]
    for r in range(a.rounds):
        pairs = list(zip(paths, libs))
        for *shape, calls in shapes:
            for path, lib in (pairs if r % 2 == 0 else pairs[::-1]):
                times.setdefault((tuple(shape), path), []).append(run(lib, *shape, calls))
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'all')}, OPENBLAS_CORETYPE "
          f"{os.environ.get('OPENBLAS_CORETYPE', 'auto')}; best of the calls, ms"
          + (f"; median of {a.rounds} rounds (each round's forward / backward)" if a.rounds > 1 else ""))
    for *shape, calls in shapes:
        for path in paths:
            ts = times[(tuple(shape), path)]
            f, b = (statistics.median(t[i] for t in ts) for i in (0, 1))
            each = "   " + " ".join(f"{t[0] * 1e3:.1f}/{t[1] * 1e3:.1f}" for t in ts) if a.rounds > 1 else ""
            print(f"B,T,heads,kv,hd = {','.join(map(str, shape)):18s} forward {f * 1e3:7.1f}  "
                  f"backward {b * 1e3:7.1f}   {path}{each}")


if __name__ == "__main__":
    main()
