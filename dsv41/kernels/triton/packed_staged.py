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

from dsv41.kernels.triton.sparse_attn_kernel import (_ASM, LAST, _main_load, _main_split_tile, _swa_load,
                                                     _swa_split_tile)

__all__ = ["stage_packed_rows"]


@triton.jit
def _stage_rows_kernel(ring_ptr, slot_ptr, win_ptr, main_ptr, table_ptr, topk_ptr, rows_ptr, idx_ptr, KW, K, P,
                       MP, W, n_w_tiles, D: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                       SPLIT_STORE: tl.constexpr):
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
        k_e, k_o = _swa_split_tile(codes, sc_w, D, BLOCK_N, True, ASM)
    else:                                               # top-k positions: entries through the page table
        jk = (t - n_w_tiles) * BLOCK_N + i
        inside = jk < K
        e = tl.load(topk_ptr + b * K + jk, mask=inside, other=-1)
        valid = e >= 0
        e = tl.maximum(e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        byt, sc_m = _main_load(main_ptr, page * P + e % P, valid, D, BLOCK_N, True)
        k_e, k_o = _main_split_tile(byt, sc_m, D, BLOCK_N, True, ASM)
        j = KW + jk
    if SPLIT_STORE:     # even and odd channels stored by two strided stores (no interleave in registers)
        dst = rows_ptr + (b * N + j)[:, None] * D + 2 * tl.arange(0, D // 2)[None, :]
        tl.store(dst, k_e, mask=inside[:, None])
        tl.store(dst + 1, k_o, mask=inside[:, None])
    else:
        kv = tl.reshape(tl.interleave(k_e, k_o), (BLOCK_N, D))
        d = tl.arange(0, D)
        tl.store(rows_ptr + (b * N + j)[:, None] * D + d[None, :], kv, mask=inside[:, None])
    tl.store(idx_ptr + b * N + j, tl.where(valid, j, -1).to(tl.int32), mask=inside)


def stage_packed_rows(swa_ring: torch.Tensor, ring_slots: torch.Tensor, win_idx: torch.Tensor,
                      main_pages: torch.Tensor, page_table: torch.Tensor, topk_idx: torch.Tensor,
                      block_n: int = 32, num_warps: int = 4,
                      split_store: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: (rows bf16 [B, KW+K, D], idx int32 [B, 1, KW+K]) of the decode list, -1 where a position is
    empty (its row is still written, as zeros, and never read)."""
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
            D=D, BLOCK_N=block_n, ASM=_ASM, SPLIT_STORE=split_store, num_warps=num_warps)
    return rows, idx
