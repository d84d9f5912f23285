"""libshard's float conversions against ml_dtypes / numpy, bit for bit."""
import ml_dtypes
import numpy as np
import pytest
from conftest import DT

NP = dict(F8_E4M3=ml_dtypes.float8_e4m3fn, F8_E5M2=ml_dtypes.float8_e5m2, F16=np.float16,
          BF16=ml_dtypes.bfloat16, F32=np.float32, F64=np.float64)
SMALL = ["F8_E4M3", "F8_E5M2", "F16", "BF16"]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a):
    return a.view(UINT[a.dtype.itemsize])


def convert(shard, a, src, dst):
    a = np.ascontiguousarray(a)
    out = np.zeros(a.shape, dtype=NP[dst])
    assert shard.shard_convert(out.ctypes.data, DT[dst], a.ctypes.data, DT[src], a.size) == 0
    return out


def every_pattern(name):
    nb = np.dtype(NP[name]).itemsize * 8
    return np.arange(2 ** nb, dtype=UINT[nb // 8]).view(NP[name])


def f32_sweep():
    rng = np.random.default_rng(1234)
    hi = np.arange(0, 2 ** 20, dtype=np.uint32) << 12
    parts = [
        rng.integers(0, 2 ** 32, 3_000_000, dtype=np.uint64).astype(np.uint32),  # anything at all
        hi, hi | 0x800, hi | 0x7FF, hi | 0x801,       # exact ties and neighbours for 12 dropped bits
        (np.arange(0, 2 ** 16, dtype=np.uint32) << 16) | 0x8000,  # bf16 ties
        (np.arange(0, 2 ** 16, dtype=np.uint32) << 16) | 0x7FFF,
        np.arange(0, 2 ** 16, dtype=np.uint32),        # f32 subnormals
        np.array([0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFC00001, 0x7FBFFFFF,
                  0x7F7FFFFF, 0xFF7FFFFF, 0x477FF000, 0x477FE000, 0x43E00000, 0x43F00000,
                  0x47600000, 0x47700000, 0x80000000, 0], dtype=np.uint32),  # inf, NaN, overflow edges
    ]
    return np.concatenate(parts).view(np.float32)


@pytest.mark.parametrize("name", SMALL)
def test_every_pattern_to_f32(shard, name):
    src = every_pattern(name)
    ref = src.astype(np.float32)
    got = convert(shard, src, name, "F32")
    assert np.array_equal(bits(ref), bits(got))


@pytest.mark.parametrize("lead", [0, 1, 2, 3, 5])
def test_uncached_bf16_to_f32(shard, lead):
    """shard_convert_uncached's streamed stores: every bf16 pattern, into a destination
    starting at each 4-byte step of a 16-byte line and from a source one element off,
    the same bits as ml_dtypes, and nothing written outside the destination."""
    for shift in (0, 1):
        src = every_pattern("BF16")[shift:]
        out = np.full(src.size + 8, np.nan, dtype=np.float32)
        st = shard.shard_convert_uncached(out[lead:].ctypes.data, DT["F32"], src.ctypes.data, DT["BF16"], src.size)
        assert st == 0
        assert np.array_equal(bits(out[lead:lead + src.size]), bits(src.astype(np.float32)))
        assert np.isnan(out[:lead]).all() and np.isnan(out[lead + src.size:]).all()


def test_uncached_lengths_and_odd_addresses(shard):
    """Runs shorter than the streamed threshold, tails of every length, a destination
    not even 4-byte aligned, and the pairs that are not streamed: shard_convert's bytes."""
    src = every_pattern("BF16")[::7].copy()
    for n in (0, 1, 7, 511, 512, 513, 519, 520, 4099, src.size):
        for byte_lead in (0, 1, 4, 6):
            out = np.zeros(4 * n + 16, dtype=np.uint8)
            st = shard.shard_convert_uncached(out[byte_lead:].ctypes.data, DT["F32"], src.ctypes.data, DT["BF16"], n)
            assert st == 0
            want = src[:n].astype(np.float32).view(np.uint8)
            assert np.array_equal(out[byte_lead:byte_lead + 4 * n], want), (n, byte_lead)
            assert not out[:byte_lead].any() and not out[byte_lead + 4 * n:].any()
    for s, d in (("F16", "F32"), ("F32", "BF16"), ("BF16", "F16")):
        a = every_pattern(s) if s != "F32" else f32_sweep()[:100_000]
        out = np.zeros(a.shape, dtype=NP[d])
        with np.errstate(all="ignore"):
            assert shard.shard_convert_uncached(out.ctypes.data, DT[d], a.ctypes.data, DT[s], a.size) == 0
        assert np.array_equal(bits(out), bits(convert(shard, a, s, d)))


@pytest.mark.parametrize("name", SMALL + ["F64"])
def test_f32_sweep(shard, name):
    f = f32_sweep()
    with np.errstate(all="ignore"):
        ref = f.astype(NP[name])
    got = convert(shard, f, "F32", name)
    bad = bits(ref) != bits(got)
    assert not bad.any(), f"{bad.sum()} mismatches, first inputs {bits(f)[bad][:5]}"


@pytest.mark.parametrize("src,dst", [(s, d) for s in SMALL for d in SMALL if s != d])
def test_every_pattern_between_small_types(shard, src, dst):
    a = every_pattern(src)
    with np.errstate(all="ignore"):
        ref = a.astype(np.float32).astype(NP[dst])  # exact: every small value is an f32
    got = convert(shard, a, src, dst)
    assert np.array_equal(bits(ref), bits(got))


@pytest.mark.parametrize("dst", ["F16", "F8_E4M3", "F8_E5M2", "F32"])
def test_f64_rounds_once_like_the_reference(shard, dst):
    rng = np.random.default_rng(5)
    d = np.concatenate([rng.standard_normal(500_000) * np.exp(rng.uniform(-40, 40, 500_000)),
                        rng.integers(0, 2 ** 64, 500_000, dtype=np.uint64).view(np.float64)])
    with np.errstate(all="ignore"):
        ref = d.astype(NP[dst])
    assert np.array_equal(bits(ref), bits(convert(shard, d, "F64", dst)))


def test_f64_to_bf16_is_correctly_rounded(shard):
    # ml_dtypes goes through float32 (two roundings); we round once. Where the f64
    # value is an f32 the two agree; elsewhere compare with an exact reference.
    rng = np.random.default_rng(6)
    f = rng.standard_normal(200_000).astype(np.float32).astype(np.float64)
    assert np.array_equal(bits(f.astype(ml_dtypes.bfloat16)), bits(convert(shard, f, "F64", "BF16")))
    from fractions import Fraction
    # a value just above a bf16 tie, that rounds down to the tie when first cast to f32
    x = 1.0 + 2.0 ** -8 + 2.0 ** -40
    got = convert(shard, np.array([x]), "F64", "BF16").astype(np.float64)[0]
    cands = [1.0, 1.0 + 2.0 ** -7]
    best = min(cands, key=lambda c: abs(Fraction(c) - Fraction(x)))
    assert got == best == 1.0 + 2.0 ** -7


@pytest.mark.parametrize("name,mx", [("F8_E4M3", 448.0), ("F8_E5M2", 57344.0)])
def test_saturating_quantizer(shard, name, mx):
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 300,
                        np.array([np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, np.nan], dtype=np.float32)])
    for scale in [1.0, 0.37, 12.5, 2.0 ** -7]:
        q = np.zeros(x.size, dtype=np.uint8)
        amax = shard.shard_fp8_quantize(q.ctypes.data, x.ctypes.data, x.size, scale, DT[name])
        with np.errstate(all="ignore"):
            ref = np.clip(x * np.float32(scale), -mx, mx).astype(NP[name])
        assert np.array_equal(ref.view(np.uint8), q)
        assert np.isnan(amax)  # the NaN input propagates into amax
        amax2 = shard.shard_fp8_quantize(q.ctypes.data, x[:-1].ctypes.data, x.size - 1, scale, DT[name])
        assert amax2 == np.inf
        back = np.zeros(x.size, dtype=np.float32)
        shard.shard_fp8_dequantize(back.ctypes.data, q.ctypes.data, x.size, scale, DT[name])
        # dequantize multiplies by the inverse scale, as TransformerEngine's scale_inv does
        inv = np.float32(1) / np.float32(scale)
        assert np.array_equal(back, ref.astype(np.float32) * inv, equal_nan=True)
    finite = x[np.isfinite(x)][:1000]
    q = np.zeros(finite.size, dtype=np.uint8)
    amax = shard.shard_fp8_quantize(q.ctypes.data, finite.ctypes.data, finite.size, 1.0, DT[name])
    assert amax == np.abs(finite).max()
