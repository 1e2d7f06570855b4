"""Tests for dsv41.codecs: packed KV records, QDQ twins and element codecs (docs/model.md §3.3-3.6, §9, §10).

The independent reference below re-implements the docs/model.md formulas with numpy fp32 arithmetic and the
``ml_dtypes`` casts (float8_e4m3fn, float4_e2m1fn, float8_e8m0fnu); the power-of-two ceiling uses
``np.frexp`` instead of the bit trick. ml_dtypes' e4m3 cast maps overflow to NaN, so the reference clamps
to +-448 first (saturation), exactly as the spec says.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dsv41.codecs as C
from dsv41.codecs.fp8 import pow2

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu

HYP = settings(max_examples=60, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------------------------------------
# independent numpy / ml_dtypes reference
# ----------------------------------------------------------------------------------------------------------


def _ref_pow2_ceil(y: np.ndarray) -> np.ndarray:
    """2^ceil(log2 y) for positive normal fp32 y, via frexp (y = m * 2^e, m in [0.5, 1))."""
    m, e = np.frexp(y.astype(np.float64))
    k = np.where(m == 0.5, e - 1, e)
    return np.ldexp(1.0, k).astype(F32)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def ref_swa(x: np.ndarray):
    """docs/model.md §3.3. Returns (packed bytes, decoded fp32)."""
    n, d = x.shape
    g = x.reshape(n, d // 32, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), F32(1e-4))
    s = _ref_pow2_ceil(amax * F32(1.0 / 448.0))
    q = np.clip(g / s, -448, 448).astype(E4M3)
    vals = (q.astype(F32) * s).reshape(n, d)
    packed = np.concatenate([q.view(np.uint8).reshape(n, d), s.astype(E8M0).view(np.uint8).reshape(n, -1)], -1)
    return packed, vals


def ref_main(x: np.ndarray):
    """docs/model.md §3.4. Returns (packed bytes, decoded fp32)."""
    n, d = x.shape
    g = x.reshape(n, d // 16, 16)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), F32(6 * 2.0**-9))
    s8 = np.clip(amax / F32(6), -448, 448).astype(E4M3)
    s = s8.astype(F32)
    q = np.clip(g / s, -6, 6).astype(E2M1)
    vals = (q.astype(F32) * s).reshape(n, d)
    packed = np.concatenate([_nibbles(q.view(np.uint8).reshape(n, d)), s8.view(np.uint8).reshape(n, -1)], -1)
    return packed, vals


def ref_index(x: np.ndarray):
    """docs/model.md §3.6. Returns (packed bytes, decoded fp32)."""
    n, d = x.shape
    g = x.reshape(n, d // 32, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), F32(6 * 2.0**-126))
    s = _ref_pow2_ceil(amax * F32(1.0 / 6.0))
    q = np.clip(g / s, -6, 6).astype(E2M1)
    vals = (q.astype(F32) * s).reshape(n, d)
    scale_bytes = s.astype(E8M0).view(np.uint8).reshape(n, -1)
    packed = np.concatenate([_nibbles(q.view(np.uint8).reshape(n, d)), scale_bytes], -1)
    return packed, vals


FORMATS = {
    # name: (pack, unpack, qdq, reference, group, bytes(d))
    "swa": (C.pack_swa_kv, C.unpack_swa_kv, C.qdq_fp8, ref_swa, 32, C.swa_kv_bytes),
    "main": (C.pack_main_kv, C.unpack_main_kv, C.qdq_main_kv, ref_main, 16, C.main_kv_bytes),
    "index": (C.pack_index_k, C.unpack_index_k, C.qdq_index_k, ref_index, 32, C.index_k_bytes),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (so -0.0 != +0.0 and NaN == NaN of the same payload)."""
    return t.float().contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def mixed_input(rng: np.random.Generator, rows: int, d: int, group: int) -> np.ndarray:
    """Rows of fp32 values mixing distributions, per-group magnitudes from 2^-40 to 2^40, exact zeros,
    -0.0, bf16-rounded values (ties are frequent) and groups made of exact format midpoints."""
    x = rng.standard_normal((rows, d)).astype(F32)
    kind = rng.integers(0, 6, size=rows)
    x[kind == 1] = rng.uniform(-1, 1, size=(int((kind == 1).sum()), d)).astype(F32)
    x[kind == 2] = (rng.standard_cauchy(size=(int((kind == 2).sum()), d)) * 0.1).astype(F32)
    heavy = kind == 3  # sparse rows: mostly zeros / signed zeros with a few outliers
    sparse = rng.standard_normal((int(heavy.sum()), d)).astype(F32)
    sparse[rng.random(sparse.shape) < 0.7] = 0.0
    sparse[rng.random(sparse.shape) < 0.2] = -0.0
    x[heavy] = sparse
    exps = rng.integers(-40, 41, size=(rows, d // group, 1)).astype(F32)
    x = (x.reshape(rows, d // group, group) * np.exp2(exps)).reshape(rows, d).astype(F32)
    bf = kind == 4  # round to bf16: many exact E4M3 / E2M1 midpoints after a power-of-two scale
    x[bf] = torch.from_numpy(x[bf]).bfloat16().float().numpy()
    x[kind == 5] = midpoint_rows(rng, int((kind == 5).sum()), d, group)
    return x


def midpoint_rows(rng: np.random.Generator, rows: int, d: int, group: int) -> np.ndarray:
    """Groups whose first element fixes a simple scale and whose other elements sit on E2M1 midpoints
    and grid points (for FP4) or E4M3 midpoints (useful for FP8), times a random power of two."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.0], dtype=F32)
    shape = (rows, d // group, group)
    g = rng.choice(mids, size=shape) * rng.choice(np.array([-1, 1], dtype=F32), size=shape)
    g[..., 0] = 6.0
    k = rng.integers(-30, 31, size=(rows, d // group, 1)).astype(F32)
    return (g * np.exp2(k)).reshape(rows, d).astype(F32)


# ----------------------------------------------------------------------------------------------------------
# sizes, shapes, layout
# ----------------------------------------------------------------------------------------------------------


def test_record_sizes():
    assert (C.main_kv_bytes(512), C.index_k_bytes(128), C.swa_kv_bytes(512)) == (288, 68, 528)
    assert (C.main_kv_bytes(64), C.index_k_bytes(64), C.swa_kv_bytes(64)) == (36, 34, 66)
    assert (C.main_kv_bytes(32), C.index_k_bytes(32), C.swa_kv_bytes(32)) == (18, 17, 33)
    for f, bad in [(C.main_kv_bytes, 24), (C.index_k_bytes, 48), (C.swa_kv_bytes, 16), (C.main_kv_bytes, 0)]:
        with pytest.raises(ValueError):
            f(bad)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("d", [32, 64, 128, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_shape_dtype_and_round_trip(name, d, dtype):
    pack, unpack, qdq, _, _, nbytes = FORMATS[name]
    gen = torch.Generator().manual_seed(d)
    for scale in [2.0**-100, 1e-6, 1e-3, 1.0, 37.0, 1e5, 1e30]:
        x = (torch.randn(2, 3, d, generator=gen) * scale).to(dtype)
        p = pack(x)
        assert p.dtype == torch.uint8 and p.shape == (2, 3, nbytes(d))
        u = unpack(p)
        assert u.dtype == torch.float32 and u.shape == x.shape
        y = qdq(x)
        assert y.dtype == dtype and y.shape == x.shape
        # bit-equal to the fp32 unpack: so the cast to the input dtype (bf16 too) lost nothing
        assert same_bits(u, y), (name, d, scale)


@pytest.mark.parametrize("name", list(FORMATS))
def test_bad_shapes(name):
    pack, unpack, qdq, _, group, nbytes = FORMATS[name]
    with pytest.raises(ValueError):
        pack(torch.zeros(3, group + 8))
    with pytest.raises(ValueError):
        qdq(torch.zeros(3, group // 2))
    with pytest.raises(ValueError):
        unpack(torch.zeros(3, nbytes(group * 2) + 1, dtype=torch.uint8))


def test_byte_layout_main_kv():
    x = torch.zeros(512)
    x[0], x[1], x[2], x[3] = 6.0, 0.5, -1.0, -0.0  # group 0: amax 6 -> scale e4m3(1.0)
    x[16:32] = 0.0  # group 1: all zero -> amax floor -> scale 2^-9 (byte 0x01)
    x[496], x[511] = 3.0 * 448, -1.5 * 448  # last group: amax/6 = 224 -> scale 224 (0x76)
    p = C.pack_main_kv(x)
    assert p[0].item() == 0x7 | (0x1 << 4)  # channel 0 (code 7) low nibble, channel 1 (code 1) high
    assert p[1].item() == 0xA | (0x8 << 4)  # -1.0 -> 0b1010, -0.0 -> 0b1000
    assert torch.all(p[8:16] == 0)
    assert p[256].item() == 0x38 and p[257].item() == 0x01  # scales follow the 256 code bytes
    assert p[287].item() == 0x76
    assert p[248].item() == 0x7 and p[255].item() == 0xD << 4  # 1344/224 = 6 (code 7); -672/224 = -3
    u = C.unpack_main_kv(p)
    assert u[0] == 6.0 and u[1] == 0.5 and u[2] == -1.0 and torch.signbit(u[3])


def test_byte_layout_index_k_and_swa():
    x = torch.zeros(128)
    x[0], x[1], x[33] = 6.0, -3.0, 0.75  # group 0 scale 1 (byte 127); group 1: amax .75 -> 2^-3 (124)
    p = C.pack_index_k(x)
    assert p.shape == (68,)
    assert p[0].item() == 0x7 | (0xD << 4)
    assert p[16].item() == (0x7 << 4)  # channel 33 = odd -> high nibble; .75 / 2^-3 = 6 -> code 7
    assert p[64:].tolist() == [127, 124, 1, 1]  # zero groups: amax floor 6*2^-126 -> 2^-126
    s = torch.zeros(64)
    s[0], s[1], s[40] = 448.0, -1.0, 2.0**-30
    q = C.pack_swa_kv(s)
    assert q.shape == (66,)
    assert q[0].item() == 0x7E and q[1].item() == 0xB8  # 448 and -1.0 in E4M3
    assert q[64].item() == 127  # 448 * fp32(1/448) rounds to exactly 1.0 -> 2^0
    # group 1: amax = 2^-30 < 1e-4 -> floor: 2^ceil(log2(fp32(1e-4) * fp32(1/448))) = 2^-22 (byte 105)
    assert q[65].item() == 105
    assert q[40].item() == C.float_to_e4m3(torch.tensor(2.0**-8)).item()


# ----------------------------------------------------------------------------------------------------------
# bit-exact agreement with the independent reference on >= 1e6 values per format
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_against_ml_dtypes_reference_1e6(name):
    pack, unpack, qdq, ref, group, _ = FORMATS[name]
    rng = np.random.default_rng({"swa": 1, "main": 2, "index": 3}[name])
    d = 128 if name == "index" else 512
    rows = (1 << 20) // d + 8
    x = mixed_input(rng, rows, d, group)
    assert x.size >= 1_000_000 and np.isfinite(x).all()
    want_packed, want_vals = ref(x)
    xt = torch.from_numpy(x)
    got_packed = pack(xt)
    assert torch.equal(got_packed, torch.from_numpy(want_packed))
    want = torch.from_numpy(want_vals)
    assert same_bits(unpack(got_packed), want)
    assert same_bits(qdq(xt), want)
    # bf16 input takes the same path after an exact widening
    xb = xt[: rows // 4].bfloat16()
    pb, vb = ref(xb.float().numpy())
    assert torch.equal(pack(xb), torch.from_numpy(pb))
    assert same_bits(qdq(xb), torch.from_numpy(vb).bfloat16())


# ----------------------------------------------------------------------------------------------------------
# element codecs and exact special cases
# ----------------------------------------------------------------------------------------------------------


def test_e2m1_ties_and_signed_zero():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert same_bits(C.round_to_e2m1(ties), want)
    assert same_bits(C.round_to_e2m1(-ties), -want)  # -0.25 -> -0.0
    assert C.float_to_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert C.float_to_e2m1(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]
    # just off the midpoints
    eps = 2.0**-20
    assert C.round_to_e2m1(ties + eps).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert C.round_to_e2m1(ties - eps).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    # saturation and signed zero
    assert C.round_to_e2m1(torch.tensor([7.0, -100.0, 6.0])).tolist() == [6.0, -6.0, 6.0]
    assert C.float_to_e2m1(torch.tensor([-0.0, 0.0, -1e-30])).tolist() == [8, 0, 8]
    # all 16 codes against ml_dtypes, both directions
    codes = torch.arange(16, dtype=torch.uint8)
    ref = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    assert same_bits(C.e2m1_to_float(codes), torch.from_numpy(ref))
    assert torch.equal(C.float_to_e2m1(torch.from_numpy(ref)), codes)
    # E2M1 ties through the two FP4 quantizers at scale 1 (amax 6)
    g = torch.cat([torch.tensor([6.0]), ties, -ties, torch.tensor([-0.0] * 17)])
    for q in (C.qdq_main_kv, C.qdq_index_k):
        y = q(g[:32])
        assert same_bits(y[1:8], want) and same_bits(y[8:15], -want)
        assert torch.signbit(y[15:32]).all()


def test_e4m3_codes_ties_saturation():
    all_codes = torch.arange(256, dtype=torch.uint8)
    ref = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
    got = C.e4m3_to_float(all_codes)
    assert same_bits(got, torch.from_numpy(ref))  # NaNs at 0x7F / 0xFF with the same payload class
    finite = torch.isfinite(got)
    assert torch.equal(C.float_to_e4m3(got[finite]), all_codes[finite])  # includes 0x80 (-0)
    x = torch.tensor([17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 448.0, 464.0, 480.0, 1e9, float("inf")])
    want = [16.0, 20.0, 0.0, 2.0**-8, 1.0, 1.25, 448.0, 448.0, 448.0, 448.0, 448.0]
    assert C.round_to_e4m3(x).tolist() == want
    assert C.round_to_e4m3(-x).tolist() == [-w for w in want]
    assert C.float_to_e4m3(torch.tensor([448.0, -1e20, -0.0, float("nan")])).tolist() == [0x7E, 0xFE, 0x80, 0x7F]
    # float8 tensors are accepted by viewing their bytes
    f8 = torch.tensor([1.0, -2.5, 448.0]).to(torch.float8_e4m3fn)
    assert C.e4m3_to_float(f8).tolist() == [1.0, -2.5, 448.0]


def test_e8m0_codes():
    all_codes = torch.arange(256, dtype=torch.uint8)
    got = C.e8m0_to_float(all_codes)
    assert got[0].item() == 2.0**-127 and got[127].item() == 1.0 and got[254].item() == 2.0**127
    assert math.isnan(got[255].item())
    ref = np.arange(256, dtype=np.uint8).view(E8M0).astype(F32)
    assert same_bits(got[:255], torch.from_numpy(ref[:255]))
    assert torch.equal(C.float_to_e8m0(got[:255], strict=True), all_codes[:255])
    assert C.float_to_e8m0(torch.tensor([3.0, 0.0, -1.0, float("inf"), 2.0**-140])).tolist() == [129, 255, 255, 255, 0]
    with pytest.raises(ValueError, match="1 value"):
        C.float_to_e8m0(torch.tensor([1.0, 3.0]), strict=True)
    if hasattr(torch, "float8_e8m0fnu"):
        f8 = torch.tensor([127, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert C.e8m0_to_float(f8).tolist() == [1.0, 8.0]


def test_ue8m0_ceiling_at_powers_of_two():
    for k in [-126, -100, -22, -1, 0, 1, 50, 126]:
        p = torch.tensor([2.0**k], dtype=torch.float32)
        above = torch.nextafter(p, torch.tensor([math.inf]))
        assert C.ue8m0_scale_byte(p).item() == k + 127
        assert C.ue8m0_scale_byte(above).item() == k + 128
        if k > -126:
            below = torch.nextafter(p, torch.tensor([0.0]))
            assert C.ue8m0_scale_byte(below).item() == k + 127
    # through the index-K quantizer: amax = 6 * 2^k exactly -> scale 2^k; one ulp above -> 2^(k+1)
    for k in [-120, -5, 0, 7, 100]:
        g = torch.zeros(32)
        g[5] = 6 * 2.0**k
        assert C.pack_index_k(g)[-1].item() == k + 127
        g[5] = torch.nextafter(g[5], torch.tensor(math.inf))
        assert C.pack_index_k(g)[-1].item() == k + 128
    # and the SWA quantizer (above its 1e-4 amax floor): amax = 448 * 2^k lands on exactly 2^k after the
    # multiply by fp32(1/448); one ulp above gives 2^(k+1)
    for k in [-13, -5, 0, 7, 100]:
        s = torch.zeros(32)
        s[3] = 448 * 2.0**k
        assert C.pack_swa_kv(s)[-1].item() == k + 127
        s[3] = torch.nextafter(s[3], torch.tensor(math.inf))
        assert C.pack_swa_kv(s)[-1].item() == k + 128
        assert C.qdq_fp8(s)[3].item() == 448 * 2.0**k  # clamp at 448 after the division


def test_amax_floors_all_zero_groups():
    z = torch.zeros(2, 512)
    z[1] = -0.0
    for name in ("swa", "main"):
        pack, unpack, qdq = FORMATS[name][:3]
        assert same_bits(qdq(z), z) and same_bits(unpack(pack(z)), z)
    assert torch.all(C.pack_swa_kv(z)[:, 512:] == 105)  # 2^-22
    assert torch.all(C.pack_main_kv(z)[:, 256:] == 0x01)  # E4M3 2^-9
    assert torch.all(C.pack_main_kv(z)[1, :256] == 0x88)  # -0 codes in both nibbles
    zi = torch.zeros(3, 128)
    assert torch.all(C.pack_index_k(zi)[:, 64:] == 1)  # 2^-126
    # below-floor values quantize against the floored scale
    t = torch.zeros(32)
    t[0] = 1e-6  # SWA: scale 2^-22, 1e-6 / 2^-22 = 4.194 -> 4.0
    assert C.qdq_fp8(t)[0].item() == 4.0 * 2.0**-22
    m = torch.zeros(16)
    m[0] = 0.004  # main KV: scale 2^-9, 0.004 / 2^-9 = 2.048 -> 2
    assert C.qdq_main_kv(m)[0].item() == 2.0 * 2.0**-9
    i = torch.zeros(32)
    i[0] = -2.0**-125  # index K: scale 2^-126 -> -2 * 2^-126
    assert C.qdq_index_k(i)[0].item() == -(2.0**-125)
    i[0] = 2.0**-128  # 0.25 * 2^-126 -> tie -> +0
    assert same_bits(C.qdq_index_k(i)[:1], torch.tensor([0.0]))


def test_main_kv_scale_saturates_and_divides():
    x = torch.zeros(16)
    x[0], x[1] = 1e6, -2000.0  # amax / 6 > 448 -> scale 448; values clamp to +-6
    y = C.qdq_main_kv(x)
    assert y[0].item() == 6 * 448.0 and y[1].item() == -4 * 448.0  # 2000/448 = 4.46 -> 4
    # a non-power-of-two scale: amax = 6 * 1.125 = 6.75 -> scale 1.125; 6.75/1.125 = 6
    x = torch.zeros(16)
    x[0], x[1], x[2] = 6.75, 1.125 * 2.5, 1.125 * 1.75
    y = C.qdq_main_kv(x)
    assert y[:3].tolist() == [6.75, 1.125 * 2.0, 1.125 * 2.0]


def test_nibbles():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)
    p = C.pack_nibbles(codes)
    assert p.shape == (3, 16)
    assert p[0, 0].item() == 0x10 and p[0, 7].item() == 0xFE  # even element -> low nibble
    assert torch.equal(C.unpack_nibbles(p), codes)
    assert C.unpack_nibbles(torch.tensor([0xA5], dtype=torch.uint8)).tolist() == [5, 10]
    with pytest.raises(ValueError):
        C.pack_nibbles(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_table_decoders_equal_the_bit_decoders_on_every_byte(dtype):
    """The decoders by table (what the packed records and weights are read with) return the bit decoders' values
    bit for bit on all 256 bytes, NaN codes and signed zeros included, from any 1-byte dtype and leading shape."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).view(4, 64)
    bits = lambda t: t.view(torch.int32)                                          # noqa: E731
    assert torch.equal(bits(C.e4m3_values(b)), bits(C.e4m3_to_float(b)))
    assert torch.equal(bits(C.e8m0_values(b)), bits(C.e8m0_to_float(b)))
    pairs = C.e2m1_pair_values(b)
    assert pairs.shape == (4, 128)
    assert torch.equal(bits(pairs), bits(C.e2m1_to_float(C.unpack_nibbles(b))))


# ----------------------------------------------------------------------------------------------------------
# non-finite handling
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_non_finite_pack_raises_qdq_propagates(name):
    pack, _, qdq, _, group, _ = FORMATS[name]
    x = torch.randn(2, 4 * group)
    x[0, 1] = float("nan")
    x[1, 3 * group] = float("inf")
    with pytest.raises(ValueError, match="2 non-finite"):
        pack(x)
    with pytest.raises(ValueError, match="1 non-finite"):
        pack(x[:1].bfloat16())
    y = qdq(x)  # no raise
    assert torch.isnan(y[0, :group]).all()  # the NaN group is NaN throughout
    assert torch.isfinite(y[0, group:]).all() and torch.isfinite(y[1, : 3 * group]).all()
    assert same_bits(y[0, group:], qdq(x[0, group:]))  # other groups are untouched
    p = pack(x, check_finite=False)  # the unchecked path still returns a well-formed record
    assert p.dtype == torch.uint8


# ----------------------------------------------------------------------------------------------------------
# hypothesis properties
# ----------------------------------------------------------------------------------------------------------

_floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)
_rows = hnp.arrays(np.float32, (3, 32), elements=_floats)


def _scaled(a: np.ndarray, k: int, bf16: bool) -> torch.Tensor:
    x = torch.from_numpy(a * F32(2.0**k))
    return x.bfloat16() if bf16 else x


def _half_step_e4m3(y: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 4)


def _half_step_e2m1(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@HYP
@given(_rows, st.integers(-60, 60), st.booleans())
def test_prop_qdq_fp8(a, k, bf16):
    x = _scaled(a, k, bf16)
    y = C.qdq_fp8(x)
    assert y.dtype == x.dtype and same_bits(C.qdq_fp8(y), y)  # idempotent
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    s = C.e8m0_to_float(C.pack_swa_kv(x)[:, 32:]).double().repeat_interleave(32, dim=-1)
    r = x.double() / s
    bound = (_half_step_e4m3(r.clamp(-448, 448)) + (r.abs() - 448).clamp_min(0)) * s
    assert torch.all((y.double() - x.double()).abs() <= bound + 1e-12 * x.double().abs())  # fp64 slack


@HYP
@given(_rows, st.integers(-60, 60), st.booleans())
def test_prop_qdq_index_k(a, k, bf16):
    x = _scaled(a, k, bf16)
    y = C.qdq_index_k(x)
    assert y.dtype == x.dtype and same_bits(C.qdq_index_k(y), y)
    assert C.qdq_index_q is C.qdq_index_k
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    p = C.pack_index_k(x)
    assert p.shape == (3, 17) and p.dtype == torch.uint8
    s = C.e8m0_to_float(p[:, 16:]).double().repeat_interleave(32, dim=-1)
    r = x.double() / s
    bound = (_half_step_e2m1(r.clamp(-6, 6)) + (r.abs() - 6).clamp_min(0)) * s
    assert torch.all((y.double() - x.double()).abs() <= bound + 1e-12 * x.double().abs())  # fp64 slack


@HYP
@given(_rows, st.integers(-60, 60), st.booleans())
def test_prop_qdq_main_kv(a, k, bf16):
    x = _scaled(a, k, bf16)
    y = C.qdq_main_kv(x)
    assert y.dtype == x.dtype
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    p = C.pack_main_kv(x)
    assert p.shape == (3, 18) and p.dtype == torch.uint8
    s = C.e4m3_to_float(p[:, 16:]).double().repeat_interleave(16, dim=-1)
    r = x.double() / s
    bound = (_half_step_e2m1(r.clamp(-6, 6)) + (r.abs() - 6).clamp_min(0)) * s
    assert torch.all((y.double() - x.double()).abs() <= bound + 1e-12 * x.double().abs())  # fp64 slack
    # idempotent wherever the group's E4M3 scale is a normal number (amax >= 6 * 2^-6), see below
    normal = x.float().abs().unflatten(-1, (2, 16)).amax(-1) >= 6 * 2.0**-6
    twice = C.qdq_main_kv(y).float().unflatten(-1, (2, 16))
    assert same_bits(twice[normal], y.float().unflatten(-1, (2, 16))[normal])


def test_main_kv_not_idempotent_with_subnormal_scale():
    """A documented property of the docs/model.md §3.4 format, not a codec bug: with a subnormal E4M3 scale the
    largest code can round down to 4, and re-quantizing then picks a different scale."""
    x = torch.zeros(16)
    x[0] = 6 * 1.6 * 2.0**-9  # amax/6 = 1.6 * 2^-9 -> scale 2 * 2^-9; x/scale = 4.8 -> 4
    y = C.qdq_main_kv(x)
    assert y[0].item() == 4 * 2.0**-8
    assert C.qdq_main_kv(y)[0].item() == 6 * 2.0**-9  # new scale 2^-9, 8 clamps to 6


# ----------------------------------------------------------------------------------------------------------
# GPU agreement (skipped without CUDA)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_matches_cpu(name):
    pack, unpack, qdq, _, group, _ = FORMATS[name]
    x = torch.from_numpy(mixed_input(np.random.default_rng(7), 512, 512 if name != "index" else 128, group))
    xc = x.cuda()
    assert torch.equal(pack(xc).cpu(), pack(x))
    assert same_bits(unpack(pack(xc)).cpu(), unpack(pack(x)))
    assert same_bits(qdq(xc).cpu(), qdq(x))
    assert same_bits(qdq(xc.bfloat16()).cpu(), qdq(x.bfloat16()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_cuda_qdq_does_not_sync():
    x = torch.randn(64, 512, device="cuda").bfloat16()
    x[0, 0] = float("nan")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ys = [C.qdq_fp8(x), C.qdq_main_kv(x), C.qdq_index_k(x[..., :128]), C.qdq_fp8(x, group=128)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isnan(y[0, 0]).item() for y in ys)


def round_to_e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E4M3 value (ties to even), saturating at +-448; returns fp32.

    The quantum at |x| is 2^(max(floor(log2|x|), -6) - 3): 3 mantissa bits for normals, and the fixed
    subnormal step 2^-9 below 2^-6. Dividing by a power of two is exact, so ``round(|x| / quantum)`` (which
    is round-half-even in torch) performs exactly one RNE rounding. A carry such as 15.5 -> 16 quanta lands
    on the next binade's value, which is correct. NaN stays NaN, +-inf saturates, the sign of zero is kept.
    """
    x = x.float()
    a = x.abs().clamp(max=C.E4M3_MAX)
    floor_log2 = ((a.view(torch.int32) >> 23) - 127).clamp(min=-6)
    quantum = pow2(floor_log2 - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, x)


def test_fast_e4m3_rounding_equals_the_explicit_rule():
    """`round_to_e4m3` (torch's float8_e4m3fn cast) == `round_to_e4m3_reference` (the rounding written out) on
    every fp32 binade from 2^-140 to 2^140, at ties, subnormals, saturation, signed zeros and NaN."""
    from dsv41.codecs.fp8 import round_to_e4m3
    g = torch.Generator().manual_seed(0)
    parts = [torch.ldexp(1 + torch.rand(4096, generator=g), torch.full((4096,), e)) for e in range(-140, 141)]
    x = torch.cat(parts)
    ties = torch.arange(-512, 513, dtype=torch.float32) * 2.0 ** -10        # halfway points of the subnormal grid
    edge = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 1e38, -1e38, float("inf"), -float("inf")])
    x = torch.cat([x, -x, ties, ties * 2 ** 7, edge])
    a, b = round_to_e4m3(x), round_to_e4m3_reference(x)
    assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))
    n = torch.tensor([float("nan")])
    assert torch.isnan(round_to_e4m3(n)).all() and torch.isnan(round_to_e4m3_reference(n)).all()


def test_fast_qdq_equals_pack_unpack_and_the_byte_rule():
    """qdq_fp8 / qdq_index_k take the scale from the bits (`pow2_ceil`); they must equal unpack(pack(x)) (which
    goes through the UE8M0 bytes) on values spanning every scale the floors allow."""
    from dsv41.codecs.fp8 import e8m0_to_float, pow2_ceil, ue8m0_scale_byte
    g = torch.Generator().manual_seed(1)
    y = torch.ldexp(1 + torch.rand(200_000, generator=g), torch.randint(-126, 127, (200_000,), generator=g))
    y = torch.cat([y, torch.ldexp(torch.ones(253), torch.arange(-126, 127))])            # exact powers of two
    assert torch.equal(pow2_ceil(y), e8m0_to_float(ue8m0_scale_byte(y)))
    for scale in (1e-7, 1e-5, 1e-3, 0.1, 1.0, 100.0, 1e5):
        x = torch.randn(4096, 128, generator=g) * scale
        x[::7, :32] = 0.0                                                                  # all-zero groups
        assert torch.equal(C.qdq_fp8(x), C.unpack_swa_kv(C.pack_swa_kv(x))[..., :128]), scale
        assert torch.equal(C.qdq_index_k(x), C.unpack_index_k(C.pack_index_k(x))), scale
        xb = x.bfloat16()
        assert torch.equal(C.qdq_fp8(xb), C.unpack_swa_kv(C.pack_swa_kv(xb)).bfloat16()), scale
