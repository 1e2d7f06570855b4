"""FP4 codecs: E2M1 nibbles, the packed compressed main-KV record and the packed index-key record.

Bit legend used in the comments below: ``s`` sign bit, ``e`` exponent bit, ``m`` mantissa bit.

E2M1 (OCP float4_e2m1fn), one nibble ``s ee m`` (docs/model.md §3.5 and §9):
  * magnitude by 3-bit code 0..7: {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign, so code 8 is -0.
  * Rounding is to nearest, ties to the even code: midpoints 0.25, 1.25, 2.5, 5.0 round *down* (to 0, 1,
    2, 4) and 0.75, 1.75, 3.5 round *up* (to 1, 2, 4). Inputs beyond +-6 saturate (the quantizers clamp to
    +-6 first anyway). The sign of zero is preserved: -0 and tiny negatives encode as code 8 and decode
    to -0.0. E2M1 has no NaN; ``float_to_e2m1`` maps NaN to a (signed) zero code.
  * Nibble packing (docs/model.md §9, fp4 experts; also used by the KV records): element 2k sits in the LOW
    nibble of byte k and element 2k+1 in the HIGH nibble.

Compressed main-KV record (docs/model.md §3.4, FP4 with E4M3 scales; layout docs/model.md §9 "Packed byte layouts"),
for d channels (d = 512 in the released model, any multiple of 16 here):
  * groups of 16 contiguous channels; ``amax = max(|x| over the group, 6 * 2^-9)``;
  * ``scale = e4m3_RNE(amax / 6)``: a true fp32 *division* by 6, rounded to E4M3 and saturating at 448;
  * ``v = clamp(x / scale, -6, 6)`` (true fp32 division; the scale is not a power of two), code = E2M1(v);
  * bytes ``[0, d/2)``: nibble-packed codes; bytes ``[d/2, d/2 + d/16)``: the E4M3 byte of each group's
    scale. 288 bytes for d = 512. Decoded value = E2M1(code) * scale.

Index-key record (docs/model.md §3.6, MXFP4: UE8M0 scales; layout docs/model.md §9), for d channels (d = 128 in the
released model, any multiple of 32 here):
  * groups of 32; ``amax = max(|x|, 6 * 2^-126)``; ``scale = 2^ceil(log2(amax * fp32(1/6)))`` with the
    exact bit-trick ceiling (see fp8.py); ``v = clamp(x / scale, -6, 6)``; code = E2M1(v);
  * bytes ``[0, d/2)``: nibble-packed codes; bytes ``[d/2, d/2 + d/32)``: UE8M0 scale bytes. 68 bytes for
    d = 128. The indexer *queries* use the very same quantizer (``qdq_index_q`` is the same function).

``qdq_main_kv`` / ``qdq_index_k`` are the fake-quant twins used by the model forward: they return the same
values as unpack(pack(x)) in x's dtype (exact in bf16), never raise and never synchronise with the host.

Pitfall (docs/model.md §10.2 item 2): on CUDA, ``tensor / python_float`` is computed as a multiply by the
reciprocal, which is not a correctly rounded division; the division by 6 here therefore divides by a
tensor. Every value in these formats is a small-integer multiple of a power of two, so the final
``E2M1 * scale`` product is exact in fp32 and in bf16.
"""

from __future__ import annotations

import torch

from .fp8 import as_u8, by_table, byte_ints, e4m3_values, e8m0_to_float, e8m0_values, f32, float_to_e4m3, grouped
from .fp8 import pow2, pow2_ceil
from .fp8 import record_bytes, require_finite, round_to_e4m3, ue8m0_scale_byte, unpack_record

E2M1_MAX = 6.0
MAIN_KV_GROUP = 16
INDEX_K_GROUP = 32
MAIN_KV_AMAX_FLOOR = 6 * 2.0**-9  # 0.01171875, so the scale is at least the smallest E4M3 subnormal
INDEX_K_AMAX_FLOOR = 6 * 2.0**-126
FP4_MAX_INV = f32(1.0 / 6.0)  # fp32(1/6), multiplied before the power-of-two ceiling
_E2M1_MAGNITUDES = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


# ----------------------------------------------------------------------------------------------------------
# E2M1 and nibbles
# ----------------------------------------------------------------------------------------------------------


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E2M1 value (ties to even code), saturating at +-6; returns fp32.

    The grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; in each range the codes are consecutive
    and the even codes are the even multiples of the step, so torch.round (half to even) of |x| / step is
    exactly the RNE of the spec. Scaling by 2, 1 or 1/2 is exact. Sign of zero kept; NaN stays NaN.
    """
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    r = torch.where(
        a < 2.0,
        torch.round(a * 2.0) * 0.5,
        torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0),
    )
    return torch.copysign(r, x)


def _e2m1_code_of_exact(r: torch.Tensor) -> torch.Tensor:
    """4-bit code (uint8) of an fp32 value that is exactly on the E2M1 grid; NaN -> signed zero code."""
    a = r.abs()
    a = torch.where(torch.isnan(a), 0.0, a)
    # 0,.5,1,1.5 -> 0..3 (2a); 2,3 -> 4,5 (a+2); 4,6 -> 6,7 (a/2+4)
    mag = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(torch.uint8)
    return mag | (torch.signbit(r).to(torch.uint8) << 3)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 -> E2M1 codes (uint8 in 0..15, bit 3 = sign): RNE, saturating at +-6, -0 -> 8."""
    return _e2m1_code_of_exact(round_to_e2m1(x))


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8; only the low 4 bits are read) -> fp32. Code 8 decodes to -0.0."""
    c = byte_ints(codes)
    e = (c >> 1) & 3
    m = c & 1
    mf = m.to(torch.float32)
    # e = 0: m * 0.5 (0 or the subnormal 0.5); e >= 1: (1 + m/2) * 2^(e-1) = (2 + m) * 2^(e-2)
    v = torch.where(e == 0, mf * 0.5, (mf + 2.0) * pow2(e - 2))
    return torch.where((c & 8) != 0, -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes[..., 2n] (values 0..15) -> uint8[..., n]; element 2k -> low nibble, 2k+1 -> high nibble."""
    c = as_u8(codes)
    if c.dim() == 0 or c.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(c.shape)}")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8[..., n] (or float4_e2m1fn_x2) -> codes uint8[..., 2n]; the low nibble is the even element."""
    b = as_u8(packed)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _e2m1_pairs(b: torch.Tensor) -> torch.Tensor:
    """bytes [n] -> fp32 [n, 2]: the E2M1 values of each byte's low, then high nibble."""
    return e2m1_to_float(unpack_nibbles(b.to(torch.uint8)).view(-1, 2))


def e2m1_pair_values(packed: torch.Tensor) -> torch.Tensor:
    """Nibble-packed E2M1 bytes [..., n] -> fp32 [..., 2n], low nibble first: `e2m1_to_float(unpack_nibbles(.))`'s
    values, by table."""
    return by_table(_e2m1_pairs, packed).flatten(-2)


# ----------------------------------------------------------------------------------------------------------
# compressed main KV: FP4, E4M3 scale per 16
# ----------------------------------------------------------------------------------------------------------


def _e2m1_of(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 values (fp32) of groups g [.., G, group] at their scales [.., G, 1]: clamp(g / scale) rounded."""
    return round_to_e2m1((g / scale).clamp(-E2M1_MAX, E2M1_MAX))


def _main_kv_scale(amax: torch.Tensor) -> torch.Tensor:
    """The codec's scale e4m3(max(amax, floor) / 6) of groups with maxima amax [.., G, 1]."""
    floored = amax.clamp_min(MAIN_KV_AMAX_FLOOR)
    return round_to_e4m3(floored / torch.full_like(floored, E2M1_MAX))   # tensor divisor: a true fp32 division


def _main_kv_quant(x: torch.Tensor, group: int, what: str):
    """docs/model.md §3.4 quantizer. Returns (E2M1 values fp32 [..,G,group], scale fp32 [..,G,1])."""
    g = grouped(x, group, what)
    scale = _main_kv_scale(g.abs().amax(dim=-1, keepdim=True))     # saturating at 448
    return _e2m1_of(g, scale), scale


def _fp4_record(r: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8[..., d/2 + G]: the nibble-packed codes of E2M1 values r [.., G, group], then one scale byte per group."""
    return torch.cat([pack_nibbles(_e2m1_code_of_exact(r).flatten(-2)), scale_bytes.squeeze(-1).to(torch.uint8)],
                     dim=-1)


def _unpack_fp4(packed: torch.Tensor, group: int, decode_scale, what: str) -> torch.Tensor:
    """uint8[..., d/2 + d/group] -> fp32[..., d] = E2M1(code) * decode_scale(scale byte)."""
    return unpack_record(packed, group, 4, e2m1_pair_values, decode_scale, what)


def main_kv_bytes(d: int = 512) -> int:
    """Bytes of one packed main-KV record of d channels: d/2 code bytes + d/16 E4M3 scales (288 for 512)."""
    return record_bytes(d, MAIN_KV_GROUP, 4, "main-KV")


def qdq_main_kv(x: torch.Tensor, group: int = MAIN_KV_GROUP) -> torch.Tensor:
    """FP4 QDQ with E4M3 scales per ``group`` (16) channels (docs/model.md §3.4): the compressed-KV latent.

    Equal to ``unpack_main_kv(pack_main_kv(x))`` in x's dtype. No raise on non-finite, no host sync.
    """
    r, scale = _main_kv_quant(x, group, "qdq_main_kv")
    return (r * scale).flatten(-2).to(x.dtype)


def pack_main_kv(x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """x[..., d] (d % 16 == 0) -> uint8[..., d/2 + d/16]: nibble-packed E2M1 codes, then E4M3 scales."""
    if check_finite:
        require_finite(x, "pack_main_kv")
    r, scale = _main_kv_quant(x, MAIN_KV_GROUP, "pack_main_kv")
    return _fp4_record(r, float_to_e4m3(scale))


def unpack_main_kv(packed: torch.Tensor) -> torch.Tensor:
    """uint8[..., d/2 + d/16] -> fp32[..., d] = E2M1(code) * E4M3(scale)."""
    return _unpack_fp4(packed, MAIN_KV_GROUP, e4m3_values, "unpack_main_kv")


def _represents(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., G, 1] bool: every value of the group is E2M1(code) * scale exactly (|code| <= 6)."""
    return (_e2m1_of(g, scale) * scale == g).all(dim=-1, keepdim=True)


def pack_main_kv_exact(x: torch.Tensor) -> torch.Tensor:
    """x[..., d] -> uint8[..., d/2 + d/16], the `pack_main_kv` record layout, decoding to x exactly when x is
    representable (every `qdq_main_kv` output is).

    Why: `pack_main_kv` re-derives the E4M3 scale from the group maximum; for groups whose scale is an E4M3
    *subnormal* (group amax below about 0.09) that re-derivation can pick another scale, so pack(qdq(x)) is lossy
    there (`qdq_main_kv` is not idempotent). The packed KV store writes main KV through this function instead.

    The scale is `pack_main_kv`'s (e4m3(max(amax, floor) / 6)) when that reproduces the group; otherwise the first
    of amax / c, c in the E2M1 magnitudes 6, 4, ..., 0.5, that is an E4M3 value and reproduces it (for a
    representable group amax = c_max * scale, so one candidate is the group's true scale). Groups matching no
    candidate (unrepresentable input) keep the codec's scale and round like `pack_main_kv`. No host sync on
    accelerators (every candidate is evaluated); on CPU the candidates are skipped when the codec's scale fits."""
    g = grouped(x, MAIN_KV_GROUP, "pack_main_kv_exact")
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = _main_kv_scale(amax)
    ok = _represents(g, scale)
    if not (g.device.type == "cpu" and bool(ok.all())):
        for c in _E2M1_MAGNITUDES:
            s = amax / torch.full_like(amax, c)               # tensor divisor: a true division on every device
            good = (s > 0) & (round_to_e4m3(s) == s) & _represents(g, s)
            scale = torch.where(ok | ~good, scale, s)
            ok = ok | good
    return _fp4_record(_e2m1_of(g, scale), float_to_e4m3(scale))


# ----------------------------------------------------------------------------------------------------------
# index keys / indexer queries: MXFP4, UE8M0 scale per 32
# ----------------------------------------------------------------------------------------------------------


def index_k_bytes(d: int = 128) -> int:
    """Bytes of one packed index-key record of d channels: d/2 code bytes + d/32 UE8M0 scales (68 for 128)."""
    return record_bytes(d, INDEX_K_GROUP, 4, "index-K")


def qdq_index_k(x: torch.Tensor, group: int = INDEX_K_GROUP) -> torch.Tensor:
    """MXFP4 QDQ (E2M1, UE8M0 scale per ``group`` = 32) of the indexer keys AND the indexer queries.

    docs/model.md §3.6 applies this one quantizer to both ``k`` (before the index-key cache) and ``q`` (after
    RoPE); ``qdq_index_q`` is an alias. Equal to ``unpack_index_k(pack_index_k(x))`` in x's dtype.
    No raise on non-finite (the group becomes NaN), no host sync.
    """
    g = grouped(x, group, "qdq_index_k")                  # `pack_index_k`'s quantizer without the scale bytes
    scale = pow2_ceil(g.abs().amax(dim=-1, keepdim=True).clamp_min(INDEX_K_AMAX_FLOOR) * FP4_MAX_INV)
    return (_e2m1_of(g, scale) * scale).flatten(-2).to(x.dtype)


qdq_index_q = qdq_index_k


def pack_index_k(x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """x[..., d] (d % 32 == 0) -> uint8[..., d/2 + d/32]: nibble-packed E2M1 codes, then UE8M0 scales."""
    if check_finite:
        require_finite(x, "pack_index_k")
    g = grouped(x, INDEX_K_GROUP, "pack_index_k")                   # docs/model.md §3.6 quantizer
    sbyte = ue8m0_scale_byte(g.abs().amax(dim=-1, keepdim=True).clamp_min(INDEX_K_AMAX_FLOOR) * FP4_MAX_INV)
    return _fp4_record(_e2m1_of(g, e8m0_to_float(sbyte)), sbyte)


def unpack_index_k(packed: torch.Tensor) -> torch.Tensor:
    """uint8[..., d/2 + d/32] -> fp32[..., d] = E2M1(code) * 2^(scale byte - 127)."""
    return _unpack_fp4(packed, INDEX_K_GROUP, e8m0_values, "unpack_index_k")
