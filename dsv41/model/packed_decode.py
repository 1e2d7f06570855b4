"""Decode attention straight from the packed store (the engine's `BatchView`): the one-token step of a layer
reads the FP8 ring rows and only the top-k FP4 main-KV records it selected, and scores the MXFP4 index keys in
place, through the kernel ops of `dsv41.kernels` (`sparse_attn_packed`, `indexer_topk_packed`; Triton on a GPU,
their torch references elsewhere). The dense path instead unpacks each source layer's whole compressed history
every step. Same index lists and order as the dense path (the references are built from the model's own math),
so on the reference backend the two agree to the last bit (tests/test_kv_paged.py).

Used when: one token per row (decode), a packed store, quantization on, no recording (parity runs), not the
official decode artifact (`applies`). `dsv41.kernels.choice.set_packed_decode(False)` forces the dense path
everywhere.

With `dsv41.kernels.choice.set_packed_verify(True)`, a continuation of 2..VERIFY_MAX_TOKENS tokens per row (a
speculative verify, eager) reads the store the same way (`attend_packed`): each query token becomes a virtual row
of its own (V = B x T), whose window is the ring as it was before the call followed by this call's rows (the
layout of `window_indices`), and whose indexer sees the entries visible at its own position. Each virtual row is
then the one-token decode of that token.
"""

from __future__ import annotations

import torch

from dsv41.devices import h2d
from dsv41.kernels import decode_window_rows, indexer_topk_packed, sparse_attn_packed
from dsv41.kernels.choice import packed_decode, packed_verify
from dsv41.kernels.invariant import is_deterministic
from dsv41.model.cache import PackedKVStore
from dsv41.model.step import StepContext


def applies(attn, ctx: StepContext) -> bool:
    """The kernels allow it (`dsv41.kernels.choice.packed_decode`), and the step neither records (parity runs
    inspect the dense path's selections) nor reproduces the official decode artifact (its stale index keys)."""
    return (packed_decode(ctx.seqlen, ctx.cache.packed, attn.quant) and ctx.record is None
            and not ctx.opts.official_decode_artifact)


VERIFY_MAX_TOKENS = 16         # continuations up to this many tokens per row take `attend_packed`


def verify_applies(attn, ctx: StepContext, prefill: bool) -> bool:
    """`attend_packed` for this call: switched on (`dsv41.kernels.choice.set_packed_verify`), 2..VERIFY_MAX_TOKENS
    (and at most a window of) continuation tokens per row, eager, under the conditions of `applies`."""
    T = ctx.seqlen
    return (packed_verify() and 1 < T <= min(VERIFY_MAX_TOKENS, attn.window) and not prefill and not ctx.static
            and packed_decode(1, ctx.cache.packed, attn.quant) and ctx.record is None
            and not ctx.opts.official_decode_artifact)


def _rows(table: torch.Tensor, T: int) -> torch.Tensor:
    """A per-row tensor [B,...] repeated for the T virtual rows of each row [B*T,...]."""
    return table if T == 1 else table.repeat_interleave(T, dim=0)


def _selection(attn, u, qr, freqs, ctx: StepContext) -> torch.Tensor:
    """Top-k compressed-entry ids [B*T,K] (ascending, -1 none) of a layer with m > 0, a row per query token (T = 1
    for a decode step); publishes what layers above read (their top-k source, their candidate pool as block ids)."""
    role, m, pub = attn.role, attn.role.ratio, ctx.published
    cache: PackedKVStore = ctx.cache
    B, T = u.shape[:2]
    if not role.is_index_source:
        return pub.topk_packed[role.topk_from]

    def visible():                                          # entries visible to each query, shared by the step's layers
        n_vis = (ctx.start.view(-1, 1) + torch.arange(1, T + 1, device=ctx.start.device)).view(-1) // m
        if ctx.static:                                      # the width fixed by the store, the counts on the device
            return ctx.entry_capacity(m), n_vis
        return int(n_vis.max()), h2d(n_vis, u.device)
    n_max, n_vis = ctx.memoized(("n-vis", m), visible)
    if n_max == 0:
        idx = pool = torch.empty(B * T, 0, dtype=torch.int32, device=u.device)     # (the pool: a candidate source's)
    else:
        ix = attn.indexer
        qi, w = (t.flatten(0, 1) for t in ix.queries(u, qr, freqs))                   # [B*T,J,I], [B*T,J]
        pages, table = cache.packed_pages(role.kv_from, "index")
        table = _rows(table, T)
        cand = pub.pool[role.candidates_from] if role.uses_candidates else None
        idx, pool = indexer_topk_packed(qi, w, pages, table, n_vis, ix.topk, cand,
                                        ix.cand_blocks if role.is_candidate_source else 0, ix.cand_size,
                                        ix.ties, n_max=n_max)
    if role.is_candidate_source:
        pub.pool[role.layer] = pool
    pub.topk_packed[role.layer] = idx
    return idx


def _compressed(attn, u, qr, freqs, ctx: StepContext):
    """The compressed part of the attention lists of u [B,T,...]: this call's global KV produced (a KV source), the
    top-k entry ids [B*T,K] (-1 none; the full top-k width in the deterministic mode, the lists' canonical layout),
    and the main-KV pages with their page table [B,MP] (an empty stand-in for a window-only layer)."""
    cache: PackedKVStore = ctx.cache
    if not attn.role.ratio:
        return (torch.empty(u.size(0) * u.size(1), 0, dtype=torch.int32, device=u.device),
                *cache.packed_pages(None, "main"))
    if attn.compressor is not None and ctx.opts.produce_kv:
        attn.produce_global_kv(u, ctx)
    topk = _selection(attn, u, qr, freqs, ctx)
    if is_deterministic():
        topk = torch.nn.functional.pad(topk, (0, attn.topk - topk.size(1)), value=-1)
    return (topk, *cache.packed_pages(attn.role.kv_from, "main"))


def attention_decode_packed(attn, u: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """`Attention.forward` for one token per row over the packed store. u [B,1,D] -> [B,1,D]."""
    cache: PackedKVStore = ctx.cache
    L = attn.layer
    freqs = ctx.memoized(("rope-freqs", attn.rope.key),                            # one per theta / YaRN setting
                         lambda: h2d(attn.rope.freqs(ctx.positions), u.device))     # [B,1,R/2]
    qr, q = attn.queries(u, freqs)
    cache.write_window(L, ctx.start, attn.window_kv(u, freqs))                       # the ring now holds pos
    floor = ctx.opts.floor_for(L)
    win = ctx.memoized(("window-rows", attn.window, floor is None),
                       lambda: decode_window_rows(h2d(ctx.start, u.device), attn.window, floor))
    topk, main, table = _compressed(attn, u, qr, freqs, ctx)
    ring, slots = cache.packed_ring(L)
    o = sparse_attn_packed(q[:, 0], ring, slots, win, main, table, topk, attn.attn_sink, attn.softmax_scale)
    conj = ctx.memoized(("rope-conj", attn.rope.key), lambda: freqs.conj().resolve_conj())
    return attn.output(o.unsqueeze(1), freqs, conj)


def attend_packed(attn, u, qr, q, kv, freqs, win_idx, ctx: StepContext) -> torch.Tensor:
    """`Attention.attend` for T continuation tokens per row (`verify_applies`) over the packed store: u [B,T,D],
    q [B,T,H,C], kv [B,T,C] (this call's window KV), win_idx [B,T,W] (`window_indices`: into [ring || this
    call's T rows]) -> [B,T,H,C]. Query token t of row b is virtual row b*T + t."""
    cache: PackedKVStore = ctx.cache
    L = attn.layer
    B, T = u.shape[:2]
    ring, slots = cache.packed_ring(L)
    W = ring.size(1)
    before = ring[slots.long()]                                                      # [B,W,bytes] before the write
    cache.write_window(L, ctx.start, kv)
    rows = ctx.memoized(("verify-ring-rows", W), lambda: h2d(
        (ctx.start.view(-1, 1) + torch.arange(T)) % W, u.device))
    ring_ext = torch.cat([before, ring[slots.long().view(-1, 1), rows]], dim=1)      # [B,W+T,bytes]
    topk, main, table = _compressed(attn, u, qr, freqs, ctx)
    own = ctx.memoized("verify-own-rows", lambda: torch.arange(B, device=u.device).repeat_interleave(T))
    o = sparse_attn_packed(q.flatten(0, 1), ring_ext, own, win_idx.flatten(0, 1), main, _rows(table, T), topk,
                           attn.attn_sink, attn.softmax_scale)
    return o.view(B, T, *o.shape[1:])
