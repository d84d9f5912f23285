#!/usr/bin/env python3
"""prepare_sft: chat or prompt/completion examples -> smp's token file and loss mask.

    python tools/prepare_sft.py --tokenizer HF_DIR [--sep TOKEN] [--jobs N] [--tokens-per-file N] IN.jsonl OUT.bin

Writes OUT.bin (the tokens) and OUT.mask.bin (OUT with its .bin suffix replaced by
.mask.bin; .mask.bin is appended when OUT does not end in .bin). The tokenizer is loaded
from a local folder (transformers.AutoTokenizer, no network).

Input: one JSON object per line of IN.jsonl (blank lines are skipped; a pipe too, such as
`<(zcat chats.jsonl.gz)`), either
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

Chat masking: the whole conversation is rendered (apply_chat_template) and tokenized
once. For the assistant message i, P_i is the rendering of messages[:i] with
add_generation_prompt=True and F_i that of messages[:i+1]; both must begin the whole
rendering, else the line is an error (the template is not prefix-stable, e.g. one that
drops earlier reasoning); so is a line the template refuses (raise_exception, e.g. roles
that must alternate). The tokens of the characters [len(P_i), len(F_i)) (the turn's
content and the template's end of turn) are targets; a token that spans either end is an
error too (e.g. a generation prompt ending in a space that a byte-level BPE joins to the
next word). This is how transformers maps {% generation %} spans to tokens
(return_assistant_tokens_mask), on offsets a ByteLevel post-processor has not trimmed,
and refusing a straddling token rather than guessing its side. The prefixes are rendered
but not tokenized: tokenizing each (earlier versions did) costs time and memory
quadratic in the number of turns. {% generation %} markers, where a template has them,
are not needed and change nothing.

Outputs: llm.c's header of 256 little-endian int32 (magic 20240520 version 1 with uint16
tokens when len(tokenizer) <= 65536, else magic 20240801 version 7 with uint32), then the
tokens; the mask file has the same header with magic 20241201 version 1 and the token
count, then one uint8 per token: 1 = the token is a target (predicted from the tokens
before it), 0 = not. They are written as they come (the input taken BATCH lines or
BATCH_BYTES at a time), under temporary names until the end. A file counts at most
2^31-1 tokens (--tokens-per-file N: at most N): more go to numbered parts cut between
examples, OUT.bin's being OUT-0000.bin with OUT-0000.mask.bin, OUT-0001.bin, ... (the
last line gives the globs for smp-train); parts an earlier run left beyond them are
removed.

A bad line stops the run with `prepare_sft: error: IN.jsonl:LINE: what` on stderr and
exit 3; usage errors (a tokenizer without an eos token too) exit 2, I/O errors (a
tokenizer that cannot be loaded too) 1, an interrupt (Ctrl-C) 130, each in one line and
with no output file written. On a terminal, stderr shows the progress; the last line on
stdout counts examples, tokens and target tokens.
"""
import argparse
import collections
import copy
import json
import multiprocessing
import os
import signal
import sys
import time

import numpy as np

from atomic_write import interruptible
from tokenize_hf import FILE_TOKENS, FileLimit, TokenFiles, part_glob

ROLES = {"system", "user", "assistant", "tool"}
BATCH = 1024  # examples per tokenizer call
BATCH_BYTES = 2 << 20  # or fewer: input bytes per call
RENDER_CHARS = 32 << 20  # prefix characters rendered per template call, about
JOBS = 16  # default processes at most: each a copy of the tokenizer and of its batch, one reader feeds them


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
    """The text of each conversation through the chat template."""
    return tok.apply_chat_template(convs, add_generation_prompt=gen, tokenize=False) if convs else []


def plain_backend(tok):
    """A copy of the tokenizer's Rust backend that encodes as apply_chat_template does
    (add_special_tokens=False: the post-processor adds nothing) but without its
    post-processor, whose only effect is then to trim whitespace off the offsets: the
    mask needs each token's true span."""
    raw = copy.deepcopy(tok.backend_tokenizer)
    raw.post_processor = None
    raw.no_truncation()
    raw.no_padding()
    raw.encode_special_tokens = bool(getattr(tok, "split_special_tokens", False))
    return raw


def turn_bounds(tok, items, wholes):
    """For each (line, messages) in items: [(i, start, end)], the characters of the whole
    rendering that assistant message i adds (messages[:i] rendered with the generation
    prompt, then messages[:i+1]). Each rendering must begin the whole one. The prefixes
    are rendered about RENDER_CHARS characters at a time (a chat of n turns renders n
    prefixes: held at once, long chats would take memory quadratic in their length)."""
    jobs, bad, size, out = [], [], 0, [[] for _ in items]

    def flush():
        for gen in (True, False):
            sel = [j for j in jobs if j[3] == gen]
            for (k, i, slot, _, _), text in zip(sel, render(tok, [j[4] for j in sel], gen)):
                if not wholes[k].startswith(text):
                    bad.append((k, i))
                out[k][slot][1 + (not gen)] = len(text)
        jobs.clear()
    for k, (line, msgs) in enumerate(items):
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            out[k].append([i, 0, len(wholes[k])])
            jobs.append((k, i, len(out[k]) - 1, True, msgs[:i]))
            if i + 1 < len(msgs):
                jobs.append((k, i, len(out[k]) - 1, False, msgs[:i + 1]))
            size += 2 * sum(len(x["content"]) for x in msgs[:i + 1])
            if size > RENDER_CHARS:
                flush()
                size = 0
    flush()
    if bad:
        k, i = min(bad)
        raise BadLine(items[k][0], "the chat template is not prefix-stable at message %d (an assistant turn)" % i)
    return out


def chat_batch(tok, raw, items):
    """(ids, mask) of each (line, messages) in items: the whole conversation is rendered
    and tokenized once; assistant message i's targets are the tokens of the characters
    it adds (turn_bounds), which must start and end on token boundaries."""
    wholes = render(tok, [msgs for _, msgs in items], False)
    bounds = turn_bounds(tok, items, wholes)
    out = []
    for (line, _), enc, turns in zip(items, raw.encode_batch(wholes, add_special_tokens=False), bounds):
        ids = np.array(enc.ids, dtype=np.int64)
        offs = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), np.uint8)
        for i, a, b in turns:
            if a > b:
                raise BadLine(line, "the chat template is not prefix-stable at message %d (an assistant turn)" % i)
            ka, kb = np.searchsorted(offs[:, 0], (a, b))
            for k, c, what in ((ka, a, "start"), (kb, b, "end")):
                if k and offs[k - 1, 1] > c:
                    raise BadLine(line, "a token spans the %s of message %d (an assistant turn): the chat template "
                                        "and the tokenizer do not separate the turns" % (what, i))
            mask[ka:kb] = 1
        out.append((ids, mask))
    return out


def chat_examples(tok, raw, items):
    """chat_batch, with a template failure (jinja's, the template's raise_exception)
    put on its line by rendering the batch again one example at a time."""
    if tok.chat_template is None:
        raise BadLine(items[0][0], "a messages line, but the tokenizer has no chat template")
    try:
        return chat_batch(tok, raw, items)
    except BadLine:
        raise
    except Exception:
        return [ex for it in items for ex in chat_one(tok, raw, it)]


def chat_one(tok, raw, item):
    try:
        return chat_batch(tok, raw, [item])
    except BadLine:
        raise
    except Exception as e:
        raise BadLine(item[0], "the chat template failed: %s: %s" % (type(e).__name__, e))


def encode(raw, texts):
    return [np.array(e.ids, np.int64) for e in raw.encode_batch(texts, add_special_tokens=False)] if texts else []


def text_examples(tok, raw, items):
    """(ids, mask) of each (line, (prompt, completion)) in items."""
    ps = encode(raw, [p for _, (p, _) in items])
    wholes = encode(raw, [p + c for _, (p, c) in items])
    split = [k for k, (p, w) in enumerate(zip(ps, wholes)) if not np.array_equal(w[:len(p)], p)]
    for k, c in zip(split, encode(raw, [items[k][1][1] for k in split])):
        wholes[k] = np.concatenate([ps[k], c])
    return [(w, (np.arange(len(w)) >= len(p)).astype(np.uint8)) for p, w in zip(ps, wholes)]


def examples(tok, raw, batch, sep):
    """(ids, mask) of each (line, kind, data) in batch, in order, each ended by the
    separator (token id sep), which occurs nowhere else in it."""
    done = {}
    for kind, fn in (("chat", chat_examples), ("text", text_examples)):
        idx = [k for k, b in enumerate(batch) if b[1] == kind]
        if idx:
            done.update(zip(idx, fn(tok, raw, [(batch[k][0], batch[k][2]) for k in idx])))
    out = []
    for k in range(len(batch)):
        ids, mask = done[k]
        if (ids[:-1] == sep).any():
            raise BadLine(batch[k][0], "the separator %s (id %d) occurs inside the example: smp-train --documents "
                                       "would cut it there; pass --sep with a token the examples never contain"
                          % (tok.convert_ids_to_tokens(sep), sep))
        if not len(ids) or ids[-1] != sep:
            mask = np.append(mask, mask[-1] if len(mask) else 0).astype(np.uint8)
            ids = np.append(ids, sep)
        out.append((ids, mask))
    return out


def read_batches(f):
    """Batches of (line, raw line) of the file's non-blank lines, with the bytes read so
    far (counted: a pipe, `<(zcat chats.jsonl.gz)`, has no position to tell)."""
    batch, size, pos = [], 0, 0
    for line, raw in enumerate(f, 1):
        pos += len(raw)
        if raw.strip():
            batch.append((line, raw))
            size += len(raw)
        if len(batch) == BATCH or size >= BATCH_BYTES:
            yield batch, pos
            batch, size = [], 0
    if batch:
        yield batch, pos


class Work:
    """What a batch's work needs (set before the workers fork): the tokenizer, its plain
    backend, the separator and the token dtype."""
    tok = raw = sep = dtype = None


def work(batch):
    """A batch of (line, raw line) -> (tokens, mask, where each example ends), or ("bad",
    line, what)."""
    try:
        exs = examples(Work.tok, Work.raw, [(line, *parse(line, raw)) for line, raw in batch], Work.sep)
    except BadLine as e:
        return "bad", e.line, str(e)
    return (np.concatenate([e[0] for e in exs]).astype(Work.dtype), np.concatenate([e[1] for e in exs]),
            np.cumsum([len(e[0]) for e in exs]))


def worker_start():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process a core already
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process says it once


def finish(pool):
    """The pool's workers ended once the batches in flight are done (at most 2 x jobs):
    Pool.terminate() may stop one in the middle of sending a result, which its reader
    then waits for forever (an interrupted test hung so, once in a suite)."""
    if pool is not None:
        pool.close()
        pool.join()


def results(batches, pool, jobs):
    """work() of each batch, in order, with its bytes read so far: in the pool's jobs
    processes (None: here), at most 2 x jobs batches ahead of the one awaited."""
    if pool is None:
        yield from ((work(b), pos) for b, pos in batches)
        return
    ahead = collections.deque()
    for b, pos in batches:
        ahead.append((pool.apply_async(work, (b,)), pos))
        if len(ahead) >= 2 * jobs:
            r, p = ahead.popleft()
            yield r.get(), p
    while ahead:
        r, p = ahead.popleft()
        yield r.get(), p


class Stream:
    """The packed tokens and mask, written as they come (files: TokenFiles, a part
    ending only between examples), with the counts for the progress line (the tokens:
    files.count)."""

    def __init__(self, files):
        self.files, self.targets, self.examples = files, 0, 0

    def add(self, ids, m, ends):
        self.files.add(ids, m, ends)
        self.targets, self.examples = self.targets + int(m.sum()), self.examples + len(ends)


def convert(tok, path, stream, sep, jobs):
    Work.tok, Work.raw, Work.sep, Work.dtype = tok, plain_backend(tok), sep, stream.files.dtype
    tty, t0 = sys.stderr.isatty(), time.time()
    # forked before the input opens (and the outputs: at the first tokens), so that no
    # worker holds them: a pipe's writer's end held by one would never let it end
    pool = multiprocessing.get_context("fork").Pool(jobs, initializer=worker_start) if jobs > 1 else None
    try:
        with open(path, "rb") as f:
            for r, pos in results(read_batches(f), pool, jobs):
                if isinstance(r[0], str):  # ("bad", line, what)
                    if tty:
                        print(file=sys.stderr)
                    fail("%s:%d: %s" % (path, r[1], r[2]), 3)
                stream.add(*r)
                if tty:
                    mbs = pos / 1e6 / max(time.time() - t0, 1e-9)
                    print("\rprepare_sft: %d examples, %d tokens, %.1f MB/s" % (stream.examples, stream.files.count, mbs),
                          end="", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # the workers killed, and interruptible() exits at once: the pool's own shutdown
        # would wait on what the interrupt cut (a result half sent, a lock held)
        for w in multiprocessing.active_children():
            w.kill()
        raise
    except BaseException:
        finish(pool)
        raise
    finish(pool)
    if tty:
        print(file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local folder with the tokenizer files")
    ap.add_argument("--sep", help="the token that ends each example (default: the tokenizer's eos token)")
    ap.add_argument("--jobs", type=int, default=min(len(os.sched_getaffinity(0)), JOBS),
                    help="processes that render and tokenize (default: the cores this process may use, at most %d)"
                    % JOBS)
    ap.add_argument("--tokens-per-file", type=int, default=FILE_TOKENS,
                    help="more tokens go to numbered parts of OUT, cut between examples (default and most: 2^31-1)")
    ap.add_argument("input", help="JSON lines: chat messages or prompt/completion")
    ap.add_argument("out", help="the token file; the mask goes next to it (.mask.bin)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        fail("--jobs %d: at least 1" % a.jobs, 2)
    if not 1 <= a.tokens_per_file <= FILE_TOKENS:
        fail("--tokens-per-file %d: from 1 to %d" % (a.tokens_per_file, FILE_TOKENS), 2)
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
    try:
        with TokenFiles(a.out, len(tok), a.tokens_per_file, masks=True) as files:
            stream = Stream(files)
            convert(tok, a.input, stream, sep, a.jobs)
            if not stream.examples:  # an empty token file would fail later, in smp-train, farther from the cause
                fail("%s: no example (the file is empty or holds blank lines only)" % a.input, 3)
            names = files.close()
    except OSError as e:
        fail("%s: %s" % (e.filename or a.input, e.strerror or e), 1)
    except FileLimit as e:
        fail(str(e), 3)
    where = a.out if len(names) == 1 else "%s (%d files: --data %s --loss-mask %s)" % (
        a.out, len(names), part_glob(a.out), part_glob(a.out, mask=True))
    print(f"{where}: {stream.examples} examples, {stream.files.count} tokens, {stream.targets} target tokens "
          f"(vocabulary {len(tok)}); separator {tok.convert_ids_to_tokens(sep)}: smp-train --documents --doc-sep {sep}")


if __name__ == "__main__":
    interruptible("prepare_sft", main)
