#!/usr/bin/env python3
"""bench/linear.py: the C linear ops alone (op_linear_forward and _backward of
build/lib/libsmpkernels.so, fp32), at the products of one training step of
tools/bench/train.py's 5 M model (8 x 256 tokens: hidden 256, 8 heads of 32, 4 kv
heads, intermediate 704, vocab 4096). Best of a few calls per product, GFLOP/s, and
the step's sum (each product times its count in the step). Not a test.

    OMP_NUM_THREADS=2 python3 tools/bench/linear.py [LIB ...]
    (SMP_LINEAR_ROWS, SMP_LINEAR_LAYERS: another step's rows and layers)

Several libraries (e.g. a copy of an older build's libsmpkernels.so with its
libshard.so beside it) run side by side, in rounds, so that a busy moment of the
machine hits each of them; OPENBLAS_CORETYPE is set as attention.py sets it.
"""
import ctypes
import os
import time

import numpy as np

from attention import load_libs  # this folder's (the script's own folder is on sys.path)

# the rows (tokens) and layers of the step: train.py's 8 x 256 by default; e.g. its
# 1 x 4096 run with SMP_LINEAR_ROWS=4096 SMP_LINEAR_LAYERS=2
N = int(os.environ.get("SMP_LINEAR_ROWS", 8 * 256))
LAYERS = int(os.environ.get("SMP_LINEAR_LAYERS", 4))
LINEARS = [  # IN, OUT, per step: q, k and v, o, gate and up, down, the head
    (256, 256, 2 * LAYERS), (256, 128, 2 * LAYERS), (256, 704, 2 * LAYERS), (704, 256, LAYERS), (256, 4096, 1)]
PARTS = ("forward", "dinp", "dweight")
ROUNDS, CALLS = 3, 5


def best_ms(lib, IN, OUT):
    r = np.random.default_rng(0)
    x, g = r.standard_normal((N, IN), dtype=np.float32), r.standard_normal((N, OUT), dtype=np.float32)
    w = r.standard_normal((OUT, IN), dtype=np.float32)
    y, dx, dw = np.zeros((N, OUT), np.float32), np.zeros_like(x), np.zeros_like(w)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    dims = [ctypes.c_int(v) for v in (N, IN, OUT)]
    calls = (lambda: lib.op_linear_forward(p(y), p(x), p(w), *dims),
             lambda: lib.op_linear_backward(p(dx), None, p(g), p(x), p(w), *dims),
             lambda: lib.op_linear_backward(None, p(dw), p(g), p(x), p(w), *dims))
    best = [float("inf")] * 3
    for _ in range(CALLS):
        for i, f in enumerate(calls):
            t0 = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main():
    paths, libs = load_libs()
    ms = {}  # (lib, shape) -> best of the rounds' bests, per part
    for _ in range(ROUNDS):
        for li, lib in enumerate(libs):
            for IN, OUT, _n in LINEARS:
                got = best_ms(lib, IN, OUT)
                old = ms.get((li, IN, OUT), got)
                ms[li, IN, OUT] = [min(a, b) for a, b in zip(old, got)]
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'all')}, OPENBLAS_CORETYPE "
          f"{os.environ.get('OPENBLAS_CORETYPE', 'auto')}; {N} rows; GFLOP/s (best of {ROUNDS} x {CALLS} calls)")
    for li, path in enumerate(paths):
        print(path)
        step = 0.0
        for IN, OUT, n in LINEARS:
            t = ms[li, IN, OUT]
            step += n * sum(t)
            rates = "  ".join(f"{part} {2 * N * IN * OUT / (x * 1e6):5.0f}" for part, x in zip(PARTS, t))
            print(f"  IN {IN:4d} OUT {OUT:4d} (x{n}):  {rates}")
        flops = sum(n * 3 * 2 * N * IN * OUT for IN, OUT, n in LINEARS)
        print(f"  the step's products: {step:.1f} ms, {flops / (step * 1e6):.0f} GFLOP/s")


if __name__ == "__main__":
    main()
