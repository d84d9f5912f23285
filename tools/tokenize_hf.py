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


def write_tokens(path, toks, vocab):
    u16 = vocab <= 65536
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = (20240520, 1, len(toks)) if u16 else (20240801, 7, len(toks))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(toks, dtype="<u2" if u16 else "<u4").tobytes())


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
