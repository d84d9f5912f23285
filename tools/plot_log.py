#!/usr/bin/env python3
"""plot_log: smp-train's log (JSON lines) -> a PNG of loss and tokens/s over steps.

    python3 tools/plot_log.py RUN.jsonl [-o RUN.png] [--width 900 --height 600]

Uses matplotlib when it is installed; otherwise draws the two panels itself (plain
Python, zlib) with axes, ticks and labels in a small built-in bitmap font, so the
plot works on a bare machine. Skipped steps (loss null) are left out; val_loss, when
logged, is drawn in a second colour.
"""
import argparse
import json
import math
import struct
import sys
import zlib


def read_log(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_log: error: {path}:{n}: not JSON: {e}")
    if not rows:
        sys.exit(f"plot_log: error: {path}: no log lines")
    return rows


def series(rows, key):
    """(step, value) by step. A run resumed from an older checkpoint logs its steps again
    after the abandoned ones: the last line of a step is the run as it stands."""
    last = {}
    for r in rows:
        if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), int):
            last[r["step"]] = r[key]
    return sorted(last.items())


# ---- a tiny raster canvas -------------------------------------------------------
# 3x5 digits and the few letters the labels use
FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111101110111", "k": "100101110101101", "M": "101111111101101", " ": "000000000000000",
    "l": "110010010010111", "o": "000111101101111", "s": "000111100001111", "t": "010111010010011",
    "p": "000111101111100", "/": "001001010100100", "v": "000101101101010", "a": "000111011101111",
    "x": "000101010101101", "n": "000110101101101", "c": "000111100100111", "i": "010000010010010",
    "r": "000111100100100", "g": "000111101111001", "d": "001111101101111", "h": "100111101101101",
    "u": "000101101101111", "m": "000111111101101", "f": "011100110100100", "y": "101101111001111",
    "w": "000101101111111", "b": "100111101101111", "q": "000111101111001", "j": "001000001101111",
    "+": "000010111010000",
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def set(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def line(self, x0, y0, x1, y1, c, thick=1):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            x = round(x0 + (x1 - x0) * k / n)
            y = round(y0 + (y1 - y0) * k / n)
            for dx in range(thick):
                for dy in range(thick):
                    self.set(x + dx, y + dy, c)

    def text(self, x, y, s, c=(0, 0, 0), scale=2):
        for ch in s:
            g = FONT.get(ch, FONT[" "])
            for r in range(5):
                for q in range(3):
                    if g[r * 3 + q] == "1":
                        for a in range(scale):
                            for b in range(scale):
                                self.set(x + q * scale + a, y + r * scale + b, c)
            x += 4 * scale

    def png(self, path):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(t, d):
            return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)) +
                    chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def fmt(v, step):
    """v as a tick label, to the digits that tell it from a tick step away (tokens/s of
    4391 read "4.39e+03", in a font without "+", and a flat series' ticks all alike)."""
    unit, suffix = (1e6, "M") if abs(v) >= 1e6 else (1e3, "k") if abs(v) >= 1e4 else (1, "")
    digits = max(0, 1 - math.floor(math.log10(step / unit))) if step > 0 else 3
    if v == 0:
        return "0"
    if digits > 8:  # tiny values
        return f"{v:.2e}"
    return f"{v / unit:.{digits}f}{suffix}"


def ticks(lo, hi, n=5):
    """n evenly spaced values from lo to hi with their labels, no two alike"""
    step = (hi - lo) / (n - 1)
    return [(lo + step * k, fmt(lo + step * k, step)) for k in range(n)]


def panel(cv, box, title, sets, xmax):
    x0, y0, x1, y1 = box
    pts = [p for s, _ in sets for p in s]
    if not pts:
        cv.text(x0, y0 - 20, title + " none")
        return
    ys = [y for _, y in pts]
    lo, hi = min(ys), max(ys)
    if hi == lo:  # a flat series: 5% either side
        hi, lo = hi + (abs(hi) * 0.05 or 1), lo - (abs(lo) * 0.05 or 1)
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    xmin = min(x for x, _ in pts)
    xspan = max(xmax - xmin, 1)
    X = lambda x: x0 + (x - xmin) * (x1 - x0) / xspan  # noqa: E731
    Y = lambda y: y1 - (y - lo) * (y1 - y0) / (hi - lo)  # noqa: E731
    grey, black = (200, 200, 200), (0, 0, 0)
    for yv, label in ticks(lo, hi):
        cv.line(x0, round(Y(yv)), x1, round(Y(yv)), grey)
        cv.text(4, round(Y(yv)) - 5, label)
    for xv, label in ticks(xmin, xmin + xspan):
        cv.line(round(X(xv)), y0, round(X(xv)), y1, grey)
        cv.text(min(round(X(xv)) - 8, cv.w - 8 * len(label)), y1 + 8, label)  # the last one inside the canvas
    cv.line(x0, y1, x1, y1, black)
    cv.line(x0, y0, x0, y1, black)
    cv.text(x0, y0 - 18, title)
    for s, col in sets:
        for (a, b), (c, d) in zip(s, s[1:]):
            cv.line(round(X(a)), round(Y(b)), round(X(c)), round(Y(d)), col, 2)
        if len(s) == 1:
            cv.line(round(X(s[0][0])), round(Y(s[0][1])), round(X(s[0][0])) + 1, round(Y(s[0][1])), col, 3)


def plot_builtin(rows, out, w, h):
    cv = Canvas(w, h)
    xmax = max(r["step"] for r in rows)
    left, right = 90, w - 20
    mid = h // 2
    panel(cv, (left, 30, right, mid - 30), "loss", [(series(rows, "loss"), (31, 119, 180)),
                                                    (series(rows, "val_loss"), (255, 127, 14))], xmax)
    panel(cv, (left, mid + 30, right, h - 30), "tokens/s", [(series(rows, "tokens_per_s"), (44, 160, 44))], xmax)
    cv.text(right - 32, h - 12, "step")
    cv.png(out)


def plot_matplotlib(rows, out, w, h):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(w / 100, h / 100), dpi=100, sharex=True)
    for key, lab in (("loss", "train"), ("val_loss", "val")):
        s = series(rows, key)
        if s:
            a.plot(*zip(*s), label=lab)
    a.set_ylabel("loss")
    a.legend()
    s = series(rows, "tokens_per_s")
    if s:
        b.plot(*zip(*s), color="tab:green")
    b.set_ylabel("tokens/s")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("-o", "--out")
    ap.add_argument("--width", type=int, default=900)
    ap.add_argument("--height", type=int, default=600)
    ap.add_argument("--builtin", action="store_true", help="draw without matplotlib even when it is installed")
    a = ap.parse_args(argv)
    out = a.out or (a.log.rsplit(".", 1)[0] + ".png")
    try:
        rows = read_log(a.log)
        try:
            if a.builtin:
                raise ImportError
            plot_matplotlib(rows, out, a.width, a.height)
        except ImportError:
            plot_builtin(rows, out, a.width, a.height)
    except OSError as e:  # a log or an output that cannot be read or written: one line
        sys.exit(f"plot_log: error: {e.filename or out}: {e.strerror or e}")
    except UnicodeDecodeError as e:
        sys.exit(f"plot_log: error: {a.log}: not text (byte {e.start})")
    print(out)


if __name__ == "__main__":
    main()
