"""Triton routed + shared experts of one MoE layer: twin of `dsv41.kernels.moe_ref.moe_experts_ref`.

Legend: N tokens, D width, F expert hidden width, E routed experts (+1: the shared expert, id E), K activated
experts, P = N * (K + 1) (token, expert) pairs, BM pairs per tile, BF / BD tile widths.

The model's loop runs ~10 torch kernels per active expert and reads the expert counts on the host (a sync per
layer). Here, with no host sync:
  routing (torch, on the device): each token's experts sorted ascending, the shared expert appended; the pairs
    sorted by expert (stable: tokens ascending), per-expert counts and offsets;
  `_moe_up_kernel`, one program per (expert, F tile): for its expert's pairs, BM at a time, gate = x W1^T and
    up = x W3^T on the tensor cores (fp32 accumulation), each rounded to the weights' dtype as the Linear's
    output is, then `expert_act_ref`'s math in its order (clamp, silu as x / (1 + exp(-x)) with IEEE division,
    times the routing weight, cast, w2's FP8 QDQ over groups of 32 of F) -> h [P, F];
  `_moe_down_kernel`, one program per (expert, D tile): out = h W2^T, rounded to the weights' dtype -> [P, D];
  `_moe_combine_kernel`, one program per (token, D tile): y = sum of the token's K outputs in ascending expert id,
    in fp32 (0 + o_1 + o_2 + ..., as the reference's index_add), the shared expert's last, cast to x's dtype.
The expert weights are read through tables of their addresses (no copy, no stacking): every weight of a kind must
have the same shape, dtype and be contiguous. Results equal the reference up to the matmuls' summation order.
A program whose expert has no pairs does no work; an expert's weights are read once per BM of its pairs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsv41.codecs.fp8 import FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX_INV
from dsv41.kernels.triton.quant_kernel import _fp8_groups, qdq_fp8_triton
from dsv41.kernels.triton.common import DOT_BF16, INTERPRET, LAST, libdevice

__all__ = ["moe_experts_triton", "CONFIG"]

# Picked by benchmarks/kernels.py on the H200 (figures: benchmarks/results/README.md); 64-wide F tiles spill.
CONFIG = {"block_m": 16, "up_block_f": 32, "up_block_d": 256, "down_block_d": 32, "down_block_f": 256,
          "combine_block_d": 512, "num_warps": 4}


@triton.jit
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    """acc + a @ b (bf16 operands, fp32 accumulation); the interpreter's bf16 dot is wrong, so it gets fp32
    (exact products, as bf16 x bf16 in fp32: "ieee", not the default tf32)."""
    if DOT_BF16:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _silu(a, LIBDEVICE: tl.constexpr):
    """a / (1 + exp(-a)) with IEEE division and the accurate exp (torch's CUDA silu); the interpreter has no
    libdevice: there tl.exp."""
    if LIBDEVICE:
        e = libdevice.exp(-a)
    else:
        e = tl.exp(-a)
    return tl.math.div_rn(a, 1.0 + e)


@triton.jit
def _moe_up_kernel(x_ptr, w1_tab, w3_tab, order_ptr, pw_ptr, counts_ptr, offs_ptr, h_ptr, D, F, KP, limit, floor,
                   max_inv, CLAMP: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr,
                   BD: tl.constexpr, GROUP: tl.constexpr, DOT_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):
    e = tl.program_id(0)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = f < F
    n_e = tl.load(counts_ptr + e)
    start = tl.load(offs_ptr + e)
    w1 = tl.load(w1_tab + e).to(tl.pointer_type(x_ptr.dtype.element_ty))
    w3 = tl.load(w3_tab + e).to(tl.pointer_type(x_ptr.dtype.element_ty))
    m = tl.arange(0, BM)
    d = tl.arange(0, BD)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        pair = tl.load(order_ptr + s, mask=sm, other=0).to(tl.int64)
        tok = pair // KP
        acc_g = tl.zeros([BM, BF], tl.float32)
        acc_u = tl.zeros([BM, BF], tl.float32)
        for d0 in range(0, D, BD):
            dm = d0 + d < D
            xt = tl.load(x_ptr + tok[:, None] * D + (d0 + d)[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
            wo = f[None, :].to(tl.int64) * D + (d0 + d)[:, None]               # [BD, BF]: W^T tiles
            wmask = fm[None, :] & dm[:, None]
            acc_g = _dot(xt, tl.load(w1 + wo, mask=wmask, other=0.0), acc_g, DOT_BF16)
            acc_u = _dot(xt, tl.load(w3 + wo, mask=wmask, other=0.0), acc_u, DOT_BF16)
        a = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)                    # the Linears' outputs
        b = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
        if CLAMP:
            b = tl.where(b < -limit, -limit, tl.where(b > limit, limit, b))
            a = tl.where(a > limit, limit, a)
        h = _silu(a, LIBDEVICE) * b
        h = tl.load(pw_ptr + pair, mask=sm, other=0.0)[:, None] * h
        h = h.to(h_ptr.dtype.element_ty).to(tl.float32)
        if QUANT:
            hg = tl.reshape(h, (BM * (BF // GROUP), GROUP))
            q, ex, scale, bad = _fp8_groups(hg, floor, max_inv)
            hg = tl.where(bad[:, None], float("nan"), q.to(tl.float32) * scale[:, None])
            h = tl.reshape(hg, (BM, BF))
        tl.store(h_ptr + s[:, None] * F + f[None, :], h.to(h_ptr.dtype.element_ty), mask=sm[:, None] & fm[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w2_tab, counts_ptr, offs_ptr, out_ptr, D, F, BM: tl.constexpr, BD: tl.constexpr,
                     BF: tl.constexpr, DOT_BF16: tl.constexpr):
    e = tl.program_id(0)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    n_e = tl.load(counts_ptr + e)
    start = tl.load(offs_ptr + e)
    w2 = tl.load(w2_tab + e).to(tl.pointer_type(h_ptr.dtype.element_ty))
    m = tl.arange(0, BM)
    fr = tl.arange(0, BF)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        acc = tl.zeros([BM, BD], tl.float32)
        for f0 in range(0, F, BF):
            fm = f0 + fr < F
            ht = tl.load(h_ptr + s[:, None] * F + (f0 + fr)[None, :], mask=sm[:, None] & fm[None, :], other=0.0)
            wt = tl.load(w2 + dd[None, :].to(tl.int64) * F + (f0 + fr)[:, None], mask=dmask[None, :] & fm[:, None],
                         other=0.0)
            acc = _dot(ht, wt, acc, DOT_BF16)
        tl.store(out_ptr + s[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=sm[:, None] & dmask[None, :])


@triton.jit
def _moe_combine_kernel(out_ptr, inv_ptr, y_ptr, D, KP, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    y = tl.zeros([BD], tl.float32)
    for j in range(KP):                                  # ascending expert id, the shared expert last
        s = tl.load(inv_ptr + t * KP + j).to(tl.int64)
        y += tl.load(out_ptr + s * D + dd, mask=dmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + dd, y.to(y_ptr.dtype.element_ty), mask=dmask)


_TABLES: dict = {}


def _address_table(ws: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [E+1] of the weights' addresses, cached by those addresses (the table holds nothing else)."""
    key = (device, tuple(w.data_ptr() for w in ws))
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) > 1024:
            _TABLES.clear()
        t = _TABLES[key] = torch.tensor(list(key[1]), dtype=torch.int64, device=device)
    return t


def moe_experts_triton(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: Sequence[torch.Tensor],
                       w3: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], limit: float, quant_in: bool,
                       quant_mid: bool, **over) -> torch.Tensor:
    """Triton twin of `moe_experts_ref` (same arguments; keyword overrides of CONFIG) -> [N, D] in x's dtype."""
    cfg = {**CONFIG, **over}
    N, D = x.shape
    E = len(w1) - 1
    F = w1[0].size(0)
    dt = x.dtype
    for what, ws, shape in (("w1", w1, (F, D)), ("w3", w3, (F, D)), ("w2", w2, (D, F))):
        for w in ws:
            if tuple(w.shape) != shape or w.dtype != dt or not w.is_contiguous():
                raise ValueError(f"moe_experts (triton): every {what} must be a contiguous {dt} {list(shape)}, got "
                                 f"{w.dtype} {list(w.shape)} contiguous={w.is_contiguous()}")
    if F % FP8_GROUP:
        raise ValueError(f"moe_experts (triton): the hidden width must be a multiple of {FP8_GROUP}, got {F}")
    BF = cfg["up_block_f"]
    if BF % FP8_GROUP:
        raise ValueError(f"moe_experts (triton): up_block_f must be a multiple of {FP8_GROUP}, got {BF}")
    dev = x.device
    y = torch.empty(N, D, dtype=dt, device=dev)
    if N == 0:
        return y
    xq = qdq_fp8_triton(x) if quant_in else x.contiguous()
    KP = indices.size(1) + 1                                                # pairs per token: K routed + shared
    sidx, perm = indices.sort(dim=1)                                        # each token's experts ascending
    pe = torch.cat([sidx, torch.full((N, 1), E, dtype=sidx.dtype, device=dev)], 1).flatten()
    pw = torch.cat([weights.float().gather(1, perm), torch.ones(N, 1, device=dev)], 1).flatten()
    order = torch.argsort(pe, stable=True)                                  # sorted slot -> pair (token * KP + j)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, pe, torch.ones_like(pe))  # no sync
    offs = torch.cumsum(counts, 0) - counts
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    h = torch.empty(N * KP, F, dtype=dt, device=dev)
    out = torch.empty(N * KP, D, dtype=dt, device=dev)
    BM, nw = cfg["block_m"], cfg["num_warps"]
    LAST['moe_up'] = _moe_up_kernel[(E + 1, triton.cdiv(F, BF))](
        xq, _address_table(w1, dev), _address_table(w3, dev), order, pw, counts, offs, h, D, F, KP, float(limit),
        FP8_AMAX_FLOOR, FP8_MAX_INV, CLAMP=limit > 0, QUANT=bool(quant_mid), BM=BM, BF=BF, BD=cfg["up_block_d"],
        GROUP=FP8_GROUP, DOT_BF16=DOT_BF16, LIBDEVICE=not INTERPRET, num_warps=nw, enable_fp_fusion=False)
    BD2 = cfg["down_block_d"]
    LAST['moe_down'] = _moe_down_kernel[(E + 1, triton.cdiv(D, BD2))](
        h, _address_table(w2, dev), counts, offs, out, D, F, BM=BM, BD=BD2, BF=cfg["down_block_f"],
        DOT_BF16=DOT_BF16, num_warps=nw)
    BC = cfg["combine_block_d"]
    _moe_combine_kernel[(N, triton.cdiv(D, BC))](out, inv, y, D, KP, BD=BC, num_warps=4)
    return y
