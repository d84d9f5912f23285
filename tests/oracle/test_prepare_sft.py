"""tools/prepare_sft.py against transformers: the token stream is apply_chat_template's
(or the tokenizer's) token by token, the mask marks exactly the assistant turns (checked
against the template's {% generation %} markers and by decoding the spans), the headers,
and every bad line's error. Tokenizers are trained here (no network)."""
import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import prepare_sft  # noqa: E402
import tokenize_hf  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]"]
WORDS = ("the cat sat on a mat and then it ran to the big red house where an old dog slept all day "
         "what is two plus three answer five please explain why sky blue light scatters more at short "
         "wavelengths you are helpful assistant héllo wörld ünïcödé naïve café").split()

# Qwen2-Instruct's template (a default system prompt when the first message is not one).
QWEN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same rendering with {% generation %} markers around the assistant turns.
QWEN_GEN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
            "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-3-Instruct's template (bos, header ids, <|eot_id|> which is also the eos).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Mistral-Instruct-v0.1-style: raises unless the roles alternate user/assistant.
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
# style: (template, eos, end of turn, the separator; --sep where the eos ends turns too)
STYLES = {"qwen": (QWEN, "<|endoftext|>", "<|im_end|>\n", "<|endoftext|>"),
          "qwen_gen": (QWEN_GEN, "<|endoftext|>", "<|im_end|>\n", "<|endoftext|>"),
          "llama3": (LLAMA3, "<|eot_id|>", "<|eot_id|>", "<|endoftext|>"), "mistral": (MISTRAL, "</s>", "</s>", "</s>"),
          "none": (None, "<|endoftext|>", "", "<|endoftext|>")}


@pytest.fixture(scope="session")
def bpe():
    """A byte-level BPE trained on WORDS."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    tk = Tokenizer(tm.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def save_tok(d, tk, tmpl, eos):
    """tk saved as a transformers tokenizer in d, loaded back: (d, tokenizer)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, bos_token="<|begin_of_text|>",
                            chat_template=tmpl).save_pretrained(str(d))
    return d, AutoTokenizer.from_pretrained(str(d), local_files_only=True)


@pytest.fixture(scope="session")
def toks(tmp_path_factory, bpe):
    """The BPE saved once per chat template: {style: (folder, tokenizer)}."""
    return {style: save_tok(tmp_path_factory.mktemp("tok_" + style), bpe, tmpl, eos)
            for style, (tmpl, eos, _, _) in STYLES.items()}


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice([".", "?", "!\n", "\n\n- item"])


def conversation(rng):
    msgs = [{"role": "system", "content": sentence(rng, 6)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        msgs += [{"role": "user", "content": sentence(rng, rng.randint(1, 12))},
                 {"role": "assistant", "content": sentence(rng, rng.randint(1, 12))}]
    if rng.random() < 0.3:
        msgs.append({"role": "user", "content": sentence(rng, 4)})  # ends with a prompt: no target at the end
    return {"messages": msgs}


def ids_of(r):
    return list(r["input_ids"] if hasattr(r, "keys") else r)


def sep_of(style, toks):
    return toks[style][1].convert_tokens_to_ids(STYLES[style][3])


def prepare(tmp_path, style, toks, lines, capsys, name="in.jsonl", sep=True, args=("--jobs", "1")):
    """Run the tool in-process on lines (str or objects), with the style's --sep where it
    is not the eos: (rc, stdout, stderr, tokens, mask, headers)."""
    src = tmp_path / name
    src.write_bytes(b"".join((x if isinstance(x, bytes) else
                              (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n" for x in lines))
    out = tmp_path / "out.bin"
    try:
        extra = ["--sep", STYLES[style][3]] if sep and STYLES[style][3] != STYLES[style][1] else []
        prepare_sft.main(["--tokenizer", str(toks[style][0]), *extra, *args, str(src), str(out)])
        rc = 0
    except SystemExit as e:
        rc = e.code
    o, e = capsys.readouterr()
    if rc or not out.exists():  # an error, or parts (parts_of)
        return rc, o, e, None, None, None
    raw, mraw = out.read_bytes(), (tmp_path / "out.mask.bin").read_bytes()
    h, mh = np.frombuffer(raw[:1024], "<i4"), np.frombuffer(mraw[:1024], "<i4")
    t = np.frombuffer(raw[1024:], "<u2" if h[0] == 20240520 else "<u4")
    return rc, o, e, t.tolist(), np.frombuffer(mraw[1024:], np.uint8).tolist(), (h, mh)


def runs(mask):
    """The [start, end) spans of the 1s."""
    m = np.concatenate([[0], np.asarray(mask, np.int8), [0]])
    d = np.flatnonzero(np.diff(m))
    return list(zip(d[::2], d[1::2]))


def expected_chat(tok, ex, sep):
    ids = ids_of(tok.apply_chat_template(ex["messages"], tokenize=True))
    return ids if ids[-1] == sep else ids + [sep]


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_chat_tokens_and_spans(tmp_path, toks, capsys, style):
    rng = random.Random(7)
    exs = [conversation(rng) for _ in range(40)]
    tok, eot, sep = toks[style][1], STYLES[style][2], STYLES[style][3]
    rc, o, e, t, m, (h, mh) = prepare(tmp_path, style, toks, exs, capsys)
    assert rc == 0, e
    want = [i for ex in exs for i in expected_chat(tok, ex, sep_of(style, toks))]
    assert t == want and len(m) == len(t)
    assert (h[0], h[1], h[2]) == (20240520, 1, len(t)) and (mh[0], mh[1], mh[2]) == (20241201, 1, len(t))
    assert not h[3:].any() and not mh[3:].any() and set(m) <= {0, 1}
    # decoding the target spans gives the assistant contents, each with its end of turn
    # (and the appended eos, a target after a target)
    got = [tok.decode(t[a:b], clean_up_tokenization_spaces=False) for a, b in runs(m)]
    spans = []
    for ex in exs:
        msgs = ex["messages"]
        for k, msg in enumerate(msgs):
            if msg["role"] == "assistant":
                c = (msg["content"].strip() if style == "llama3" else msg["content"]) + eot
                last = k == len(msgs) - 1
                spans.append(c + (sep if last and eot != sep else ""))
    assert got == spans
    assert "%d examples, %d tokens, %d target tokens (vocabulary %d); separator %s: smp-train --documents --doc-sep %d" % (
        len(exs), len(t), sum(m), len(tok), sep, sep_of(style, toks)) in o


def test_separator_inside_an_example_is_refused(tmp_path, toks, capsys):
    """Llama-3's eos ends every turn: as the separator it would cut the examples."""
    ex = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    rc, _, e, *_ = prepare(tmp_path, "llama3", toks, [ex, ex], capsys, sep=False)
    assert rc == 3 and ":1: the separator <|eot_id|>" in e and "--sep" in e, e
    src = tmp_path / "in.jsonl"
    for bad in ("<|nope|>", "zzzzqqq"):
        with pytest.raises(SystemExit) as x:
            prepare_sft.main(["--tokenizer", str(toks["llama3"][0]), "--sep", bad, str(src), str(tmp_path / "o.bin")])
        assert x.value.code == 2 and "--sep" in capsys.readouterr().err


def test_chat_mask_matches_generation_markers(tmp_path, toks, capsys):
    """The prefix method (template without markers) against transformers' own
    return_assistant_tokens_mask on the same rendering with {% generation %} markers."""
    rng = random.Random(3)
    exs = [conversation(rng) for _ in range(30)]
    rc, _, e, t, m, _ = prepare(tmp_path, "qwen", toks, exs, capsys)
    assert rc == 0, e
    gen = toks["qwen_gen"][1]
    want_t, want_m = [], []
    for ex in exs:
        r = gen.apply_chat_template(ex["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, am = list(r["input_ids"]), list(r["assistant_masks"])
        want_t += ids + [gen.eos_token_id]
        want_m += am + [am[-1]]
    assert t == want_t and m == want_m


def post_processors():
    from tokenizers import processors
    bos = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 3)])
    return {"none": None, "bytelevel_trim": processors.ByteLevel(trim_offsets=True),
            "sequence": processors.Sequence([processors.ByteLevel(trim_offsets=True), bos])}


@pytest.mark.parametrize("proc", ["bytelevel_trim", "sequence"])
def test_post_processors_change_nothing(tmp_path, toks, bpe, capsys, proc):
    """GPT-2's and Llama-3's post-processors (ByteLevel trims whitespace off the offsets;
    a template adds a bos, but not to apply_chat_template's encoding): the same tokens as
    apply_chat_template's, the same mask as without a post-processor."""
    import copy
    tk = copy.deepcopy(bpe)
    tk.post_processor = post_processors()[proc]
    d, tok = save_tok(tmp_path / "tok", tk, QWEN, "<|endoftext|>")
    assert tk.token_to_id("<|begin_of_text|>") == 3 and tok.backend_tokenizer.post_processor is not None
    exs = [conversation(random.Random(13)) for _ in range(25)]
    base = prepare(tmp_path, "qwen", toks, exs, capsys)
    rc, _, e, t, m, _ = prepare(tmp_path, "qwen", {"qwen": (d, tok)}, exs, capsys)
    assert rc == 0 == base[0], e
    assert t == [i for ex in exs for i in expected_chat(tok, ex, tok.eos_token_id)] and (t, m) == base[3:5]


# A generation prompt that ends in a space: the byte-level BPE joins it to the first word.
SPACE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
# The same, with the space written as the turn's: every turn starts on a token.
NOSPACE = ("{% for message in messages %}{{ message['role'] + ':' + ' ' + message['content'] + '\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@pytest.mark.parametrize("proc", ["none", "bytelevel_trim"])
def test_a_token_across_a_turn_boundary_is_refused(tmp_path, bpe, capsys, proc):
    """' the' starts in the prompt and ends in the answer: refused, whether the offsets
    the tokenizer reports are trimmed (the space hidden) or not; with the space on the
    turn's side, the turn is ' the cat.\\n'."""
    import copy
    tk = copy.deepcopy(bpe)
    tk.post_processor = post_processors()[proc]
    msgs = [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "the cat."}]
    styles = {"space": save_tok(tmp_path / "sp", tk, SPACE, "<|endoftext|>"),
              "nospace": save_tok(tmp_path / "nsp", tk, NOSPACE, "<|endoftext|>")}
    ok = {"prompt": "a", "completion": "b"}
    rc, _, e, *_ = prepare(tmp_path, "space", styles, [ok, {"messages": msgs}], capsys, sep=False)
    assert rc == 3 and e.count("\n") == 1, e
    assert ":2: a token spans the start of message 1 (an assistant turn)" in e, e
    rc, _, e, t, m, _ = prepare(tmp_path, "nospace", styles, [{"messages": msgs}], capsys, sep=False)
    tok = styles["nospace"][1]
    assert rc == 0 and t == expected_chat(tok, {"messages": msgs}, tok.eos_token_id), e
    assert [tok.decode(t[a:b]) for a, b in runs(m)] == [" the cat.\n<|endoftext|>"]


def test_long_chats_render_their_prefixes_in_parts(tmp_path, toks, capsys, monkeypatch):
    """A chat of 150 turns among short ones, the prefixes rendered a few hundred
    characters at a time and the input taken 3000 bytes at a time: the same stream as
    in one go, and transformers' own mask from the {% generation %} markers."""
    rng = random.Random(17)
    long = [{"role": r, "content": sentence(rng, rng.randint(1, 8))} for _ in range(150) for r in ("user", "assistant")]
    exs = [conversation(rng) for _ in range(6)] + [{"messages": long}] + [conversation(rng) for _ in range(6)]
    whole = prepare(tmp_path, "qwen", toks, exs, capsys)
    monkeypatch.setattr(prepare_sft, "RENDER_CHARS", 300)
    monkeypatch.setattr(prepare_sft, "BATCH_BYTES", 3000)
    rc, _, e, t, m, _ = prepare(tmp_path, "qwen", toks, exs, capsys)
    assert rc == 0 == whole[0] and (t, m) == whole[3:5], e
    gen, want_t, want_m = toks["qwen_gen"][1], [], []
    for ex in exs:
        r = gen.apply_chat_template(ex["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        want_t += list(r["input_ids"]) + [gen.eos_token_id]
        want_m += list(r["assistant_masks"]) + [r["assistant_masks"][-1]]
    assert t == want_t and m == want_m and sum(m) > 1500


def test_generation_template_itself(tmp_path, toks, capsys):
    rng = random.Random(5)
    exs = [conversation(rng) for _ in range(10)]
    a = prepare(tmp_path, "qwen", toks, exs, capsys)
    b = prepare(tmp_path, "qwen_gen", toks, exs, capsys)
    assert a[0] == b[0] == 0 and a[3:5] == b[3:5]


def test_prompt_completion(tmp_path, toks, capsys):
    tok = toks["qwen"][1]
    pairs = [("", "the cat sat."),
             ("Q: what is two plus three?\n", "A: five."),  # the prompt's tokens are a prefix of the whole's
             ("answer ", "five"),  # " five" is one token in the whole: the two are tokenized apart
             ("héllo", " wörld<|endoftext|>")]  # already ends with the eos
    rc, o, e, t, m, _ = prepare(tmp_path, "qwen", toks, [{"prompt": p, "completion": c} for p, c in pairs], capsys)
    assert rc == 0, e
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    assert enc("answer ") != enc("answer five")[:len(enc("answer "))]
    want_t, want_m = [], []
    for p, c in pairs:
        ids = enc(p + c) if enc(p + c)[:len(enc(p))] == enc(p) else enc(p) + enc(c)
        tail = [] if ids[-1] == tok.eos_token_id else [tok.eos_token_id]
        want_t += ids + tail
        want_m += [0] * len(enc(p)) + [1] * (len(ids) - len(enc(p)) + len(tail))
    assert t == want_t and m == want_m
    texts = [tok.decode(t[a:b], clean_up_tokenization_spaces=False) for a, b in runs(m)]
    assert texts == ["the cat sat.<|endoftext|>", "A: five.<|endoftext|>", "five<|endoftext|>",
                     " wörld<|endoftext|>"]


def test_mixed_file_blank_lines_and_batches(tmp_path, toks, capsys, monkeypatch):
    """Both forms interleaved, blank lines skipped, batch boundaries anywhere."""
    monkeypatch.setattr(prepare_sft, "BATCH", 7)
    rng = random.Random(11)
    tok = toks["llama3"][1]
    exs = [conversation(rng) if rng.random() < 0.5 else
           {"prompt": sentence(rng, 5), "completion": " " + sentence(rng, 3), "id": 1} for _ in range(50)]
    lines = []
    for ex in exs:
        lines += [ex] + ([""] if rng.random() < 0.3 else []) + (["   \t"] if rng.random() < 0.1 else [])
    rc, _, e, t, m, _ = prepare(tmp_path, "llama3", toks, [""] + lines, capsys)
    assert rc == 0, e
    want_t = []
    for ex in exs:
        if "messages" in ex:
            ids = expected_chat(tok, ex, sep_of("llama3", toks))
        else:
            ids = tok(ex["prompt"] + ex["completion"], add_special_tokens=False)["input_ids"] + [sep_of("llama3", toks)]
        want_t += ids
    assert t == want_t
    monkeypatch.setattr(prepare_sft, "BATCH", 1024)
    one = prepare(tmp_path, "llama3", toks, lines, capsys)
    assert (one[3], one[4]) == (t, m)


def test_jobs_give_the_same_stream(tmp_path, toks, capsys, monkeypatch):
    """Batches of 4 lines over 1, 2 and 3 processes: the same files; of two bad lines in
    different batches, the first is the one named, whichever process meets it first."""
    monkeypatch.setattr(prepare_sft, "BATCH", 4)
    rng = random.Random(19)
    exs = [conversation(rng) if rng.random() < 0.7 else {"prompt": sentence(rng, 4), "completion": sentence(rng, 3)}
           for _ in range(40)]
    runs_ = [prepare(tmp_path, "qwen", toks, exs, capsys, args=("--jobs", j)) for j in ("1", "2", "3")]
    assert all(r[0] == 0 for r in runs_) and runs_[0][3:5] == runs_[1][3:5] == runs_[2][3:5]
    assert runs_[0][3] == [i for ex in exs for i in (expected_chat(toks["qwen"][1], ex, sep_of("qwen", toks))
                                                      if "messages" in ex else
                                                      toks["qwen"][1](ex["prompt"] + ex["completion"])["input_ids"]
                                                      + [sep_of("qwen", toks)])]
    bad = exs[:9] + ['{"messages": 1}'] + exs[9:30] + ["[]"] + exs[30:]
    for j in ("1", "3"):
        rc, o, e, *_ = prepare(tmp_path, "qwen", toks, bad, capsys, args=("--jobs", j))
        assert rc == 3 and e == "prepare_sft: error: %s:10: messages must be a list\n" % (tmp_path / "in.jsonl"), e
    with pytest.raises(SystemExit) as x:
        prepare_sft.main(["--tokenizer", str(toks["qwen"][0]), "--jobs", "0", "in.jsonl", "o.bin"])
    assert x.value.code == 2 and "--jobs 0: at least 1" in capsys.readouterr().err


def parts_of(out):
    """The tokens, masks and counts of OUT's parts (OUT-0000.bin, ...), in order."""
    got = []
    for k in range(100):
        t, m = out.with_name("%s-%04d.bin" % (out.stem, k)), out.with_name("%s-%04d.mask.bin" % (out.stem, k))
        if not t.exists():
            break
        h, mh = np.frombuffer(t.read_bytes()[:12], "<i4"), np.frombuffer(m.read_bytes()[:12], "<i4")
        toks, mask = np.frombuffer(t.read_bytes()[1024:], "<u2"), np.frombuffer(m.read_bytes()[1024:], np.uint8)
        assert h[2] == mh[2] == len(toks) == len(mask) and mh[0] == 20241201, (t, h, mh)
        got.append((toks.tolist(), mask.tolist()))
    return got


def test_more_tokens_than_a_file_holds_go_to_parts_cut_between_examples(tmp_path, toks, capsys, monkeypatch):
    """--tokens-per-file: each part ends with an example's separator, holds at most N
    tokens, its mask beside it; the parts together are the one file's stream; the last
    line gives the globs; a run with fewer parts removes the earlier run's extra ones
    (and one file, every part); an example longer than a file is refused, nothing left."""
    rng = random.Random(23)
    exs = [conversation(rng) for _ in range(30)]
    rc, o, e, t, m, _ = prepare(tmp_path, "qwen", toks, exs, capsys)
    sep = sep_of("qwen", toks)
    longest = max(len(expected_chat(toks["qwen"][1], ex, sep)) for ex in exs)
    out = tmp_path / "out.bin"
    for n in (longest, 2 * longest):
        out.unlink(missing_ok=True)  # (a file and parts may lie side by side: each run names its own)
        rc, o, e, *_ = prepare(tmp_path, "qwen", toks, exs, capsys, args=("--jobs", "2", "--tokens-per-file", str(n)))
        parts = parts_of(out)
        assert rc == 0 and len(parts) > 2 and not out.exists(), (rc, e)
        assert all(len(pt) <= n and pt[-1] == sep for pt, _ in parts)
        assert sum((pt for pt, _ in parts), []) == t and sum((pm for _, pm in parts), []) == m
        assert "(%d files: --data '%s' --loss-mask '%s')" % (
            len(parts), tmp_path / "out-????.bin", tmp_path / "out-????.mask.bin") in o, o
        if n == longest:
            many = len(parts)
    assert len(parts) < many and not (tmp_path / ("out-%04d.bin" % len(parts))).exists()
    assert not (tmp_path / ("out-%04d.mask.bin" % len(parts))).exists()
    rc, o, e, t1, m1, _ = prepare(tmp_path, "qwen", toks, exs, capsys)
    assert rc == 0 and (t1, m1) == (t, m) and parts_of(out) == [] and not (tmp_path / "out-0000.mask.bin").exists()
    out.unlink()
    (tmp_path / "out.mask.bin").unlink()
    rc, o, e, *_ = prepare(tmp_path, "qwen", toks, exs, capsys, args=("--tokens-per-file", str(longest - 1)))
    assert rc == 3 and e.count("\n") == 1, e
    assert "an example of %d tokens, longer than a file's %d" % (longest, longest - 1) in e, e
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.jsonl"]
    monkeypatch.setattr(tokenize_hf, "MAX_PARTS", 3)  # (the glob's four digits: 10000 parts)
    rc, o, e, *_ = prepare(tmp_path, "qwen", toks, exs, capsys, args=("--tokens-per-file", str(longest)))
    assert rc == 3 and e == "prepare_sft: error: %s: more than 3 files of %d tokens: a larger --tokens-per-file\n" % (
        out, longest), e
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.jsonl"]
    for bad in ("0", str(2**31)):
        with pytest.raises(SystemExit) as x:
            prepare_sft.main(["--tokenizer", str(toks["qwen"][0]), "--tokens-per-file", bad, "in.jsonl", "o.bin"])
        assert x.value.code == 2 and "--tokens-per-file %s: from 1 to 2147483647" % bad in capsys.readouterr().err


BAD = [
    ('{"messages": [', "not JSON"),
    (b'{"prompt": "\xff", "completion": "x"}', "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"text": "hello"}', "neither"),
    ('{"prompt": "only a prompt"}', "neither"),
    ('{"messages": "hi"}', "messages must be a list"),
    ('{"messages": []}', "empty messages"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}', "message 0"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "message 0"),
    ('{"messages": ["user"]}', "message 0"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}', "no assistant turn"),
    ('{"prompt": 1, "completion": "x"}', "must be strings"),
    ('{"prompt": "p", "completion": ""}', "empty completion"),
    ('{"prompt": "p", "completion": "c", "messages": []}', "both forms"),
    # Qwen's default system prompt is not in the rendering of the empty prefix
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "not prefix-stable at message 0"),
]


@pytest.mark.parametrize("line,what", BAD)
def test_bad_lines(tmp_path, toks, capsys, line, what):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    rc, o, e, *_ = prepare(tmp_path, "qwen", toks, [good, "", line, good], capsys)
    src = tmp_path / "in.jsonl"
    assert rc == 3 and e.count("\n") == 1, e
    assert e.startswith("prepare_sft: error: %s:3: " % src) and what in e, e
    assert not (tmp_path / "out.bin").exists()


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_no_example_is_refused(tmp_path, toks, capsys, lines):
    rc, o, e, *_ = prepare(tmp_path, "qwen", toks, lines, capsys)
    assert rc == 3 and e == "prepare_sft: error: %s: no example (the file is empty or holds blank lines only)\n" % (
        tmp_path / "in.jsonl"), e
    assert not (tmp_path / "out.bin").exists()


def test_template_errors(tmp_path, toks, capsys):
    alt = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    rc, _, e, t, m, _ = prepare(tmp_path, "mistral", toks, [{"messages": alt}] * 3, capsys)
    assert rc == 0 and t == expected_chat(toks["mistral"][1], {"messages": alt}, sep_of("mistral", toks)) * 3, e
    rc, _, e, *_ = prepare(tmp_path, "mistral", toks, [{"messages": alt}] * 4 + [{"messages": bad}, {"messages": alt}],
                           capsys)
    assert rc == 3 and ":5: the chat template failed" in e and "must alternate" in e, e
    rc, _, e, *_ = prepare(tmp_path, "none", toks, [{"prompt": "a", "completion": "b"}, {"messages": alt}], capsys)
    assert rc == 3 and ":2: a messages line, but the tokenizer has no chat template" in e, e


def test_uint32_tokens(tmp_path, capsys):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "</s>": 1, **{"w%d" % i: i + 2 for i in range(70000)}}
    tk = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>").save_pretrained(
        str(tmp_path / "big"))
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "w5 w69000", "completion": " w69999"}) + "\n")
    prepare_sft.main(["--tokenizer", str(tmp_path / "big"), str(tmp_path / "in.jsonl"), str(tmp_path / "o")])
    raw, mraw = (tmp_path / "o").read_bytes(), (tmp_path / "o.mask.bin").read_bytes()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [20240801, 7, 4]
    assert np.frombuffer(raw[1024:], "<u4").tolist() == [7, 69002, 70001, 1] and len(raw) == 1024 + 16
    assert np.frombuffer(mraw[:12], "<i4").tolist() == [20241201, 1, 4] and list(mraw[1024:]) == [0, 0, 1, 1]
    assert "1 examples, 4 tokens, 2 target tokens (vocabulary 70002)" in capsys.readouterr().out


def test_writers(tmp_path):
    for vocab, magic, dt in ((65536, (20240520, 1), "<u2"), (65537, (20240801, 7), "<u4")):
        tokenize_hf.write_tokens(tmp_path / "t.bin", [0, 65535, 7], vocab)
        raw = (tmp_path / "t.bin").read_bytes()
        assert np.frombuffer(raw[:1024], "<i4").tolist() == [*magic, 3] + [0] * 253
        assert np.frombuffer(raw[1024:], dt).tolist() == [0, 65535, 7]
    tokenize_hf.write_mask(tmp_path / "m.bin", [1, 0, 1, 1])
    raw = (tmp_path / "m.bin").read_bytes()
    assert np.frombuffer(raw[:1024], "<i4").tolist() == [20241201, 1, 4] + [0] * 253 and raw[1024:] == b"\1\0\1\1"


def test_progress_on_a_terminal(tmp_path, toks, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _, e, *_ = prepare(tmp_path, "qwen", toks, [{"prompt": "a", "completion": "b"}] * 3, capsys)
    assert rc == 0 and e.startswith("\rprepare_sft: 3 examples, ") and "MB/s" in e and e.endswith("\n"), e


PIPE = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import prepare_sft
sys.stderr.isatty = lambda: True
prepare_sft.BATCH = 50
data = open(sys.argv[3], "rb").read()
writer = threading.Thread(target=lambda: open(sys.argv[4], "wb").write(data), daemon=True)
writer.start()
prepare_sft.main(["--tokenizer", sys.argv[2], "--jobs", "2", sys.argv[4], sys.argv[5]])
"""


def test_a_pipe_is_an_input(tmp_path, toks):
    """`<(zcat chats.jsonl.gz)`: a FIFO read as the file is, the progress counted (a pipe
    has no position: the first version failed with "Illegal seek"), here written by a
    thread of the same process: the workers fork before the input opens (forked after,
    they held the writer's end and the reading never ended)."""
    import os
    rng = random.Random(29)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(800)))  # more than a pipe holds
    os.mkfifo(tmp_path / "in.fifo")
    p = subprocess.run([sys.executable, "-c", PIPE, str(ROOT / "tools"), str(toks["qwen"][0]), str(src),
                        str(tmp_path / "in.fifo"), str(tmp_path / "p.bin")], capture_output=True, text=True, timeout=120)
    assert src.stat().st_size > 4 * 65536
    assert p.returncode == 0 and "prepare_sft: 800 examples, " in p.stderr and "error" not in p.stderr, p.stderr
    prepare_sft.main(["--tokenizer", str(toks["qwen"][0]), "--jobs", "1", str(src), str(tmp_path / "f.bin")])
    for x in (".bin", ".mask.bin"):
        assert (tmp_path / ("p" + x)).read_bytes() == (tmp_path / ("f" + x)).read_bytes()


def test_an_interrupt_leaves_nothing(tmp_path, toks):
    """Ctrl-C (SIGINT to the whole process group, workers included) while the parts are
    being written: one line, exit 130, no file left (it printed a traceback from every
    process)."""
    import os
    import signal
    import time
    rng = random.Random(31)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(9000)))
    assert src.stat().st_size > 2 << 20  # a first batch (BATCH_BYTES), then the pipe stays open
    os.mkfifo(tmp_path / "in.fifo")
    writer = subprocess.Popen(["sh", "-c", 'exec >"$2"; cat "$1"; sleep 100', "sh", str(src), str(tmp_path / "in.fifo")])
    p = subprocess.Popen([sys.executable, str(ROOT / "tools" / "prepare_sft.py"), "--tokenizer", str(toks["qwen"][0]),
                          "--jobs", "2", str(tmp_path / "in.fifo"), str(tmp_path / "out.bin")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         # as a terminal's Ctrl-C finds it: a suite started in the background (`&`) runs
                         # with SIGINT ignored, which the tool would inherit (and rightly keep)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(600):
            if any(".tmp-" in x.name for x in tmp_path.iterdir()) or p.poll() is not None:
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        writer.kill()
        writer.wait()
    assert p.returncode == 130 and err == "prepare_sft: interrupted: no output written\n", err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.fifo", "in.jsonl"]


def test_cli(tmp_path, toks):
    """The script end to end: the files, the exit codes of a usage and an I/O error."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "the cat", "completion": " sat."}) + "\n")
    cmd = [sys.executable, str(ROOT / "tools" / "prepare_sft.py")]
    p = subprocess.run(cmd + ["--tokenizer", str(toks["qwen"][0]), str(src), str(tmp_path / "o.bin")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and (tmp_path / "o.mask.bin").exists() and p.stderr == "", p.stderr
    assert subprocess.run(cmd + [str(src)], capture_output=True).returncode == 2
    p = subprocess.run(cmd + ["--tokenizer", str(toks["qwen"][0]), str(tmp_path / "missing.jsonl"),
                              str(tmp_path / "o.bin")], capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("prepare_sft: error: %s" % (tmp_path / "missing.jsonl")), p.stderr


def test_tokenizer_without_eos(tmp_path, capsys):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(tm.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(str(tmp_path / "t"))
    (tmp_path / "in.jsonl").write_text('{"prompt": "a", "completion": "a"}\n')
    with pytest.raises(SystemExit) as e:
        prepare_sft.main(["--tokenizer", str(tmp_path / "t"), str(tmp_path / "in.jsonl"), str(tmp_path / "o.bin")])
    assert e.value.code == 2 and "the tokenizer has no eos token" in capsys.readouterr().err


def tokenize(args, capsys):
    """tokenize_hf in this process: (exit status, stdout, stderr)"""
    try:
        tokenize_hf.main([str(a) for a in args])
        rc = 0
    except SystemExit as e:
        rc = e.code
    o, e = capsys.readouterr()
    return rc, o, e


def test_tokenize_hf_documents_of_records(tmp_path, capsys, monkeypatch):
    """tokenize_hf --text-key KEY (pretraining corpora's records): each JSON line's or
    Parquet row's string KEY is a document, encoded on its own (transformers' encode of
    it: a SentencePiece-style prefix space at every document's start), the eos after each
    with --eot; blank lines skipped, other keys and columns ignored, .gz read through
    gzip and .zst (several frames) through zstandard, text inputs too, Parquet written by
    pyarrow in several row groups, a document longer than a piece (4 KiB here) cut as a
    file is, many short ones encoded together. A record without that string stops the
    run naming the file and line or row (exit 3), and no output takes its name; so does a
    damaged .gz or .zst (one cut inside a frame too) or Parquet file."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    monkeypatch.setattr(tokenize_hf, "PIECE", 4096)
    rng = np.random.default_rng(5)
    words = ["".join(rng.choice(list("abcdeéüñ漢字z"), size=rng.integers(1, 8))) for _ in range(300)]
    ends = ["\n", "\n\n", " \n", ".\n", "\r\n", " ", "\t"]

    def doc(n):
        return "".join(" ".join(rng.choice(words, size=rng.integers(1, 12))) + ends[rng.integers(0, len(ends))]
                       for _ in range(n))
    docs = [doc(int(rng.integers(0, 6))) for _ in range(300)] + [doc(2000), "", "  lead\r\nand tail\n\n"]
    rng.shuffle(docs)
    assert max(map(len, docs)) > 3 * 4096 and "" in docs
    half = len(docs) // 2
    lines = [json.dumps({"id": k, "text": d, "meta": {"text": 1}}, ensure_ascii=k % 2 == 0) for k, d in enumerate(docs)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:half]) + "\n\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\r\n".join(lines[half:-100]))  # no line end after the last
    zc = zstandard.ZstdCompressor()
    z = [zc.compress("".join(x + "\n" for x in lines[a:b]).encode()) for a, b in ((-100, -60), (-60, -30))]
    (tmp_path / "c.jsonl.zst").write_bytes(z[0] + z[1])  # two frames, as pzstd writes
    pq.write_table(pa.table({"id": list(range(30)), "text": docs[-30:]}), tmp_path / "d.parquet", row_group_size=7)
    inputs = [tmp_path / f for f in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet")]
    bpe = Tokenizer(tm.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ms = Tokenizer(tm.BPE(unk_token="<unk>"))
    ms.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    ms.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    for name, tk in (("bpe", bpe), ("metaspace", ms)):
        tk.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>"]))
        fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")
        fast.save_pretrained(str(tmp_path / name))
        for eot in (["--eot"], []):
            out = tmp_path / f"{name}.bin"
            rc, o, e = tokenize(["--tokenizer", tmp_path / name, *eot, "--text-key", "text", out, *inputs], capsys)
            assert rc == 0, e
            want = []
            for d in docs:
                want += fast.encode(d, add_special_tokens=False) + ([fast.eos_token_id] if eot else [])
            raw = out.read_bytes()
            assert np.frombuffer(raw[:1024], "<i4")[2] == len(want)
            assert np.frombuffer(raw[1024:], "<u2").tolist() == want, (name, eot)
            m = re.search(r"(\d+) documents, encoded in (\d+) piece", o)
            assert m and int(m.group(1)) == len(docs) and int(m.group(2)) >= sum(map(bool, docs)) + 10, o
            sep = f"; each ends with eos {fast.eos_token_id}: smp-train --documents --doc-sep {fast.eos_token_id}\n"
            assert o.endswith(sep) == bool(eot), o
    # text files read through gzip and zstandard: the tokens of each file as it is
    long = max(docs, key=len)
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(long.encode()))
    (tmp_path / "t.txt.zst").write_bytes(zc.compress(long.encode()))
    fast = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "bpe"))
    want = fast.encode(long.replace("\r\n", "\n"), add_special_tokens=False) + [fast.eos_token_id]
    assert tokenize(["--tokenizer", tmp_path / "bpe", "--eot", tmp_path / "t.bin", tmp_path / "t.txt.gz",
                     tmp_path / "t.txt.zst"], capsys)[0] == 0
    assert np.frombuffer((tmp_path / "t.bin").read_bytes()[1024:], "<u2").tolist() == want * 2
    # one line that is not a document: the run stops there, naming the file and line
    good = json.dumps({"text": "fine"})
    bad = {"not JSON": ('{"text": "cut', "not JSON (Unterminated string starting at column 10)"),
           "nested": ("[" * 100000, "not JSON that Python reads (nested too deeply)"),
           "no key": ('{"body": "x"}', 'not an object with a string "text"'),
           "a number": ('{"text": 7}', 'not an object with a string "text"'),
           "null": ('{"text": null}', 'not an object with a string "text"'),
           "a list": ('["text"]', 'not an object with a string "text"'),
           "a lone surrogate": ('{"text": "a\\ud800b"}', '"text" holds a lone surrogate (\\ud800): not Unicode text')}
    bj = tmp_path / "bad.jsonl"
    for what, (line, msg) in bad.items():
        bj.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
        rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin", bj], capsys)
        assert (rc, e) == (3, f"tokenize_hf: error: {bj}:3: {msg}\n"), what
        assert not (tmp_path / "x.bin").exists(), what
    bj.write_bytes(f"{good}\n".encode() + b'{"text": "\xff"}\n')
    rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin", bj], capsys)
    assert (rc, e) == (3, f"tokenize_hf: error: {bj}:2: not UTF-8 text (byte {len(good) + 1 + 10})\n")
    # Parquet rows without the string: a missing column, another type, a null
    for what, table, msg in (
            ("no column", pa.table({"body": ["x"]}), 'no column "text" (it has body)'),
            ("numbers", pa.table({"text": [1, 2]}), 'column "text" holds int64, not strings'),
            ("a null", pa.table({"text": ["a"] * 9 + [None]}), 'row 9: "text" is null')):
        pq.write_table(table, tmp_path / "bad.parquet", row_group_size=4)
        rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin",
                             tmp_path / "bad.parquet"], capsys)
        assert (rc, e) == (3, f"tokenize_hf: error: {tmp_path / 'bad.parquet'}: {msg}\n"), what
        assert not (tmp_path / "x.bin").exists(), what
    # damaged files, exit 3: a .gz cut short, a .zst cut inside a frame, each in no format at all, a Parquet
    # file cut short
    gz, zs, pqb = ((tmp_path / f).read_bytes() for f in ("b.jsonl.gz", "c.jsonl.zst", "d.parquet"))
    damaged = {"cut.jsonl.gz": (gz[:len(gz) // 2], "damaged gzip data ("),
               "plain.jsonl.gz": (b"not gzip\n", "damaged gzip data ("),
               "cut.jsonl.zst": (zs[:len(z[0]) + 9], "damaged zstd data (the file ends inside a frame)"),
               "plain.jsonl.zst": (b"not zstd\n", "damaged zstd data ("),
               "cut.parquet": (pqb[:len(pqb) - 9], "not a Parquet file ("),
               "plain.parquet": (b'{"text": "json"}\n', "not a Parquet file (")}
    for f, (data, msg) in damaged.items():
        (tmp_path / f).write_bytes(data)
        rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin",
                             tmp_path / "a.jsonl", tmp_path / f], capsys)
        assert rc == 3 and e.startswith(f"tokenize_hf: error: {tmp_path / f}: {msg}"), (f, e)
        assert len(e.splitlines()) == 1 and not (tmp_path / "x.bin").exists()
    # a missing input of each kind: an I/O error, exit 1
    for f in ("nope.parquet", "nope.jsonl.zst", "nope.jsonl.gz"):
        rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin", tmp_path / f],
                            capsys)
        assert (rc, e) == (1, f"tokenize_hf: error: {tmp_path / f}: No such file or directory\n"), f
    # without pyarrow or zstandard (imported only for such inputs): exit 2, naming the package
    real = tokenize_hf.importlib.import_module
    monkeypatch.setattr(tokenize_hf.importlib, "import_module",
                        lambda m: (_ for _ in ()).throw(ImportError(m)) if m in ("pyarrow", "zstandard") else real(m))
    for f, pkg, why in (("d.parquet", "pyarrow", "reading Parquet"), ("c.jsonl.zst", "zstandard", "reading .zst")):
        rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", "--text-key", "text", tmp_path / "x.bin", tmp_path / f],
                            capsys)
        assert (rc, e) == (2, f"tokenize_hf: error: {tmp_path / f}: {why} needs Python's {pkg} package "
                              f"(pip install {pkg})\n")
    monkeypatch.undo()
    # the text of a damaged .gz too
    rc, o, e = tokenize(["--tokenizer", tmp_path / "bpe", tmp_path / "x.bin", tmp_path / "cut.jsonl.gz"], capsys)
    assert rc == 3 and e.startswith(f"tokenize_hf: error: {tmp_path / 'cut.jsonl.gz'}: damaged gzip data (")


def test_tokenize_hf_progress_on_a_terminal(tmp_path, toks, capsys, monkeypatch):
    """On a terminal tokenize_hf shows a line after each batch (the inputs' stored bytes
    read, tokens, MB/s, the share done and the time left), ended at the last; an error
    after it gets a line of its own."""
    import gzip
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(tokenize_hf, "PIECE", 4096)
    rng = random.Random(31)
    text = "".join(sentence(rng, rng.randint(3, 12)) + ".\n" for _ in range(1500))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(text.encode()))
    size = sum((tmp_path / f).stat().st_size for f in ("a.txt", "b.txt.gz"))
    rc, o, e = tokenize(["--tokenizer", toks["qwen"][0], tmp_path / "x.bin", tmp_path / "a.txt", tmp_path / "b.txt.gz"],
                        capsys)
    lines = e.split("\r")
    assert rc == 0 and lines[0] == "" and len(lines) > 10 and e.endswith("\n"), e
    for line in lines[1:-1]:
        assert re.fullmatch(r"tokenize_hf: [\d.]+ MB read, \d+ tokens, [\d.]+ MB/s, \d+%, \d+(s|m\d\ds|h\d\dm) left"
                            r"\x1b\[K", line), line
    assert re.fullmatch(r"tokenize_hf: %.1f MB read, %d tokens, [\d.]+ MB/s, 100%%, 0s left\x1b\[K\n"
                        % (size / 1e6, np.fromfile(tmp_path / "x.bin", "<i4", 3)[2]), lines[-1]), lines[-1]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": text}) + "\n" + "{oops\n")
    rc, o, e = tokenize(["--tokenizer", toks["qwen"][0], "--text-key", "text", tmp_path / "y.bin", tmp_path / "bad.jsonl"],
                        capsys)
    assert rc == 3 and e.startswith("\rtokenize_hf: ") and e.endswith(
        f"\x1b[K\ntokenize_hf: error: {tmp_path / 'bad.jsonl'}:2: not JSON (Expecting property name enclosed in "
        "double quotes at column 2)\n"), e
