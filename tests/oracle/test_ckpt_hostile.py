"""A hostile corpus of checkpoints: malformed manifests (smp.json) and shard files.

Each case starts from a good checkpoint (hf2smp of a random transformers Llama,
pp=2,tp=2: four shard files and one extra file) and breaks ONE rule, keeping everything
else consistent (when a shard file is edited, its bytes and checksum in "files" are fixed,
so that only the intended problem remains). Every case must be refused:

- by `smp-verify` (AddressSanitizer + UBSan build): exit 3, ONE stderr line
  `smp-verify: error: ...` naming the checkpoint file involved (smp.json or the shard),
  and no sanitizer report;
- by loading it, `smp-merge`: exit 3, one `smp-merge: error:` line, and no output
  folder (nor its staging folder) left behind;
- by `smp-convert reshard`: exit 3, one line, no output and no staging folder.
"""
import json
import os
import shutil
import subprocess
import time

import h5py
import hdf5plugin  # noqa: F401  (registers the zstd filter 32015 with h5py)
import numpy as np
import pytest

import models
from conftest import BUILD_SAN, run, set_file_entry, xxh64

# ------------------------------------------------------------------ helpers
def load(ck):
    return json.loads((ck / "smp.json").read_text())


def save(ck, m):
    (ck / "smp.json").write_text(json.dumps(m, indent=1))


def tensor(m, name):
    return next(t for t in m["tensors"] if t["name"] == name)


def refresh(ck, m, fname):
    """Fix the bytes and checksum of files[fname] after the file itself was edited."""
    data = (ck / fname).read_bytes()
    for f in m["files"]:
        if f["name"] == fname:
            set_file_entry(f, data)
            return
    raise KeyError(fname)


def replace_dataset(ck, m, tname, data, shape_in_manifest=None):
    """Replace the one piece of tensor `tname` by `data` (a new dataset with the same
    attributes, global_shape = its shape), and make the manifest agree everywhere:
    tensor shape, piece shape, piece xxh64, the file's bytes and xxh64."""
    t = tensor(m, tname)
    assert len(t["pieces"]) == 1
    p = t["pieces"][0]
    shape = list(data.shape) if shape_in_manifest is None else shape_in_manifest
    with h5py.File(ck / p["file"], "r+") as f:
        attrs = dict(f[p["dataset"]].attrs)
        del f[p["dataset"]]
        d = f.create_dataset(p["dataset"], data=data) if data.size < (1 << 24) else \
            f.create_dataset(p["dataset"], shape=data.shape, dtype=data.dtype, chunks=(1,) * (len(data.shape) - 1) + (1 << 16,))
        for k, v in attrs.items():
            d.attrs[k] = v
        d.attrs["global_shape"] = np.array(shape, dtype=np.int64)
        d.attrs["offset"] = np.zeros(len(shape), dtype=np.int64)
        d.attrs["xxh64"] = np.bytes_(xxh64(data.tobytes()) if data.size < (1 << 24) else "0" * 16)
    t["shape"] = shape
    p["shape"] = shape
    p["offset"] = [0] * len(shape)
    if data.size < (1 << 24):
        p["xxh64"] = xxh64(np.ascontiguousarray(data).tobytes())
    refresh(ck, m, p["file"])


class Sparse:
    """A stand-in for a huge array: h5py creates the dataset without writing it."""

    def __init__(self, *shape):
        self.shape, self.dtype, self.size = shape, np.dtype("f4"), int(np.prod(shape, dtype=object))


# ------------------------------------------------------------------ the cases
# name -> (function(ck, tmp_path) that breaks the checkpoint, file names one of which
#          the error line must contain)
CASES = {}
MANIFEST = ("smp.json",)


def case(name, names=MANIFEST):
    def reg(fn):
        assert name not in CASES
        CASES[name] = (fn, names)
        return fn
    return reg


def on_manifest(ck, edit):
    """edit(m) on ck's parsed manifest m, saved back."""
    m = load(ck)
    edit(m)
    save(ck, m)


def manifest_case(name, names=MANIFEST):
    """A case that only edits the parsed manifest."""
    def reg(fn):
        def apply(ck, tmp_path):
            on_manifest(ck, fn)
        return case(name, names)(apply)
    return reg


# --- pieces against their tensor: coverage, overlaps, bounds, numbers
def lm_head_case(name, field, value, piece=None, names=MANIFEST):
    """A case that sets one field of lm_head.weight [101,48] in the manifest: of its piece
    `piece` (0: rows [0,51), 1: rows [51,101)), or of the tensor itself (None)."""
    @manifest_case(name, names)
    def _(m):
        t = tensor(m, "lm_head.weight")
        (t if piece is None else t["pieces"][piece])[field] = value


# move the second piece up one row: it overlaps row 50 and row 100 is left out, so a
# count of the covered elements alone still adds up to 101*48
lm_head_case("overlapping-pieces", "offset", [50, 0], piece=1)


@manifest_case("hole-piece-removed")
def _(m):
    del tensor(m, "lm_head.weight")["pieces"][1]


@manifest_case("hole-no-pieces")
def _(m):
    tensor(m, "model.norm.weight")["pieces"] = []


lm_head_case("piece-outside-tensor", "offset", [60, 0], piece=1)
lm_head_case("piece-past-last-dim", "offset", [51, 1], piece=1)
lm_head_case("offset-negative", "offset", [-1, 0], piece=0)
lm_head_case("offset-not-integer", "offset", [51.0, 0], piece=1)
lm_head_case("offset-string", "offset", ["51", 0], piece=1)
lm_head_case("offset-wrong-rank", "offset", [51], piece=1)
lm_head_case("piece-shape-negative", "shape", [-50, 48], piece=1)
lm_head_case("piece-shape-not-integer", "shape", [50.5, 48], piece=1)
lm_head_case("tensor-shape-negative", "shape", [-101, 48])
lm_head_case("tensor-shape-overflows", "shape", [2**62, 2**62])
lm_head_case("piece-xxh64-malformed", "xxh64", "not-a-hash-at-al", piece=0)


# --- paths and the list of files
def _rename_file(m, old, new):
    for f in m["files"]:
        if f["name"] == old:
            f["name"] = new
    for t in m["tensors"]:
        for p in t["pieces"]:
            if p["file"] == old:
                p["file"] = new


@case("path-dotdot")
def _(ck, tmp_path):
    # the file really is there, one folder up: only the rule may stop it
    shutil.copy(ck / "shard-00002.h5", tmp_path / "shard-00002.h5")
    on_manifest(ck, lambda m: _rename_file(m, "shard-00002.h5", "../shard-00002.h5"))


@case("path-dotdot-inside")
def _(ck, tmp_path):
    (ck / "sub").mkdir()
    on_manifest(ck, lambda m: _rename_file(m, "shard-00002.h5", "sub/../shard-00002.h5"))


@case("path-absolute")
def _(ck, tmp_path):
    shutil.copy(ck / "shard-00002.h5", tmp_path / "abs.h5")
    on_manifest(ck, lambda m: _rename_file(m, "shard-00002.h5", str(tmp_path / "abs.h5")))


@case("path-subfolder")
def _(ck, tmp_path):
    (ck / "sub").mkdir()
    shutil.move(ck / "shard-00002.h5", ck / "sub" / "shard-00002.h5")
    on_manifest(ck, lambda m: _rename_file(m, "shard-00002.h5", "sub/shard-00002.h5"))


@case("path-piece-under-extra")
def _(ck, tmp_path):
    # extra/ is a legal place for a file, not for a shard file holding pieces
    shutil.move(ck / "shard-00002.h5", ck / "extra" / "shard-00002.h5")
    on_manifest(ck, lambda m: _rename_file(m, "shard-00002.h5", "extra/shard-00002.h5"))


@manifest_case("path-empty")
def _(m):
    _rename_file(m, "shard-00002.h5", "")


@manifest_case("file-listed-twice")
def _(m):
    m["files"].append(dict(m["files"][0]))


@manifest_case("file-checksum-malformed")
def _(m):
    m["files"][1]["xxh3_blocks"] = "not-a-hash-at-al"


@manifest_case("file-checksum-missing")
def _(m):
    del m["files"][1]["xxh3_blocks"]


@manifest_case("file-checksum-of-version-1")
def _(m):
    # a version-2 manifest must carry version 2's key: version 1's is not taken instead
    m["files"][1]["xxh64"] = m["files"][1].pop("xxh3_blocks")


@manifest_case("piece-file-not-in-files")
def _(m):
    # shard-00003.h5 is still on disk, but the manifest no longer lists it
    m["files"] = [f for f in m["files"] if f["name"] != "shard-00003.h5"]


lm_head_case("piece-file-unknown", "file", "shard-00009.h5", piece=1)


@manifest_case("files-not-array")
def _(m):
    m["files"] = {f["name"]: f for f in m["files"]}


# --- the header: format, version, config, layout, stages
DROP = object()


def header_case(name, field, value=DROP):
    """A case that sets one field of the manifest's top level (DROP: deletes it)."""
    @manifest_case(name)
    def _(m):
        if value is DROP:
            del m[field]
        else:
            m[field] = value


header_case("format-unknown", "format", "gguf")
header_case("format-missing", "format")
header_case("version-3", "version", 3)
header_case("version-0", "version", 0)
header_case("version-missing", "version")
header_case("version-string", "version", "1")
header_case("config-json-missing", "config_json")


@manifest_case("config-json-invalid")
def _(m):
    m["config_json"] = m["config_json"][: len(m["config_json"]) // 2]


@manifest_case("config-json-not-a-string")
def _(m):
    m["config_json"] = json.loads(m["config_json"])


@manifest_case("config-json-unsupported-model")
def _(m):
    cfg = json.loads(m["config_json"])
    cfg["architectures"] = ["GPT2LMHeadModel"]
    m["config_json"] = json.dumps(cfg)


@manifest_case("layout-pp-zero")
def _(m):
    m["layout"]["pp"] = 0
    m["stages"] = []


@manifest_case("layout-missing-tp")
def _(m):
    del m["layout"]["tp"]


@manifest_case("layout-ep-zero")
def _(m):
    m["layout"]["ep"] = 0


@manifest_case("layout-ep-string")
def _(m):
    m["layout"]["ep"] = "2"


@manifest_case("layout-ep-on-a-dense-model")
def _(m):
    m["layout"]["ep"] = 2  # expert parallelism of a model without experts


header_case("stages-wrong-sum", "stages", [2, 2])
header_case("stages-wrong-count", "stages", [3])


@manifest_case("stages-wrap-to-layer-count")
def _(m):
    # three stages whose 64-bit sum wraps around to exactly 3 (the layer count)
    a = (2**64 - 1) // 3
    m["layout"]["pp"] = 3
    m["stages"] = [a, a, a + 4]


# --- tensors
lm_head_case("dtype-unknown", "dtype", "F128")


@manifest_case("tensor-listed-twice")
def _(m):
    m["tensors"].append(json.loads(json.dumps(tensor(m, "model.norm.weight"))))


@manifest_case("tensor-missing")
def _(m):
    # the model (config_json) has lm_head.weight; the checkpoint does not hold it
    m["tensors"] = [t for t in m["tensors"] if t["name"] != "lm_head.weight"]


@manifest_case("tensor-shape-vs-dataset", names=("smp.json", "shard-00002.h5"))
def _(m):
    # model.norm.weight [48] (one piece, in shard-00002.h5) said to be [47]: tensor and
    # piece agree with each other, the stored dataset has 48 elements
    t = tensor(m, "model.norm.weight")
    t["shape"] = t["pieces"][0]["shape"] = [47]


lm_head_case("dtype-vs-dataset", "dtype", "F16", names=("smp.json", "shard-00002.h5", "shard-00003.h5"))
lm_head_case("dtype-vs-dataset-same-width", "dtype", "I32", names=("smp.json", "shard-00002.h5", "shard-00003.h5"))


@case("tensor-shape-vs-config", names=("smp.json", "shard-00002.h5"))
def _(ck, tmp_path):
    # model.norm.weight stored (consistently, checksums right) with 40 elements while
    # config_json says hidden_size 48
    on_manifest(ck, lambda m: replace_dataset(ck, m, "model.norm.weight", np.ones(40, np.float32)))


@case("tensor-huge-sparse-dataset", names=("smp.json", "shard-00002.h5"))
def _(ck, tmp_path):
    # model.norm.weight declared [2**40] and backed by a chunked dataset of that extent
    # that was never written: a few KB on disk, 4 TiB when read
    on_manifest(ck, lambda m: replace_dataset(ck, m, "model.norm.weight", Sparse(2**40)))


@case("tensor-huge-sparse-row", names=("smp.json", "shard-00002.h5"))
def _(ck, tmp_path):
    # the same, as one row of 2**40 elements [1, 2**40]: a reader that buffers whole rows
    # must not trust that length
    on_manifest(ck, lambda m: replace_dataset(ck, m, "model.norm.weight", Sparse(1, 2**40)))


# --- the shard files themselves
@case("shard-not-hdf5", names=("shard-00001.h5",))
def _(ck, tmp_path):
    n = (ck / "shard-00001.h5").stat().st_size
    (ck / "shard-00001.h5").write_bytes(np.random.default_rng(1).bytes(n))
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00001.h5"))


@case("shard-empty-file", names=("shard-00001.h5",))
def _(ck, tmp_path):
    (ck / "shard-00001.h5").write_bytes(b"")
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00001.h5"))


@case("shard-dataset-deleted", names=("shard-00000.h5",))
def _(ck, tmp_path):
    with h5py.File(ck / "shard-00000.h5", "r+") as f:
        del f["/params/model.layers.0.mlp.up_proj.weight"]
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00000.h5"))


@case("shard-dataset-is-a-group", names=("shard-00000.h5",))
def _(ck, tmp_path):
    with h5py.File(ck / "shard-00000.h5", "r+") as f:
        del f["/params/model.layers.0.mlp.up_proj.weight"]
        f.create_group("/params/model.layers.0.mlp.up_proj.weight")
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00000.h5"))


# --- HDF5 objects that reach outside the checkpoint: refused before anything is read.
# Each replaces the dataset of model.norm.weight (its one piece, in shard-00002.h5)
# by an object whose data lives in a file outside the folder, holding exactly the
# right bytes (so that every checksum would pass if it were followed).
NORM = "/params/model.norm.weight"


def outside_copy(ck, tmp_path):
    """model.norm.weight's dataset copied, attributes and all, into an outside file."""
    out = tmp_path / "outside.h5"
    with h5py.File(ck / "shard-00002.h5", "r") as f, h5py.File(out, "w") as g:
        f.copy(f[NORM], g, name="w")
    return out


def relink(ck, make):
    with h5py.File(ck / "shard-00002.h5", "r+") as f:
        attrs = dict(f[NORM].attrs)
        data = f[NORM][()]
        del f[NORM]
        make(f, data, attrs)
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00002.h5"))


@case("hdf5-external-link", names=("shard-00002.h5",))
def _(ck, tmp_path):
    out = outside_copy(ck, tmp_path)
    relink(ck, lambda f, data, attrs: f.__setitem__(NORM, h5py.ExternalLink(str(out), "/w")))


@case("hdf5-external-link-group", names=("shard-00002.h5",))
def _(ck, tmp_path):
    # the group on the way to the dataset is the link
    out = tmp_path / "outside-group.h5"
    with h5py.File(ck / "shard-00002.h5", "r") as f, h5py.File(out, "w") as g:
        f.copy(f["/params"], g, name="params")
    with h5py.File(ck / "shard-00002.h5", "r+") as f:
        del f["/params"]
        f["/params"] = h5py.ExternalLink(str(out), "/params")
    on_manifest(ck, lambda m: refresh(ck, m, "shard-00002.h5"))


@case("hdf5-soft-link", names=("shard-00002.h5",))
def _(ck, tmp_path):
    def make(f, data, attrs):
        d = f.create_dataset("/elsewhere/w", data=data)
        for k, v in attrs.items():
            d.attrs[k] = v
        f[NORM] = h5py.SoftLink("/elsewhere/w")
    relink(ck, make)


@case("hdf5-external-raw-storage", names=("shard-00002.h5",))
def _(ck, tmp_path):
    def make(f, data, attrs):
        raw = tmp_path / "outside.raw"
        raw.write_bytes(np.ascontiguousarray(data).tobytes())
        d = f.create_dataset(NORM, shape=data.shape, dtype=data.dtype, external=[(str(raw), 0, data.nbytes)])
        for k, v in attrs.items():
            d.attrs[k] = v
    relink(ck, make)


@case("hdf5-virtual-dataset", names=("shard-00002.h5",))
def _(ck, tmp_path):
    out = outside_copy(ck, tmp_path)

    def make(f, data, attrs):
        lay = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
        lay[...] = h5py.VirtualSource(str(out), "w", shape=data.shape)
        d = f.create_virtual_dataset(NORM, lay)
        for k, v in attrs.items():
            d.attrs[k] = v
    relink(ck, make)


@manifest_case("two-pieces-one-dataset")
def _(m):
    # lm_head's two pieces [0,51) and [51,101) both point at the first one's dataset
    ps = tensor(m, "lm_head.weight")["pieces"]
    ps[1]["file"], ps[1]["dataset"] = ps[0]["file"], ps[0]["dataset"]


@case("extra-file-damaged-same-size", names=("extra/",))
def _(ck, tmp_path):
    # one byte of the extra file flipped, its size and the manifest unchanged: merge and
    # reshard must not pass it on (they check it as they copy it), verify names it
    name = next(f["name"] for f in load(ck)["files"] if f["name"].startswith("extra/"))
    data = bytearray((ck / name).read_bytes())
    data[len(data) // 2] ^= 0x20
    (ck / name).write_bytes(bytes(data))


# --- the manifest as a document
@case("manifest-deeply-nested")
def _(ck, tmp_path):
    # the real manifest with one more member: 200,000 nested arrays
    text = json.dumps(load(ck))
    (ck / "smp.json").write_text(text[:-1] + ', "notes": ' + "[" * 200000 + "]" * 200000 + "}")


@case("manifest-deeply-nested-objects")
def _(ck, tmp_path):
    (ck / "smp.json").write_text('{"format": "smp", "version": 1, "x": ' + '{"a":' * 100000 + "1" + "}" * 100000 + "}")


@case("manifest-huge")
def _(ck, tmp_path):
    # over the 256 MiB cap on a manifest: one long string
    with open(ck / "smp.json", "w") as f:
        f.write('{"format": "smp", "version": 1, "pad": "')
        chunk = "a" * (1 << 20)
        for _ in range(257):
            f.write(chunk)
        f.write('"}')


@case("manifest-huge-many-tensors")
def _(ck, tmp_path):
    # ~20 MB, well under the cap: 100,000 small tensors that each pass the checks, then
    # one with an unknown dtype. Refusing it is a matter of seconds for a reader whose
    # checks are linear; checks that compare every tensor with every other take minutes.
    m = load(ck)
    junk = [{"name": f"junk.{i}", "group": "params", "dtype": "F32", "shape": [1],
             "pieces": [{"file": "shard-00000.h5", "dataset": f"/params/junk.{i}", "offset": [0], "shape": [1],
                         "xxh64": "0" * 16}]} for i in range(100000)]
    junk[-1]["dtype"] = "F128"
    m["tensors"] += junk
    (ck / "smp.json").write_text(json.dumps(m))


@case("manifest-not-json")
def _(ck, tmp_path):
    text = (ck / "smp.json").read_text()
    (ck / "smp.json").write_text(text[: len(text) // 2])


@case("manifest-trailing-garbage")
def _(ck, tmp_path):
    with open(ck / "smp.json", "a") as f:
        f.write("\n{}")


@case("manifest-duplicate-key")
def _(ck, tmp_path):
    text = (ck / "smp.json").read_text()
    (ck / "smp.json").write_text(text.replace('"format": "smp",', '"format": "smp", "format": "smp",', 1))


@case("manifest-not-object")
def _(ck, tmp_path):
    (ck / "smp.json").write_text(json.dumps([load(ck)]))


@case("manifest-empty")
def _(ck, tmp_path):
    (ck / "smp.json").write_text("")


@case("manifest-is-a-folder")
def _(ck, tmp_path):
    (ck / "smp.json").unlink()
    (ck / "smp.json").mkdir()


@manifest_case("tensors-not-array")
def _(m):
    m["tensors"] = {t["name"]: t for t in m["tensors"]}


@manifest_case("tensors-missing")
def _(m):
    del m["tensors"]


@manifest_case("tensor-entry-not-object")
def _(m):
    m["tensors"][3] = "model.layers.0.mlp.down_proj.weight"


@manifest_case("piece-entry-not-object")
def _(m):
    tensor(m, "lm_head.weight")["pieces"][1] = 7


# ------------------------------------------------------------------ the runs
# Seconds a command may take to refuse a case (the slowest right refusal here, the
# 20 MB manifest, takes ~4 s under the sanitizers).
LIMIT_S = 20

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    models.make("llama-gqa-f32", root / "hf")
    ck = root / "ck"
    run("smp-convert", "hf2smp", "--in", root / "hf", "--out", ck, "--layout", "pp=2,tp=2", check=0)
    run("smp-verify", ck, san=True, check=0)
    names = {f["name"] for f in load(ck)["files"]}
    assert {"shard-00000.h5", "shard-00001.h5", "shard-00002.h5", "shard-00003.h5"} <= names
    return ck


def _env():
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    return env


def run_san(cmd, *args, timeout=LIMIT_S):
    """conftest.run under the sanitizer build, with a time limit of our own: a refusal
    that takes minutes is not a refusal. None when the limit was reached."""
    try:
        return subprocess.run([str(BUILD_SAN / "bin" / cmd), *map(str, args)], capture_output=True, text=True,
                              env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def run_san_together(*cmds, timeout=LIMIT_S):
    """Several sanitizer-build commands side by side (they only read the checkpoint):
    a list of CompletedProcess, None for one that reached the time limit."""
    procs = [subprocess.Popen([str(BUILD_SAN / "bin" / c[0]), *map(str, c[1:])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for c in cmds]
    t0, out = time.monotonic(), []
    for c, p in zip(cmds, procs):
        try:
            o, e = p.communicate(timeout=max(0.1, timeout - (time.monotonic() - t0)))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append(None)
    return out


def refusal_problems(p, cmd, names=None):
    """What is wrong with this refusal (an empty list when it is right): exit code 3,
    one stderr line `cmd: error: ...` (naming one of `names`), no sanitizer report."""
    if p is None:
        return [f"{cmd}: still running after {LIMIT_S}s (not refused)"]
    err = p.stderr.strip()
    tail = err[-1500:]
    out = []
    if "Sanitizer" in err or "runtime error" in err:
        out.append(f"{cmd}: sanitizer report:\n{tail}")
    if p.returncode != 3:
        out.append(f"{cmd}: exit {p.returncode}, expected 3: {tail}")
    lines = err.splitlines()
    if not lines or not lines[0].startswith(f"{cmd}: error: "):
        out.append(f"{cmd}: stderr does not start with '{cmd}: error: ': {tail}")
    elif len(lines) != 1 and not out:
        out.append(f"{cmd}: {len(lines)} lines on stderr: {tail}")
    if names and lines and not any(n in lines[0] for n in names):
        out.append(f"{cmd}: the error line names none of {names}: {lines[0]}")
    return out


def entries(folder):
    return set(os.listdir(folder))


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_checkpoint(good, tmp_path, name):
    fn, names = CASES[name]
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    fn(ck, tmp_path)
    before = entries(tmp_path)
    # verify; loading (smp-merge reads every tensor through the planner); reshard
    pv, pm, pr = run_san_together(("smp-verify", ck), ("smp-merge", "--in", ck, "--out", tmp_path / "merged"),
                                  ("smp-convert", "reshard", "--in", ck, "--out", tmp_path / "re", "--layout", "tp=1"))
    problems = refusal_problems(pv, "smp-verify", names) + refusal_problems(pm, "smp-merge") + \
        refusal_problems(pr, "smp-convert")
    # nothing left behind by a refusal (a command stopped at the time limit was killed,
    # and a kill may leave a staging folder: that is not held against it)
    left = sorted(entries(tmp_path) - before)
    if pm is not None and [e for e in left if e.startswith("merged")]:
        problems.append(f"smp-merge left {[e for e in left if e.startswith('merged')]}")
    if pr is not None and [e for e in left if not e.startswith("merged")]:
        problems.append(f"smp-convert reshard left {[e for e in left if not e.startswith('merged')]}")
    assert not problems, "\n".join(problems)


def test_corpus_size():
    assert len(CASES) >= 25


def test_the_good_checkpoint_passes_every_command(good, tmp_path):
    # the same three commands accept the unbroken copy: the refusals above are the
    # breakage's doing, not the harness's
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    p = run_san("smp-verify", ck)
    assert p.returncode == 0, p.stderr
    p = run_san("smp-merge", "--in", ck, "--out", tmp_path / "merged")
    assert p.returncode == 0 and (tmp_path / "merged" / "model.safetensors").exists(), p.stderr
    p = run_san("smp-convert", "reshard", "--in", ck, "--out", tmp_path / "re", "--layout", "tp=1")
    assert p.returncode == 0, p.stderr
    assert run_san("smp-verify", tmp_path / "re").returncode == 0
    # and the helpers that edit shard files keep a checkpoint whole when the edit is
    # harmless: rewrite a dataset with its own data
    ck2 = tmp_path / "ck2"
    shutil.copytree(good, ck2)
    m = load(ck2)
    p0 = tensor(m, "model.norm.weight")["pieces"][0]
    with h5py.File(ck2 / p0["file"], "r") as f:
        data = f[p0["dataset"]][()]
    replace_dataset(ck2, m, "model.norm.weight", data)
    save(ck2, m)
    p = run_san("smp-verify", ck2)
    assert p.returncode == 0, p.stderr
