#!/usr/bin/env python3
"""prepare_sft: chat or prompt/completion examples -> smp's token file and loss mask.

    python tools/prepare_sft.py --tokenizer HF_DIR [--sep TOKEN] IN.jsonl OUT.bin

Writes OUT.bin (the tokens) and OUT.mask.bin (OUT with its .bin suffix replaced by
.mask.bin; .mask.bin is appended when OUT does not end in .bin). The tokenizer is loaded
from a local folder (transformers.AutoTokenizer, no network).

Input: one JSON object per line of IN.jsonl (blank lines are skipped), either
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
      rendered through the tokenizer's chat template (apply_chat_template); the assistant
      turns are the targets, everything else is masked; at least one assistant turn;
  {"prompt": "...", "completion": "..."}
      the completion (non-empty) is the target. Prompt and completion are tokenized as
      one text, prompt + completion, without special tokens (write a bos into the prompt
      if the model wants one), and the boundary is the prompt's own token count; where
      tokenizing the prompt alone is not a prefix of tokenizing the concatenation (a
      token straddles the boundary), the two are tokenized separately and concatenated.
Other keys of an object are ignored (but not both forms in one). Each example ends with the
separator, by default the tokenizer's eos token (--sep TOKEN: another token of the
vocabulary), appended unless the example already ends with it; it is a target when the
token before it is one. The examples are packed in file order into one stream, for
`smp-train --documents --doc-sep ID` (the last line printed gives the ID). The separator
must not occur inside an example, or --documents would cut the example there: many chat
templates end every turn with the eos (Llama-3's <|eot_id|>, Qwen2-Instruct's
<|im_end|>), and then a line is refused with a hint to pass --sep (e.g. <|end_of_text|> or
<|endoftext|>, a token that only ends texts).

Chat masking (the prefix method): for the assistant message i, P_i is the rendering of
messages[:i] with add_generation_prompt=True and F_i that of messages[:i+1], both token
ids (apply_chat_template(..., tokenize=True), a batch of examples per call); the tokens
F_i[len(P_i):] (the turn's content and the template's end of turn) are targets. P_i must
be a prefix of F_i and F_i a prefix of the whole conversation's rendering, else the line
is an error (the template is not prefix-stable, e.g. one that drops earlier reasoning).
So is a line the template refuses (raise_exception, e.g. roles that must alternate).
{% generation %} markers, where a template has them, are not needed and change nothing.

Outputs: llm.c's header of 256 little-endian int32 (magic 20240520 version 1 with uint16
tokens when len(tokenizer) <= 65536, else magic 20240801 version 7 with uint32), then the
tokens; the mask file has the same header with magic 20241201 version 1 and the token
count, then one uint8 per token: 1 = the token is a target (predicted from the tokens
before it), 0 = not. The stream is held in memory (3 or 5 bytes a token) until written.

A bad line stops the run with `prepare_sft: error: IN.jsonl:LINE: what` on stderr and
exit 3; usage errors (a tokenizer without an eos token too) exit 2, I/O errors (a
tokenizer that cannot be loaded too) 1. On a terminal, stderr shows the progress; the
last line on stdout counts examples, tokens and target tokens.
"""
import argparse
import json
import sys
import time
from collections.abc import Mapping

import numpy as np

from tokenize_hf import write_mask, write_tokens

ROLES = {"system", "user", "assistant", "tool"}
BATCH = 1024  # examples per tokenizer call


class BadLine(Exception):
    def __init__(self, line, what):
        super().__init__(what)
        self.line = line


def fail(msg, code):
    print("prepare_sft: error: " + msg, file=sys.stderr)
    sys.exit(code)


def parse(line, raw):
    """The example of one input line: ("chat", messages) or ("text", (prompt, completion))."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadLine(line, "not JSON: %s" % e)
    if not isinstance(obj, dict):
        raise BadLine(line, "not a JSON object")
    if "messages" in obj and ("prompt" in obj or "completion" in obj):
        raise BadLine(line, "both forms: messages and prompt/completion")
    if "messages" in obj:
        return "chat", check_messages(line, obj["messages"])
    if "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if not isinstance(p, str) or not isinstance(c, str):
            raise BadLine(line, "prompt and completion must be strings")
        if not c:
            raise BadLine(line, "empty completion")
        return "text", (p, c)
    raise BadLine(line, 'neither {"messages": [...]} nor {"prompt": ..., "completion": ...}')


def check_messages(line, msgs):
    if not isinstance(msgs, list):
        raise BadLine(line, "messages must be a list")
    if not msgs:
        raise BadLine(line, "empty messages")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadLine(line, "message %d: not an object with string role and content" % k)
        if m["role"] not in ROLES:
            raise BadLine(line, "message %d: unknown role %r" % (k, m["role"]))
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadLine(line, "no assistant turn")
    return msgs


def render(tok, convs, gen):
    """Token ids of each conversation through the chat template (a list of lists or a
    BatchEncoding, depending on the transformers version)."""
    if not convs:
        return []
    out = tok.apply_chat_template(convs, add_generation_prompt=gen, tokenize=True)
    return out["input_ids"] if isinstance(out, Mapping) else out


def chat_batch(tok, items):
    """(ids, mask) of each (line, messages) in items, by the prefix method."""
    prompts, fulls, plan = [], [], []
    for line, msgs in items:
        spans, whole = [], len(fulls)
        fulls.append(msgs)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompts.append(msgs[:i])
                if i + 1 < len(msgs):
                    fulls.append(msgs[:i + 1])
                spans.append((i, len(prompts) - 1, len(fulls) - 1 if i + 1 < len(msgs) else whole))
        plan.append((line, whole, spans))
    P, F = render(tok, prompts, True), render(tok, fulls, False)
    out = []
    for line, whole, spans in plan:
        ids = list(F[whole])
        mask = [0] * len(ids)
        for i, p, f in spans:
            pi, fi = P[p], F[f]
            if fi[:len(pi)] != pi or ids[:len(fi)] != fi:
                raise BadLine(line, "the chat template is not prefix-stable at message %d (an assistant turn)" % i)
            mask[len(pi):len(fi)] = [1] * (len(fi) - len(pi))
        out.append((ids, mask))
    return out


def chat_examples(tok, items):
    """chat_batch, with a template failure (jinja's, the template's raise_exception)
    put on its line by rendering the batch again one example at a time."""
    if tok.chat_template is None:
        raise BadLine(items[0][0], "a messages line, but the tokenizer has no chat template")
    try:
        return chat_batch(tok, items)
    except BadLine:
        raise
    except Exception:
        return [ex for it in items for ex in chat_one(tok, it)]


def chat_one(tok, item):
    try:
        return chat_batch(tok, [item])
    except BadLine:
        raise
    except Exception as e:
        raise BadLine(item[0], "the chat template failed: %s: %s" % (type(e).__name__, e))


def text_examples(tok, items):
    """(ids, mask) of each (line, (prompt, completion)) in items."""
    enc = lambda texts: tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    ps = enc([p for _, (p, _) in items])
    wholes = enc([p + c for _, (p, c) in items])
    split = [k for k, (p, w) in enumerate(zip(ps, wholes)) if w[:len(p)] != p]
    for k, c in zip(split, enc([items[k][1][1] for k in split])):
        wholes[k] = ps[k] + c
    return [(list(w), [0] * len(p) + [1] * (len(w) - len(p))) for p, w in zip(ps, wholes)]


def examples(tok, batch, sep):
    """(ids, mask) of each (line, kind, data) in batch, in order, each ended by the
    separator (token id sep), which occurs nowhere else in it."""
    done = {}
    for kind, fn in (("chat", chat_examples), ("text", text_examples)):
        idx = [k for k, b in enumerate(batch) if b[1] == kind]
        if idx:
            done.update(zip(idx, fn(tok, [(batch[k][0], batch[k][2]) for k in idx])))
    out = []
    for k in range(len(batch)):
        ids, mask = done[k]
        if sep in ids[:-1]:
            raise BadLine(batch[k][0], "the separator %s (id %d) occurs inside the example: smp-train --documents "
                                       "would cut it there; pass --sep with a token the examples never contain"
                          % (tok.convert_ids_to_tokens(sep), sep))
        if not ids or ids[-1] != sep:
            mask.append(mask[-1] if mask else 0)
            ids.append(sep)
        out.append((ids, mask))
    return out


def read_batches(f):
    """Batches of (line, kind, data) of the file's non-blank lines, with the bytes read so far."""
    batch = []
    for line, raw in enumerate(f, 1):
        if raw.strip():
            kind, data = parse(line, raw)
            batch.append((line, kind, data))
        if len(batch) == BATCH:
            yield batch, f.tell()
            batch = []
    if batch:
        yield batch, f.tell()


class Stream:
    """The packed tokens and mask, in chunks, with the counts for the progress line."""

    def __init__(self, vocab):
        self.dtype = np.uint16 if vocab <= 65536 else np.uint32
        self.toks, self.mask, self.n, self.targets, self.examples = [], [], 0, 0, 0

    def add(self, exs):
        ids = np.fromiter((t for e in exs for t in e[0]), dtype=np.int64)
        m = np.fromiter((t for e in exs for t in e[1]), dtype=np.uint8, count=len(ids))
        self.toks.append(ids.astype(self.dtype))
        self.mask.append(m)
        self.n, self.targets, self.examples = self.n + len(ids), self.targets + int(m.sum()), self.examples + len(exs)


def convert(tok, path, stream, sep):
    tty, t0 = sys.stderr.isatty(), time.time()
    with open(path, "rb") as f:
        try:
            for batch, pos in read_batches(f):
                stream.add(examples(tok, batch, sep))
                if tty:
                    mbs = pos / 1e6 / max(time.time() - t0, 1e-9)
                    print("\rprepare_sft: %d examples, %d tokens, %.1f MB/s" % (stream.examples, stream.n, mbs),
                          end="", file=sys.stderr, flush=True)
        except BadLine as e:
            if tty:
                print(file=sys.stderr)
            fail("%s:%d: %s" % (path, e.line, e), 3)
    if tty:
        print(file=sys.stderr)


def mask_path(out):
    return (out[:-4] if out.endswith(".bin") else out) + ".mask.bin"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local folder with the tokenizer files")
    ap.add_argument("--sep", help="the token that ends each example (default: the tokenizer's eos token)")
    ap.add_argument("input", help="JSON lines: chat messages or prompt/completion")
    ap.add_argument("out", help="the token file; the mask goes next to it (.mask.bin)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    except (OSError, ValueError) as e:
        fail("%s: cannot load the tokenizer: %s" % (a.tokenizer, e), 1)
    if a.sep is None and tok.eos_token_id is None:
        fail("%s: the tokenizer has no eos token: give the separator with --sep TOKEN" % a.tokenizer, 2)
    sep = tok.eos_token_id if a.sep is None else tok.convert_tokens_to_ids(a.sep)
    if a.sep is not None and (sep is None or sep == tok.unk_token_id or tok.convert_ids_to_tokens(sep) != a.sep):
        fail("--sep %s: not a token of the tokenizer's vocabulary" % a.sep, 2)
    stream = Stream(len(tok))
    try:
        convert(tok, a.input, stream, sep)
        if not stream.examples:  # an empty token file would fail later, in smp-train, farther from the cause
            fail("%s: no example (the file is empty or holds blank lines only)" % a.input, 3)
        if stream.n > 2**31 - 1:
            fail("more than 2^31-1 tokens: split the input", 1)
        toks = np.concatenate(stream.toks) if stream.toks else np.zeros(0, stream.dtype)
        mask = np.concatenate(stream.mask) if stream.mask else np.zeros(0, np.uint8)
        write_tokens(a.out, toks, len(tok))
        write_mask(mask_path(a.out), mask)
    except OSError as e:
        fail("%s: %s" % (e.filename or a.input, e.strerror or e), 1)
    print(f"{a.out}: {stream.examples} examples, {stream.n} tokens, {stream.targets} target tokens "
          f"(vocabulary {len(tok)}); separator {tok.convert_ids_to_tokens(sep)}: smp-train --documents --doc-sep {sep}")


if __name__ == "__main__":
    main()
