"""Torch references of the kernels that read the engine's packed KV store (`dsv41.kv.pool.PackedKVPool`).

Each `*_ref` here has the signature of its Triton launcher (`dsv41.kernels.triton`) and is built only from the
codecs' unpack functions and the model's own math (`sparse_attn_ref`; the indexer of docs/model.md §3.6-3.7 as
`dsv41.model.attention.Indexer.select` computes it), so the kernels are compared with the model, not with a copy.

Legend: B batch rows (one decode query each), H heads, D head dim (= latent width C), S ring slots, W ring rows,
KW window indices, P page size (entries per page), NP pages, MP page-table width, K selected entries,
J indexer heads, I index-key width, N visible entries, NB candidate blocks, bs candidate block size.

Packed inputs (the pool's tensors, unchanged):
  swa_ring     uint8 [S, W, D + D/32]     E4M3 codes + UE8M0 per 32 (one ring per sequence slot)
  main_pages   uint8 [NP, P, D/2 + D/16]  E2M1 nibbles (even channel low) + E4M3 scale per 16
  index_pages  uint8 [NP, P, I/2 + I/32]  E2M1 nibbles + UE8M0 scale per 32
  page_table   int32 [B, MP]              page ids of each row's entries: entry e is row e % P of page
                                          page_table[b, e // P] (main and index records share the page)
"""

from __future__ import annotations

import torch

from dsv41.codecs import unpack_index_k, unpack_main_kv, unpack_swa_kv
from dsv41.kernels.invariant import canonical_lists, index_scores, is_deterministic
from dsv41.kernels.ref import sparse_attn_ref

__all__ = ["decode_window_rows", "gather_records", "sparse_attn_packed_ref", "indexer_scores_packed_ref",
           "pool_entries", "top_blocks", "candidate_pool", "indexer_select", "indexer_topk_packed_ref",
           "topk_indices"]

_LAST = torch.iinfo(torch.int32).max


# ------------------------------------------------------------------------------------------ layout helpers

def decode_window_rows(pos: torch.Tensor, W: int, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Ring rows [B, W] int32 of the decode window, oldest first: positions pos-W+1 .. pos at rows p % W, -1 for
    positions below 0 (or below floor_b, a replay start). The ring must already hold the token at `pos` (the
    engine writes it before attending); then this is `window_indices(pos, 1, W, False, floor)` of the model,
    row for row, since the model's chunk row W and ring row pos % W hold the same KV."""
    p = pos.view(-1, 1).long() - W + 1 + torch.arange(W, device=pos.device)
    lo = torch.zeros_like(p) if floor is None else floor.view(-1, 1).long().to(pos.device).expand_as(p)
    return torch.where(p < lo.clamp_min(0), -1, p % W).int()


def gather_records(pages: torch.Tensor, page_table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Records uint8 [B, n, bytes] of entry ids `entries` [B, n] (-1 entries read entry 0's bytes: mask them)."""
    P = pages.size(1)
    e = entries.long().clamp_min(0)
    if page_table.size(1) == 0:
        return pages.new_zeros(*entries.shape, pages.size(2))
    page = page_table.long().gather(1, (e // P).clamp_max(page_table.size(1) - 1))
    return pages[page, e % P]


# ------------------------------------------------------------------------------------------ sparse attention

def sparse_attn_packed_ref(q: torch.Tensor, swa_ring: torch.Tensor, ring_slots: torch.Tensor,
                           win_idx: torch.Tensor, main_pages: torch.Tensor, page_table: torch.Tensor,
                           topk_idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode sparse attention straight from the packed store (docs/model.md §3.8) -> [B, H, D] in q's dtype.

    q [B,H,D]; swa_ring uint8 [S,W,D+D/32]; ring_slots [B] (row b reads ring slot ring_slots[b]); win_idx [B,KW]
    ring rows in attention order (`decode_window_rows`), -1 none; main_pages uint8 [NP,P,D/2+D/16];
    page_table [B,MP] int32; topk_idx [B,K] compressed-entry ids (ascending, -1 none); sink [H] fp32.

    Computes `sparse_attn_ref` over KV = [the row's ring rows || the K selected entries] with the index list
    [win_idx || W + k for each selected k]: the model's decode list (window oldest first, then the top-k),
    so the blocks of 64 and the bf16 rounding of the probabilities are the model's."""
    W, K = swa_ring.size(1), topk_idx.size(1)       # (a verify passes W + T rows: the ring and its new rows)
    ring = unpack_swa_kv(swa_ring[ring_slots.long()])                                  # [B,W,D]
    comp = unpack_main_kv(gather_records(main_pages, page_table, topk_idx))            # [B,K,D]
    kv = torch.cat([ring, comp], dim=1).to(q.dtype)
    cidx = torch.where(topk_idx >= 0, W + torch.arange(K, device=q.device), -1)
    if is_deterministic():
        idx = canonical_lists(win_idx.long(), cidx.long() if K else None, win_idx.size(1), K).unsqueeze(1)
    else:
        idx = torch.cat([win_idx.long(), cidx.long()], dim=-1).unsqueeze(1)            # [B,1,KW+K]
    return sparse_attn_ref(q.unsqueeze(1), kv, sink, idx, scale)[:, 0]


# ------------------------------------------------------------------------------------------ indexer

def pool_entries(cand_blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Entry ids [B, NB*bs] of candidate blocks [B, NB] (-1 blocks give -1 entries), ascending when the blocks are."""
    e = cand_blocks.long().unsqueeze(-1) * block_size + torch.arange(block_size, device=cand_blocks.device)
    return torch.where(cand_blocks.unsqueeze(-1) >= 0, e, -1).flatten(1).int()


def indexer_scores_packed_ref(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                              page_table: torch.Tensor, n_vis: torch.Tensor, entries: torch.Tensor | None = None,
                              n_entries: int | None = None) -> torch.Tensor:
    """Index scores I[b, t] = sum_j w[b,j] * ReLU(q[b,j] . K_t) of one decode query per row (docs/model.md §3.6)
    -> fp32.

    q [B,J,I] (already MXFP4 QDQ'd), w [B,J], n_vis [B] entries visible to each row. Scores entry ids
    `entries` [B,E] (-1 none) or, when None, entries 0..n_entries-1 (default max n_vis). Invisible entries
    (id < 0 or >= n_vis) are -inf. Stages run in q's dtype, as the model's einsum / product / head sum."""
    B = q.size(0)
    if entries is None:
        n = int(n_vis.max()) if n_entries is None else n_entries
        entries = torch.arange(n, device=q.device, dtype=torch.int32).expand(B, n)
    keys = unpack_index_k(gather_records(index_pages, page_table, entries))           # [B,E,I]
    if is_deterministic():
        score = index_scores(q, keys, w)                                                # [B,E] fp32
    else:
        score = torch.einsum("bhd,bnd->bhn", q, keys.to(q.dtype))
        score = (score.relu() * w.unsqueeze(-1)).sum(dim=1)                            # [B,E]
    visible = (entries >= 0) & (entries.long() < n_vis.view(-1, 1).to(entries.device))
    return score.float().masked_fill(~visible, -torch.inf)


TIE_RULES = ("official", "official-cpu", "recent")


def topk_indices(score: torch.Tensor, k: int, ties: str) -> torch.Tensor:
    """Indices of the k largest entries along the last axis. ties="official": torch's `topk(sorted=False)` on the
    score's device (on a CPU the official code's order among exact ties; CUDA's topk orders ties otherwise);
    "official-cpu": the official order on any device (a GPU's rows go through the host: one sync a call, for parity
    runs); "recent": ties broken toward the larger index (`dsv41.model.attention.set_tie_break`)."""
    if ties == "official" or (ties == "official-cpu" and score.device.type == "cpu"):
        return score.topk(k, dim=-1, sorted=False).indices
    if ties == "official-cpu":
        return score.cpu().topk(k, dim=-1, sorted=False).indices.to(score.device)
    if ties != "recent":
        raise ValueError(f"tie break must be one of {TIE_RULES}, got {ties!r}")
    order = torch.sort(score.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return score.size(-1) - 1 - order


def _ascending_tail(ids: torch.Tensor) -> torch.Tensor:
    """Sort ids ascending with the -1s at the tail (the model's order of top-k and pool lists)."""
    key = torch.where(ids < 0, _LAST, ids.int())
    s = key.sort(dim=-1).values
    return torch.where(s == _LAST, -1, s).int()


def top_blocks(scores: torch.Tensor, n_vis: torch.Tensor, n_blocks: int, block_size: int,
               ties: str = "official") -> tuple[torch.Tensor, torch.Tensor]:
    """Level one of the hierarchical indexer (docs/model.md §3.7), shared by the model's `select_candidate_blocks` and
    `candidate_pool`: block score = max over `block_size` entries, the block holding the newest visible entry
    pinned to +inf, then the top min(n_blocks, nb) blocks. scores [..., N] (invisible = -inf), n_vis visible
    counts broadcastable to [..., 1] -> (block scores [..., nb], top block ids [..., min(n_blocks, nb)])."""
    N = scores.size(-1)
    padded = torch.nn.functional.pad(scores, (0, -N % block_size), value=-torch.inf)
    blocks = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)                       # [..., nb]
    nb = blocks.size(-1)
    last = torch.div(n_vis - 1, block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(nb, device=scores.device) == last, torch.inf)
    return blocks, topk_indices(blocks, min(n_blocks, nb), ties)


def candidate_pool(scores: torch.Tensor, n_vis: torch.Tensor, pool_blocks: int, block_size: int,
                   ties: str = "official") -> torch.Tensor:
    """`select_candidate_blocks` (docs/model.md §3.7) as block ids: [B, min(pool_blocks, nb)] int32, ascending, -1 for
    slots whose block score is -inf. scores [B,N] over entries 0..N-1 (invisible = -inf)."""
    n_vis = n_vis.view(-1, 1).long().to(scores.device)
    blocks, top = top_blocks(scores, n_vis, pool_blocks, block_size, ties)
    keep = blocks.gather(-1, top) > -torch.inf
    return _ascending_tail(torch.where(keep, top, -1))


def indexer_select(scores: torch.Tensor, entries: torch.Tensor | None, n_vis: torch.Tensor, topk: int,
                   n_max: int, ties: str = "official") -> torch.Tensor:
    """Top-k of scored entries -> entry ids [B, min(topk, n_max)] int32, ascending, -1 tail (docs/model.md §3.6).

    scores [B,E] over `entries` [B,E] (None: entries 0..E-1); n_max = the widest row's visible count (the
    model's k is min(topk, n_max)). Selected ids outside 0..n_vis-1 become -1, as the model's. A restricted
    list narrower than k (possible only when topk > pool) is padded with -1."""
    k = min(topk, n_max)
    if scores.size(-1) < k:                          # only a restricted list (entries given) can be narrower
        pad = k - scores.size(-1)
        scores = torch.nn.functional.pad(scores, (0, pad), value=-torch.inf)
        entries = torch.nn.functional.pad(entries, (0, pad), value=-1)
    pos = topk_indices(scores, k, ties)
    ids = pos if entries is None else entries.long().gather(-1, pos)
    ok = (ids >= 0) & (ids < n_vis.view(-1, 1).long().to(ids.device))
    return _ascending_tail(torch.where(ok, ids, -1))


def indexer_topk_packed_ref(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor, page_table: torch.Tensor,
                            n_vis: torch.Tensor, topk: int, cand_blocks: torch.Tensor | None = None,
                            pool_blocks: int = 0, block_size: int = 8, ties: str = "official",
                            n_max: int | None = None, *, score_fn=indexer_scores_packed_ref):
    """Decode indexer over packed MXFP4 keys -> (top-k entry ids [B, min(topk, max n_vis)] int32, pool or None).

    Full layer: scores every visible entry. Candidate source (pool_blocks > 0): also returns its candidate pool
    as block ids [B, min(pool_blocks, nb)] (ascending, -1 tail), its own top-k from the unmasked scores.
    Reindex layer (cand_blocks given): scores only the pool's entries, which selects what the model's
    mask-then-top-k selects (the same set; with ties='recent' the same ids, since the pool lists entries in
    ascending order). Shapes as `indexer_scores_packed_ref`. n_max: max(n_vis) when the caller knows it (the
    engine does), which saves a host sync. score_fn: the scores (the Triton twin passes its kernel's: the
    reference and the Triton path differ only there)."""
    B = q.size(0)
    n_max = int(n_vis.max()) if n_max is None else n_max
    if n_max == 0:                                   # the model skips the indexer: empty selection, no pool
        empty = torch.empty(B, 0, dtype=torch.int32, device=q.device)
        return empty, (empty if pool_blocks else None)
    if cand_blocks is not None:                      # Reindex: score only the candidate pool's entries
        if pool_blocks:
            raise ValueError("a layer either publishes a candidate pool (pool_blocks > 0) or uses one (cand_blocks)")
        entries = pool_entries(cand_blocks, block_size)
        scores = score_fn(q, w, index_pages, page_table, n_vis, entries)
        return indexer_select(scores, entries, n_vis, topk, n_max, ties), None
    scores = score_fn(q, w, index_pages, page_table, n_vis, None, n_max)
    pool = candidate_pool(scores, n_vis, pool_blocks, block_size, ties) if pool_blocks else None
    return indexer_select(scores, None, n_vis, topk, n_max, ties), pool
