"""Triton routed + shared experts of one MoE layer: twin of `dsv41.kernels.moe_ref.moe_experts_ref`.

Legend: N tokens, D width, F expert hidden width, E routed experts (+1: the shared expert, id E), K activated
experts, P = N * (K + 1) (token, expert) pairs, BM pairs per tile, BF / BD tile widths.

The model's loop runs ~10 torch kernels per active expert and reads the expert counts on the host (a sync per
layer). Here, with no host sync:
  routing (`moe_route_ref`'s slots): each token's experts sorted ascending, the shared expert appended; the pairs
    sorted by expert (stable: tokens ascending), per-expert counts and offsets. Decode sizes (up to
    ROUTE_MAX_PAIRS pairs): one program, `_moe_route_kernel` (the torch routing is ~14 kernels, each a few us of a
    graph-replayed decode step, per layer); larger calls: the torch routing;
  `_moe_up_kernel`, one program per (expert, F tile): for its expert's pairs, BM at a time, gate = x W1^T and
    up = x W3^T on the tensor cores (fp32 accumulation), each rounded to the weights' dtype as the Linear's
    output is, then `expert_act_ref`'s math in its order (clamp, silu as x / (1 + exp(-x)) with IEEE division,
    times the routing weight, cast, w2's FP8 QDQ over groups of 32 of F) -> h [P, F];
  `_moe_down_kernel`, one program per (expert, D tile): out = h W2^T, rounded to the weights' dtype -> [P, D];
  `_moe_combine_kernel`, one program per (token, D tile): y = sum of the token's K outputs in ascending expert id,
    in fp32 (0 + o_1 + o_2 + ..., as the reference's index_add), the shared expert's last, cast to x's dtype.
The expert weights are read through tables of their addresses (no copy, no stacking): every weight of a kind must
have the same shape, dtype and be contiguous. Weights held packed (`PackedWeight`: fp4 routed experts, an fp8 shared
expert) are read as their checkpoint bytes, one 32-wide block of the reduced dimension at a time, decoded in registers
(`packed_block`, exact in bf16) and scaled per block after the tensor-core dot (`block_dot`, the GEMM of
triton/packed_gemm.py); routed and shared experts held differently launch apart (the same slots, the same combine).
Results equal the reference up to the matmuls' summation order.
A program whose expert has no pairs does no work; an expert's weights are read once per BM of its pairs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsv41.codecs.fp8 import FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX_INV
from dsv41.kernels.triton.quant_kernel import _fp8_groups, qdq_fp8_triton
from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import ASM, DOT_BF16, INTERPRET, LAST, aligned_rows, libdevice, sm_count
from dsv41.kernels.triton.fp8_decode import fp8_rows_dot_t
from dsv41.kernels.moe_ref import moe_route_ref
from dsv41.kernels.triton.packed_gemm import check_offsets, packed_rows_dot

__all__ = ["moe_experts_triton", "moe_route_triton", "moe_gate_triton", "CONFIG", "ROUTE_MAX_PAIRS"]

# Picked by benchmarks/kernels.py on the H200 (figures: benchmarks/results/README.md); 64-wide F tiles spill.
# Over packed weights (benchmarks/packed_gemm.py --sweep): packed_block_f / packed_down_block_d the up / down
# kernels' output tiles, packed_unroll 32-wide blocks per loop step, packed_num_warps (H100: 1,763 us for the op
# at 1 + 32 tokens against 2,226 with the dense tiles, results/packed_gemm_h100-2026-12-05b.log); packed_split: at
# most that many parts of the reduced width (split-K: fp32 partials added in part order by a finish kernel) so that
# a decode step's few busy experts fill about packed_programs_per_sm programs per SM (H200 sweep at 1 + 32 tokens:
# split 16 / 8 programs per SM 819 us against 1,840 without the split; tiles F 128 / D 128 971 us against 1,208
# at F 64; results/packed_gemm_h200-2026-12-05.log). packed_fp8_mma: from this many tokens (0: never), packed experts
# of bf16 models run on the FP8 tensor cores (fp8_decode.fp8_rows_dot_t: the inputs, FP8-QDQ'd, as codes; the
# weights' codes as the operand, no decode to bf16). H100 (results/packed_gemm_h100-2026-12-06.log, the op at
# B = 1 / 8 / 32 / 64 tokens): 224 / 404 / 469 / 833 us against the bf16-decode kernels' 215 / 397 / 556 / 1,028.
CONFIG = {"block_m": 16, "up_block_f": 32, "up_block_d": 256, "down_block_d": 32, "down_block_f": 256,
          "combine_block_d": 512, "num_warps": 4, "packed_unroll": 2, "packed_block_f": 128,
          "packed_down_block_d": 128, "packed_num_warps": 4, "packed_split": 16, "packed_programs_per_sm": 8,
          "packed_fp8_mma": 16}


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
def _dense_tile(w_tab, j, r, c, mask, C, dtype):
    """Expert j's dense weight W [R, C] at rows r x columns c."""
    w = tl.load(w_tab + j).to(tl.pointer_type(dtype))
    return tl.load(w + r.to(tl.int64) * C + c, mask=mask, other=0.0)


@triton.jit
def _packed_rows_dot(acc, xrow, xm, w_tab, s_tab, j, rn, nm, C, kb_lo, kb_hi, BN: tl.constexpr, U: tl.constexpr,
                     FP4: tl.constexpr, DOT_BF16: tl.constexpr, ASM: tl.constexpr, ALIGNED: tl.constexpr):
    """acc [BM, BN] + x W[rn]^T over the 32-wide column blocks kb_lo .. kb_hi - 1 for expert j's packed weight W
    [R, C] (`packed_rows_dot`): x's rows at the pointers xrow [BM, 1] (mask xm)."""
    codes = tl.load(w_tab + j).to(tl.pointer_type(tl.uint8))
    if ALIGNED:                                        # every expert's codes at a multiple of 16 bytes (checked)
        codes = tl.multiple_of(codes, 16)
    scales = tl.load(s_tab + j).to(tl.pointer_type(tl.uint8))
    return packed_rows_dot(acc, xrow, xm, codes, scales, rn, nm, C, kb_lo, kb_hi, BN, U, FP4, DOT_BF16, ASM)


@triton.jit
def _fp8_rows_dot(acc, xrow, xm, w_tab, s_tab, j, rn, nm, C, kb_lo, kb_hi, BN: tl.constexpr, FP4: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """`_packed_rows_dot` on the FP8 tensor cores (bf16 models, x FP8-QDQ'd): `fp8_decode.fp8_rows_dot_t`, the
    weight's rows on the MMA's wide side, transposed back to acc's [BM, BN]."""
    codes = tl.load(w_tab + j).to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        codes = tl.multiple_of(codes, 16)
    scales = tl.load(s_tab + j).to(tl.pointer_type(tl.uint8))
    acc_t = fp8_rows_dot_t(tl.zeros([BN, acc.shape[0]], tl.float32), xrow, xm, codes, scales, rn, nm, C, kb_lo,
                           kb_hi, BN, FP4)
    return acc + tl.trans(acc_t)


@triton.jit
def _up_finish(acc_g, acc_u, s, sm, f, fm, order_ptr, pw_ptr, h_ptr, F, limit, floor, max_inv, CLAMP: tl.constexpr,
               QUANT: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr, GROUP: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    """The up kernel's epilogue for the slots s [BM] (mask sm) x hidden columns f [BF]: gate / up rounded to the
    weights' dtype, `expert_act_ref`'s math, times the routing weight, w2's FP8 QDQ -> h."""
    pair = tl.load(order_ptr + s, mask=sm, other=0).to(tl.int64)
    a = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)                    # the Linears' outputs
    b = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
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
def _moe_up_kernel(x_ptr, w1_tab, w3_tab, s1_tab, s3_tab, order_ptr, pw_ptr, counts_ptr, offs_ptr, h_ptr, part_ptr,
                   e0, D, F, KP, P, kb_per_split, limit, floor, max_inv, CLAMP: tl.constexpr, QUANT: tl.constexpr,
                   BM: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GROUP: tl.constexpr, DOT_BF16: tl.constexpr,
                   LIBDEVICE: tl.constexpr, PACKED: tl.constexpr, FP4: tl.constexpr, U: tl.constexpr,
                   ASM: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr, FP8MMA: tl.constexpr):
    """Program (expert j, F tile, split part): gate and up of the expert's slots over the part's 32-wide blocks
    of D (packed weights; dense: all of D, SPLIT 1). SPLIT 1: the epilogue (`_up_finish`) -> h; else the fp32
    partials at part_ptr[0 or 1, part, slot, f] (`_moe_up_finish_kernel` adds them in part order)."""
    j = tl.program_id(0)
    e = e0 + j
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = f < F
    part = tl.program_id(2)
    n_e = tl.load(counts_ptr + e)
    start = tl.load(offs_ptr + e)
    m = tl.arange(0, BM)
    d = tl.arange(0, BD)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        pair = tl.load(order_ptr + s, mask=sm, other=0).to(tl.int64)
        tok = pair // KP
        acc_g = tl.zeros([BM, BF], tl.float32)
        acc_u = tl.zeros([BM, BF], tl.float32)
        if PACKED:
            xrow = x_ptr + tok[:, None] * D
            xm = sm[:, None]
            lo = part * kb_per_split
            hi = tl.minimum(lo + kb_per_split, D >> 5)
            if FP8MMA:
                acc_g = _fp8_rows_dot(acc_g, xrow, xm, w1_tab, s1_tab, j, f, fm, D, lo, hi, BF, FP4, ALIGNED)
                acc_u = _fp8_rows_dot(acc_u, xrow, xm, w3_tab, s3_tab, j, f, fm, D, lo, hi, BF, FP4, ALIGNED)
            else:
                acc_g = _packed_rows_dot(acc_g, xrow, xm, w1_tab, s1_tab, j, f, fm, D, lo, hi, BF, U, FP4, DOT_BF16,
                                         ASM, ALIGNED)
                acc_u = _packed_rows_dot(acc_u, xrow, xm, w3_tab, s3_tab, j, f, fm, D, lo, hi, BF, U, FP4, DOT_BF16,
                                         ASM, ALIGNED)
        else:
            for d0 in range(0, D, BD):
                dm = d0 + d < D
                xt = tl.load(x_ptr + tok[:, None] * D + (d0 + d)[None, :], mask=sm[:, None] & dm[None, :],
                             other=0.0)
                fr, dc = f[None, :], (d0 + d)[:, None]                         # [BD, BF]: W^T tiles
                wmask = fm[None, :] & dm[:, None]
                dt = x_ptr.dtype.element_ty
                acc_g = _dot(xt, _dense_tile(w1_tab, j, fr, dc, wmask, D, dt), acc_g, DOT_BF16)
                acc_u = _dot(xt, _dense_tile(w3_tab, j, fr, dc, wmask, D, dt), acc_u, DOT_BF16)
        if SPLIT == 1:
            _up_finish(acc_g, acc_u, s, sm, f, fm, order_ptr, pw_ptr, h_ptr, F, limit, floor, max_inv, CLAMP, QUANT,
                       BM, BF, GROUP, LIBDEVICE)
        else:
            off = (part * P + s)[:, None] * F + f[None, :]
            mask = sm[:, None] & fm[None, :]
            tl.store(part_ptr + off, acc_g, mask=mask)
            tl.store(part_ptr + SPLIT * P * F + off, acc_u, mask=mask)


@triton.jit
def _moe_up_finish_kernel(part_ptr, order_ptr, pw_ptr, counts_ptr, offs_ptr, h_ptr, e0, F, P, limit, floor,
                          max_inv, CLAMP: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr,
                          GROUP: tl.constexpr, LIBDEVICE: tl.constexpr, SPLIT: tl.constexpr):
    """Program (expert j, F tile): the up kernel's split partials added in part order (0 + p_0 + p_1 + ...), then
    its epilogue."""
    j = tl.program_id(0)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = f < F
    n_e = tl.load(counts_ptr + e0 + j)
    start = tl.load(offs_ptr + e0 + j)
    m = tl.arange(0, BM)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        mask = sm[:, None] & fm[None, :]
        acc_g = tl.zeros([BM, BF], tl.float32)
        acc_u = tl.zeros([BM, BF], tl.float32)
        for p in tl.static_range(SPLIT):
            off = (p * P + s)[:, None] * F + f[None, :]
            acc_g += tl.load(part_ptr + off, mask=mask, other=0.0)
            acc_u += tl.load(part_ptr + SPLIT * P * F + off, mask=mask, other=0.0)
        _up_finish(acc_g, acc_u, s, sm, f, fm, order_ptr, pw_ptr, h_ptr, F, limit, floor, max_inv, CLAMP, QUANT,
                   BM, BF, GROUP, LIBDEVICE)


@triton.jit
def _moe_down_kernel(h_ptr, w2_tab, s2_tab, counts_ptr, offs_ptr, out_ptr, part_ptr, e0, D, F, P, kb_per_split,
                     BM: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, DOT_BF16: tl.constexpr,
                     PACKED: tl.constexpr, FP4: tl.constexpr, U: tl.constexpr, ASM: tl.constexpr,
                     ALIGNED: tl.constexpr, SPLIT: tl.constexpr, FP8MMA: tl.constexpr):
    """Program (expert j, D tile, split part): h W2^T of the expert's slots over the part's 32-wide blocks of F
    (packed; dense: all of F, SPLIT 1). SPLIT 1: rounded to the weights' dtype -> out; else the fp32 partial at
    part_ptr[part, slot, d] (`_moe_down_finish_kernel`)."""
    j = tl.program_id(0)
    e = e0 + j
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    part = tl.program_id(2)
    n_e = tl.load(counts_ptr + e)
    start = tl.load(offs_ptr + e)
    m = tl.arange(0, BM)
    fr = tl.arange(0, BF)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        acc = tl.zeros([BM, BD], tl.float32)
        if PACKED:
            lo = part * kb_per_split
            hi = tl.minimum(lo + kb_per_split, F >> 5)
            if FP8MMA:
                acc = _fp8_rows_dot(acc, h_ptr + s[:, None] * F, sm[:, None], w2_tab, s2_tab, j, dd, dmask, F, lo, hi,
                                    BD, FP4, ALIGNED)
            else:
                acc = _packed_rows_dot(acc, h_ptr + s[:, None] * F, sm[:, None], w2_tab, s2_tab, j, dd, dmask, F, lo,
                                       hi, BD, U, FP4, DOT_BF16, ASM, ALIGNED)
        else:
            for f0 in range(0, F, BF):
                fm = f0 + fr < F
                ht = tl.load(h_ptr + s[:, None] * F + (f0 + fr)[None, :], mask=sm[:, None] & fm[None, :], other=0.0)
                wt = _dense_tile(w2_tab, j, dd[None, :], (f0 + fr)[:, None], dmask[None, :] & fm[:, None], F,
                                 h_ptr.dtype.element_ty)
                acc = _dot(ht, wt, acc, DOT_BF16)
        mask = sm[:, None] & dmask[None, :]
        if SPLIT == 1:
            tl.store(out_ptr + s[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + (part * P + s)[:, None] * D + dd[None, :], acc, mask=mask)


@triton.jit
def _moe_down_finish_kernel(part_ptr, counts_ptr, offs_ptr, out_ptr, e0, D, P, BM: tl.constexpr, BD: tl.constexpr,
                            SPLIT: tl.constexpr):
    """Program (expert j, D tile): the down kernel's split partials added in part order, rounded -> out."""
    j = tl.program_id(0)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    n_e = tl.load(counts_ptr + e0 + j)
    start = tl.load(offs_ptr + e0 + j)
    m = tl.arange(0, BM)
    for m0 in range(0, n_e, BM):
        sm = m0 + m < n_e
        s = (start + m0 + m).to(tl.int64)
        mask = sm[:, None] & dmask[None, :]
        acc = tl.zeros([BM, BD], tl.float32)
        for p in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + (p * P + s)[:, None] * D + dd[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + s[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


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


def _storage(w) -> str:
    """"dense", or the packed kind ("fp8" / "fp4") of one expert weight."""
    return w.kind if isinstance(w, PackedWeight) else "dense"


def _groups(w1, w3, w2) -> list[tuple[int, int]]:
    """(first expert, count) runs that one launch each serves: the routed experts and the shared one (id E) share a
    launch when all are held alike, else (e.g. fp4 routed experts, an fp8 shared expert) they launch apart."""
    E = len(w1) - 1
    kinds = {(_storage(a), _storage(b), _storage(c)) for a, b, c in zip(w1, w3, w2)}
    routed = {(_storage(a), _storage(b), _storage(c)) for a, b, c in zip(w1[:E], w3[:E], w2[:E])}
    if len(routed) > 1 or any(len(set(k)) > 1 for k in kinds):
        raise ValueError(f"moe_experts (triton): every routed expert's w1, w3, w2 must be held alike, got {kinds}")
    return [(0, E + 1)] if len(kinds) == 1 else [(0, E), (E, 1)]


def _tables(ws, dev) -> tuple[torch.Tensor, torch.Tensor, bool, bool, bool]:
    """(address table of the weights or of their codes, of their scales (the codes' again when dense), packed, fp4,
    every packed weight's codes at a multiple of 16 bytes: the kernels' 16-byte vector loads)."""
    if isinstance(ws[0], PackedWeight):
        for w in ws:
            check_offsets(w)
        codes = _address_table([w.codes for w in ws], dev)
        aligned = all(w.codes.data_ptr() % 16 == 0 for w in ws)
        return codes, _address_table([w.scale for w in ws], dev), True, ws[0].kind == "fp4", aligned
    t = _address_table(ws, dev)
    return t, t, False, False, False


def _check(w1, w3, w2, F: int, D: int, dt: torch.dtype) -> None:
    for what, ws, shape in (("w1", w1, (F, D)), ("w3", w3, (F, D)), ("w2", w2, (D, F))):
        for w in ws:
            packed = isinstance(w, PackedWeight)
            ok = tuple(w.shape) == shape and w.dtype == dt and (packed or w.is_contiguous())
            if packed:
                ok = ok and w.codes.is_contiguous() and w.scale.is_contiguous()
            if not ok:
                raise ValueError(f"moe_experts (triton): every {what} must be a contiguous {dt} {list(shape)} (dense "
                                 f"or packed), got {w.dtype} {list(w.shape)}")


def _split(cfg: dict, packed: bool, tiles: int, C: int, U: int, device: torch.device) -> tuple[int, int]:
    """(parts, 32-wide blocks per part) of the reduced width C of a packed expert GEMM: split until about
    `packed_programs_per_sm` programs per SM for `tiles` busy (expert, output tile) programs, each part at least 2
    steps of U blocks, at most `packed_split` parts; dense weights and decode-free calls: no split."""
    kb = C // 32
    if not packed or cfg["packed_split"] <= 1:
        return 1, kb
    want = triton.cdiv(cfg["packed_programs_per_sm"] * sm_count(device), max(1, tiles))
    parts = max(1, min(want, cfg["packed_split"], kb // (2 * U)))
    per = triton.cdiv(triton.cdiv(kb, parts), U) * U
    return triton.cdiv(kb, per), per


def _tiles(cfg: dict, packed: bool) -> tuple[int, int, int]:
    """(up kernel's F tile, down kernel's D tile, warps) over packed or dense expert weights."""
    if packed:
        return cfg["packed_block_f"], cfg["packed_down_block_d"], cfg["packed_num_warps"]
    return cfg["up_block_f"], cfg["down_block_d"], cfg["num_warps"]


def moe_experts_triton(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: Sequence[torch.Tensor],
                       w3: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], limit: float, quant_in: bool,
                       quant_mid: bool, **over) -> torch.Tensor:
    """Triton twin of `moe_experts_ref` (same arguments; keyword overrides of CONFIG) -> [N, D] in x's dtype. The
    weights are dense tensors or `PackedWeight`s (fp4 / fp8 bytes decoded in registers, `packed_block`)."""
    cfg = {**CONFIG, **over}
    N, D = x.shape
    E = len(w1) - 1
    F = w1[0].shape[0]
    dt = x.dtype
    _check(w1, w3, w2, F, D, dt)
    if F % FP8_GROUP:
        raise ValueError(f"moe_experts (triton): the hidden width must be a multiple of {FP8_GROUP}, got {F}")
    for key in ("up_block_f", "packed_block_f"):
        if cfg[key] % FP8_GROUP:
            raise ValueError(f"moe_experts (triton): {key} must be a multiple of {FP8_GROUP}, got {cfg[key]}")
    groups = _groups(w1, w3, w2)
    dev = x.device
    y = torch.empty(N, D, dtype=dt, device=dev)
    if N == 0:
        return y
    xq = qdq_fp8_triton(x) if quant_in else x.contiguous()
    KP = indices.size(1) + 1                                                # pairs per token: K routed + shared
    route = moe_route_triton if N * KP <= ROUTE_MAX_PAIRS else moe_route_ref   # no host sync either way
    order, inv, pw, counts, offs = route(indices, weights, E)
    h = torch.empty(N * KP, F, dtype=dt, device=dev)
    out = torch.empty(N * KP, D, dtype=dt, device=dev)
    BM = cfg["block_m"]
    P = N * KP
    fp8mma = (0 < cfg["packed_fp8_mma"] <= N and dt == torch.bfloat16 and dev.type == "cuda" and not INTERPRET
              and torch.cuda.get_device_capability(dev) >= (8, 9))
    for e0, n in groups:
        t1, s1, packed, fp4, al1 = _tables(w1[e0:e0 + n], dev)
        t3, s3, _, _, al3 = _tables(w3[e0:e0 + n], dev)
        BF, BD2, nw = _tiles(cfg, packed)
        U = cfg["packed_unroll"]
        active = min(n, N * (KP - 1)) if e0 < E else 1          # experts of the group with slots (at most)
        sp1, kb1 = _split(cfg, packed, active * triton.cdiv(F, BF), D, U, dev)
        parts = torch.empty(2 * sp1 * P * F if sp1 > 1 else 1, dtype=torch.float32, device=dev)
        quant = dict(CLAMP=limit > 0, QUANT=bool(quant_mid), BM=BM, BF=BF, GROUP=FP8_GROUP, LIBDEVICE=not INTERPRET,
                     SPLIT=sp1)
        LAST['moe_up'] = _moe_up_kernel[(n, triton.cdiv(F, BF), sp1)](
            xq, t1, t3, s1, s3, order, pw, counts, offs, h, parts, e0, D, F, KP, P, kb1, float(limit),
            FP8_AMAX_FLOOR, FP8_MAX_INV, BD=cfg["up_block_d"], DOT_BF16=DOT_BF16, PACKED=packed, FP4=fp4, U=U,
            ASM=ASM, ALIGNED=al1 and al3, FP8MMA=packed and fp8mma and bool(quant_in), num_warps=nw,
            enable_fp_fusion=False, **quant)
        if sp1 > 1:
            _moe_up_finish_kernel[(n, triton.cdiv(F, BF))](
                parts, order, pw, counts, offs, h, e0, F, P, float(limit), FP8_AMAX_FLOOR, FP8_MAX_INV, num_warps=4,
                enable_fp_fusion=False, **quant)
        t2, s2, packed, fp4, al2 = _tables(w2[e0:e0 + n], dev)
        sp2, kb2 = _split(cfg, packed, active * triton.cdiv(D, BD2), F, U, dev)
        parts = torch.empty(sp2 * P * D if sp2 > 1 else 1, dtype=torch.float32, device=dev)
        LAST['moe_down'] = _moe_down_kernel[(n, triton.cdiv(D, BD2), sp2)](
            h, t2, s2, counts, offs, out, parts, e0, D, F, P, kb2, BM=BM, BD=BD2, BF=cfg["down_block_f"],
            DOT_BF16=DOT_BF16, PACKED=packed, FP4=fp4, U=U, ASM=ASM, ALIGNED=al2, SPLIT=sp2,
            FP8MMA=packed and fp8mma and bool(quant_mid), num_warps=nw)
        if sp2 > 1:
            _moe_down_finish_kernel[(n, triton.cdiv(D, BD2))](parts, counts, offs, out, e0, D, P, BM=BM, BD=BD2,
                                                              SPLIT=sp2, num_warps=4)
    BC = cfg["combine_block_d"]
    _moe_combine_kernel[(N, triton.cdiv(D, BC))](out, inv, y, D, KP, BD=BC, num_warps=4)
    return y


# ------------------------------------------------------------------------------------------------ routing

ROUTE_MAX_PAIRS = 1024          # N (K + 1) up to this: the one-program routing kernel (its tiles are [pairs, 32])


@triton.jit
def _route_entry(idx_ptr, q, N, K, E, BK: tl.constexpr):
    """Entries q of the [N, K + 1] grid (column K: the shared expert) -> (valid, routed, expert id, pair): the pair
    is t (K + 1) + the entry's stable rank in its token's row (smaller ids first, equal ids by column)."""
    KP = K + 1
    qm = q < N * KP
    t = q // KP
    j = q % KP
    routed = qm & (j < K)
    e = tl.where(routed, tl.load(idx_ptr + t * K + j, mask=routed, other=0).to(tl.int32), E)
    k = tl.arange(0, BK)
    km = qm[:, None] & (k[None, :] < K)
    row = tl.load(idx_ptr + t[:, None] * K + k[None, :], mask=km, other=0).to(tl.int32)
    before = km & ((row < e[:, None]) | ((row == e[:, None]) & (k[None, :] < j[:, None])))
    return qm, routed, e, t * KP + tl.sum(before.to(tl.int32), axis=1)         # the shared entry's rank: K


@triton.jit
def _moe_route_kernel(idx_ptr, w_ptr, order_ptr, inv_ptr, pw_ptr, counts_ptr, offs_ptr, N, K, E,
                      BP: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr, BE: tl.constexpr):
    """One program: `moe_route_ref`'s outputs in closed form. Each entry's slot = #{entries of a smaller expert} +
    #{entries of its expert with a smaller pair}, counted over the entries BQ at a time; counts and offsets per
    expert BE at a time."""
    q = tl.arange(0, BP)
    qm, routed, e, pair = _route_entry(idx_ptr, q, N, K, E, BK)
    w = tl.where(routed, tl.load(w_ptr + (q // (K + 1)) * K + q % (K + 1), mask=routed, other=0.0).to(tl.float32),
                 1.0)
    slot = tl.zeros([BP], tl.int32)
    for q0 in range(0, N * (K + 1), BQ):
        qm2, _, e2, pair2 = _route_entry(idx_ptr, q0 + tl.arange(0, BQ), N, K, E, BK)
        less = (e2[None, :] < e[:, None]) | ((e2[None, :] == e[:, None]) & (pair2[None, :] < pair[:, None]))
        slot += tl.sum((less & qm2[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + slot, pair.to(tl.int64), mask=qm)
    tl.store(inv_ptr + pair, slot.to(tl.int64), mask=qm)
    tl.store(pw_ptr + pair, w, mask=qm)
    for e0 in range(0, E + 1, BE):
        ev = e0 + tl.arange(0, BE)
        cnt = tl.sum(((e[None, :] == ev[:, None]) & qm[None, :]).to(tl.int32), axis=1)
        below = tl.sum(((e[None, :] < ev[:, None]) & qm[None, :]).to(tl.int32), axis=1)
        tl.store(counts_ptr + ev, cnt.to(tl.int64), mask=ev <= E)
        tl.store(offs_ptr + ev, below.to(tl.int64), mask=ev <= E)


def moe_route_triton(indices: torch.Tensor, weights: torch.Tensor, n_experts: int):
    """Triton twin of `moe_route_ref` (same arguments and outputs; exact: integer counts), one program, for at most
    ROUTE_MAX_PAIRS pairs."""
    N, K = indices.shape
    P = N * (K + 1)
    if P > ROUTE_MAX_PAIRS:
        raise ValueError(f"moe_route: {P} pairs, the one-program kernel takes at most {ROUTE_MAX_PAIRS}")
    dev = indices.device
    order = torch.empty(P, dtype=torch.long, device=dev)
    inv = torch.empty(P, dtype=torch.long, device=dev)
    pw = torch.empty(P, dtype=torch.float32, device=dev)
    counts = torch.empty(n_experts + 1, dtype=torch.long, device=dev)
    offs = torch.empty(n_experts + 1, dtype=torch.long, device=dev)
    if P == 0:
        return order, inv, pw, counts.zero_(), offs.zero_()
    BP = triton.next_power_of_2(P)
    LAST["moe_route"] = _moe_route_kernel[(1,)](
        indices.contiguous(), weights.contiguous(), order, inv, pw, counts, offs, N, K, n_experts, BP=BP,
        BK=triton.next_power_of_2(K), BQ=min(BP, 32), BE=64, num_warps=8 if BP >= 512 else 4)
    return order, inv, pw, counts, offs


# ------------------------------------------------------------------------------------------------ gate

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


@triton.jit
def _moe_gate_kernel(x_ptr, w_ptr, b_ptr, wout_ptr, iout_ptr, s_ptr, E, D, temp, route_scale, K: tl.constexpr,
                     KP: tl.constexpr, SCORE: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    """Token t: z = x_t W^T in fp32 (BK of D at a time) / temp, the scores, top-K of scores + bias by repeated
    argmax (the lowest id among equal values), the weights at them (normalised, x route_scale)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    k = tl.arange(0, BK)
    z = tl.zeros([BE], tl.float32)
    for k0 in range(0, D, BK):
        km = k0 + k < D
        xv = tl.load(x_ptr + t * D + k0 + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * D + k0 + k[None, :], mask=em[:, None] & km[None, :], other=0.0)
        z += tl.sum(w.to(tl.float32) * xv[None, :], 1)
    z = z / temp
    if SCORE == 0:                                                   # softmax
        ex = tl.exp(tl.where(em, z, float("-inf")) - tl.max(tl.where(em, z, float("-inf")), 0))
        sc = ex / tl.sum(ex, 0)
    elif SCORE == 1:                                                 # sigmoid
        sc = 1.0 / (1.0 + tl.exp(-z))
    else:                                                            # sqrt(softplus), softplus = z above 20
        if LIBDEVICE:
            sp = libdevice.log1p(libdevice.exp(z))
        else:
            sp = tl.log(1.0 + tl.exp(z))
        sc = tl.sqrt(tl.where(z > 20.0, z, sp))
    tl.store(s_ptr + t * E + e, sc, mask=em)
    sel = tl.where(em, sc + tl.load(b_ptr + e, mask=em, other=0.0), float("-inf"))
    kk = tl.arange(0, KP)                                            # K padded to a power of two
    idx = tl.zeros([KP], tl.int32)
    wts = tl.zeros([KP], tl.float32)
    for i in tl.static_range(K):
        top = tl.max(sel, 0)
        j = tl.min(tl.where(sel == top, e, BE), 0)
        idx = tl.where(kk == i, j, idx)
        wts = tl.where(kk == i, tl.sum(tl.where(e == j, sc, 0.0), 0), wts)
        sel = tl.where(e == j, float("-inf"), sel)
    if NORM:
        wts = wts / (tl.sum(wts, 0) + 1e-20)
    tl.store(wout_ptr + t * K + kk, wts * route_scale, mask=kk < K)
    tl.store(iout_ptr + t * K + kk, idx.to(tl.int64), mask=kk < K)


# block_k 0: a [experts padded, K block] tile of 32768 weights, the K block within 16 .. D padded. The H200 sweep
# at v41-geometry's gate (16 experts, D 5120; 2026-12-07, `benchmarks/packed_gemm.py --sweep-gate`,
# benchmarks/results/gpu_misc_h200-2026-12-07e.log), 4 warps, 1 token: K block 256 (the old rule, 4096 / experts,
# at most 256) 27.9 us a call, 512 12.6, 1024 9.2, 2048 8.0 (this rule there; 32 tokens: 28.9 -> 8.7); same ids.
GATE_CONFIG = {"block_k": 0, "num_warps": 4}


def moe_gate_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str,
                    gate_temp: float, norm_topk_prob: bool, route_scale: float, **over):
    """Twin of `moe_gate_ref` (same arguments and outputs), a program per token; `over`: GATE_CONFIG keys (the
    benchmark's sweep, `benchmarks/packed_gemm.py --sweep-gate`)."""
    cfg = {**GATE_CONFIG, **over}
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"moe_gate (triton): score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    N, D = x.shape
    E = weight.size(0)
    if not 0 < topk <= E:
        raise ValueError(f"moe_gate (triton): top-{topk} of {E} experts")
    dev = x.device
    wout = torch.empty(N, topk, dtype=torch.float32, device=dev)
    iout = torch.empty(N, topk, dtype=torch.long, device=dev)
    scores = torch.empty(N, E, dtype=torch.float32, device=dev)
    if N:
        BE = triton.next_power_of_2(E)
        LAST["moe_gate"] = _moe_gate_kernel[(N,)](
            aligned_rows(x, D), aligned_rows(weight, D), bias.float().contiguous(), wout, iout, scores, E, D,
            float(gate_temp), float(route_scale), K=topk, KP=triton.next_power_of_2(topk), SCORE=SCORE_FUNCS.index(score_func),
            NORM=bool(norm_topk_prob) and topk > 1, BE=BE,
            BK=cfg["block_k"] or min(triton.next_power_of_2(D), max(16, 32768 // BE)),
            LIBDEVICE=not INTERPRET, num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return wout, iout, scores

