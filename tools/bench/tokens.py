#!/usr/bin/env python3
"""bench/tokens.py: tools/tokenize_hf.py on a pretraining corpus, side by side in one
run with the least work any exact tool does (the anchor: parse each line, tokenize the
documents in batches with the tokenizer's Rust batch encoder, keep only a count) and
with what a transformers user writes instead (the tokenizer called on batches of 1000
documents, every id kept in a Python list, written at the end; and a document at a
time, tokenizer.encode). Two corpora: JSON Lines of documents (`--text-key text`) and text
files of 250 KB (one document each). Prints each command's wall time (median of
--repeat rounds, each a fresh process: imports and the tokenizer's load included), its
ratio to the anchor, MB/s and peak RSS; checks that the user's way wrote the same
tokens as tokenize_hf.

    python tools/bench/tokens.py [--mb 20] [--repeat 3] [--old PATH] [--cache DIR]

--old PATH times another tokenize_hf.py on the text files too (e.g. an earlier commit's,
from `git show REV:tools/tokenize_hf.py`; it must write the same file). The tokenizer
is bench/sft.py's byte-level BPE of 16,000 tokens (no network). Needs the oracle venv.
"""
import filecmp
import json
import pathlib
import random
import statistics
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sft import ROOT, run, setup  # noqa: E402  (the same tokenizer, arguments and timing)

ANCHOR = r"""
import json, sys
from transformers import AutoTokenizer
raw = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True).backend_tokenizer
n, docs = 0, []
def enc():
    global n
    n += sum(len(e.ids) for e in raw.encode_batch(docs, add_special_tokens=False))
    docs.clear()
for p in sys.argv[2:]:
    with open(p, encoding="utf-8") as f:
        if p.endswith(".jsonl"):
            for l in f:
                docs.append(json.loads(l)["text"])
                if len(docs) == 1024:
                    enc()
        else:
            docs.append(f.read())
            if len(docs) == 8:
                enc()
enc()
print(n)
"""
BATCHED = r"""
import json, sys, numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
ids, docs = [], []
def enc():
    for x in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(x + [tok.eos_token_id])
    docs.clear()
for l in open(sys.argv[3], encoding="utf-8"):
    docs.append(json.loads(l)["text"])
    if len(docs) == 1000:
        enc()
enc()
np.array(ids, dtype=np.uint16).tofile(sys.argv[2])
"""
ONE_AT_A_TIME = r"""
import json, sys, numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
ids = []
for l in open(sys.argv[3], encoding="utf-8"):
    ids.extend(tok.encode(json.loads(l)["text"], add_special_tokens=False) + [tok.eos_token_id])
np.array(ids, dtype=np.uint16).tofile(sys.argv[2])
"""


def say(rng, words, n):
    return " ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "?", "!\n", "\n\n- item ", "\n"])


def make_jsonl(path, mb, words):
    """mb MB of documents of 1-40 sentences (a few of 1000), as JSON lines with a "text" key."""
    if path.exists() and path.stat().st_size >= mb * 10**6:
        return
    rng, n = random.Random(path.name), 0
    with open(str(path) + ".part", "w") as f:
        while n < mb * 10**6:
            k = 1000 if rng.random() < 0.002 else rng.randint(1, 40)
            line = json.dumps({"id": n, "text": "".join(say(rng, words, rng.randint(5, 30)) for _ in range(k)),
                               "url": "https://example.com/%d" % n}) + "\n"
            f.write(line)
            n += len(line)
    pathlib.Path(str(path) + ".part").rename(path)


def make_texts(d, mb, words):
    """mb MB of text files of 250 KB each"""
    d.mkdir(exist_ok=True)
    files = [d / ("%04d.txt" % k) for k in range(mb * 4)]
    rng = random.Random(d.name)
    for p in files:
        if not p.exists():
            text, n = [], 0
            while n < 250000:
                text.append(say(rng, words, rng.randint(5, 30)))
                n += len(text[-1]) + 1
            p.write_text(" ".join(text))
    return files


def table(title, size, got, anchor_row):
    anchor = statistics.median(s for s, _ in got[anchor_row])
    print("\n%s, %.1f MB; medians of %d" % (title, size / 1e6, len(got[anchor_row])))
    print("| command | seconds | x (a) | MB/s | peak RSS |\n|---|---|---|---|---|")
    for k, v in got.items():
        s = statistics.median(x for x, _ in v)
        print("| %s | %.2f | %.2f | %.2f | %.0f MiB |" % (k, s, s / anchor, size / 1e6 / s, max(r for _, r in v)))


def main():
    a, d, words = setup(__doc__, "MB of each corpus", "another tokenize_hf.py to time on the text files beside this one")
    py, tool, tok = sys.executable, str(ROOT / "tools" / "tokenize_hf.py"), str(d / "plain")
    data = d / ("docs-%d.jsonl" % a.mb)
    make_jsonl(data, a.mb, words)
    texts = make_texts(d / ("texts-%d" % a.mb), a.mb, words)
    rows = {"(a) anchor: parse, batch-encode, count": [py, "-c", ANCHOR, tok, str(data)],
            "(b) tokenize_hf --text-key text --eot": [py, tool, "--tokenizer", tok, "--text-key", "text", "--eot",
                                                   str(d / "b.bin"), str(data)],
            "(c) tokenizer on batches of 1000, ids in a list": [py, "-c", BATCHED, tok, str(d / "c.bin"), str(data)],
            "(d) tokenizer.encode a document at a time": [py, "-c", ONE_AT_A_TIME, tok, str(d / "d.bin"), str(data)]}
    got = {k: [] for k in rows}
    for _ in range(a.repeat):
        for k, cmd in rows.items():
            got[k].append(run(cmd))
    b = np.fromfile(d / "b.bin", dtype="<u2", offset=1024)
    for x in ("c", "d"):
        if not np.array_equal(b, np.fromfile(d / (x + ".bin"), dtype="<u2")):
            sys.exit("bench/tokens.py: (%s) wrote other tokens than tokenize_hf" % x)
    table("JSON Lines of documents: %s, %d tokens, (c) and (d) the same tokens as (b)" % (data, b.size),
          data.stat().st_size, got, "(a) anchor: parse, batch-encode, count")
    files = list(map(str, texts))
    rows = {"(a) anchor: read each file, batch-encode 8, count": [py, "-c", ANCHOR, tok] + files,
            "(b) tokenize_hf --eot": [py, tool, "--tokenizer", tok, "--eot", str(d / "tb.bin")] + files}
    if a.old:
        rows["(e) tokenize_hf --old"] = [py, a.old, "--tokenizer", tok, "--eot", str(d / "te.bin")] + files
    got = {k: [] for k in rows}
    for _ in range(a.repeat):
        for k, cmd in rows.items():
            got[k].append(run(cmd))
    if a.old and not filecmp.cmp(d / "tb.bin", d / "te.bin", shallow=False):
        sys.exit("bench/tokens.py: --old wrote another file than (b)")
    table("Text files of 250 KB: %d files%s" % (len(files), ", (e) the same file as (b)" if a.old else ""),
          sum(t.stat().st_size for t in texts), got, "(a) anchor: read each file, batch-encode 8, count")
    for x in ("b", "c", "d", "tb", "te"):
        (d / (x + ".bin")).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
