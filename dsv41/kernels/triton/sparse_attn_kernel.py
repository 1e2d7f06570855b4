"""Triton sparse attention with the per-head sink (MODEL.md 3.8): decode over the packed store, and dense KV.

Twins (same signatures): `sparse_attn_packed_triton` ~ `packed_ref.sparse_attn_packed_ref`,
`sparse_attn_triton` ~ `ref.sparse_attn_ref`.

Legend: B rows, T queries per row, H heads, D head dim, BH heads per program, BN indices per tile, KW window
indices, K compressed (top-k) indices, P page size, MP page-table width, S splits of the index list.

One program per (row or query, block of BH heads, split): it walks its tiles of the index list (for the packed
decode: the window tiles, then the top-k tiles, the model's order), gathers the BN rows of each tile straight from
the packed bytes (E4M3 + UE8M0/32 ring rows; E2M1 nibbles + E4M3/16 main-KV records found through the page
table), dequantizes them in registers to bf16 (exact: every stored value is bf16-representable), and runs the
reference's online softmax on the tile: logits = scale * q.k in fp32 (tensor cores, fp32 accumulation), running
max from -1e30, denominator of fp32 p, numerator of bf16(p) @ V. The sink enters the denominator last.
With BN = 64 and an unsplit list the tiles are the reference's blocks of 64, so the result equals the reference
up to summation order and exp rounding; a smaller BN (fewer registers for the [BN, D] dequantized tile) updates
the running max more often, which moves the bf16 rounding of p slightly (differences at the bf16-rounding level).
When the rows and head blocks alone cannot fill the GPU, the list is split (flash-decoding): each split keeps its
own running max, and `_combine_kernel` merges the partial (acc, max, sum) and adds the sink; the bf16 rounding of
p is then relative to the split's running max (differences at the bf16-rounding level).

The packed decode's default is not a kernel of this file but the "staged" path (packed_staged.py): a first kernel
decodes the row's selected entries to bf16 rows with this file's decoders, then `_sparse_attn_dense_kernel` runs on
them; it is 2-3x faster than the fused kernels here (CONFIG's comment). Those read the packed bytes inside the
softmax loop: `_sparse_attn_packed_v2` (see its section below: the tiles split into even and odd channels and
decoded by a few PTX instructions per 32-bit word, the next tile's bytes fetched while the current one is computed,
splits capped at one program per SM) and the first kernel, `_sparse_attn_packed_kernel` (impl "v1").

Not handled: the NaN codes (E4M3 0x7F/0xFF decode as +-480, UE8M0 0xFF as 2^128 here, NaN in the reference; the
pool never writes them) and UE8M0 byte 0 (0 here, 2^-127 there; below every scale the quantizers produce).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["sparse_attn_packed_triton", "sparse_attn_triton", "CONFIG", "DENSE_CONFIG"]

# Picked by benchmarks/kernels.py's sweeps on the H200 (override per call with the launcher's keyword arguments;
# results/kernels-attn-2026-12-03.json). Default "staged" (packed_staged.py: the entries decoded to bf16 rows, then
# the dense kernel): at 64 heads x 512, 128 + 512 indices, 22 / 29 / 67 / 106 us at B = 1 / 16 / 64 / 128 against
# 64 / 69 / 135 / 236 us for v2, the best fused kernel. Its block_h, block_n, num_warps, num_stages are the dense
# kernel's (block_h 32 from `large_rows` rows on: 106 vs 131 us at B = 128, equal at 64; it spills ~30 bytes).
# Stage 1 alone (results/kernels-2026-12-03c.json): tiles of 16 entries, 4 warps: 2.3 / 4.8 / 17.5 / 34.1 us at
# B = 1 / 16 / 64 / 128 (32 entries: 3.1 / 5.7 / 20.9 / 39.8); the "pairs" store the same within 0.2 us.
# v2 (V2_CONFIG) with block_h 32 (two head blocks, mma.sync) compiles without spills; block_h 64 (wgmma, each tile
# decoded once) spills 400-600 bytes per thread: its fp32 [64, 512] accumulator alone takes 128 of 255 registers.
CONFIG = {"impl": "staged", "stage_block_n": 16, "stage_num_warps": 4, "stage_store": "interleave",
          "block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "large_rows": 64, "large_block_h": 32}
V2_CONFIG = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 1, "sc3d": True}
V1_CONFIG = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 1, "vec": True}
DENSE_CONFIG = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}

# Triton's interpreter (TRITON_INTERPRET=1, CPU debugging) gets bf16 dot products wrong: there the operands are
# upcast to fp32 before the dot (the same products: bf16 values are exact in fp32). It runs no inline PTX either:
# there the dequantization takes the arithmetic path (the same values).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DOT_BF16 = not _INTERPRET
_ASM = not _INTERPRET


# ------------------------------------------------------------------------------------------ dequantization

@triton.jit
def _e4m3_to_f32(b):
    """E4M3 byte (int32 0..255) -> fp32: normals by moving the 7 magnitude bits under the fp32 exponent and
    rebiasing (7 -> 127), subnormals (exponent 0) as m * 2^-9; the sign from bit 7 (codecs.e4m3_to_float)."""
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _ue8m0_to_f32(b):
    """UE8M0 byte (int32) -> 2^(b - 127) as the fp32 exponent field (codecs.e8m0_to_float)."""
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 nibble (int32 0..15, bit 3 sign) -> fp32 (codecs.e2m1_to_float): exponent e = bits 1-2, mantissa m =
    bit 0; e >= 1 is (1 + m/2) 2^(e-1) (fp32 exponent e + 126), e = 0 is m * 0.5 (0x3F000000 = 0.5)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _swa_tile(ptr, row, valid, D: tl.constexpr, BN: tl.constexpr, VEC: tl.constexpr):
    """bf16 [BN, D] of the SWA rows at byte offsets row [BN] (codecs.unpack_swa_kv): code d at byte d, the UE8M0
    scale of group d // 32 at byte D + d // 32. Invalid rows read as 0."""
    if VEC:     # [BN, groups, 32]: contiguous 32-byte code runs, one scale load per group
        g = tl.arange(0, D // 32)
        c = tl.arange(0, 32)
        codes = tl.load(ptr + row[:, None, None] + (g[None, :, None] * 32 + c[None, None, :]),
                        mask=valid[:, None, None], other=0).to(tl.int32)
        sc = tl.load(ptr + row[:, None] + D + g[None, :], mask=valid[:, None], other=0).to(tl.int32)
        v = _e4m3_to_f32(codes) * _ue8m0_to_f32(sc)[:, :, None]
        return tl.reshape(v.to(tl.bfloat16), (BN, D))
    else:
        d = tl.arange(0, D)
        codes = tl.load(ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0).to(tl.int32)
        sc = tl.load(ptr + row[:, None] + D + (d // 32)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        return (_e4m3_to_f32(codes) * _ue8m0_to_f32(sc)).to(tl.bfloat16)


@triton.jit
def _main_tile(ptr, row, valid, D: tl.constexpr, BN: tl.constexpr, VEC: tl.constexpr):
    """bf16 [BN, D] of the main-KV records at byte offsets row [BN] (codecs.unpack_main_kv): channel 2k in the low
    nibble of byte k, 2k+1 in the high one; the E4M3 scale of group d // 16 at byte D/2 + d // 16."""
    if VEC:     # [BN, groups, 8 bytes]: both nibbles of a byte share its group's scale; interleave lo/hi
        g = tl.arange(0, D // 16)
        c = tl.arange(0, 8)
        byt = tl.load(ptr + row[:, None, None] + (g[None, :, None] * 8 + c[None, None, :]),
                      mask=valid[:, None, None], other=0).to(tl.int32)
        sc = tl.load(ptr + row[:, None] + D // 2 + g[None, :], mask=valid[:, None], other=0).to(tl.int32)
        scf = _e4m3_to_f32(sc)[:, :, None]
        lo = (_e2m1_to_f32(byt & 15) * scf).to(tl.bfloat16)
        hi = (_e2m1_to_f32(byt >> 4) * scf).to(tl.bfloat16)
        return tl.reshape(tl.interleave(lo, hi), (BN, D))
    else:
        d = tl.arange(0, D)
        byt = tl.load(ptr + row[:, None] + (d // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        nib = (byt >> ((d & 1) * 4)[None, :]) & 15
        sc = tl.load(ptr + row[:, None] + D // 2 + (d // 16)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        return (_e2m1_to_f32(nib) * _e4m3_to_f32(sc)).to(tl.bfloat16)


@triton.jit
def _index_tile(ptr, row, valid, I: tl.constexpr, BN: tl.constexpr):
    """bf16 [BN, I] of the index-key records at byte offsets row [BN] (codecs.unpack_index_k): nibbles as the
    main KV, the UE8M0 scale of group d // 32 at byte I/2 + d // 32."""
    g = tl.arange(0, I // 32)
    c = tl.arange(0, 16)
    byt = tl.load(ptr + row[:, None, None] + (g[None, :, None] * 16 + c[None, None, :]),
                  mask=valid[:, None, None], other=0).to(tl.int32)
    sc = tl.load(ptr + row[:, None] + I // 2 + g[None, :], mask=valid[:, None], other=0).to(tl.int32)
    scf = _ue8m0_to_f32(sc)[:, :, None]
    lo = (_e2m1_to_f32(byt & 15) * scf).to(tl.bfloat16)
    hi = (_e2m1_to_f32(byt >> 4) * scf).to(tl.bfloat16)
    return tl.reshape(tl.interleave(lo, hi), (BN, I))


# ------------------------------------------------------------------------------------------ softmax step

@triton.jit
def _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16: tl.constexpr):
    """One block of `sparse_attn_ref`'s loop: q [BH,D] bf16, kv [BN,D] bf16 (K = V), valid [BN]."""
    if DOT_BF16:
        s = tl.dot(q, tl.trans(kv))
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)))
    s = tl.where(valid[None, :], s * scale, float("-inf"))           # s = where(valid, q.k, -inf) * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))                            # run_max = max(prev, s.amax)
    alpha = tl.exp(m_i - m_new)                                      # rescale = exp(prev - run_max)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)                                 # den: fp32 p
    pb = p.to(tl.bfloat16)                                           # num: bf16(p) @ V
    if DOT_BF16:
        pv = tl.dot(pb, kv)
    else:
        pv = tl.dot(pb.to(tl.float32), kv.to(tl.float32))
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _epilogue(acc, m_i, l_i, heads, hmask, d, row, sp, n_split, H, sink_ptr, out_ptr, acc_ptr, ml_ptr,
              D: tl.constexpr, SPLIT: tl.constexpr):
    """Unsplit: den += exp(sink - max), out = num / den in bf16. Split: store the partial state for the combine."""
    if SPLIT:
        o = (row * n_split + sp) * H + heads
        tl.store(acc_ptr + o[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + o * 2, m_i, mask=hmask)
        tl.store(ml_ptr + o * 2 + 1, l_i, mask=hmask)
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        l_i = l_i + tl.exp(sink - m_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (row * H + heads[:, None]) * D + d[None, :], out.to(tl.bfloat16), mask=hmask[:, None])


# ------------------------------------------------------------------------------------------ kernels

@triton.jit
def _sparse_attn_packed_kernel(q_ptr, ring_ptr, slot_ptr, win_ptr, main_ptr, table_ptr, topk_ptr, sink_ptr,
                               out_ptr, acc_ptr, ml_ptr, scale, H, KW, K, P, MP, W, tiles_per_split, n_split,
                               D: tl.constexpr, SWA_RB: tl.constexpr, MAIN_RB: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                               VEC: tl.constexpr, DOT_BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + heads[:, None]) * D + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    n_w = tl.cdiv(KW, BLOCK_N)
    n_t = n_w + tl.cdiv(K, BLOCK_N)
    t0 = sp * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, n_t)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    for t in range(t0, tl.minimum(t1, n_w)):                         # window tiles: ring rows of the row's slot
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.load(win_ptr + b * KW + j, mask=j < KW, other=-1)
        valid = r >= 0
        off = (slot * W + tl.maximum(r, 0).to(tl.int64)) * SWA_RB
        kv = _swa_tile(ring_ptr, off, valid, D, BLOCK_N, VEC)
        acc, m_i, l_i = _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16)
    for t in range(tl.maximum(t0, n_w), t1):                         # top-k tiles: entries through the page table
        j = (t - n_w) * BLOCK_N + tl.arange(0, BLOCK_N)
        e = tl.load(topk_ptr + b * K + j, mask=j < K, other=-1)
        valid = e >= 0
        e = tl.maximum(e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        off = (page * P + (e % P)) * MAIN_RB
        kv = _main_tile(main_ptr, off, valid, D, BLOCK_N, VEC)
        acc, m_i, l_i = _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16)
    _epilogue(acc, m_i, l_i, heads, hmask, d, b, sp, n_split, H, sink_ptr, out_ptr, acc_ptr, ml_ptr, D, SPLIT)


@triton.jit
def _sparse_attn_dense_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, acc_ptr, ml_ptr, scale, T, H, N, K,
                              tiles_per_split, n_split, D: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_BF16: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)                               # query row b * T + t
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = bt // T
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (bt * H + heads[:, None]) * D + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    t0 = sp * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BLOCK_N))
    for t in range(t0, t1):
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        i = tl.load(idx_ptr + bt * K + j, mask=j < K, other=-1)
        valid = i >= 0
        rows = b * N + tl.maximum(i, 0).to(tl.int64)
        kv = tl.load(kv_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16)
    _epilogue(acc, m_i, l_i, heads, hmask, d, bt, sp, n_split, H, sink_ptr, out_ptr, acc_ptr, ml_ptr, D, SPLIT)


# ------------------------------------------------------------------------------------------ v2 dequantization
# The v2 kernel splits every KV tile into its even and odd channels ([BN, D/2] each; q and the output are split the
# same way, so q.k and p@V are unchanged): a main-KV byte holds channels 2k (low nibble) and 2k+1 (high nibble), an
# SWA pair of bytes channels 2i and 2i+1, so each split half comes out of the packed bytes with no interleave.
# On the GPU the bytes are decoded by a few PTX instructions per 32-bit word (SIMD within the register):
#   E2M1 nibble -> E4M3 byte: the 3 magnitude bits move under the E4M3 exponent/mantissa (value * 2^-6, exact, the
#     nibble's subnormal 0.5 becomes the E4M3 subnormal 2^-7), the sign to bit 7;
#   E4M3 pair -> f16x2 by the hardware conversion (exact: every E4M3 value is an fp16 normal);
#   f16 -> bf16 bits by moving exponent and mantissa down 3 bits, sign kept ((x >> 3) & 0x0FFF | x & 0x8000): the
#     bf16 whose exponent field is the fp16's, i.e. the value * 2^-112 (zero stays zero, no subnormals occur);
#   times the group scale, pre-multiplied by 2^112 (SWA, UE8M0: exact for scale bytes <= 142, i.e. scales
#   <= 2^15) or 2^118 (main KV, E4M3), in one bf16x2 fma with -0 (a single rounding of an exact product: exact).
# Off the GPU (the interpreter) the same values come from the arithmetic decoders above.

_F16_TO_BF16 = """
shr.b32 t, {r}, 3;
and.b32 t, t, 0x0FFF0FFF;
and.b32 {r}, {r}, 0x80008000;
or.b32 {r}, {r}, t;"""

# The E2M1 nibbles of a 32-bit word {x} as E4M3 bytes (the 3 magnitude bits under the E4M3 exponent / mantissa: the
# value * 2^-6, exact; the sign to bit 7): A = the low nibbles (channels 2k), B = the high ones (2k+1), byte k of
# each. Needs .reg .b32 t1, t2, A, B.
_E2M1_TO_E4M3 = """
shl.b32 t1, {x}, 2;
and.b32 t1, t1, 0x1C1C1C1C;
shl.b32 t2, {x}, 4;
and.b32 t2, t2, 0x80808080;
or.b32 A, t1, t2;
shr.b32 t1, {x}, 2;
and.b32 t1, t1, 0x1C1C1C1C;
and.b32 t2, {x}, 0x80808080;
or.b32 B, t1, t2;"""

# uint16 element i = channels (2i, 2i+1) as E4M3 bytes (low, high); pack 2: $2 = two elements, $3 = their two bf16
# scales; $0 = even channels (2i), $1 = odd channels (2i+1) as bf16x2.
_SWA_ASM = tl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b, e, o, t, z;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
prmt.b32 e, a, b, 0x5410;
prmt.b32 o, a, b, 0x7632;""" + _F16_TO_BF16.format(r="e") + _F16_TO_BF16.format(r="o") + """
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, e, $3, z;
fma.rn.bf16x2 $1, o, $3, z;
}""")

# uint8 element k = channels (2k low nibble, 2k+1 high nibble) in E2M1; pack 4: $4 = four bytes, $5 $6 = their four
# bf16 scales; $0 $1 = even channels, $2 $3 = odd channels, bf16x2 each.
_E2M1_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B, e0, e1, o0, o1, t, z;
""" + _E2M1_TO_E4M3.format(x="$4") + """
mov.b32 {a0, a1}, A;
mov.b32 {b0, b1}, B;
cvt.rn.f16x2.e4m3x2 e0, a0;
cvt.rn.f16x2.e4m3x2 e1, a1;
cvt.rn.f16x2.e4m3x2 o0, b0;
cvt.rn.f16x2.e4m3x2 o1, b1;""" + "".join(_F16_TO_BF16.format(r=r) for r in ("e0", "e1", "o0", "o1")) + """
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, e0, $5, z;
fma.rn.bf16x2 $1, e1, $6, z;
fma.rn.bf16x2 $2, o0, $5, z;
fma.rn.bf16x2 $3, o1, $6, z;
}""")

_P2_112 = tl.constexpr(5.192296858534828e33)      # 2^112
_P2_118 = tl.constexpr(3.3230699894622943e35)     # 2^118
_P2_M112 = tl.constexpr(1.925929944387236e-34)    # 2^-112
_P2_M118 = tl.constexpr(3.0092655314788645e-36)   # 2^-118


@triton.jit
def _swa_split(codes, sc, ASM: tl.constexpr):
    """uint16 codes (E4M3 channels 2i | 2i+1 << 8), bf16 sc = UE8M0 scale * 2^112 -> (even, odd) bf16 channels."""
    if ASM:
        ev, od = tl.inline_asm_elementwise(_SWA_ASM, "=r,=r,r,r", [codes, sc], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=2)
    else:
        c = codes.to(tl.int32)
        s = sc.to(tl.float32) * _P2_M112
        ev = (_e4m3_to_f32(c & 255) * s).to(tl.bfloat16)
        od = (_e4m3_to_f32(c >> 8) * s).to(tl.bfloat16)
    return ev, od


@triton.jit
def _e2m1_split(byt, sc, ASM: tl.constexpr):
    """uint8 bytes (E2M1 channel 2k low nibble, 2k+1 high), bf16 sc = E4M3 scale * 2^118 -> (even, odd) bf16."""
    if ASM:
        ev, od = tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [byt, sc],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        c = byt.to(tl.int32)
        s = sc.to(tl.float32) * _P2_M118
        ev = (_e2m1_to_f32(c & 15) * s).to(tl.bfloat16)
        od = (_e2m1_to_f32(c >> 4) * s).to(tl.bfloat16)
    return ev, od


@triton.jit
def _swa_load(ring_ptr, rows, valid, D: tl.constexpr, BN: tl.constexpr, SC3D: tl.constexpr):
    """Raw bytes of the SWA rows `rows` [BN] (ring row ids; invalid rows read as 0): the codes as uint16 pairs and
    the UE8M0 scale bytes. SC3D: codes [BN, D/32, 16], scales [BN, D/32] (one per group, broadcast by
    `_swa_split_tile`); else codes [BN, D/2] and the scale byte gathered per pair."""
    RB: tl.constexpr = D + D // 32
    ring16 = ring_ptr.to(tl.pointer_type(tl.uint16))
    r = rows.to(tl.int64)
    if SC3D:
        g = tl.arange(0, D // 32)
        c = tl.arange(0, 16)
        codes = tl.load(ring16 + (r * (RB // 2))[:, None, None] + (g[None, :, None] * 16 + c[None, None, :]),
                        mask=valid[:, None, None], other=0)
        sb = tl.load(ring_ptr + (r * RB + D)[:, None] + g[None, :], mask=valid[:, None], other=0)
    else:
        i = tl.arange(0, D // 2)
        codes = tl.load(ring16 + (r * (RB // 2))[:, None] + i[None, :], mask=valid[:, None], other=0)
        sb = tl.load(ring_ptr + (r * RB + D)[:, None] + (i // 16)[None, :], mask=valid[:, None], other=0)
    return codes, sb


@triton.jit
def _swa_split_tile(codes, sb, D: tl.constexpr, BN: tl.constexpr, SC3D: tl.constexpr, ASM: tl.constexpr):
    """(even, odd) bf16 [BN, D/2] of `_swa_load`'s bytes: the scale as bf16 2^(s - 15) (UE8M0 * 2^112)."""
    sc = (_ue8m0_to_f32(sb.to(tl.int32)) * _P2_112).to(tl.bfloat16)
    if SC3D:
        sc = tl.broadcast_to(sc[:, :, None], (BN, D // 32, 16))
    k_e, k_o = _swa_split(codes, sc, ASM)
    return tl.reshape(k_e, (BN, D // 2)), tl.reshape(k_o, (BN, D // 2))


@triton.jit
def _main_load(main_ptr, rec, valid, D: tl.constexpr, BN: tl.constexpr, SC3D: tl.constexpr):
    """Raw bytes of the main-KV records `rec` [BN] (record ids page * P + slot): nibble bytes and E4M3 scale bytes,
    shaped as `_swa_load`'s ([BN, D/16, 8] and [BN, D/16], or [BN, D/2] twice)."""
    RB: tl.constexpr = D // 2 + D // 16
    r = rec.to(tl.int64) * RB
    if SC3D:
        g = tl.arange(0, D // 16)
        c = tl.arange(0, 8)
        byt = tl.load(main_ptr + r[:, None, None] + (g[None, :, None] * 8 + c[None, None, :]),
                      mask=valid[:, None, None], other=0)
        sb = tl.load(main_ptr + (r + D // 2)[:, None] + g[None, :], mask=valid[:, None], other=0)
    else:
        k = tl.arange(0, D // 2)
        byt = tl.load(main_ptr + r[:, None] + k[None, :], mask=valid[:, None], other=0)
        sb = tl.load(main_ptr + (r + D // 2)[:, None] + (k // 8)[None, :], mask=valid[:, None], other=0)
    return byt, sb


@triton.jit
def _main_split_tile(byt, sb, D: tl.constexpr, BN: tl.constexpr, SC3D: tl.constexpr, ASM: tl.constexpr):
    """(even, odd) bf16 [BN, D/2] of `_main_load`'s bytes: the scale as bf16 E4M3 * 2^118."""
    sc = (_e4m3_to_f32(sb.to(tl.int32)) * _P2_118).to(tl.bfloat16)
    if SC3D:
        sc = tl.broadcast_to(sc[:, :, None], (BN, D // 16, 8))
    k_e, k_o = _e2m1_split(byt, sc, ASM)
    return tl.reshape(k_e, (BN, D // 2)), tl.reshape(k_o, (BN, D // 2))


@triton.jit
def _attend2(q_e, q_o, k_e, k_o, valid, acc_e, acc_o, m_i, l_i, scale, DOT_BF16: tl.constexpr):
    """`_attend` on channel-split operands: q.k = q_e.k_e + q_o.k_o, and p@V into the even / odd accumulators."""
    if DOT_BF16:
        s = tl.dot(q_e, tl.trans(k_e))
        s = tl.dot(q_o, tl.trans(k_o), s)
    else:
        s = tl.dot(q_e.to(tl.float32), tl.trans(k_e.to(tl.float32)))
        s = tl.dot(q_o.to(tl.float32), tl.trans(k_o.to(tl.float32)), s)
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pb = p.to(tl.bfloat16)
    acc_e = acc_e * alpha[:, None]
    acc_o = acc_o * alpha[:, None]
    if DOT_BF16:
        acc_e = tl.dot(pb, k_e, acc_e)
        acc_o = tl.dot(pb, k_o, acc_o)
    else:
        acc_e = tl.dot(pb.to(tl.float32), k_e.to(tl.float32), acc_e)
        acc_o = tl.dot(pb.to(tl.float32), k_o.to(tl.float32), acc_o)
    return acc_e, acc_o, m_new, l_i


@triton.jit
def _win_rows(win_ptr, b, KW, t, t_end, BN: tl.constexpr):
    """Ring rows of window tile t ([BN], -1 outside the list or at t >= t_end)."""
    j = t * BN + tl.arange(0, BN)
    return tl.load(win_ptr + b * KW + j, mask=(j < KW) & (t < t_end), other=-1)


@triton.jit
def _topk_ids(topk_ptr, b, K, tk, t_ok, BN: tl.constexpr):
    """Entry ids of top-k tile tk ([BN], -1 outside the list or when not t_ok)."""
    j = tk * BN + tl.arange(0, BN)
    return tl.load(topk_ptr + b * K + j, mask=(j < K) & t_ok, other=-1)


@triton.jit
def _sparse_attn_packed_v2(q_ptr, ring_ptr, slot_ptr, win_ptr, main_ptr, table_ptr, topk_ptr, sink_ptr,
                           out_ptr, acc_ptr, ml_ptr, scale, H, KW, K, P, MP, W, tiles_per_split, n_split,
                           D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                           SC3D: tl.constexpr, ASM: tl.constexpr, DOT_BF16: tl.constexpr):
    """One program per (row, block of heads, split): channel-split q / accumulators, each tile's raw bytes fetched
    one tile ahead (the entry ids and page numbers two / one tiles ahead), decoded in registers (`_swa_split`,
    `_e2m1_split`), then `_attend2`."""
    DH: tl.constexpr = D // 2
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    i = tl.arange(0, DH)
    qrow = q_ptr + (b * H + heads[:, None]) * D + 2 * i[None, :]
    q_e = tl.load(qrow, mask=hmask[:, None], other=0.0)
    q_o = tl.load(qrow + 1, mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_e = tl.zeros([BLOCK_H, DH], tl.float32)
    acc_o = tl.zeros([BLOCK_H, DH], tl.float32)
    n_w = tl.cdiv(KW, BLOCK_N)
    n_t = n_w + tl.cdiv(K, BLOCK_N)
    t0 = sp * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, n_t)
    base = tl.load(slot_ptr + b).to(tl.int64) * W
    # window tiles t0 .. tw1-1: ring rows of the row's slot
    tw1 = tl.minimum(t1, n_w)
    r0 = _win_rows(win_ptr, b, KW, t0, tw1, BLOCK_N)
    r1 = _win_rows(win_ptr, b, KW, t0 + 1, tw1, BLOCK_N)
    codes, sc = _swa_load(ring_ptr, base + tl.maximum(r0, 0), r0 >= 0, D, BLOCK_N, SC3D)
    for t in range(t0, tw1):
        codes_n, sc_n = _swa_load(ring_ptr, base + tl.maximum(r1, 0), r1 >= 0, D, BLOCK_N, SC3D)
        r2 = _win_rows(win_ptr, b, KW, t + 2, tw1, BLOCK_N)
        k_e, k_o = _swa_split_tile(codes, sc, D, BLOCK_N, SC3D, ASM)
        acc_e, acc_o, m_i, l_i = _attend2(q_e, q_o, k_e, k_o, r0 >= 0, acc_e, acc_o, m_i, l_i, scale, DOT_BF16)
        codes, sc, r0, r1 = codes_n, sc_n, r1, r2
    # top-k tiles tk0 .. t1-1: entries through the page table
    tk0 = tl.maximum(t0, n_w)
    e0 = _topk_ids(topk_ptr, b, K, tk0 - n_w, tk0 < t1, BLOCK_N)
    e1 = _topk_ids(topk_ptr, b, K, tk0 + 1 - n_w, tk0 + 1 < t1, BLOCK_N)
    e2 = _topk_ids(topk_ptr, b, K, tk0 + 2 - n_w, tk0 + 2 < t1, BLOCK_N)
    pg0 = tl.load(table_ptr + b * MP + tl.maximum(e0, 0) // P, mask=e0 >= 0, other=0)
    pg1 = tl.load(table_ptr + b * MP + tl.maximum(e1, 0) // P, mask=e1 >= 0, other=0)
    byt, sc = _main_load(main_ptr, pg0.to(tl.int64) * P + tl.maximum(e0, 0) % P, e0 >= 0, D, BLOCK_N, SC3D)
    for t in range(tk0, t1):
        byt_n, sc_n = _main_load(main_ptr, pg1.to(tl.int64) * P + tl.maximum(e1, 0) % P, e1 >= 0, D, BLOCK_N,
                                 SC3D)
        pg2 = tl.load(table_ptr + b * MP + tl.maximum(e2, 0) // P, mask=e2 >= 0, other=0)
        e3 = _topk_ids(topk_ptr, b, K, t + 3 - n_w, t + 3 < t1, BLOCK_N)
        k_e, k_o = _main_split_tile(byt, sc, D, BLOCK_N, SC3D, ASM)
        acc_e, acc_o, m_i, l_i = _attend2(q_e, q_o, k_e, k_o, e0 >= 0, acc_e, acc_o, m_i, l_i, scale, DOT_BF16)
        byt, sc, e0, e1, pg1, e2 = byt_n, sc_n, e1, e2, pg2, e3
    if SPLIT:
        o = (b * n_split + sp) * H + heads
        dst = acc_ptr + o[:, None] * D + 2 * i[None, :]
        tl.store(dst, acc_e, mask=hmask[:, None])
        tl.store(dst + 1, acc_o, mask=hmask[:, None])
        tl.store(ml_ptr + o * 2, m_i, mask=hmask)
        tl.store(ml_ptr + o * 2 + 1, l_i, mask=hmask)
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        l_i = l_i + tl.exp(sink - m_i)
        dst = out_ptr + (b * H + heads[:, None]) * D + 2 * i[None, :]
        tl.store(dst, (acc_e / l_i[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        tl.store(dst + 1, (acc_o / l_i[:, None]).to(tl.bfloat16), mask=hmask[:, None])


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, sink_ptr, out_ptr, H, n_split, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Merge the splits of one row: max M over splits, num = sum exp(m_s - M) acc_s,
    den = sum exp(m_s - M) l_s + exp(sink - M); out = num / den in bf16."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    m_g = tl.full([BLOCK_H], -1e30, tl.float32)
    for s in range(n_split):
        m_g = tl.maximum(m_g, tl.load(ml_ptr + ((row * n_split + s) * H + heads) * 2, mask=hmask, other=-1e30))
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for s in range(n_split):
        o = (row * n_split + s) * H + heads
        m_s = tl.load(ml_ptr + o * 2, mask=hmask, other=-1e30)
        alpha = tl.exp(m_s - m_g)
        den += alpha * tl.load(ml_ptr + o * 2 + 1, mask=hmask, other=0.0)
        acc += alpha[:, None] * tl.load(acc_ptr + o[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    den += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - m_g)
    tl.store(out_ptr + (row * H + heads[:, None]) * D + d[None, :], (acc / den[:, None]).to(tl.bfloat16),
             mask=hmask[:, None])


# ------------------------------------------------------------------------------------------ launchers

_SM_COUNT: dict[int, int] = {}
LAST: dict = {}          # the last compiled kernel per launcher (n_regs / n_spills for the benchmark's report)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _split_plan(programs: int, n_tiles: int, device: torch.device, num_splits: int | None,
                fill: str = "ceil") -> tuple[int, int]:
    """(splits, tiles per split): split the index list only as far as needed to give every SM a program (each split
    costs a partial [H, D] fp32 write and read, about half a row's packed KV bytes). fill="floor": never more
    programs than SMs (kernels that hold one program per SM: a second wave would double the time)."""
    if n_tiles == 0:
        return 1, 1
    if num_splits is None:
        sms = _sm_count(device)
        num_splits = (-(-sms // max(1, programs)) if fill == "ceil" else max(1, sms // max(1, programs)))
    num_splits = max(1, min(num_splits, n_tiles))
    tps = -(-n_tiles // num_splits)
    return -(-n_tiles // tps), tps


def _block_h(H: int, block_h: int) -> int:
    return max(16, min(block_h, triton.next_power_of_2(H)))


def _check_dim(D: int, what: str) -> None:
    if D < 32 or D & (D - 1):
        raise ValueError(f"{what}: the Triton kernel needs a power-of-two head dim >= 32, got {D}")


def _finish(out, acc_ws, ml_ws, sink, rows, H, D, n_split, BH, num_warps):
    if n_split > 1:
        _combine_kernel[(rows, triton.cdiv(H, BH))](acc_ws, ml_ws, sink, out, H, n_split, D=D, BLOCK_H=BH,
                                                    num_warps=num_warps)
    return out


def sparse_attn_packed_triton(q: torch.Tensor, swa_ring: torch.Tensor, ring_slots: torch.Tensor,
                              win_idx: torch.Tensor, main_pages: torch.Tensor, page_table: torch.Tensor,
                              topk_idx: torch.Tensor, sink: torch.Tensor, scale: float, *,
                              num_splits: int | None = None, block_h: int | None = None,
                              block_n: int | None = None, num_warps: int | None = None,
                              num_stages: int | None = None, vec: bool | None = None, impl: str | None = None,
                              sc3d: bool | None = None) -> torch.Tensor:
    """Triton twin of `sparse_attn_packed_ref` (same arguments; the keywords override `CONFIG`) -> [B,H,D] bf16.

    impl "staged" (default): the selected entries decoded to bf16 rows, then the dense kernel (packed_staged.py);
    "v2" (`V2_CONFIG`): the fused kernel `_sparse_attn_packed_v2` (channel-split tiles decoded in registers by
    PTX, prefetch, splits up to one program per SM); "v1" (`V1_CONFIG`): the first fused kernel. The fused kernels
    are kept for comparison (benchmarks/kernels.py) and tested like the default."""
    B, H, D = q.shape
    _check_dim(D, "sparse_attn_packed")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attn_packed (triton): q must be bfloat16, got {q.dtype}")
    for name, t, nbytes in (("swa_ring", swa_ring, D + D // 32), ("main_pages", main_pages, D // 2 + D // 16)):
        if t.dtype != torch.uint8 or t.dim() != 3 or t.size(2) != nbytes:
            raise ValueError(f"sparse_attn_packed (triton): {name} must be uint8 [*, *, {nbytes}] for D={D}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    over = {k: v for k, v in dict(impl=impl, block_h=block_h, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages, vec=vec, sc3d=sc3d).items() if v is not None}
    which = over.get("impl", CONFIG["impl"])
    if which not in ("staged", "v2", "v1"):
        raise ValueError(f"sparse_attn_packed (triton): impl must be 'staged', 'v2' or 'v1', got {which!r}")
    cfg = {**{"staged": CONFIG, "v2": V2_CONFIG, "v1": V1_CONFIG}[which], **over, "impl": which}
    if which == "staged":
        from dsv41.kernels.triton.packed_staged import stage_packed_rows
        if block_h is None and q.size(0) >= cfg["large_rows"]:
            cfg["block_h"] = cfg["large_block_h"]
        rows, idx = stage_packed_rows(swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx,
                                      cfg["stage_block_n"], cfg["stage_num_warps"], cfg["stage_store"])
        out = sparse_attn_triton(q.unsqueeze(1), rows, sink, idx, scale, num_splits=num_splits,
                                 **{k: cfg[k] for k in ("block_h", "block_n", "num_warps", "num_stages")})[:, 0]
        LAST['packed'] = LAST.get('dense')
        return out
    v2 = cfg["impl"] == "v2"
    BH, BN = _block_h(H, cfg["block_h"]), cfg["block_n"]
    KW, K = win_idx.size(1), topk_idx.size(1)
    n_tiles = triton.cdiv(KW, BN) + triton.cdiv(K, BN)
    n_hb = triton.cdiv(H, BH)
    n_split, tps = _split_plan(B * n_hb, n_tiles, q.device, num_splits, "floor" if v2 else "ceil")
    out = torch.empty(B, H, D, dtype=torch.bfloat16, device=q.device)
    acc_ws = ml_ws = out
    if n_split > 1:
        acc_ws = torch.empty(B, n_split, H, D, dtype=torch.float32, device=q.device)
        ml_ws = torch.empty(B, n_split, H, 2, dtype=torch.float32, device=q.device)
    if v2:
        LAST['packed'] = _sparse_attn_packed_v2[(B, n_hb, n_split)](
            q.contiguous(), swa_ring.contiguous(), ring_slots.to(torch.int32).contiguous(),
            win_idx.to(torch.int32).contiguous(), main_pages.contiguous(), page_table.to(torch.int32).contiguous(),
            topk_idx.to(torch.int32).contiguous(), sink.float().contiguous(), out, acc_ws, ml_ws,
            float(scale), H, KW, K, main_pages.size(1), page_table.size(1), swa_ring.size(1), tps, n_split,
            D=D, BLOCK_H=BH, BLOCK_N=BN, SPLIT=n_split > 1, SC3D=bool(cfg["sc3d"]), ASM=_ASM, DOT_BF16=_DOT_BF16,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return _finish(out, acc_ws, ml_ws, sink.float().contiguous(), B, H, D, n_split, 16, 4)
    LAST['packed'] = _sparse_attn_packed_kernel[(B, n_hb, n_split)](
        q.contiguous(), swa_ring.contiguous(), ring_slots.to(torch.int32).contiguous(),
        win_idx.to(torch.int32).contiguous(), main_pages.contiguous(), page_table.to(torch.int32).contiguous(),
        topk_idx.to(torch.int32).contiguous(), sink.float().contiguous(), out, acc_ws, ml_ws,
        float(scale), H, KW, K, main_pages.size(1), page_table.size(1), swa_ring.size(1), tps, n_split,
        D=D, SWA_RB=D + D // 32, MAIN_RB=D // 2 + D // 16, BLOCK_H=BH, BLOCK_N=BN, SPLIT=n_split > 1,
        VEC=bool(cfg["vec"]), DOT_BF16=_DOT_BF16, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return _finish(out, acc_ws, ml_ws, sink.float().contiguous(), B, H, D, n_split, BH, 4)


def sparse_attn_triton(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                       query_chunk: int = 1024, *, num_splits: int | None = None, block_h: int | None = None,
                       block_n: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> torch.Tensor:
    """Triton twin of `sparse_attn_ref` on dense bf16 KV (any T: prefill and decode) -> [B,T,H,D] bf16.
    query_chunk is accepted for the signature and unused (the kernel holds no [T, K, D] gather)."""
    B, T, H, D = q.shape
    _check_dim(D, "sparse_attn")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attn (triton): q and kv must be bfloat16, got {q.dtype} and {kv.dtype}")
    cfg = {**DENSE_CONFIG, **{k: v for k, v in dict(block_h=block_h, block_n=block_n, num_warps=num_warps,
                                                    num_stages=num_stages).items() if v is not None}}
    BH, BN = _block_h(H, cfg["block_h"]), cfg["block_n"]
    K = idx.size(-1)
    n_hb = triton.cdiv(H, BH)
    n_split, tps = _split_plan(B * T * n_hb, triton.cdiv(K, BN), q.device, num_splits)
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16, device=q.device)
    acc_ws = ml_ws = out
    if n_split > 1:
        acc_ws = torch.empty(B * T, n_split, H, D, dtype=torch.float32, device=q.device)
        ml_ws = torch.empty(B * T, n_split, H, 2, dtype=torch.float32, device=q.device)
    if B * T:
        LAST['dense'] = _sparse_attn_dense_kernel[(B * T, n_hb, n_split)](
            q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous(), sink.float().contiguous(), out,
            acc_ws, ml_ws, float(scale), T, H, kv.size(1), K, tps, n_split, D=D, BLOCK_H=BH, BLOCK_N=BN,
            SPLIT=n_split > 1, DOT_BF16=_DOT_BF16, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        _finish(out, acc_ws, ml_ws, sink.float().contiguous(), B * T, H, D, n_split, BH, 4)
    return out
