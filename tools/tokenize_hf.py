#!/usr/bin/env python3
"""tokenize_hf: text files -> tokens of a Hugging Face tokenizer, in llm.c's format.

    python tools/tokenize_hf.py --tokenizer MODEL_DIR [--eot] OUT.bin IN.txt [IN2.txt ...]

The tokenizer is loaded from a local folder (transformers.AutoTokenizer, no network).
Each file is encoded without special tokens; --eot appends the tokenizer's eos token
after each file. A file is read and encoded a piece of about 1 MB at a time, cut at a
line end followed by a non-space where the tokenizer's tokens do not cross (checked on
the text round each cut: encoded whole it gives the tokens of its two sides), so the
tokens are those of the file encoded whole while memory holds about one piece's
encoding per core (up to 8, encoded together on the tokenizer's threads, across files;
an encoding keeps every token's string and offsets: 50 MB of text encoded whole took
8.3 GB and 64 s). A piece after the first is encoded after the line end that precedes
it in the file, whose tokens are then dropped: a SentencePiece tokenizer (Llama 2,
Mistral) puts its prefix space only at the start of a text, so a piece encoded alone
would begin with a token the whole file does not have. Where no cut is found in a piece's last
2 MB the piece grows (the file encoded whole at worst, as before).

Output: llm.c's header of 256 int32 (magic 20240520 version 1 with uint16 tokens when
the vocabulary fits, else magic 20240801 version 7 with uint32), then the tokens. A
model trained on them needs vocab_size >= len(tokenizer).
"""
import argparse
import os
import re
import sys

import numpy as np

from atomic_write import write_atomically


def header(magic, version, count):
    """llm.c's file header: 256 little-endian int32, the first three magic, version, count."""
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, count
    return h.tobytes()


def token_dtype(vocab):
    """uint16 tokens when the vocabulary fits, else uint32"""
    return "<u2" if vocab <= 65536 else "<u4"


def write_token_parts(path, parts, vocab):
    """a token file of the arrays parts (of token_dtype(vocab)), one after the other"""
    u16 = token_dtype(vocab) == "<u2"
    write_atomically(path, [header(*((20240520, 1) if u16 else (20240801, 7)), sum(x.size for x in parts))] +
                     [x.tobytes() for x in parts])


def write_tokens(path, toks, vocab):
    write_token_parts(path, [np.asarray(toks, dtype=token_dtype(vocab))], vocab)


def write_mask(path, mask):
    """The loss mask of a token file: magic 20241201 version 1, then one uint8 per token
    (1: the token is a target, 0: not)."""
    write_atomically(path, (header(20241201, 1, len(mask)), np.asarray(mask, dtype=np.uint8).tobytes()))


def fail(msg, code):
    print("tokenize_hf: error: " + msg, file=sys.stderr)
    sys.exit(code)


PIECE = int(os.environ.get("SMP_TOKENIZE_PIECE", 1 << 20))  # bytes read at a time (tests make it small)
WINDOW = 1024  # characters each side of a cut that must encode alike whole and apart
BATCH = min(os.cpu_count() or 1, 8)  # pieces encoded together (memory: about one encoding a piece)
SAFE = re.compile(r"\n(?=\S)")  # a line end, then text: where tokenizers' pre-tokens end


def utf8_whole(data):
    """data cut before a UTF-8 sequence its end leaves incomplete: (whole, rest)"""
    j, n = len(data) - 1, 0
    while j >= 0 and n < 3 and data[j] & 0xC0 == 0x80:
        j, n = j - 1, n + 1
    if j >= 0 and data[j] >= 0xC0 and len(data) - j < (2 if data[j] < 0xE0 else 3 if data[j] < 0xF0 else 4):
        return data[:j], data[j:]
    return data, b""


LEAD = "\n"  # the character before every cut (SAFE): later pieces are encoded after it


def after_lead(lead, ids):
    """ids of LEAD + a piece with the lead's own tokens (lead) dropped, or None where
    the piece's first token merged with them"""
    return ids[len(lead):] if ids[:len(lead)] == lead else None


def cuts_alike(encode, lead, text, at):
    """whether the tokens do not cross `at`: the window round it, encoded whole, gives
    the tokens of its left side and of its right side encoded after LEAD"""
    a, b = max(0, at - WINDOW), at + WINDOW
    right = after_lead(lead, encode(LEAD + text[at:b]))
    return right is not None and encode(text[a:b]) == encode(text[a:at]) + right


def cut_in(encode, lead, text):
    """the last of a few line ends in text's second half (its last two pieces at most:
    text that found no cut grows, and is not searched again) that encoding does not
    cross (with a window's text after it), or None"""
    tried = 0
    for m in reversed(list(SAFE.finditer(text, max(len(text) // 2, len(text) - 2 * PIECE), len(text) - WINDOW))):
        if cuts_alike(encode, lead, text, m.end()):
            return m.end()
        tried += 1
        if tried == 8:
            return None
    return None


class Pieces:
    """The token arrays of the inputs, in order. Pieces of text wait and are encoded
    BATCH at a time (encode_many: the tokenizer's threads take one each), across files
    (a file shorter than a piece does not encode alone), every piece but a file's first
    after LEAD (its tokens then dropped); arrays given whole (an eos) keep their place."""

    def __init__(self, encode, encode_many, dtype):
        self.encode_many, self.dtype, self.lead = encode_many, dtype, encode(LEAD)
        self.out, self.waiting, self.ntext, self.texts = [], [], 0, 0

    def text(self, path, t, first):
        self.waiting.append((path, t, first))
        self.ntext += 1
        self.texts += 1
        if self.ntext == BATCH:
            self.flush()

    def ids(self, arr):
        self.waiting.append((None, arr, None))

    def flush(self):
        enc = iter(self.encode_many([t if first else LEAD + t for path, t, first in self.waiting if path]))
        for path, t, first in self.waiting:
            if path is None:
                self.out.append(t)
                continue
            ids = next(enc)
            ids = ids if first else after_lead(self.lead, ids)
            if ids is None:  # the window round its cut said otherwise: a tokenizer no window sees whole
                fail("%s: a piece's first token merged with the line end before it, which the text round "
                     "its cut did not: this tokenizer cannot be read a piece at a time" % path, 1)
            self.out.append(np.asarray(ids, dtype=self.dtype))
        self.waiting.clear()
        self.ntext = 0


def encode_file(f, path, encode, pieces):
    """binary file f's text (line ends read as Python's text mode reads them) given to
    pieces a piece at a time, cut where its tokens are those of the text encoded whole;
    exits 3 on text that is not UTF-8, naming its byte."""
    text, rest, at, cr, first = "", b"", 0, "", True
    while True:
        data = f.read(PIECE)
        whole, rest = utf8_whole(rest + data) if data else (rest, b"")
        try:
            new = cr + whole.decode("utf-8")
        except UnicodeDecodeError as e:
            fail("%s: not UTF-8 text (byte %d)" % (path, at + e.start), 3)
        at += len(whole)
        cr = "\r" if data and new.endswith("\r") else ""  # its \n may come with the next read
        text += (new[:-1] if cr else new).replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
        cut = cut_in(encode, pieces.lead, text) if data and len(text) >= PIECE else None
        if cut:
            pieces.text(path, text[:cut], first)
            text, first = text[cut:], False
        if not data:
            break
    if text:
        pieces.text(path, text, first)


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
    dtype = token_dtype(len(tok))

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    def encode_many(texts):
        return tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    pieces = Pieces(encode, encode_many, dtype)
    try:
        for p in a.inputs:
            with open(p, "rb") as f:
                encode_file(f, p, encode, pieces)
            if a.eot:
                pieces.ids(np.array([tok.eos_token_id], dtype=dtype))
        pieces.flush()
        count = sum(x.size for x in pieces.out)
        if count > 2**31 - 1:
            fail("more than 2^31-1 tokens: split the input", 3)
        if not count:  # an empty token file would fail later, in smp-train, farther from the cause
            fail("no token: the inputs are empty", 3)
        write_token_parts(a.out, pieces.out, len(tok))
    except OSError as e:
        fail("%s: %s" % (e.filename, e.strerror or e), 1)
    print(f"{a.out}: {count} tokens (vocabulary {len(tok)}), encoded in {pieces.texts} piece(s)")


if __name__ == "__main__":
    main()
