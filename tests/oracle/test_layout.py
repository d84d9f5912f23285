"""Layouts and partition rules of libshard, checked on configs that transformers writes:
every tensor stored exactly once, replicas identical, each tensor-parallel group holding
the whole tensor, attention heads owned as Megatron owns them, and the automatic stage
split no worse than any other (brute force)."""
import ctypes
import itertools

import numpy as np
import pytest

import models
from conftest import Coords, Layout, ModelDesc, Piece, TensorSpec

(T_EMBED, T_Q, T_K, T_V, T_O, T_GATE, T_UP, T_DOWN, T_NORM_ATTN, T_NORM_MLP, T_NORM_FINAL, T_HEAD,
 T_Q_BIAS, T_K_BIAS, T_V_BIAS, T_Q_NORM, T_K_NORM,
 T_QKV, T_QKV_BIAS, T_O_BIAS, T_UP_BIAS, T_DOWN_BIAS, T_NORM_ATTN_BIAS, T_NORM_MLP_BIAS, T_NORM_FINAL_BIAS,
 T_ROUTER, T_EXPERT_GATE, T_EXPERT_UP, T_EXPERT_DOWN) = range(29)
E_USAGE = 3

# Beyond models.CASES: head counts that make tp=3 and tp=6 legal, odd sizes, a vocabulary
# smaller than tp, ties, and a vocabulary big enough to weigh on the stage split.
EXTRA = {
    "llama-12h-6kv": ("llama", dict(vocab_size=103, hidden_size=96, intermediate_size=50, num_hidden_layers=5,
                                    num_attention_heads=12, num_key_value_heads=6)),
    "llama-12h-3kv-tied": ("llama", dict(vocab_size=7, hidden_size=48, intermediate_size=20, num_hidden_layers=4,
                                         num_attention_heads=12, num_key_value_heads=3, tie_word_embeddings=True)),
    "llama-6h-mha-v5": ("llama", dict(vocab_size=5, hidden_size=24, intermediate_size=4, num_hidden_layers=6,
                                      num_attention_heads=6, num_key_value_heads=6)),
    "mistral-6h-1kv-bigvocab": ("mistral", dict(vocab_size=5003, hidden_size=24, intermediate_size=36,
                                                num_hidden_layers=7, num_attention_heads=6, num_key_value_heads=1,
                                                head_dim=8)),
}
ALL = {name: (fam, kw) for name, (fam, kw, _dt, _sv) in models.CASES.items()}
ALL.update(EXTRA)


@pytest.fixture(scope="module")
def descs(shard, tmp_path_factory):
    """Each config saved by transformers, then read by shard_config_load."""
    out = {}
    for name, (fam, kw) in ALL.items():
        path = tmp_path_factory.mktemp(name)
        cls, model_cls = models.classes(fam)
        cls(architectures=[model_cls.__name__], **kw).save_pretrained(str(path))  # what a model's save_pretrained writes
        d = ModelDesc()
        assert shard.shard_config_load(str(path / "config.json").encode(), ctypes.byref(d)) == 0, shard.shard_errmsg()
        out[name] = d
    return out


def tensors(shard, d):
    out = []
    for i in range(shard.shard_model_tensor_count(ctypes.byref(d))):
        t = TensorSpec()
        shard.shard_model_tensor(ctypes.byref(d), i, ctypes.byref(t))
        out.append(t)
    return out


def layout(shard, text):
    l = Layout()
    assert shard.shard_layout_parse(text.encode(), ctypes.byref(l)) == 0, shard.shard_errmsg()
    return l


def stages(shard, d, pp, spec="auto"):
    s = (ctypes.c_int * pp)()
    assert shard.shard_stages_parse(spec.encode(), ctypes.byref(d), pp, s) == 0, shard.shard_errmsg()
    return list(s)


def slices(p, ndim):
    return tuple(slice(p.box.off[k], p.box.off[k] + p.box.len[k]) for k in range(ndim))


def legal(d, tp, pp):
    return d.heads % tp == 0 and (d.kv_heads % tp == 0 or tp % d.kv_heads == 0) and pp <= d.layers


def layouts_of(d):
    for tp, pp, cp, dp in itertools.product((1, 2, 3, 6), range(1, d.layers + 1), (1, 2), (1, 2)):
        yield tp, pp, cp, dp, f"tp={tp},pp={pp},cp={cp},dp={dp}"


@pytest.mark.parametrize("name", list(ALL))
def test_partition_rules(shard, descs, name):
    d = descs[name]
    specs = tensors(shard, d)
    checked = 0
    for tp, pp, cp, dp, text in layouts_of(d):
        l = layout(shard, text)
        rc = shard.shard_layout_check(ctypes.byref(l), ctypes.byref(d))
        if not legal(d, tp, pp):
            assert rc == E_USAGE and f"tp={tp}" in shard.shard_errmsg().decode()
            continue
        assert rc == 0, shard.shard_errmsg()
        # the auto split, and an explicit lopsided one (one layer on every stage but the last)
        splits = [stages(shard, d, pp)]
        if pp > 1:
            splits.append(stages(shard, d, pp, ",".join(["1"] * (pp - 1) + [str(d.layers - pp + 1)])))
        for lps in splits:
            check_layout(shard, d, specs, l, lps)
            checked += 1
    assert checked > 0


def check_layout(shard, d, specs, l, lps):
    n = shard.shard_layout_size(ctypes.byref(l))
    assert n == l.pp * l.tp * l.cp * l.dp
    coords = [shard.shard_layout_coords(ctypes.byref(l), r) for r in range(n)]
    arr = (ctypes.c_int * l.pp)(*lps)
    stage_of = [s for s, k in enumerate(lps) for _ in range(k)]
    nH, nKV, hd, tp = d.heads, d.kv_heads, d.head_dim, l.tp
    for t in specs:
        shape = tuple(t.shape[k] for k in range(t.ndim))
        pieces = []
        for r in range(n):
            p = Piece()
            assert shard.shard_partition(ctypes.byref(d), ctypes.byref(l), arr, ctypes.byref(t), r, ctypes.byref(p)) == 0, \
                shard.shard_errmsg()
            assert p.box.ndim == t.ndim
            assert not p.writes or p.holds
            pieces.append(p)
        # (1) the written boxes tile the tensor exactly once
        cov = np.zeros(shape, np.int32)
        for p in pieces:
            if p.writes:
                cov[slices(p, t.ndim)] += 1
        assert (cov == 1).all(), (t.name, l.pp, l.tp, l.cp, l.dp, lps)
        # the stages that hold it
        if t.role == T_EMBED:
            want = {0, l.pp - 1} if d.tie_word_embeddings else {0}
        elif t.role in (T_NORM_FINAL, T_NORM_FINAL_BIAS, T_HEAD):
            want = {l.pp - 1}
        else:
            want = {stage_of[t.layer]}
            assert shard.shard_stage_of_layer(arr, l.pp, t.layer) == stage_of[t.layer]
        by_pos = {}
        for c, p in zip(coords, pieces):
            assert p.holds == (c.pp in want), (t.name, c.pp)
            # (2) cp and dp replicas hold what cp=0,dp=0 holds, and only that one writes
            key = (c.pp, c.tp)
            box = (p.holds, tuple(p.box.off[:t.ndim]), tuple(p.box.len[:t.ndim]))
            assert by_pos.setdefault(key, box) == box
            if c.cp or c.dp:
                assert not p.writes
        for s in want:
            # (3) one tensor-parallel group at one stage holds the whole tensor
            cov = np.zeros(shape, np.int32)
            group = [by_pos[(s, r)] for r in range(tp)]
            for _, off, ln in group:
                cov[tuple(slice(o, o + k) for o, k in zip(off, ln))] += 1
            assert (cov >= 1).all(), (t.name, s)
            check_heads(d, t, group, tp)


# roles split by heads: (the split dim, a head's width in head_dims, query or kv heads);
# GPT-NeoX's fused qkv holds per head its q, k and v rows, 3 head_dims together
BY_HEADS = {T_Q: (0, 1, "q"), T_O: (1, 1, "q"), T_K: (0, 1, "kv"), T_V: (0, 1, "kv"), T_Q_BIAS: (0, 1, "q"),
            T_K_BIAS: (0, 1, "kv"), T_V_BIAS: (0, 1, "kv"), T_QKV: (0, 3, "q"), T_QKV_BIAS: (0, 3, "q")}
BY_ROWS = {T_GATE: 0, T_UP: 0, T_DOWN: 1, T_EMBED: 0, T_HEAD: 0, T_UP_BIAS: 0,  # blocks of ceil(N / tp)
           T_EXPERT_GATE: 0, T_EXPERT_UP: 0, T_EXPERT_DOWN: 1}  # each expert as a dense MLP


def check_heads(d, t, group, tp):
    """(4) Megatron's ownership: query head h on tp rank h // (nH/tp), and each rank holds
    exactly the kv heads (h // (nH/nKV)) its query heads read."""
    nH, nKV, hd = d.heads, d.kv_heads, d.head_dim
    for r, (_, off, ln) in enumerate(group):
        q_heads = set(range(r * (nH // tp), (r + 1) * (nH // tp)))
        assert all(h // (nH // tp) == r for h in q_heads)
        full = list(range(t.ndim))
        if t.role in BY_HEADS:
            dim, width, kind = BY_HEADS[t.role]
            w = width * hd
            assert t.shape[dim] == (nH if kind == "q" else nKV) * w, t.name
            assert off[dim] % w == 0 and ln[dim] % w == 0
            held = set(range(off[dim] // w, (off[dim] + ln[dim]) // w))
            if kind == "q":
                assert held == q_heads, t.name
            else:
                assert held == {h // (nH // nKV) for h in q_heads}, t.name
            full.remove(dim)
        elif t.role in BY_ROWS:
            dim = BY_ROWS[t.role]
            N = t.shape[dim]
            b = -(-N // tp)
            assert off[dim] == min(r * b, N) and ln[dim] == max(0, min(b, N - r * b)), t.name
            full.remove(dim)
        elif t.role == T_ROUTER:  # [experts, hidden], whole on every rank
            assert t.ndim == 2 and t.shape[0] == d.experts, t.name
        else:  # norms, their biases, the biases added after a sum over tp (dense, dense_4h_to_h)
            assert t.ndim == 1, t.name
        for k in full:
            assert off[k] == 0 and ln[k] == t.shape[k], t.name


def stage_cost(d, pp, split):
    """The cost model of shard.h, restated: 2 flops per matmul weight per token plus 4 bytes
    per parameter; embedding (bytes) on stage 0; head (flops + bytes) and final norm on the last.
    A mixture of experts: a token's flops through the router and its k experts, the bytes of
    the router and all E experts."""
    H, F, V = d.hidden, d.intermediate, d.vocab
    QD, KD = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attn = 2 * H * QD + 2 * H * KD
    mlp = (2 if d.gelu_mlp else 3) * H * (d.moe_intermediate if d.experts else F)  # GELU: up, down; SwiGLU: gate too
    if d.experts:
        used, held = attn + d.experts * H + d.experts_per_tok * mlp, attn + d.experts * H + d.experts * mlp
    else:
        used = held = attn + mlp
    layer = 2 * used + 4 * (held + 2 * H)
    costs = [k * layer for k in split]
    costs[0] += 4 * V * H
    costs[-1] += 6 * V * H + 4 * H
    return max(costs)


def compositions(n, k):
    for cut in itertools.combinations(range(1, n), k - 1):
        b = (0,) + cut + (n,)
        yield [b[i + 1] - b[i] for i in range(k)]


@pytest.mark.parametrize("name", list(ALL))
def test_auto_stages_are_balanced(shard, descs, name):
    d = descs[name]
    for vocab in (d.vocab, 20000, 200000):  # heavier ends move layers off the first and last stages
        e = ModelDesc.from_buffer_copy(d)
        e.vocab = vocab
        for pp in range(1, d.layers + 1):
            got = stages(shard, e, pp)
            assert sum(got) == e.layers and min(got) >= 1
            every = sorted(compositions(e.layers, pp), key=lambda s: (stage_cost(e, pp, s), s))
            best = stage_cost(e, pp, every[0])
            assert stage_cost(e, pp, got) == best, (name, vocab, pp, got, every[0])
            assert got == every[0]  # ties: the lexicographically smallest, earlier stages lighter
        s = (ctypes.c_int * (d.layers + 1))()
        assert shard.shard_stages_auto(ctypes.byref(e), d.layers + 1, s) == E_USAGE


def test_explicit_stages_and_refusals(shard, descs):
    d = descs["llama-sharded"]  # 4 layers, 8 heads, 4 kv heads
    assert stages(shard, d, 3, "1,2,1") == [1, 2, 1]
    s = (ctypes.c_int * 4)()
    for spec, pp in [("1,2", 3), ("2,2,1", 3), ("0,4", 2), ("2,2,", 2), ("2;2", 2), ("1,1,1,1", 5), (" 2,2", 2)]:
        assert shard.shard_stages_parse(spec.encode(), ctypes.byref(d), pp, s) == E_USAGE, spec
        assert shard.shard_errmsg()
    l = layout(shard, "tp=3")
    assert shard.shard_layout_check(ctypes.byref(l), ctypes.byref(d)) == E_USAGE
    assert shard.shard_errmsg().decode() == "layout pp=1,tp=3,cp=1,dp=1: tp=3 does not divide the 8 attention heads"
    l = layout(shard, "pp=5")
    assert shard.shard_layout_check(ctypes.byref(l), ctypes.byref(d)) == E_USAGE
    assert "pp=5 exceeds the 4 layers" in shard.shard_errmsg().decode()


@pytest.mark.parametrize("text", ["pp=2,tp=4", "dp=3,tp=2,cp=2,pp=2", "tp=1", "cp=5,dp=7"])
def test_rank_coords_round_trip(shard, text):
    l = layout(shard, text)
    n = shard.shard_layout_size(ctypes.byref(l))
    seen = set()
    for r in range(n):
        c = shard.shard_layout_coords(ctypes.byref(l), r)
        assert ((c.pp * l.dp + c.dp) * l.cp + c.cp) * l.tp + c.tp == r
        assert shard.shard_layout_rank(ctypes.byref(l), c) == r
        seen.add((c.pp, c.tp, c.cp, c.dp))
    assert len(seen) == n
    assert shard.shard_layout_rank(ctypes.byref(l), Coords(l.pp, 0, 0, 0)) == -1


@pytest.mark.parametrize("text", ["pp=0", "tp=2,tp=2", "xx=1", "tp=2,", "tp=1e3", "tp=99999999", "", "tp=2,pp"])
def test_layout_parse_refusals(shard, text):
    l = Layout(9, 9, 9, 9)
    assert shard.shard_layout_parse(text.encode(), ctypes.byref(l)) == E_USAGE
    assert shard.shard_errmsg().decode().startswith(f'layout "{text}"')
    assert (l.pp, l.tp, l.cp, l.dp) == (9, 9, 9, 9)
