"""smp-train --backend cuda, run on the CPU emulator of the CUDA features the kernels
use (tests/gpu/emu, built by `scons variant=emu` into a libsmp_cuda.so that smp-train
loads through SMP_CUDA_LIB), against the C backend.

What this shows without a GPU: the CUDA backend's table (backends/cuda) drives the
same model, optimizer, ZeRO-1, pipeline, tensor and context parallel code as the C
backend, with the kernels' real index arithmetic, fragment layouts and barriers; and
its checkpoints are the C backend's format; and the NCCL communicator a GPU run
uses (backends/cuda/nccl.c), stream-ordered on the backend's stream, over the
emulator's NCCL (tests/gpu/emu/nccl_emu.cpp: MPI messages, device buffers only, data
landing when the stream's order says). What it cannot show: speed, the real cuBLASLt
and NCCL, the tensor cores' own rounding. tools/gpu-check runs the same comparisons
on a GPU.

- fp32 compute: 4 steps log the C backend's losses within 1e-4 relative (the issue's
  bound), gradient norms within 1e-3; bf16 (bf16 parameters and activations, fp32
  master weights): within 1e-2; FP8 delayed: within 5e-2 of the C backend's FP8;
- --recompute full on CUDA gives the same losses as without, bit for bit;
- a checkpoint written by the CUDA backend verifies and resumes on the C backend and
  the other way round, tracking the straight run;
- under mpirun: tp=2 with sequence parallelism, cp=2, pp=2 x dp=2, tp=2 x cp=2 and
  pp=2 x tp=2 on the CUDA backend track the single-rank C run (tp=2 and pp=2 with the loss's logits in chunks of 24
  tokens), and Mixtral at dp=2, ep=2 (the experts' all-to-all) in fp32 within 1e-4;
  a failed or hung NCCL call ends the run with an error, not a hang;
- Qwen2 (bias kernels), Qwen3 (q/k norms), GPT-NeoX (fused qkv, LayerNorm, GELU,
  partial rotary, parallel residual) and Mixtral (router, top-2 experts) on one rank in
  fp32 within 1e-4;
- packed documents with loss masks (the attention kernels' document ids, the ring's
  skipped blocks): fp32 on one rank within 1e-4 and bf16 at cp=2 within 1e-2 of the C
  backend's run on the same data.
"""
import os
import subprocess

import numpy as np
import pytest

import models
from conftest import BUILD, ROOT, run
from test_parallel import assert_tracks
from test_train import datasets, make_ckpt, read_log, write_tokens

CASE = "llama-cuda"
COMMON = ["--batch", 4, "--seq", 32, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5]
FUSED_TOL = 2e-5  # see test_cuda_fused_attention_backward_tracks_c_backend
STEPS = 4  # the emulator is slow: 4 steps (warmup 2, then the cosine) show the tracking


@pytest.fixture(scope="module")
def emu_lib():
    p = subprocess.run(["scons", "-Q", "variant=emu"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout + p.stderr
    return ROOT / "build" / "emu" / "lib" / "libsmp_cuda.so"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, emu_lib):
    tmp = tmp_path_factory.mktemp("cuda")
    _, ck = make_ckpt(tmp, CASE, sharp=False)
    data = write_tokens(tmp / "d.bin", np.random.default_rng(7).integers(0, 128, size=6000))
    refs = {}
    for fp8 in ("off", "delayed"):
        ref = tmp / f"ref-{fp8}"
        run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", ref, "--steps", STEPS, "--fp8", fp8,
            "--log", ref / "log.jsonl", *COMMON, check=0)
        refs[fp8] = read_log(ref / "log.jsonl")
    return tmp, ck, data, refs, emu_lib


def env_for(lib):
    return dict(os.environ, SMP_CUDA_LIB=str(lib), OMP_NUM_THREADS="1", SMP_EMU_DEVICES="8")


def train(setup, out, *args, np_=1, check=True, env_extra=None):
    tmp, ck, data, refs, lib = setup
    exe = str(BUILD / "bin" / "smp-train")
    cmd = [exe, "--ckpt", ck, "--data", data, "--save-dir", out, "--log", out / "log.jsonl", *COMMON, *args]
    if np_ > 1:
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), *cmd]
    env = env_for(lib)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env_extra or {}))
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, timeout=900)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.mark.parametrize("dtype,fp8,tol", [("fp32", "off", 1e-4), ("bf16", "off", 1e-2), ("bf16", "delayed", 5e-2)])
def test_cuda_tracks_c_backend(setup, dtype, fp8, tol):
    tmp, ck, data, refs, lib = setup
    out = tmp / f"cuda-{dtype}-{fp8}"
    p = train(setup, out, "--steps", STEPS, "--backend", "cuda", "--dtype", dtype, "--fp8", fp8)
    assert "backend cuda (cuda_emu" in p.stderr, p.stderr
    assert_tracks(read_log(out / "log.jsonl"), refs[fp8], tol, f"cuda {dtype} fp8 {fp8} vs C")
    assert run("smp-verify", out / f"step-{STEPS:06d}").returncode == 0


def test_no_device_or_no_library_is_a_clear_error(setup):
    tmp, ck, data, refs, lib = setup
    exe = str(BUILD / "bin" / "smp-train")
    args = [exe, "--ckpt", str(ck), "--data", str(data), "--save-dir", str(tmp / "never"), "--steps", 1, "--backend",
            "cuda"]
    cases = [(dict(env_for(lib), SMP_EMU_NO_DEVICE="1"), "smp-train: error: no CUDA device"),
             (dict(env_for(lib), SMP_CUDA_LIB=str(tmp / "missing.so")), "smp-train: error: the CUDA backend could not "
              "be loaded (" + str(tmp / "missing.so") + ")")]
    for env, msg in cases:
        p = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 1, p.stderr
        assert p.stderr.startswith(msg) and len(p.stderr.splitlines()) == 1, p.stderr
        assert not (tmp / "never").exists()
    p = subprocess.run(list(map(str, args[:-2])) + ["--dtype", "bf16"], capture_output=True, text=True,
                       env=env_for(lib), timeout=120)
    assert p.returncode == 2 and "--dtype bf16 needs --backend cuda" in p.stderr
    # a misspelt form of the attention kernels is refused, not replaced by the default unseen
    for var, bad, names in (("SMP_CUDA_ATTN_BWD", "fuse", "split, fused or fused-8x16"),
                            ("SMP_CUDA_ATTN_FWD", "4x8", "8x16, 4x16 or 4x32")):
        p = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=dict(env_for(lib), **{var: bad}),
                           timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr == f"smp-train: error: {var}={bad}: not {names}\n", p.stderr
        assert not (tmp / "never").exists()


def test_recompute_on_cuda_is_exact(setup):
    tmp, ck, data, refs, lib = setup
    logs = {}
    for mode in ("none", "full"):
        out = tmp / f"cuda-rc-{mode}"
        train(setup, out, "--steps", 2, "--backend", "cuda", "--dtype", "bf16", "--recompute", mode)
        logs[mode] = [(r["loss"], r["grad_norm"]) for r in read_log(out / "log.jsonl")]
    assert logs["full"] == logs["none"]


def test_checkpoints_move_between_backends(setup):
    tmp, ck, data, refs, lib = setup
    # CUDA (bf16) for 3 steps, then the C backend for the other 3; and the other way
    for first, second in (("cuda", "cpu"), ("cpu", "cuda")):
        out = tmp / f"move-{first}"
        a = ["--backend", first] + (["--dtype", "fp32"] if first == "cuda" else [])
        b = ["--backend", second] + (["--dtype", "fp32"] if second == "cuda" else [])
        train(setup, out, "--steps", STEPS, "--stop-at", 2, *a)
        assert run("smp-verify", out / "step-000002").returncode == 0
        exe = str(BUILD / "bin" / "smp-train")
        p = subprocess.run([exe, "--ckpt", str(out), "--data", str(data), "--save-dir", str(out), "--log",
                            str(out / "log.jsonl"), *b], capture_output=True, text=True, env=env_for(lib), timeout=900)
        assert p.returncode == 0, p.stderr
        assert_tracks(read_log(out / "log.jsonl"), refs["off"], 1e-4, f"{first} then {second}")


# one dtype per layout keeps the emulated runs to a few minutes on 2 cores (measured
# with both dtypes on each: fp32 1e-7..2e-7, bf16 1e-4..2e-4 relative)
@pytest.mark.parametrize("layout,np_,dtype,tol,extra", [
    ("tp=2", 2, "fp32", 1e-4, ["--sequence-parallel", "--logits-chunk", 24]),
    ("cp=2", 2, "bf16", 1e-2, []),
    ("pp=2,dp=2", 4, "bf16", 1e-2, ["--microbatches", 2, "--logits-chunk", 24]),
    # several NCCL communicators at once: the ring's started passes beside tp's
    # all-reduces, and the pipeline's transfers beside them
    ("tp=2,cp=2", 4, "fp32", 1e-4, ["--sequence-parallel"]),
    ("pp=2,tp=2", 4, "fp32", 1e-4, ["--microbatches", 2]),
])
def test_cuda_parallel_layouts(setup, layout, np_, dtype, tol, extra):
    tmp, ck, data, refs, lib = setup
    steps = 3  # of the reference's schedule of STEPS
    out = tmp / f"cuda-{layout}-{dtype}"
    train(setup, out, "--steps", STEPS, "--stop-at", steps, "--layout", layout, "--backend", "cuda", "--dtype", dtype,
          *extra, np_=np_)
    assert_tracks(read_log(out / "log.jsonl"), refs["off"][:steps], tol, f"cuda {dtype} {layout} vs C one rank")
    assert run("smp-verify", out / f"step-{steps:06d}").returncode == 0


@pytest.mark.parametrize("layout,kind,message", [("tp=2", "error", "emulated asynchronous failure"),
                                                 ("tp=2", "hang", "did not finish within 3 s"),
                                                 ("cp=2", "hang", "did not finish within 3 s")])
def test_a_failed_nccl_call_is_an_error_not_a_hang(setup, tmp_path, layout, kind, message):
    """The backend's collectives are stream-ordered (the host does not wait for them),
    so its own waits watch NCCL: the emulated NCCL's 6th call on each rank reports an
    asynchronous error, or never completes (SMP_EMU_NCCL_FAIL_AT; at cp=2 a ring pass
    started on the communicator's own stream, which the backend's stream waits
    behind); either surfaces as an error line and a failed exit within the deadline
    (SMP_NCCL_TIMEOUT), not as a hang, and no checkpoint is written."""
    out = tmp_path / "out"
    p = train(setup, out, "--steps", 2, "--layout", layout, "--backend", "cuda", np_=2, check=False,
              env_extra=dict(SMP_EMU_NCCL_FAIL_AT="6", SMP_EMU_NCCL_FAIL=kind, SMP_NCCL_TIMEOUT="3"))
    assert p.returncode != 0, p.stderr
    assert "smp-train: error:" in p.stderr and message in p.stderr, p.stderr
    assert "would hang" not in p.stderr, p.stderr  # no host wait outside the watched ones
    assert not (out / "latest").exists() and not list(out.glob("step-*"))


@pytest.mark.parametrize("value", ["5m", "0", "-1", ""])
def test_a_bad_nccl_timeout_is_refused(setup, tmp_path, value):
    """SMP_NCCL_TIMEOUT is read whole: "5m" would otherwise be 5 seconds, a deadline
    that ends healthy runs; refused in one line when the communicator is made"""
    p = train(setup, tmp_path / "out", "--steps", 1, "--layout", "tp=2", "--backend", "cuda", np_=2, check=False,
              env_extra=dict(SMP_NCCL_TIMEOUT=value))
    assert p.returncode == 2, p.stderr
    assert f"smp-train: error: SMP_NCCL_TIMEOUT={value}: not a number of seconds above 0" in p.stderr, p.stderr


@pytest.mark.parametrize("layout,np_,form,shape", [("cp=1", 1, "fused", "4x32"), ("cp=2", 2, "fused-8x16", "4x16")])
def test_cuda_fused_attention_backward_tracks_c_backend(setup, layout, np_, form, shape):
    """SMP_CUDA_ATTN_BWD=fused or fused-8x16: dK, dV and dQ in one kernel of 4 or 8
    warps (dQ's parts added with atomics), with SMP_CUDA_ATTN_FWD=4x32 or 4x16 (the
    forward's other blocks: the same numbers), bf16 (the tensor-core kernels; heads of
    32), on one rank and in the ring of cp=2 (whose blocks add into the same
    gradients): within 1e-2 of the C backend like the defaults, and within FUSED_TOL
    of the defaults' run (the same bf16 rounding of each gradient, only dQ's sums in
    another order; at 32 tokens one key block, so on the emulator the two runs log the
    same numbers. A dQ left out stays within bf16's 1e-2 of C, 1.3e-4 on the loss, but
    not within this)"""
    tmp, ck, data, refs, lib = setup
    steps, logs = 3, {}
    for run_form, run_shape in (("split", "8x16"), (form, shape)):
        out = tmp / f"cuda-{run_form}-{run_shape}-{layout}"
        p = train(setup, out, "--steps", STEPS, "--stop-at", steps, "--layout", layout, "--backend", "cuda", "--dtype",
                  "bf16", np_=np_, env_extra={"SMP_CUDA_ATTN_BWD": run_form, "SMP_CUDA_ATTN_FWD": run_shape})
        named = f"attention backward {form}; attention forward {shape}" in p.stderr
        assert named == (run_form == form), p.stderr
        logs[run_form] = read_log(out / "log.jsonl")
    assert_tracks(logs[form], refs["off"][:steps], 1e-2, f"cuda bf16 {layout} {form} backward vs C")
    assert_tracks(logs[form], logs["split"], FUSED_TOL, f"cuda bf16 {layout} {form} vs split backward")


def test_cuda_documents_and_masks_track_c_backend(setup, tmp_path):
    from test_documents import packed, write_mask
    tmp, ck, data, refs, lib = setup
    toks, mask = packed(128, 6000, np.random.default_rng(21), max_len=12)
    docs = ["--data", write_tokens(tmp_path / "docs.bin", toks), "--loss-mask",
            write_mask(tmp_path / "docs.mask.bin", mask), "--documents"]
    ref, steps = tmp_path / "c", 3  # the emulator is slow: 3 steps show the tracking
    run("smp-train", "--ckpt", ck, "--save-dir", ref, "--steps", steps, "--log", ref / "log.jsonl", *COMMON, *docs,
        check=0)
    for layout, np_, dtype, tol in (("cp=1", 1, "fp32", 1e-4), ("cp=2", 2, "bf16", 1e-2)):
        out = tmp_path / f"cuda-{layout}-{dtype}"
        train(setup, out, "--steps", steps, "--layout", layout, "--backend", "cuda", "--dtype", dtype, *docs, np_=np_)
        rows = read_log(out / "log.jsonl")
        assert [r["targets"] for r in rows] == [r["targets"] for r in read_log(ref / "log.jsonl")]
        assert_tracks(rows, read_log(ref / "log.jsonl"), tol, f"cuda {dtype} {layout} documents vs C")


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen3-gqa-hd", "qwen3-yarn", "neox-parallel", "mixtral-k2"])
def test_cuda_families_track_c_backend(setup, tmp_path, case):
    """Qwen2's biases (the bias kernels), Qwen3's per-head q/k norms (RMSNorm rows of
    head_dim; with YaRN, the RoPE tables' attention factor), GPT-NeoX's layer (LayerNorm with bias, the fused qkv, GELU, RoPE on
    half of each head, the parallel residual) and Mixtral's experts (the router's top-2,
    each expert's SwiGLU over its tokens) on the emulated CUDA backend, fp32, against
    the C backend"""
    tmp, _, _, _, lib = setup
    _, ck = make_ckpt(tmp_path, case, sharp=True)
    V = min(89, models.CASES[case][1]["vocab_size"])
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(9).integers(0, V, size=3000))
    ref = tmp_path / "c"
    run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", ref, "--steps", 2, "--log", ref / "log.jsonl",
        *COMMON, check=0)
    out = tmp_path / "cuda"
    exe = str(BUILD / "bin" / "smp-train")
    p = subprocess.run([exe, "--ckpt", str(ck), "--data", str(data), "--save-dir", str(out), "--steps", "2", "--log",
                        str(out / "log.jsonl"), "--backend", "cuda", "--dtype", "fp32", *map(str, COMMON)],
                       capture_output=True, text=True, env=env_for(lib), timeout=900)
    assert p.returncode == 0, p.stderr
    rows, want = read_log(out / "log.jsonl"), read_log(ref / "log.jsonl")
    assert_tracks(rows, want, 1e-4, f"cuda fp32 {case} vs C")
    for r, q in zip(rows, want):  # a mixture of experts' load-balancing loss too
        assert ("aux_loss" in r) == ("aux_loss" in q) and abs(r.get("aux_loss", 0) - q.get("aux_loss", 0)) <= \
            1e-4 * q.get("aux_loss", 0), (r, q)
    assert ("aux_loss" in want[0]) == (case == "mixtral-k2")


def test_cuda_expert_parallel_tracks_c_backend(setup, tmp_path):
    """Mixtral's experts over two ranks (dp=2, ep=2) on the emulated CUDA backend: each
    token goes to its experts' rank and back through the NCCL communicator's
    all-to-all (nccl.c's group of sends and receives, on the emulator's NCCL), fp32,
    against the C backend on one rank, the load-balancing loss included"""
    tmp, _, _, _, lib = setup
    _, ck = make_ckpt(tmp_path, "mixtral-k2", sharp=True)
    V = min(89, models.CASES["mixtral-k2"][1]["vocab_size"])
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(9).integers(0, V, size=3000))
    ref = tmp_path / "c"
    run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", ref, "--steps", 2, "--log", ref / "log.jsonl",
        *COMMON, check=0)
    out = tmp_path / "cuda"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", str(BUILD / "bin" / "smp-train"), "--ckpt",
           ck, "--data", data, "--save-dir", out, "--steps", 2, "--log", out / "log.jsonl", "--layout", "dp=2,ep=2",
           "--backend", "cuda", "--dtype", "fp32", *COMMON]
    env = dict(env_for(lib), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr
    rows, want = read_log(out / "log.jsonl"), read_log(ref / "log.jsonl")
    assert_tracks(rows, want, 1e-4, "cuda fp32 mixtral dp=2,ep=2 vs C one rank")
    assert all(abs(r["aux_loss"] - q["aux_loss"]) <= 1e-4 * q["aux_loss"] for r, q in zip(rows, want)), (rows, want)


def test_cuda_fp8_experts_track_c_backend(setup, tmp_path):
    """--fp8 delayed on the emulated CUDA backend (fp32 storage: the same quantized
    operands as the C backend's emulation): every expert's gate, up and down through
    cuBLASLt's FP8 GEMMs on its routed rows, which are rarely a multiple of 16 (the last
    rows padded: the parity cases' N = 37, 5, 21), against the C backend's FP8 run"""
    tmp, _, _, _, lib = setup
    _, ck = make_ckpt(tmp_path, "mixtral-cuda", sharp=True)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(9).integers(0, 89, size=3000))
    args = ["--ckpt", ck, "--data", data, "--steps", 2, "--fp8", "delayed", *COMMON]
    ref, out = tmp_path / "c", tmp_path / "cuda"
    run("smp-train", *args, "--save-dir", ref, "--log", ref / "log.jsonl", check=0)
    p = subprocess.run(list(map(str, [BUILD / "bin" / "smp-train", *args, "--save-dir", out, "--log", out / "log.jsonl",
                                      "--backend", "cuda", "--dtype", "fp32"])),
                       capture_output=True, text=True, env=env_for(lib), timeout=900)
    assert p.returncode == 0, p.stderr
    rows, want = read_log(out / "log.jsonl"), read_log(ref / "log.jsonl")
    assert_tracks(rows, want, 1e-4, "cuda fp32 fp8 mixtral vs C")
    assert all(abs(r["aux_loss"] - q["aux_loss"]) <= 1e-4 * q["aux_loss"] for r, q in zip(rows, want))
    a, b = datasets(ref / "step-000002"), datasets(out / "step-000002")
    hist = [k for k in a if k.startswith("fp8/") and a[k].ndim == 2][0]
    assert a[hist].shape[0] == 3 * 2 * (7 + 3 * 4)  # a row per expert linear and role
    np.testing.assert_allclose(b[hist], a[hist], rtol=1e-4)  # the same amaxes, gathered on the device
