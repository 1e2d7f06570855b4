"""Weight storage as the checkpoint holds it: FP8 Linears, FP4 routed experts, Engram table rows (docs/model.md §9).

Legend: N output rows, K inputs (columns), R table rows, W row width.

  fp8       codes e4m3 [N, K], one e8m0 scale per 32 x 32 tile [ceil(N/32), ceil(K/32)]
  fp4       codes e2m1 [N, K/2], two a byte (element 2k in the low nibble), one e8m0 scale per row and 32 inputs
            [N, K/32]
  fp8_rows  codes e4m3 [R, W], one e8m0 scale per row and 32 of its values [R, W/32] (the Engram tables)

A weight's value is code x power-of-two scale: one fp32 product, exact whenever the result is an fp32 normal
number (always, for weights of any real model). The quantizers (`quant_fp8`, `quant_fp4`, `quant_rows`) pick the
smallest power-of-two scale that brings a block's maximum within the format (RNE codes), as the release's
weights are scaled; the decoders return fp32. `PackedWeight` is one weight in this storage with the dtype its
dequantized twin would be held in; it dequantizes any range of 32-wide column blocks on demand through 256-entry
tables built from the codecs' own decoders (the same fp32 products as the whole-tensor decoders, so a block of
`PackedWeight.cols` has the bits of the same block of the dequantized weight).
"""

from __future__ import annotations

import math

import torch

from .fp4 import e2m1_pair_values, float_to_e2m1, pack_nibbles
from .fp8 import as_u8, e4m3_values, e8m0_values, float_to_e4m3, float_to_e8m0

BLOCK = 32                   # the scale block: a 32 x 32 tile (fp8), 32 inputs of a row (fp4, fp8_rows)
PACKED_KINDS = ("fp8", "fp4", "fp8_rows")


# ------------------------------------------------------------------------------------------------ whole tensors

def _tile_scales(scale: torch.Tensor, rows: int, cols: int, tile: int) -> torch.Tensor:
    return scale.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, tile: int = BLOCK) -> torch.Tensor:
    """e4m3 [N, K] + e8m0 [ceil(N/32), ceil(K/32)] -> fp32 [N, K]."""
    w = e4m3_values(weight)
    return w * _tile_scales(e8m0_values(scale), *w.shape, tile)


def _row_scaled(w: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return w * e8m0_values(scale).repeat_interleave(group, 1)[:, :w.size(1)]


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """packed e2m1 [N, K/2] + e8m0 [N, K/32] -> fp32 [N, K]."""
    return _row_scaled(e2m1_pair_values(weight), scale, group)


def dequant_rows(weight: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """e4m3 [R, W] + e8m0 [R, W/32] -> fp32 [R, W]."""
    return _row_scaled(e4m3_values(weight), scale, group)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (s >= 2^-127), as the release's weight scales."""
    amax = amax.float().clamp_min(2.0 ** -120)
    return torch.exp2(torch.ceil(torch.log2(amax / qmax))).clamp(2.0 ** -127, 2.0 ** 127)


def quant_fp8(w: torch.Tensor, tile: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (e4m3 bytes [N, K], e8m0 bytes [ceil(N/32), ceil(K/32)])."""
    w = w.float()
    R, C = w.shape
    pr, pc = -R % tile, -C % tile
    t = torch.nn.functional.pad(w, (0, pc, 0, pr)).view((R + pr) // tile, tile, (C + pc) // tile, tile)
    s = _pow2_scale(t.abs().amax(dim=(1, 3)), 448.0)
    codes = float_to_e4m3(w / _tile_scales(s, R, C, tile))
    return codes.view(torch.float8_e4m3fn), float_to_e8m0(s).view(torch.float8_e8m0fnu)


def _quant_row_groups(w: torch.Tensor, group: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (values divided by their scale [N, K], e8m0 bytes [N, K/group]): one power-of-two
    scale per `group` along each row, the smallest that brings the group's amax within qmax."""
    w = w.float()
    R, C = w.shape
    g = w.view(R, C // group, group)
    s = _pow2_scale(g.abs().amax(-1), qmax)
    return (g / s.unsqueeze(-1)).view(R, C), float_to_e8m0(s).view(torch.float8_e8m0fnu)


def quant_fp4(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K/2] two E2M1 codes a byte, e8m0 bytes [N, K/32])."""
    x, s = _quant_row_groups(w, group, 6.0)
    return pack_nibbles(float_to_e2m1(x.clamp(-6, 6))).view(torch.int8), s


def quant_rows(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, W] -> (e4m3 bytes [R, W], e8m0 bytes [R, W/32]): the Engram table's storage."""
    x, s = _quant_row_groups(w, group, 448.0)
    return float_to_e4m3(x).view(torch.float8_e4m3fn), s


def stored_shapes(kind: str, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(codes shape, scales shape) of an [rows, cols] weight stored as `kind`."""
    if kind == "fp8":
        return (rows, cols), (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    if kind == "fp4":
        return (rows, cols // 2), (rows, cols // BLOCK)
    if kind == "fp8_rows":
        return (rows, cols), (rows, cols // BLOCK)
    raise ValueError(f"storage kind {kind!r}: expected one of {', '.join(PACKED_KINDS)}")


# storage kind -> (quantizer, whole-tensor decoder)
CODECS = {"fp8": (quant_fp8, dequant_fp8), "fp4": (quant_fp4, dequant_fp4), "fp8_rows": (quant_rows, dequant_rows)}


def non_finite_codes(kind: str, codes: torch.Tensor, scale: torch.Tensor) -> int:
    """How many NaN codes (e4m3 0x7F / 0xFF) and NaN scales (e8m0 0xFF) a stored weight holds (one host sync)."""
    bad = int((as_u8(scale) == 0xFF).sum())
    if kind != "fp4":                                     # e2m1 has no NaN
        bad += int(((as_u8(codes) & 0x7F) == 0x7F).sum())
    return bad


# ------------------------------------------------------------------------------------------------ block decoders

def rows_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Table rows in `fp8_rows` storage, any leading shape: codes [..., W], scale [..., W/32] -> fp32 [..., W]
    (the values of `dequant_rows`)."""
    return e4m3_values(codes) * e8m0_values(scale).repeat_interleave(BLOCK, -1)


class PackedWeight:
    """One Linear weight [N, K] in its checkpoint storage (kind fp8 or fp4), dequantized block by block on demand.

    `dtype` is the dtype the dequantized twin is held in (the model's): `cols` returns the fp32 values of that
    twin (rounded through `dtype`, a no-op for every value a real model holds), `dequant` the twin itself."""

    __slots__ = ("codes", "scale", "kind", "shape", "dtype")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, kind: str, shape: tuple[int, int],
                 dtype: torch.dtype):
        assert kind in ("fp8", "fp4"), kind
        self.codes, self.scale, self.kind, self.shape, self.dtype = codes, scale, kind, tuple(shape), dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def cols(self, k0: int, k1: int) -> torch.Tensor:
        """fp32 [N, k1 - k0] of the dequantized weight's columns k0..k1 (k0 a multiple of 32)."""
        assert k0 % BLOCK == 0 and k0 < k1 <= self.shape[1], (k0, k1)
        N = self.shape[0]
        s = e8m0_values(self.scale[:, k0 // BLOCK:math.ceil(k1 / BLOCK)]).repeat_interleave(BLOCK, 1)[:, :k1 - k0]
        if self.kind == "fp8":
            v = e4m3_values(self.codes[:, k0:k1]) * s.repeat_interleave(BLOCK, 0)[:N]
        else:
            v = e2m1_pair_values(self.codes[:, k0 // 2:(k1 + 1) // 2])[:, :k1 - k0] * s
        return v if self.dtype == torch.float32 else v.to(self.dtype).float()

    def dequant(self) -> torch.Tensor:
        """The dequantized weight [N, K] in `dtype` (what a dense Linear holds)."""
        return CODECS[self.kind][1](self.codes, self.scale).to(self.dtype)


def pack_weight(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (codes, scales) as uint8 in `kind`'s storage; exact for checkpoint-representable weights,
    else the release's rounding (power-of-two scales, RNE codes)."""
    codes, scale = CODECS[kind][0](weight.detach())
    return as_u8(codes), as_u8(scale)
