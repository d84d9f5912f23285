#!/usr/bin/env python3
"""tokenize_hf: text files -> tokens of a Hugging Face tokenizer, in llm.c's format.

    python tools/tokenize_hf.py --tokenizer MODEL_DIR [--eot] OUT.bin IN.txt [IN2.txt ...]

The tokenizer is loaded from a local folder (transformers.AutoTokenizer, no network).
Each file is encoded without special tokens; --eot appends the tokenizer's eos token
after each file. Output: llm.c's header of 256 int32 (magic 20240520 version 1 with
uint16 tokens when the vocabulary fits, else magic 20240801 version 7 with uint32),
then the tokens. A model trained on them needs vocab_size >= len(tokenizer).
"""
import argparse
import sys

import numpy as np

from atomic_write import write_atomically


def header(magic, version, count):
    """llm.c's file header: 256 little-endian int32, the first three magic, version, count."""
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, count
    return h.tobytes()


def write_tokens(path, toks, vocab):
    u16 = vocab <= 65536
    write_atomically(path, (header(*((20240520, 1) if u16 else (20240801, 7)), len(toks)),
                            np.asarray(toks, dtype="<u2" if u16 else "<u4").tobytes()))


def write_mask(path, mask):
    """The loss mask of a token file: magic 20241201 version 1, then one uint8 per token
    (1: the token is a target, 0: not)."""
    write_atomically(path, (header(20241201, 1, len(mask)), np.asarray(mask, dtype=np.uint8).tobytes()))


def fail(msg, code):
    print("tokenize_hf: error: " + msg, file=sys.stderr)
    sys.exit(code)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local folder with the tokenizer files")
    ap.add_argument("--eot", action="store_true", help="append the eos token after each file")
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    except (OSError, ValueError) as e:
        fail("%s: cannot load the tokenizer: %s" % (a.tokenizer, e), 1)
    if a.eot and tok.eos_token_id is None:
        fail("%s: the tokenizer has no eos token for --eot" % a.tokenizer, 2)
    ids = []
    try:
        for p in a.inputs:
            with open(p, encoding="utf-8") as f:
                try:
                    text = f.read()
                except UnicodeDecodeError as e:
                    fail("%s: not UTF-8 text (byte %d)" % (p, e.start), 3)
            ids.extend(tok.encode(text, add_special_tokens=False))
            if a.eot:
                ids.append(tok.eos_token_id)
        if len(ids) > 2**31 - 1:
            fail("more than 2^31-1 tokens: split the input", 3)
        if not ids:  # an empty token file would fail later, in smp-train, farther from the cause
            fail("no token: the inputs are empty", 3)
        write_tokens(a.out, ids, len(tok))
    except OSError as e:
        fail("%s: %s" % (e.filename, e.strerror or e), 1)
    print(f"{a.out}: {len(ids)} tokens (vocabulary {len(tok)})")


if __name__ == "__main__":
    main()
