"""The portable C ops (build/lib/libsmpkernels.so) against torch autograd.

Every op's forward and backward is compared with a float64 torch reference on odd
shapes; RoPE against transformers' own Llama code (the partial rotary against its
GPT-NeoX code), FP8 against ml_dtypes.
The library is found in $SMP_BUILD_LIB (else $SMP_BUILD/lib, as conftest.py; default
<repo>/build/lib), so the same tests run on the BLAS build, a -DSMP_NO_BLAS build
and the sanitizer build.

Run: python -m pytest tests/oracle/test_kernels.py -q
"""
import ctypes
import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBDIR = os.environ.get("SMP_BUILD_LIB") or os.path.join(os.environ.get("SMP_BUILD") or
                                                          os.path.join(REPO, "build"), "lib")
LIB_PATH = os.path.join(LIBDIR, "libsmpkernels.so")

TOL = 1e-5  # fp32 kernels against a float64 reference

torch.set_num_threads(2)

# ---- the library and its signatures (kernels/ops.h) --------------------------

P, I, F32, SZ, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t, ctypes.c_double


class RopeParams(ctypes.Structure):
    _fields_ = [("theta", ctypes.c_float), ("type", ctypes.c_int), ("factor", ctypes.c_float),
                ("low_freq_factor", ctypes.c_float), ("high_freq_factor", ctypes.c_float),
                ("original_max_pos", ctypes.c_float), ("beta_fast", ctypes.c_float), ("beta_slow", ctypes.c_float),
                ("no_truncate", ctypes.c_int), ("attention_factor", ctypes.c_double), ("mscale", ctypes.c_double),
                ("mscale_all_dim", ctypes.c_double)]


SIGNATURES = {
    "op_embedding_forward": (None, [P, P, P, I, I, I, I]),
    "op_embedding_backward": (None, [P, P, P, I, I, I, I]),
    "op_linear_forward": (None, [P, P, P, I, I, I]),
    "op_linear_backward": (None, [P, P, P, P, P, I, I, I]),
    "op_bias_forward": (None, [P, P, I, I]),
    "op_bias_backward": (None, [P, P, I, I]),
    "op_qkv_split": (None, [P, P, P, P, I, I, I]),
    "op_qkv_merge": (None, [P, P, P, P, I, I, I]),
    "op_moe_route": (None, [P, P, P, P, I, I, I, I]),
    "op_moe_route_backward": (None, [P, P, P, P, P, I, I, I, I]),
    "op_moe_gather": (None, [P, P, P, I, I]),
    "op_moe_combine": (None, [P, P, P, P, I, I, I]),
    "op_moe_combine_backward": (None, [P, P, P, P, P, P, I, I, I]),
    "op_moe_scatter_add": (None, [P, P, P, I, I, I]),
    "op_moe_group": (None, [P, P, P, P, I, I, I]),
    "op_moe_prob_sums": (None, [P, P, I, I]),
    "op_rmsnorm_forward": (None, [P, P, P, P, I, I, F32]),
    "op_rmsnorm_backward": (None, [P, P, P, P, P, P, I, I]),
    "op_layernorm_forward": (None, [P, P, P, P, P, P, I, I, F32]),
    "op_layernorm_backward": (None, [P, P, P, P, P, P, P, P, I, I]),
    "op_rope_inv_freq": (None, [P, I, ctypes.POINTER(RopeParams)]),
    "op_rope_table": (None, [P, P, P, I, P, I, ctypes.c_float]),
    "op_rope_scale": (ctypes.c_float, [ctypes.POINTER(RopeParams)]),
    "op_rope_forward": (None, [P, P, P, I, I, I, I, I]),
    "op_rope_backward": (None, [P, P, P, I, I, I, I, I]),
    "op_attention_forward": (None, [P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I]),
    "op_attention_backward": (None, [P, P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I]),
    "op_attention_merge": (None, [P, P, P, P, I, I, I, I]),
    "op_swiglu_forward": (None, [P, P, P, SZ]),
    "op_swiglu_backward": (None, [P, P, P, P, P, SZ]),
    "op_gelu_forward": (None, [P, P, SZ]),
    "op_gelu_backward": (None, [P, P, P, SZ]),
    "op_xent_rowmax": (None, [P, P, P, P, I, I, I]),
    "op_xent_sumexp": (None, [P, P, P, I, I]),
    "op_xent_loss": (D, [P, P, P, P, P, I]),
    "op_xent_backward": (None, [P, P, P, P, P, I, I, I, F32]),
    "op_adamw": (None, [P, P, P, P, SZ, F32, F32, F32, F32, F32, I]),
    "op_sumsq": (D, [P, SZ]),
    "op_amax": (F32, [P, SZ]),
    "op_scale": (None, [P, F32, SZ]),
    "op_fp8_quantize": (None, [P, P, P, SZ, F32, I]),
    "op_fp8_dequantize": (None, [P, P, SZ, F32, I]),
    "op_linear_forward_fp8": (None, [P, P, P, I, I, I, F32, F32, P]),
    "smp_tile_gemm": (None, [I, I, I, F32, P, SZ, SZ, P, SZ, F32, P, SZ]),
    "smp_tile_gemm_w": (I, [I, I, I, I, F32, P, SZ, SZ, P, SZ, F32, P, SZ]),
}
OP_FP8_E4M3, OP_FP8_E5M2 = 0, 1


@pytest.fixture(scope="module")
def lib():
    if not os.path.exists(LIB_PATH):
        pytest.fail(f"{LIB_PATH} not found: build it with `scons` (or set SMP_BUILD_LIB)")
    so = ctypes.CDLL(LIB_PATH)
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = res, args
    return so


def ptr(a):
    """Pointer to a C-contiguous numpy array (None stays NULL). data_as keeps a
    reference to the array, so a temporary such as ptr(f32(x)) lives through the call."""
    if a is None:
        return None
    assert a.flags["C_CONTIGUOUS"], "ops take contiguous buffers"
    return a.ctypes.data_as(ctypes.c_void_p)


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def i32(a):
    return np.ascontiguousarray(a, dtype=np.int32)


def t64(a, grad=False):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def close(got, ref, tol=TOL, what=""):
    """|got - ref| <= tol * (|ref| + max|ref|): relative error, normalized by the
    tensor's scale so that entries near zero are not held to a relative bound."""
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    got, ref = np.asarray(got, dtype=np.float64), ref.astype(np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(ref).all() and np.isfinite(got).all(), f"{what}: non-finite values"
    scale = np.abs(ref).max() if ref.size else 0.0
    err = np.abs(got - ref)
    bad = err > tol * (np.abs(ref) + scale) + 1e-30
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} entries off, max abs err "
                           f"{err.max():.3g}, max |ref| {scale:.3g}")


def rng(seed):
    return np.random.default_rng(seed)


# ---- the attention's tile product (kernels/tile_gemm.c) ------------------------

# M, N, K: full 6 x 16 blocks, every row and column tail, one element, K = 0 (C = beta C),
# a column tail with K past its padded copy (256: the scalar path), wide N
TILE_SHAPES = [(64, 64, 32), (64, 32, 64), (61, 37, 29), (1, 1, 1), (7, 16, 0), (6, 15, 256),
               (13, 33, 257), (5, 260, 64), (12, 48, 3)]


@pytest.mark.parametrize("M,N,K", TILE_SHAPES)
@pytest.mark.parametrize("ta", [0, 1])
def test_tile_gemm(lib, M, N, K, ta):
    """C = beta C + alpha op(A) B against numpy in float64, A through its strides (ta: A
    stored transposed), every buffer with a row stride past its width: the elements
    outside C's box untouched, and with beta 0 C not read (NaN there stays out)."""
    r = rng(M * 1000 + N * 10 + K + ta)
    pad = 3
    A = f32(r.standard_normal((K, M + pad) if ta else (M, K + pad)))
    B = f32(r.standard_normal((K, N + pad)))
    opA = A[:, :M].T if ta else A[:, :K]
    sam, sak = (1, M + pad) if ta else (K + pad, 1)
    for alpha, beta in [(1.0, 0.0), (0.37, 1.0), (-2.0, 1.0)]:
        C0 = f32(r.standard_normal((M, N + pad)))
        if beta == 0.0:
            C0[:, :N] = np.nan
        C = C0.copy()
        lib.smp_tile_gemm(M, N, K, alpha, ptr(A), sam, sak, ptr(B), N + pad, beta, ptr(C), N + pad)
        ref = alpha * (opA.astype(np.float64) @ B[:, :N].astype(np.float64))
        if beta:
            ref += C0[:, :N]
        close(C[:, :N], ref, what=f"tile_gemm alpha {alpha} beta {beta}")
        np.testing.assert_array_equal(C[:, N:], C0[:, N:])  # the padding of each row


def avx512():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))


@pytest.mark.parametrize("M,N,K", TILE_SHAPES + [(64, 64, 128), (8, 32, 7), (9, 33, 64), (64, 16, 64), (9, 40, 300), (3, 24, 17)])
@pytest.mark.parametrize("ta", [0, 1])
def test_tile_gemm_widths_agree(lib, M, N, K, ta):
    """The 16-float (AVX-512) form gives the 8-float form's bits, tails included: each
    output is its own lane of one FMA chain over k in order at either width."""
    if not avx512():
        pytest.skip("this CPU has no AVX-512: the 16-float form does not run here")
    r = rng(M * 7 + N * 3 + K + ta)
    A = f32(r.standard_normal((K, M) if ta else (M, K)))
    B = f32(r.standard_normal((K, N)))
    sam, sak = (1, M) if ta else (K, 1)
    for alpha, beta in [(1.0, 0.0), (0.37, 1.0)]:
        C0 = f32(r.standard_normal((M, N)))
        got = {}
        for w in (8, 16):
            C = C0.copy()
            # the width that ran: a build without the 16-float form would run 8 twice
            assert lib.smp_tile_gemm_w(w, M, N, K, alpha, ptr(A), sam, sak, ptr(B), N, beta, ptr(C), N) == w
            got[w] = C
        np.testing.assert_array_equal(got[8].view(np.uint32), got[16].view(np.uint32))


# ---- embedding -----------------------------------------------------------------

def test_embedding_vocab_shard(lib):
    r = rng(1)
    V, H, N = 50, 33, 7
    wte = r.standard_normal((V, H))
    tokens = i32([3, 20, 36, 37, 25, 25, 49])  # in the shard: 20, 36, 25 (twice)
    dout = r.standard_normal((N, H))

    W = t64(wte, grad=True)
    full = F.embedding(torch.tensor(tokens, dtype=torch.long), W)
    (full * t64(dout)).sum().backward()

    outs = []
    for start, local in [(0, 20), (20, 17), (37, 13)]:  # three uneven tp shards
        out = np.full((N, H), np.nan, dtype=np.float32)  # every row must be written
        lib.op_embedding_forward(ptr(out), ptr(tokens), ptr(f32(wte[start:start + local])),
                                 N, H, start, local)
        own = (tokens >= start) & (tokens < start + local)
        ref = full.detach().numpy() * own[:, None]
        close(out, ref, what=f"embedding forward shard {start}")
        outs.append(out)

        dwte0 = r.standard_normal((local, H))
        dwte = f32(dwte0)
        lib.op_embedding_backward(ptr(dwte), ptr(f32(dout)), ptr(tokens), N, H, start, local)
        ref_d = dwte0.astype(np.float32) + W.grad.numpy()[start:start + local]  # accumulates
        close(dwte, ref_d, what=f"embedding backward shard {start}")
    # the tp all-reduce (a sum over the shards) gives the full lookup
    close(sum(outs), full, what="embedding sum over shards")


# ---- linear ----------------------------------------------------------------------

# (the larger ones are cut among OpenBLAS's threads)
@pytest.mark.parametrize("N,IN,OUT", [(7, 33, 19), (70, 130, 150), (333, 70, 90), (40, 200, 261)])
def test_linear(lib, N, IN, OUT):
    r = rng(2)
    x, w, g = r.standard_normal((N, IN)), r.standard_normal((OUT, IN)), r.standard_normal((N, OUT))
    X, Wt = t64(x, True), t64(w, True)
    y = X @ Wt.T
    (y * t64(g)).sum().backward()

    out = np.full((N, OUT), np.nan, dtype=np.float32)
    lib.op_linear_forward(ptr(out), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
    close(out, y, what="linear forward")

    dx0, dw0 = r.standard_normal((N, IN)), r.standard_normal((OUT, IN))
    dx, dw = f32(dx0), f32(dw0)
    lib.op_linear_backward(ptr(dx), ptr(dw), ptr(f32(g)), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
    close(dx, dx0 + X.grad.numpy(), what="linear dinp (+=)")
    close(dw, dw0 + Wt.grad.numpy(), what="linear dweight (+=)")

    # a second call adds the same gradient again; NULL skips a gradient
    lib.op_linear_backward(ptr(dx), None, ptr(f32(g)), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
    close(dx, dx0 + 2 * X.grad.numpy(), what="linear dinp twice")
    close(dw, dw0 + Wt.grad.numpy(), what="linear dweight untouched by NULL")
    lib.op_linear_backward(None, ptr(dw), ptr(f32(g)), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
    close(dw, dw0 + 2 * Wt.grad.numpy(), what="linear dweight twice")


def test_linear_threads(lib):
    """1, 2, 3 and 4 OpenMP threads (OpenBLAS's OpenMP build threads with them), a
    shape with more rows than columns and one with more columns: every count matches
    torch. (Not the same bits: the threads' parts sum differently, in 76% of the
    first shape's dweight.)"""
    omp = ctypes.CDLL("libgomp.so.1")
    r = rng(21)
    for N, IN, OUT in [(333, 70, 90), (40, 200, 261)]:
        x, w, g = r.standard_normal((N, IN)), r.standard_normal((OUT, IN)), r.standard_normal((N, OUT))
        X, Wt = t64(x, True), t64(w, True)
        (X @ Wt.T * t64(g)).sum().backward()
        try:
            for threads in (1, 2, 3, 4):
                omp.omp_set_num_threads(threads)
                out = np.full((N, OUT), np.nan, dtype=np.float32)
                dx, dw = np.ones((N, IN), np.float32), np.ones((OUT, IN), np.float32)
                lib.op_linear_forward(ptr(out), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
                lib.op_linear_backward(ptr(dx), ptr(dw), ptr(f32(g)), ptr(f32(x)), ptr(f32(w)), N, IN, OUT)
                close(out, (X @ Wt.T).detach().numpy(), what=f"linear forward, {threads} threads")
                close(dx, 1 + X.grad.numpy(), what=f"linear dinp, {threads} threads")
                close(dw, 1 + Wt.grad.numpy(), what=f"linear dweight, {threads} threads")
        finally:
            omp.omp_set_num_threads(os.cpu_count())


# ---- bias (Qwen2's q/k/v projections) ------------------------------------------------

@pytest.mark.parametrize("N,C", [(7, 33), (130, 200), (1, 65), (9, 1)])
def test_bias(lib, N, C):
    r = rng(11)
    x, b, g = r.standard_normal((N, C)) * 3, r.standard_normal(C), r.standard_normal((N, C))
    X, B = t64(x, True), t64(b, True)
    y = X + B  # F.linear's bias, broadcast over the rows
    (y * t64(g)).sum().backward()

    out = f32(x)  # in place
    lib.op_bias_forward(ptr(out), ptr(f32(b)), N, C)
    close(out, y, what="bias forward")

    db0 = r.standard_normal(C)
    db = f32(db0)
    lib.op_bias_backward(ptr(db), ptr(f32(g)), N, C)
    close(db, db0 + B.grad.numpy(), what="bias dbias (+=)")
    np.testing.assert_array_equal(X.grad.numpy(), g)  # what the caller passes on as dinp


# ---- GPT-NeoX's fused qkv: split and its adjoint -------------------------------------

@pytest.mark.parametrize("N,nh,hd", [(7, 3, 8), (1, 4, 5), (5, 1, 16), (1, 1, 1), (33, 2, 5)])
def test_qkv(lib, N, nh, hd):
    r = rng(12)
    x = f32(r.standard_normal((N, nh, 3, hd)))
    g = [f32(r.standard_normal((N, nh, hd))) for _ in range(3)]
    X = torch.tensor(x, requires_grad=True)
    ref = X.view(N, nh, 3 * hd).chunk(3, -1)  # transformers' GPTNeoXAttention
    sum((t * torch.tensor(gi)).sum() for t, gi in zip(ref, g)).backward()

    q, k, v = (np.full((N, nh, hd), np.nan, np.float32) for _ in range(3))  # written, whatever was there
    lib.op_qkv_split(ptr(q), ptr(k), ptr(v), ptr(x), N, nh, hd)
    for got, want, name in zip((q, k, v), ref, "qkv"):
        np.testing.assert_array_equal(got, want.detach().numpy(), err_msg=f"qkv split {name}")

    dqkv = np.full((N, nh, 3, hd), np.nan, np.float32)
    lib.op_qkv_merge(ptr(dqkv), ptr(g[0]), ptr(g[1]), ptr(g[2]), N, nh, hd)
    np.testing.assert_array_equal(dqkv, X.grad.numpy(), err_msg="qkv merge vs autograd")


# ---- Mixture of experts: routing, dispatch and combine --------------------------------

def router_ref(z, idx, k, renorm):
    """transformers' MixtralTopKRouter in float64 on the experts idx chose: softmax, the
    chosen probs, divided by their sum when renorm"""
    probs = F.softmax(z, dim=-1)
    wts = probs.gather(1, torch.tensor(idx, dtype=torch.int64))
    return probs, (wts / wts.sum(-1, keepdim=True) if renorm else wts)


@pytest.mark.parametrize("renorm", [0, 1])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("N", [1, 13])
def test_moe_route(lib, N, E, k, renorm):
    r = rng(30 + N + E + k + renorm)
    z = f32(r.standard_normal((N, E)) * 2.0)  # random normal logits: no ties
    probs = np.full((N, E), np.nan, np.float32)
    wts = np.full((N, k), np.nan, np.float32)
    idx = np.full((N, k), -1, np.int32)
    lib.op_moe_route(ptr(probs), ptr(idx), ptr(wts), ptr(z), N, E, k, renorm)
    p32 = F.softmax(torch.tensor(z).float(), dim=-1)  # the router's own fp32 path
    tv, ti = torch.topk(p32, k, dim=-1)
    np.testing.assert_array_equal(idx, ti.numpy().astype(np.int32), err_msg="moe route idx vs torch.topk")
    if renorm:
        tv = tv / tv.sum(-1, keepdim=True)
    close(wts, tv, what="moe route wts vs the fp32 router")

    Z = t64(z, grad=True)
    p_ref, w_ref = router_ref(Z, idx, k, renorm)
    close(probs, p_ref, what="moe route probs")
    close(wts, w_ref, what="moe route wts")

    g, gp = f32(r.standard_normal((N, k))), f32(r.standard_normal((N, E)))
    for dprobs in (gp, None):
        Z.grad = None
        p_ref, w_ref = router_ref(Z, idx, k, renorm)
        loss = (w_ref * t64(g)).sum() + ((p_ref * t64(dprobs)).sum() if dprobs is not None else 0.0)
        loss.backward()
        dz = np.full((N, E), np.nan, np.float32)  # written
        lib.op_moe_route_backward(ptr(dz), ptr(g), ptr(dprobs), ptr(probs), ptr(idx), N, E, k, renorm)
        what = f"moe route dlogits (dprobs {'given' if dprobs is not None else 'NULL'})"
        if renorm and k == 1 and dprobs is None:  # the one weight is 1 whatever the logits
            assert np.abs(dz).max() <= 1e-6 and np.abs(Z.grad.numpy()).max() <= 1e-12, what
        else:
            close(dz, Z.grad, what=what)


@pytest.mark.parametrize("N,k,H", [(7, 2, 5), (1, 1, 3), (1, 2, 8), (33, 2, 17), (5, 8, 4)])
def test_moe_combine(lib, N, k, H):
    r = rng(40 + N + k + H)
    S = N * k
    slot = i32(r.permutation(S))  # where token t's j-th expert put its row
    tok = torch.arange(S) // k  # the token of flat (t, j)
    ys, wts, dout = f32(r.standard_normal((S, H))), f32(r.standard_normal((N, k))), f32(r.standard_normal((N, H)))
    Y, W = t64(ys, grad=True), t64(wts, grad=True)
    sl = torch.tensor(slot, dtype=torch.int64)
    ref = torch.zeros(N, H, dtype=torch.float64).index_add_(0, tok, W.reshape(S, 1) * Y[sl])
    (ref * t64(dout)).sum().backward()

    out = np.full((N, H), np.nan, np.float32)
    lib.op_moe_combine(ptr(out), ptr(ys), ptr(wts), ptr(slot), N, k, H)
    close(out, ref, what="moe combine")
    dys, dwts = np.full((S, H), np.nan, np.float32), np.full((N, k), np.nan, np.float32)
    lib.op_moe_combine_backward(ptr(dys), ptr(dwts), ptr(dout), ptr(ys), ptr(wts), ptr(slot), N, k, H)
    close(dys, Y.grad, what="moe combine dys vs autograd")
    close(dwts, W.grad, what="moe combine dwts vs autograd")

    # scatter_add accumulates each token's slot rows; gather copies rows exactly
    dxs, dx0 = f32(r.standard_normal((S, H))), f32(r.standard_normal((N, H)))
    want = t64(dx0).index_add_(0, tok, t64(dxs)[sl])
    dx = dx0.copy()
    lib.op_moe_scatter_add(ptr(dx), ptr(dxs), ptr(slot), N, k, H)
    close(dx, want, what="moe scatter_add")
    rows = i32(r.integers(0, N, size=S))
    xs = np.full((S, H), np.nan, np.float32)
    lib.op_moe_gather(ptr(xs), ptr(dout), ptr(rows), S, H)
    np.testing.assert_array_equal(xs, dout[rows], err_msg="moe gather")


@pytest.mark.parametrize("N,k,E,skew", [(13, 2, 4, 0), (1, 1, 1, 0), (600, 2, 8, 0), (300, 4, 64, 0), (50, 2, 8, 1)])
def test_moe_group(lib, N, k, E, skew):
    """the grouping against torch's stable sort of the choices by expert (transformers'
    experts take their tokens in the same order), and the probability sums against a
    float64 column sum"""
    r = rng(50 + N + k + E)
    if skew:  # every token's first choice the same expert: one group holds N rows
        idx = np.stack([np.zeros(N), r.integers(1, E, size=N)], 1)
    else:
        idx = np.stack([r.permutation(E)[:k] for _ in range(N)])
    idx = i32(idx.reshape(-1))
    off, rows, slot = (np.full(n, -1, np.int32) for n in (E + 1, N * k, N * k))
    lib.op_moe_group(ptr(off), ptr(rows), ptr(slot), ptr(idx), N, k, E)
    order = torch.argsort(torch.tensor(idx, dtype=torch.int64), stable=True)  # pairs by expert, in pair order
    np.testing.assert_array_equal(rows, (order // k).numpy(), err_msg="moe group rows")
    np.testing.assert_array_equal(slot, torch.argsort(order).numpy(), err_msg="moe group slot (the inverse)")
    want = np.concatenate([[0], np.cumsum(np.bincount(idx, minlength=E))])
    np.testing.assert_array_equal(off, want, err_msg="moe group off")
    probs = f32(r.random((N, E)))
    sums = np.full(E, np.nan)
    lib.op_moe_prob_sums(ptr(sums), ptr(probs), N, E)
    np.testing.assert_allclose(sums, probs.astype(np.float64).sum(0), rtol=1e-13)


# ---- RMSNorm -----------------------------------------------------------------------

def test_rmsnorm(lib):
    r = rng(3)
    N, H, eps = 7, 33, 1e-5
    x, w, g = r.standard_normal((N, H)) * 3, r.standard_normal(H), r.standard_normal((N, H))
    X, Wt = t64(x, True), t64(w, True)
    rstd_ref = torch.rsqrt(X.pow(2).mean(-1) + eps)
    y = X * rstd_ref[:, None] * Wt  # LlamaRMSNorm
    (y * t64(g)).sum().backward()

    out, rstd = np.empty((N, H), np.float32), np.empty(N, np.float32)
    lib.op_rmsnorm_forward(ptr(out), ptr(rstd), ptr(f32(x)), ptr(f32(w)), N, H, eps)
    close(out, y, what="rmsnorm forward")
    close(rstd, rstd_ref, what="rmsnorm rstd")

    dx0, dw0 = r.standard_normal((N, H)), r.standard_normal(H)
    dx, dw = f32(dx0), f32(dw0)
    lib.op_rmsnorm_backward(ptr(dx), ptr(dw), ptr(f32(g)), ptr(f32(x)), ptr(f32(w)), ptr(rstd), N, H)
    close(dx, dx0 + X.grad.numpy(), what="rmsnorm dinp (+=)")
    close(dw, dw0 + Wt.grad.numpy(), what="rmsnorm dweight (+=)")


# ---- LayerNorm (GPT-NeoX's) ----------------------------------------------------------

@pytest.mark.parametrize("N,H,shift,bias", [(7, 33, 0.0, True), (5, 130, 4.0, True), (3, 1, 1.0, True),
                                            (4, 65, -2.0, False)])
def test_layernorm(lib, N, H, shift, bias):
    r = rng(13)
    eps = 1e-5
    x = r.standard_normal((N, H)) * 3 + shift
    w, b, g = r.standard_normal(H), r.standard_normal(H), r.standard_normal((N, H))
    X, Wt, Bt = t64(x, True), t64(w, True), t64(b, True)
    y = F.layer_norm(X, (H,), Wt, Bt if bias else None, eps)
    (y * t64(g)).sum().backward()

    out = np.full((N, H), np.nan, np.float32)
    mean, rstd = np.full(N, np.nan, np.float32), np.full(N, np.nan, np.float32)
    lib.op_layernorm_forward(ptr(out), ptr(mean), ptr(rstd), ptr(f32(x)), ptr(f32(w)),
                             ptr(f32(b)) if bias else None, N, H, eps)
    close(out, y, what="layernorm forward")
    close(mean, X.mean(-1), what="layernorm mean")
    close(rstd, torch.rsqrt(X.var(-1, unbiased=False) + eps), what="layernorm rstd (biased variance)")

    dx0, dw0, db0 = r.standard_normal((N, H)), r.standard_normal(H), r.standard_normal(H)
    dx, dw, db = f32(dx0), f32(dw0), f32(db0)
    lib.op_layernorm_backward(ptr(dx), ptr(dw), ptr(db), ptr(f32(g)), ptr(f32(x)), ptr(f32(w)),
                              ptr(mean), ptr(rstd), N, H)
    close(dx, dx0 + X.grad.numpy(), what="layernorm dinp (+=)")
    close(dw, dw0 + Wt.grad.numpy(), what="layernorm dweight (+=)")
    close(db, db0 + g.sum(0), what="layernorm dbias (+=)")


# ---- RoPE (against transformers' Llama code) -----------------------------------------

ROPE_CASES = [
    # head_dim, theta, rope_scaling (None: default rope)
    (10, 10000.0, None),
    (16, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    (10, 10000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}),
    # YaRN as Qwen2.5 / Qwen3 configs give it (the attention factor from factor alone)
    (16, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    (128, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # ... and with every key it reads: truncate off, the betas, mscale and mscale_all_dim
    # (DeepSeek's), an explicit attention_factor, a factor below 1 (no scaling)
    (64, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False,
                   "beta_fast": 16.0, "beta_slow": 2.0}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                   "mscale_all_dim": 0.707}),
    (10, 500000.0, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
                    "attention_factor": 0.8}),
    (10, 10000.0, {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 256}),
    (12, 10000.0, {"rope_type": "linear", "factor": 4.0}),
]

TYPES = {"llama3": 1, "yarn": 2, "linear": 3}


def rope_params(theta, scaling):
    """kernels/ops.h's op_rope_params of a rope_parameters dict (None: the default rope)"""
    p = RopeParams(theta=theta, type=0, factor=1, low_freq_factor=1, high_freq_factor=1, original_max_pos=0)
    if scaling:
        s = dict(scaling)
        p.type, p.factor = TYPES[s.pop("rope_type")], s.pop("factor")
        p.original_max_pos = s.pop("original_max_position_embeddings", 0)
        p.no_truncate = not s.pop("truncate", True)
        for k, v in s.items():  # the type's other keys, by their names
            setattr(p, k, v)
    return p


def rope_tables(lib, emb, pos, rd, p):
    """inv_freq [rd/2] and the tables [T, rd] of the op, checked against transformers'
    rotary embedding module emb (whose rotated dims are rd); returns cos_t, sin_t."""
    T = len(pos)
    inv = np.empty(rd // 2, np.float32)
    lib.op_rope_inv_freq(ptr(inv), rd, ctypes.byref(p))
    np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=1e-6, err_msg="inv_freq")

    scale = lib.op_rope_scale(ctypes.byref(p))
    assert abs(scale - emb.attention_scaling) <= 1e-7 * emb.attention_scaling, (scale, emb.attention_scaling)
    cos_t, sin_t = np.empty((T, rd), np.float32), np.empty((T, rd), np.float32)
    lib.op_rope_table(ptr(cos_t), ptr(sin_t), ptr(pos), T, ptr(inv), rd, scale)
    cos_hf, sin_hf = emb(torch.zeros(1, dtype=torch.float32), torch.tensor(pos[None, :], dtype=torch.long))
    np.testing.assert_allclose(cos_t, cos_hf[0].numpy(), atol=2e-6, err_msg="cos table")
    np.testing.assert_allclose(sin_t, sin_hf[0].numpy(), atol=2e-6, err_msg="sin table")
    return cos_t, sin_t


@pytest.mark.parametrize("hd,theta,scaling", ROPE_CASES)
def test_rope(lib, hd, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    nh, B = 3, 2
    cfg = LlamaConfig(hidden_size=nh * hd, num_attention_heads=nh, num_key_value_heads=nh,
                      head_dim=hd, rope_parameters=dict(scaling or {"rope_type": "default"}, rope_theta=theta),
                      max_position_embeddings=8192)
    emb = LlamaRotaryEmbedding(config=cfg)
    # explicit, non-contiguous positions (a context-parallel rank's two chunks) and a
    # large one, where the fp32 angle itself is coarse
    pos = i32([0, 1, 2, 3, 4, 31, 32, 33, 34, 35, 7000])
    T = len(pos)

    cos_t, sin_t = rope_tables(lib, emb, pos, hd, rope_params(theta, scaling))

    # rotation: apply_rotary_pos_emb works on [B, nh, T, hd]; the op on [B, T, nh, hd]
    r = rng(4)
    x, g = r.standard_normal((B, T, nh, hd)), r.standard_normal((B, T, nh, hd))
    X = t64(x, True)
    c64, s64 = t64(cos_t)[None], t64(sin_t)[None]
    y, _ = apply_rotary_pos_emb(X.transpose(1, 2), X.transpose(1, 2), c64, s64)
    y = y.transpose(1, 2)
    (y * t64(g)).sum().backward()

    xr = f32(x)
    lib.op_rope_forward(ptr(xr), ptr(cos_t), ptr(sin_t), B, T, nh, hd, hd)
    close(xr, y, what="rope forward")
    gr = f32(g)
    lib.op_rope_backward(ptr(gr), ptr(cos_t), ptr(sin_t), B, T, nh, hd, hd)
    close(gr, X.grad, what="rope backward")


# ---- partial rotary (against transformers' GPT-NeoX code) ------------------------------

@pytest.mark.parametrize("hd,pct,base", [(16, 0.25, 10000.0), (20, 0.5, 10000.0), (12, 1.0, 500.0),
                                         (80, 0.25, 10000.0)])
def test_rope_partial(lib, hd, pct, base):
    """GPT-NeoX's rotary_pct: rotate the first rotary_ndims = int(head_dim * rotary_pct)
    dims of each head (rotate_half within them), pass the rest through."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    nh, B = 3, 2
    rd = int(hd * pct)
    cfg = GPTNeoXConfig(hidden_size=nh * hd, num_attention_heads=nh, rotary_pct=pct, rotary_emb_base=base,
                        max_position_embeddings=8192)
    emb = GPTNeoXRotaryEmbedding(config=cfg)
    pos = i32([0, 1, 2, 3, 31, 32, 33, 7000])
    T = len(pos)

    cos_t, sin_t = rope_tables(lib, emb, pos, rd, rope_params(base, None))

    # GPTNeoXAttention: q [B, nh, T, hd]; rotate q[..., :rd], cat the rest (float64 here)
    r = rng(12)
    x, g = r.standard_normal((B, T, nh, hd)), r.standard_normal((B, T, nh, hd))
    X = t64(x, True)
    q = X.transpose(1, 2)
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    y, _ = apply_rotary_pos_emb(q_rot, q_rot, t64(cos_t)[None], t64(sin_t)[None])
    y = torch.cat((y, q_pass), dim=-1).transpose(1, 2)
    (y * t64(g)).sum().backward()

    xr = f32(x)
    lib.op_rope_forward(ptr(xr), ptr(cos_t), ptr(sin_t), B, T, nh, hd, rd)
    close(xr, y, what="partial rope forward")
    np.testing.assert_array_equal(xr[..., rd:], f32(x)[..., rd:])  # passed through, to the bit
    gr = f32(g)
    lib.op_rope_backward(ptr(gr), ptr(cos_t), ptr(sin_t), B, T, nh, hd, rd)
    close(gr, X.grad, what="partial rope backward")


# ---- attention --------------------------------------------------------------------

def attention_ref(q, k, v, qpos, kpos, window, qdoc=None, kdoc=None):
    """float64 torch: q [B,Tq,nh,hd], k/v [B,Tk,nkv,hd] -> out [B,Tq,nh,hd], lse [B,nh,Tq].
    qdoc [B,Tq], kdoc [B,Tk]: document ids (None: one document); the mask is explicit,
    causal & window & same document."""
    nh, nkv, hd = q.shape[2], k.shape[2], q.shape[3]
    qh = q.transpose(1, 2)                                    # [B, nh, Tq, hd]
    kh = k.transpose(1, 2).repeat_interleave(nh // nkv, 1)    # HF repeat_kv: head h reads h // group
    vh = v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(hd)             # [B, nh, Tq, Tk]
    qp, kp = torch.tensor(qpos, dtype=torch.long)[:, None], torch.tensor(kpos, dtype=torch.long)[None, :]
    vis = kp <= qp
    if window > 0:
        vis = vis & (qp - kp < window)
    if qdoc is not None:                                      # [B, 1, Tq, Tk]
        qd, kd = torch.tensor(qdoc, dtype=torch.long), torch.tensor(kdoc, dtype=torch.long)
        vis = vis & (qd[:, None, :, None] == kd[:, None, None, :])
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)                              # -inf where nothing is visible
    p = torch.where(vis, torch.exp(s - lse.clamp_min(-1e300)[..., None]), torch.zeros(()).double())
    out = (p @ vh).transpose(1, 2)
    return out, lse


class Attn:
    """One attention problem: random q, k, v, dout and the torch reference."""

    def __init__(self, seed, B, Tq, Tk, nh, nkv, hd, qpos, kpos, window, qdoc=None, kdoc=None):
        r = rng(seed)
        self.dims = (B, Tq, Tk, nh, nkv, hd)
        self.qpos, self.kpos, self.window = i32(qpos), i32(kpos), window
        self.qdoc, self.kdoc = (None, None) if qdoc is None else (i32(qdoc), i32(kdoc))
        self.q = r.standard_normal((B, Tq, nh, hd)) * 1.5
        self.k = r.standard_normal((B, Tk, nkv, hd)) * 1.5
        self.v = r.standard_normal((B, Tk, nkv, hd))
        self.g = r.standard_normal((B, Tq, nh, hd))
        Q, K, Vt = t64(self.q, True), t64(self.k, True), t64(self.v, True)
        out, lse = attention_ref(Q, K, Vt, self.qpos, self.kpos, window, self.qdoc, self.kdoc)
        (out * t64(self.g)).sum().backward()
        self.out_ref, self.lse_ref = out.detach().numpy(), lse.detach().numpy()
        self.dq_ref, self.dk_ref, self.dv_ref = Q.grad.numpy(), K.grad.numpy(), Vt.grad.numpy()

    def forward(self, lib, k, v, kpos, kdoc=None):
        """kdoc: the documents of these keys (None: self.kdoc, or none)"""
        B, Tq, _, nh, nkv, hd = self.dims
        kdoc = self.kdoc if kdoc is None else i32(kdoc)
        out = np.full((B, Tq, nh, hd), np.nan, np.float32)
        lse = np.full((B, nh, Tq), np.nan, np.float32)
        lib.op_attention_forward(ptr(out), ptr(lse), ptr(f32(self.q)), ptr(f32(k)), ptr(f32(v)),
                                 ptr(self.qpos), ptr(i32(kpos)), ptr(self.qdoc), ptr(kdoc), B, Tq,
                                 len(kpos), nh, nkv, hd, self.window)
        return out, lse

    def backward(self, lib, k, v, kpos, out, lse, dq, dk, dv, kdoc=None):
        B, Tq, _, nh, nkv, hd = self.dims
        kdoc = self.kdoc if kdoc is None else i32(kdoc)
        lib.op_attention_backward(ptr(dq), ptr(dk), ptr(dv), ptr(f32(self.g)), ptr(f32(self.q)),
                                  ptr(f32(k)), ptr(f32(v)), ptr(out), ptr(lse), ptr(self.qpos),
                                  ptr(i32(kpos)), ptr(self.qdoc), ptr(kdoc), B, Tq, len(kpos), nh, nkv,
                                  hd, self.window)


def check_lse(lse, ref, what):
    dead = np.isneginf(ref)
    assert (np.isneginf(lse) == dead).all(), f"{what}: -inf rows differ"
    close(np.where(dead, 0, lse), np.where(dead, 0, ref), what=what)


def docs_of(pos, starts):
    """[B, T] document ids of positions pos: per sequence b, the largest of starts[b]
    (the first positions of its documents, sorted, starts[b][0] = 0) <= the position"""
    return [[max(s for s in st if s <= p) for p in pos] for st in starts]


ZIGZAG = list(range(8)) + list(range(24, 32))  # cp rank 0 of 2: chunks 0 and 3 of 4
# per sequence: the first positions of its documents (one-token documents at 3 and 27)
DOC_STARTS = [[0, 5, 26], [0, 3, 4, 20, 27, 28]]

ATTN_CASES = {
    # name: (B, Tq, Tk, nh, nkv, hd, qpos, kpos, window[, doc starts per sequence])
    "causal_gqa3": (2, 13, 13, 6, 2, 16, list(range(13)), list(range(13)), 0),
    "gaps_window": (1, 11, 11, 6, 3, 10, [0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34],
                    [0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34], 4),
    # q is the tail of the sequence (Tq != Tk), a query sees keys of its own block
    "q_tail": (2, 5, 17, 6, 6, 10, list(range(12, 17)), list(range(17)), 0),
    # the first queries precede every key: nothing visible, out 0 and lse -inf
    "none_visible": (1, 7, 9, 4, 2, 16, list(range(0, 14, 2)), list(range(5, 14)), 3),
    # packed documents, split differently per sequence, on a cp rank's two chunks
    "docs_zigzag": (2, 16, 16, 6, 2, 16, ZIGZAG, ZIGZAG, 0, DOC_STARTS),
    "docs_window": (2, 16, 16, 6, 3, 10, ZIGZAG, ZIGZAG, 3, DOC_STARTS),
    # keys of the other chunk: queries of a document that starts later see nothing
    "docs_none_visible": (2, 8, 8, 4, 2, 16, list(range(24, 32)), list(range(8)), 0, DOC_STARTS),
    # the C op's tiles (64 queries x 64 keys) at their edges: T not a multiple of the
    # tile, hd not one of the vector width, several tiles per side
    "tiles_ragged": (2, 150, 150, 4, 2, 5, list(range(150)), list(range(150)), 0),
    # a ring step: keys of the earlier chunk, Tq != Tk, every tile partly or fully seen
    "tiles_ring": (1, 70, 130, 4, 1, 33, list(range(130, 200)), list(range(130)), 0),
    # keys of a later chunk: the first queries see none (-inf rows inside a tile),
    # the last key tile none of the first query tile
    "tiles_ring_ahead": (1, 100, 90, 2, 2, 16, list(range(100)), list(range(60, 150)), 0),
    # a window smaller than a tile: tiles on the diagonal partial, far ones skipped
    "tiles_window": (1, 200, 200, 4, 2, 33, list(range(200)), list(range(200)), 7),
    # a head dim past the one whose query tile the forward transposes (QT_HD_MAX = 256):
    # the scores as a transposed product instead
    "wide_head": (1, 70, 70, 2, 1, 260, list(range(70)), list(range(70)), 0),
    # a cp rank's two chunks of 70, documents that start and end inside tiles
    "tiles_docs_zigzag": (2, 140, 140, 6, 3, 16, list(range(70)) + list(range(210, 280)),
                          list(range(70)) + list(range(210, 280)), 0,
                          [[0, 37, 64, 65, 100, 230], [0, 90, 250]]),
    "tiles_docs_window": (2, 140, 140, 2, 1, 5, list(range(140)), list(range(140)), 40,
                          [[0, 37, 64, 65, 100], [0, 130]]),
    # the backward's one-pass form (B * nkv = 2 tasks: taken by 1 and 2 threads) takes
    # the keys in runs whose rows it packs (4 MiB of k, v, dk, dv rows: 1024 keys at hd
    # 256): two runs, the second partial
    "key_runs": (1, 1100, 1100, 4, 2, 256, list(range(1100)), list(range(1100)), 0),
    # runs of 1280 keys (hd 200) in a ring step (Tq != Tk) with a window: query tiles
    # that see no key of a run, runs that end inside the window
    "key_runs_ring_window": (1, 200, 1400, 4, 2, 200, list(range(1400, 1600)), list(range(1400)), 700),
    # the forward's out rows added up packed (hd <= 32, 8 key tiles or more)
    "out_packed": (2, 530, 530, 4, 2, 32, list(range(530)), list(range(530)), 0, [[0, 300], [0]]),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention(lib, case):
    B, Tq, Tk, nh, nkv, hd, qpos, kpos, window, *starts = ATTN_CASES[case]
    docs = (docs_of(qpos, starts[0]), docs_of(kpos, starts[0])) if starts else (None, None)
    a = Attn(5, B, Tq, Tk, nh, nkv, hd, qpos, kpos, window, *docs)
    out, lse = a.forward(lib, a.k, a.v, a.kpos)
    close(out, a.out_ref, what="attention out")
    check_lse(lse, a.lse_ref, "attention lse")
    if "none_visible" in case:
        assert np.isneginf(a.lse_ref).any() and not np.isneginf(a.lse_ref).all()
    if starts:  # the documents hide pairs that positions alone would show
        plain = attention_ref(t64(a.q), t64(a.k), t64(a.v), a.qpos, a.kpos, window)[1].numpy()
        assert (np.isneginf(a.lse_ref) | (np.abs(a.lse_ref - plain) > 1e-6)).any()

    dq0, dk0, dv0 = (rng(6).standard_normal(x.shape) for x in (a.q, a.k, a.v))
    dq, dk, dv = f32(dq0), f32(dk0), f32(dv0)
    a.backward(lib, a.k, a.v, a.kpos, out, lse, dq, dk, dv)
    close(dq, dq0 + a.dq_ref, what="attention dq (+=)")
    close(dk, dk0 + a.dk_ref, what="attention dk (+=)")
    close(dv, dv0 + a.dv_ref, what="attention dv (+=)")


@pytest.mark.parametrize("case", ["tiles_docs_zigzag", "key_runs_ring_window"])
def test_attention_threads_bit_identical(lib, case):
    """Each output row is summed by one thread in a fixed order: 1, 3 and 4 OpenMP
    threads give the same bits, forward and backward (tiles_docs_zigzag's B * nkv = 6 kv
    heads: one pass for 1 and 3 threads, the two-pass form for 4; key_runs_ring_window's
    two: one pass, in runs of keys, for 1 thread, the two-pass form for 3 and 4)."""
    omp = ctypes.CDLL("libgomp.so.1")
    B, Tq, Tk, nh, nkv, hd, qpos, kpos, window, *starts = ATTN_CASES[case]
    docs = (docs_of(qpos, starts[0]), docs_of(kpos, starts[0])) if starts else (None, None)
    a = Attn(9, B, Tq, Tk, nh, nkv, hd, qpos, kpos, window, *docs)
    runs = []
    try:
        for threads in (1, 3, 4):
            omp.omp_set_num_threads(threads)
            out, lse = a.forward(lib, a.k, a.v, a.kpos)
            grads = [np.zeros(x.shape, np.float32) for x in (a.q, a.k, a.v)]
            a.backward(lib, a.k, a.v, a.kpos, out, lse, *grads)
            runs.append([out, lse] + grads)
    finally:
        omp.omp_set_num_threads(os.cpu_count())
    for run in runs[1:]:
        for x, y in zip(runs[0], run):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,T,hd", [(1, 100, 0), (1, 0, 32), (0, 10, 8)])
def test_attention_empty(lib, threads, B, T, hd):
    """Nothing to compute (a head dim of 0, no tokens, no sequences): both ops return,
    touching nothing, under the one-pass backward (1 thread) and the two-pass one (2;
    B * nkv = 1). The one-pass form's runs of keys divided by hd once (SIGFPE)."""
    omp = ctypes.CDLL("libgomp.so.1")
    nh, nkv = 2, 1
    q = np.full((max(B, 1), max(T, 1), nh, max(hd, 1)), 7.0, np.float32)
    k = np.full((max(B, 1), max(T, 1), nkv, max(hd, 1)), 7.0, np.float32)
    lse = np.full((max(B, 1), nh, max(T, 1)), 7.0, np.float32)
    pos = np.arange(max(T, 1), dtype=np.int32)
    grads = [np.full(x.shape, 7.0, np.float32) for x in (q, k, k)]
    try:
        omp.omp_set_num_threads(threads)
        lib.op_attention_forward(ptr(q), ptr(lse), ptr(q), ptr(k), ptr(k), ptr(pos), ptr(pos), None, None,
                                 B, T, T, nh, nkv, hd, 0)
        lib.op_attention_backward(*(ptr(g) for g in grads), ptr(q), ptr(q), ptr(k), ptr(k), ptr(q), ptr(lse),
                                  ptr(pos), ptr(pos), None, None, B, T, T, nh, nkv, hd, 0)
    finally:
        omp.omp_set_num_threads(os.cpu_count())
    if B == 0 or T == 0:  # no rows: nothing written
        assert all((x == 7.0).all() for x in [q, lse] + grads)


@pytest.mark.parametrize("window,docs", [(0, False), (5, False), (0, True)])
def test_attention_two_kv_blocks(lib, window, docs):
    """Ring attention's step: each kv half alone, merged by lse, equals the full
    attention; the backward of each half (from the final out and lse) sums to the
    full backward."""
    B, T, nh, nkv, hd = 2, 15, 6, 3, 10
    pos = list(range(3, 3 + T))
    doc = np.array(docs_of(pos, [[0, 9], [0, 6, 7, 12]])) if docs else None
    a = Attn(7, B, T, T, nh, nkv, hd, pos, pos, window, doc, doc)
    cut = 8  # queries before the cut see nothing of the second half: -inf partials
    kd = [None, None] if doc is None else [doc[:, :cut], doc[:, cut:]]
    halves = [(a.k[:, :cut], a.v[:, :cut], a.kpos[:cut], kd[0]),
              (a.k[:, cut:], a.v[:, cut:], a.kpos[cut:], kd[1])]

    out, lse = a.forward(lib, *halves[0])
    out2, lse2 = a.forward(lib, *halves[1])
    assert np.isneginf(lse2).any(), "the split should leave rows with nothing visible"
    if window:
        assert np.isneginf(lse).any()
    lib.op_attention_merge(ptr(out), ptr(lse), ptr(out2), ptr(lse2), B, T, nh, hd)
    close(out, a.out_ref, what="merged out")
    check_lse(lse, a.lse_ref, "merged lse")

    # merging in the other order gives the same
    o_b, l_b = a.forward(lib, *halves[1])
    o_a, l_a = a.forward(lib, *halves[0])
    lib.op_attention_merge(ptr(o_b), ptr(l_b), ptr(o_a), ptr(l_a), B, T, nh, hd)
    close(o_b, a.out_ref, what="merged out, other order")

    dq = np.zeros(a.q.shape, np.float32)
    dks, dvs = [], []
    for k, v, kpos, kdoc in halves:
        dk, dv = np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
        a.backward(lib, np.ascontiguousarray(k), np.ascontiguousarray(v), kpos, out, lse, dq, dk, dv, kdoc)
        dks.append(dk)
        dvs.append(dv)
    close(dq, a.dq_ref, what="dq summed over kv blocks")
    close(np.concatenate(dks, 1), a.dk_ref, what="dk of the two blocks")
    close(np.concatenate(dvs, 1), a.dv_ref, what="dv of the two blocks")


# ---- SwiGLU ---------------------------------------------------------------------

def test_swiglu(lib):
    r = rng(8)
    n = 7 * 33
    gate, up, g = r.standard_normal(n) * 4, r.standard_normal(n), r.standard_normal(n)
    G, U = t64(gate, True), t64(up, True)
    y = F.silu(G) * U
    (y * t64(g)).sum().backward()

    out = np.empty(n, np.float32)
    lib.op_swiglu_forward(ptr(out), ptr(f32(gate)), ptr(f32(up)), n)
    close(out, y, what="swiglu forward")
    dg0, du0 = r.standard_normal(n), r.standard_normal(n)
    dg, du = f32(dg0), f32(du0)
    lib.op_swiglu_backward(ptr(dg), ptr(du), ptr(f32(g)), ptr(f32(gate)), ptr(f32(up)), n)
    close(dg, dg0 + G.grad.numpy(), what="swiglu dgate (+=)")
    close(du, du0 + U.grad.numpy(), what="swiglu dup (+=)")


# ---- GELU (exact, GPT-NeoX's hidden_act "gelu") ---------------------------------------

def test_gelu(lib):
    r = rng(14)
    n = 7 * 33
    x, g = r.standard_normal(n) * 4, r.standard_normal(n)
    X = t64(x, True)
    y = F.gelu(X)  # approximate="none": the erf form
    (y * t64(g)).sum().backward()

    out = np.full(n, np.nan, np.float32)
    lib.op_gelu_forward(ptr(out), ptr(f32(x)), n)
    close(out, y, what="gelu forward")
    # not the tanh approximation ("gelu_new"): at these inputs it differs by more than the tolerance
    assert np.abs(out - F.gelu(X, approximate="tanh").detach().numpy()).max() > 1e-4
    dx0 = r.standard_normal(n)
    dx = f32(dx0)
    lib.op_gelu_backward(ptr(dx), ptr(f32(g)), ptr(f32(x)), n)
    close(dx, dx0 + X.grad.numpy(), what="gelu dinp (+=)")


# ---- vocab-parallel cross-entropy (tp=2 simulated) --------------------------------

def test_xent_vocab_parallel(lib):
    r = rng(9)
    N, V = 9, 37
    logits = r.standard_normal((N, V)) * 6
    targets = i32([0, 18, 19, 36, -1, 5, 25, -1, 19])
    shards = [(0, 19), (19, 18)]  # uneven: (vocab_start, Vl)

    L = t64(logits, True)
    ref_losses = F.cross_entropy(L, torch.tensor(targets, dtype=torch.long), ignore_index=-1,
                                 reduction="none")
    valid = int((targets >= 0).sum())
    (ref_losses.sum() / valid).backward()  # the mean over counted rows

    parts = [f32(logits[:, s:s + vl]) for s, vl in shards]
    # step 1 on each rank; step 2: the caller's all-reduces (max; sum)
    stats = []
    for (s, vl), lg in zip(shards, parts):
        rowmax, tl = np.empty(N, np.float32), np.empty(N, np.float32)
        lib.op_xent_rowmax(ptr(rowmax), ptr(tl), ptr(lg), ptr(targets), N, vl, s)
        stats.append((rowmax, tl))
    rowmax = f32(np.max([st[0] for st in stats], 0))
    target_logit = f32(np.sum([st[1] for st in stats], 0))
    close(rowmax, logits.astype(np.float32).max(1), what="global row max")
    # step 3: sum of exp on each rank, all-reduced by sum
    sumexp = np.zeros(N, np.float32)
    for (s, vl), lg in zip(shards, parts):
        se = np.empty(N, np.float32)
        lib.op_xent_sumexp(ptr(se), ptr(lg), ptr(rowmax), N, vl)
        sumexp += se
    losses = np.full(N, np.nan, np.float32)
    total = lib.op_xent_loss(ptr(losses), ptr(rowmax), ptr(sumexp), ptr(target_logit),
                             ptr(targets), N)
    close(losses, ref_losses, what="per-row losses")
    assert (losses[targets < 0] == 0).all()
    assert abs(total - ref_losses.sum().item()) <= TOL * abs(ref_losses.sum().item())

    dparts = []
    for (s, vl), lg in zip(shards, parts):
        d = np.full((N, vl), np.nan, np.float32)  # written, not accumulated
        lib.op_xent_backward(ptr(d), ptr(lg), ptr(rowmax), ptr(sumexp), ptr(targets), N, vl, s,
                             1.0 / valid)
        dparts.append(d)
    dlogits = np.concatenate(dparts, 1)
    close(dlogits, L.grad, what="dlogits")
    assert (dlogits[targets < 0] == 0).all()


# ---- AdamW ------------------------------------------------------------------------

def test_adamw_vs_torch(lib):
    r = rng(10)
    n = 7 * 33
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    p0 = r.standard_normal(n)
    grads = [r.standard_normal(n) * s for s in (1.0, 0.1, 3.0)]

    P_ = t64(p0, True)
    opt = torch.optim.AdamW([P_], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    param, m, v = f32(p0), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step, g in enumerate(grads, start=1):
        P_.grad = t64(g)
        opt.step()
        lib.op_adamw(ptr(param), ptr(f32(g)), ptr(m), ptr(v), n, lr, b1, b2, eps, wd, step)
        st = opt.state[P_]
        close(param, P_, what=f"param after step {step}")
        close(m, st["exp_avg"], what=f"m after step {step}")
        close(v, st["exp_avg_sq"], what=f"v after step {step}")


# ---- reductions --------------------------------------------------------------------

def test_reductions(lib):
    r = rng(11)
    n = 100_003
    x = f32(r.standard_normal(n) * 10)
    got = lib.op_sumsq(ptr(x), n)
    ref = float(np.sum(x.astype(np.float64) ** 2))
    assert abs(got - ref) <= 1e-12 * ref
    assert lib.op_sumsq(ptr(x), 0) == 0.0

    assert lib.op_amax(ptr(x), n) == np.abs(x).max()
    x[77_777] = -1e6
    assert lib.op_amax(ptr(x), n) == np.float32(1e6)
    for at in (0, 50_001, n - 1):  # NaN propagates from any thread's part
        y = x.copy()
        y[at] = np.nan
        assert math.isnan(lib.op_amax(ptr(y), n)), f"NaN at {at} lost"

    s = np.float32(0.37)
    y = x.copy()
    lib.op_scale(ptr(y), s, n)
    np.testing.assert_array_equal(y, x * s)  # one fp32 multiply: exact


# ---- FP8 ---------------------------------------------------------------------------

FP8 = {OP_FP8_E4M3: (ml_dtypes.float8_e4m3fn, 448.0), OP_FP8_E5M2: (ml_dtypes.float8_e5m2, 57344.0)}


def fp8_ref(x, scale, fmt):
    dt, mx = FP8[fmt]
    xs = x * np.float32(scale)  # fp32 product, as the op
    return np.clip(xs, -mx, mx).astype(dt)


@pytest.mark.parametrize("fmt", [OP_FP8_E4M3, OP_FP8_E5M2])
def test_fp8_quantize(lib, fmt):
    r = rng(12)
    n = 10_007  # more than one chunk per thread
    # normal values over many binades, saturating values, subnormals, zeros, ties
    x = r.standard_normal(n) * np.exp2(r.integers(-20, 18, n))
    x[:6] = [0.0, -0.0, 1e9, -1e9, 1e-12, -1e-12]
    x = f32(x)
    for scale in (1.0, 0.75, 64.0):
        q = np.empty(n, np.uint8)
        amax = np.array([np.nan], np.float32)
        lib.op_fp8_quantize(ptr(q), ptr(amax), ptr(x), n, scale, fmt)
        ref = fp8_ref(x, scale, fmt)
        np.testing.assert_array_equal(q, ref.view(np.uint8), err_msg=f"fp8 bytes, scale {scale}")
        assert amax[0] == np.abs(x).max()

        # dequantize: x = value * (1 / scale), both roundings in fp32: exact
        back = np.empty(n, np.float32)
        lib.op_fp8_dequantize(ptr(back), ptr(q), n, scale, fmt)
        inv = np.float32(1) / np.float32(scale)
        np.testing.assert_array_equal(back, ref.astype(np.float32) * inv)

    # NaN stays NaN and makes amax NaN; amax may be NULL
    y = x.copy()
    y[4321] = np.nan
    q = np.empty(n, np.uint8)
    amax = np.zeros(1, np.float32)
    lib.op_fp8_quantize(ptr(q), ptr(amax), ptr(y), n, 1.0, fmt)
    assert math.isnan(amax[0])
    dt = FP8[fmt][0]
    assert np.isnan(q[4321:4322].view(dt).astype(np.float32))[0]
    lib.op_fp8_quantize(ptr(q), None, ptr(x), n, 1.0, fmt)
    np.testing.assert_array_equal(q, fp8_ref(x, 1.0, fmt).view(np.uint8))


@pytest.mark.parametrize("fmt", [OP_FP8_E4M3, OP_FP8_E5M2])
def test_fp8_dequantize_every_pattern(lib, fmt):
    dt = FP8[fmt][0]
    q = np.arange(256, dtype=np.uint8)
    vals = q.view(dt).astype(np.float32)
    x = np.empty(256, np.float32)
    lib.op_fp8_dequantize(ptr(x), ptr(q), 256, 1.0, fmt)
    nan = np.isnan(vals)
    np.testing.assert_array_equal(np.isnan(x), nan)
    np.testing.assert_array_equal(x[~nan], vals[~nan])


def test_linear_forward_fp8(lib):
    r = rng(13)
    N, IN, OUT = 7, 33, 19
    x, w = f32(r.standard_normal((N, IN)) * 3), f32(r.standard_normal((OUT, IN)) * 0.05)
    s_in, s_w = 448.0 / np.abs(x).max() * 0.5, 448.0 / np.abs(w).max()
    xd = fp8_ref(x, s_in, OP_FP8_E4M3).astype(np.float64) / np.float64(np.float32(s_in))
    wd = fp8_ref(w, s_w, OP_FP8_E4M3).astype(np.float64) / np.float64(np.float32(s_w))
    ref = t64(xd) @ t64(wd).T

    scratch = np.empty((N + OUT) * IN, np.float32)  # OP_LINEAR_FP8_SCRATCH_BYTES
    out = np.full((N, OUT), np.nan, np.float32)
    lib.op_linear_forward_fp8(ptr(out), ptr(x), ptr(w), N, IN, OUT, s_in, s_w, ptr(scratch))
    close(out, ref, what="fp8 linear")
    # and it differs from the fp32 product: the quantization is really applied
    assert np.abs(out - x @ w.T).max() > 1e-3
