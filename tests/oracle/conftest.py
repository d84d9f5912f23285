"""Shared fixtures: where the build is, libshard through ctypes, running the CLIs."""
import ctypes
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# SMP_BUILD: folder holding bin/ and lib/ (default: the release build). The hostile
# corpus runs the sanitizer build: SMP_BUILD_SAN (default build/asan).
BUILD = pathlib.Path(os.environ.get("SMP_BUILD", ROOT / "build"))
BUILD_SAN = pathlib.Path(os.environ.get("SMP_BUILD_SAN", ROOT / "build" / "asan"))

DT = dict(BOOL=1, U8=2, I8=3, U16=4, I16=5, U32=6, I32=7, U64=8, I64=9, F8_E4M3=10, F8_E5M2=11,
          F16=12, BF16=13, F32=14, F64=15)


# Checksums from libxxhash alone. A checkpoint file's checksum, format version 2
# (docs/FORMAT.md, files[]): XXH64 of the little-endian XXH3_64bits of each 4096-byte block.
_XXH = ctypes.CDLL("libxxhash.so.0")
_XXH.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_ulonglong]
_XXH.XXH64.restype = ctypes.c_ulonglong
_XXH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_XXH.XXH3_64bits.restype = ctypes.c_ulonglong


def file_checksum(data: bytes) -> str:
    digests = b"".join(_XXH.XXH3_64bits(data[i:i + 4096], len(data[i:i + 4096])).to_bytes(8, "little")
                       for i in range(0, len(data), 4096))
    return "%016x" % _XXH.XXH64(digests, len(digests), 0)


def xxh64(data: bytes) -> str:
    """XXH64 (seed 0), as pieces' checksums and version 1's files' checksums are written."""
    return "%016x" % _XXH.XXH64(data, len(data), 0)


def xxh3(data: bytes) -> int:
    return _XXH.XXH3_64bits(data, len(data))


def to_version_1(ck):
    """Rewrite a checkpoint's manifest as format version 1.1 wrote it: each file's XXH64
    under "xxh64", no "xxh3_blocks" (the shard files are the same)."""
    m = json.loads((ck / "smp.json").read_text())
    m["version"], m["minor"] = 1, 1
    for fe in m["files"]:
        data = (ck / fe["name"]).read_bytes()
        del fe["xxh3_blocks"]
        fe["xxh64"] = xxh64(data)
    (ck / "smp.json").write_text(json.dumps(m, indent=1))


def set_file_entry(entry: dict, data: bytes):
    """A files[] entry of a version-2 manifest made to describe data."""
    entry["bytes"] = len(data)
    entry["xxh3_blocks"] = file_checksum(data)


class StTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("numel", ctypes.c_uint64),
                ("nbytes", ctypes.c_uint64), ("file_offset", ctypes.c_uint64), ("data", ctypes.c_void_p)]


# The layout part's structs (shard.h, "HF config", "layouts", "boxes").
class ModelDesc(ctypes.Structure):
    _fields_ = [("architecture", ctypes.c_char * 64), ("model_type", ctypes.c_char * 32)] + \
        [(n, ctypes.c_int64) for n in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab",
                                       "max_positions")] + \
        [("norm_eps", ctypes.c_double), ("rope_theta", ctypes.c_double), ("rope_type", ctypes.c_int),
         ("rope_factor", ctypes.c_double), ("rope_low_freq_factor", ctypes.c_double),
         ("rope_high_freq_factor", ctypes.c_double), ("rope_original_max_positions", ctypes.c_int64),
         ("rope_beta_fast", ctypes.c_double), ("rope_beta_slow", ctypes.c_double), ("rope_truncate", ctypes.c_int),
         ("rope_attention_factor", ctypes.c_double), ("rope_mscale", ctypes.c_double),
         ("rope_mscale_all_dim", ctypes.c_double), ("tie_word_embeddings", ctypes.c_int), ("sliding_window", ctypes.c_int64),
         ("initializer_range", ctypes.c_double), ("pad_token_id", ctypes.c_int64), ("eos_token_id", ctypes.c_int64),
         ("torch_dtype", ctypes.c_int)] + \
        [(n, ctypes.c_int) for n in ("qkv_bias", "qk_norm", "fused_qkv", "linear_bias", "layer_norm", "gelu_mlp",
                                     "parallel_residual")] + \
        [("rotary_dim", ctypes.c_int64), ("experts", ctypes.c_int64), ("experts_per_tok", ctypes.c_int64),
         ("moe_intermediate", ctypes.c_int64), ("norm_topk_prob", ctypes.c_int), ("router_aux_loss_coef", ctypes.c_double),
         ("output_router_logits", ctypes.c_int)]


class TensorSpec(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("role", ctypes.c_int), ("layer", ctypes.c_int), ("expert", ctypes.c_int),
                ("ndim", ctypes.c_int), ("shape", ctypes.c_int64 * 2)]


class Layout(ctypes.Structure):
    _fields_ = [("pp", ctypes.c_int), ("tp", ctypes.c_int), ("cp", ctypes.c_int), ("dp", ctypes.c_int),
                ("ep", ctypes.c_int)]


class Coords(ctypes.Structure):
    _fields_ = [("pp", ctypes.c_int), ("tp", ctypes.c_int), ("cp", ctypes.c_int), ("dp", ctypes.c_int)]


class Box(ctypes.Structure):
    _fields_ = [("ndim", ctypes.c_int), ("off", ctypes.c_int64 * 8), ("len", ctypes.c_int64 * 8)]


class Piece(ctypes.Structure):
    _fields_ = [("holds", ctypes.c_int), ("writes", ctypes.c_int), ("box", Box)]


def load_lib(path, sig):
    """The shared library at path through ctypes, each function in sig (name: (argtypes,
    restype)) given its signature."""
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in sig.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


def _load():
    P, I, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    return load_lib(BUILD / "lib" / "libshard.so", {
        "shard_errmsg": ([], ctypes.c_char_p),
        "shard_convert": ([P, I, P, I, S], I),
        "shard_convert_uncached": ([P, I, P, I, S], I),
        "shard_fp8_quantize": ([P, P, S, ctypes.c_float, I], ctypes.c_float),
        "shard_fp8_dequantize": ([P, P, S, ctypes.c_float, I], None),
        "shard_st_open": ([ctypes.c_char_p, ctypes.POINTER(P)], I),
        "shard_st_close": ([P], None),
        "shard_st_count": ([P], S),
        "shard_st_at": ([P, S], ctypes.POINTER(StTensor)),
        "shard_st_find": ([P, ctypes.c_char_p], ctypes.POINTER(StTensor)),
        "shard_st_metadata_count": ([P], S),
        "shard_st_metadata_at": ([P, S, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)], None),
        "shard_st_writer_create": ([ctypes.c_char_p, ctypes.POINTER(P)], I),
        "shard_st_writer_metadata": ([P, ctypes.c_char_p, ctypes.c_char_p], I),
        "shard_st_writer_declare": ([P, ctypes.c_char_p, I, I, ctypes.POINTER(ctypes.c_int64)], I),
        "shard_st_writer_write": ([P, P, S], I),
        "shard_st_writer_finish": ([P], I),
        "shard_st_writer_abort": ([P], None),
        "shard_weights_open": ([ctypes.c_char_p, ctypes.POINTER(P)], I),
        "shard_weights_close": ([P], None),
        "shard_weights_count": ([P], S),
        "shard_weights_at": ([P, S], ctypes.POINTER(StTensor)),
        "shard_weights_file_of": ([P, S], ctypes.c_char_p),
        "shard_config_load": ([ctypes.c_char_p, ctypes.POINTER(ModelDesc)], I),
        "shard_model_tensor_count": ([ctypes.POINTER(ModelDesc)], S),
        "shard_model_tensor": ([ctypes.POINTER(ModelDesc), S, ctypes.POINTER(TensorSpec)], None),
        "shard_layout_parse": ([ctypes.c_char_p, ctypes.POINTER(Layout)], I),
        "shard_layout_size": ([ctypes.POINTER(Layout)], I),
        "shard_layout_coords": ([ctypes.POINTER(Layout), I], Coords),
        "shard_layout_rank": ([ctypes.POINTER(Layout), Coords], I),
        "shard_layout_check": ([ctypes.POINTER(Layout), ctypes.POINTER(ModelDesc)], I),
        "shard_stages_parse": ([ctypes.c_char_p, ctypes.POINTER(ModelDesc), I, ctypes.POINTER(I)], I),
        "shard_stages_auto": ([ctypes.POINTER(ModelDesc), I, ctypes.POINTER(I)], I),
        "shard_stage_of_layer": ([ctypes.POINTER(I), I, I], I),
        "shard_partition": ([ctypes.POINTER(ModelDesc), ctypes.POINTER(Layout), ctypes.POINTER(I),
                             ctypes.POINTER(TensorSpec), I, ctypes.POINTER(Piece)], I),
    })


@pytest.fixture(scope="session")
def shard():
    return _load()


def run(cmd, *args, san=False, check=None):
    exe = (BUILD_SAN if san else BUILD) / "bin" / cmd
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    p = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=600)
    if check is not None:
        assert p.returncode == check, f"{cmd} {args}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p
