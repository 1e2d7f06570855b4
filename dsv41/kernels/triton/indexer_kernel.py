"""Triton indexer scores over packed MXFP4 index keys, for one decode query per row (MODEL.md 3.6).

Twins (same signatures): `indexer_scores_packed_triton` ~ `packed_ref.indexer_scores_packed_ref`,
`indexer_topk_packed_triton` ~ `packed_ref.indexer_topk_packed_ref`.

Legend: B rows, J indexer heads (BJ padded to >= 16), I index-key width, E scored entries per row, BN entries per
tile, P page size, MP page-table width.

One program per (row, run of tiles of BN entries): q [J, I] and w [J] stay in registers; each tile gathers its
entries' 68-byte records through the page table (entry ids 0..E-1, or an explicit list: the candidate pool of a
Reindex layer), dequantizes E2M1 * 2^(UE8M0) to bf16 in registers (exact), and computes
I[t] = sum_j w[j] * ReLU(q_j . K_t) with the model's bf16 roundings (the einsum output, the product with w and
the head sum are bf16 tensors there; here fp32 accumulation rounded to bf16 at the same three places, so ties
come out as the model's). Only the [B, E] fp32 scores are written: the context is walked in tiles, nothing of
size [heads x context] exists. First version: the top-k, the block max of the candidate pool and the pool's
top blocks are torch ops on those scores (`packed_ref.indexer_select` / `candidate_pool`), not fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.packed_ref import _indexer_topk
from dsv41.kernels.triton.sparse_attn_kernel import (_ASM, _DOT_BF16, LAST, _e2m1_to_f32, _index_tile, _sm_count,
                                                     _ue8m0_to_f32)

__all__ = ["indexer_scores_packed_triton", "indexer_topk_packed_triton", "CONFIG"]

CONFIG = {"impl": "v2", "block_n": 64, "num_warps": 4, "num_stages": 1, "max_tiles_per_program": 8}
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
shl.b32 t1, $4, 2;
and.b32 t1, t1, 0x1C1C1C1C;
shl.b32 t2, $4, 4;
and.b32 t2, t2, 0x80808080;
or.b32 A, t1, t2;
shr.b32 t1, $4, 2;
and.b32 t1, t1, 0x1C1C1C1C;
and.b32 t2, $4, 0x80808080;
or.b32 B, t1, t2;
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
def _k_group(pages_ptr, rec, valid, kmul, qlo, qhi, g: tl.constexpr, I: tl.constexpr, ASM: tl.constexpr,
             DOT16: tl.constexpr):
    """Group g's scaled partial scores [BN, BJ] fp32 of the records at byte offsets rec [BN]."""
    RB: tl.constexpr = I // 2 + I // 32
    c = tl.arange(0, 16)
    byt = tl.load(pages_ptr + rec[:, None] + 16 * g + c[None, :], mask=valid[:, None], other=0)
    sb = tl.load(pages_ptr + rec + I // 2 + g, mask=valid, other=0).to(tl.int32)
    lo, hi = _e2m1_f16(byt, ASM)
    if DOT16:
        part = tl.dot(lo, qlo)
        part = tl.dot(hi, qhi, part)
    else:
        part = tl.dot(lo.to(tl.float32), qlo.to(tl.float32))
        part = tl.dot(hi.to(tl.float32), qhi.to(tl.float32), part)
    return part * (_ue8m0_to_f32(sb) * kmul)[:, None]


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
    d = tl.arange(0, I)
    qf = tl.load(q_ptr + (b * J + hj[:, None]) * I + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
    qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
    ex = (qmax.to(tl.int32, bitcast=True) >> 23) & 255              # biased exponent of max |q| (0: all zero)
    cexp = tl.where(ex > 0, 141 - ex, 0)                            # c = 14 - (ex - 127)
    qs = ((cexp + 127) << 23).to(tl.float32, bitcast=True)          # 2^c
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


def indexer_scores_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                                 page_table: torch.Tensor, n_vis: torch.Tensor, entries: torch.Tensor | None = None,
                                 n_entries: int | None = None, *, block_n: int | None = None,
                                 num_warps: int | None = None, num_stages: int | None = None,
                                 tiles_per_program: int | None = None, impl: str | None = None) -> torch.Tensor:
    """Triton twin of `indexer_scores_packed_ref` -> [B, E] fp32 (bf16-rounded values, -inf where invisible).

    impl "v2" (default; index widths 32, 64, 128): `_indexer_v2_kernel`; "v1": the first kernel (`V1_CONFIG`)."""
    B, J, I = q.shape
    if q.dtype != torch.bfloat16:
        raise ValueError(f"indexer scores (triton): q must be bfloat16 (the model's rounding), got {q.dtype}")
    if I < 32 or I & (I - 1):
        raise ValueError(f"indexer scores (triton): index width must be a power of two >= 32, got {I}")
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 3 or index_pages.size(2) != I // 2 + I // 32:
        raise ValueError(f"indexer scores (triton): index_pages must be uint8 [*, *, {I // 2 + I // 32}], got "
                         f"{index_pages.dtype} {tuple(index_pages.shape)}")
    impl = impl or CONFIG["impl"]
    if I > 128:
        impl = "v1"
    cfg = CONFIG if impl == "v2" else V1_CONFIG
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
    if tiles_per_program is None:        # enough programs for ~4 per SM, then longer runs per program (q reuse)
        tiles_per_program = max(1, min(cfg["max_tiles_per_program"], n_tiles * B // (4 * _sm_count(q.device))))
    grid = (B, triton.cdiv(n_tiles, tiles_per_program))
    BJ = max(16, triton.next_power_of_2(J))
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
