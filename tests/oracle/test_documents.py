"""Fine-tuning data: packed documents (--documents) and loss masks (--loss-mask), against
transformers and torch (fp32, CPU).

The reference is what users do with transformers for packed examples: position_ids
restarting at each document, a block-diagonal causal mask (4-D, with the sliding window
for Mistral), labels -100 where a token is not a target: the first token of each
document (as DataCollatorWithFlattening does) and tokens whose mask byte is 0.

- smp-eval with --documents and/or --loss-mask equals transformers' loss within 1e-5
  (Llama; Mistral with a window shorter than the sequence);
- the gradients of a packed, masked batch (--dump-grads, 1 and 2 microbatches) equal
  autograd's within 1e-4;
- every parallel layout (cp=2/4 with documents crossing chunk and rank boundaries, pp,
  tp with sequence parallelism, dp, mixes; FP8 delayed scaling at cp=2) tracks the
  single-rank run within 2e-4; recomputation and resume are bit-exact;
- a step without a counted target logs "loss": null and leaves the weights alone;
- bad masks and flags: one error line, exit 3 (naming both files when the counts differ)
  or 2.
"""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

import models
from conftest import run
from test_parallel import assert_tracks, layout_of, mpirun
from test_train import datasets, make_ckpt, read_log, rel, torch_model, vocab_of, write_tokens

SEP = 2  # the tiny models' eos_token_id (transformers' default): --documents' default separator
SEQ = 48


def write_mask(path, mask):
    """The loss mask format, written independently of tools/: 256 int32 (magic 20241201,
    version 1, count), then a byte per token."""
    mask = np.asarray(mask, np.uint8)
    h = np.zeros(256, dtype="<i4")
    h[:3] = (20241201, 1, len(mask))
    path.write_bytes(h.tobytes() + mask.tobytes())
    return path


def packed(V, n, rng, max_len=20):
    """n tokens of documents (random lengths 1..max_len, tokens other than SEP), each ended
    by SEP, and a random mask (about 60% targets)."""
    out = []
    while len(out) < n:
        k = int(rng.integers(1, max_len + 1))
        out += [int(t) for t in rng.choice([t for t in range(V) if t != SEP], size=k)] + [SEP]
    toks = np.array(out[:n])
    return toks, (rng.random(n) < 0.6).astype(np.uint8)


def reference_inputs(toks, mask, S, rows, window=None, documents=True):
    """input_ids, position_ids, the additive 4-D mask and labels of sequences `rows`
    (sequence j: tokens [j*S, j*S+S] as inputs and targets)."""
    ids, pos, masks, labels = [], [], [], []
    for j in rows:
        x, y = toks[j * S:j * S + S], toks[j * S + 1:j * S + S + 1].copy()
        p = np.zeros(S, np.int64)
        for t in range(1, S):
            p[t] = 0 if documents and x[t - 1] == SEP else p[t - 1] + 1
        doc = np.arange(S) - p
        i, k = np.arange(S)[:, None], np.arange(S)[None, :]
        ok = (k <= i) & (doc[:, None] == doc[None, :])
        if window:
            ok &= i - k < window
        m = np.where(ok, 0.0, torch.finfo(torch.float32).min).astype(np.float32)
        keep = np.ones(S, bool)
        if mask is not None:
            keep &= mask[j * S + 1:j * S + S + 1] == 1
        if documents:
            keep &= x != SEP  # the first token of a document is not a target
        y[~keep] = -100
        ids.append(x), pos.append(p), masks.append(m[None]), labels.append(y)
    return (torch.tensor(np.stack(ids)), torch.tensor(np.stack(pos)), torch.tensor(np.stack(masks)),
            torch.tensor(np.stack(labels)))


def reference_loss(model, toks, mask, S, rows, V, window=None, documents=True):
    """(sum of the counted targets' losses, their count) from transformers' model"""
    ids, pos, am, lab = reference_inputs(toks, mask, S, rows, window, documents)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    loss = F.cross_entropy(logits.reshape(-1, V), lab.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((lab != -100).sum())


def make_loud_ckpt(tmp, case):
    """case's model with sharp attention whose output weighs on the logits (q, k x4;
    v, o x3), so that what a token may see shows in the loss; its checkpoint"""
    hf = tmp / f"hf-{case}"
    model = models.make(case, hf)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, f in ((layer.self_attn.q_proj, 4.0), (layer.self_attn.k_proj, 4.0), (layer.self_attn.v_proj, 3.0),
                            (layer.self_attn.o_proj, 3.0)):
                proj.weight.mul_(f)
    model.save_pretrained(str(hf), safe_serialization=True)
    ck = tmp / f"ck-{case}"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=1", check=0)
    return hf, ck


def window_of(case):
    return models.CASES[case][1].get("sliding_window")


# ---------------------------------------------------------------- eval vs transformers
@pytest.mark.parametrize("case", ["llama-gqa-f32", "mistral-gqa-f16-window"])
def test_eval_matches_transformers(tmp_path, case):
    hf, ck = make_loud_ckpt(tmp_path, case)
    V, B, NB = vocab_of(case), 3, 2
    toks, mask = packed(V, NB * B * SEQ + 1, np.random.default_rng(11))
    data, mfile = write_tokens(tmp_path / "d.bin", toks), write_mask(tmp_path / "d.mask.bin", mask)
    model = torch_model(hf)
    window = window_of(case)
    for flags, m, docs in [(["--documents", "--loss-mask", mfile], mask, True), (["--documents"], None, True),
                           (["--loss-mask", mfile], mask, False)]:
        got = json.loads(run("smp-eval", "--ckpt", ck, "--data", data, "--batch", B, "--seq", SEQ, "--json", *flags,
                             check=0).stdout)
        total, n = 0.0, 0
        with torch.no_grad():
            for b in range(NB):
                s, c = reference_loss(model, toks, m, SEQ, range(b * B, b * B + B), V, window, docs)
                total, n = total + s.item(), n + c
        ref = total / n
        assert got["tokens"] == n, (flags, got, n)
        assert abs(got["loss"] - ref) <= 1e-5 * ref, (flags, got, ref)
    # the documents matter: the same targets seen through one causal stream (positions
    # not restarted, no block mask) give a clearly other loss; and so does the plain causal
    # mask with the restarted positions: transformers uses the custom 4-D mask as given
    ids, pos, am, lab = reference_inputs(toks, mask, SEQ, range(B), window, documents=True)
    ids0, pos0, am0, _ = reference_inputs(toks, mask, SEQ, range(B), window, documents=False)

    def loss(x, m, p):
        return F.cross_entropy(model(input_ids=x, attention_mask=m, position_ids=p).logits.reshape(-1, V),
                               lab.reshape(-1), ignore_index=-100).item()
    with torch.no_grad():
        ld, l0, lc = loss(ids, am, pos), loss(ids0, am0, pos0), loss(ids, am0, pos)
    assert abs(ld - l0) > 2e-4 * ld, (ld, l0)  # 20x the tolerance above
    assert abs(ld - lc) > 2e-4 * ld, (ld, lc)


# ---------------------------------------------------------------- gradients vs autograd
@pytest.mark.parametrize("case,micro", [("llama-gqa-f32", 1), ("llama-tied-bf16-llama3", 2),
                                        ("mistral-gqa-f16-window", 1)])
def test_gradients_match_autograd(tmp_path, case, micro):
    hf, ck = make_loud_ckpt(tmp_path, case)
    V, B = vocab_of(case), 4
    toks, mask = packed(V, B * SEQ + 1, np.random.default_rng(12))
    data, mfile = write_tokens(tmp_path / "d.bin", toks), write_mask(tmp_path / "d.mask.bin", mask)
    out = run("smp-train", "--ckpt", ck, "--data", data, "--dump-grads", tmp_path / "g", "--steps", 1, "--batch", B,
              "--microbatches", micro, "--seq", SEQ, "--documents", "--loss-mask", mfile, check=0)
    got = load_file(str(tmp_path / "g" / "grads.safetensors"))
    model = torch_model(hf)
    s, n = reference_loss(model, toks, mask, SEQ, range(B), V, window_of(case))
    (s / n).backward()
    assert abs(float(out.stdout.split("loss ")[1].split(",")[0]) - s.item() / n) <= 1e-5 * s.item() / n
    for name, p in model.named_parameters():
        assert rel(got[name], p.grad.numpy()) < 1e-4, (name, rel(got[name], p.grad.numpy()))


# ---------------------------------------------------------------- every layout
models.CASES.setdefault("llama-no-eos", ("llama", dict(vocab_size=101, hidden_size=48, intermediate_size=88,
                                                       num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                                                       eos_token_id=None), torch.float32, {}))
PCASE = "llama-tp-kv2"  # 8 heads, 2 kv heads (test_parallel_cp's)
models.CASES.setdefault(PCASE, ("llama", dict(vocab_size=103, hidden_size=32, intermediate_size=70,
                                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2),
                                torch.float32, {}))
PSEQ = 32
PCOMMON = ["--batch", 8, "--seq", PSEQ, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5, "--documents"]


@pytest.fixture(scope="module")
def psetup(tmp_path_factory):
    """documents of 1..12 tokens (many cross the cp chunks of 16, 8 and 4 tokens), masks,
    the checkpoint, and the single-rank reference runs (by microbatches)"""
    tmp = tmp_path_factory.mktemp("docs-par")
    rng = np.random.default_rng(13)
    toks, mask = packed(103, 6000, rng, max_len=12)
    vt, vm = packed(103, 2000, rng, max_len=12)
    files = dict(data=write_tokens(tmp / "d.bin", toks), mask=write_mask(tmp / "d.mask.bin", mask),
                 val=write_tokens(tmp / "v.bin", vt), vmask=write_mask(tmp / "v.mask.bin", vm))
    _, ck = make_ckpt(tmp, PCASE, sharp=True)

    def args(out, ckpt=ck):
        return ["--ckpt", ckpt, "--data", files["data"], "--loss-mask", files["mask"], "--val-data", files["val"],
                "--val-loss-mask", files["vmask"], "--val-every", 3, "--val-batches", 2, "--save-dir", out,
                "--log", out / "log.jsonl", *PCOMMON]

    class Refs(dict):
        def __missing__(self, micro):
            out = tmp / f"ref-m{micro}"
            run("smp-train", *args(out), "--steps", 6, "--microbatches", micro, "--lanes", 1, check=0)
            self[micro] = read_log(out / "log.jsonl")
            return self[micro]
    return tmp, args, Refs()


@pytest.mark.parametrize("layout,micro,extra", [
    ("cp=2", 1, []),
    ("cp=4", 1, []),                          # chunks of 4 tokens: documents span several ranks
    ("pp=2", 2, []),
    ("tp=2", 1, ["--sequence-parallel"]),
    ("dp=2", 1, []),
    ("dp=2", 1, ["--lanes", 4]),              # each replica its 4 sequences over 4 lanes (on one thread)
    ("tp=2,cp=2,dp=2", 2, []),                # 8 ranks
    ("pp=2,cp=2", 2, []),
])
def test_layouts_match_one_rank(psetup, layout, micro, extra):
    tmp, args, refs = psetup
    lay = layout_of(layout)
    out = tmp / f"run-{layout}-m{micro}{''.join(map(str, extra))}"
    mpirun(lay["pp"] * lay["tp"] * lay["cp"] * lay["dp"], *args(out), "--steps", 6, "--layout", layout,
           "--microbatches", micro, *extra)
    rows, ref = read_log(out / "log.jsonl"), refs[micro * lay["dp"]]
    if "--lanes" in extra:  # the count ran and was saved
        st = json.loads((out / "step-000006" / "smp.json").read_text())["training"]
        assert st["lanes"] == extra[extra.index("--lanes") + 1]
    assert [r["targets"] for r in rows] == [q["targets"] for q in ref]
    assert all(0 < r["targets"] < 8 * PSEQ for r in rows)  # the masks and documents left targets out
    assert_tracks(rows, ref, 2e-4, f"documents {layout} microbatches {micro}")
    vals = [(r["val_loss"], q["val_loss"]) for r, q in zip(rows, ref) if "val_loss" in q]
    assert len(vals) == 2 and max(rel(a, b) for a, b in vals) < 2e-4


@pytest.mark.parametrize("lanes,micro", [(4, 1), (2, 2), (8, 1)])
def test_lanes_match_one_lane(psetup, lanes, micro):
    # each lane its documents and masks (8 lanes: a sequence each)
    tmp, args, refs = psetup
    out = tmp / f"run-lanes{lanes}-m{micro}"
    p = run("smp-train", *args(out), "--steps", 6, "--microbatches", micro, "--lanes", lanes, check=0)
    assert f"{lanes} lanes of {8 // micro // lanes} sequence" in p.stderr, p.stderr
    rows, ref = read_log(out / "log.jsonl"), refs[micro]
    assert [r["targets"] for r in rows] == [q["targets"] for q in ref]
    assert_tracks(rows, ref, 2e-4, f"documents, {lanes} lanes, microbatches {micro}")
    vals = [(r["val_loss"], q["val_loss"]) for r, q in zip(rows, ref) if "val_loss" in q]
    assert len(vals) == 2 and max(rel(a, b) for a, b in vals) < 2e-4


@pytest.mark.parametrize("recompute", ["attention", "full"])
def test_recompute_is_bit_exact(psetup, recompute):
    tmp, args, refs = psetup
    out = tmp / f"recompute-{recompute}"
    run("smp-train", *args(out), "--steps", 6, "--recompute", recompute, "--lanes", 1, check=0)
    assert [(r["loss"], r["grad_norm"]) for r in read_log(out / "log.jsonl")] == \
        [(q["loss"], q["grad_norm"]) for q in refs[1]]


def test_fp8_context_parallel_matches_one_rank(psetup):
    tmp, args, _ = psetup
    one, two = tmp / "fp8-1", tmp / "fp8-cp2"
    run("smp-train", *args(one), "--steps", 6, "--fp8", "delayed", check=0)
    mpirun(2, *args(two), "--steps", 6, "--fp8", "delayed", "--layout", "cp=2")
    assert_tracks(read_log(two / "log.jsonl"), read_log(one / "log.jsonl"), 2e-4, "documents fp8 delayed cp=2")


def test_resume_is_bit_exact(psetup):
    tmp, args, refs = psetup
    a = tmp / "resume"
    run("smp-train", *args(a), "--steps", 6, "--stop-at", 3, "--lanes", 1, check=0)
    run("smp-train", *args(a, ckpt=a), check=0)  # the run folder: its latest, step 3 (and its one lane)
    rows = read_log(a / "log.jsonl")
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(q["loss"], q["grad_norm"]) for q in refs[1]]
    st = json.loads((a / "step-000006" / "smp.json").read_text())["training"]
    assert st["data"]["document_separator"] == SEP and len(st["data"]["loss_masks"]) == 1


# ---------------------------------------------------------------- steps without targets
def test_step_without_targets_logs_null_and_keeps_the_weights(tmp_path):
    case = "llama-gqa-f32"
    _, ck = make_ckpt(tmp_path, case, sharp=False)
    V, S = vocab_of(case), 16
    toks = np.random.default_rng(3).integers(0, V, size=4 * S + 1)
    mask = np.zeros(len(toks), np.uint8)
    mask[2 * S + 5:] = 1  # the first two sequences (one step of batch 2) have no target
    data, mfile = write_tokens(tmp_path / "d.bin", toks), write_mask(tmp_path / "d.mask.bin", mask)
    out = tmp_path / "run"
    run("smp-train", "--ckpt", ck, "--data", data, "--loss-mask", mfile, "--save-dir", out, "--steps", 2,
        "--batch", 2, "--seq", S, "--save-every", 1, "--log", out / "log.jsonl", check=0)
    rows = read_log(out / "log.jsonl")
    assert rows[0]["loss"] is None and rows[0]["targets"] == 0 and rows[0]["skipped"] is True
    assert rows[1]["loss"] is not None and rows[1]["targets"] == 2 * S - 4  # tokens 2S+5 .. 4S
    before, after = datasets(ck), datasets(out / "step-000001")
    for name in before:
        if name.startswith("params/"):
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    st = json.loads((out / "step-000001" / "smp.json").read_text())["training"]
    assert st["step"] == 1 and st["optimizer_step"] == 0
    assert st["data"]["loss_masks"] == [str(mfile)] and st["data"]["document_separator"] is None


# ---------------------------------------------------------------- bad inputs
def test_bad_masks_and_flags(tmp_path):
    case = "llama-gqa-f32"
    _, ck = make_ckpt(tmp_path, case, sharp=False)
    V, S = vocab_of(case), 16
    toks = np.random.default_rng(4).integers(0, V, size=200)
    data = write_tokens(tmp_path / "d.bin", toks)
    good = write_mask(tmp_path / "good.mask.bin", np.ones(200, np.uint8))
    short = write_mask(tmp_path / "short.mask.bin", np.ones(199, np.uint8))
    two = write_mask(tmp_path / "two.mask.bin", np.r_[np.ones(150, np.uint8), [2], np.ones(49, np.uint8)])
    magic = tmp_path / "magic.mask.bin"
    magic.write_bytes(write_tokens(tmp_path / "t.bin", np.ones(200, int)).read_bytes())
    trunc = tmp_path / "trunc.mask.bin"
    trunc.write_bytes(good.read_bytes()[:-3])
    base = ["--ckpt", ck, "--data", data, "--seq", S, "--batch", 2]
    evalc = lambda *a: run("smp-eval", *base, *a)  # noqa: E731
    trainc = lambda *a: run("smp-train", *base, "--steps", 1, "--save-dir", tmp_path / "o", *a)  # noqa: E731
    for cmd in (evalc, trainc):
        for mfile, code, words in [(short, 3, [str(short), str(data), "199", "200"]), (two, 3, [str(two), "150"]),
                                   (magic, 3, [str(magic), "not a loss mask"]), (trunc, 3, [str(trunc)]),
                                   (f"{good},{good}", 2, ["2 loss mask files for 1 token files"])]:
            p = cmd("--loss-mask", mfile)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == code and len(lines) == 1, (mfile, p.returncode, p.stderr)
            assert all(w in lines[0] for w in words), (mfile, lines)
        for flags, words in [(["--documents", "--doc-sep", V], ["--doc-sep"]), (["--doc-sep", 1], ["--documents"]),
                             (["--documents", "--doc-sep", "x"], ["--doc-sep"])]:
            p = cmd(*flags)
            assert p.returncode == 2 and all(w in p.stderr for w in words), (flags, p.stderr)
    # a glob that takes the mask with the tokens (sft*.bin: sft.bin, sft.mask.bin) names the mask as such, and a
    # token file given as a mask is named as one
    os.makedirs(tmp_path / "g")
    write_tokens(tmp_path / "g" / "sft.bin", toks)
    gm = write_mask(tmp_path / "g" / "sft.mask.bin", np.ones(200, np.uint8))
    p = run("smp-eval", "--ckpt", ck, "--data", tmp_path / "g" / "sft*.bin", "--seq", S, "--batch", 2)
    assert p.returncode == 3 and p.stderr.splitlines() == [
        f"smp-eval: error: {gm}: a loss mask file, not a token file (masks go with --loss-mask)"], p.stderr
    p = evalc("--loss-mask", magic)
    assert p.stderr.splitlines() == [f"smp-eval: error: {magic}: a token file, not a loss mask file (tokens go with --data)"]
    # a model without an eos token needs --doc-sep
    _, ck2 = make_ckpt(tmp_path, "llama-no-eos", sharp=False)
    p = run("smp-eval", "--ckpt", ck2, "--data", data, "--seq", S, "--batch", 2, "--documents")
    assert p.returncode == 2 and "eos_token_id" in p.stderr and "--doc-sep" in p.stderr, p.stderr
    p = run("smp-eval", "--ckpt", ck2, "--data", data, "--seq", S, "--batch", 2, "--documents", "--doc-sep", 5,
            "--json", check=0)
    assert json.loads(p.stdout)["tokens"] == 12 * S - int((toks[:12 * S] == 5).sum())
    # a mask file that is a FIFO is refused at once, not waited on
    fifo = tmp_path / "fifo.mask.bin"
    os.mkfifo(fifo)
    p = evalc("--loss-mask", fifo)
    assert p.returncode == 3 and str(fifo) in p.stderr
