"""Decode-size GEMMs over a weight held packed, on the FP8 tensor cores with the weight as the wide operand (swap AB):
reference `dsv41.kernels.gemm_ref.packed_linear_ref`, for bf16 models (as the prefill GEMM of fp8_gemm.py).

Legend: M rows of x (at most 64), N output features, K input features (a multiple of 32); BN output features per
program, BM = x's rows padded to a tile (16 or more), S split-K parts.

The decode kernel of packed_gemm.py decodes every weight byte to bf16 in registers and multiplies on the bf16 tensor
cores, x's rows padded to 16 on the MMA's 16-row side; here the weight's bytes are the FP8 MMA's operand as they are:
y^T [N, M] = W [N, K] x^T [K, M], the weight's N rows on the MMA's 64-row side, x's few rows on its narrow side (as
DeepGEMM does for small M). Per 32-wide K block (docs/model.md §9): the fp32 partial of W's e4m3 codes times x's
e4m3 codes (x is FP8-QDQ'd, so `quant_block` turns each block into codes and a power-of-two scale exactly, in
registers), scaled by
W's block scale (e8m0: per 32 x 32 tile for fp8, per row for fp4) and x's row scale, added to the accumulator in K
order. fp4 weights: each E2M1 nibble becomes the E4M3 byte of the same value times 2^-6 (the 3 magnitude bits under
E4M3's exponent and mantissa, the sign to bit 7: exact; the 2^6 goes into the block's scale), bytes interleaved
back into column order. K split into S parts when N / BN leaves SMs idle, summed in the kernel in part order
(`splitk.splitk_finish`).

Numerics: Hopper's FP8 MMA keeps about 14 bits while it sums a block's 32 products (fp8_gemm.py), ~1e-4 relative
per row, below a bf16 output's rounding: bf16 models only (`fp8_decode_fits`); fp32 models keep the exact kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import INTERPRET, LAST, sm_count
from dsv41.kernels.triton.decoders import ue8m0_to_f32
from dsv41.kernels.triton.fp8_gemm import AMAX_FLOOR, MAX_INV
from dsv41.kernels.triton.splitk import splitk_finish, tile_counters

__all__ = ["fp8_decode_triton", "fp8_decode_fits", "fp8_rows_dot_t", "quant_block", "weight_block_e4m3",
           "FP8_DECODE_CONFIG", "FP8_DECODE_FROM"]

# packed_gemm routes bf16 decode calls of at least this many rows per weight kind here (65: none). H100 sweep
# (benchmarks/packed_gemm.py --sweep-fp8-decode, results/packed_gemm_h100-2026-12-06.log): over the v41-geometry fp8
# shapes 87.8 us against the bf16-decode kernel's 91.9 at one row, 33-50% less time at 32-64 rows; over an expert's
# fp4 w1 + w2 29.1 against 24.9 us at one row, even at 2-8, 25-60% less at 16-64 rows.
FP8_DECODE_FROM = {"fp8": 1, "fp4": 2}
FP8_DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}


@triton.jit
def quant_block(xb):
    """x's block [R, 32] (fp32; FP8-QDQ'd values) -> (e4m3 codes [R, 32], power-of-two scales [R]): the scale
    2^ceil(log2(amax / 448)) of `quant_rows_ref`, so codes x scale = x exactly."""
    y = tl.maximum(tl.max(tl.abs(xb), axis=1), AMAX_FLOOR) * MAX_INV
    bits = (y.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    inv = (0x7F000000 - bits).to(tl.float32, bitcast=True)             # 1 / scale exactly
    return (xb * inv[:, None]).to(tl.float8e4nv), bits.to(tl.float32, bitcast=True)


@triton.jit
def weight_block_e4m3(c_ptr, s_ptr, rn, nm, kb, K, BN: tl.constexpr, FP4: tl.constexpr):
    """Block kb of W's rows rn [BN] as E4M3 codes [BN, 32] and the block's fp32 scale per row [BN]: fp8 codes as
    stored (scale per 32 x 32 tile); fp4 nibbles moved under E4M3's exponent and mantissa (value * 2^-6, exact),
    low nibble first (column order), the scale per row times 2^6."""
    KB = K >> 5
    if FP4:
        byt = tl.load(c_ptr + rn[:, None] * (KB * 16) + (kb * 16 + tl.arange(0, 16))[None, :], mask=nm[:, None],
                      other=0)
        lo, hi = byt & 15, byt >> 4
        lo = ((lo & 7) << 2) | ((lo & 8) << 4)
        hi = ((hi & 7) << 2) | ((hi & 8) << 4)
        w = tl.reshape(tl.join(lo, hi), [BN, 32]).to(tl.float8e4nv, bitcast=True)
        sb = ue8m0_to_f32(tl.load(s_ptr + rn * KB + kb, mask=nm, other=0).to(tl.int32)) * 64.0
    else:
        w = tl.load(c_ptr.to(tl.pointer_type(tl.float8e4nv)) + rn[:, None] * K + (kb * 32 + tl.arange(0, 32))[None, :],
                    mask=nm[:, None], other=0.0)
        sb = ue8m0_to_f32(tl.load(s_ptr + (rn >> 5) * KB + kb, mask=nm, other=0).to(tl.int32))
    return w, sb


@triton.jit
def fp8_rows_dot_t(acc_t, xrow, xm, c_ptr, s_ptr, rn, nm, K, kb_lo, kb_hi, BN: tl.constexpr, FP4: tl.constexpr):
    """acc_t [BN, R] + W[rn] x^T over the 32-wide blocks kb_lo .. kb_hi - 1 of K, in K order, on the FP8 tensor
    cores: x's rows at the pointers xrow [R, 1] (mask xm [R, 1]) quantized per block in registers
    (`quant_block`), W's block as E4M3 codes (`weight_block_e4m3`), each block's fp32 partial scaled by both."""
    k = tl.arange(0, 32)
    for kb in range(kb_lo, kb_hi):
        xq, sa = quant_block(tl.load(xrow + (kb * 32 + k)[None, :], mask=xm, other=0.0).to(tl.float32))
        w, sb = weight_block_e4m3(c_ptr, s_ptr, rn, nm, kb, K, BN, FP4)
        acc_t += tl.dot(w, tl.trans(xq)) * (sb[:, None] * sa[None, :])
    return acc_t


@triton.jit
def _fp8_decode_kernel(x_ptr, c_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, kb_per_split, S,
                       FP4: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Columns [BN] of y's M rows over the K blocks of split part program_id(1)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, BM)
    mm = rm < M
    kb_lo = tl.program_id(1) * kb_per_split
    acc_t = fp8_rows_dot_t(tl.zeros([BN, BM], tl.float32), x_ptr + rm[:, None].to(tl.int64) * K, mm[:, None], c_ptr,
                           ws_ptr, rn, nm, K, kb_lo, tl.minimum(kb_lo + kb_per_split, K >> 5), BN, FP4)
    splitk_finish(tl.trans(acc_t), tl.program_id(1), part_ptr, cnt_ptr + tl.program_id(0), b_ptr, y_ptr, rm, rn, mm,
                  nm, M, N, S, HAS_BIAS)


def fp8_decode_fits(x: torch.Tensor, weight: PackedWeight) -> bool:
    """This path can serve the call: a packed weight held in bf16, on a GPU with FP8 tensor cores (sm_89 on)."""
    return (weight.dtype == torch.bfloat16 and x.is_cuda and not INTERPRET
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_decode_triton(a: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """a [M, K] (M <= 64, FP8-QDQ'd, contiguous) W^T (+ bias) -> [M, N] in the weight's held dtype."""
    N, K = weight.shape
    M = a.size(0)
    if M > 64 or K % 32:
        raise ValueError(f"fp8_decode: {M} rows x K {K} (at most 64 rows, K a multiple of 32)")
    cfg = config or FP8_DECODE_CONFIG
    y = torch.empty(M, N, dtype=weight.dtype, device=a.device)
    KB, BN = K // 32, cfg["block_n"]
    tiles = triton.cdiv(N, BN)
    split = max(1, min(triton.cdiv(cfg["programs_per_sm"] * sm_count(a.device), tiles), KB // 4))
    kb_per_split = triton.cdiv(KB, split)
    split = triton.cdiv(KB, kb_per_split)
    part = torch.empty(split, M, N, dtype=torch.float32, device=a.device) if split > 1 else y
    LAST["fp8_decode"] = _fp8_decode_kernel[(tiles, split)](
        a, weight.codes, weight.scale, bias if bias is not None else a, y, part, tile_counters(a.device, tiles),
        M, N, K, kb_per_split, split, FP4=weight.kind == "fp4", HAS_BIAS=bias is not None,
        BM=max(16, triton.next_power_of_2(M)), BN=BN, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
