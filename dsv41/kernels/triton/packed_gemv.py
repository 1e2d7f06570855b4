"""Decode GEMMs of a few rows over a weight held packed, on the CUDA cores, and the in-kernel split-K sum that the
decode kernels share: twin of `dsv41.kernels.gemm_ref.packed_linear_ref` for calls of a few rows (packed_gemm.py
routes calls of up to its `GEMV_ROWS` here).

Legend: M rows of x (at most MB, a power of two), N output features, K input features (a multiple of 32); BN
output features per program, U 32-wide K blocks per loop step, S split-K parts.

Why a second decode kernel: at one to a few rows the tensor-core kernel (packed_gemm.py) pads x to 16 rows and
moves every decoded block through the tensor cores' operand layout, work that does not shrink with M; here each
program streams its BN rows of W as [BN, 32 U] bytes (16-byte loads along K, no mask along K: U divides K / 32),
decodes them in registers (fp8: the hardware's e4m3 conversion; fp4: `e2m1_f16`, the nibbles as fp16 times 2^-6,
the 2^6 folded into the block's scale), multiplies by x's MB rows, sums each 32-wide block's 32 products in fp32,
scales each block's partial by its power of two (exact), sums a step's U scaled partials and adds the steps in K
order, promoting each block as the official GEMM does (docs/model.md §9). The products are exact (x is FP8-QDQ'd, the weight's codes exact in fp32); only the
order of the additions inside a step differs from the CPU reference (the GPU tolerance is measured:
tests/test_kernels_packed_gemm.py).

Split-K without a second kernel (`splitk_finish`): when N / BN tiles leave SMs idle, K is split into S parts; each
part stores its fp32 partial [M, BN] and counts itself done on the tile's counter (a device int32, atomically, after
a barrier: the partial is visible before the count); the part that finds S - 1 parts done adds the S partials in
part order (a fixed order: the result does not depend on which part finishes last), adds the bias, casts, stores
y, and resets the counter to 0 for the next call (so CUDA-graph replays need no memset). The earlier decode path
summed the parts with torch (`out.sum(0)`, then the bias and the cast): two or three more launches per GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import ASM, LAST, sm_count
from dsv41.kernels.triton.decoders import e2m1_f16, e4m3_to_f32, ue8m0_to_f32

__all__ = ["packed_gemv_triton", "splitk_finish", "tile_counters", "MAX_ROWS", "GEMV_CONFIG", "gemv_unroll"]

MAX_ROWS = 16           # x's rows live in registers beside the decoded tile: a few only
GEMV_CONFIG = {"block_n": 64, "unroll": 4, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}

_COUNTERS: dict = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """The split-K counters of a device (int32 zeros, at least n; every finishing part resets its tile's to 0).
    Allocated once per device, outside any CUDA-graph capture where the first call is a warm-up (as the graph
    runner's is)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


@triton.jit
def splitk_finish(acc, part, ws_ptr, cnt_ptr, b_ptr, y_ptr, rm, rn, mm, nm, M, N, S, HAS_BIAS: tl.constexpr):
    """acc [R, BN] is split part `part`'s fp32 partial of the y tile (rows rm, columns rn): stored at ws[part],
    counted on cnt_ptr (this tile's counter); the last part to finish sums ws[0..S-1] in order (+ bias), casts into
    y and resets the counter. With S == 1 it stores acc (+ bias) directly."""
    mask = mm[:, None] & nm[None, :]
    off = rm[:, None].to(tl.int64) * N + rn[None, :]
    if S == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + part.to(tl.int64) * M * N + off, acc, mask=mask)
        tl.debug_barrier()                                   # every thread's partial stored before the count
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tot = tl.load(ws_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
            for p in range(1, S):
                tot += tl.load(ws_ptr + p * M * N + off, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + off, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _packed_gemv_kernel(x_ptr, c_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, kb_per_split, S,
                        FP4: tl.constexpr, HAS_BIAS: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                        U: tl.constexpr, ASM: tl.constexpr):
    """Columns [BN] of y's M rows over the 32-wide K blocks of split part program_id(1), U blocks a step."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, MB)
    mm = rm < M
    KB = K >> 5
    kb_lo = tl.program_id(1) * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
    ub = tl.arange(0, U)
    acc = tl.zeros([MB, BN], tl.float32)
    xrow = x_ptr + rm[:, None].to(tl.int64) * K
    if FP4:
        j = tl.arange(0, 16 * U)                             # byte j of a step: columns 2j, 2j + 1 of the step
        wrow = c_ptr + rn[:, None] * (KB * 16)
        for kb0 in range(kb_lo, kb_hi, U):
            byt = tl.load(wrow + (kb0 * 16 + j)[None, :], mask=nm[:, None], other=0)
            lo, hi = e2m1_f16(byt, ASM)                      # [BN, 16 U] each, the values * 2^-6
            xe = tl.load(xrow + (kb0 * 32 + 2 * j)[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
            xo = tl.load(xrow + (kb0 * 32 + 1 + 2 * j)[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
            prod = lo.to(tl.float32)[None, :, :] * xe[:, None, :] + hi.to(tl.float32)[None, :, :] * xo[:, None, :]
            blocks = tl.sum(tl.reshape(prod, [MB, BN, U, 16]), axis=3)                      # [MB, BN, U]
            sc = ue8m0_to_f32(tl.load(s_ptr + rn[:, None] * KB + (kb0 + ub)[None, :], mask=nm[:, None],
                                      other=0).to(tl.int32)) * 64.0                          # [BN, U]
            acc = _add_blocks(acc, blocks, sc, U)
    else:
        j = tl.arange(0, 32 * U)
        wrow = c_ptr + rn[:, None] * K
        for kb0 in range(kb_lo, kb_hi, U):
            byt = tl.load(wrow + (kb0 * 32 + j)[None, :], mask=nm[:, None], other=0)
            if ASM:
                w = byt.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = e4m3_to_f32(byt.to(tl.int32))
            xv = tl.load(xrow + (kb0 * 32 + j)[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
            blocks = tl.sum(tl.reshape(w[None, :, :] * xv[:, None, :], [MB, BN, U, 32]), axis=3)
            sc = ue8m0_to_f32(tl.load(s_ptr + (rn >> 5)[:, None] * KB + (kb0 + ub)[None, :], mask=nm[:, None],
                                      other=0).to(tl.int32))
            acc = _add_blocks(acc, blocks, sc, U)
    splitk_finish(acc, tl.program_id(1), ws_ptr, cnt_ptr + tl.program_id(0), b_ptr, y_ptr, rm, rn, mm, nm, M, N, S, HAS_BIAS)


@triton.jit
def _add_blocks(acc, blocks, sc, U: tl.constexpr):
    """acc [MB, BN] + the U blocks' partials [MB, BN, U] times their scales [BN, U] (the step's U scaled partials
    summed first, then added: the steps in K order)."""
    return acc + tl.sum(blocks * sc[None, :, :], axis=2)


def gemv_unroll(KB: int, want: int) -> int:
    """The largest power of two at most `want` dividing KB (the kernel's steps then need no mask along K)."""
    u = 1
    while u * 2 <= want and KB % (u * 2) == 0:
        u *= 2
    return u


def packed_gemv_triton(a: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """a [M, K] (M <= MAX_ROWS, contiguous) W^T (+ bias) -> [M, N] in the weight's held dtype."""
    N, K = weight.shape
    M = a.size(0)
    cfg = config or GEMV_CONFIG
    if M > MAX_ROWS or K % 32:
        raise ValueError(f"packed_gemv: {M} rows x K {K} (at most {MAX_ROWS} rows, K a multiple of 32)")
    y = torch.empty(M, N, dtype=weight.dtype, device=a.device)
    KB = K // 32
    BN, U = cfg["block_n"], gemv_unroll(KB, cfg["unroll"])
    tiles = triton.cdiv(N, BN)
    want = triton.cdiv(cfg["programs_per_sm"] * sm_count(a.device), tiles)
    split = max(1, min(want, KB // (2 * U), weight.nbytes // (16 * M * N)))
    kb_per_split = triton.cdiv(triton.cdiv(KB, split), U) * U
    split = triton.cdiv(KB, kb_per_split)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=a.device) if split > 1 else y
    cnt = tile_counters(a.device, tiles)
    LAST["packed_gemv"] = _packed_gemv_kernel[(tiles, split)](
        a, weight.codes, weight.scale, bias if bias is not None else a, y, ws, cnt, M, N, K, kb_per_split, split,
        FP4=weight.kind == "fp4", HAS_BIAS=bias is not None, MB=max(1, triton.next_power_of_2(M)), BN=BN, U=U,
        ASM=ASM, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
