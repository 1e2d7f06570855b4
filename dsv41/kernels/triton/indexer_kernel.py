"""Triton indexer scores over packed MXFP4 index keys, for one decode query per row (docs/model.md §3.6).

Twins (same signatures): `indexer_scores_packed_triton` ~ `packed_ref.indexer_scores_packed_ref`,
`indexer_topk_packed_triton` ~ `packed_ref.indexer_topk_packed_ref`.

Legend: B rows, J indexer heads (BJ padded to >= 16), I index-key width, E scored entries per row, BN entries per
tile, P page size, MP page-table width.

One program per (row, run of tiles of BN entries): q [J, I] and w [J] stay on chip; each tile gathers its
entries' records through the page table (entry ids 0..E-1, or an explicit list: the candidate pool of a Reindex
layer), dequantizes E2M1 * 2^(UE8M0) in registers (exact), and computes
I[t] = sum_j w[j] * ReLU(q_j . K_t) with the model's bf16 roundings (the einsum output, the product with w and
the head sum are bf16 tensors there; here fp32 accumulation rounded to bf16 at the same three places, so ties
come out as the model's). Only the [B, E] fp32 scores are written: the context is walked in tiles, nothing of
size [heads x context] exists. The top-k, the block max of the candidate pool and the pool's top blocks are torch
ops on those scores (`packed_ref.indexer_select` / `candidate_pool`), not fused.

Three kernels, chosen by the index width and the pages' alignment (`CONFIG` holds each one's launch parameters):
  v3 (`_indexer_v3_kernel`, width 128 on 4-byte aligned pages, the model's case): 32-bit word loads, the scale
     folded into the fp16 keys, one K=128 tensor-core dot per tile (see the v3 section);
  v2 (`_indexer_v2_kernel`, widths 32, 64 and 128 otherwise): per tile and group of 32 channels, two K=16 fp16
     tensor-core dots and the group's scale on the fp32 partial; also v3's exact path for entries whose group
     scales span more than fp16's window;
  v1 (`_indexer_v1_kernel`, widths above 128): bf16 dequantization of the whole tile, one bf16 dot.
v3 and v2 give the same bits (the reference's, up to fp32 summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.packed_ref import indexer_topk_packed_ref
from dsv41.kernels.triton.common import ASM, DOT_BF16, LAST, sm_count
from dsv41.kernels.triton.decoders import e2m1_f16, e2m1_to_f32, ue8m0_to_f32, word_f16

__all__ = ["indexer_scores_packed_triton", "indexer_topk_packed_triton", "CONFIG"]

# Launch parameters per kernel, picked by benchmarks/kernels.py's sweeps on the H200. v3: one wave of resident
# programs (programs_per_sm at <= 128 registers), each a long run of tiles; v2 / v1: enough programs for ~4 per SM,
# then longer runs (q reuse), up to max_tiles_per_program.
CONFIG = {"v3": {"block_n": 64, "num_warps": 4, "num_stages": 1, "max_tiles_per_program": 32, "programs_per_sm": 4},
          "v2": {"block_n": 64, "num_warps": 4, "num_stages": 1, "max_tiles_per_program": 8},
          "v1": {"block_n": 128, "num_warps": 8, "num_stages": 1, "max_tiles_per_program": 8}}


# ------------------------------------------------------------------------------------------ v1 (widths above 128)

@triton.jit
def _tile_records(ent_ptr, table_ptr, b, j, E, nv, P, MP, RB: tl.constexpr, GATHER: tl.constexpr):
    """Tile positions j [BN] -> (inside the list, visible entry: 0 <= id < n_vis, the entry's record byte offset
    through the page table; entry ids j, or the list's ids with GATHER)."""
    inb = j < E
    if GATHER:
        e = tl.load(ent_ptr + b * E + j, mask=inb, other=-1)
    else:
        e = j
    valid = inb & (e >= 0) & (e < nv)
    e = tl.where(valid, e, 0)
    page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
    return inb, valid, (page * P + (e % P)) * RB


@triton.jit
def _index_tile(ptr, row, valid, I: tl.constexpr, BN: tl.constexpr):
    """bf16 [BN, I] of the index-key records at byte offsets row [BN] (codecs.unpack_index_k): nibbles as the
    main KV, the UE8M0 scale of group d // 32 at byte I/2 + d // 32."""
    g = tl.arange(0, I // 32)
    c = tl.arange(0, 16)
    byt = tl.load(ptr + row[:, None, None] + (g[None, :, None] * 16 + c[None, None, :]),
                  mask=valid[:, None, None], other=0).to(tl.int32)
    sc = tl.load(ptr + row[:, None] + I // 2 + g[None, :], mask=valid[:, None], other=0).to(tl.int32)
    scf = ue8m0_to_f32(sc)[:, :, None]
    lo = (e2m1_to_f32(byt & 15) * scf).to(tl.bfloat16)
    hi = (e2m1_to_f32(byt >> 4) * scf).to(tl.bfloat16)
    return tl.reshape(tl.interleave(lo, hi), (BN, I))


@triton.jit
def _indexer_v1_kernel(q_ptr, w_ptr, pages_ptr, table_ptr, ent_ptr, nvis_ptr, out_ptr, E, P, MP,
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
        inb, valid, rec = _tile_records(ent_ptr, table_ptr, b, j, E, nv, P, MP, IDX_RB, GATHER)
        k = _index_tile(pages_ptr, rec, valid, I, BLOCK_N)                                # [BN, I] bf16
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
# (packed bf16x2 PTX on the GPU). The dots run on the tensor cores (wgmma), the decode (decoders.e2m1_f16) in 13
# integer/convert instructions per 8 channels.

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
    lo, hi = e2m1_f16(byt, ASM)
    return _pair_dots(lo, hi, qlo, qhi, DOT16) * (ue8m0_to_f32(sb) * kmul)[:, None]


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
        inb, valid, rec = _tile_records(ent_ptr, table_ptr, b, j, E, nv, P, MP, RB, GATHER)
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
# when P % BN == 0 and no entry list), the next tile's words loaded while this one is computed. Word v of a record
# holds channels 8v..8v+7; one PTX block (decoders.word_f16) turns it into 8 fp16 values E2M1 * 2^-6 * 2^(S_g - R_n)
# (the E4M3 trick of v2, then one mul.f16x2 by the group's power of two), with R_n = max_g S_g - 15 per entry: every
# value of an entry whose four group scales lie within 29 binades is exact in fp16 (a program meeting another entry
# recomputes its tiles on v2's per-group path at its end, exact for any scales). The fp16 tile [BN, 128], its channels
# permuted as the decode leaves them (q's rows permuted to match: a dot product is a sum, any order of its terms is
# the same sum when every partial sum is exact), makes one K=128 tensor-core dot with q (fp16 times 2^c as in v2). The
# per-entry power of two 2^(R_n + 6 - c - 127) commutes with relu, the bf16 roundings and the head sum, so it
# multiplies the entry's final score only (one multiply per entry, not one per head and group). The fast-path check is
# deferred to the end of a program (fewer live registers: 4 programs per SM); the tuning history is in
# benchmarks/results/README.md.


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
                       ASM: tl.constexpr, DOT16: tl.constexpr):
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
    # the next tile's words loaded in registers while this one is computed
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
    o0, o1, o2, o3, o4, o5, o6, o7 = word_f16(wd, mul, ASM)
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
        lo, hi = e2m1_f16(byt, ASM)
        qlo = _q_half(q_ptr, b, J, hj, jm, qs, g, 0, 128)
        qhi = _q_half(q_ptr, b, J, hj, jm, qs, g, 1, 128)
        part = _pair_dots(lo, hi, qlo, qhi, DOT16) * ue8m0_to_f32(sb)[:, None]
        if g == 0:
            s = part
        else:
            s += part
    return s, tl.full([BLOCK_N], 1.0, tl.float32) * kmul


def _launch_plan(kernel: str, B: int, E: int, device: torch.device, block_n: int | None,
                 tiles_per_program: int | None) -> tuple[int, int, tuple[int, int]]:
    """(BN, tiles per program, grid) of one launch; block_n / tiles_per_program override CONFIG's choice."""
    cfg = CONFIG[kernel]
    BN = block_n or cfg["block_n"]
    n_tiles = triton.cdiv(E, BN)
    if tiles_per_program is None and kernel == "v3":    # one wave of resident programs, long runs of tiles
        waves = cfg["programs_per_sm"] * sm_count(device)
        tiles_per_program = max(1, min(cfg["max_tiles_per_program"], triton.cdiv(n_tiles * B, waves)))
    elif tiles_per_program is None:      # enough programs for ~4 per SM, then longer runs per program (q reuse)
        tiles_per_program = max(1, min(cfg["max_tiles_per_program"], n_tiles * B // (4 * sm_count(device))))
    return BN, tiles_per_program, (B, triton.cdiv(n_tiles, tiles_per_program))


def indexer_scores_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                                 page_table: torch.Tensor, n_vis: torch.Tensor, entries: torch.Tensor | None = None,
                                 n_entries: int | None = None, *, block_n: int | None = None,
                                 num_warps: int | None = None, tiles_per_program: int | None = None) -> torch.Tensor:
    """Triton twin of `indexer_scores_packed_ref` -> [B, E] fp32 (bf16-rounded values, -inf where invisible).

    The kernel follows from the index width and the pages' alignment (module docstring); the keywords override its
    CONFIG entry."""
    B, J, I = q.shape
    if q.dtype != torch.bfloat16:
        raise ValueError(f"indexer scores (triton): q must be bfloat16 (the model's rounding), got {q.dtype}")
    if I < 32 or I & (I - 1):
        raise ValueError(f"indexer scores (triton): index width must be a power of two >= 32, got {I}")
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 3 or index_pages.size(2) != I // 2 + I // 32:
        raise ValueError(f"indexer scores (triton): index_pages must be uint8 [*, *, {I // 2 + I // 32}], got "
                         f"{index_pages.dtype} {tuple(index_pages.shape)}")
    index_pages = index_pages.contiguous()
    kernel = "v1" if I > 128 else "v3" if I == 128 and index_pages.data_ptr() % 4 == 0 else "v2"
    if entries is None:
        E = int(n_vis.max()) if n_entries is None else n_entries
    else:
        E = entries.size(1)
        entries = entries.to(torch.int32).contiguous()
    out = torch.empty(B, E, dtype=torch.float32, device=q.device)
    if B == 0 or E == 0:
        return out
    BN, tpp, grid = _launch_plan(kernel, B, E, q.device, block_n, tiles_per_program)
    BJ = max(16, triton.next_power_of_2(J))
    args = (q.contiguous(), w.contiguous(), index_pages.view(torch.int32) if kernel == "v3" else index_pages,
            page_table.to(torch.int32).contiguous(), out if entries is None else entries,
            n_vis.to(torch.int32).contiguous(), out, E)
    launch = dict(num_warps=num_warps or CONFIG[kernel]["num_warps"], num_stages=CONFIG[kernel]["num_stages"])
    if kernel == "v3":
        LAST['indexer'] = _indexer_v3_kernel[grid](
            *args, page_table.size(1), tpp, J, P=index_pages.size(1), BLOCK_J=BJ, BLOCK_N=BN,
            GATHER=entries is not None, ASM=ASM, DOT16=DOT_BF16, **launch)
    elif kernel == "v2":
        LAST['indexer'] = _indexer_v2_kernel[grid](
            *args, index_pages.size(1), page_table.size(1), tpp, J, I=I, BLOCK_J=BJ, BLOCK_N=BN,
            GATHER=entries is not None, ASM=ASM, DOT16=DOT_BF16, **launch)
    else:
        LAST['indexer'] = _indexer_v1_kernel[grid](
            *args, index_pages.size(1), page_table.size(1), tpp, J, I=I, IDX_RB=I // 2 + I // 32, BLOCK_J=BJ,
            BLOCK_N=BN, GATHER=entries is not None, DOT_BF16=DOT_BF16, **launch)
    return out


def indexer_topk_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor, page_table: torch.Tensor,
                               n_vis: torch.Tensor, topk: int, cand_blocks: torch.Tensor | None = None,
                               pool_blocks: int = 0, block_size: int = 8, ties: str = "official",
                               n_max: int | None = None):
    """Triton twin of `indexer_topk_packed_ref`: the Triton scores, then the reference's torch selection."""
    return indexer_topk_packed_ref(q, w, index_pages, page_table, n_vis, topk, cand_blocks, pool_blocks, block_size,
                                   ties, n_max, score_fn=indexer_scores_packed_triton)
