"""The "staged" packed decode attention: decode the selected entries to bf16 rows, then the dense-KV kernel.

Twin of `packed_ref.sparse_attn_packed_ref` through `sparse_attn_packed_triton(..., impl="staged")`.

Legend: B rows, H heads, D head dim, KW window indices, K top-k indices, N = KW + K list positions, BN positions
per program, P page size, MP page-table width, W ring rows.

Stage 1 (`_stage_rows_kernel`, one program per (row, tile of BN list positions)): list position j < KW is the
ring row win_idx[b, j] of the row's slot (E4M3 + UE8M0/32), position KW + i the main-KV entry topk_idx[b, i]
found through the page table (E2M1 + E4M3/16); each is decoded by the same PTX decoders as the fused kernel
(exact: every stored value is bf16-representable) and written as a bf16 row of rows[b, j]; the list position
(or -1 for an empty one) goes to idx[b, j]. Stage 2 is `_sparse_attn_dense_kernel` on (rows, idx): the model's
decode list in the model's order, so with blocks of 64 the result is the reference's up to summation order.

Why: the fused kernels decode each tile in registers and hand it to the tensor cores through a layout change per
dot, one program of 8 warps per SM (12.5% occupancy, register-bound); at large batches that ran at 5-6% of the
GPU's bf16 rate. The bf16 rows cost a write and a read of
2*D bytes per position (about 1.3 MB per row at KW + K = 640, D = 512), which the dense kernel reads through its
pipelined loads. It is the default of `sparse_attn_packed_triton` (measured figures in sparse_attn_kernel.CONFIG).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.sparse_attn_kernel import (_ASM, _E2M1_TO_E4M3, _F16_TO_BF16, _P2_112, _P2_118, LAST,
                                                     _e2m1_split, _e4m3_to_f32, _main_load, _main_split_tile,
                                                     _swa_load, _swa_split, _swa_split_tile, _ue8m0_to_f32)

__all__ = ["stage_packed_rows", "STORES"]

STORES = ("interleave", "pairs")

# "pairs" store: each output is one 32-bit word = the bf16 pair (channel 2i, 2i+1), in memory order, decoded by PTX
# without separating even and odd channels (sparse_attn_kernel's decoders, the E4M3 pair kept together):
# SWA: uint16 element i (E4M3 channels 2i | 2i+1 << 8), pack 2: $2 = two elements, $3 = their two bf16 scales
# (UE8M0 * 2^112); $0 $1 = the pairs, times the element's scale duplicated into both halves (prmt).
_SWA_PAIRS_ASM = tl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b, s0, s1, t, z;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;""" + _F16_TO_BF16.format(r="a") + _F16_TO_BF16.format(r="b") + """
prmt.b32 s0, $3, $3, 0x1010;
prmt.b32 s1, $3, $3, 0x3232;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, a, s0, z;
fma.rn.bf16x2 $1, b, s1, z;
}""")

# Main KV: uint8 element k (E2M1 channel 2k low nibble, 2k+1 high), pack 4: $4 = four bytes, $5 $6 = their four
# bf16 scales (E4M3 * 2^118); the nibbles become E4M3 bytes as in `_E2M1_ASM` (A: low nibbles, B: high), then
# byte pairs (A_k, B_k) are formed by prmt and converted together: $0..$3 = the pairs (2k, 2k+1) of elements 0..3.
_E2M1_PAIRS_ASM = tl.constexpr("""{
.reg .b16 p0, p1, p2, p3;
.reg .b32 t1, t2, A, B, C, E, r0, r1, r2, r3, s0, s1, s2, s3, t, z;
""" + _E2M1_TO_E4M3.format(x="$4") + """
prmt.b32 C, A, B, 0x5140;
prmt.b32 E, A, B, 0x7362;
mov.b32 {p0, p1}, C;
mov.b32 {p2, p3}, E;
cvt.rn.f16x2.e4m3x2 r0, p0;
cvt.rn.f16x2.e4m3x2 r1, p1;
cvt.rn.f16x2.e4m3x2 r2, p2;
cvt.rn.f16x2.e4m3x2 r3, p3;""" + "".join(_F16_TO_BF16.format(r=r) for r in ("r0", "r1", "r2", "r3")) + """
prmt.b32 s0, $5, $5, 0x1010;
prmt.b32 s1, $5, $5, 0x3232;
prmt.b32 s2, $6, $6, 0x1010;
prmt.b32 s3, $6, $6, 0x3232;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, r0, s0, z;
fma.rn.bf16x2 $1, r1, s1, z;
fma.rn.bf16x2 $2, r2, s2, z;
fma.rn.bf16x2 $3, r3, s3, z;
}""")


@triton.jit
def _pair_bits(ev, od):
    """int32 word of the bf16 pair (ev low half, od high half)."""
    return ev.to(tl.uint16, bitcast=True).to(tl.int32) | (od.to(tl.uint16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _swa_pairs(codes, sb, D: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """int32 [BN, D/2] channel pairs of `_swa_load`'s bytes (SC3D layout)."""
    sc = tl.broadcast_to(((_ue8m0_to_f32(sb.to(tl.int32)) * _P2_112).to(tl.bfloat16))[:, :, None], (BN, D // 32, 16))
    if ASM:
        w = tl.inline_asm_elementwise(_SWA_PAIRS_ASM, "=r,=r,r,r", [codes, sc], dtype=tl.int32, is_pure=True, pack=2)
    else:
        ev, od = _swa_split(codes, sc, False)
        w = _pair_bits(ev, od)
    return tl.reshape(w, (BN, D // 2))


@triton.jit
def _e2m1_pairs(byt, sb, D: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """int32 [BN, D/2] channel pairs of `_main_load`'s bytes (SC3D layout)."""
    sc = tl.broadcast_to(((_e4m3_to_f32(sb.to(tl.int32)) * _P2_118).to(tl.bfloat16))[:, :, None], (BN, D // 16, 8))
    if ASM:
        w = tl.inline_asm_elementwise(_E2M1_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [byt, sc], dtype=tl.int32,
                                      is_pure=True, pack=4)
    else:
        ev, od = _e2m1_split(byt, sc, False)
        w = _pair_bits(ev, od)
    return tl.reshape(w, (BN, D // 2))


@triton.jit
def _stage_rows_kernel(ring_ptr, slot_ptr, win_ptr, main_ptr, table_ptr, topk_ptr, rows_ptr, idx_ptr, KW, K, P,
                       MP, W, n_w_tiles, D: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                       STORE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    N = KW + K
    i = tl.arange(0, BLOCK_N)
    if t < n_w_tiles:                                   # window positions t*BN .. : ring rows of the row's slot
        j = t * BLOCK_N + i
        inside = j < KW
        r = tl.load(win_ptr + b * KW + j, mask=inside, other=-1)
        valid = r >= 0
        base = tl.load(slot_ptr + b).to(tl.int64) * W
        codes, sc_w = _swa_load(ring_ptr, base + tl.maximum(r, 0), valid, D, BLOCK_N, True)
        if STORE == 1:
            pairs = _swa_pairs(codes, sc_w, D, BLOCK_N, ASM)
        else:
            k_e, k_o = _swa_split_tile(codes, sc_w, D, BLOCK_N, True, ASM)
    else:                                               # top-k positions: entries through the page table
        jk = (t - n_w_tiles) * BLOCK_N + i
        inside = jk < K
        e = tl.load(topk_ptr + b * K + jk, mask=inside, other=-1)
        valid = e >= 0
        e = tl.maximum(e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        byt, sc_m = _main_load(main_ptr, page * P + e % P, valid, D, BLOCK_N, True)
        if STORE == 1:
            pairs = _e2m1_pairs(byt, sc_m, D, BLOCK_N, ASM)
        else:
            k_e, k_o = _main_split_tile(byt, sc_m, D, BLOCK_N, True, ASM)
        j = KW + jk
    if STORE == 1:      # channel pairs as 32-bit words
        dst = rows_ptr.to(tl.pointer_type(tl.int32)) + (b * N + j)[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
        tl.store(dst, pairs, mask=inside[:, None])
    else:
        kv = tl.reshape(tl.interleave(k_e, k_o), (BLOCK_N, D))
        d = tl.arange(0, D)
        tl.store(rows_ptr + (b * N + j)[:, None] * D + d[None, :], kv, mask=inside[:, None])
    tl.store(idx_ptr + b * N + j, tl.where(valid, j, -1).to(tl.int32), mask=inside)


def stage_packed_rows(swa_ring: torch.Tensor, ring_slots: torch.Tensor, win_idx: torch.Tensor,
                      main_pages: torch.Tensor, page_table: torch.Tensor, topk_idx: torch.Tensor,
                      block_n: int = 16, num_warps: int = 4,
                      store: str = "interleave") -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: (rows bf16 [B, KW+K, D], idx int32 [B, 1, KW+K]) of the decode list, -1 where a position is
    empty (its row is still written, as zeros, and never read). store: how the decoded tile reaches memory
    (`STORES`: the even / odd halves interleaved in registers, or PTX-decoded channel pairs); the same bytes either
    way. (A third way, two strided stores of the halves, was 10x slower on the H200 and was dropped.)"""
    if store not in STORES:
        raise ValueError(f"stage_packed_rows: store must be one of {STORES}, got {store!r}")
    B, KW, K = win_idx.size(0), win_idx.size(1), topk_idx.size(1)
    D = swa_ring.size(2) * 32 // 33
    N = KW + K
    rows = torch.empty(B, N, D, dtype=torch.bfloat16, device=swa_ring.device)
    idx = torch.empty(B, 1, N, dtype=torch.int32, device=swa_ring.device)
    n_w = triton.cdiv(KW, block_n)
    if B and N:
        LAST['stage'] = _stage_rows_kernel[(B, n_w + triton.cdiv(K, block_n))](
            swa_ring.contiguous(), ring_slots.to(torch.int32).contiguous(), win_idx.to(torch.int32).contiguous(),
            main_pages.contiguous(), page_table.to(torch.int32).contiguous(), topk_idx.to(torch.int32).contiguous(),
            rows, idx, KW, K, main_pages.size(1), page_table.size(1), swa_ring.size(1), n_w,
            D=D, BLOCK_N=block_n, ASM=_ASM, STORE=STORES.index(store), num_warps=num_warps)
    return rows, idx
