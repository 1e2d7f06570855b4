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
from dsv41.kernels.triton.sparse_attn_kernel import _DOT_BF16, LAST, _index_tile, _sm_count

__all__ = ["indexer_scores_packed_triton", "indexer_topk_packed_triton", "CONFIG"]

CONFIG = {"block_n": 128, "num_warps": 8, "num_stages": 1, "max_tiles_per_program": 8}


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


def indexer_scores_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                                 page_table: torch.Tensor, n_vis: torch.Tensor, entries: torch.Tensor | None = None,
                                 n_entries: int | None = None, *, block_n: int | None = None,
                                 num_warps: int | None = None, num_stages: int | None = None,
                                 tiles_per_program: int | None = None) -> torch.Tensor:
    """Triton twin of `indexer_scores_packed_ref` -> [B, E] fp32 (bf16-rounded values, -inf where invisible)."""
    B, J, I = q.shape
    if q.dtype != torch.bfloat16:
        raise ValueError(f"indexer scores (triton): q must be bfloat16 (the model's rounding), got {q.dtype}")
    if I < 32 or I & (I - 1):
        raise ValueError(f"indexer scores (triton): index width must be a power of two >= 32, got {I}")
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 3 or index_pages.size(2) != I // 2 + I // 32:
        raise ValueError(f"indexer scores (triton): index_pages must be uint8 [*, *, {I // 2 + I // 32}], got "
                         f"{index_pages.dtype} {tuple(index_pages.shape)}")
    BN = block_n or CONFIG["block_n"]
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
        tiles_per_program = max(1, min(CONFIG["max_tiles_per_program"], n_tiles * B // (4 * _sm_count(q.device))))
    grid = (B, triton.cdiv(n_tiles, tiles_per_program))
    LAST['indexer'] = _indexer_scores_kernel[grid](
        q.contiguous(), w.contiguous(), index_pages.contiguous(), page_table.to(torch.int32).contiguous(),
        out if entries is None else entries, n_vis.to(torch.int32).contiguous(), out, E, index_pages.size(1),
        page_table.size(1), tiles_per_program, J, I=I, IDX_RB=I // 2 + I // 32,
        BLOCK_J=max(16, triton.next_power_of_2(J)), BLOCK_N=BN, GATHER=entries is not None, DOT_BF16=_DOT_BF16,
        num_warps=num_warps or CONFIG["num_warps"], num_stages=num_stages or CONFIG["num_stages"])
    return out


def indexer_topk_packed_triton(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor, page_table: torch.Tensor,
                               n_vis: torch.Tensor, topk: int, cand_blocks: torch.Tensor | None = None,
                               pool_blocks: int = 0, block_size: int = 8, ties: str = "official",
                               n_max: int | None = None):
    """Triton twin of `indexer_topk_packed_ref`: the Triton scores, then the reference's torch selection."""
    return _indexer_topk(indexer_scores_packed_triton, q, w, index_pages, page_table, n_vis, topk, cand_blocks,
                         pool_blocks, block_size, ties, n_max)
