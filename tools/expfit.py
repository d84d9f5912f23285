#!/usr/bin/env python3
"""tools/expfit.py: the coefficients of kernels/simd.h's exps.

e^r on |r| <= ln2 / 2 (what is left of x after n ln2 is taken out) as
1 + r + r^2 (C0 + C1 r + ... + Cd r^d), fitted to the RELATIVE error of e^r by
iteratively reweighted least squares on Chebyshev nodes (close to minimax). Prints each
degree's worst relative error and its coefficients as floats: d = 4 (a degree-6
polynomial) is the first whose error (3e-9) is far below a float's half ulp (6e-8), so
simd.h uses it; Cephes' expf has d = 5. Needs numpy (the oracle venv has it).
"""
import numpy as np

HALF_LN2 = 0.34657359027997264


def fit(d, nodes=4001, rounds=60):
    r = np.cos(np.linspace(0.0, np.pi, nodes)) * HALF_LN2
    r = r[np.abs(r) > 1e-6]
    target = (np.expm1(r) - r) / r**2  # what the bracket must be
    A = np.stack([r**k for k in range(d + 1)], 1)
    scale = r**2 / np.exp(r)  # the bracket's error -> e^r's relative error
    w = np.ones_like(r)
    for _ in range(rounds):  # weigh up where the error peaks: towards equal ripples
        c, *_ = np.linalg.lstsq(A * (scale * w)[:, None], target * scale * w, rcond=None)
        err = np.abs((A @ c - target) * scale)
        w = w * (err / err.max()) ** 0.3 + 1e-9
    return c, err.max()


if __name__ == "__main__":
    for d in (3, 4, 5):
        c, e = fit(d)
        print(f"d = {d}: worst relative error {e:.2e}")
        for k, x in enumerate(c):
            print(f"  #define SMP_EXP_C{k} {np.float32(x):.10e}f")
