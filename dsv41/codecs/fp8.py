"""FP8 codecs: E4M3 and UE8M0 bytes, the packed SWA-KV row and the FP8 activation QDQ.

Everything here is integer/fp32 bit math on ordinary torch tensors. torch's float8 dtypes are never used
for arithmetic (their casts turn overflow into NaN and their availability differs across versions); a
float8 tensor is only accepted as *input* to the decoders, by viewing its bytes as uint8.

Bit legend used in the comments below: ``s`` sign bit, ``e`` exponent bit, ``m`` mantissa bit.

E4M3 (OCP float8_e4m3fn), one byte ``s eeee mmm``, exponent bias 7 (docs/model.md §9, "Storage formats"):
  * e = 1..15: value = (-1)^s * (1 + m/8) * 2^(e-7); the largest finite value is 0x7E = 1.75 * 2^8 = 448.
  * e = 0: subnormal, value = (-1)^s * m * 2^-9 (smallest 2^-9); 0x00 = +0 and 0x80 = -0.
  * 0x7F / 0xFF (e = 15, m = 7) is NaN; there is no infinity.
  * Encoding (``float_to_e4m3``) rounds to nearest, ties to even, and *saturates* at +-448 (like the CUDA
    ``satfinite`` conversion the kernels use; a plain ``tensor.to(torch.float8_e4m3fn)`` maps overflow to
    NaN, docs/model.md §10.2 pitfall 2). +-inf saturates to +-448, NaN stays NaN, the sign of zero is kept.

UE8M0 (OCP float8_e8m0fnu), one byte ``eeeeeeee``: value = 2^(byte - 127); byte 0 is 2^-127 and byte 255
is NaN. There is no sign and no zero.

Power-of-two ("MX") scales, docs/model.md §3.3 and §10.1: ``scale = 2^ceil(log2(amax * fp32(1/448)))``. The
product is an fp32 multiply by the fp32-rounded reciprocal (not a division), and the ceiling is exact,
from the fp32 bits of the product: its biased exponent, plus one if its mantissa is nonzero. That biased
exponent *is* the UE8M0 byte of the scale.

SWA-KV row (docs/model.md §3.3; packed layout from docs/model.md §9 "Packed byte layouts"), for a row of d channels
(d = 512 in the released model, any multiple of 32 here):
  * groups of 32 contiguous channels; ``amax = max(|x| over the group, 1e-4)``; scale as above;
  * ``q = e4m3_RNE(clamp(x / scale, -448, 448))``; the decoded value is ``q * scale``;
  * bytes ``[0, d)``: the E4M3 code of channel i at byte i; bytes ``[d, d + d/32)``: the UE8M0 byte of
    group j at byte d + j. Total ``d + d/32`` bytes (528 for d = 512).

The same per-32 quantizer is the activation quantization in front of every fp8/fp4 Linear (docs/model.md §9,
"How the reference computes with them": ``act_quant`` with ue8m0 scales). ``qdq_fp8`` is its fake-quant
twin: the same values as ``unpack_swa_kv(pack_swa_kv(x))`` returned in x's dtype, never raising and never
synchronising with the host, so it is safe inside the model forward on GPU. Every QDQ value is exactly
representable in bf16 (3 mantissa bits times a power of two), so casting the result to bf16 is lossless.

Non-finite inputs. The pack functions raise ``ValueError`` (this costs one host sync; pass
``check_finite=False`` to skip it). The QDQ functions propagate instead: a NaN or inf in a group makes the
group's UE8M0 scale byte 255 (NaN), so the whole group decodes to NaN.
"""

from __future__ import annotations

import functools
import struct

import torch


def f32(v: float) -> float:
    """The Python float equal to ``v`` rounded to fp32 (RNE)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


E4M3_MAX = 448.0
FP8_GROUP = 32
FP8_AMAX_FLOOR = f32(1e-4)  # docs/model.md §3.3 / §10.1: amax >= 1e-4 (compared in fp32)
FP8_MAX_INV = f32(1.0 / 448.0)  # fp32(1/448): multiplied, not divided (docs/model.md §10.2 pitfall 2)

_E4M3_MIN_NORMAL = 2.0**-6
_F32_NAN_BITS = 0x7FC00000
_F32_2POW_M127_BITS = 0x00400000  # 2^-127, an fp32 subnormal


# ----------------------------------------------------------------------------------------------------------
# small shared helpers (also used by fp4.py)
# ----------------------------------------------------------------------------------------------------------


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """View a 1-byte tensor (uint8, int8, float8_*, float4_e2m1fn_x2) as uint8; no copy."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() == 1 and t.dtype != torch.bool:
        return t.view(torch.uint8)
    raise TypeError(f"expected a 1-byte tensor (uint8 / int8 / float8), got {t.dtype}")


def byte_ints(t: torch.Tensor) -> torch.Tensor:
    """Byte values 0..255 as int32 from a 1-byte tensor (viewed as uint8) or a wider integer tensor."""
    if t.element_size() == 1:
        return as_u8(t).to(torch.int32)
    if t.dtype in (torch.int16, torch.int32, torch.int64):
        return t.to(torch.int32)
    raise TypeError(f"expected byte codes (uint8 / int8 / float8 / int32), got {t.dtype}")


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as fp32 for an integer tensor e in [-126, 127], built from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def require_finite(x: torch.Tensor, what: str) -> None:
    """Raise ValueError naming how many entries of x are NaN or +-inf (one host sync)."""
    if x.is_floating_point():
        bad = int((~torch.isfinite(x)).sum().item())
        if bad:
            raise ValueError(
                f"{what}: input has {bad} non-finite value(s) (NaN/inf) out of {x.numel()}, shape {tuple(x.shape)}"
            )


def grouped(x: torch.Tensor, group: int, what: str) -> torch.Tensor:
    """x as fp32 with the last dim split into (d/group, group)."""
    if x.dim() == 0 or x.shape[-1] % group != 0:
        raise ValueError(f"{what}: last dim must be a multiple of {group}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    return x.float().unflatten(-1, (x.shape[-1] // group, group))


def record_bytes(d: int, group: int, code_bits: int, what: str) -> int:
    """Bytes of a packed record of d channels: d codes of `code_bits` bits, then one scale byte per `group`."""
    if d <= 0 or d % group:
        raise ValueError(f"{what} channel count must be a positive multiple of {group}, got {d}")
    return d * code_bits // 8 + d // group


def unpack_record(packed: torch.Tensor, group: int, code_bits: int, decode_codes, decode_scale,
                  what: str) -> torch.Tensor:
    """uint8[..., n] records (`record_bytes` layout) -> fp32[..., d] = decode_codes(codes) * decode_scale(byte)."""
    b = as_u8(packed)
    n = b.shape[-1]
    d = n * 8 * group // (code_bits * group + 8)            # the inverse of record_bytes, where one exists
    if d <= 0 or d % group or d * code_bits // 8 + d // group != n:
        raise ValueError(f"{what}: {n} bytes is not the record of d channels for any d divisible by {group}")
    codes = d * code_bits // 8
    vals = decode_codes(b[..., :codes]).unflatten(-1, (d // group, group))
    return (vals * decode_scale(b[..., codes:]).unsqueeze(-1)).flatten(-2)


# ----------------------------------------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """value(x, q) = q; its gradient with respect to x is the identity (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, q):
        return q

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E4M3 value (ties to even), saturating at +-448; returns fp32.

    Through torch's own float8_e4m3fn cast (round to nearest even, subnormals included): 3 kernels instead of
    the ~10 of the explicit rounding rule (`round_to_e4m3_reference` in tests/test_codecs.py), checked equal on
    every finite fp32 binade and the edge values (tests/test_codecs.py). Under autograd the rounding passes the
    gradient straight through (the cast's own backward would round the gradient to E4M3 as well, flushing
    everything below 2^-9 to zero: a quantized training forward then trained almost nothing upstream)."""
    xc = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    if not xc.requires_grad:
        return xc.to(torch.float8_e4m3fn).float()
    return _StraightThrough.apply(xc, xc.detach().to(torch.float8_e4m3fn).float())


def _e4m3_code_of_exact(r: torch.Tensor) -> torch.Tensor:
    """Byte of an fp32 value that is already exactly an E4M3 value (or NaN)."""
    a = r.abs()
    nan = torch.isnan(a)
    a = torch.where(nan, 0.0, a)
    # normal: the top 4 exponent bits and top 3 mantissa bits of the fp32 pattern, rebiased 127 -> 7
    normal = (a.view(torch.int32) >> 20) - ((127 - 7) << 3)
    subnormal = (a * 512.0).to(torch.int32)  # m = value / 2^-9, an exact integer in 0..7
    mag = torch.where(a < _E4M3_MIN_NORMAL, subnormal, normal)
    mag = torch.where(nan, 0x7F, mag)
    return (mag | (torch.signbit(r).to(torch.int32) << 7)).to(torch.uint8)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 -> E4M3 bytes (uint8): round to nearest even, saturating at +-448, NaN -> 0x7F|sign."""
    return _e4m3_code_of_exact(round_to_e4m3(x))


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 / int32 0..255, or a float8_e4m3fn tensor viewed as bytes) -> fp32 (0x7F / 0xFF -> NaN)."""
    b = byte_ints(codes)
    mag = b & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = (((e + (127 - 7)) << 23) | (m << 20)).view(torch.float32)
    subnormal = m.to(torch.float32) * 2.0**-9
    v = torch.where(e == 0, subnormal, normal)
    v = torch.where(mag == 0x7F, torch.full_like(v, float("nan")), v)
    return torch.where(b >= 0x80, -v, v)


# ----------------------------------------------------------------------------------------------------------
# UE8M0
# ----------------------------------------------------------------------------------------------------------


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8 / int32 0..255, or a float8_e8m0fnu tensor) -> fp32 2^(byte-127); 0 -> 2^-127, 255 -> NaN."""
    b = byte_ints(codes)
    bits = torch.where(b == 0, _F32_2POW_M127_BITS, b << 23)
    bits = torch.where(b == 255, _F32_NAN_BITS, bits)
    return bits.view(torch.float32)


# ------------------------------------------------------------------------------------------------ by table
# The decoders above, tabulated once per device over the 256 byte values and read by one gather: the same
# values bit for bit (NaN codes included), in 2 ops instead of ~10 elementwise passes over the codes (the
# records a decode step reads, the weights it dequantizes).

@functools.cache
def _byte_table(decode, device: torch.device) -> torch.Tensor:
    """fp32 [256, ...]: decode(b) of every byte value b, on `device`."""
    return decode(torch.arange(256, dtype=torch.int32)).to(device)


def by_table(decode, codes: torch.Tensor) -> torch.Tensor:
    """decode(codes) for 1-byte codes, read from its table: [..., n] -> [..., n, *decode's trailing shape]."""
    table = _byte_table(decode, codes.device)
    flat = table.index_select(0, as_u8(codes).reshape(-1).int())      # ~2x an advanced-indexing gather on a CPU
    return flat.view(*codes.shape, *table.shape[1:])


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes of any shape -> fp32: `e4m3_to_float`'s values, by table."""
    return by_table(e4m3_to_float, codes)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes of any shape -> fp32: `e8m0_to_float`'s values, by table."""
    return by_table(e8m0_to_float, codes)


def ue8m0_scale_byte(y: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of 2^ceil(log2 y), for positive fp32 y, computed exactly from the bits (int32 result).

    byte = biased exponent of y, plus 1 if y's mantissa is nonzero (docs/model.md §3.3). Results past 254 (y
    above 2^127, inf, NaN) are clamped to 255, the NaN byte. Only meaningful for normal y; subnormal y is
    handled by ``float_to_e8m0``.
    """
    bits = y.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=255)


def float_to_e8m0(x: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """fp32 -> UE8M0 bytes (uint8).

    Exact for positive powers of two in [2^-127, 2^127]. Any other positive value is rounded *up* to the
    next power of two (the same ceiling as the MX scale rule); zero, negatives, inf, NaN and values above
    2^127 give 255 (NaN). With ``strict=True`` anything that is not an exact representable power of two
    raises ValueError instead (one host sync).
    """
    x = x.float()
    bits = x.view(torch.int32)
    byte = ue8m0_scale_byte(x)
    # fp32 subnormals (exponent field 0): (0, 2^-127] -> 0 (2^-127), (2^-127, 2^-126) -> 1
    byte = torch.where((bits >> 23) == 0, (bits > _F32_2POW_M127_BITS).to(torch.int32), byte)
    invalid = ~(x > 0) | torch.isinf(x)
    byte = torch.where(invalid, 255, byte)
    if strict:
        exact = ((bits & 0x7FFFFF) == 0) & ((bits >> 23) > 0) | (bits == _F32_2POW_M127_BITS)
        bad = int((invalid | ~exact | (byte == 255)).sum().item())
        if bad:
            raise ValueError(f"float_to_e8m0(strict=True): {bad} value(s) are not powers of two in [2^-127, 2^127]")
    return byte.to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------
# FP8 act quant / SWA-KV row
# ----------------------------------------------------------------------------------------------------------


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 y) for positive finite fp32 y, from the bits: a nonzero mantissa carries into the exponent.
    Equals `e8m0_to_float(ue8m0_scale_byte(y))` there (the UE8M0 scale of y), in 5 kernels instead of ~11;
    NaN stays NaN (so a group holding a NaN dequantizes to NaN throughout, as with the byte rule)."""
    y = y.float()
    return torch.where(torch.isnan(y), y, ((y.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32))


def qdq_fp8(x: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """FP8 (E4M3, UE8M0 scale per ``group`` channels along the last dim) quantize-dequantize.

    The ``act_quant`` of docs/model.md §3.3 / §9: used for the sliding-window KV (group 32, equal to
    ``unpack_swa_kv(pack_swa_kv(x))``) and for the activation quantization before every fp8/fp4 Linear.
    Computes in fp32 and returns x's dtype (exact for bf16). Never raises on non-finite values (their group
    becomes NaN), no host sync. The same arithmetic as `pack_swa_kv` (which goes through the scale bytes), in
    fewer kernels: it runs before every quantized Linear."""
    g = grouped(x, group, "qdq_fp8")
    scale = pow2_ceil(g.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) * FP8_MAX_INV)
    return (round_to_e4m3(g / scale) * scale).flatten(-2).to(x.dtype)


def swa_kv_bytes(d: int = 512) -> int:
    """Bytes of one packed SWA-KV row of d channels: d E4M3 codes + d/32 UE8M0 scales (528 for 512)."""
    return record_bytes(d, FP8_GROUP, 8, "SWA-KV")


def pack_swa_kv(x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """x[..., d] (d % 32 == 0) -> uint8[..., d + d/32]: E4M3 codes, then one UE8M0 byte per 32 channels."""
    if check_finite:
        require_finite(x, "pack_swa_kv")
    g = grouped(x, FP8_GROUP, "pack_swa_kv")                        # per-group quantization, docs/model.md §3.3
    sbyte = ue8m0_scale_byte(g.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) * FP8_MAX_INV)
    q = round_to_e4m3(g / e8m0_to_float(sbyte))                     # saturates at +-448
    return torch.cat([_e4m3_code_of_exact(q).flatten(-2), sbyte.squeeze(-1).to(torch.uint8)], dim=-1)


def unpack_swa_kv(packed: torch.Tensor) -> torch.Tensor:
    """uint8[..., d + d/32] -> fp32[..., d] = E4M3(code) * 2^(scale byte - 127)."""
    return unpack_record(packed, FP8_GROUP, 8, e4m3_values, e8m0_values, "unpack_swa_kv")
