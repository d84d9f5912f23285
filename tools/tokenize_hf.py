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


def header(magic, version, count):
    """llm.c's file header: 256 little-endian int32, the first three magic, version, count."""
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, count
    return h.tobytes()


def write_tokens(path, toks, vocab):
    u16 = vocab <= 65536
    with open(path, "wb") as f:
        f.write(header(*((20240520, 1) if u16 else (20240801, 7)), len(toks)))
        f.write(np.asarray(toks, dtype="<u2" if u16 else "<u4").tobytes())


def write_mask(path, mask):
    """The loss mask of a token file: magic 20241201 version 1, then one uint8 per token
    (1: the token is a target, 0: not)."""
    with open(path, "wb") as f:
        f.write(header(20241201, 1, len(mask)))
        f.write(np.asarray(mask, dtype=np.uint8).tobytes())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local folder with the tokenizer files")
    ap.add_argument("--eot", action="store_true", help="append the eos token after each file")
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    if a.eot and tok.eos_token_id is None:
        sys.exit("tokenize_hf: error: %s: the tokenizer has no eos token for --eot" % a.tokenizer)
    ids = []
    for p in a.inputs:
        with open(p, encoding="utf-8") as f:
            ids.extend(tok.encode(f.read(), add_special_tokens=False))
        if a.eot:
            ids.append(tok.eos_token_id)
    if len(ids) > 2**31 - 1:
        sys.exit("tokenize_hf: error: more than 2^31-1 tokens: split the input")
    write_tokens(a.out, ids, len(tok))
    print(f"{a.out}: {len(ids)} tokens (vocabulary {len(tok)})")


if __name__ == "__main__":
    main()
