"""Decode sparse attention over the packed store, staged: decode the selected entries to bf16 rows, then the
dense-KV kernel. Twin of `packed_ref.sparse_attn_packed_ref` (same signature): `sparse_attn_packed_triton`.

Legend: B rows, H heads, D head dim, KW window indices, K top-k indices, N = KW + K list positions, BN positions
per program, P page size, MP page-table width, W ring rows.

Stage 1 (`_stage_rows_kernel`, one program per (row, tile of BN list positions)): list position j < KW is the
ring row win_idx[b, j] of the row's slot (E4M3 + UE8M0/32), position KW + i the main-KV entry topk_idx[b, i]
found through the page table (E2M1 + E4M3/16); each is decoded by the PTX decoders of decoders.py (exact: every
stored value is bf16-representable) and written as a bf16 row of rows[b, j]; the list position (or -1 for an
empty one) goes to idx[b, j]. Stage 2 is `sparse_attn_triton` on (rows, idx): the model's decode list in the
model's order, so with blocks of 64 the result is the reference's up to summation order.

Why two stages: a kernel that decodes each tile in registers inside the softmax loop hands it to the tensor cores
through a layout change per dot and holds one program of 8 warps per SM (register-bound); at large batches such
kernels ran at 5-6% of the GPU's bf16 rate and 2-3x slower than this path (benchmarks/results/README.md). The bf16
rows cost a write and a read of 2*D bytes per position (about 1.3 MB per row at KW + K = 640, D = 512), which the
dense kernel reads through its pipelined loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.common import ASM, LAST
from dsv41.kernels.triton.decoders import P2_112, P2_118, e2m1_split, e4m3_to_f32, swa_split, ue8m0_to_f32
from dsv41.kernels.triton.sparse_attn_kernel import check_head_dim, sparse_attn_triton

__all__ = ["sparse_attn_packed_triton", "stage_packed_rows", "CONFIG"]

# Picked by benchmarks/kernels.py's sweeps on the H200. stage_*: stage 1's tile of list positions and warps; the
# rest are the dense kernel's launch parameters, block_h raised to large_block_h from large_rows rows on.
CONFIG = {"stage_block_n": 16, "stage_num_warps": 4, "block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2,
          "large_rows": 64, "large_block_h": 32}


@triton.jit
def _swa_tile(ring_ptr, rows, valid, D: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """(even, odd) bf16 [BN, D/2] channels of the SWA ring rows `rows` [BN] (invalid rows read as 0): the codes
    loaded as uint16 pairs [BN, D/32, 16], the UE8M0 scale bytes [BN, D/32] as bf16 2^(s - 15) (UE8M0 * 2^112)
    broadcast over their group."""
    RB: tl.constexpr = D + D // 32
    ring16 = ring_ptr.to(tl.pointer_type(tl.uint16))
    r = rows.to(tl.int64)
    g = tl.arange(0, D // 32)
    c = tl.arange(0, 16)
    codes = tl.load(ring16 + (r * (RB // 2))[:, None, None] + (g[None, :, None] * 16 + c[None, None, :]),
                    mask=valid[:, None, None], other=0)
    sb = tl.load(ring_ptr + (r * RB + D)[:, None] + g[None, :], mask=valid[:, None], other=0)
    sc = (ue8m0_to_f32(sb.to(tl.int32)) * P2_112).to(tl.bfloat16)
    sc = tl.broadcast_to(sc[:, :, None], (BN, D // 32, 16))
    k_e, k_o = swa_split(codes, sc, ASM)
    return tl.reshape(k_e, (BN, D // 2)), tl.reshape(k_o, (BN, D // 2))


@triton.jit
def _main_tile(main_ptr, rec, valid, D: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """(even, odd) bf16 [BN, D/2] channels of the main-KV records `rec` [BN] (record ids page * P + slot): nibble
    bytes [BN, D/16, 8], the E4M3 scale bytes [BN, D/16] as bf16 E4M3 * 2^118 broadcast over their group."""
    RB: tl.constexpr = D // 2 + D // 16
    r = rec.to(tl.int64) * RB
    g = tl.arange(0, D // 16)
    c = tl.arange(0, 8)
    byt = tl.load(main_ptr + r[:, None, None] + (g[None, :, None] * 8 + c[None, None, :]),
                  mask=valid[:, None, None], other=0)
    sb = tl.load(main_ptr + (r + D // 2)[:, None] + g[None, :], mask=valid[:, None], other=0)
    sc = (e4m3_to_f32(sb.to(tl.int32)) * P2_118).to(tl.bfloat16)
    sc = tl.broadcast_to(sc[:, :, None], (BN, D // 16, 8))
    k_e, k_o = e2m1_split(byt, sc, ASM)
    return tl.reshape(k_e, (BN, D // 2)), tl.reshape(k_o, (BN, D // 2))


@triton.jit
def _stage_rows_kernel(ring_ptr, slot_ptr, win_ptr, main_ptr, table_ptr, topk_ptr, rows_ptr, idx_ptr, KW, K, P,
                       MP, W, n_w_tiles, D: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
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
        k_e, k_o = _swa_tile(ring_ptr, base + tl.maximum(r, 0), valid, D, BLOCK_N, ASM)
    else:                                               # top-k positions: entries through the page table
        jk = (t - n_w_tiles) * BLOCK_N + i
        inside = jk < K
        e = tl.load(topk_ptr + b * K + jk, mask=inside, other=-1)
        valid = e >= 0
        e = tl.maximum(e, 0)
        page = tl.load(table_ptr + b * MP + e // P, mask=valid, other=0).to(tl.int64)
        k_e, k_o = _main_tile(main_ptr, page * P + e % P, valid, D, BLOCK_N, ASM)
        j = KW + jk
    kv = tl.reshape(tl.interleave(k_e, k_o), (BLOCK_N, D))
    d = tl.arange(0, D)
    tl.store(rows_ptr + (b * N + j)[:, None] * D + d[None, :], kv, mask=inside[:, None])
    tl.store(idx_ptr + b * N + j, tl.where(valid, j, -1).to(tl.int32), mask=inside)


def stage_packed_rows(swa_ring: torch.Tensor, ring_slots: torch.Tensor, win_idx: torch.Tensor,
                      main_pages: torch.Tensor, page_table: torch.Tensor, topk_idx: torch.Tensor,
                      block_n: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: (rows bf16 [B, KW+K, D], idx int32 [B, 1, KW+K]) of the decode list, -1 where a position is
    empty (its row is still written, as zeros, and never read). block_n, num_warps override CONFIG's stage_*."""
    block_n = block_n or CONFIG["stage_block_n"]
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
            D=D, BLOCK_N=block_n, ASM=ASM, num_warps=num_warps or CONFIG["stage_num_warps"])
    return rows, idx


def sparse_attn_packed_triton(q: torch.Tensor, swa_ring: torch.Tensor, ring_slots: torch.Tensor,
                              win_idx: torch.Tensor, main_pages: torch.Tensor, page_table: torch.Tensor,
                              topk_idx: torch.Tensor, sink: torch.Tensor, scale: float, *,
                              num_splits: int | None = None, block_h: int | None = None,
                              block_n: int | None = None, num_warps: int | None = None,
                              num_stages: int | None = None) -> torch.Tensor:
    """Triton twin of `sparse_attn_packed_ref` (same arguments) -> [B,H,D] bf16: `stage_packed_rows`, then
    `sparse_attn_triton` over the rows. The keywords override the dense kernel's launch parameters in CONFIG."""
    B, H, D = q.shape
    check_head_dim(D, "sparse_attn_packed")                  # (q's dtype: checked by sparse_attn_triton)
    for name, t, nbytes in (("swa_ring", swa_ring, D + D // 32), ("main_pages", main_pages, D // 2 + D // 16)):
        if t.dtype != torch.uint8 or t.dim() != 3 or t.size(2) != nbytes:
            raise ValueError(f"sparse_attn_packed (triton): {name} must be uint8 [*, *, {nbytes}] for D={D}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    over = dict(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    launch = {k: CONFIG[k] if v is None else v for k, v in over.items()}
    if block_h is None and B >= CONFIG["large_rows"]:
        launch["block_h"] = CONFIG["large_block_h"]
    rows, idx = stage_packed_rows(swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx)
    out = sparse_attn_triton(q.unsqueeze(1), rows, sink, idx, scale, num_splits=num_splits, **launch)[:, 0]
    LAST['packed'] = LAST.get('dense')
    return out
