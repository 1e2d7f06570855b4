"""Decode-size GEMMs over a weight held packed, on the FP8 tensor cores with the weight as the wide operand (swap AB):
reference `dsv41.kernels.gemm_ref.packed_linear_ref`, for bf16 models (as the prefill GEMM of fp8_gemm.py).

Legend: M rows of x (at most 64), N output features, K input features (a multiple of 32); BN output features per
program, BM = x's rows padded to a tile (16 or more), S split-K parts.

The decode kernels of packed_gemm.py / packed_gemv.py decode every weight byte to bf16 or fp32 in registers and
multiply there or on the bf16 tensor cores; here the weight's bytes are the FP8 MMA's operand as they are:
y^T [N, M] = W [N, K] x^T [K, M], the weight's N rows on the MMA's 64-row side, x's few rows on its narrow side (as
DeepGEMM does for small M). Per 32-wide K block (docs/model.md §9): the fp32 partial of W's e4m3 codes times x's
e4m3 codes (x is FP8-QDQ'd, so `quant_rows_triton` writes it as codes and power-of-two scales exactly), scaled by
W's block scale (e8m0: per 32 x 32 tile for fp8, per row for fp4) and x's row scale, added to the accumulator in K
order. fp4 weights: each E2M1 nibble becomes the E4M3 byte of the same value times 2^-6 (the 3 magnitude bits under
E4M3's exponent and mantissa, the sign to bit 7: exact; the 2^6 goes into the block's scale), bytes interleaved
back into column order. K split into S parts when N / BN leaves SMs idle, summed in the kernel in part order
(`packed_gemv.splitk_finish`).

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
from dsv41.kernels.triton.fp8_gemm import quant_rows_triton
from dsv41.kernels.triton.packed_gemv import splitk_finish, tile_counters

__all__ = ["fp8_decode_triton", "fp8_decode_fits", "FP8_DECODE_CONFIG", "FP8_DECODE_FROM"]

FP8_DECODE_FROM = 65    # packed_gemm routes bf16 decode calls of this many rows and more here (65: none; set by
                        # benchmarks/packed_gemm.py --sweep-fp8-decode)
FP8_DECODE_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2}


@triton.jit
def _fp8_decode_kernel(q_ptr, xs_ptr, c_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, kb_per_split, S,
                       FP4: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Columns [BN] of y's M rows over the K blocks of split part program_id(1)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, BM)
    mm = rm < M
    KB = K >> 5
    kb_lo = tl.program_id(1) * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
    k = tl.arange(0, 32)
    xt_ptr = q_ptr + rm[None, :].to(tl.int64) * K + k[:, None]                    # x^T [32, BM], K-major
    if FP4:
        w_ptr = c_ptr + rn[:, None] * (KB * 16) + tl.arange(0, 16)[None, :]       # [BN, 16] bytes
        sb_ptr = ws_ptr + rn * KB
    else:
        w_ptr = c_ptr.to(tl.pointer_type(tl.float8e4nv)) + rn[:, None] * K + k[None, :]
        sb_ptr = ws_ptr + (rn >> 5) * KB
    acc = tl.zeros([BN, BM], tl.float32)
    for kb in range(kb_lo, kb_hi):
        xt = tl.load(xt_ptr + kb * 32, mask=mm[None, :], other=0.0)
        if FP4:
            byt = tl.load(w_ptr + kb * 16, mask=nm[:, None], other=0)
            lo, hi = byt & 15, byt >> 4
            lo = ((lo & 7) << 2) | ((lo & 8) << 4)                                 # E2M1 -> E4M3 (value * 2^-6)
            hi = ((hi & 7) << 2) | ((hi & 8) << 4)
            w = tl.reshape(tl.join(lo, hi), [BN, 32]).to(tl.float8e4nv, bitcast=True)
            sb = ue8m0_to_f32(tl.load(sb_ptr + kb, mask=nm, other=0).to(tl.int32)) * 64.0
        else:
            w = tl.load(w_ptr + kb * 32, mask=nm[:, None], other=0.0)
            sb = ue8m0_to_f32(tl.load(sb_ptr + kb, mask=nm, other=0).to(tl.int32))
        sa = tl.load(xs_ptr + rm * KB + kb, mask=mm, other=0.0)
        acc += tl.dot(w, xt) * (sb[:, None] * sa[None, :])
    splitk_finish(tl.trans(acc), tl.program_id(1), part_ptr, cnt_ptr + tl.program_id(0), b_ptr, y_ptr, rm, rn, mm,
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
    q, s = quant_rows_triton(a)
    y = torch.empty(M, N, dtype=weight.dtype, device=a.device)
    KB, BN = K // 32, cfg["block_n"]
    tiles = triton.cdiv(N, BN)
    split = max(1, min(triton.cdiv(cfg["programs_per_sm"] * sm_count(a.device), tiles), KB // 4))
    kb_per_split = triton.cdiv(KB, split)
    split = triton.cdiv(KB, kb_per_split)
    part = torch.empty(split, M, N, dtype=torch.float32, device=a.device) if split > 1 else y
    LAST["fp8_decode"] = _fp8_decode_kernel[(tiles, split)](
        q, s, weight.codes, weight.scale, bias if bias is not None else s, y, part, tile_counters(a.device, tiles),
        M, N, K, kb_per_split, split, FP4=weight.kind == "fp4", HAS_BIAS=bias is not None,
        BM=max(16, triton.next_power_of_2(M)), BN=BN, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
