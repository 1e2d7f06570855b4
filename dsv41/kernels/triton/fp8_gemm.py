"""Prefill-size GEMM over an fp8 weight on the FP8 tensor cores, with the official per-32 K-block promotion: the
prefill twin of `packed_linear_triton`'s decode kernel, reference `dsv41.kernels.gemm_ref.packed_linear_ref`.

Legend: M rows of x, N output features, K input features (a multiple of 32); KB = K / 32 blocks; BM / BN tiles.

y = x W^T (+ bias): x [M, K] is FP8-QDQ'd along K in groups of 32 (`act_quant`, docs/model.md §9: every packed
Linear's input), W [N, K] held as e4m3 codes with one e8m0 scale per 32 x 32 tile.
1. `quant_rows_triton` (reference: gemm_ref's `quant_rows_ref`): x's e4m3 codes and one power-of-two scale per
   row and block. For a QDQ'd x this is exact (x = code x scale in every block; the scale may be a smaller power
   of two than act_quant's, the codes then larger, still exact in e4m3), so the GEMM below computes x W^T of the
   same x, not of a re-rounded one.
2. `_fp8_gemm_kernel`: each [BM, BN] tile walks K one 32-wide block at a time: the FP8 tensor cores' fp32 partial
   of the block (one K = 32 wgmma; every product exact) times the row's and the tile's scales (powers of two:
   exact), added to the fp32 accumulator in K order, as the official GEMM promotes each block. Hopper's FP8 tensor
   cores keep about 14 bits while they sum the 32 products of a block (DeepSeek-V3 report §3.3.2): the partial is
   promoted after every block, so that error stays inside one block: 0.7-1.0e-4 relative per row measured on an
   H100 (tests/test_kernels_fp8_gemm.py, pytest -s), below a bf16 output's rounding (2^-9), which is why only bf16
   models may take this path (an fp32 model's GEMMs keep the exact bf16-operand kernels).
Operands cross HBM as 1 byte per element instead of bf16's 2 and the weight is not decoded into a scratch copy.
Speed (H100, M = 4096, v41-geometry fp8 shapes): 185-263 TFLOP/s, 0.26-0.35 x the bf16 GEMM and 13-19% of torch's
per-tensor FP8 GEMM (1,396 TFLOP/s): a K = 32 wgmma per promotion leaves the tensor cores waiting on the fp32
scaling. `packed_gemm.FP8_PREFILL` routes prefill calls here (off by default until a deeper K step, e.g. two
warpgroups alternating blocks as DeepGEMM does, makes it pay).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import INTERPRET, LAST
from dsv41.kernels.triton.decoders import ue8m0_to_f32

__all__ = ["fp8_linear_triton", "quant_rows_triton", "fp8_prefill_fits", "PREFILL_CONFIG"]

AMAX_FLOOR = tl.constexpr(1e-4)             # dsv41.codecs.fp8.FP8_AMAX_FLOOR
MAX_INV = tl.constexpr(1.0 / 448.0)         # FP8_MAX_INV (fp32(1/448) once multiplied with an fp32 amax)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, BR: tl.constexpr):
    """Twin of `dsv41.kernels.gemm_ref.quant_rows_ref`. Rows rm [BR], block program_id(1): codes (e4m3) and the
    power-of-two scale 2^ceil(log2(amax / 448))."""
    rm = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    mm = rm < M
    off = rm[:, None].to(tl.int64) * K + (kb * 32 + tl.arange(0, 32))[None, :]
    x = tl.load(x_ptr + off, mask=mm[:, None], other=0.0).to(tl.float32)
    y = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR) * MAX_INV
    bits = (y.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    s = bits.to(tl.float32, bitcast=True)
    inv = (0x7F000000 - bits).to(tl.float32, bitcast=True)          # 1 / s exactly: exponent field 254 - E
    tl.store(q_ptr + off, (x * inv[:, None]).to(tl.float8e4nv), mask=mm[:, None])
    tl.store(s_ptr + rm.to(tl.int64) * (K >> 5) + kb, s, mask=mm)


def quant_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (e4m3 codes [M, K], fp32 power-of-two scales [M, K / 32])."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, K // 32, dtype=torch.float32, device=x.device)
    _quant_rows_kernel[(triton.cdiv(M, 32), K // 32)](x, q, s, M, K, BR=32, num_warps=4)
    return q, s


@triton.jit
def _fp8_gemm_kernel(q_ptr, xs_ptr, c_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, BLOCKS: tl.constexpr):
    """One [BM, BN] tile of y (tiles ordered in groups of GROUP_M tile rows, so neighbours share W in L2). Each loop
    step loads BLOCKS 32-wide K blocks and issues their dots before scaling any of them (independent tensor-core
    work in flight while the previous block's partial is scaled); the partials are added in K order."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first = (pid // (GROUP_M * tiles_n)) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    pm = first + (pid % (GROUP_M * tiles_n)) % rows
    pn = (pid % (GROUP_M * tiles_n)) // rows
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm, nm = rm < M, rn < N
    KB = K >> 5
    k = tl.arange(0, 32)
    a_ptr = q_ptr + rm[:, None].to(tl.int64) * K + k[None, :]
    w_ptr = c_ptr.to(tl.pointer_type(tl.float8e4nv)) + rn[:, None].to(tl.int64) * K + k[None, :]
    sa_ptr = xs_ptr + rm.to(tl.int64) * KB
    sb_ptr = ws_ptr + (rn >> 5) * KB
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, KB - BLOCKS + 1, BLOCKS):       # whole steps of BLOCKS blocks
        a0 = tl.load(a_ptr, mask=mm[:, None], other=0.0)
        b0 = tl.load(w_ptr, mask=nm[:, None], other=0.0)
        p0 = tl.dot(a0, tl.trans(b0))
        if BLOCKS == 2:
            a1 = tl.load(a_ptr + 32, mask=mm[:, None], other=0.0)
            b1 = tl.load(w_ptr + 32, mask=nm[:, None], other=0.0)
            p1 = tl.dot(a1, tl.trans(b1))
        acc += p0 * _tile_scale(sa_ptr, sb_ptr, kb, mm, nm)
        if BLOCKS == 2:
            acc += p1 * _tile_scale(sa_ptr, sb_ptr, kb + 1, mm, nm)
        a_ptr += 32 * BLOCKS
        w_ptr += 32 * BLOCKS
    for kb in range(KB - KB % BLOCKS, KB):              # the blocks left over (BLOCKS not dividing KB)
        a = tl.load(a_ptr, mask=mm[:, None], other=0.0)
        b = tl.load(w_ptr, mask=nm[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b)) * _tile_scale(sa_ptr, sb_ptr, kb, mm, nm)
        a_ptr += 32
        w_ptr += 32
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _tile_scale(sa_ptr, sb_ptr, kb, mm, nm):
    """Block kb's scales of the tile: x's per row times W's per 32 output features -> [BM, BN] (powers of two)."""
    sa = tl.load(sa_ptr + kb, mask=mm, other=0.0)
    sb = ue8m0_to_f32(tl.load(sb_ptr + kb, mask=nm, other=0).to(tl.int32))
    return sa[:, None] * sb[None, :]


# Prefill tiles: benchmarks/packed_gemm.py --sweep-prefill picks them on the H200 (results/packed_gemm_h200.json.gz).
PREFILL_CONFIG = {"block_m": 128, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 4, "blocks": 1}


def fp8_prefill_fits(x: torch.Tensor, weight: PackedWeight) -> bool:
    """This path serves the call: an fp8 weight held in bf16, on a GPU with FP8 tensor cores (sm_89 and later)."""
    return (weight.kind == "fp8" and weight.dtype == torch.bfloat16 and x.is_cuda and not INTERPRET
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_linear_triton(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (FP8-QDQ'd) W^T (+ bias) -> [M, N] in out_dtype (default the weight's held dtype)."""
    N, K = weight.shape
    M = x.size(0)
    if weight.kind != "fp8" or K % 32 or x.size(-1) != K:
        raise ValueError(f"fp8_linear: x {list(x.shape)} against a {weight.kind} weight {list(weight.shape)}")
    q, s = quant_rows_triton(x.contiguous())
    y = torch.empty(M, N, dtype=out_dtype or weight.dtype, device=x.device)
    cfg = PREFILL_CONFIG
    BM, BN = cfg["block_m"], cfg["block_n"]
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    if bias is not None:
        bias = bias.contiguous()
    LAST["fp8_linear"] = _fp8_gemm_kernel[grid](
        q, s, weight.codes, weight.scale, bias if bias is not None else s, y, M, N, K, HAS_BIAS=bias is not None,
        BM=BM, BN=BN, GROUP_M=cfg["group_m"], BLOCKS=cfg.get("blocks", 1), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return y
