"""Triton FP8 quantizers: twins of `dsv41.codecs.qdq_fp8` (the activation QDQ), `dsv41.codecs.pack_swa_kv` (the
packed sliding-window KV row) and `dsv41.kernels.expert_act_ref` (the expert's SwiGLU + w2's QDQ), one kernel each
instead of ~12, ~25 and ~9 small torch kernels.

The reference runs before every quantized Linear and on every sliding-window KV row; in a decode step of the
40-layer model that is ~900 calls of a dozen small torch kernels each, so the step was launch-bound. Here one
program takes BLOCK groups of GROUP channels:
  amax  = max(|x| over the group, fp32(1e-4))                      (docs/model.md §3.3)
  scale = 2^ceil(log2(amax * fp32(1/448)))                        from the fp32 bits, exactly as `pow2_ceil`
  out   = e4m3_rne_satfinite(x / scale) * scale                   in x's dtype
Every step is exact in fp32 (the max, the multiply by the fp32 reciprocal, the bit ceiling, the division by a
power of two as a multiply by its exact reciprocal, the Hopper `cvt.rn.satfinite` to E4M3, the multiply back), so
the result is bit-identical to the reference, checked on the GPU by tests/test_kernels_quant.py. A group holding a
NaN or an inf decodes to NaN, as in the reference. The SWA pack stores the same quantities as bytes: the E4M3
codes of q and the UE8M0 byte of the scale (its biased exponent), in the row layout [d codes | d/32 scale bytes];
finite inputs only (the engine's writes; the reference's `check_finite` raise is a host sync, left to callers that
want it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.fp4 import FP4_MAX_INV, INDEX_K_AMAX_FLOOR, INDEX_K_GROUP
from dsv41.codecs.fp8 import FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX_INV
from dsv41.kernels.triton.common import libdevice

__all__ = ["qdq_fp8_triton", "pack_swa_kv_triton", "expert_act_triton", "qdq_index_k_triton"]


@triton.jit
def _fp8_groups(x, floor, max_inv):
    """x [BLOCK, GROUP] fp32 -> (E4M3-rounded x / scale, scale's biased exponent, group is NaN/inf)."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), floor)
    bad = (tl.max((x != x).to(tl.int32), 1) > 0) | (amax == float("inf"))  # NaN (tl.max drops it) or inf
    y = amax * max_inv
    e = ((y.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23) & 0xFF         # biased exponent of 2^ceil(log2 y)
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)                  # 1 / scale, exact (e <= 247 here)
    q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)           # == x / scale: a power-of-two scaling
    return q.to(tl.float8e4nv), e, scale, bad


@triton.jit
def _group_tile(n_groups, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK groups of GROUP contiguous values: (group ids, offsets [BLOCK, GROUP], valid [BLOCK, 1])."""
    g = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = tl.arange(0, GROUP)
    return g, g[:, None] * GROUP + c[None, :], (g < n_groups)[:, None]


@triton.jit
def _qdq_fp8_kernel(x_ptr, y_ptr, n_groups, floor, max_inv, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    g, offs, gm = _group_tile(n_groups, GROUP, BLOCK)
    x = tl.load(x_ptr + offs, mask=gm, other=0.0).to(tl.float32)
    q, e, scale, bad = _fp8_groups(x, floor, max_inv)
    out = tl.where(bad[:, None], float("nan"), q.to(tl.float32) * scale[:, None])
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=gm)


@triton.jit
def _expert_act_kernel(g_ptr, u_ptr, w_ptr, y_ptr, n_groups, F, limit, floor, max_inv, HAS_W: tl.constexpr,
                       CLAMP: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """SwiGLU with the asymmetric clamp and the routing weight, rounded to y's dtype, then (QUANT) the FP8 QDQ of
    w2's input: the torch ops of `expert_act_ref` in their order, silu as x / (1 + exp(-x)) with IEEE division and
    the accurate exp (as torch's CUDA silu)."""
    g, offs, gm = _group_tile(n_groups, GROUP, BLOCK)
    a = tl.load(g_ptr + offs, mask=gm, other=0.0).to(tl.float32)
    b = tl.load(u_ptr + offs, mask=gm, other=0.0).to(tl.float32)
    if CLAMP:
        b = tl.where(b < -limit, -limit, tl.where(b > limit, limit, b))      # NaN stays NaN, as torch.clamp
        a = tl.where(a > limit, limit, a)
    h = tl.math.div_rn(a, 1.0 + libdevice.exp(-a)) * b
    if HAS_W:
        h = tl.load(w_ptr + offs // F, mask=gm, other=0.0) * h
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    if QUANT:
        q, e, scale, bad = _fp8_groups(h, floor, max_inv)
        h = tl.where(bad[:, None], float("nan"), q.to(tl.float32) * scale[:, None])
    tl.store(y_ptr + offs, h.to(y_ptr.dtype.element_ty), mask=gm)


@triton.jit
def _pack_swa_kernel(x_ptr, out_ptr, n_groups, floor, max_inv, GPR: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr):
    """GPR groups per row; row r's record starts at r * GPR * (GROUP + 1): codes, then one scale byte per group."""
    g, offs, gm = _group_tile(n_groups, GROUP, BLOCK)
    x = tl.load(x_ptr + offs, mask=gm, other=0.0).to(tl.float32)
    q, e, scale, bad = _fp8_groups(x, floor, max_inv)
    row = g // GPR
    # value i of group g sits at offs = g * GROUP + i; in the record: row * GPR * (GROUP + 1) + (g % GPR) * GROUP + i
    tl.store(out_ptr + offs + (row * GPR)[:, None], q.to(tl.uint8, bitcast=True), mask=gm)
    tl.store(out_ptr + row * (GPR * (GROUP + 1)) + GPR * GROUP + g % GPR, tl.where(bad, 255, e).to(tl.uint8),
             mask=g < n_groups)


def qdq_fp8_triton(x: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """Triton twin of `dsv41.codecs.qdq_fp8` for CUDA tensors (fp32 / bf16 / fp16) -> x's dtype and shape."""
    if x.dim() == 0 or x.shape[-1] % group:
        raise ValueError(f"qdq_fp8: last dim must be a multiple of {group}, got shape {tuple(x.shape)}")
    if group & (group - 1) or group > 256:
        raise ValueError(f"qdq_fp8 (triton): group must be a power of two up to 256, got {group}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n_groups = xc.numel() // group
    if n_groups:
        block = max(1, min(64, 2048 // group))
        _qdq_fp8_kernel[(triton.cdiv(n_groups, block),)](xc, y, n_groups, FP8_AMAX_FLOOR, FP8_MAX_INV, GROUP=group,
                                                         BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return y


@triton.jit
def _qdq_index_k_kernel(x_ptr, y_ptr, n_groups, floor, max_inv, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """`qdq_index_k` per group: scale = 2^ceil(log2(max(amax, floor) * fp32(1/6))) from the bits, q = x / scale
    clamped to +-6 (NaN kept), rounded to the E2M1 grid half to even (steps 0.5 / 1 / 2 below 2 / 4 / 6: the
    1.5 * 2^23 addition rounds to an integer in fp32's own mode), the sign bit of q put back (-0 stays -0), times
    the scale. A group holding a NaN is NaN (tl.max drops NaN; the reference's amax propagates it)."""
    g, offs, gm = _group_tile(n_groups, GROUP, BLOCK)
    x = tl.load(x_ptr + offs, mask=gm, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), floor)
    bad = tl.max((x != x).to(tl.int32), 1) > 0
    y = amax * max_inv
    scale = ((y.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    q = x / scale[:, None]
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -6.0), 6.0))
    a = tl.abs(q)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    r = ((a / step + 12582912.0) - 12582912.0) * step                 # RNE of a / step (exact: step is 2^k)
    r = (r.to(tl.int32, bitcast=True) | (q.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    out = tl.where(bad[:, None], float("nan"), r * scale[:, None])
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=gm)


def qdq_index_k_triton(x: torch.Tensor, group: int = INDEX_K_GROUP) -> torch.Tensor:
    """Triton twin of `dsv41.codecs.qdq_index_k` (the indexer's MXFP4 QDQ of keys and queries) for CUDA tensors,
    bit-identical on finite inputs -> x's dtype and shape."""
    if x.dim() == 0 or x.shape[-1] % group or group & (group - 1) or group > 256:
        raise ValueError(f"qdq_index_k (triton): last dim a multiple of a power-of-two group (<= 256), got shape "
                         f"{tuple(x.shape)} and group {group}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n_groups = xc.numel() // group
    if n_groups:
        block = max(1, min(64, 2048 // group))
        _qdq_index_k_kernel[(triton.cdiv(n_groups, block),)](xc, y, n_groups, INDEX_K_AMAX_FLOOR, FP4_MAX_INV,
                                                             GROUP=group, BLOCK=block, num_warps=4,
                                                             enable_fp_fusion=False)
    return y


def pack_swa_kv_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of `dsv41.codecs.pack_swa_kv(x, check_finite=False)` for finite CUDA x [..., d] -> uint8
    [..., d + d/32]."""
    d = x.shape[-1] if x.dim() else 0
    if d <= 0 or d % FP8_GROUP:
        raise ValueError(f"pack_swa_kv: last dim must be a positive multiple of {FP8_GROUP}, got shape {tuple(x.shape)}")
    xc = x.contiguous()
    out = torch.empty(*x.shape[:-1], d + d // FP8_GROUP, dtype=torch.uint8, device=x.device)
    n_groups = xc.numel() // FP8_GROUP
    if n_groups:
        block = 64
        _pack_swa_kernel[(triton.cdiv(n_groups, block),)](xc, out, n_groups, FP8_AMAX_FLOOR, FP8_MAX_INV,
                                                          GPR=d // FP8_GROUP, GROUP=FP8_GROUP, BLOCK=block,
                                                          num_warps=4, enable_fp_fusion=False)
    return out


def expert_act_triton(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float,
                      quantize: bool, dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of `dsv41.kernels.expert_act_ref`: gate, up [n, F] (F % 32 == 0), weights [n, 1] fp32 or None."""
    n, F = gate.shape
    if F % FP8_GROUP or up.shape != gate.shape:
        raise ValueError(f"expert_act: gate and up must be [n, F] with F % 32 == 0, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}")
    y = torch.empty(n, F, dtype=dtype, device=gate.device)
    n_groups = n * F // FP8_GROUP
    if n_groups:
        w = weights.float().contiguous() if weights is not None else y
        block = 64
        _expert_act_kernel[(triton.cdiv(n_groups, block),)](
            gate.contiguous(), up.contiguous(), w, y, n_groups, F, float(limit), FP8_AMAX_FLOOR, FP8_MAX_INV,
            HAS_W=weights is not None, CLAMP=limit > 0, QUANT=bool(quantize), GROUP=FP8_GROUP, BLOCK=block,
            num_warps=4, enable_fp_fusion=False)
    return y
