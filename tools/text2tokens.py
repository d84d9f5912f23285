#!/usr/bin/env python3
"""text2tokens: text files -> byte-level tokens in llm.c's token file format.

Tokenizer: token b (0..255) is the byte b of the UTF-8 (or any) text, as is; token
256 is the end-of-text marker, written after each input file with --eot. A model
for these tokens needs vocab_size >= 256 (>= 257 with --eot).

Output: llm.c's format: a header of 256 little-endian int32 (magic 20240520,
version 1, token count), then the tokens as uint16.

    python3 tools/text2tokens.py [--eot] [--val-fraction F --val-out VAL.bin] OUT.bin IN.txt [IN2.txt ...]

With --val-fraction, the last fraction F of the tokens goes to VAL.bin instead.
Plain Python, no dependencies.
"""
import argparse
import array
import sys

from atomic_write import write_atomically

MAGIC, VERSION, EOT = 20240520, 1, 256


def fail(msg, code):
    print("text2tokens: error: " + msg, file=sys.stderr)
    sys.exit(code)


def write_tokens(path, toks):
    header = array.array("i", [0] * 256)
    header[0], header[1], header[2] = MAGIC, VERSION, len(toks)
    body = array.array("H", toks)
    if sys.byteorder != "little":
        header.byteswap()
        body.byteswap()
    write_atomically(path, (header.tobytes(), body.tobytes()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--eot", action="store_true", help="append token 256 after each file")
    ap.add_argument("--val-fraction", type=float, default=0.0)
    ap.add_argument("--val-out")
    a = ap.parse_args(argv)
    if a.val_fraction and not a.val_out:
        ap.error("--val-fraction needs --val-out")
    if not 0.0 <= a.val_fraction < 1.0:
        ap.error("--val-fraction must be in [0, 1)")
    toks = array.array("H")
    try:
        for p in a.inputs:
            with open(p, "rb") as f:  # a FIFO too: `<(zcat corpus.gz)` is an input
                toks.extend(f.read())
            if a.eot:
                toks.append(EOT)
        if len(toks) > 2**31 - 1:
            fail("more than 2^31-1 tokens: split the input", 3)
        if not toks:  # an empty token file would fail later, in smp-train, farther from the cause
            fail("no token: the inputs are empty", 3)
        n_val = int(len(toks) * a.val_fraction)
        if a.val_out and not n_val:
            fail("--val-fraction %g of %d tokens leaves --val-out no token" % (a.val_fraction, len(toks)), 2)
        train = toks[: len(toks) - n_val]
        write_tokens(a.out, train)
        if a.val_out:
            write_tokens(a.val_out, toks[len(toks) - n_val:])
    except OSError as e:
        fail("%s: %s" % (e.filename, e.strerror or e), 1)
    print(f"{a.out}: {len(train)} tokens" + (f"; {a.val_out}: {n_val} tokens" if a.val_out else ""))


if __name__ == "__main__":
    main()
