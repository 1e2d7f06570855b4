"""Triton indexer scores over packed MXFP4 index keys, for one decode query per row (MODEL.md 3.6).

Twins (same signatures): `indexer_scores_packed_triton` ~ `packed_ref.indexer_scores_packed_ref`,
`indexer_topk_packed_triton` ~ `packed_ref.indexer_topk_packed_ref`.

Legend: B rows, J indexer heads (BJ padded to >= 16), I index-key width, E scored entries per row, BN entries per
tile, P page size, MP page-table width.

One program per (row, run of tiles of BN entries): q [J, I] and w [J] stay on chip; each tile gathers its
entries' 68-byte records through the page table (entry ids 0..E-1, or an explicit list: the candidate pool of a
Reindex layer), dequantizes E2M1 * 2^(UE8M0) in registers (exact), and computes
I[t] = sum_j w[j] * ReLU(q_j . K_t) with the model's bf16 roundings (the einsum output, the product with w and
the head sum are bf16 tensors there; here fp32 accumulation rounded to bf16 at the same three places, so ties
come out as the model's). Only the [B, E] fp32 scores are written: the context is walked in tiles, nothing of
size [heads x context] exists. The top-k, the block max of the candidate pool and the pool's top blocks are torch
ops on those scores (`packed_ref.indexer_select` / `candidate_pool`), not fused.

Kernels (`impl`): "v2" (index widths 32, 64, 128): per tile and group of 32 channels, two K=16
fp16 tensor-core dots and the group's scale on the fp32 partial. "v3" (the default; index width 128, else v2;
"v3pipe" the same with
Triton's software pipeline instead of a register prefetch): 32-bit word loads, the scale folded into the fp16
keys, one K=128 dot per tile (see the v3 section). "v1": the first kernel (bf16 dequantization, any width).
H200 (benchmarks/results/kernels-indexer-2026-12-03.json, CUDA-graph timing, J=32 I=128, all scores bit-equal
to the reference): v2 72.9 us at B=1 N=1M (1.04 TB/s, 22% of HBM; 6.0-8.1 us at N=65536); v3 in its first form
(a per-tile check for the fallback, 160 registers: 3 programs per SM) 72.2-75.6 us, no faster: it issues 40%
fewer instructions than v2 (525 against 890 per thread and tile of 64, ptxas for sm_90), so v2 was not
instruction-bound alone. The present v3 (the fallback check deferred to the end of a program: 119 registers, 4
programs per SM; v3pipe 127): 64.0 us at B=1 N=1M and at B=4 N=256K (1.18 TB/s, 24.6% of HBM) against 73.3 us for
v2 in the same run, 6.9 us at N=65536 (v2 6.1-8.1), v3pipe 78.5 us; scores bit-equal to the reference in the
benchmark and the GPU tests (benchmarks/results/kernels-2026-12-03c.json, gpu_tests-2026-12-03b.txt).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.packed_ref import _indexer_topk
from dsv41.kernels.triton.sparse_attn_kernel import (_ASM, _DOT_BF16, _E2M1_TO_E4M3, LAST, _e2m1_to_f32,
                                                     _index_tile, _sm_count, _ue8m0_to_f32)

__all__ = ["indexer_scores_packed_triton", "indexer_topk_packed_triton", "CONFIG"]

# Default v3 (64.0 us at B=1 N=1M and B=4 N=256K on the H200 against 73.3 us for v2; results/kernels-2026-12-03c.json);
# the other keys are v2's launch parameters (v3's are V3_CONFIG).
CONFIG = {"impl": "v3", "block_n": 64, "num_warps": 4, "num_stages": 1, "max_tiles_per_program": 8}
# v3: one wave of resident programs (programs_per_sm at <= 128 registers), each a long run of tiles;
# pipe_stages: v3pipe's num_stages.
V3_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 1, "max_tiles_per_program": 32, "programs_per_sm": 4,
             "pipe_stages": 3}
# v3 variants (impl names) -> PREFETCH: the next tile's words loaded ahead in registers (1), or Triton's software
# pipeline over num_stages streaming them through shared memory (0).
V3_VARIANTS = {"v3": 1, "v3pipe": 0}
V1_CONFIG = {"block_n": 128, "num_warps": 8, "num_stages": 1, "max_tiles_per_program": 8}


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, pages_ptr, table_ptr, ent_ptr, nvis_ptr, out_ptr, E, P, MP,
                           tiles_per_prog, J, I: tl.constexpr, IDX_RB: tl.constexpr, BLOCK_J: tl.constexpr,
                           BLOCK_N: tl.constexpr, GATHER: tl.constexpr, DOT_BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    hj = tl.arange(0, BLOCK_J)
    jm = hj < J
    d = tl.arange(0, I)
    q = tl.load(q_ptr + (b * J + hj[:, None]) * I + d[None, :], mask=jm[:, None], other=0.0)
    w = tl.load(w_ptr + b * J + hj, mask=jm, other=0.0).to(tl.float32)
    if not DOT_BF16:
        q = q.to(tl.float32)
    nv = tl.load(nvis_ptr + b)
    for tt in range(tiles_per_prog):
        j = (pb * tiles_per_prog + tt) * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = j < E
        if GATHER:
            e = tl.load(ent_ptr + b * E + j, mask=inb, other=-1)
        else:
            e = j
        valid = inb & (e >= 0) & (e < nv)                            # visible: 0 <= id < n_vis
        e = tl.where(valid, e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        k = _index_tile(pages_ptr, (page * P + (e % P)) * IDX_RB, valid, I, BLOCK_N)    # [BN, I] bf16
        if DOT_BF16:
            s = tl.dot(q, tl.trans(k))                               # einsum q.K -> [BJ, BN], bf16 in the model
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)))
        s = s.to(tl.bfloat16).to(tl.float32)
        r = (tl.maximum(s, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)   # relu(score) * w, bf16
        tot = tl.sum(r, 0).to(tl.bfloat16).to(tl.float32)                      # sum over heads, bf16
        tl.store(out_ptr + b * E + j, tl.where(valid, tot, float("-inf")), mask=inb)


# ------------------------------------------------------------------------------------------ v2
# Per tile of BN entries, per group g of 32 channels (16 bytes: even channels in the low nibbles, odd in the high):
# the nibbles become fp16 E2M1 * 2^-6 (E2M1 -> E4M3 bits, then the hardware E4M3 -> f16x2 conversion: exact), and
# two fp16 tensor-core dots give the group's partial q.K for all heads, [BN, BJ] = k_lo [BN,16] @ q_lo^T + k_hi @
# q_hi^T, with q_lo / q_hi the group's even / odd channels of q. q is carried in fp16 times 2^c (c per row, putting
# max |q| in [2^14, 2^15): every bf16 value at or above max|q| * 2^-29 is exact; smaller ones contribute below
# 2^-38 of the largest term), and the UE8M0 scale of each (entry, group) times 2^(6 - c) multiplies the fp32 partial
# (powers of two: exact) before the group sum. Products are exact in fp32, so the score equals the model's bf16
# einsum up to fp32 summation order; then relu, * w and the head sum with the model's three bf16 roundings
# (packed bf16x2 PTX on the GPU). The dots run on the tensor cores (wgmma), the decode in 13 integer/convert
# instructions per 8 channels.

_E2M1_F16_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B;
""" + _E2M1_TO_E4M3.format(x="$4") + """
mov.b32 {a0, a1}, A;
mov.b32 {b0, b1}, B;
cvt.rn.f16x2.e4m3x2 $0, a0;
cvt.rn.f16x2.e4m3x2 $1, a1;
cvt.rn.f16x2.e4m3x2 $2, b0;
cvt.rn.f16x2.e4m3x2 $3, b1;
}""")

# r = bf16(relu(bf16(s)) * w): $1 $2 = two fp32 scores, $3 = their two bf16 head weights, $0 = bf16x2 result.
_RELU_W_ASM = tl.constexpr("""{
.reg .b32 t, z;
cvt.rn.bf16x2.f32 t, $2, $1;
mov.b32 z, 0;
max.bf16x2 t, t, z;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t, $3, z;
}""")


@triton.jit
def _e2m1_f16(byt, ASM: tl.constexpr):
    """uint8 bytes -> (low-nibble, high-nibble) E2M1 values * 2^-6 in fp16 (exact)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_F16_ASM, "=r,=r,=r,=r,r", [byt], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        c = byt.to(tl.int32)
        lo = (_e2m1_to_f32(c & 15) * 0.015625).to(tl.float16)
        hi = (_e2m1_to_f32(c >> 4) * 0.015625).to(tl.float16)
    return lo, hi


@triton.jit
def _relu_w(s, w, ASM: tl.constexpr):
    """bf16(relu(bf16(s)) * w) -> fp32, s fp32 [BN, BJ], w bf16 broadcast to s's shape (the model's roundings)."""
    if ASM:
        r = tl.inline_asm_elementwise(_RELU_W_ASM, "=r,r,r,r", [s, w], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        sb = s.to(tl.bfloat16).to(tl.float32)
        r = (tl.maximum(sb, 0.0) * w.to(tl.float32)).to(tl.bfloat16)
    return r.to(tl.float32)


@triton.jit
def _q_half(q_ptr, b, J, hj, jm, qs, g: tl.constexpr, odd: tl.constexpr, I: tl.constexpr):
    """[16, BJ] fp16: channels 32g + 2c + odd of every head's q, times qs (a power of two)."""
    c = tl.arange(0, 16)
    v = tl.load(q_ptr + (b * J + hj[None, :]) * I + 32 * g + 2 * c[:, None] + odd, mask=jm[None, :], other=0.0)
    return (v.to(tl.float32) * qs).to(tl.float16)


@triton.jit
def _pair_dots(lo, hi, qlo, qhi, DOT16: tl.constexpr):
    """lo @ qlo + hi @ qhi in fp32 (the even / odd channels of a group; fp16 operands, or fp32 in the interpreter)."""
    if DOT16:
        part = tl.dot(lo, qlo)
        return tl.dot(hi, qhi, part)
    part = tl.dot(lo.to(tl.float32), qlo.to(tl.float32))
    return tl.dot(hi.to(tl.float32), qhi.to(tl.float32), part)


@triton.jit
def _k_group(pages_ptr, rec, valid, kmul, qlo, qhi, g: tl.constexpr, I: tl.constexpr, ASM: tl.constexpr,
             DOT16: tl.constexpr):
    """Group g's scaled partial scores [BN, BJ] fp32 of the records at byte offsets rec [BN]."""
    c = tl.arange(0, 16)
    byt = tl.load(pages_ptr + rec[:, None] + 16 * g + c[None, :], mask=valid[:, None], other=0)
    sb = tl.load(pages_ptr + rec + I // 2 + g, mask=valid, other=0).to(tl.int32)
    lo, hi = _e2m1_f16(byt, ASM)
    return _pair_dots(lo, hi, qlo, qhi, DOT16) * (_ue8m0_to_f32(sb) * kmul)[:, None]


@triton.jit
def _q_scale(q_ptr, b, J, hj, jm, I: tl.constexpr):
    """(2^c, c) for row b's queries: c = 14 - the unbiased exponent of max |q| (0 when q is all zero), so q * 2^c
    is below 2^15 (fp16's range) with q's bits unchanged (a power of two)."""
    d = tl.arange(0, I)
    qf = tl.load(q_ptr + (b * J + hj[:, None]) * I + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
    qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
    ex = (qmax.to(tl.int32, bitcast=True) >> 23) & 255              # biased exponent of max |q| (0: all zero)
    cexp = tl.where(ex > 0, 141 - ex, 0)                            # c = 14 - (ex - 127)
    return ((cexp + 127) << 23).to(tl.float32, bitcast=True), cexp  # 2^c


@triton.jit
def _indexer_v2_kernel(q_ptr, w_ptr, pages_ptr, table_ptr, ent_ptr, nvis_ptr, out_ptr, E, P, MP, tiles_per_prog, J,
                       I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
                       ASM: tl.constexpr, DOT16: tl.constexpr):
    G: tl.constexpr = I // 32
    RB: tl.constexpr = I // 2 + I // 32
    b = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    hj = tl.arange(0, BLOCK_J)
    jm = hj < J
    qs, cexp = _q_scale(q_ptr, b, J, hj, jm, I)
    kmul = ((133 - cexp) << 23).to(tl.float32, bitcast=True)        # 2^(6 - c)
    ql0 = _q_half(q_ptr, b, J, hj, jm, qs, 0, 0, I)
    qh0 = _q_half(q_ptr, b, J, hj, jm, qs, 0, 1, I)
    if G > 1:
        ql1 = _q_half(q_ptr, b, J, hj, jm, qs, 1, 0, I)
        qh1 = _q_half(q_ptr, b, J, hj, jm, qs, 1, 1, I)
    if G > 2:
        ql2 = _q_half(q_ptr, b, J, hj, jm, qs, 2, 0, I)
        qh2 = _q_half(q_ptr, b, J, hj, jm, qs, 2, 1, I)
        ql3 = _q_half(q_ptr, b, J, hj, jm, qs, 3, 0, I)
        qh3 = _q_half(q_ptr, b, J, hj, jm, qs, 3, 1, I)
    w = tl.load(w_ptr + b * J + hj, mask=jm, other=0.0)
    wb = tl.broadcast_to(w[None, :], (BLOCK_N, BLOCK_J))
    nv = tl.load(nvis_ptr + b)
    for tt in range(tiles_per_prog):
        j = (pb * tiles_per_prog + tt) * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = j < E
        if GATHER:
            e = tl.load(ent_ptr + b * E + j, mask=inb, other=-1)
        else:
            e = j
        valid = inb & (e >= 0) & (e < nv)
        e = tl.where(valid, e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        rec = (page * P + (e % P)) * RB
        s = _k_group(pages_ptr, rec, valid, kmul, ql0, qh0, 0, I, ASM, DOT16)
        if G > 1:
            s += _k_group(pages_ptr, rec, valid, kmul, ql1, qh1, 1, I, ASM, DOT16)
        if G > 2:
            s += _k_group(pages_ptr, rec, valid, kmul, ql2, qh2, 2, I, ASM, DOT16)
            s += _k_group(pages_ptr, rec, valid, kmul, ql3, qh3, 3, I, ASM, DOT16)
        r = _relu_w(s, wb, ASM)
        tot = tl.sum(r, 1).to(tl.bfloat16).to(tl.float32)
        tl.store(out_ptr + b * E + j, tl.where(valid, tot, float("-inf")), mask=inb)


# ------------------------------------------------------------------------------------------ v3
# Index width 128 (68-byte records = 17 words: words 0-15 the nibbles, word 16 the four UE8M0 scale bytes). Each
# tile's records are read as 32-bit words (17 loads per entry instead of 68 byte loads; one page-table read per tile
# when P % BN == 0 and no entry list), the next tile's words loaded while this one is computed ("v3pipe": Triton's
# pipeline over num_stages instead). Word v of a record holds channels 8v..8v+7; one PTX block turns it into 8 fp16
# values E2M1 * 2^-6 * 2^(S_g - R_n) (the E4M3 trick of v2, then one mul.f16x2 by the group's power of two), with
# R_n = max_g S_g - 15 per entry: every value of an entry whose four group scales lie within 29 binades is exact in
# fp16 (a program meeting another entry recomputes its tiles on v2's per-group path at its end, exact for any
# scales). The fp16 tile [BN, 128], its channels permuted as the decode leaves them (q's rows permuted to match: a
# dot product is a sum, any order of its terms is the same sum when every partial sum is exact), makes one K=128
# tensor-core dot with q (fp16 times 2^c as in v2). The per-entry power of two 2^(R_n + 6 - c - 127) commutes with
# relu, the bf16 roundings and the head sum, so it multiplies the entry's final score only (one multiply per entry,
# not one per head and group). ptxas (sm_90, BN 64, 4 warps): 119 registers, ~530 instructions per thread and tile
# against v2's 890. Not adopted yet: its first form measured no faster than v2 (module docstring); tried and
# dropped: the head sum as a second tensor-core dot (slower), K split into eight K=16 dots or a permuted K order to
# feed the MMA from registers (Triton still went through shared memory, with more instructions).

# $8 = one word (4 bytes: channels 2k low nibble, 2k+1 high), $9 = the fp16x2 power of two of its group;
# $0..$7 = channels 0, 2, 4, 6, 1, 3, 5, 7 of the word as fp16.
_WORD_F16_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B, r0, r1, r2, r3;
""" + _E2M1_TO_E4M3.format(x="$8") + """
mov.b32 {a0, a1}, A;
mov.b32 {b0, b1}, B;
cvt.rn.f16x2.e4m3x2 r0, a0;
cvt.rn.f16x2.e4m3x2 r1, a1;
cvt.rn.f16x2.e4m3x2 r2, b0;
cvt.rn.f16x2.e4m3x2 r3, b1;
mul.rn.f16x2 r0, r0, $9;
mul.rn.f16x2 r1, r1, $9;
mul.rn.f16x2 r2, r2, $9;
mul.rn.f16x2 r3, r3, $9;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")


@triton.jit
def _word_f16(wd, mul, ASM: tl.constexpr):
    """int32 words -> 8 fp16 tensors (channels 0, 2, 4, 6, 1, 3, 5, 7 of each word) * 2^-6 * mul; mul int32 holding
    the fp16x2 bits of a power of two (exact)."""
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _WORD_F16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wd, mul], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        m = (mul & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 0.015625
        o0 = (_e2m1_to_f32(wd & 15) * m).to(tl.float16)
        o4 = (_e2m1_to_f32((wd >> 4) & 15) * m).to(tl.float16)
        o1 = (_e2m1_to_f32((wd >> 8) & 15) * m).to(tl.float16)
        o5 = (_e2m1_to_f32((wd >> 12) & 15) * m).to(tl.float16)
        o2 = (_e2m1_to_f32((wd >> 16) & 15) * m).to(tl.float16)
        o6 = (_e2m1_to_f32((wd >> 20) & 15) * m).to(tl.float16)
        o3 = (_e2m1_to_f32((wd >> 24) & 15) * m).to(tl.float16)
        o7 = (_e2m1_to_f32((wd >> 28) & 15) * m).to(tl.float16)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _v3_tile(words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, P: tl.constexpr, BLOCK_N: tl.constexpr,
             GATHER: tl.constexpr):
    """Tile t's entries -> (valid [BN], the word pointer of each record [BN]). Without an entry list and with
    P % BN == 0 a tile lies in one page: one page-table read per tile; else one per entry."""
    n = tl.arange(0, BLOCK_N)
    j = t * BLOCK_N + n
    if GATHER:
        e = tl.load(ent_ptr + b * E + j, mask=j < E, other=-1)
        valid = (e >= 0) & (e < nv)
        e = tl.where(valid, e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        return valid, words_ptr + (page * P + e % P) * 17
    elif P % BLOCK_N == 0:
        j0 = t * BLOCK_N
        valid = (j < E) & (j < nv)
        page = tl.load(table_ptr + b * MP + j0 // P, mask=(j0 < E) & (j0 < nv), other=0).to(tl.int64)
        return valid, (words_ptr + (page * P + j0 % P) * 17) + n * 17
    else:
        valid = (j < E) & (j < nv)
        e = tl.where(valid, j, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        return valid, words_ptr + (page * P + e % P) * 17


@triton.jit
def _v3_words(valid, rp):
    """The tile's nibble words [BN, 16] and scale words [BN] (invalid entries read as 0)."""
    v = tl.arange(0, 16)
    wd = tl.load(rp[:, None] + v[None, :], mask=valid[:, None], other=0)
    sw = tl.load(rp + 16, mask=valid, other=0)
    return wd, sw


@triton.jit
def _indexer_v3_kernel(q_ptr, w_ptr, words_ptr, table_ptr, ent_ptr, nvis_ptr, out_ptr, E, MP, tiles_per_prog, J,
                       P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
                       ASM: tl.constexpr, DOT16: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr):
    I: tl.constexpr = 128
    b = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    hj = tl.arange(0, BLOCK_J)
    jm = hj < J
    qs, cexp = _q_scale(q_ptr, b, J, hj, jm, I)
    fq = ((118 - cexp) << 23).to(tl.float32, bitcast=True)          # 2^(-9 - c)
    kmul = ((133 - cexp) << 23).to(tl.float32, bitcast=True)        # 2^(6 - c)
    # q^T [128, BJ] in the decode's channel order: row 8v + i holds channel 8v + (0, 2, 4, 6, 1, 3, 5, 7)[i]
    kk = tl.arange(0, I)
    ki = kk & 7
    chan = (kk - ki) + tl.where(ki < 4, 2 * ki, 2 * ki - 7)
    qt = tl.load(q_ptr + (b * J + hj[None, :]) * I + chan[:, None], mask=jm[None, :], other=0.0)
    qt = (qt.to(tl.float32) * qs).to(tl.float16)
    if not DOT16:
        qt = qt.to(tl.float32)
    w = tl.load(w_ptr + b * J + hj, mask=jm, other=0.0)
    wb = tl.broadcast_to(w[None, :], (BLOCK_N, BLOCK_J))
    nv = tl.load(nvis_ptr + b)
    vw = tl.arange(0, 16)
    gsh = 8 * (vw // 4)                                             # word v's scale byte: bits 8(v // 4)..
    t0 = pb * tiles_per_prog
    bad = tl.zeros([BLOCK_N], tl.int32)
    if PREFETCH == 0:   # Triton's software pipeline (num_stages) streams the words through shared memory
        for tt in tl.range(tiles_per_prog, num_stages=NUM_STAGES):
            t = t0 + tt
            valid_c, rp = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, P, BLOCK_N, GATHER)
            wd, sw = _v3_words(valid_c, rp)
            bad |= _v3_tile_scores(wd, sw, valid_c, t, qt, wb, fq, gsh, out_ptr, b, E, BLOCK_N, ASM, DOT16)
    else:               # the next tile's words loaded in registers while this one is computed
        valid, rp = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t0, E, MP, nv, P, BLOCK_N, GATHER)
        wd_n, sw_n = _v3_words(valid, rp)
        valid_n, rp_n = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t0 + 1, E, MP, nv, P, BLOCK_N, GATHER)
        for tt in range(tiles_per_prog):
            t = t0 + tt
            wd = wd_n
            sw = sw_n
            valid_c = valid
            valid = valid_n
            wd_n, sw_n = _v3_words(valid_n, rp_n)                                   # prefetch tile t + 1
            valid_n, rp_n = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t + 2, E, MP, nv, P, BLOCK_N, GATHER)
            bad |= _v3_tile_scores(wd, sw, valid_c, t, qt, wb, fq, gsh, out_ptr, b, E, BLOCK_N, ASM, DOT16)
    # A tile holding an entry whose four group scales span more than fp16's window (never seen in real keys; the
    # fast path's values for it are not used): all of this program's tiles again on v2's per-group path, exact
    # for any scales; the barrier orders these stores after the first ones.
    if tl.max(bad, 0) > 0:
        tl.debug_barrier()
        for tt in range(tiles_per_prog):
            t = t0 + tt
            s, fac = _v3_exact_tile(q_ptr, words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, J, hj, jm, qs, kmul,
                                    P, BLOCK_N, GATHER, ASM, DOT16)
            valid_c, rp = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, P, BLOCK_N, GATHER)
            _v3_finish(s, fac, wb, valid_c, t, out_ptr, b, E, BLOCK_N, ASM)


@triton.jit
def _v3_tile_scores(wd, sw, valid_c, t, qt, wb, fq, gsh, out_ptr, b, E, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                    DOT16: tl.constexpr):
    """Tile t's scores from its words (decode, one K=128 dot, `_v3_finish`) -> its entries needing v2's path."""
    I: tl.constexpr = 128
    s0 = sw & 255
    s1 = (sw >> 8) & 255
    s2 = (sw >> 16) & 255
    s3 = (sw >> 24) & 255
    mx = tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))
    mn = tl.minimum(tl.minimum(s0, s1), tl.minimum(s2, s3))
    e16 = ((sw[:, None] >> gsh[None, :]) & 255) - mx[:, None] + 30      # fp16 exponent field of 2^(S_g - R_n)
    mul = tl.maximum(e16, 1) * 0x04000400
    o0, o1, o2, o3, o4, o5, o6, o7 = _word_f16(wd, mul, ASM)
    k = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))  # [.., 8]
    k = tl.reshape(k, (BLOCK_N, I))                                     # column 8v + i: word v's value i
    if DOT16:
        s = tl.dot(k, qt)
    else:
        s = tl.dot(k.to(tl.float32), qt)
    fac = (mx << 23).to(tl.float32, bitcast=True) * fq                  # 2^(R_n + 6 - c - 127)
    _v3_finish(s, fac, wb, valid_c, t, out_ptr, b, E, BLOCK_N, ASM)
    return (valid_c & (mn < mx - 29)).to(tl.int32)                      # an entry's scales span > 29 binades


@triton.jit
def _v3_finish(s, fac, wb, valid_c, t, out_ptr, b, E, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """relu, the head weights and the head sum with the model's bf16 roundings, times fac; store tile t."""
    tot = tl.sum(_relu_w(s, wb, ASM), 1).to(tl.bfloat16).to(tl.float32) * fac
    j = t * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + b * E + j, tl.where(valid_c, tot, float("-inf")), mask=j < E)


@triton.jit
def _v3_exact_tile(q_ptr, words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, J, hj, jm, qs, kmul, P: tl.constexpr,
                   BLOCK_N: tl.constexpr, GATHER: tl.constexpr, ASM: tl.constexpr, DOT16: tl.constexpr):
    """v2's per-group scores of tile t, exact for any scales -> (s [BN, BJ] fp32 = the scores * 2^(c - 6), the
    factor 2^(6 - c) for each entry)."""
    valid, rp = _v3_tile(words_ptr, table_ptr, ent_ptr, b, t, E, MP, nv, P, BLOCK_N, GATHER)
    rb = rp.to(tl.pointer_type(tl.uint8))
    c = tl.arange(0, 16)
    for g in tl.static_range(4):
        byt = tl.load(rb[:, None] + (16 * g + c)[None, :], mask=valid[:, None], other=0)
        sb = tl.load(rb + (64 + g), mask=valid, other=0).to(tl.int32)
        lo, hi = _e2m1_f16(byt, ASM)
        qlo = _q_half(q_ptr, b, J, hj, jm, qs, g, 0, 128)
        qhi = _q_half(q_ptr, b, J, hj, jm, qs, g, 1, 128)
        part = _pair_dots(lo, hi, qlo, qhi, DOT16) * _ue8m0_to_f32(sb)[:, None]
        if g == 0:
            s = part
        else:
            s += part
    return s, tl.full([BLOCK_N], 1.0, tl.float32) * kmul


def indexer_scores_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                                 page_table: torch.Tensor, n_vis: torch.Tensor, entries: torch.Tensor | None = None,
                                 n_entries: int | None = None, *, block_n: int | None = None,
                                 num_warps: int | None = None, num_stages: int | None = None,
                                 tiles_per_program: int | None = None, impl: str | None = None) -> torch.Tensor:
    """Triton twin of `indexer_scores_packed_ref` -> [B, E] fp32 (bf16-rounded values, -inf where invisible).

    impl "v2" (index widths 32, 64, 128: `_indexer_v2_kernel`, `CONFIG`), "v3" (default) / "v3pipe" (index width
    128, 4-byte aligned pages: `_indexer_v3_kernel`, `V3_CONFIG`; otherwise v2), "v1" (the first kernel,
    `V1_CONFIG`; any width)."""
    B, J, I = q.shape
    if q.dtype != torch.bfloat16:
        raise ValueError(f"indexer scores (triton): q must be bfloat16 (the model's rounding), got {q.dtype}")
    if I < 32 or I & (I - 1):
        raise ValueError(f"indexer scores (triton): index width must be a power of two >= 32, got {I}")
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 3 or index_pages.size(2) != I // 2 + I // 32:
        raise ValueError(f"indexer scores (triton): index_pages must be uint8 [*, *, {I // 2 + I // 32}], got "
                         f"{index_pages.dtype} {tuple(index_pages.shape)}")
    impl = impl or CONFIG["impl"]
    if impl not in ("v1", "v2") and impl not in V3_VARIANTS:
        raise ValueError(f"indexer scores (triton): impl must be 'v1', 'v2' or 'v3' (or one of {sorted(V3_VARIANTS)}),"
                         f" got {impl!r}")
    variant = V3_VARIANTS.get(impl)
    index_pages = index_pages.contiguous()
    if variant is not None:
        impl = "v3" if I == 128 and index_pages.data_ptr() % 4 == 0 else "v2"
    if I > 128:
        impl = "v1"
    cfg = {"v1": V1_CONFIG, "v2": CONFIG, "v3": V3_CONFIG}[impl]
    BN = block_n or cfg["block_n"]
    if entries is None:
        E = int(n_vis.max()) if n_entries is None else n_entries
    else:
        E = entries.size(1)
        entries = entries.to(torch.int32).contiguous()
    out = torch.empty(B, E, dtype=torch.float32, device=q.device)
    if B == 0 or E == 0:
        return out
    n_tiles = triton.cdiv(E, BN)
    if tiles_per_program is None and impl == "v3":      # one wave of resident programs, long runs of tiles
        waves = cfg["programs_per_sm"] * _sm_count(q.device)
        tiles_per_program = max(1, min(cfg["max_tiles_per_program"], triton.cdiv(n_tiles * B, waves)))
    elif tiles_per_program is None:      # enough programs for ~4 per SM, then longer runs per program (q reuse)
        tiles_per_program = max(1, min(cfg["max_tiles_per_program"], n_tiles * B // (4 * _sm_count(q.device))))
    grid = (B, triton.cdiv(n_tiles, tiles_per_program))
    BJ = max(16, triton.next_power_of_2(J))
    if impl == "v3":
        LAST['indexer'] = _indexer_v3_kernel[grid](
            q.contiguous(), w.contiguous(), index_pages.view(torch.int32), page_table.to(torch.int32).contiguous(),
            out if entries is None else entries, n_vis.to(torch.int32).contiguous(), out, E, page_table.size(1),
            tiles_per_program, J, P=index_pages.size(1), BLOCK_J=BJ, BLOCK_N=BN, GATHER=entries is not None,
            ASM=_ASM, DOT16=_DOT_BF16, PREFETCH=variant,
            NUM_STAGES=num_stages or cfg["pipe_stages"], num_warps=num_warps or cfg["num_warps"],
            num_stages=cfg["num_stages"])                      # (num_stages: v3pipe's depth, its loop only)
        return out
    if impl == "v2":
        LAST['indexer'] = _indexer_v2_kernel[grid](
            q.contiguous(), w.contiguous(), index_pages.contiguous(), page_table.to(torch.int32).contiguous(),
            out if entries is None else entries, n_vis.to(torch.int32).contiguous(), out, E, index_pages.size(1),
            page_table.size(1), tiles_per_program, J, I=I, BLOCK_J=BJ, BLOCK_N=BN, GATHER=entries is not None,
            ASM=_ASM, DOT16=_DOT_BF16, num_warps=num_warps or cfg["num_warps"],
            num_stages=num_stages or cfg["num_stages"])
        return out
    LAST['indexer'] = _indexer_scores_kernel[grid](
        q.contiguous(), w.contiguous(), index_pages.contiguous(), page_table.to(torch.int32).contiguous(),
        out if entries is None else entries, n_vis.to(torch.int32).contiguous(), out, E, index_pages.size(1),
        page_table.size(1), tiles_per_program, J, I=I, IDX_RB=I // 2 + I // 32,
        BLOCK_J=BJ, BLOCK_N=BN, GATHER=entries is not None, DOT_BF16=_DOT_BF16,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])
    return out


def indexer_topk_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor, page_table: torch.Tensor,
                               n_vis: torch.Tensor, topk: int, cand_blocks: torch.Tensor | None = None,
                               pool_blocks: int = 0, block_size: int = 8, ties: str = "official",
                               n_max: int | None = None):
    """Triton twin of `indexer_topk_packed_ref`: the Triton scores, then the reference's torch selection."""
    return _indexer_topk(indexer_scores_packed_triton, q, w, index_pages, page_table, n_vis, topk, cand_blocks,
                         pool_blocks, block_size, ties, n_max)
