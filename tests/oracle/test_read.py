"""libshard's checkpoint reader (chunkread.c, verify.c) against outside implementations.

The reader locates each piece's chunks once, preads them, decompresses and unshuffles
them itself, checks each against its own XXH3 (attribute chunk_xxh3) and scatters the
wanted box. Everything here is checked against code that is not libshard's:

- h5py + hdf5plugin read the same shard files; numpy assembles each tensor from its
  datasets, placed by their `offset` attributes (not by smp.json), and slices boxes;
- ml_dtypes converts dtypes; libxxhash (ctypes) computes XXH64 and XXH3_64bits;
- safetensors reads smp-merge's exports.

Models are built with numpy (no torch) and sized so that pieces span several ~1 MiB
chunks with a partial last one, split along dim 0 (embedding, head, gate/up) and dim 1
(down_proj) by tp=2 and pp=2,tp=2, with and without zstd; a checkpoint written through
the C writer adds 1-D, 3-D and 4-D tensors (group fp8) of several dtypes in shard
files with different compression.
"""
import concurrent.futures
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import h5py
import hdf5plugin  # noqa: F401  (registers the zstd filter 32015 with h5py)
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import BUILD, BUILD_SAN, DT, Box, Layout, ModelDesc, load_lib, run, set_file_entry, xxh3, xxh64

# ------------------------------------------------------------------ outside oracles
# (libxxhash's XXH64 and XXH3_64bits: conftest's xxh64, xxh3)
DT_NAME = {v: k for k, v in DT.items()}
# the numpy dtype holding a dtype's bits (as h5py reads them) and the real type
RAW = {"F32": np.float32, "F64": np.float64, "BF16": np.uint16, "F16": np.uint16, "F8_E4M3": np.uint8,
       "F8_E5M2": np.uint8, "U8": np.uint8, "I32": np.int32}
REAL = {"F32": np.float32, "F64": np.float64, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
E_CORRUPT = 6
CHUNK_TARGET = 1 << 20


def convert(raw, src, dst):
    """ml_dtypes/numpy's conversion of raw bits of dtype src into raw bits of dst."""
    if src == dst:
        return raw
    return raw.view(REAL[src]).astype(REAL[dst]).view(RAW[dst])


# ------------------------------------------------------------------ libshard (ctypes)
class CkptTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("group", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 8), ("npieces", ctypes.c_size_t)]


class Compress(ctypes.Structure):
    _fields_ = [("zstd_level", ctypes.c_int), ("threads", ctypes.c_int), ("no_fsync", ctypes.c_int), ("planes", ctypes.c_int)]


def _load(build=BUILD):
    """A handle of our own on libshard, with the checkpoint API's signatures."""
    P, I, S, C = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p
    return load_lib(build / "lib" / "libshard.so", {
        "shard_errmsg": ([], C),
        "shard_ckpt_open": ([C, ctypes.POINTER(P)], I),
        "shard_ckpt_close": ([P], None),
        "shard_ckpt_tensor_count": ([P], S),
        "shard_ckpt_tensor_at": ([P, S], ctypes.POINTER(CkptTensor)),
        "shard_ckpt_find": ([P, C, C], ctypes.c_long),
        "shard_ckpt_read": ([P, S, ctypes.POINTER(Box), P, I], I),
        "shard_ckpt_set_threads": ([P, I], None),
        "shard_ckpt_set_uncached": ([P, I], None),
        "shard_ckpt_bytes_read": ([P], ctypes.c_uint64),
        "shard_ckpt_verify": ([P, ctypes.POINTER(ctypes.c_uint64)], I),
        "shard_h5_create": ([C, Compress, ctypes.POINTER(P)], I),
        "shard_h5_write_local": ([P, C, C, I, I, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(Box), P, I], I),
        "shard_h5_close": ([P], I),
        "shard_ckpt_begin": ([C, ctypes.POINTER(P)], I),
        "shard_ckpt_staging": ([P], C),
        "shard_ckpt_commit": ([P, C, S, ctypes.POINTER(ModelDesc), ctypes.POINTER(Layout), ctypes.POINTER(I), C, I], I),
        "shard_ckpt_abort": ([P], None),
        "shard_config_load": ([C, ctypes.POINTER(ModelDesc)], I),
    })


@pytest.fixture(scope="module")
def lib():
    return _load()


def make_box(off, ln):
    b = Box()
    b.ndim = len(off)
    for k, (o, n) in enumerate(zip(off, ln)):
        b.off[k], b.len[k] = int(o), int(n)
    return b


GUARD = 64  # bytes of 0xAB before and after every destination buffer


class Ckpt:
    """A checkpoint opened through libshard."""

    def __init__(self, lib, path, threads=1, uncached=False):
        self.lib, self.h = lib, ctypes.c_void_p()
        st = lib.shard_ckpt_open(str(path).encode(), ctypes.byref(self.h))
        assert st == 0, f"open {path}: {st}: {lib.shard_errmsg().decode()}"
        lib.shard_ckpt_set_threads(self.h, threads)
        lib.shard_ckpt_set_uncached(self.h, int(uncached))
        self.t = {}
        for i in range(lib.shard_ckpt_tensor_count(self.h)):
            t = lib.shard_ckpt_tensor_at(self.h, i).contents
            self.t[(t.group.decode(), t.name.decode())] = (i, DT_NAME[t.dtype], tuple(t.shape[:t.ndim]), t.npieces)

    def close(self):
        if self.h:
            self.lib.shard_ckpt_close(self.h)
            self.h = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def bytes_read(self):
        return self.lib.shard_ckpt_bytes_read(self.h)

    def read(self, key, off, ln, dt=None):
        """(status, message, array of the box in dtype dt's bits); the buffer's guards
        (bytes before and after it) must be untouched."""
        i, sdt, _, _ = self.t[key]
        dt = dt or sdt
        n = int(np.prod(ln, dtype=np.int64))
        es = np.dtype(RAW[dt]).itemsize
        buf = np.full(n * es + 2 * GUARD, 0xAB, dtype=np.uint8)
        box = make_box(off, ln)
        st = self.lib.shard_ckpt_read(self.h, i, ctypes.byref(box), buf.ctypes.data + GUARD, DT[dt])
        msg = self.lib.shard_errmsg().decode() if st else ""
        assert (buf[:GUARD] == 0xAB).all() and (buf[GUARD + n * es:] == 0xAB).all(), \
            f"{key} box {off}+{ln}: bytes written outside the destination"
        return st, msg, buf[GUARD:GUARD + n * es].view(RAW[dt]).reshape(ln)

    def read_ok(self, key, off, ln, dt=None):
        st, msg, a = self.read(key, off, ln, dt)
        assert st == 0, f"{key} box {off}+{ln}: status {st}: {msg}"
        return a


def assert_same(got, want, what):
    """Byte for byte, naming the first differing element."""
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    g = np.ascontiguousarray(got).view(np.uint8).reshape(got.shape + (-1,))
    w = np.ascontiguousarray(want).view(np.uint8).reshape(want.shape + (-1,))
    bad = np.argwhere((g != w).any(axis=-1))
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {got.size} elements differ; first at box index {i}: "
                             f"got {got[i]!r} (bits {g[i].tobytes().hex()}), expected {want[i]!r} "
                             f"(bits {w[i].tobytes().hex()})")


# ------------------------------------------------------------------ the h5py oracle
class Oracle:
    """Every tensor of a checkpoint assembled from the shard files by h5py and numpy,
    each dataset placed by its own attributes; and every piece's chunking."""

    def __init__(self, ck):
        self.full, self.dtype, self.pieces = {}, {}, {}
        seen = {}
        for f in sorted(ck.glob("shard-*.h5")):
            with h5py.File(f, "r") as h:
                items = []
                h.visititems(lambda n, o: items.append((n, o)) if isinstance(o, h5py.Dataset) else None)
                for path, ds in items:
                    a = ds.attrs
                    name = a["tensor"].decode() if isinstance(a["tensor"], bytes) else str(a["tensor"])
                    dt = a["dtype"].decode() if isinstance(a["dtype"], bytes) else str(a["dtype"])
                    group = path.rsplit("/", 1)[0]
                    assert path == f"{group}/{name}"
                    key = (group, name)
                    off, gshape = [int(x) for x in a["offset"]], [int(x) for x in a["global_shape"]]
                    data = ds[()]
                    assert data.dtype == np.dtype(RAW[dt]), (f, path, data.dtype)
                    if key not in self.full:
                        self.full[key] = np.zeros(gshape, RAW[dt])
                        seen[key] = np.zeros(gshape, np.int8)
                        self.dtype[key] = dt
                    sl = tuple(slice(o, o + n) for o, n in zip(off, data.shape))
                    self.full[key][sl] = data
                    seen[key][sl] += 1
                    self.pieces.setdefault(key, []).append(dict(
                        file=f.name, dataset="/" + path, off=off, shape=list(data.shape),
                        chunks=list(ds.chunks) if ds.chunks else None, data=data,
                        stored=ds.id.get_storage_size(), filters=filter_ids(ds),
                        chunk_xxh3=np.array(a["chunk_xxh3"]) if "chunk_xxh3" in a else None,
                        xxh64=a["xxh64"].decode() if isinstance(a["xxh64"], bytes) else str(a["xxh64"])))
        for key, s in seen.items():
            assert (s == 1).all(), f"{key}: not every element stored exactly once"

    def box(self, key, off, ln, dt=None):
        sl = tuple(slice(o, o + n) for o, n in zip(off, ln))
        return np.ascontiguousarray(convert(self.full[key][sl], self.dtype[key], dt or self.dtype[key]))

    def cuts(self, key):
        """Per dimension: coordinates where a piece or a chunk starts or ends."""
        shape = self.full[key].shape
        nd = len(shape)
        rdim = 0 if nd == 1 else nd - 2
        c = [{0, shape[d]} for d in range(nd)]
        for p in self.pieces[key]:
            for d in range(nd):
                c[d] |= {p["off"][d], p["off"][d] + p["shape"][d]}
            r = p["chunks"][rdim] if p["chunks"] else p["shape"][rdim]
            c[rdim] |= {p["off"][rdim] + k for k in range(0, p["shape"][rdim], r)}
        return [sorted(x) for x in c]


_ORACLES = {}


def oracle(ck):
    if ck not in _ORACLES:
        _ORACLES[ck] = Oracle(ck)
    return _ORACLES[ck]


def random_boxes(rng, shape, cuts, n_random):
    """The whole tensor; single rows, columns and elements at piece and chunk edges;
    then random boxes whose ends are mostly at (or one off) those edges."""
    nd = len(shape)
    out = [([0] * nd, list(shape))]
    for d in range(nd):
        for x in cuts[d]:
            for i in (x - 1, x):
                if 0 <= i < shape[d]:
                    off, ln = [0] * nd, list(shape)
                    off[d], ln[d] = i, 1
                    out.append((off, ln))
    pts = [sorted({x + e for x in cuts[d] for e in (-1, 0, 1) if 0 <= x + e <= shape[d]}) for d in range(nd)]
    for _ in range(n_random):
        off, ln = [], []
        for d in range(nd):
            S = shape[d]
            mode = rng.integers(5)
            if mode == 0:
                lo, hi = 0, S
            elif mode in (1, 2):
                lo, hi = sorted(int(x) for x in rng.choice(pts[d], 2))
            elif mode == 3:
                lo = int(rng.integers(S))
                hi = int(rng.integers(lo + 1, S + 1))
            else:
                lo = min(int(rng.choice(pts[d])), S - 1)
                hi = lo + 1
            if hi == lo:
                lo, hi = (lo, lo + 1) if lo < S else (lo - 1, lo)
            off.append(lo)
            ln.append(hi - lo)
        out.append((off, ln))
    return out


def compare_boxes(lib, ck, keys, threads, n_random, seed=0, dt_for=None, uncached=False):
    """Read boxes of each tensor through libshard and compare with the oracle's."""
    o = oracle(ck)
    n = 0
    with Ckpt(lib, ck, threads, uncached) as c:
        for key in keys:
            i, sdt, shape, _ = c.t[key]
            assert shape == o.full[key].shape and sdt == o.dtype[key], key
            rng = np.random.default_rng([seed, threads, zlib.crc32("/".join(key).encode())])
            for off, ln in random_boxes(rng, shape, o.cuts(key), n_random):
                dt = dt_for(sdt) if dt_for else sdt
                got = c.read_ok(key, off, ln, dt)
                assert_same(got, o.box(key, off, ln, dt), f"{ck.name} {key} {sdt}->{dt} threads={threads} box "
                                                           f"off={off} len={ln}")
                n += 1
    return n


# ------------------------------------------------------------------ models (numpy)
def llama_config(V, H, F, L, heads, kv, dtype):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": H,
            "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": heads,
            "num_key_value_heads": kv, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "initializer_range": 0.02, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}


def llama_tensors(cfg, rng, np_dtype):
    V, H, F, L = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                       p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if len(shape) == 1:
            x = np.float32(1) + x
        out[name] = np.ascontiguousarray(x.astype(np_dtype))
    return out


def make_hf(path, cfg, np_dtype, seed):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    save_file(llama_tensors(cfg, np.random.default_rng(seed), np_dtype), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


# The writer's chunks: at most 1 MiB of whole rows, the rows spread evenly over them.
# f32: embedding/head [5002,128] -> tp pieces of 2501 rows (1251 + 1250); gate/up
# [4610,128] -> pieces [2305,128] (1153 + 1152); down [128,4610] -> pieces [128,2305]
# split along dim 1 (64 + 64). bf16: embedding/head [9002,128] -> pieces of 4501 rows
# (2251 + 2250); gate/up pieces [4353,128] (2177 + 2176); down pieces [128,4353] (64 + 64).
MODELS = {"f32": (llama_config(5002, 128, 4610, 2, 4, 2, "float32"), np.float32),
          "bf16": (llama_config(9002, 128, 8706, 2, 4, 2, "bfloat16"), ml_dtypes.bfloat16)}
CKPTS = {"f32-tp2-none": ("f32", "tp=2", "none"), "f32-pp2tp2-zstd": ("f32", "pp=2,tp=2", "zstd"),
         "bf16-tp2-zstd": ("bf16", "tp=2", "zstd"), "bf16-pp2tp2-none": ("bf16", "pp=2,tp=2", "none")}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {k: make_hf(root / k, cfg, npd, seed=i + 1) for i, (k, (cfg, npd)) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def ckpts(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for name, (model, layout, comp) in CKPTS.items():
        out[name] = root / name
        run("smp-convert", "hf2smp", "--in", hf[model], "--out", out[name], "--layout", layout, "--compress", comp,
            "--threads", 2, "--no-fsync", check=0)
    return out


def filter_ids(ds):
    dcpl = ds.id.get_create_plist()
    return [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]


def multi_chunk(p):
    rdim = 0 if len(p["shape"]) == 1 else len(p["shape"]) - 2
    return p["chunks"] is not None and p["shape"][rdim] > p["chunks"][rdim]


def test_pieces_span_several_chunks(ckpts):
    """The fixtures do what the tests below rely on: multi-chunk pieces with a partial
    last chunk (split along dim 0), multi-chunk pieces split along dim 1 (the API
    checkpoint's have partial chunks too), compressed and not."""
    for name, ck in ckpts.items():
        o = oracle(ck)
        emb = o.pieces[("params", "model.embed_tokens.weight")]
        gate = o.pieces[("params", "model.layers.0.mlp.gate_proj.weight")]
        down = o.pieces[("params", "model.layers.0.mlp.down_proj.weight")]
        assert len(emb) == 2 and {p["off"][1] for p in emb} == {0}, name
        assert len(down) == 2 and {p["off"][0] for p in down} == {0} and {p["off"][1] for p in down} != {0}, name
        for partial, pieces in ((True, emb + gate), (False, down)):
            for p in pieces:
                r = p["chunks"][0]
                assert p["chunks"][1] == p["shape"][1] and p["shape"][0] > r, (name, p["dataset"])
                assert p["shape"][0] % r or not partial, (name, p["dataset"])
        with h5py.File(ck / emb[0]["file"], "r") as f:
            filters = filter_ids(f[emb[0]["dataset"]])
        assert filters == ([2, 32015] if name.endswith("zstd") else []), (name, filters)


# ------------------------------------------------------------------ 1. boxes across chunks
@pytest.mark.parametrize("name", list(CKPTS))
def test_random_boxes_match_h5py(lib, ckpts, name):
    ck = ckpts[name]
    o = oracle(ck)
    keys = sorted(o.full)
    big = [k for k in keys if any(multi_chunk(p) for p in o.pieces[k])]
    assert len(big) >= 6
    n = 0
    for threads in (1, 2, 3, 4):
        # every tensor with one thread; the multi-chunk ones with each thread count
        n += compare_boxes(lib, ck, keys if threads == 1 else big, threads, n_random=30 if threads == 1 else 15)
    assert n > 500


CONVERSIONS = {"F32": ("BF16", "F16", "F64"), "BF16": ("F32", "F64", "F16")}


@pytest.mark.parametrize("name", ["f32-pp2tp2-zstd", "bf16-tp2-zstd", "f32-tp2-none", "bf16-pp2tp2-none"])
def test_read_converts_dtype(lib, ckpts, name):
    ck = ckpts[name]
    keys = [("params", "model.embed_tokens.weight"), ("params", "model.layers.1.mlp.down_proj.weight"),
            ("params", "model.norm.weight"), ("params", "model.layers.0.self_attn.o_proj.weight")]
    sdt = oracle(ck).dtype[keys[0]]
    for k, dt in enumerate(CONVERSIONS[sdt]):
        compare_boxes(lib, ck, keys, threads=1 + k, n_random=10, seed=7, dt_for=lambda s, dt=dt: dt)


@pytest.mark.parametrize("name", ["bf16-tp2-zstd", "bf16-pp2tp2-none"])
def test_read_uncached_into_f32(lib, ckpts, name):
    """A load's reads (shard_ckpt_set_uncached: BF16 -> F32 by streamed stores), whole
    tensors, rows, columns and random boxes: the oracle's values, nothing written
    outside the box."""
    keys = [("params", "model.embed_tokens.weight"), ("params", "model.layers.1.mlp.down_proj.weight"),
            ("params", "model.layers.0.mlp.up_proj.weight"), ("params", "model.norm.weight")]
    for threads in (1, 3):
        assert compare_boxes(lib, ckpts[name], keys, threads, n_random=12, seed=11, dt_for=lambda s: "F32",
                             uncached=True) > 40


def test_concurrent_reads_on_one_handle(lib, ckpts):
    """shard_ckpt_read from several threads at once on one checkpoint (ctypes lets the
    GIL go during the call), each read itself on 8 threads, pieces first touched
    concurrently."""
    ck = ckpts["f32-pp2tp2-zstd"]
    o = oracle(ck)
    rng = np.random.default_rng(3)
    jobs = []
    for key in sorted(o.full):
        for off, ln in random_boxes(rng, o.full[key].shape, o.cuts(key), 8):
            jobs.append((key, off, ln))
    rng.shuffle(jobs)
    # 6 callers x 8 threads: more chunks in flight than the reader keeps decoded
    with Ckpt(lib, ck, threads=8) as c:
        def one(job):
            key, off, ln = job
            return c.read(key, off, ln)

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            results = list(ex.map(one, jobs))
    for (key, off, ln), (st, msg, got) in zip(jobs, results):
        assert st == 0, (key, off, ln, msg)
        assert_same(got, o.box(key, off, ln), f"concurrent {key} off={off} len={ln}")


def test_exports_match(lib, ckpts, hf, tmp_path):
    """smp-merge's export, read by safetensors, equals the HF source and the h5py
    oracle, for every layout and compression."""
    for name, ck in ckpts.items():
        out = tmp_path / name
        run("smp-merge", "--in", ck, "--out", out, "--threads", 2, "--no-fsync", check=0)
        got, src = load_file(str(out / "model.safetensors")), load_file(str(hf[CKPTS[name][0]] / "model.safetensors"))
        assert set(got) == set(src)
        o = oracle(ck)
        for k, v in src.items():
            assert_same(got[k], v, f"{name} export {k}")
            assert_same(got[k].view(o.full[("params", k)].dtype), o.full[("params", k)], f"{name} oracle {k}")


def test_reads_touch_only_their_chunks(lib, ckpts):
    """A box's first read reads (as stored) exactly the chunks it touches: bytes_read
    grows by the sum of their stored sizes as h5py's chunk index gives them."""
    for name in ("f32-pp2tp2-zstd", "bf16-pp2tp2-none"):
        ck = ckpts[name]
        o = oracle(ck)
        for key in [("params", "model.embed_tokens.weight"), ("params", "model.layers.0.mlp.down_proj.weight")]:
            p = min(o.pieces[key], key=lambda p: p["off"])  # the first piece
            r = p["chunks"][0]
            with h5py.File(ck / p["file"], "r") as f:
                ds = f[p["dataset"]]
                sizes = [ds.id.get_chunk_info_by_coord((k * r, 0)).size for k in range(math.ceil(p["shape"][0] / r))]
            cases = [((p["off"][0], p["off"][1]), (1, 1), [0]),                       # one element of chunk 0
                     ((p["off"][0] + r - 1, p["off"][1]), (2, 3), [0, 1]),              # across chunks 0 and 1
                     ((p["off"][0] + r, p["off"][1] + 1), (1, p["shape"][1] - 1), [1]),  # chunk 1 alone
                     (tuple(p["off"]), tuple(p["shape"]), list(range(len(sizes))))]    # the whole piece
            for off, ln, touched in cases:
                with Ckpt(lib, ck) as c:
                    before = c.bytes_read()
                    got = c.read_ok(key, off, ln)
                    assert c.bytes_read() - before == sum(sizes[k] for k in touched), (name, key, off, ln, sizes)
                assert_same(got, o.box(key, off, ln), f"{name} {key} off={off} len={ln}")


# ------------------------------------------------------------------ 2. 1-D, 3-D, 4-D (C writer)
# name: (dtype, global shape, split dim, cut points, files of the pieces)
API_TENSORS = {
    "vec": ("F32", (700003,), 0, (300001, 310000), (0, 1, 2)),    # 150001 + 150000; 9999; 195002 + 195001
    "vec_exact": ("F32", (786432,), 0, (524288,), (1, 0)),         # whole chunks only, no partial one
    "vec_bf16": ("BF16", (1200001,), 0, (600000,), (2, 1)),
    "cube_d0": ("F32", (3, 701, 500), 0, (1,), (0, 1)),           # at most 524 rows a chunk: 351 + 350 a plane
    "cube_d1": ("F32", (3, 1101, 256), 1, (50,), (1, 0)),          # 526 + 525 a plane
    "cube_d2": ("BF16", (2, 5001, 160), 2, (40,), (0, 2)),         # 2501 + 2500 a plane; one chunk a plane
    "cube_e4m3": ("F8_E4M3", (2, 2001, 700), 1, (1701,), (2, 0)),  # 1-byte elements: 851 + 850
    "hyper": ("F32", (2, 3, 40, 300), 1, (1,), (0, 1)),            # two plane dims
    "hyper_e5m2": ("F8_E5M2", (3, 2, 5, 7), 0, (2,), (1, 2)),
    # chunks whose element count is not a multiple of 16 (the unshuffle's tail)
    "odd_f32": ("F32", (1000, 333), 0, (1,), (0, 2)),              # 500 + 499 rows
    "odd_bf16": ("BF16", (1501, 777), 1, (5,), (2, 0)),            # [1501,5] one chunk; 501 + 501 + 499
    "odd_small": ("F32", (3, 7, 13), 2, (6,), (0, 2)),
}
API_FILES = (("shard-00000.h5", 3), ("shard-00001.h5", 0), ("shard-00002.h5", 1))  # zstd:3, none, zstd:1
API_CFG = llama_config(64, 32, 64, 1, 2, 2, "float32")


def api_data(dt, shape, rng):
    if dt in ("F8_E4M3", "F8_E5M2"):
        return rng.integers(0, 256, shape, dtype=np.uint8)
    x = rng.standard_normal(shape, dtype=np.float32)
    return x if dt == "F32" else x.astype(REAL[dt]).view(RAW[dt])


def api_pieces(shape, dim, cuts):
    edges = (0,) + tuple(cuts) + (shape[dim],)
    for a, b in zip(edges, edges[1:]):
        off, ln = [0] * len(shape), list(shape)
        off[dim], ln[dim] = a, b - a
        yield off, ln


def write_api_ckpt(lib, final):
    """A checkpoint written through the C writer: the tiny model's params whole in
    shard-00000.h5, the fp8-group tensors above in pieces over three files."""
    rng = np.random.default_rng(11)
    w = ctypes.c_void_p()
    assert lib.shard_ckpt_begin(str(final).encode(), ctypes.byref(w)) == 0, lib.shard_errmsg()
    staging = lib.shard_ckpt_staging(w).decode()
    writers = []
    for fname, level in API_FILES:
        h = ctypes.c_void_p()
        assert lib.shard_h5_create(f"{staging}/{fname}".encode(), Compress(level, 2, 1), ctypes.byref(h)) == 0, \
            lib.shard_errmsg()
        writers.append(h)

    def put(fi, group, name, dt, gshape, off, ln, local):
        local = np.ascontiguousarray(local)
        gs = (ctypes.c_int64 * len(gshape))(*gshape)
        box = make_box(off, ln)
        st = lib.shard_h5_write_local(writers[fi], group.encode(), name.encode(), DT[dt], len(gshape), gs,
                                      ctypes.byref(box), local.ctypes.data, DT[dt])
        assert st == 0, lib.shard_errmsg()

    for name, a in llama_tensors(API_CFG, rng, np.float32).items():
        put(0, "params", name, "F32", a.shape, [0] * a.ndim, a.shape, a)
    for name, (dt, shape, dim, cuts, files) in API_TENSORS.items():
        full = api_data(dt, shape, rng)
        for fi, (off, ln) in zip(files, api_pieces(shape, dim, cuts)):
            put(fi, "fp8", name, dt, shape, off, ln, full[tuple(slice(o, o + n) for o, n in zip(off, ln))])
    for h in writers:
        assert lib.shard_h5_close(h) == 0, lib.shard_errmsg()
    cfg_path = final.parent / "api-config.json"
    cfg_text = json.dumps(API_CFG).encode()
    cfg_path.write_bytes(cfg_text)
    d = ModelDesc()
    assert lib.shard_config_load(str(cfg_path).encode(), ctypes.byref(d)) == 0, lib.shard_errmsg()
    layout = Layout(1, 1, 1, 1)
    stages = (ctypes.c_int * 1)(API_CFG["num_hidden_layers"])
    st = lib.shard_ckpt_commit(w, cfg_text, len(cfg_text), ctypes.byref(d), ctypes.byref(layout), stages, None, 0)
    if st:
        msg = lib.shard_errmsg().decode()
        lib.shard_ckpt_abort(w)
        raise AssertionError(msg)
    return final


@pytest.fixture(scope="module")
def api_ckpt(lib, tmp_path_factory):
    return write_api_ckpt(lib, tmp_path_factory.mktemp("api") / "ck")


def test_api_checkpoint_layout(api_ckpt):
    o = oracle(api_ckpt)
    for name, (dt, shape, dim, cuts, files) in API_TENSORS.items():
        key = ("fp8", name)
        assert o.dtype[key] == dt and o.full[key].shape == shape
        assert sorted(p["off"][dim] for p in o.pieces[key]) == [0, *cuts]
    run("smp-verify", "--threads", 2, api_ckpt, check=0)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_api_boxes_match_h5py(lib, api_ckpt, threads):
    keys = [("fp8", n) for n in API_TENSORS] + [("params", "model.embed_tokens.weight"), ("params", "model.norm.weight")]
    assert compare_boxes(lib, api_ckpt, keys, threads, n_random=25 if threads == 1 else 12) > 200


def test_api_boxes_convert_dtype(lib, api_ckpt):
    conv = {"F32": "BF16", "BF16": "F32", "F8_E4M3": "F32", "F8_E5M2": "F16"}
    keys = [("fp8", n) for n in API_TENSORS]
    compare_boxes(lib, api_ckpt, keys, 3, n_random=8, seed=5, dt_for=lambda s: conv[s])
    compare_boxes(lib, api_ckpt, keys, 1, n_random=4, seed=6, dt_for=lambda s: "F64")


def test_empty_and_refused_boxes(lib, api_ckpt):
    with Ckpt(lib, api_ckpt) as c:
        st, _, a = c.read(("fp8", "cube_d1"), (1, 40, 0), (1, 0, 256))
        assert st == 0 and a.size == 0
        for off, ln in [((0, 0, 0), (4, 1, 1)), ((0, 1101, 0), (1, 1, 1)), ((0, -1, 0), (1, 1, 1)),
                        ((0, 0, 200), (1, 1, 57))]:
            st, msg, _ = c.read(("fp8", "cube_d1"), off, ln)
            assert st == 3, (off, ln, st, msg)


def replace_contiguous(ck, fname, dpath, keep_chunk_xxh3=True):
    """Rewrite one dataset as h5py writes one by default (contiguous, no filters), same
    data and attributes."""
    with h5py.File(ck / fname, "r+") as f:
        ds = f[dpath]
        data, attrs = ds[()], dict(ds.attrs)
        del f[dpath]
        nd = f.create_dataset(dpath, data=data)
        assert nd.chunks is None
        for k, v in attrs.items():
            if k != "chunk_xxh3" or keep_chunk_xxh3:
                nd.attrs[k] = v


def refresh_files(ck):
    """Fix every shard file's bytes and checksum in smp.json (after an edit with h5py)."""
    m = json.loads((ck / "smp.json").read_text())
    for f in m["files"]:
        if f["name"].startswith("shard-"):
            data = (ck / f["name"]).read_bytes()
            set_file_entry(f, data)
    (ck / "smp.json").write_text(json.dumps(m, indent=1))


def test_contiguous_datasets_are_read(lib, api_ckpt, tmp_path):
    """Datasets rewritten by h5py (contiguous, unfiltered), among smp's chunked and
    compressed ones in the same files: same boxes, and smp-verify passes."""
    ck = tmp_path / "ck"
    shutil.copytree(api_ckpt, ck)
    replace_contiguous(ck, "shard-00000.h5", "/fp8/cube_d0")                       # in a zstd file
    replace_contiguous(ck, "shard-00002.h5", "/fp8/vec", keep_chunk_xxh3=False)    # no chunk checksums
    replace_contiguous(ck, "shard-00001.h5", "/fp8/cube_d1")
    replace_contiguous(ck, "shard-00000.h5", "/params/model.layers.0.mlp.up_proj.weight")
    refresh_files(ck)
    o = oracle(ck)
    assert all(p["chunks"] is None for p in o.pieces[("fp8", "cube_d0")] if p["file"] == "shard-00000.h5")
    run("smp-verify", "--threads", 1, ck, check=0)
    run("smp-verify", "--threads", 4, ck, check=0)
    keys = [("fp8", "cube_d0"), ("fp8", "vec"), ("fp8", "cube_d1"), ("params", "model.layers.0.mlp.up_proj.weight")]
    for threads in (1, 3):
        compare_boxes(lib, ck, keys, threads, n_random=15, seed=9)


# The read order that makes one scratch buffer serve a small zstd chunk, then a large
# unfiltered one, then a large zstd one (threads 1: one scratch).
_SEQUENCE_SCRIPT = textwrap.dedent("""
    import pathlib, sys
    sys.path.insert(0, sys.argv[1])
    import test_read as T
    lib = T._load(pathlib.Path(sys.argv[2]))
    with T.Ckpt(lib, sys.argv[3], threads=1) as c:
        for spec in sys.argv[4:]:
            group, name, off, ln = spec.split(":")
            off, ln = [int(x) for x in off.split(",")], [int(x) for x in ln.split(",")]
            st, msg, a = c.read((group, name), off, ln)
            print(st, msg, T.xxh64(a.tobytes()), flush=True)
""")


def _read_sequence(build, ck, specs, san):
    env = dict(os.environ)
    if san:
        ldd = subprocess.run(["ldd", str(build / "lib" / "libshard.so")], capture_output=True, text=True).stdout
        env["LD_PRELOAD"] = next(line.split("=>")[1].split()[0] for line in ldd.splitlines() if "libasan" in line)
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0"
    return subprocess.run([sys.executable, "-c", _SEQUENCE_SCRIPT, os.path.dirname(__file__), str(build), str(ck),
                           *specs], capture_output=True, text=True, env=env, timeout=120)


def test_mixed_compression_in_one_handle(api_ckpt):
    """Unfiltered and zstd pieces read one after the other through one handle's buffers
    (one thread): a small zstd chunk, a big unfiltered one, a big zstd one. Run in a
    child process (a heap overflow must not take pytest down), with AddressSanitizer
    when the asan build is there."""
    o = oracle(api_ckpt)
    specs = ["params:model.norm.weight:0:32",          # shard-00000.h5, zstd, a 128-byte chunk
             "fp8:vec_exact:0:10",                      # shard-00001.h5, unfiltered, a 1 MiB chunk
             "fp8:vec:0:300000",                        # shard-00000.h5, zstd, 1 MiB chunks
             "fp8:cube_d1:0,0,0:3,1101,256"]            # zstd and unfiltered pieces, 1 MiB chunks
    want = []
    for s in specs:
        group, name, off, ln = s.split(":")
        off, ln = [int(x) for x in off.split(",")], [int(x) for x in ln.split(",")]
        want.append(f"0  {xxh64(o.box((group, name), off, ln).tobytes())}")
    san = (BUILD_SAN / "lib" / "libshard.so").exists() and shutil.which("ldd") is not None
    p = _read_sequence(BUILD_SAN if san else BUILD, api_ckpt, specs, san)
    assert p.returncode == 0 and "Sanitizer" not in p.stderr, \
        f"exit {p.returncode} ({'asan' if san else 'release'} build)\n{p.stdout}\n{p.stderr[-3000:]}"
    assert p.stdout.splitlines() == want, p.stdout


# ------------------------------------------------------------------ 3. chunk_xxh3
def chunk_grid(shape, chunks):
    grid = [math.ceil(s / c) for s, c in zip(shape, chunks)]
    for idx in np.ndindex(*grid):
        yield tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, chunks, shape))


def check_chunk_xxh3(ck):
    o = oracle(ck)
    n = 0
    for key, pieces in o.pieces.items():
        for p in pieces:
            shape, chunks, data = p["shape"], p["chunks"], p["data"]
            what = f"{ck.name} {p['file']}:{p['dataset']}"
            assert p["xxh64"] == xxh64(np.ascontiguousarray(data).tobytes()), what
            # whole rows, at most 1 MiB: [1, ..., 1, r, last] ([r] for 1-D); as few chunks
            # as that allows, the rows spread evenly over them (a partial last chunk pads
            # fewer rows than there are chunks)
            nd = len(shape)
            rdim = 0 if nd == 1 else nd - 2
            rows, row = shape[rdim], (1 if nd == 1 else shape[-1]) * data.dtype.itemsize
            r, least = chunks[rdim], math.ceil(rows / max(1, CHUNK_TARGET // row))
            nch = math.ceil(rows / r)
            assert all(c == 1 for c in chunks[:rdim]) and (nd == 1 or chunks[-1] == shape[-1]), (what, chunks)
            assert 1 <= r <= rows and (r == 1 or r * row <= CHUNK_TARGET), (what, chunks, shape)
            assert nch == least and nch * r - rows < nch, (what, chunks, shape)
            # what HDF5 says the dataset takes on disk: the data and that padding alone
            if not p["filters"]:
                planes = math.prod(shape[:rdim])
                assert p["stored"] == planes * nch * r * row, (what, p["stored"], planes, nch, r, row)
            want = [xxh3(np.ascontiguousarray(data[sl]).tobytes()) for sl in chunk_grid(shape, chunks)]
            got = p["chunk_xxh3"]
            assert got is not None and got.dtype == np.uint64 and got.ndim == 1, (what, got)
            assert len(got) == len(want) == math.prod(math.ceil(s / c) for s, c in zip(shape, chunks)), what
            bad = [k for k, (g, w) in enumerate(zip(got.tolist(), want)) if g != w]
            assert not bad, f"{what}: chunk_xxh3 wrong for chunks {bad[:10]} of {len(want)}"
            n += len(want)
    return n


@pytest.mark.parametrize("name", list(CKPTS) + ["api"])
def test_chunk_xxh3_attribute(ckpts, api_ckpt, name):
    ck = api_ckpt if name == "api" else ckpts[name]
    assert check_chunk_xxh3(ck) > 40


def test_chunk_xxh3_after_reshard(lib, ckpts, tmp_path):
    """smp-convert reshard writes the attribute too (its pieces come from the reader)."""
    out = tmp_path / "re"
    run("smp-convert", "reshard", "--in", ckpts["f32-tp2-none"], "--out", out, "--layout", "pp=2", "--threads", 2,
        "--no-fsync", check=0)
    check_chunk_xxh3(out)
    o, src = oracle(out), oracle(ckpts["f32-tp2-none"])
    for key in src.full:
        assert_same(o.full[key], src.full[key], f"reshard {key}")
    # whole tensors now: the embedding is 1668 + 1667 + 1667 rows
    assert [p["chunks"][0] for p in o.pieces[("params", "model.embed_tokens.weight")]] == [1668]
    compare_boxes(lib, out, [("params", "model.embed_tokens.weight"), ("params", "lm_head.weight")], 2, n_random=10)


def test_earlier_chunking_is_read(lib, ckpts, tmp_path):
    """Checkpoints written before 2026-12-07 chunk a piece in 1 MiB of whole rows with a
    longer padded last chunk (r0 = 1 MiB / a row's bytes, not spread evenly): pieces
    rewritten that way by h5py (their chunk_xxh3 recomputed) read the same boxes,
    smp-verify passes, and a reshard of them is bit for bit and chunked the new way."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpts["f32-tp2-none"], ck)
    keys = [("params", n) for n in ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                                     "model.layers.1.mlp.down_proj.weight")]
    src = oracle(ckpts["f32-tp2-none"])
    for key in keys:
        for p in src.pieces[key]:
            shape, data = p["shape"], p["data"]
            r0 = min(shape[0], max(1, CHUNK_TARGET // (shape[1] * data.itemsize)))
            assert r0 != p["chunks"][0] and shape[0] % r0, (p["dataset"], r0, p["chunks"])
            with h5py.File(ck / p["file"], "r+") as f:
                attrs = dict(f[p["dataset"]].attrs)
                del f[p["dataset"]]
                nd = f.create_dataset(p["dataset"], data=data, chunks=(r0, shape[1]))
                attrs["chunk_xxh3"] = np.array([xxh3(np.ascontiguousarray(data[sl]).tobytes())
                                                for sl in chunk_grid(shape, (r0, shape[1]))], np.uint64)
                for k, v in attrs.items():
                    nd.attrs[k] = v
    refresh_files(ck)
    o = oracle(ck)
    for key in keys:  # the old padding is what HDF5 stores: the rewrite is of the old kind
        for p in o.pieces[key]:
            r0 = p["chunks"][0]
            assert p["stored"] == math.ceil(p["shape"][0] / r0) * r0 * p["shape"][1] * 4 > p["data"].nbytes
    run("smp-verify", "--threads", 2, ck, check=0)
    for threads in (1, 3):
        compare_boxes(lib, ck, keys, threads, n_random=12, seed=13)
    out = tmp_path / "re"
    run("smp-convert", "reshard", "--in", ck, "--out", out, "--layout", "pp=2", "--threads", 2, "--no-fsync", check=0)
    check_chunk_xxh3(out)
    for key in src.full:
        assert_same(oracle(out).full[key], src.full[key], f"reshard {key}")


# ------------------------------------------------------------------ 4. a corrupt chunk
def flip_byte(ck, p, k_row):
    """Flip one byte inside the stored bytes of the chunk of piece p that holds row k_row
    (relative to the piece); inside its valid part when it is stored raw. Returns the
    chunk's first and last row (relative)."""
    r = p["chunks"][0]
    r0 = k_row // r * r
    with h5py.File(ck / p["file"], "r") as f:
        ds = f[p["dataset"]]
        info = ds.id.get_chunk_info_by_coord((r0, 0))
        compressed = bool(filter_ids(ds))
    valid = min(r, p["shape"][0] - r0) * p["shape"][1] * p["data"].dtype.itemsize
    at = info.byte_offset + (info.size // 2 if compressed else valid // 2 + 1)
    with open(ck / p["file"], "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))
    return r0, min(r0 + r, p["shape"][0])


def check_refusal(p, cmd, fname):
    err = p.stderr.strip().splitlines()
    errs = [line for line in err if "error" in line]
    assert p.returncode == 3, f"{cmd}: exit {p.returncode}, expected 3\n{p.stdout}\n{p.stderr}"
    assert len(errs) == 1 and errs[0].startswith(f"{cmd}: error: ") and fname in errs[0], f"{cmd}: {p.stderr}"
    assert len(err) == 1, f"{cmd}: more than one line on stderr:\n{p.stderr}"


def write_tokens(path, toks):
    h = np.zeros(256, dtype="<i4")
    h[:3] = (20240520, 1, len(toks))
    path.write_bytes(h.tobytes() + np.asarray(toks).astype("<u2").tobytes())
    return path


def commands_refuse(ck, tmp_path, fname, vocab):
    data = write_tokens(tmp_path / "tok.bin", np.arange(40) * 37 % vocab)
    cmds = [("smp-verify", [ck]), ("smp-verify", ["--threads", 1, ck]),
            ("smp-merge", ["--in", ck, "--out", tmp_path / "merged", "--no-fsync"]),
            ("smp-merge", ["--in", ck, "--out", tmp_path / "merged1", "--threads", 1, "--no-fsync"]),
            ("smp-convert", ["reshard", "--in", ck, "--out", tmp_path / "re", "--layout", "tp=1", "--no-fsync"]),
            ("smp-eval", ["--ckpt", ck, "--data", data, "--batch", 1, "--seq", 8])]
    before = set(os.listdir(tmp_path))
    for cmd, args in cmds:
        check_refusal(run(cmd, *args), cmd, fname)
    assert set(os.listdir(tmp_path)) == before, "a refused command left output behind"


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the HDF5 file format specification's, at offset 0


def test_shard_files_carry_metadata_checksums(ckpts, api_ckpt, tmp_path):
    """Shard files are written in HDF5 1.10's format: superblock version 3 (the byte after
    the signature), whose object headers carry checksums that HDF5 checks as it reads
    (docs/FORMAT.md). One bit of an attribute's name in an object header flipped, with the
    manifest's file checksums refreshed to match: every reading command refuses it,
    exit 3, one line naming the file; h5py (HDF5's own checks) refuses that object too."""
    for ck in list(ckpts.values()) + [api_ckpt]:
        for f in sorted(ck.glob("shard-*.h5")):
            head = f.read_bytes()[:9]
            assert head[:8] == HDF5_SIGNATURE and head[8] == 3, (f, head)
    ck = tmp_path / "ck"
    shutil.copytree(ckpts["bf16-tp2-zstd"], ck)
    f = ck / "shard-00000.h5"
    data = bytearray(f.read_bytes())
    at = data.find(b"global_shape")
    assert at > 0
    data[at + 3] ^= 0x01
    f.write_bytes(bytes(data))
    refresh_files(ck)
    with h5py.File(f, "r") as h, pytest.raises(Exception):
        for name in h["params"]:
            h["params"][name].attrs["global_shape"]
    commands_refuse(ck, tmp_path, "shard-00000.h5", MODELS["bf16"][0]["vocab_size"])


@pytest.mark.parametrize("name", ["f32-pp2tp2-zstd", "f32-tp2-none", "bf16-tp2-zstd", "bf16-pp2tp2-none"])
def test_corrupt_chunk_is_caught(lib, ckpts, tmp_path, name):
    src = ckpts[name]
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    o = oracle(src)
    key = ("params", "model.embed_tokens.weight")
    p = min(o.pieces[key], key=lambda p: p["off"])
    other = max(o.pieces[key], key=lambda p: p["off"])
    r = p["chunks"][0]
    lo, hi = flip_byte(ck, p, r)  # the second (partial) chunk of the first piece
    assert (lo, hi) == (r, p["shape"][0])
    vocab = MODELS[CKPTS[name][0]][0]["vocab_size"]
    # every command that reads it, and smp-verify with the manifest refreshed too (only
    # the chunk's and the piece's checksums can catch it then)
    commands_refuse(ck, tmp_path, p["file"], vocab)
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    refresh_files(ck2)
    check_refusal(run("smp-verify", ck2), "smp-verify", p["file"])
    check_refusal(run("smp-verify", "--threads", 1, ck2), "smp-verify", p["file"])
    H = p["shape"][1]
    for threads in (1, 3):
        with Ckpt(lib, ck2, threads) as c:
            # boxes that do not touch the damaged chunk read as they were
            fine = [((0, 0), (r, H)), ((5, 7), (r - 5, 30)), ((0, 0), (1, 1)),
                    ((other["off"][0], 0), (other["shape"][0], H)), ((hi, 3), (4, 100))]
            for off, ln in fine:
                assert_same(c.read_ok(key, off, ln), o.box(key, off, ln), f"{name} undamaged box {off}+{ln}")
            # boxes that touch it fail, naming the file and the dataset, every time
            for off, ln in [((r - 1, 0), (2, H)), ((hi - 1, 5), (1, 1)), ((0, 0), o.full[key].shape),
                            ((r + 1, 0), (2, 1)), ((r - 1, 0), (2, H))]:
                st, msg, _ = c.read(key, off, ln)
                assert st == E_CORRUPT and p["file"] in msg and p["dataset"] in msg, (off, ln, st, msg)
            assert_same(c.read_ok(key, (0, 0), (r, H)), o.box(key, (0, 0), (r, H)), f"{name} after a failure")
            # other tensors of the same file are untouched
            k2 = ("params", "model.layers.0.mlp.up_proj.weight")
            assert_same(c.read_ok(k2, (0, 0), o.full[k2].shape), o.full[k2], f"{name} {k2}")


@pytest.mark.parametrize("name", ["f32-tp2-none", "bf16-pp2tp2-none"])
def test_corrupt_chunk_read_in_place(lib, ckpts, tmp_path, name):
    """A whole, uncompressed chunk wanted in its stored dtype as one run of the box is
    read straight into the caller's buffer (no chunk cache): damage there is caught
    all the same, as through the cache (another dtype, a part of the chunk), and by
    the commands."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpts[name], ck)
    o = oracle(ck)
    key = ("params", "model.embed_tokens.weight")
    p = min(o.pieces[key], key=lambda p: p["off"])
    r, H = p["chunks"][0], p["shape"][1]
    assert p["shape"][0] > r and H == o.full[key].shape[1]  # a full first chunk, whole rows of the tensor
    assert flip_byte(ck, p, 0) == (0, r)
    refresh_files(ck)  # only the chunk's and the piece's checksums can catch it
    other = {"F32": "BF16", "BF16": "F32"}[o.dtype[key]]
    for threads in (1, 2):
        with Ckpt(lib, ck, threads) as c:
            for off, ln, dt in [((0, 0), (r, H), None), ((0, 0), (2 * r, H), None), ((0, 0), (r, H), other),
                                ((3, 0), (1, H), None)]:
                st, msg, _ = c.read(key, off, ln, dt)
                assert st == E_CORRUPT and p["file"] in msg and p["dataset"] in msg, (off, ln, dt, st, msg)
            assert_same(c.read_ok(key, (r, 0), (1, H)), o.box(key, (r, 0), (1, H)), f"{name} after a failure")
    vocab = MODELS[CKPTS[name][0]][0]["vocab_size"]
    commands_refuse(ck, tmp_path, p["file"], vocab)


@pytest.mark.parametrize("name", ["f32-tp2-none", "bf16-pp2tp2-none"])
def test_corrupt_chunk_read_in_place_strided(lib, ckpts, tmp_path, name):
    """A whole, uncompressed chunk of a column-split piece (down_proj under tp: each of
    its rows half a row of the tensor), wanted in its stored dtype in a box of whole rows
    of the tensor, is read straight into the box row by row (preadv, the rows a tensor's
    row apart) and its XXH3 taken there (shard_xxh3_rows): undamaged, the box is h5py's,
    bit for bit, with 1 and 2 threads, and the bytes read are the chunks' alone; one
    flipped byte is caught by the read and by every command."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpts[name], ck)
    o = oracle(ck)
    key = ("params", "model.layers.0.mlp.down_proj.weight")
    full = o.full[key].shape
    p = max(o.pieces[key], key=lambda p: p["off"][1])  # the right half: its rows start mid-row
    r, H = p["chunks"][0], p["shape"][1]
    R = p["shape"][0]  # all of the tensor's rows: a full first chunk, a partial last one
    assert p["off"][1] > 0 and H < full[1] and R == full[0] and R > r
    with h5py.File(ck / p["file"], "r") as f:
        c0 = f[p["dataset"]].id.get_chunk_info_by_coord((0, 0)).size
    assert c0 == r * H * p["data"].dtype.itemsize  # stored raw, whole
    other = {"F32": "BF16", "BF16": "F32"}[o.dtype[key]]
    boxes = [((0, 0), (r, full[1])), ((r, 0), (R - r, full[1])), ((1, 0), (r, full[1])), ((0, 0), full)]
    for threads in (1, 2):
        with Ckpt(lib, ck, threads) as c:
            for off, ln in boxes:
                assert_same(c.read_ok(key, off, ln), o.box(key, off, ln), f"{name} strided box {off}+{ln}")
            before = c.bytes_read()
            c.read_ok(key, (0, 0), (r, full[1]))  # chunk 0 of each half
            assert c.bytes_read() - before == 2 * c0
    assert flip_byte(ck, p, 0) == (0, r)
    refresh_files(ck)  # only the chunk's and the piece's checksums can catch it
    for threads in (1, 2):
        with Ckpt(lib, ck, threads) as c:
            for off, ln, dt in [((0, 0), (r, full[1]), None), ((0, 0), full, None), ((0, 0), (r, full[1]), other),
                                ((0, p["off"][1]), (r, H), None)]:
                st, msg, _ = c.read(key, off, ln, dt)
                assert st == E_CORRUPT and p["file"] in msg and p["dataset"] in msg, (off, ln, dt, st, msg)
            assert_same(c.read_ok(key, (r, 0), (R - r, full[1])), o.box(key, (r, 0), (R - r, full[1])),
                        f"{name} after a failure")
    vocab = MODELS[CKPTS[name][0]][0]["vocab_size"]
    commands_refuse(ck, tmp_path, p["file"], vocab)


def test_corrupt_chunk_in_3d_piece(lib, api_ckpt, tmp_path):
    """The same in a 3-D piece: one chunk of one plane damaged; the other planes and the
    other chunks of the plane read."""
    ck = tmp_path / "ck"
    shutil.copytree(api_ckpt, ck)
    o = oracle(api_ckpt)
    key = ("fp8", "cube_d1")
    p = next(p for p in o.pieces[key] if p["off"][1] == 50)  # [3, 1051, 256] in shard-00000.h5 (zstd)
    r = p["chunks"][1]
    with h5py.File(ck / p["file"], "r") as f:
        info = f[p["dataset"]].id.get_chunk_info_by_coord((1, r, 0))  # plane 1, its second chunk
    with open(ck / p["file"], "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        b = fh.read(1)
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    refresh_files(ck)
    check_refusal(run("smp-verify", ck), "smp-verify", p["file"])
    with Ckpt(lib, ck, 2) as c:
        for off, ln in [((0, 0, 0), (1, 1101, 256)), ((2, 0, 0), (1, 1101, 256)), ((1, 0, 0), (1, 50 + r, 256)),
                        ((0, 50 + r, 0), (1, 1051 - r, 256)), ((0, 0, 7), (3, 50, 1))]:
            assert_same(c.read_ok(key, off, ln), o.box(key, off, ln), f"3-D undamaged box {off}+{ln}")
        for off, ln in [((1, 50 + r, 0), (1, 1, 1)), ((0, 0, 0), (3, 1101, 256)), ((1, 1100, 255), (1, 1, 1))]:
            st, msg, _ = c.read(key, off, ln)
            assert st == E_CORRUPT and p["file"] in msg, (off, ln, st, msg)


# ------------------------------------------------------------------ 5. legacy pieces
def drop_chunk_xxh3(ck, which=lambda path: True):
    """Delete chunk_xxh3 from the datasets `which` picks (by path): pieces as written
    before chunk checksums."""
    for f in sorted(ck.glob("shard-*.h5")):
        with h5py.File(f, "r+") as h:
            items = []
            h.visititems(lambda name, o: items.append(o) if isinstance(o, h5py.Dataset) else None)
            for ds in items:
                if which(ds.name):
                    del ds.attrs["chunk_xxh3"]
    refresh_files(ck)


@pytest.mark.parametrize("name,which", [("f32-pp2tp2-zstd", "all"), ("bf16-pp2tp2-none", "all"),
                                        ("bf16-tp2-zstd", "some")])
def test_legacy_pieces(lib, ckpts, tmp_path, name, which):
    src = ckpts[name]
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    drop_chunk_xxh3(ck, (lambda path: True) if which == "all" else (lambda path: "embed" in path or "mlp" in path))
    o = oracle(ck)
    key = ("params", "model.embed_tokens.weight")
    p = min(o.pieces[key], key=lambda p: p["off"])
    assert p["chunk_xxh3"] is None
    assert any(q["chunk_xxh3"] is None for ps in o.pieces.values() for q in ps)
    if which == "some":
        assert any(q["chunk_xxh3"] is not None for ps in o.pieces.values() for q in ps)
    # same bytes as before, verify passes
    for key2 in o.full:
        assert_same(o.full[key2], oracle(src).full[key2], f"legacy copy {key2}")
    run("smp-verify", "--threads", 1, ck, check=0)
    run("smp-verify", "--threads", 4, ck, check=0)
    keys = sorted(o.full)
    for threads in (1, 3):
        compare_boxes(lib, ck, keys, threads, n_random=6, seed=13)
    # a legacy piece is read whole (and its xxh64 checked) the first time it is touched
    with h5py.File(ck / p["file"], "r") as f:
        ds = f[p["dataset"]]
        r = p["chunks"][0]
        whole = sum(ds.id.get_chunk_info_by_coord((k, 0)).size for k in range(0, p["shape"][0], r))
        sizes0 = ds.id.get_chunk_info_by_coord((0, 0)).size
    with Ckpt(lib, ck) as c:
        c.read_ok(key, (0, 0), (1, 1))
        assert whole <= c.bytes_read() <= whole + sizes0, (c.bytes_read(), whole)
    # a flipped byte in a legacy piece: smp-verify and any read of that piece fail (even
    # of a box away from the damage), reads of other pieces do not
    lo, hi = flip_byte(ck, p, 0)
    refresh_files(ck)
    check_refusal(run("smp-verify", ck), "smp-verify", p["file"])
    check_refusal(run("smp-verify", "--threads", 1, ck), "smp-verify", p["file"])
    check_refusal(run("smp-merge", "--in", ck, "--out", tmp_path / "m", "--no-fsync"), "smp-merge", p["file"])
    other = max(o.pieces[key], key=lambda p: p["off"])
    for threads in (1, 2):
        with Ckpt(lib, ck, threads) as c:
            for off, ln in [((0, 0), (1, 1)), ((hi, 0), (1, 5)), ((p["shape"][0] - 1, 0), (1, 1))]:
                st, msg, _ = c.read(key, off, ln)
                assert st == E_CORRUPT and p["file"] in msg, (off, ln, st, msg)
            off, ln = (other["off"][0], 0), (other["shape"][0], p["shape"][1])
            assert_same(c.read_ok(key, off, ln), o.box(key, off, ln), "legacy: the other piece")


# ------------------------------------------------------------------ 6. threads of the commands
def test_verify_threads(ckpts, api_ckpt):
    for ck in list(ckpts.values()) + [api_ckpt]:
        for t in (1, 4):
            p = run("smp-verify", "--threads", t, ck, check=0)
            assert ": ok: " in p.stdout, p.stdout
        run("smp-verify", ck, check=0)


def test_verify_through_the_api(lib, ckpts):
    for ck in ckpts.values():
        total = sum((ck / f["name"]).stat().st_size for f in json.loads((ck / "smp.json").read_text())["files"])
        for t in (1, 3):
            with Ckpt(lib, ck, t) as c:
                n = ctypes.c_uint64()
                assert lib.shard_ckpt_verify(c.h, ctypes.byref(n)) == 0, lib.shard_errmsg()
                assert n.value == total


@pytest.mark.parametrize("name", ["f32-pp2tp2-zstd", "bf16-pp2tp2-none"])
def test_merge_threads_identical(ckpts, hf, tmp_path, name):
    outs = []
    for t in (1, 3):
        out = tmp_path / f"m{t}"
        run("smp-merge", "--in", ckpts[name], "--out", out, "--threads", t, "--no-fsync", check=0)
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]
    got = load_file(str(tmp_path / "m1" / "model.safetensors"))
    src = load_file(str(hf[CKPTS[name][0]] / "model.safetensors"))
    assert set(got) == set(src)
    for k in src:
        assert_same(got[k], src[k], f"{name} merge {k}")


def test_merge_multi_block_tensors(tmp_path):
    """Tensors over smp-merge's 8 MiB blocks (blocks that end inside a chunk and inside
    a piece), whole-tensor pieces of many chunks, and a split export with an index."""
    cfg = llama_config(24000, 96, 128, 1, 4, 2, "float32")  # embedding/head 9.2 MB: 21845 + 2155 rows
    src = make_hf(tmp_path / "hf", cfg, np.float32, seed=21)
    ref = load_file(str(src / "model.safetensors"))
    for layout in ("tp=2", "pp=1"):
        ck = tmp_path / f"ck-{layout}"
        run("smp-convert", "hf2smp", "--in", src, "--out", ck, "--layout", layout, "--threads", 2, "--no-fsync", check=0)
        outs = []
        for t in (1, 3):
            out = tmp_path / f"m-{layout}-{t}"
            run("smp-merge", "--in", ck, "--out", out, "--threads", t, "--no-fsync", check=0)
            outs.append((out / "model.safetensors").read_bytes())
            got = load_file(str(out / "model.safetensors"))
            assert set(got) == set(ref)
            for k in ref:
                assert_same(got[k], ref[k], f"{layout} threads={t} merge {k}")
        assert outs[0] == outs[1]
    out = tmp_path / "split"
    run("smp-merge", "--in", ck, "--out", out, "--max-shard-size", "4MB", "--dtype", "bf16", "--threads", 2,
        "--no-fsync", check=0)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in sorted(set(idx["weight_map"].values())):
        got.update(load_file(str(out / f)))
    assert set(got) == set(ref)
    for k in ref:
        assert_same(got[k], ref[k].astype(ml_dtypes.bfloat16), f"split bf16 merge {k}")
