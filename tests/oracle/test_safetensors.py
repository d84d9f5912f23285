"""The safetensors reader and writer against the `safetensors` Python library."""
import ctypes
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from conftest import DT

NPDT = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
        "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64}


def random_tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i, (name, dt) in enumerate(NPDT.items()):
        shape = [(3, 5), (7,), (2, 3, 4), (1,), ()][i % 5]
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dt).itemsize, dtype=np.uint8)
        a = raw.view(dt).reshape(shape) if name != "BOOL" else (raw % 2).astype(np.bool_).reshape(shape)
        out[f"t.{name.lower()}"] = a
    out["empty.f32"] = np.zeros((0, 4), np.float32)
    out["empty.bf16"] = np.zeros((3, 0, 2), ml_dtypes.bfloat16)
    return out


def read_all(shard, path):
    h = ctypes.c_void_p()
    rc = shard.shard_st_open(str(path).encode(), ctypes.byref(h))
    assert rc == 0, shard.shard_errmsg()
    out = {}
    try:
        for i in range(shard.shard_st_count(h)):
            t = shard.shard_st_at(h, i).contents
            shape = tuple(t.shape[k] for k in range(t.ndim))
            data = ctypes.string_at(t.data, t.nbytes) if t.nbytes else b""
            out[t.name.decode()] = (t.dtype, shape, data)
        meta = {}
        for i in range(shard.shard_st_metadata_count(h)):
            k, v = ctypes.c_char_p(), ctypes.c_char_p()
            shard.shard_st_metadata_at(h, i, ctypes.byref(k), ctypes.byref(v))
            meta[k.value.decode()] = v.value.decode()
    finally:
        shard.shard_st_close(h)
    return out, meta


def test_reads_files_written_by_safetensors(shard, tmp_path):
    tensors = random_tensors()
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np", "note": "ünïcode"})
    got, meta = read_all(shard, path)
    assert meta == {"format": "np", "note": "ünïcode"}
    assert set(got) == set(tensors)
    for name, a in tensors.items():
        dt, shape, data = got[name]
        assert shape == a.shape
        expect = [k for k, v in NPDT.items() if np.dtype(v) == a.dtype][0]
        assert dt == DT[expect], name
        assert data == a.tobytes(), name


def write_with_shard(shard, path, tensors, metadata=None):
    w = ctypes.c_void_p()
    assert shard.shard_st_writer_create(str(path).encode(), ctypes.byref(w)) == 0, shard.shard_errmsg()
    for k, v in (metadata or {}).items():
        assert shard.shard_st_writer_metadata(w, k.encode(), v.encode()) == 0
    for name, a in tensors.items():
        dt = [k for k, v in NPDT.items() if np.dtype(v) == a.dtype][0]
        shape = (ctypes.c_int64 * max(1, a.ndim))(*a.shape)
        assert shard.shard_st_writer_declare(w, name.encode(), DT[dt], a.ndim, shape) == 0, shard.shard_errmsg()
    for a in tensors.values():
        b = np.ascontiguousarray(a).tobytes()
        # stream in uneven pieces, as a converter would
        for i in range(0, len(b), 7):
            piece = b[i:i + 7]
            assert shard.shard_st_writer_write(w, piece, len(piece)) == 0
    rc = shard.shard_st_writer_finish(w)
    assert rc == 0, shard.shard_errmsg()


def test_files_we_write_load_in_safetensors(shard, tmp_path):
    tensors = random_tensors(1)
    path = tmp_path / "ours.safetensors"
    write_with_shard(shard, path, tensors, {"format": "pt"})
    # the reference parser (Rust, full validation) gives dtype, shape and raw bytes
    from safetensors import deserialize
    loaded = dict(deserialize(path.read_bytes()))
    assert set(loaded) == set(tensors)
    for name, a in tensors.items():
        expect = [k for k, v in NPDT.items() if np.dtype(v) == a.dtype][0]
        assert loaded[name]["dtype"] == expect and tuple(loaded[name]["shape"]) == a.shape
        assert bytes(loaded[name]["data"]) == a.tobytes()
    # and the numpy front end for the dtypes it knows
    plain = {k: v for k, v in tensors.items() if "f8" not in k}
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        for name, a in plain.items():
            if a.dtype == ml_dtypes.bfloat16:
                continue  # numpy has no bfloat16
            assert f.get_tensor(name).tobytes() == a.tobytes(), name
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert n % 8 == 0  # data 8-byte aligned, as the reference writes it
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_writer_refuses_short_data_and_leaves_nothing(shard, tmp_path):
    w = ctypes.c_void_p()
    path = tmp_path / "short.safetensors"
    assert shard.shard_st_writer_create(str(path).encode(), ctypes.byref(w)) == 0
    shape = (ctypes.c_int64 * 1)(4)
    assert shard.shard_st_writer_declare(w, b"x", DT["F32"], 1, shape) == 0
    assert shard.shard_st_writer_write(w, b"\0" * 8, 8) == 0
    assert shard.shard_st_writer_finish(w) != 0
    assert b"declared bytes" in shard.shard_errmsg()
    assert list(tmp_path.iterdir()) == []


def test_multi_file_model_with_index(shard, tmp_path):
    rng = np.random.default_rng(2)
    a = {"a.weight": rng.standard_normal((4, 3)).astype(np.float32), "b.weight": np.arange(5, dtype=np.int64)}
    b = {"c.weight": rng.standard_normal((2,)).astype(np.float16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 0},
             "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                            **{k: "model-00002-of-00002.safetensors" for k in b}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    h = ctypes.c_void_p()
    assert shard.shard_weights_open(str(tmp_path).encode(), ctypes.byref(h)) == 0, shard.shard_errmsg()
    try:
        names = []
        for i in range(shard.shard_weights_count(h)):
            t = shard.shard_weights_at(h, i).contents
            name = t.name.decode()
            names.append(name)
            ref = {**a, **b}[name]
            assert ctypes.string_at(t.data, t.nbytes) == ref.tobytes()
            assert shard.shard_weights_file_of(h, i).decode() == index["weight_map"][name]
        assert names == sorted({**a, **b})
    finally:
        shard.shard_weights_close(h)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_merge_writes_at_most_256_kib_at_a_time(tmp_path):
    """smp-merge hands the kernel at most SHARD_WRITE_MAX (256 KiB) per write(2): larger
    writes get large page-cache folios, which on a VM with free page reporting were
    4-10x slower to fill (libshard/core/internal.h). A 16 MiB embedding, so that the
    writer's 4 MiB buffer fills several times."""
    import subprocess
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from conftest import BUILD, run
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    run("smp-convert", "hf2smp", "--in", tmp_path / "hf", "--out", tmp_path / "ck", "--layout", "pp=1", check=0)
    log = tmp_path / "strace.log"
    p = subprocess.run(["strace", "-f", "-qq", "-e", "trace=write,pwrite64,writev", "-e", "signal=none", "-o", str(log),
                        str(BUILD / "bin" / "smp-merge"), "--in", str(tmp_path / "ck"), "--out", str(tmp_path / "m"),
                        "--no-fsync"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "ptrace" in p.stderr.lower():
        pytest.skip(f"strace cannot trace here: {p.stderr.strip().splitlines()[0]}")
    assert p.returncode == 0, p.stderr
    sizes = [int(line.rsplit("=", 1)[1]) for line in log.read_text().splitlines() if "= " in line and "write" in line
             and line.rsplit("=", 1)[1].strip().lstrip("-").isdigit()]
    out = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert out > 16 << 20 and sum(sizes) >= out, (out, sum(sizes))
    assert max(sizes) <= 256 << 10, max(sizes)
    src, got = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "m" / "model.safetensors"))
    assert set(src) == set(got) and all(np.array_equal(src[k], got[k]) for k in src)


def traced_syncs(tmp_path, tag, cmd, *args):
    """Runs a release command under strace; returns (main pid, [(pid, syscall)]) of its
    fsync and fdatasync calls."""
    import subprocess
    from conftest import BUILD
    log = tmp_path / f"{tag}.strace"
    p = subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve,fsync,fdatasync", "-e", "signal=none", "-o", str(log),
                        str(BUILD / "bin" / cmd), *map(str, args)], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "ptrace" in p.stderr.lower():
        pytest.skip(f"strace cannot trace here: {p.stderr.strip().splitlines()[0]}")
    assert p.returncode == 0, p.stderr
    calls = [line.split(None, 1) for line in log.read_text().splitlines()]
    main = next(int(pid) for pid, rest in calls if rest.startswith("execve("))
    return main, [(int(pid), rest.split("(", 1)[0]) for pid, rest in calls if not rest.startswith("execve(")]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_durable_writers_flush_in_the_background(tmp_path):
    """A durable HDF5 shard writer (hf2smp) and safetensors writer (smp-merge) past 64 MiB
    start their flusher (libshard/io/flusher.c): a thread other than the main one calls
    fdatasync while the file is written, the close still fsyncs, and what lands is bit for
    bit what `safetensors` and h5py read back; the ASan + UBSan build does the same without
    a report. With --no-fsync, neither call happens. One pp=1 shard file and one merged
    file of 2 x 80 MiB (f32 embedding and head [32000, 640])."""
    import h5py
    from conftest import run
    from test_read import assert_same, llama_config, make_hf
    cfg = llama_config(32000, 640, 128, 1, 4, 2, "float32")
    src = make_hf(tmp_path / "hf", cfg, np.float32, seed=5)
    ref = load_file(str(src / "model.safetensors"))
    ck, out = tmp_path / "ck", tmp_path / "m"
    steps = [("hf2smp", "smp-convert", "hf2smp", "--in", src, "--out", ck, "--layout", "pp=1", "--compress", "none"),
             ("merge", "smp-merge", "--in", ck, "--out", out)]
    for tag, *cmd in steps:
        main, calls = traced_syncs(tmp_path, tag, *cmd)
        flushes = [pid for pid, name in calls if name == "fdatasync"]
        assert flushes and main not in flushes, (tag, calls)  # the flusher's, in its own thread
        assert "fsync" in [name for _, name in calls], (tag, calls)  # the durability point at close
    [shard_file] = list(ck.rglob("*.h5"))
    assert shard_file.stat().st_size > 128 << 20
    with h5py.File(shard_file, "r") as f:
        found = []
        f.visititems(lambda name, obj: found.append(obj[()]) if isinstance(obj, h5py.Dataset) and
                     obj.shape == ref["lm_head.weight"].shape else None)
    assert any(np.array_equal(a, ref["lm_head.weight"]) for a in found)
    assert any(np.array_equal(a, ref["model.embed_tokens.weight"]) for a in found)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        assert_same(got[k], ref[k], f"durable merge {k}")
    run("smp-verify", ck, check=0)
    run("smp-convert", "hf2smp", "--in", src, "--out", tmp_path / "ck-san", "--layout", "pp=1", "--compress", "none",
        san=True, check=0)
    run("smp-merge", "--in", tmp_path / "ck-san", "--out", tmp_path / "m-san", san=True, check=0)
    assert (tmp_path / "m-san" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    _, calls = traced_syncs(tmp_path, "merge-no-fsync", "smp-merge", "--in", ck, "--out", tmp_path / "m2", "--no-fsync")
    assert calls == [], calls
