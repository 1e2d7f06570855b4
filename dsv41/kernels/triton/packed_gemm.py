"""Triton GEMM over a weight held as the checkpoint stores it: twin of `dsv41.kernels.gemm_ref.packed_linear_ref`.

Legend: M rows of x, N output features, K input features (a multiple of 32); BM / BN tile sizes, KB = K / 32 blocks
of 32 inputs, U blocks per loop step (unrolled), S split-K parts.

y = x W^T (+ bias) where W [N, K] is a `PackedWeight` (docs/model.md §9): kind fp8, e4m3 codes [N, K] and one e8m0
scale per 32 x 32 tile [ceil(N/32), KB]; or kind fp4, e2m1 codes two a byte [N, K/2] (the even column in the low
nibble) and one e8m0 scale per row and 32 columns [N, KB]. Every program walks K one 32-wide block at a time, as the
official GEMM does (docs/model.md §9): `packed_block` loads the block's bytes ([BN, 16] byte pairs or bytes, 16-byte
vector loads), decodes them in registers with the PTX decoders of triton/decoders.py into the even and the odd
columns (bf16, the codes' exact values, no interleave), and `block_dot` multiplies x's even and odd columns by them
on the tensor cores (fp32 partial of the block: every product exact, x being FP8-QDQ'd), scales the partial by the
block's power of two and adds it to the fp32 accumulator in K order. Only the summation order inside a block (the
tensor cores') and across split-K parts differs from the CPU reference (the GPU tolerance is measured:
tests/test_kernels_packed_gemm.py, benchmarks/gpu_parity.py). Only the weight's bytes cross HBM: 1 byte (fp8) or
half a byte (fp4) per weight instead of bf16's 2; the scales are read once per row and block, not per weight.

Decode-size calls (M <= 64) are bound by reading W: in bf16 models, calls of at least `fp8_decode.FP8_DECODE_FROM`
rows (per kind) take the FP8 tensor cores (fp8_decode.py, the weight's codes as the MMA's operand, no decode); the
others (fp32 models, fewer rows) this kernel, whose grid covers N in tiles of BN and, when that leaves SMs idle,
splits K into S parts whose fp32 partials the last part to finish adds in part order (`splitk.splitk_finish`, in
the kernel). A CUDA-core kernel for 1-8 rows (decode in registers, FMA; 2026-12-06) lost to both on an H100: 1.7 x
slower than this one at one row over fp8 weights (results/packed_gemm_h100-2026-12-06.log), so it was removed.
Larger M (prefill) decodes the weight once into a scratch (`dequant_triton`, one pass over the bytes) and runs the
library's GEMM: its cost is shared by the M rows. The FP8 tensor-core GEMM with the per-32 K-block promotion (`dsv41.kernels.triton.fp8_gemm`) serves
fp8 weights of bf16 models instead when FP8_PREFILL is set: measured on an H100 it ran at 0.26-0.35 x the bf16
GEMM's speed (benchmarks/results/packed_gemm_h100-2026-12-05.json.gz), slower than decoding first, so it is off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.triton.common import ASM, DOT_BF16, LAST, sm_count
from dsv41.kernels.triton.decoders import P2_112, P2_118, e2m1_split, swa_split, ue8m0_to_f32
from dsv41.kernels.triton import fp8_decode
from dsv41.kernels.triton.fp8_gemm import fp8_linear_triton, fp8_prefill_fits
from dsv41.kernels.triton.splitk import splitk_finish, tile_counters

__all__ = ["packed_linear_triton", "packed_block", "block_dot", "packed_rows_dot", "check_offsets", "dequant_triton",
           "DECODE_ROWS", "DECODE_CONFIG", "DECODE_CONFIGS", "decode_config", "FP8_PREFILL"]

DECODE_ROWS = 64        # up to this many rows: the weight-read-bound configuration (split-K)
FP8_PREFILL = False     # prefill-size fp8 calls on the FP8 tensor cores (slower than dequant + bf16 GEMM today)


@triton.jit
def packed_block(c_ptr, s_ptr, rn, nm, kb, K, BN: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr):
    """Block kb (columns 32 kb .. 32 kb + 31) of the rows rn [BN] of W [R, K] held packed -> (even columns, odd
    columns) as bf16 [BN, 16] each, the codes' exact values, and the block's fp32 scale per row [BN]. Rows where nm
    is False read code 0 and scale 0. fp8: byte pairs (columns 2i, 2i+1) as uint16, decoded by `swa_split` with
    the unit scale (2^112 there); fp4: bytes by `e2m1_split` (unit scale 2^118). Offsets in int32 (the launchers
    check the byte counts stay below 2^31)."""
    i = tl.arange(0, 16)
    row = (K >> 5) * 16      # bytes (fp4) or byte pairs (fp8) per row; written so that the compiler sees 16 | row
    if FP4:
        byt = tl.load(c_ptr + (rn[:, None] * row + (kb * 16 + i)[None, :]), mask=nm[:, None], other=0)
        ev, od = e2m1_split(byt, tl.full([BN, 16], P2_118, tl.float32).to(tl.bfloat16), ASM)
        sc = tl.load(s_ptr + (rn * (K >> 5) + kb), mask=nm, other=0)
    else:
        pairs = c_ptr.to(tl.pointer_type(tl.uint16))
        two = tl.load(pairs + (rn[:, None] * row + (kb * 16 + i)[None, :]), mask=nm[:, None], other=0)
        ev, od = swa_split(two, tl.full([BN, 16], P2_112, tl.float32).to(tl.bfloat16), ASM)
        sc = tl.load(s_ptr + ((rn >> 5) * ((K + 31) >> 5) + kb), mask=nm, other=0)
    return ev, od, ue8m0_to_f32(sc.to(tl.int32))


@triton.jit
def block_dot(acc, xe, xo, ev, od, sc, DOT_BF16: tl.constexpr):
    """acc [BM, BN] + (xe ev^T + xo od^T) * sc: one 32-wide block's fp32 partial (x's even / odd columns [BM, 16]
    against the weight's, bf16 tensor cores) times the weight's scale per output column, added in K order. The
    interpreter's bf16 dot is wrong: there fp32 operands (the same exact products)."""
    if DOT_BF16:
        part = tl.dot(xe.to(tl.bfloat16), tl.trans(ev))
        part = tl.dot(xo.to(tl.bfloat16), tl.trans(od), part)
    else:
        part = tl.dot(xe.to(tl.float32), tl.trans(ev.to(tl.float32)), input_precision="ieee")
        part = tl.dot(xo.to(tl.float32), tl.trans(od.to(tl.float32)), part, input_precision="ieee")
    return acc + part * sc[None, :]


@triton.jit
def packed_rows_dot(acc, xrow, xm, c_ptr, s_ptr, rn, nm, K, kb_lo, kb_hi, BN: tl.constexpr, U: tl.constexpr,
                    FP4: tl.constexpr, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """acc [BM, BN] + x W[rn]^T over the 32-wide blocks kb_lo .. kb_hi - 1 of K, in K order, U blocks a step, for W
    [R, K] held packed: x's rows at the pointers xrow [BM, 1] (mask xm [BM, 1]), its even and odd columns loaded
    apart (`packed_block`, `block_dot`)."""
    i2 = 2 * tl.arange(0, 16)
    for kb0 in range(kb_lo, kb_hi, U):
        for u in tl.static_range(U):
            kb = kb0 + u
            ok = kb < kb_hi
            ev, od, sc = packed_block(c_ptr, s_ptr, rn, nm & ok, kb, K, BN, FP4, ASM)
            xe = tl.load(xrow + (kb * 32 + i2)[None, :], mask=xm & ok, other=0.0)
            xo = tl.load(xrow + (kb * 32 + 1 + i2)[None, :], mask=xm & ok, other=0.0)
            acc = block_dot(acc, xe, xo, ev, od, sc, DOT_BF16)
    return acc


def check_offsets(weight: PackedWeight) -> None:
    """`packed_block` indexes a weight's bytes in int32; the kernels walk K in blocks of 32."""
    if weight.codes.numel() >= 2 ** 31 or weight.shape[0] * weight.shape[1] >= 2 ** 31:
        raise ValueError(f"packed weight {list(weight.shape)}: too large for the kernels' int32 offsets")
    if weight.shape[1] % 32:
        raise ValueError(f"packed weight {list(weight.shape)}: the kernels need K divisible by 32")


@triton.jit
def _packed_linear_kernel(x_ptr, c_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, kb_per_split, S,
                          FP4: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          U: tl.constexpr, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """One [BM, BN] tile of y over the 32-wide K blocks of split part program_id(2), U blocks a step; the S parts'
    fp32 partials summed in part order by the last one to finish (`splitk.splitk_finish`, + bias, cast)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    part = tl.program_id(2)
    nm, mm = rn < N, rm < M
    kb_lo = part * kb_per_split
    acc = packed_rows_dot(tl.zeros([BM, BN], tl.float32), x_ptr + (rm * K)[:, None], mm[:, None], c_ptr, s_ptr, rn,
                          nm, K, kb_lo, tl.minimum(kb_lo + kb_per_split, K >> 5), BN, U, FP4, DOT_BF16, ASM)
    cnt = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    splitk_finish(acc, part, ws_ptr, cnt, b_ptr, y_ptr, rm, rn, mm, nm, M, N, S, HAS_BIAS)


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, w_ptr, N, K, FP4: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr,
                    ASM: tl.constexpr):
    """W [N, K] in w's dtype from its packed bytes: BN rows x BLOCKS 32-wide blocks per program, each block's even
    and odd columns decoded apart (`packed_block`), interleaved, scaled in fp32 (exact) and stored."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = rn < N
    cols = tl.arange(0, 32)
    for u in tl.static_range(BLOCKS):
        kb = tl.program_id(1) * BLOCKS + u
        ok = kb < (K >> 5)
        ev, od, sc = packed_block(c_ptr, s_ptr, rn, nm & ok, kb, K, BN, FP4, ASM)
        w = tl.reshape(tl.join(ev, od), [BN, 32]).to(tl.float32) * sc[:, None]     # columns 2i, 2i + 1
        tl.store(w_ptr + (rn[:, None] * K + (kb * 32 + cols)[None, :]), w.to(w_ptr.dtype.element_ty),
                 mask=nm[:, None] & ok)


# Decode-size tiles per row bucket (calls of up to 16, 32, 64 rows): benchmarks/packed_gemm.py --sweep picks them
# (results/packed_gemm_h200.json.gz). block_m: the rows of x a program takes (a smaller one than the bucket's re-reads
# the weight once per row tile, mostly from L2). DECODE_CONFIG is the 16-row bucket's.
# On an H100 (results/packed_gemm_h100-2026-12-05b.log) 16-row tiles won in every bucket: at 64 rows 158 us
# against 388 for one 64-row tile (wo_b + an expert's w1), at 32 rows 88 against 132.
DECODE_CONFIG = {"block_m": 16, "block_n": 128, "unroll": 1, "num_warps": 4, "programs_per_sm": 4, "num_stages": 3}
DECODE_CONFIGS = {16: DECODE_CONFIG,
                  32: {**DECODE_CONFIG, "block_m": 16},
                  64: {**DECODE_CONFIG, "block_m": 16, "unroll": 2}}


def decode_config(M: int) -> dict:
    """The tiles of a decode-size call of M rows (its bucket's entry of DECODE_CONFIGS)."""
    return DECODE_CONFIGS[min(b for b in DECODE_CONFIGS if b >= min(M, DECODE_ROWS))]


def _config(M: int, N: int, K: int, nbytes: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BN, U, split parts) of a decode-size call: K split until the grid has `programs_per_sm` programs per
    SM, each part at least 2 steps of U blocks, and the parts' fp32 partials (written and read back) at most half
    the weight's bytes."""
    cfg = decode_config(M)
    BM = max(16, min(cfg["block_m"], triton.next_power_of_2(M)))
    BN, U = cfg["block_n"], cfg["unroll"]
    tiles = triton.cdiv(N, BN) * triton.cdiv(M, BM)
    want = triton.cdiv(cfg["programs_per_sm"] * sm_count(device), tiles)
    split = max(1, min(want, (K // 32) // (2 * U), nbytes // (16 * M * N)))
    return BM, BN, U, split


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
    if M > DECODE_ROWS and FP8_PREFILL and fp8_prefill_fits(a, weight):    # opt in: the FP8 tensor cores
        return fp8_linear_triton(a, weight, bias).view(*x.shape[:-1], N)
    if M > DECODE_ROWS:                  # prefill sizes otherwise: decode the weight once, then the library's GEMM
        w = dequant_triton(weight)
        return torch.nn.functional.linear(a.to(weight.dtype), w, bias).view(*x.shape[:-1], N)
    check_offsets(weight)
    if M >= fp8_decode.FP8_DECODE_FROM[weight.kind] and fp8_decode.fp8_decode_fits(a, weight):   # FP8 tensor cores
        return fp8_decode.fp8_decode_triton(a, weight, bias).view(*x.shape[:-1], N)
    BM, BN, U, split = _config(M, N, K, weight.nbytes, x.device)
    cfg = decode_config(M)
    KB = K // 32
    kb_per_split = triton.cdiv(triton.cdiv(KB, split), U) * U
    split = triton.cdiv(KB, kb_per_split)
    ws = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), split)
    cnt = tile_counters(x.device, grid[0] * grid[1])
    LAST["packed_linear"] = _packed_linear_kernel[grid](
        a, weight.codes, weight.scale, bias if bias is not None else a, y, ws, cnt, M, N, K, kb_per_split, split,
        FP4=weight.kind == "fp4", HAS_BIAS=bias is not None, BM=BM, BN=BN, U=U,
        DOT_BF16=DOT_BF16, ASM=ASM, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(*x.shape[:-1], N)


def dequant_triton(weight: PackedWeight) -> torch.Tensor:
    """The dequantized weight [N, K] in its held dtype (`PackedWeight.dequant`'s values), decoded by one kernel."""
    N, K = weight.shape
    check_offsets(weight)
    w = torch.empty(N, K, dtype=weight.dtype, device=weight.device)
    _dequant_kernel[(triton.cdiv(N, 64), triton.cdiv(K // 32, 4))](
        weight.codes, weight.scale, w, N, K, FP4=weight.kind == "fp4", BN=64, BLOCKS=4, ASM=ASM, num_warps=4)
    return w
