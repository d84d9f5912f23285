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
import os
import sys

from atomic_write import interruptible, write_atomically

MAGIC, VERSION, EOT = 20240520, 1, 256


def fail(msg, code):
    print("text2tokens: error: " + msg, file=sys.stderr)
    sys.exit(code)


CHUNK = int(os.environ.get("SMP_TEXT2TOKENS_CHUNK", 1 << 26))  # bytes read at a time (tests make it small)


def write_tokens(path, body):
    """body: the tokens' little-endian uint16 bytes (a memoryview: not copied)"""
    header = array.array("i", [0] * 256)
    header[0], header[1], header[2] = MAGIC, VERSION, len(body) // 2
    if sys.byteorder != "little":
        header.byteswap()
    write_atomically(path, (header.tobytes(), body))


def widen_into(toks, data):
    """the tokens of data (each byte one) appended to toks as little-endian uint16
    bytes: the byte, then a zero (an extended slice's copy in C: appending byte by byte
    to an array took 9.1 s and 2.1 GB for 270 MB of text)"""
    at = len(toks)
    toks.extend(bytes(2 * len(data)))
    toks[at::2] = data


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
    toks = bytearray()  # little-endian uint16
    try:
        for p in a.inputs:
            with open(p, "rb") as f:  # a FIFO too: `<(zcat corpus.gz)` is an input
                while data := f.read(CHUNK):
                    widen_into(toks, data)
            if a.eot:
                toks += EOT.to_bytes(2, "little")
        n = len(toks) // 2
        if n > 2**31 - 1:
            fail("more than 2^31-1 tokens: split the input", 3)
        if not n:  # an empty token file would fail later, in smp-train, farther from the cause
            fail("no token: the inputs are empty", 3)
        n_val = int(n * a.val_fraction)
        if a.val_out and not n_val:
            fail("--val-fraction %g of %d tokens leaves --val-out no token" % (a.val_fraction, n), 2)
        train = n - n_val
        body = memoryview(toks)
        write_tokens(a.out, body[: 2 * train])
        if a.val_out:
            write_tokens(a.val_out, body[2 * train:])
    except OSError as e:
        fail("%s: %s" % (e.filename, e.strerror or e), 1)
    print(f"{a.out}: {train} tokens" + (f"; {a.val_out}: {n_val} tokens" if a.val_out else ""))


if __name__ == "__main__":
    interruptible("text2tokens", main)
