#!/usr/bin/env python3
"""bench/sft.py: tools/prepare_sft.py on chats of a few turns and on long agent-like
chats, side by side in one run with the least work any exact tool does (render each
whole conversation through the chat template and tokenize it once: the anchor) and
with what a transformers user would run instead (apply_chat_template with
return_assistant_tokens_mask=True, which needs a template with {% generation %}
markers; batches of 1024). Prints each command's wall time (median of --repeat rounds,
each a fresh process: imports and the tokenizer's load included), its ratio to the
anchor and its peak RSS.

    python tools/bench/sft.py [--mb 20] [--repeat 3] [--old PATH] [--cache DIR]

--old PATH times another prepare_sft.py too (e.g. an earlier commit's, from `git show
REV:tools/prepare_sft.py`); each row's files must be (b)'s. The tokenizer is a
byte-level BPE of 16,000 tokens trained here on a made-up vocabulary (no network), with
Qwen2-Instruct's chat template; each data set is --mb MB of JSON lines. Needs the oracle
venv (transformers, tokenizers).
"""
import argparse
import filecmp
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
from test_prepare_sft import QWEN, QWEN_GEN, SPECIALS  # noqa: E402  (the templates the tests check)

# Each command reads the JSON lines and holds the packed tokens and mask, as prepare_sft does.
ANCHOR = r"""
import json, sys, numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
raw, out = tok.backend_tokenizer, []
lines = [json.loads(l)["messages"] for l in open(sys.argv[2])]
for k in range(0, len(lines), 1024):
    texts = tok.apply_chat_template(lines[k:k + 1024], tokenize=False)
    out += [np.array(e.ids, np.uint16) for e in raw.encode_batch(texts, add_special_tokens=False)]
print(sum(map(len, out)))
"""
GENERATION = r"""
import json, sys, numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
lines, ids, masks = [json.loads(l)["messages"] for l in open(sys.argv[2])], [], []
for k in range(0, len(lines), 1024):
    r = tok.apply_chat_template(lines[k:k + 1024], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids += [np.array(x, np.uint16) for x in r["input_ids"]]
    masks += [np.array(x, np.uint8) for x in r["assistant_masks"]]
print(sum(map(len, ids)), sum(int(m.sum()) for m in masks))
"""


def make_tokenizers(d):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    if (d / "gen" / "tokenizer.json").exists():
        return
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(20000)]
    (d / "words.json").write_text(json.dumps(words))
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(3000)]
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=16000, special_tokens=SPECIALS,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    for name, tmpl in (("plain", QWEN), ("gen", QWEN_GEN)):
        PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|begin_of_text|>",
                                chat_template=tmpl).save_pretrained(str(d / name))


def make_data(path, mb, exchanges, words):
    """mb MB of chats of `exchanges` (a range) user/assistant exchanges, half with a system prompt."""
    if path.exists() and path.stat().st_size >= mb * 10**6:
        return
    rng = random.Random(path.name)
    say = lambda n: " ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "?", "!\n", "\n\n- item"])
    n = 0
    with open(str(path) + ".part", "w") as f:
        while n < mb * 10**6:
            msgs = [{"role": "system", "content": say(20)}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(*exchanges)):
                msgs += [{"role": "user", "content": say(rng.randint(10, 80))},
                         {"role": "assistant", "content": say(rng.randint(20, 200))}]
            line = json.dumps({"messages": msgs}) + "\n"
            f.write(line)
            n += len(line)
    os.replace(str(path) + ".part", path)


def run(cmd):
    """(seconds, peak RSS MiB) of cmd, measured by GNU time when present; tools/ on the
    module path (an --old prepare_sft.py imports its modules)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tools"), os.environ.get("PYTHONPATH")])))
    if os.path.exists("/usr/bin/time"):
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M"] + cmd, capture_output=True, text=True, env=env)
        secs = time.perf_counter() - t0
        if p.returncode:
            sys.exit("bench/sft.py: %s failed: %s" % (" ".join(cmd[:2]), p.stderr.strip()[-500:]))
        return secs, int(p.stderr.strip().splitlines()[-1]) / 1024
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - t0, float("nan")


def setup(doc, mb_help, old_help):
    """(arguments, the cache folder with the tokenizers, the made-up words) of a benchmark
    whose docstring is doc"""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=20, help=mb_help)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old", help=old_help)
    ap.add_argument("--cache", default="/tmp/smp-bench/sft")
    a = ap.parse_args()
    d = pathlib.Path(a.cache)
    d.mkdir(parents=True, exist_ok=True)
    make_tokenizers(d)
    return a, d, json.loads((d / "words.json").read_text())


def main():
    a, d, words = setup(__doc__, "MB of JSON lines per data set", "another prepare_sft.py to time beside this one")
    py, tool = sys.executable, str(ROOT / "tools" / "prepare_sft.py")
    sets = {"chats of 1-6 exchanges": d / ("chats-%d.jsonl" % a.mb),
            "agent-like chats of 40-80 exchanges": d / ("agent-%d.jsonl" % a.mb)}
    make_data(sets["chats of 1-6 exchanges"], a.mb, (1, 6), words)
    make_data(sets["agent-like chats of 40-80 exchanges"], a.mb, (40, 80), words)
    for title, data in sets.items():
        rows = {"(a) anchor: render each chat, tokenize it once": [py, "-c", ANCHOR, str(d / "plain"), str(data)],
                "(b) prepare_sft (--jobs: every core)": [py, tool, "--tokenizer", str(d / "plain"), str(data),
                                                         str(d / "new.bin")],
                "(b') prepare_sft --jobs 1": [py, tool, "--jobs", "1", "--tokenizer", str(d / "plain"), str(data),
                                            str(d / "new1.bin")],
                "(c) transformers return_assistant_tokens_mask": [py, "-c", GENERATION, str(d / "gen"), str(data)]}
        if a.old:
            rows["(d) prepare_sft --old"] = [py, a.old, "--tokenizer", str(d / "plain"), str(data), str(d / "old.bin")]
        got = {k: [] for k in rows}
        for _ in range(a.repeat):
            for k, cmd in rows.items():
                got[k].append(run(cmd))
        for y in ["new1"] + (["old"] if a.old else []):
            if not all(filecmp.cmp(d / ("new" + x), d / (y + x), shallow=False) for x in (".bin", ".mask.bin")):
                sys.exit("bench/sft.py: %s: %s wrote other files than (b)" % (data, y))
        anchor = statistics.median(s for s, _ in got["(a) anchor: render each chat, tokenize it once"])
        print("\n%s: %s, %.1f MB, %d lines; medians of %d%s" % (
            title, data, data.stat().st_size / 1e6, sum(1 for _ in open(data)), a.repeat,
            "; (b')%s wrote the same files as (b)" % (" and (d)" if a.old else "")))
        print("| command | seconds | x (a) | MB/s | peak RSS |\n|---|---|---|---|---|")
        for k, v in got.items():
            s = statistics.median(x for x, _ in v)
            print("| %s | %.2f | %.2f | %.2f | %.0f MiB |" % (k, s, s / anchor, data.stat().st_size / 1e6 / s,
                                                             max(r for _, r in v)))
    for x in ("new", "new1", "old"):
        for ext in (".bin", ".mask.bin"):
            (d / (x + ext)).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
