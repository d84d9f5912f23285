#!/usr/bin/env python3
"""tokenize_hf: text files or records (JSON Lines, Parquet) -> tokens of a Hugging Face tokenizer, in llm.c's format.

    python tools/tokenize_hf.py --tokenizer MODEL_DIR [--eot] [--text-key KEY] [--tokens-per-file N] [--files-from LIST] OUT.bin [IN ...]

The tokenizer is loaded from a local folder (transformers.AutoTokenizer, no network).
Each file is encoded without special tokens; --eot appends the tokenizer's eos token
after each file. With --text-key KEY the inputs hold records, as pretraining corpora
come: JSON Lines (each line an object), or Parquet files (by the .parquet suffix; needs
pyarrow), whose string KEY (e.g. "text") is a document, encoded on its own (as
tokenizer.encode(doc) gives it) and followed by the eos with --eot (then `smp-train
--documents --doc-sep EOS` keeps the documents apart); blank lines are skipped, other
keys and columns ignored, and a record without that string stops the run
(`tokenize_hf: error: IN:LINE: what`, or `IN: row N: what`, rows from 0, exit 3): nothing is dropped
silently. Inputs named *.gz are read through gzip, *.zst through zstandard (needs the
zstandard package; every frame, a file cut inside one is an error). On a terminal,
stderr shows the progress after each batch: the inputs' bytes read as stored, tokens,
MB/s, and where every input is a file, the share done and the time left.

A file is read and encoded a piece of about 1 MB at a time (a longer document too), cut at a
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
model trained on them needs vocab_size >= len(tokenizer). The tokens are written as
they come (memory does not grow with the inputs). A file counts at most 2^31-1 tokens
(--tokens-per-file N: at most N): more go to numbered parts, OUT.bin's being
OUT-0000.bin, OUT-0001.bin, ... (the last line gives the glob for smp-train --data);
parts an earlier run left beyond them are removed. Every file appears whole or not at
all (written under a temporary name, renamed at the end).
"""
import argparse
import gzip
import importlib
import io
import json
import os
import re
import sys
import time
import zlib

import numpy as np

from atomic_write import interruptible, write_atomically


def header(magic, version, count):
    """llm.c's file header: 256 little-endian int32, the first three magic, version, count."""
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, count
    return h.tobytes()


def token_dtype(vocab):
    """uint16 tokens when the vocabulary fits, else uint32"""
    return "<u2" if vocab <= 65536 else "<u4"


def token_header(dtype, count):
    """a token file's header: magic 20240520 version 1 for uint16 tokens, 20240801 version 7 for uint32"""
    return header(*((20240520, 1) if np.dtype(dtype) == np.dtype("<u2") else (20240801, 7)), count)


def write_tokens(path, toks, vocab):
    """a token file of toks, in memory (TokenFiles writes as the tokens come)"""
    toks = np.asarray(toks, dtype=token_dtype(vocab))
    write_atomically(path, (token_header(toks.dtype, toks.size), toks.tobytes()))


def write_mask(path, mask):
    """The loss mask of a token file: magic 20241201 version 1, then one uint8 per token
    (1: the token is a target, 0: not)."""
    write_atomically(path, (header(20241201, 1, len(mask)), np.asarray(mask, dtype=np.uint8).tobytes()))


FILE_TOKENS = 2**31 - 1  # llm.c's header counts a file's tokens in an int32
MAX_PARTS = 10000  # parts have four digits: a glob of them (????) takes no fifth


def part_path(out, k):
    """OUT's k-th part: a number before its .bin suffix (train.bin -> train-0003.bin)."""
    return "%s-%04d.bin" % (out[:-4], k) if out.endswith(".bin") else "%s-%04d" % (out, k)


def part_glob(out, mask=False):
    """A glob of OUT's parts (or of their masks), quoted for a shell: smp-train's --data
    (--loss-mask)."""
    g = "%s-????%s" % ((out[:-4], ".bin") if out.endswith(".bin") else (out, ""))
    return "'%s'" % (mask_path(g) if mask else g)


def mask_path(out):
    """The loss mask beside a token file: its .bin suffix replaced by .mask.bin."""
    return (out[:-4] if out.endswith(".bin") else out) + ".mask.bin"


class FileLimit(ValueError):
    """Tokens that the files cannot hold (an example longer than a file, too many parts,
    more than a file for a device output)."""


class TokenFiles:
    """Token files (and their loss masks, masks=True) written as the tokens come, none
    held: OUT when they fit in one file, else OUT's parts (part_path) of at most per_file
    tokens each, cut only where add() allows. Each file is written under a temporary
    name, its header's count set last, and takes its name at close(), which then removes
    the parts an earlier run left beyond this run's (a glob of the parts names this
    run's tokens and nothing else); abort() (or leaving a `with` by an exception) leaves
    every name as it was. An output that is
    a link, a device or a FIFO is written through (atomic_write): one file, held in
    memory until close(). A unit longer than per_file is a FileLimit; an OSError names
    OUT."""

    def __init__(self, out, vocab, per_file=FILE_TOKENS, masks=False):
        self.out, self.vocab, self.per_file, self.masks = out, vocab, per_file, masks
        self.dtype = np.dtype(token_dtype(vocab))
        self.direct = os.path.islink(out) or (os.path.exists(out) and not os.path.isfile(out))
        self.files, self.held, self.count, self.n = [], [], 0, 0  # n: the open part's tokens

    def _tmp(self, k, mask):
        return "%s.part%d%s.tmp-%d" % (self.out, k, ".mask" if mask else "", os.getpid())

    def _seal(self):
        """the open part's headers written, its files closed"""
        if self.files and not self.files[-1][0].closed:
            heads = (token_header(self.dtype, self.n), header(20241201, 1, self.n))
            for f, h in zip(self.files[-1], heads):
                f.seek(0)
                f.write(h)
                f.close()

    def _open(self):
        self._seal()
        k = len(self.files)
        if k == MAX_PARTS:
            raise FileLimit("%s: more than %d files of %d tokens: a larger --tokens-per-file"
                             % (self.out, MAX_PARTS, self.per_file))
        self.files.append([])
        for m in (False, True)[:1 + self.masks]:
            self.files[-1].append(open(self._tmp(k, m), "wb"))
            self.files[-1][-1].write(bytes(1024))  # the header, once the count is known
        self.n = 0

    def add(self, toks, mask=None, ends=None):
        """toks (and their mask) after the tokens before; a part may end only at the
        positions ends (increasing, the last len(toks)), anywhere when ends is None."""
        toks = np.asarray(toks, dtype=self.dtype)
        if self.direct:
            self.held.append((toks, mask))
            self.count += len(toks)
            if self.count > self.per_file:
                raise FileLimit("%s: more than %d tokens, and a link, a device or a FIFO holds one file"
                                 % (self.out, self.per_file))
            return
        try:
            self._add(toks, mask, ends)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.out) from e

    def _add(self, toks, mask, ends):
        at = 0
        while at < len(toks):
            if not self.files or self.n == self.per_file:
                self._open()
            cut = min(len(toks), at + self.per_file - self.n)
            if ends is not None and cut < len(toks):
                i = np.searchsorted(ends, cut, side="right")
                cut = int(ends[i - 1]) if i else 0  # the last unit that fits
                if cut <= at:  # the next unit does not: a new part, unless this one is new
                    if not self.n:
                        unit = int(ends[np.searchsorted(ends, at, side="right")]) - at
                        raise FileLimit("%s: an example of %d tokens, longer than a file's %d"
                                         % (self.out, unit, self.per_file))
                    self._open()
                    continue
            self.files[-1][0].write(toks[at:cut].tobytes())
            if self.masks:
                self.files[-1][1].write(np.asarray(mask[at:cut], dtype=np.uint8).tobytes())
            self.n += cut - at
            self.count += cut - at
            at = cut

    def close(self):
        """The files' names, in order, once they hold this run's tokens."""
        if self.direct:
            toks = np.concatenate([t for t, _ in self.held]) if self.held else np.zeros(0, self.dtype)
            write_tokens(self.out, toks, self.vocab)
            if self.masks:
                write_mask(mask_path(self.out), np.concatenate([m for _, m in self.held]) if self.held else [])
            return [self.out]
        try:
            if not self.files:
                self._open()
            self._seal()
            names = [self.out] if len(self.files) == 1 else [part_path(self.out, k) for k in range(len(self.files))]
            for k, name in enumerate(names):
                for m in (False, True)[:1 + self.masks]:
                    os.replace(self._tmp(k, m), mask_path(name) if m else name)
            k = len(names) if len(names) > 1 else 0
            while os.path.isfile(part_path(self.out, k)):  # an earlier run's, which a glob of these would take
                for name in (part_path(self.out, k), mask_path(part_path(self.out, k)))[:1 + self.masks]:
                    if os.path.isfile(name):
                        os.unlink(name)
                k += 1
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.out) from e
        return names

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:  # an error, an exit, an interrupt: no name changes
            self.abort()

    def abort(self):
        """the temporary files closed and removed"""
        for k, fs in enumerate(self.files):
            for m, f in enumerate(fs):
                f.close()
                if os.path.lexists(self._tmp(k, m)):
                    os.unlink(self._tmp(k, m))


def fail(msg, code):
    if Progress.line_open:  # the error on a line of its own
        print(file=sys.stderr)
    print("tokenize_hf: error: " + msg, file=sys.stderr)
    sys.exit(code)


PIECE = int(os.environ.get("SMP_TOKENIZE_PIECE", 1 << 20))  # bytes read at a time (tests make it small)
WINDOW = 1024  # characters each side of a cut that must encode alike whole and apart
BATCH = min(os.cpu_count() or 1, 8)  # pieces encoded together (memory: about one encoding a piece)
BATCH_TEXTS = 4096  # texts shorter than a piece (files, documents) encoded together at most
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

    def __init__(self, encode, encode_many, dtype, sink):
        self.encode_many, self.dtype, self.lead, self.sink = encode_many, dtype, encode(LEAD), sink
        self.waiting, self.ntext, self.chars, self.texts, self.documents = [], 0, 0, 0, 0
        self.on_flush = lambda: None  # the progress line's turn

    def text(self, path, t, first):
        self.waiting.append((path, t, first))
        self.ntext += 1
        self.chars += len(t)
        self.texts += 1
        if self.ntext == BATCH_TEXTS or self.chars >= BATCH * PIECE:  # BATCH pieces, or as much in shorter texts
            self.flush()

    def ids(self, arr):
        self.waiting.append((None, arr, None))

    def flush(self):
        enc = iter(self.encode_many([t if first else LEAD + t for path, t, first in self.waiting if path]))
        for path, t, first in self.waiting:
            if path is None:
                self.sink(t)
                continue
            ids = next(enc)
            ids = ids if first else after_lead(self.lead, ids)
            if ids is None:  # the window round its cut said otherwise: a tokenizer no window sees whole
                fail("%s: a piece's first token merged with the line end before it, which the text round "
                     "its cut did not: this tokenizer cannot be read a piece at a time" % path, 1)
            self.sink(np.asarray(ids, dtype=self.dtype))
        self.waiting.clear()
        self.ntext = self.chars = 0
        self.on_flush()


def file_text(f, path):
    """binary file f's text a read at a time, line ends read as Python's text mode reads
    them; exits 3 on text that is not UTF-8, naming its byte."""
    rest, at, cr = b"", 0, ""
    while True:
        data = f.read(PIECE)
        whole, rest = utf8_whole(rest + data) if data else (rest, b"")
        try:
            new = cr + whole.decode("utf-8")
        except UnicodeDecodeError as e:
            fail("%s: not UTF-8 text (byte %d)" % (path, at + e.start), 3)
        at += len(whole)
        cr = "\r" if data and new.endswith("\r") else ""  # its \n may come with the next read
        yield (new[:-1] if cr else new).replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
        if not data:
            return


def encode_text(reads, where, encode, pieces):
    """one text, given a read at a time (strings), to pieces a piece at a time, cut where
    its tokens are those of the text encoded whole"""
    text, first = "", True
    for new in reads:
        if not new:
            continue
        text += new
        cut = cut_in(encode, pieces.lead, text) if len(text) >= PIECE else None
        if cut:
            pieces.text(where, text[:cut], first)
            text, first = text[cut:], False
    if text:
        pieces.text(where, text, first)


def jsonl_docs(f, path, key):
    """(where, document) of binary file f's JSON Lines, each line's string `key`; exits 3
    naming the line of one that is not such an object."""
    at = 0
    for n, raw in enumerate(f, 1):
        where, at = "%s:%d" % (path, n), at + len(raw)
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte order mark some editors write
        except UnicodeDecodeError as e:
            fail("%s: not UTF-8 text (byte %d)" % (where, at - len(raw) + e.start), 3)
        if not line.strip():
            continue
        try:
            doc = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            fail("%s: not JSON (%s at column %d)" % (where, e.msg.removesuffix(" at"), e.colno), 3)
        except RecursionError:  # Python's parser recurses once a nesting level
            fail("%s: not JSON that Python reads (nested too deeply)" % where, 3)
        doc = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(doc, str):
            fail('%s: not an object with a string "%s"' % (where, key), 3)
        yield where, doc


def need(module, path, why):
    """module imported, or exit 2 naming the package that `why` needs"""
    try:
        return importlib.import_module(module)
    except ImportError:
        fail("%s: %s needs Python's %s package (pip install %s)" % (path, why, module.split(".")[0],
                                                                    module.split(".")[0]), 2)


def parquet_docs(path, key, progress):
    """(where, document) of Parquet file path's string column `key`, a batch of rows at a
    time; exits 3 on a file that is not Parquet, a missing or non-string column, a null."""
    pa = need("pyarrow", path, "reading Parquet")
    pq = need("pyarrow.parquet", path, "reading Parquet")
    with open(path, "rb") as fh:  # opened here: a missing file or a folder is an I/O error like any input's
        progress.current = fh
        try:
            f = pq.ParquetFile(fh)
            schema = f.schema_arrow
        except (pa.ArrowException, OSError) as e:
            fail("%s: not a Parquet file (%s)" % (path, e), 3)
        if key not in schema.names:
            fail('%s: no column "%s" (it has %s)' % (path, key, ", ".join(schema.names) or "none"), 3)
        t = schema.field(key).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
            fail('%s: column "%s" holds %s, not strings' % (path, key, t), 3)
        row = 0
        try:
            for batch in f.iter_batches(batch_size=1024, columns=[key]):
                col = batch.column(0)
                if col.null_count:
                    at = row + col.is_null().to_pylist().index(True)
                    fail('%s: row %d: "%s" is null' % (path, at, key), 3)
                for doc in col.to_pylist():
                    yield "%s: row %d" % (path, row), doc
                    row += 1
        except (pa.ArrowException, UnicodeDecodeError) as e:
            fail("%s: damaged Parquet data near row %d (%s)" % (path, row, e), 3)


def encode_docs(docs, key, encode, pieces, eos):
    """each (where, document) of docs to pieces, then eos (unless None)"""
    for where, doc in docs:
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes reach no UTF-8 text
            fail('%s: "%s" holds a lone surrogate (\\u%04x): not Unicode text' % (where, key, ord(doc[e.start])), 3)
        encode_text((doc[i:i + PIECE] for i in range(0, len(doc), PIECE)), where, encode, pieces)
        pieces.documents += 1
        if eos is not None:
            pieces.ids(eos)


class ZstdReader(io.RawIOBase):
    """a .zst file's bytes, every frame in turn (pzstd and --rsyncable write several), as
    `zstd -d` reads them; a file that ends inside a frame is a ZstdError (zstandard's
    stream_reader ends there silently: a corpus cut short by a download would lose its
    tail unnoticed)."""

    def __init__(self, path, zstandard):
        self.zstd, self.f, self.obj, self.out, self.at = zstandard, open(path, "rb"), None, b"", 0

    def readable(self):
        return True

    def readinto(self, b):
        while self.at == len(self.out):
            more = self.obj is not None and not self.obj.eof
            data = self.obj.unused_data if self.obj is not None and self.obj.eof else b""
            data = data or self.f.read(PIECE)
            if not data:
                if more:
                    raise self.zstd.ZstdError("the file ends inside a frame")
                return 0
            if not more:
                self.obj = self.zstd.ZstdDecompressor().decompressobj()
            self.out, self.at = self.obj.decompress(data), 0
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self):
        self.f.close()
        super().close()


def open_input(path):
    """an input file for binary reads, decompressed where its name ends in .gz or .zst"""
    if path.endswith(".zst"):
        return io.BufferedReader(ZstdReader(path, need("zstandard", path, "reading .zst")), PIECE)
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class Progress:
    """On a terminal, a line on stderr after each batch: the inputs' bytes read as stored
    (a compressed file's compressed bytes), the tokens, MB/s and, where every input is a
    file of known size, the share done and the time left (a corpus takes hours)."""
    line_open = False  # a progress line without its line end yet

    def __init__(self, paths, files):
        self.tty, self.files, self.t0, self.done, self.current = sys.stderr.isatty(), files, time.time(), 0, None
        self.total = sum(os.stat(p).st_size for p in paths) if all(map(os.path.isfile, paths)) else None

    def read(self):
        raw = self.current
        raw = getattr(raw, "fileobj", None) or getattr(getattr(raw, "raw", None), "f", None) or raw  # gzip's, zstd's
        try:
            return self.done + (raw.tell() if raw is not None and not raw.closed else 0)
        except (OSError, ValueError):  # a pipe has no position
            return self.done

    def next_file(self, path):
        self.current = None
        self.done += os.stat(path).st_size if os.path.isfile(path) else 0

    def show(self, end=""):
        if not self.tty:
            return
        read, secs = self.read(), max(time.time() - self.t0, 1e-9)
        line = "tokenize_hf: %.1f MB read, %d tokens, %.1f MB/s" % (read / 1e6, self.files.count, read / 1e6 / secs)
        if self.total and read:
            line += ", %.0f%%, %s left" % (100.0 * read / self.total, clock(secs * (self.total - read) / read))
        print("\r" + line + "\033[K", end=end, file=sys.stderr, flush=True)
        Progress.line_open = not end


def clock(secs):
    """1h02m, 3m05s, 12s"""
    s = int(secs)
    return "%dh%02dm" % (s // 3600, s // 60 % 60) if s >= 3600 else "%dm%02ds" % (s // 60, s % 60) if s >= 60 else "%ds" % s


def encode_input(p, key, encode, pieces, eos):
    """input file p to pieces: its text, or with key its records' documents, each then eos"""
    if key is not None and p.endswith(".parquet"):
        return encode_docs(parquet_docs(p, key, pieces.progress), key, encode, pieces, eos)
    try:
        with open_input(p) as f:
            pieces.progress.current = f
            if key is None:
                encode_text(file_text(f, p), p, encode, pieces)
            else:
                encode_docs(jsonl_docs(f, p, key), key, encode, pieces, eos)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # EOFError: a .gz cut short
        fail("%s: damaged gzip data (%s)" % (p, e), 3)
    except getattr(sys.modules.get("zstandard"), "ZstdError", ()) as e:  # () where no .zst was read
        fail("%s: damaged zstd data (%s)" % (p, e), 3)


def files_from(list_path):
    """The paths listed in list_path (one a line, blank lines skipped; - is stdin): a
    corpus of 100,000 files does not fit on a command line (ARG_MAX), and xargs would
    run the tool several times over one output."""
    try:
        f = sys.stdin if list_path == "-" else open(list_path, encoding="utf-8", errors="surrogateescape")
        with f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    except OSError as e:
        fail("%s: %s" % (list_path, e.strerror or e), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local folder with the tokenizer files")
    ap.add_argument("--eot", action="store_true", help="append the eos token after each file (document with --text-key)")
    ap.add_argument("--text-key", metavar="KEY", help="the inputs hold records (JSON Lines, or Parquet by the "
                    ".parquet suffix): each record's string KEY is a document")
    ap.add_argument("--tokens-per-file", type=int, default=FILE_TOKENS,
                    help="more tokens go to numbered parts of OUT (default and most: 2^31-1)")
    ap.add_argument("--files-from", metavar="LIST",
                    help="more inputs: the paths in LIST, one a line, after those given (- reads stdin)")
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="*")
    a = ap.parse_args(argv)
    if a.files_from:
        a.inputs += files_from(a.files_from)
    if not a.inputs:
        fail("no input: give text files, or --files-from LIST", 2)
    if not 1 <= a.tokens_per_file <= FILE_TOKENS:
        fail("--tokens-per-file %d: from 1 to %d" % (a.tokens_per_file, FILE_TOKENS), 2)
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

    try:
        with TokenFiles(a.out, len(tok), a.tokens_per_file) as files:
            pieces = Pieces(encode, encode_many, dtype, files.add)
            pieces.progress = Progress(a.inputs, files)
            pieces.on_flush = pieces.progress.show
            eos = np.array([tok.eos_token_id], dtype=dtype) if a.eot else None
            for p in a.inputs:
                encode_input(p, a.text_key, encode, pieces, eos)
                pieces.progress.next_file(p)
                if eos is not None and a.text_key is None:
                    pieces.ids(eos)
            pieces.flush()
            pieces.progress.show(end="\n")
            if not files.count:  # an empty token file would fail later, in smp-train, farther from the cause
                fail("no token: the inputs are empty", 3)
            names = files.close()
    except OSError as e:
        fail("%s: %s" % (e.filename, e.strerror or e), 1)
    except FileLimit as e:
        fail(str(e), 3)
    docs = f"{pieces.documents} documents, " if a.text_key is not None else ""
    print(f"{a.out}: {files.count} tokens (vocabulary {len(tok)}), {docs}encoded in {pieces.texts} piece(s)" +
          ("" if len(names) == 1 else f", in {len(names)} files: smp-train --data {part_glob(a.out)}") +
          (f"; each ends with eos {tok.eos_token_id}: smp-train --documents --doc-sep {tok.eos_token_id}"
           if a.eot and a.text_key is not None else ""))


if __name__ == "__main__":
    interruptible("tokenize_hf", main)
