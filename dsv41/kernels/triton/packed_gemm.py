"""Triton GEMM over a weight held as the checkpoint stores it: twin of `dsv41.kernels.gemm_ref.packed_linear_ref`.

Legend: M rows of x, N output features, K input features; BM / BN / BK tile sizes, S split-K parts.

y = x W^T (+ bias) where W [N, K] is a `PackedWeight` (docs/model.md §9): kind fp8, e4m3 codes [N, K] and one e8m0
scale per 32 x 32 tile [ceil(N/32), ceil(K/32)]; or kind fp4, e2m1 codes two a byte [N, K/2] (the even column in
the low nibble) and one e8m0 scale per row and 32 columns [N, K/32]. Each program loads its W tile's bytes, decodes
them in registers (`packed_tile`: code value times the power-of-two scale, exact), and multiplies on the tensor cores
in bf16 with fp32 accumulation: x is the FP8-QDQ'd activation (exact in bf16), the decoded weight is exact in bf16,
so every product is exact and only the summation order differs from the CPU reference (the GPU tolerance is
measured: tests/test_kernels_packed_gemm.py, benchmarks/gpu_parity.py). Only the weight's bytes cross HBM: 1 byte
(fp8) or half a byte (fp4) per weight instead of bf16's 2.

Decode-size calls (M <= 64) are bound by reading W: the grid covers N in tiles of BN and, when that leaves SMs
idle, splits K into S parts whose fp32 partials one sum adds (a fixed order). Larger M (prefill) decodes the weight
once into a bf16 scratch (`dequant_triton`, one pass over the bytes) and runs the library's bf16 GEMM: its cost is
shared by the M rows. (A tensor-core FP8 kernel with the per-32 K-block promotion would halve the GEMM's operand
bytes; not written yet.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import DOT_BF16, LAST, sm_count
from dsv41.kernels.triton.decoders import e2m1_to_f32, e4m3_to_f32, ue8m0_to_f32

__all__ = ["packed_linear_triton", "packed_tile", "check_offsets", "dequant_triton", "DECODE_ROWS", "DECODE_CONFIG"]

DECODE_ROWS = 64        # up to this many rows: the weight-read-bound configuration (split-K)


@triton.jit
def packed_tile(c_ptr, s_ptr, r, c, mask, C, FP4: tl.constexpr):
    """fp32 values of W [R, C] held packed, at rows r x columns c (int32 index tensors that broadcast to the tile's
    shape; `mask` the same shape): the e4m3 / e2m1 code's value times its e8m0 scale (fp8: per 32 x 32 tile, fp4:
    per row and 32 columns). Masked elements are 0 (code 0). Offsets in int32 (the launchers check the byte counts
    stay below 2^31) and shifts: 64-bit offset tensors and divisions per element cost more than the decode."""
    if FP4:
        byte = tl.load(c_ptr + (r * (C >> 1) + (c >> 1)), mask=mask, other=0).to(tl.int32)
        v = e2m1_to_f32((byte >> ((c & 1) << 2)) & 0xF)
        sc = tl.load(s_ptr + (r * (C >> 5) + (c >> 5)), mask=mask, other=0).to(tl.int32)
    else:
        v = e4m3_to_f32(tl.load(c_ptr + (r * C + c), mask=mask, other=0).to(tl.int32))
        sc = tl.load(s_ptr + ((r >> 5) * ((C + 31) >> 5) + (c >> 5)), mask=mask, other=0).to(tl.int32)
    return v * ue8m0_to_f32(sc)


def check_offsets(weight: PackedWeight) -> None:
    """`packed_tile` indexes a weight's bytes in int32."""
    if weight.codes.numel() >= 2 ** 31 or weight.shape[0] * weight.shape[1] >= 2 ** 31:
        raise ValueError(f"packed weight {list(weight.shape)}: too large for the kernels' int32 offsets")


@triton.jit
def _packed_linear_kernel(x_ptr, c_ptr, s_ptr, b_ptr, y_ptr, M, N, K, k_per_split, FP4: tl.constexpr,
                          HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, DOT_BF16: tl.constexpr):
    """One [BM, BN] tile of y over the K range of split part program_id(2); PARTIAL: store the fp32 partial at
    y_ptr[part, m, n] (the caller sums the parts), else cast (+ bias) into y [M, N]."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    part = tl.program_id(2)
    nm, mm = rn < N, rm < M
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = part * k_per_split
    for k0 in range(0, k_per_split, BK):
        rk = k_lo + k0 + tl.arange(0, BK)
        km = (rk < K) & (rk < k_lo + k_per_split)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = packed_tile(c_ptr, s_ptr, rn[None, :], rk[:, None], nm[None, :] & km[:, None], K, FP4)   # [BK, BN]
        if DOT_BF16:
            acc = tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        else:                                            # the interpreter: fp32 operands, exact products
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    row = (part * M + rm[:, None]).to(tl.int64) * N
    if PARTIAL:
        tl.store(y_ptr + row + rn[None, :], acc, mask=mm[:, None] & nm[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + row + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, w_ptr, N, K, FP4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W [N, K] in w's dtype from its packed bytes, one [BN, BK] tile per program."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    w = packed_tile(c_ptr, s_ptr, rn[:, None], rk[None, :], mask, K, FP4)
    tl.store(w_ptr + (rn[:, None] * K + rk[None, :]), w.to(w_ptr.dtype.element_ty), mask=mask)


# Decode-size tiles: benchmarks/packed_gemm.py --sweep picks them on the H200 (results/packed_gemm_h200.json).
DECODE_CONFIG = {"block_n": 64, "block_k": 64, "num_warps": 4, "programs_per_sm": 2, "num_stages": 4}


def _config(M: int, N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BN, BK, split parts) of a decode-size call: K split until the grid has `programs_per_sm` programs per
    SM (each part at least 4 K tiles)."""
    cfg = DECODE_CONFIG
    BM = max(16, triton.next_power_of_2(M))
    BN, BK = cfg["block_n"], cfg["block_k"]
    tiles = triton.cdiv(N, BN) * triton.cdiv(M, BM)
    split = max(1, min(triton.cdiv(cfg["programs_per_sm"] * sm_count(device), tiles), K // (4 * BK)))
    return BM, BN, BK, split


def packed_linear_triton(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `packed_linear_ref` (same arguments) -> [..., N] in the weight's held dtype."""
    N, K = weight.shape
    if x.size(-1) != K:
        raise ValueError(f"packed_linear: x has {x.size(-1)} features, the weight {K}")
    a = x.reshape(-1, K).contiguous()
    M = a.size(0)
    y = torch.empty(M, N, dtype=weight.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    if M > DECODE_ROWS:                  # prefill sizes: decode the weight once, then the library's bf16 GEMM
        w = dequant_triton(weight)
        return torch.nn.functional.linear(a.to(weight.dtype), w, bias).view(*x.shape[:-1], N)
    check_offsets(weight)
    BM, BN, BK, split = _config(M, N, K, x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), BK) * BK
    split = triton.cdiv(K, k_per_split)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), split)
    LAST["packed_linear"] = _packed_linear_kernel[grid](
        a, weight.codes, weight.scale, bias if bias is not None else a, out, M, N, K, k_per_split,
        FP4=weight.kind == "fp4", HAS_BIAS=bias is not None, PARTIAL=split > 1, BM=BM, BN=BN, BK=BK,
        DOT_BF16=DOT_BF16, num_warps=DECODE_CONFIG["num_warps"], num_stages=DECODE_CONFIG["num_stages"])
    if split > 1:
        s = out.sum(0)
        y = (s + bias.float() if bias is not None else s).to(weight.dtype)
    return y.view(*x.shape[:-1], N)


def dequant_triton(weight: PackedWeight) -> torch.Tensor:
    """The dequantized weight [N, K] in its held dtype (`PackedWeight.dequant`'s values), decoded by one kernel."""
    N, K = weight.shape
    check_offsets(weight)
    w = torch.empty(N, K, dtype=weight.dtype, device=weight.device)
    _dequant_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 128))](weight.codes, weight.scale, w, N, K,
                                                               FP4=weight.kind == "fp4", BN=64, BK=128, num_warps=4)
    return w
