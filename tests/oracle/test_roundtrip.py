"""hf2smp -> reshard chains -> smp-merge against transformers, safetensors, h5py."""
import hashlib
import json
import os
import shutil

import h5py
import hdf5plugin  # noqa: F401  (registers the zstd filter 32015 with h5py)
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

import models
from conftest import file_checksum, run, to_version_1

LAYOUTS = ["pp=1", "tp=2", "pp=2,tp=2", "tp=3,cp=2", "pp=3,dp=2", "pp=2,tp=6", "tp=4,cp=1,dp=2", "cp=2,dp=3",
           "pp=2,cp=2,dp=2", "tp=4"]


def tensors_of(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def fits(case, layout):
    _, kw, _, _ = models.CASES[case]
    parts = dict(p.split("=") for p in layout.split(","))
    tp, pp = int(parts.get("tp", 1)), int(parts.get("pp", 1))
    kv = kw.get("num_key_value_heads", kw["num_attention_heads"])
    return kw["num_attention_heads"] % tp == 0 and (kv % tp == 0 or tp % kv == 0) and pp <= kw["num_hidden_layers"]


@pytest.mark.parametrize("case", list(models.CASES))
def test_roundtrip_bit_for_bit(tmp_path, case):
    hf = tmp_path / "hf"
    model = models.make(case, hf)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    ref = tensors_of(hf)
    layouts = [l for l in LAYOUTS if fits(case, l)]
    assert len(layouts) >= 6
    ids = torch.tensor([[1, 5, 7, 2, 9, 3]])
    from transformers import AutoModelForCausalLM
    # the reference: the original folder loaded the same way (fp32 for both, the
    # half-precision cases included; loading recomputes rope buffers in fp32 for both)
    with torch.no_grad():
        ref_logits = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)(ids).logits
    for i, layout in enumerate(layouts):
        ck = tmp_path / f"ck{i}"
        run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", layout, check=0)
        run("smp-verify", ck, check=0)
        # a reshard chain through two other layouts
        a, b = layouts[(i + 1) % len(layouts)], layouts[(i + 2) % len(layouts)]
        run("smp-convert", "reshard", "--in", ck, "--out", tmp_path / f"r{i}a", "--layout", a, "--compress", "none", check=0)
        run("smp-convert", "reshard", "--in", tmp_path / f"r{i}a", "--out", tmp_path / f"r{i}b", "--layout", b, check=0)
        out = tmp_path / f"out{i}"
        run("smp-merge", "--in", tmp_path / f"r{i}b", "--out", out, check=0)
        got = tensors_of(out)
        assert set(got) == set(ref)
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
        for name in ["config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"]:
            assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    # the export serves as it is: transformers loads it and gives the same logits
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref_logits)


def test_hub_cache_snapshot(tmp_path):
    """A model as huggingface_hub caches it (snapshots/REV/NAME -> ../../blobs/HASH, the
    commonest local copy): hf2smp follows those links out of the snapshot folder (the
    links refused inside a checkpoint are not refused here), and the export holds the
    same tensors and files as regular files."""
    hf = tmp_path / "hf"
    models.make("llama-sharded", hf)
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(hf.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(str(snap)).num_hidden_layers == AutoConfig.from_pretrained(str(hf)).num_hidden_layers
    run("smp-convert", "hf2smp", "--in", snap, "--out", tmp_path / "ck", "--layout", "pp=2,tp=2", check=0)
    run("smp-merge", "--in", tmp_path / "ck", "--out", tmp_path / "out", check=0)
    ref, got = tensors_of(hf), tensors_of(tmp_path / "out")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    for name in ("config.json", "generation_config.json"):
        out = tmp_path / "out" / name
        assert not out.is_symlink() and out.read_bytes() == (hf / name).read_bytes(), name


def test_merge_to_fp16_as_torch_and_refused_where_it_overflows(tmp_path):
    """smp-merge --dtype fp16 of a bf16 model writes what torch's .to(float16) gives, bit
    for bit, and transformers loads it as fp16. A weight beyond fp16's +-65504 (which
    torch turns into inf without a word, and the model then gives NaN) is refused: exit
    3, one line naming the tensor, no export."""
    hf = tmp_path / "hf"
    models.make("llama-tied-bf16-llama3", hf)
    ref = tensors_of(hf)
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "tp=2", check=0)
    run("smp-merge", "--in", tmp_path / "ck", "--out", tmp_path / "out", "--dtype", "fp16", check=0)
    got = tensors_of(tmp_path / "out")
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == torch.float16 and torch.equal(got[k], ref[k].to(torch.float16)), k
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).dtype == torch.float16
    big = tmp_path / "big"
    shutil.copytree(hf, big)
    w = tensors_of(big)
    name = "model.layers.0.mlp.down_proj.weight"
    w[name][1, 2] = 1e6
    assert torch.isinf(w[name].to(torch.float16)).any()  # what a plain cast would write
    f = sorted(big.glob("*.safetensors"))
    assert len(f) == 1
    from safetensors.torch import save_file
    save_file(w, str(f[0]), metadata={"format": "pt"})
    run("smp-convert", "hf2smp", "--in", big, "--out", tmp_path / "ck-big", "--layout", "tp=2", check=0)
    p = run("smp-merge", "--in", tmp_path / "ck-big", "--out", tmp_path / "out-big", "--dtype", "fp16")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1 and name in lines[0] and "fp16" in lines[0], p.stderr
    assert not [e for e in os.listdir(tmp_path) if "out-big" in e]
    run("smp-merge", "--in", tmp_path / "ck-big", "--out", tmp_path / "out-big", "--dtype", "bf16", check=0)


def test_split_export_with_index(tmp_path):
    hf = tmp_path / "hf"
    models.make("llama-gqa-f32", hf)
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "ck", "--layout", "tp=2", check=0)
    run("smp-merge", "--in", tmp_path / "ck", "--out", tmp_path / "out", "--max-shard-size", "20KB", "--dtype", "bf16", check=0)
    idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got = tensors_of(tmp_path / "out")
    assert set(idx["weight_map"]) == set(got) == set(tensors_of(hf))
    ref = tensors_of(hf)
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].to(torch.bfloat16)), k
    # config.json names the weights' new dtype, every other byte as given; transformers,
    # taking the config's word (dtype="auto"), loads the model in bf16
    given = (hf / "config.json").read_text()
    keys = [k for k in ("torch_dtype", "dtype") if json.loads(given).get(k) == "float32"]
    assert keys, "the model's config.json names no dtype: nothing to test"
    want = given
    for k in keys:
        assert want.count(f'"{k}": "float32"') == 1
        want = want.replace(f'"{k}": "float32"', f'"{k}": "bfloat16"')
    assert (tmp_path / "out" / "config.json").read_text() == want
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # weights kept as stored (fp32): config.json byte for byte as given
    run("smp-merge", "--in", tmp_path / "ck", "--out", tmp_path / "keep", check=0)
    assert (tmp_path / "keep" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


def assert_file_checksums(ck):
    """Every file's checksum in smp.json, computed here from libxxhash alone (the writer
    hashes its chunks' blocks from memory and reads back only the rest)."""
    m = json.loads((ck / "smp.json").read_text())
    assert m["files"]
    for fe in m["files"]:
        data = (ck / fe["name"]).read_bytes()
        assert (fe["bytes"], fe["xxh3_blocks"]) == (len(data), file_checksum(data)), (ck.name, fe["name"])


def independent_reader(ck):
    """Reassemble every tensor from smp.json and the shard files using only
    docs/FORMAT.md's rules, with h5py + hdf5plugin."""
    m = json.loads((ck / "smp.json").read_text())
    assert m["format"] == "smp" and m["version"] == 2
    assert_file_checksums(ck)
    raw = {"F32": np.float32, "F16": np.uint16, "BF16": np.uint16, "F64": np.float64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}
    view = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    out = {}
    for t in m["tensors"]:
        full = np.zeros(t["shape"], dtype=raw[t["dtype"]])
        seen = np.zeros(t["shape"], dtype=np.int32)
        for p in t["pieces"]:
            with h5py.File(ck / p["file"], "r") as f:
                d = f[p["dataset"]]
                assert d.attrs["tensor"].decode() if isinstance(d.attrs["tensor"], bytes) else d.attrs["tensor"] == t["name"]
                assert list(d.attrs["offset"]) == p["offset"] and list(d.attrs["global_shape"]) == t["shape"]
                sl = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"]))
                full[sl] = d[()]
                seen[sl] += 1
        assert (seen == 1).all(), t["name"]
        out[t["name"]] = full.view(view[t["dtype"]]) if t["dtype"] in view else full
    return out


@pytest.mark.parametrize("case", ["llama-tied-bf16-llama3", "mistral-gqa-f16-window"])
def test_h5py_and_an_independent_reader(tmp_path, case):
    hf = tmp_path / "hf"
    models.make(case, hf)
    ck = tmp_path / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=2,tp=2", check=0)
    with h5py.File(next(ck.glob("shard-*.h5")), "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert names and all(n.startswith("params/") for n in names)
        d = f[names[0]]
        plist = d.id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert filters == [h5py.h5z.FILTER_SHUFFLE, 32015], filters  # shuffle, then zstd
        d[()]  # decompresses through hdf5plugin's zstd
    got = independent_reader(ck)
    ref = {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in tensors_of(hf).items()}
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert np.array_equal(np.asarray(got[k], dtype=np.float32), np.asarray(v, dtype=np.float32)), k


def pieces_of(ck):
    """Every piece of a checkpoint: (group, name, dtype, shape, offset, piece shape, xxh64)."""
    m = json.loads((ck / "smp.json").read_text())
    return sorted((t["group"], t["name"], t["dtype"], tuple(t["shape"]), tuple(p["offset"]), tuple(p["shape"]), p["xxh64"])
                  for t in m["tensors"] for p in t["pieces"])


def leftovers(folder):
    """Staging folders and checksum notes left anywhere under folder."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp-" in p.name or p.name.endswith(".fhash"))


def test_no_fsync_writes_the_same_checkpoint(tmp_path):
    """--no-fsync leaves out the fsyncs and nothing else: hf2smp, reshard and init give the
    pieces (and checksums) of the durable default, files that verify, nothing left behind
    (staging folders, the writers' notes of file checksums), and smp-merge --no-fsync gives
    the model back bit for bit."""
    hf = tmp_path / "hf"
    models.make("llama-sharded", hf)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    ref = tensors_of(hf)
    cfg = hf / "config.json"
    for what, args in [("hf2smp", ["--in", hf, "--layout", "pp=2,tp=2"]),
                       ("init", ["--config", cfg, "--layout", "tp=2,dp=2", "--seed", "3"])]:
        for compress in ["none", "zstd"]:
            durable, fast = tmp_path / f"{what}-{compress}", tmp_path / f"{what}-{compress}-nofsync"
            run("smp-convert", what, *args, "--compress", compress, "--out", durable, check=0)
            run("smp-convert", what, *args, "--compress", compress, "--out", fast, "--no-fsync", check=0)
            run("smp-verify", fast, check=0)
            assert_file_checksums(fast)
            assert_file_checksums(durable)
            assert pieces_of(fast) == pieces_of(durable), (what, compress)
            a, b = json.loads((durable / "smp.json").read_text()), json.loads((fast / "smp.json").read_text())
            assert [f["name"] for f in a["files"]] == [f["name"] for f in b["files"]]
    rs = tmp_path / "reshard-nofsync"
    run("smp-convert", "reshard", "--in", tmp_path / "hf2smp-zstd-nofsync", "--out", rs, "--layout", "tp=4", "--no-fsync", check=0)
    run("smp-verify", rs, check=0)
    assert_file_checksums(rs)
    run("smp-convert", "reshard", "--in", tmp_path / "hf2smp-zstd", "--out", tmp_path / "reshard", "--layout", "tp=4", check=0)
    assert pieces_of(rs) == pieces_of(tmp_path / "reshard")
    for flags in [[], ["--no-fsync"]]:
        out = tmp_path / f"merged{len(flags)}"
        run("smp-merge", "--in", rs, "--out", out, "--max-shard-size", "60KB", *flags, check=0)
        got = tensors_of(out)
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
        assert (out / "tokenizer_config.json").read_bytes() == (hf / "tokenizer_config.json").read_bytes()
    assert leftovers(tmp_path) == []
    p = run("smp-convert", "--help")
    assert "--no-fsync" in p.stdout + p.stderr
    p = run("smp-merge", "--help")
    assert "--no-fsync" in p.stdout + p.stderr


BIG = dict(vocab_size=3001, hidden_size=512, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4)


def test_chunked_pieces_hold_the_source(tmp_path):
    """Pieces of several ~1 MiB chunks, written by 1 to 4 threads taking turns (hash in
    chunk order, write in chunk order): h5py reads every dataset equal to its box of the
    source, for whole-row pieces, row-split ones (o_proj, down_proj at tp=2), partial last
    chunks (an odd vocabulary), with and without dtype conversion and compression; and the
    pieces' checksums do not depend on threads, compression or --no-fsync. Uncompressed
    pieces are made with their chunks' places allocated (the writer's direct path)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.numpy import load_file
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**BIG)).save_pretrained(str(hf), safe_serialization=True)
    src = load_file(str(hf / "model.safetensors"))
    assert src["model.embed_tokens.weight"].nbytes > 4 << 20 and src["model.embed_tokens.weight"].dtype == np.float32
    seen = {}
    for dtype, compress, threads, extra in [("keep", "none", "4", ["--no-fsync"]), ("keep", "zstd", "1", []),
                                            ("keep", "none", "1", []), ("bf16", "none", "3", []),
                                            ("bf16", "zstd:1", "2", ["--no-fsync"])]:
        ck = tmp_path / f"ck-{dtype}-{compress}-{threads}"
        run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "pp=2,tp=2", "--dtype", dtype, "--compress",
            compress, "--threads", threads, *extra, check=0)
        run("smp-verify", ck, check=0)
        assert_file_checksums(ck)
        m = json.loads((ck / "smp.json").read_text())
        multi = set()  # the tensors with pieces of several chunks: the test is about them
        for t in m["tensors"]:
            want = torch.from_numpy(src[t["name"]])
            if dtype == "bf16":
                want = want.to(torch.bfloat16).view(torch.int16)
            want = want.numpy().view(np.uint16) if dtype == "bf16" else want.numpy()
            for p in t["pieces"]:
                with h5py.File(ck / p["file"], "r") as f:
                    d = f[p["dataset"]]
                    if d.id.get_num_chunks() > 1:
                        multi.add(t["name"].split(".")[-2])
                    # uncompressed pieces: every chunk placed at creation, written by pwrite in parallel
                    early = d.id.get_create_plist().get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY
                    assert early == (compress == "none"), (ck.name, p["dataset"])
                    got = d[()]
                sl = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"]))
                assert got.dtype == want.dtype and np.array_equal(got, want[sl]), (ck.name, t["name"], p["offset"])
        assert {"embed_tokens", "down_proj", "gate_proj"} <= multi, multi
        seen.setdefault(dtype, []).append(pieces_of(ck))
    for dtype, runs in seen.items():
        assert all(r == runs[0] for r in runs), dtype


def shard_datasets(ck):
    """One walk of every shard file: each piece as h5py decodes it (keyed by file and
    dataset), the stored (compressed) bytes of all chunks, and the zstd filter's
    recorded values."""
    data, total, levels = {}, 0, set()
    for f5 in sorted(ck.glob("shard-*.h5")):
        with h5py.File(f5, "r") as f:
            def visit(name, d):
                nonlocal total
                if not isinstance(d, h5py.Dataset):
                    return
                data[(f5.name, name)] = d[()]
                total += sum(d.id.get_chunk_info(i).size for i in range(d.id.get_num_chunks()))
                plist = d.id.get_create_plist()
                levels.update(tuple(vals) for code, _, vals, _ in map(plist.get_filter, range(plist.get_nfilters()))
                              if code == 32015)
            f.visititems(visit)
    return data, total, levels


def test_default_zstd_is_tuned_for_number_planes(tmp_path):
    """The default --compress zstd (level 1, matches of 7 bytes and up from a small table:
    FORMAT.md) stores bf16 weights in fewer bytes than plain zstd:1 and zstd:3 (the old
    default), in frames hdf5plugin decodes to the same tensors; zstd:N keeps zstd's own
    parameters (so zstd:1 differs from the default)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**BIG)).to(torch.bfloat16).save_pretrained(str(hf), safe_serialization=True)
    sizes, data = {}, {}
    for compress in ("zstd", "zstd:1", "zstd:3"):
        ck = tmp_path / compress.replace(":", "-")
        run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=2", "--compress", compress, check=0)
        run("smp-verify", ck, check=0)
        data[compress], sizes[compress], levels = shard_datasets(ck)
        assert levels == {(1,) if compress == "zstd" else (int(compress[5:]),)}, (compress, levels)
    assert data["zstd"].keys() == data["zstd:3"].keys() and len(data["zstd"]) > 10
    for k, v in data["zstd"].items():
        assert np.array_equal(v, data["zstd:3"][k]) and np.array_equal(v, data["zstd:1"][k]), k
    assert sizes["zstd"] < sizes["zstd:1"] and sizes["zstd"] < sizes["zstd:3"], sizes


def test_version_1_checkpoints_are_still_read(tmp_path):
    """A checkpoint of format version 1 (files[] with the whole file's XXH64) verifies,
    merges to the source, reshards into a version-2 one, and its damaged extra file is
    still caught by its XXH64; each version's manifest must carry its own key."""
    hf = tmp_path / "hf"
    models.make("llama-gqa-f32", hf)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    ck = tmp_path / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=2", check=0)
    assert json.loads(run("smp-inspect", ck, "--json", check=0).stdout)["format_version"] == 2
    to_version_1(ck)
    run("smp-verify", ck, check=0)
    assert json.loads(run("smp-inspect", ck, "--json", check=0).stdout)["format_version"] == 1
    assert "format version 1" in run("smp-inspect", ck, check=0).stdout
    run("smp-merge", "--in", ck, "--out", tmp_path / "merged", check=0)
    ref, got = tensors_of(hf), tensors_of(tmp_path / "merged")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    run("smp-convert", "reshard", "--in", ck, "--out", tmp_path / "v2", "--layout", "pp=2", check=0)
    assert json.loads((tmp_path / "v2" / "smp.json").read_text())["version"] == 2
    assert_file_checksums(tmp_path / "v2")
    run("smp-verify", tmp_path / "v2", check=0)
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    tc = bad / "extra" / "tokenizer_config.json"
    tc.write_text(tc.read_text().replace("128", "256"))
    for cmd in (["smp-verify", bad], ["smp-merge", "--in", bad, "--out", tmp_path / "o-bad"]):
        p = run(*cmd)
        assert p.returncode == 3 and "tokenizer_config.json" in p.stderr and "checksum" in p.stderr, p.stderr
    assert not (tmp_path / "o-bad").exists()
    for version, key, missing in [(1, "xxh3_blocks", "xxh64"), (2, "xxh64", "xxh3_blocks")]:
        wrong = tmp_path / f"wrong-{version}"
        shutil.copytree(ck, wrong)
        m = json.loads((wrong / "smp.json").read_text())
        m["version"] = version
        for fe in m["files"]:
            fe[key] = fe.pop("xxh64")
        (wrong / "smp.json").write_text(json.dumps(m))
        p = run("smp-verify", wrong)
        assert p.returncode == 3 and f"{missing} missing" in p.stderr, p.stderr


@pytest.mark.parametrize("version", [2, 1])
def test_corruption_is_caught_and_named(tmp_path, version):
    hf = tmp_path / "hf"
    models.make("llama-gqa-f32", hf)
    ck = tmp_path / "ck"
    run("smp-convert", "hf2smp", "--in", hf, "--out", ck, "--layout", "tp=2", check=0)
    if version == 1:
        to_version_1(ck)
    files = sorted(p for p in ck.rglob("*") if p.is_file() and p.name != "smp.json")
    rng = np.random.default_rng(0)
    for f in files:
        for _ in range(3):
            bad = tmp_path / "bad"
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(ck, bad)
            target = bad / f.relative_to(ck)
            data = bytearray(target.read_bytes())
            i = int(rng.integers(0, len(data)))
            data[i] ^= 0x5A
            target.write_bytes(bytes(data))
            p = run("smp-verify", bad)
            assert p.returncode == 3, (f, i, p.stdout, p.stderr)
            assert f.name in p.stderr, p.stderr
    # a missing shard, a truncated shard, an edited manifest
    for how in ["missing", "truncated", "manifest"]:
        bad = tmp_path / f"bad-{how}"
        shutil.copytree(ck, bad)
        shard = bad / "shard-00001.h5"
        if how == "missing":
            shard.unlink()
        elif how == "truncated":
            shard.write_bytes(shard.read_bytes()[:-100])
        else:
            m = json.loads((bad / "smp.json").read_text())
            m["tensors"][0]["pieces"][0]["xxh64"] = "0" * 16
            (bad / "smp.json").write_text(json.dumps(m))
        p = run("smp-verify", bad)
        assert p.returncode == 3 and ("shard-0000" in p.stderr), p.stderr
        # loading (merge) refuses it too
        p = run("smp-merge", "--in", bad, "--out", tmp_path / f"o-{how}")
        assert p.returncode == 3 and not (tmp_path / f"o-{how}").exists(), p.stderr


def test_folder_without_manifest_is_refused(tmp_path):
    (tmp_path / "ck").mkdir()
    p = run("smp-verify", tmp_path / "ck")
    assert p.returncode == 3 and "no smp.json" in p.stderr


def test_conversion_scales_out_under_mpirun(tmp_path):
    import os
    import subprocess
    from conftest import BUILD
    hf = tmp_path / "hf"
    models.make("llama-sharded", hf)
    # Open MPI's dynamically loaded components leak at MPI_Finalize (LeakSanitizer sees
    # them as unknown modules): leak checks of this code path run in the one-process tests
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader",
               ASAN_OPTIONS="detect_leaks=0")
    p = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "3", str(BUILD / "bin" / "smp-convert"), "hf2smp",
                        "--in", str(hf), "--out", str(tmp_path / "mp"), "--layout", "pp=2,tp=2,dp=2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    run("smp-convert", "hf2smp", "--in", hf, "--out", tmp_path / "one", "--layout", "pp=2,tp=2,dp=2", check=0)
    run("smp-verify", tmp_path / "mp", check=0)
    a, b = json.loads((tmp_path / "mp" / "smp.json").read_text()), json.loads((tmp_path / "one" / "smp.json").read_text())
    assert a["tensors"] == b["tensors"]  # same pieces, same checksums, whichever process wrote them
    run("smp-merge", "--in", tmp_path / "mp", "--out", tmp_path / "out", check=0)
    ref, got = tensors_of(hf), tensors_of(tmp_path / "out")
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
