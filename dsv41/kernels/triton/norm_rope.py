"""Triton twins of two small row ops the decode step runs at every layer, one launch each instead of the 5-9 torch
kernels of their references (each a few us of a graph-replayed GPU step; `benchmarks/decode_census.py` counts them):

  rms_norm_triton   `dsv41.kernels.ref.rms_norm_ref`: one program per row, fp32 sum of squares, x * rsqrt(mean + eps),
                    times the weight, cast to x's dtype.
  rope_triton       `dsv41.kernels.ref.apply_rope_ref`: one program per (row, head block); the head part of the row
                    copied, the last R dims rotated by adjacent (even, odd) pairs in fp32, (a c - b d, a d + b c) as
                    the complex product, cast to x's dtype.

Numerics: the same fp32 operations as the references; only the row sum's order (and rsqrt's rounding) differ, so a
bf16 output can differ from the reference's by one rounding; fp32 outputs by a few ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.common import LAST, aligned_rows

__all__ = ["rms_norm_triton", "rope_triton"]

MAX_WIDTH = 16384                  # the widest row one program holds (RMSNorm's D, RoPE's row)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + row * D + d, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + d, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin of `rms_norm` (same arguments) -> x's shape and dtype."""
    D = x.size(-1)
    if D > MAX_WIDTH or weight.numel() != D:
        raise ValueError(f"rms_norm (triton): rows of at most {MAX_WIDTH} with a weight of {D}, got {D} and "
                         f"{weight.numel()}")
    a = aligned_rows(x, D)                                  # one compiled variant: one summation order
    y = torch.empty_like(a)
    if a.size(0):
        LAST["rms_norm"] = _rms_norm_kernel[(a.size(0),)](a, weight.contiguous(), y, D, float(eps),
                                                          BD=triton.next_power_of_2(D), num_warps=4)
    return y.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, f_ptr, y_ptr, T, H, C, R2, f_batch_stride, BH: tl.constexpr, BC: tl.constexpr,
                 BR: tl.constexpr, INVERSE: tl.constexpr):
    """Program (b * T + t, head block): rows [BH, C] of x; the last 2 R2 columns rotated by freqs[b or 0, t]."""
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    t = bt % T
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    row = (bt * H + h.to(tl.int64)) * C
    c = tl.arange(0, BC)
    head = C - 2 * R2
    cm = hm[:, None] & (c[None, :] < head)
    tl.store(y_ptr + row[:, None] + c[None, :], tl.load(x_ptr + row[:, None] + c[None, :], mask=cm), mask=cm)
    i = tl.arange(0, BR)
    im = i < R2
    fb = f_ptr + b * f_batch_stride + t * (2 * R2) + 2 * i
    cos = tl.load(fb, mask=im, other=0.0)
    sin = tl.load(fb + 1, mask=im, other=0.0)
    if INVERSE:
        sin = -sin
    pm = hm[:, None] & im[None, :]
    ev = row[:, None] + head + 2 * i[None, :]
    a = tl.load(x_ptr + ev, mask=pm, other=0.0).to(tl.float32)
    bb = tl.load(x_ptr + ev + 1, mask=pm, other=0.0).to(tl.float32)
    tl.store(y_ptr + ev, (a * cos[None, :] - bb * sin[None, :]).to(y_ptr.dtype.element_ty), mask=pm)
    tl.store(y_ptr + ev + 1, (a * sin[None, :] + bb * cos[None, :]).to(y_ptr.dtype.element_ty), mask=pm)


def rope_triton(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Twin of `apply_rope_ref` (same arguments): x [B, T, C] or [B, T, H, C], freqs complex64 [B or 1, T, R/2]."""
    if x.dim() not in (3, 4) or freqs.dim() != 3 or freqs.dtype != torch.complex64:
        raise ValueError(f"rope (triton): x [B, T, (H,) C] and complex64 freqs [B or 1, T, R/2], got {tuple(x.shape)} "
                         f"and {freqs.dtype} {tuple(freqs.shape)}")
    B, T, C = x.size(0), x.size(1), x.size(-1)
    H = x.size(2) if x.dim() == 4 else 1
    R2 = freqs.size(-1)
    if freqs.size(1) != T or freqs.size(0) not in (1, B) or 2 * R2 > C or C > MAX_WIDTH:
        raise ValueError(f"rope (triton): freqs {tuple(freqs.shape)} do not fit x {tuple(x.shape)}")
    a = x.contiguous()
    f = torch.view_as_real(freqs.contiguous())                          # [B or 1, T, R/2, 2] fp32
    y = torch.empty_like(a)
    if a.numel():
        BH = min(triton.next_power_of_2(H), max(1, 4096 // triton.next_power_of_2(C)))
        LAST["rope"] = _rope_kernel[(B * T, triton.cdiv(H, BH))](
            a, f, y, T, H, C, R2, f.stride(0) if f.size(0) > 1 else 0, BH=BH, BC=triton.next_power_of_2(C),
            BR=triton.next_power_of_2(R2), INVERSE=inverse, num_warps=4)
    return y
