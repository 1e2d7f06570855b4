"""CSA2 attention: sliding-window KV, the Compressor, the Indexer with the hierarchical candidate pool, sparse
attention with sinks, and the grouped low-rank output projection (docs/model.md §3 and §4).

Legend: B batch, T tokens of this call, P start position, H heads, C head dim (= latent width), R rope dims,
W window, m compression ratio, I index-key width, J indexer heads, N compressed entries visible, K top-k.

Layer modes (resolved once in `dsv41.config.layer_roles`):
  SWA-only   window only.
  Full       owns a Compressor (global KV at 1/m of positions) and index keys; its Indexer scores every entry.
  Reindex    its own Indexer over a Full layer's keys, restricted to that layer's candidate-block pool.
  Reuse      reads a source's compressed KV and top-k.

Calls are general chunks: any start position P and any T (prefill P = 0, decode T = 1, chunked prefill in
between). Index lists reproduce the official ones exactly in the two official modes (prefill at P = 0: ascending
positions; otherwise the ring listed oldest first), since the blocked softmax's bf16 rounding depends on order.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.codecs import qdq_main_kv
from dsv41.config import LayerRole, ModelConfig
from dsv41.devices import h2d
from dsv41.kernels import qdq_fp8, qdq_index_k, sparse_attn
from dsv41.kernels.invariant import (canonical_lists, index_scores, is_deterministic, set_cpu_order,
                                     set_deterministic, small_sum, tiled_linear)
from dsv41.kernels.packed_ref import TIE_RULES, top_blocks, topk_indices
from dsv41.model import packed_decode
from dsv41.model.common import Linear, QuantSite, RMSNorm, Rope, apply_rope, lin_kind
from dsv41.model.step import StepContext


def set_tie_break(model: nn.Module, ties: str) -> None:
    """Choose how every indexer / candidate top-k breaks exact ties (`dsv41.kernels.packed_ref.topk_indices`).

    ties="official": torch's `topk(sorted=False)`, as the official code. Its order among exactly equal scores
      is implementation-defined and depends on the tensor's width (docs/model.md §10.2 item 1), so it reproduces
      the official selections (gate 1) but a chunked prefill or a decode step can pick another member of a tie.
    ties="recent": ties broken toward the larger index (the more recent entry): a fixed rule under which
      chunked prefill, decode and batching select exactly what one-shot prefill selects, even at exact ties
      (all-zero ReLU score rows are common). Used for the engine's exactness checks.
    ties="official-cpu": the official order on any device. CUDA's topk orders exact ties otherwise than the CPU's,
      which alone fails gate 1 on a GPU from the first compressed layer on (docs/golden.md §4); this rule takes the
      score rows through the host (a sync per top-k: parity runs, not serving)."""
    if ties not in TIE_RULES:
        raise ValueError(f"tie break must be one of {TIE_RULES}, got {ties!r}")
    for m in model.modules():
        if isinstance(m, Indexer):
            m.ties = ties


def use_official_cpu(model: nn.Module) -> None:
    """The CPU reference's numerics on any device, for parity runs (gate 1 on a GPU, docs/golden.md §4): the
    `official-cpu` tie rule and, process-wide, the row statistics in the CPU's summation order
    (`dsv41.kernels.invariant.set_cpu_order`). Slow on a GPU (host syncs, many small adds); not for serving."""
    set_tie_break(model, "official-cpu")
    set_cpu_order(True)


def use_deterministic(model: nn.Module) -> None:
    """The deterministic mode (`dsv41.kernels.invariant`, process-wide) and the `recent` tie rule it implies:
    every row's result then depends on that row alone, bit for bit (docs/system.md §10)."""
    set_deterministic(True)
    set_tie_break(model, "recent")


def window_indices(start: torch.Tensor, T: int, W: int, prefill: bool,
                   floor: torch.Tensor | None = None) -> torch.Tensor:
    """Window index lists [B, T, K] into the window KV tensor of this call.

    prefill (every row at position 0): the KV tensor is the chunk itself; query i sees max(0,i-W+1) +
      0..min(T,W)-1, entries > i -> -1 (the official prefill lists).
    otherwise: the KV tensor is [ring (W slots, position p at slot p % W) || chunk (T rows)]; query p lists the W
      positions p-W+1..p oldest first (ring slot for positions before the chunk, chunk row after), < 0 -> -1
      (for T = 1 exactly the official decode list).
    floor [B]: positions below floor_b are absent (-1): the sliding window truncated at a replay start. In the
      prefill branch only the queries at positions >= floor_b lose them (queries before it keep their full
      window: a training prefill simulating a replay that starts at floor_b, `dsv41.train.qat`); otherwise
      every query of the chunk does."""
    B = start.size(0)
    if prefill:
        end = torch.arange(T).unsqueeze(1)
        idx = (end - W + 1).clamp(min=0) + torch.arange(min(T, W))
        idx = torch.where(idx > end, -1, idx)
        if floor is None:
            return idx.expand(B, -1, -1)
        f = floor.view(B, 1, 1).cpu()
        return torch.where((end.unsqueeze(0) >= f) & (idx < f), -1, idx.unsqueeze(0))
    P = start.view(B, 1, 1).cpu()
    pos = P + torch.arange(T).view(1, T, 1) - W + 1 + torch.arange(W).view(1, 1, W)     # [B,T,W] positions
    idx = torch.where(pos < P, pos % W, W + pos - P)
    lo = 0 if floor is None else floor.view(B, 1, 1).cpu()
    return torch.where(pos < lo, -1, torch.where(pos < 0, -1, idx))


def select_candidate_blocks(score: torch.Tensor, compress_lens: torch.Tensor, topk_blocks: int,
                            block_size: int, ties: str = "official") -> torch.Tensor:
    """Level one of the hierarchical indexer (docs/model.md §3.7): block score = max over `block_size` entries, the
    block holding the newest visible entry pinned to +inf, keep the top `topk_blocks` blocks with a finite
    score. score [B,T,N] (invisible = -inf), compress_lens [T,1] -> bool mask [B,T,N]."""
    blocks, top = top_blocks(score, compress_lens, topk_blocks, block_size, ties)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :score.size(-1)]


def carry_after(seq_kv: torch.Tensor, seq_sc: torch.Tensor, length: torch.Tensor, m: int):
    """The compressor carry [B,m,C] after row b's first length_b tokens of a group-aligned sequence [B,L,C]: the
    last m tokens, so slots m-r_b..m-1 hold the open group's r_b = length_b % m tokens, where the next call reads
    them (`Compressor.forward` aligns the state's last `carried` slots before its chunk); the other slots are
    never read."""
    L = seq_kv.size(1)
    idx = length.to(seq_kv.device).unsqueeze(1) - m + torch.arange(m, device=seq_kv.device)
    idx = idx.clamp(min=0, max=L - 1).unsqueeze(-1).expand(-1, -1, seq_kv.size(-1))
    return seq_kv.gather(1, idx), seq_sc.gather(1, idx)


class Compressor(nn.Module):
    """m tokens -> one latent (docs/model.md §3.4). m = 2: per-channel softmax-gated pooling in fp32, with the partial
    group carried between calls; m = 1: a plain bf16 projection. Returns the latents before RoPE (the indexer
    needs them unrotated) of every group completed in this call."""

    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype)
        if ratio > 1:
            self.wkv = Linear(cfg.dim, cfg.head_dim, "fp32", torch.float32)
            self.wgate = Linear(cfg.dim, cfg.head_dim, "fp32", torch.float32)
        else:
            self.wkv = Linear(cfg.dim, cfg.head_dim, "bf16", dtype)

    def forward(self, u: torch.Tensor, start: torch.Tensor, cache, layer: int, journal: dict | None = None,
                static: bool = False):
        """u [B,T,D] -> (latents [B,n,C], count [B]): row b completed groups start_b//m .. + count_b - 1
        (latents beyond a row's count are padding). With `journal` (a speculative verify), the group-aligned
        per-token sequence is kept there so the carry can be recomputed for any accepted prefix
        (`carry_after`). `static` (a step of fixed shapes): the widths the widest row could need (m - 1 carried
        tokens, (T + m - 1) // m groups) instead of the batch's, read from no tensor; each row's values are the
        same, the extra groups padding."""
        m = self.ratio
        B, T = u.shape[:2]
        if m == 1:
            return self.norm(self.wkv(u)), torch.full((B,), T, dtype=torch.long, device=u.device)
        x = u.float()
        kv, score = self.wkv(x), self.wgate(x)                                     # [B,T,C] fp32
        carried = h2d(start % m, u.device)                                          # tokens of the open group
        st_kv, st_sc = cache.compressor_state(layer)                                # [B,m,C], slots 0..m-1
        # row b's sequence: its `carried` state slots, then this chunk; aligned so index 0 starts a group
        shift = m - carried                                                         # first used index per row
        L = T + (m - 1 if static else int(carried.max()))
        gather = (shift.unsqueeze(1) + torch.arange(L, device=u.device)).clamp(max=m + T - 1)
        gather = gather.unsqueeze(-1).expand(-1, -1, kv.size(-1))
        seq_kv, seq_sc = (torch.cat([st, new], dim=1).gather(1, gather)             # [B,m+T,C] -> [B,L,C]
                          for st, new in ((st_kv, kv), (st_sc, score)))
        if journal is not None:
            journal[("compressor", layer)] = (seq_kv, seq_sc, carried)
        length = carried + T                                                        # [B]
        count = length // m
        n = L // m if static else int(count.max())
        # the open group's tokens become the new carry (the last slots; see carry_after)
        cache.set_compressor_state(layer, *carry_after(seq_kv, seq_sc, length, m))
        if n == 0:
            return None, count
        g_kv, g_sc = (t[:, :n * m].unflatten(1, (n, m)) for t in (seq_kv, seq_sc))
        pooled = small_sum(g_kv * g_sc.softmax(dim=2), 2)
        return self.norm(pooled.to(u.dtype)), count


class Indexer(QuantSite):
    """Scores compressed entries for each query and keeps the top K (docs/model.md §3.6).

    I[q,t] = sum_j w[q,j] * ReLU(q_j . K_t), keys FP4 (MXFP4) QDQ'd. Owners (Full layers) first turn the new
    latents into index keys. The candidate source publishes its block pool; Reindex layers mask to it."""

    ties: str = "official"          # the top-k tie rule, switched model-wide by `set_tie_break`
    score_budget: int = 1 << 26     # query rows are scored in blocks of at most this many (row, head, entry) scores

    def __init__(self, cfg: ModelConfig, role: LayerRole, dtype: torch.dtype):
        super().__init__()
        self.role = role
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.cand_blocks, self.cand_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, lin_kind(cfg), dtype)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, "bf16", dtype)
        if role.is_kv_source:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "bf16", dtype)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps, dtype)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        return qdq_index_k(x) if self.quant else x

    def publish_keys(self, latent: torch.Tensor, count: torch.Tensor, row0: torch.Tensor, freqs: torch.Tensor,
                     ctx: StepContext) -> None:
        """Index keys of the new latents (freqs: RoPE at each group's first token), appended to the store."""
        k = apply_rope(self.k_norm(self.wk(latent)), freqs)
        ctx.cache.append_index_k(self.role.layer, row0, self.qdq(k), count)
        ctx.cache.index_k_publisher = self.role.layer

    def queries(self, u: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [B,T,J,I] (RoPE'd, QDQ'd) and head weights [B,T,J]."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return self.qdq(apply_rope(q, freqs)), self.weights_proj(u) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

    def forward(self, u: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Returns int32 [B,T,K] compressed-entry ids, ascending, -1 = none (the caller adds its window offset)."""
        role, m = self.role, self.role.ratio
        n_vis = (ctx.start + ctx.seqlen) // m                                       # [B] entries visible at the end
        q, w = self.queries(u, qr, freqs)
        src = ctx.cache.index_k_publisher if ctx.opts.official_decode_artifact else role.kv_from
        keys = ctx.cache.index_k(src, n_vis)                                        # [B,N,I]
        compress_lens = ctx.memoized(("compress-lens", m, u.size(1)), lambda: (h2d(ctx.positions, u.device) + 1).div(
            m, rounding_mode="floor").unsqueeze(-1))
        # the candidate source may have run on more rows
        cand = ctx.published.cand[role.candidates_from][:, -ctx.seqlen:] if role.uses_candidates else None
        budget = self.score_budget >> (2 if is_deterministic() else 0)           # float64 blocks there
        rows = max(1, budget // max(1, keys.size(1) * self.n_heads))               # bound the [rows,J,N] scores
        parts = []
        for lo in range(0, u.size(1), rows):
            sl = slice(lo, lo + rows)
            parts.append(self.select(q[:, sl], keys, w[:, sl], compress_lens[:, sl],
                                     None if cand is None else cand[:, sl]))
        idx, masks = zip(*parts)
        if role.is_candidate_source:
            ctx.published.cand[role.layer] = torch.cat(masks, dim=1)
        return torch.cat(idx, dim=1)

    def select(self, q, keys, w, compress_lens, cand):
        """Scores and top-k for a block of query rows -> (ids [B,t,K], candidate mask [B,t,N] or None)."""
        role = self.role
        N = keys.size(1)
        if is_deterministic():
            score = index_scores(q, keys.unsqueeze(1), w)                           # [B,t,N] fp32
        else:
            score = torch.einsum("bthd,bnd->bthn", q, keys.to(q.dtype))
            score = (score.relu() * w.unsqueeze(-1)).sum(dim=2)                     # [B,t,N]
        visible = torch.arange(N, device=score.device) < compress_lens             # [B,t,N]
        score = score.masked_fill(~visible, -torch.inf)
        mask = None
        if role.is_candidate_source:
            mask = select_candidate_blocks(score, compress_lens, self.cand_blocks, self.cand_size, self.ties)
        elif cand is not None:
            score = score.masked_fill(~cand, -torch.inf)
        k = min(self.topk, N)
        idx = topk_indices(score, k, self.ties).sort(dim=-1).values
        return torch.where(idx < compress_lens, idx, -1).int(), mask


class Attention(QuantSite):
    """One layer's attention. Parameter names follow the official checkpoint (`layers.{L}.attn.*`)."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, dtype: torch.dtype):
        super().__init__()
        self.role, self.layer = role, role.layer
        H, C = cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.window = H, C, cfg.window_size
        self.n_groups, self.o_lora_rank, self.topk = cfg.o_groups, cfg.o_lora_rank, cfg.index_topk
        self.softmax_scale = C ** -0.5
        kind = lin_kind(cfg)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, kind, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype)
        self.wq_b = Linear(cfg.q_lora_rank, H * C, kind, dtype)
        self.wkv = Linear(cfg.dim, C, kind, dtype)
        self.kv_norm = RMSNorm(C, cfg.norm_eps, dtype)
        self.wo_a = Linear(H * C // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "bf16", dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, kind, dtype)
        self.rope = Rope(cfg, role.ratio)
        self.compressor = Compressor(cfg, role.ratio, dtype) if role.is_kv_source else None
        self.indexer = Indexer(cfg, role, dtype) if role.is_index_source else None

    # ---------------------------------------------------------------- pieces
    def queries(self, u: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(u))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return qr, apply_rope(q, freqs)

    def window_kv(self, u: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """kv_norm(wkv u), RoPE tail, FP8 QDQ of the whole vector (docs/model.md §3.3). [B,T,C]"""
        kv = apply_rope(self.kv_norm(self.wkv(u)), freqs)
        return qdq_fp8(kv) if self.quant else kv

    def output(self, o: torch.Tensor, freqs: torch.Tensor, conj_freqs: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse RoPE at the query positions, grouped wo_a (block diagonal), wo_b (docs/model.md §3.9).
        conj_freqs: the conjugate of freqs, materialised once by a caller that runs many layers (the same rotation)."""
        B, T = o.shape[:2]
        o = (apply_rope(o, freqs, inverse=True) if conj_freqs is None else apply_rope(o, conj_freqs))
        o = o.reshape(B, T, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        if is_deterministic():
            o = torch.stack([tiled_linear(o[:, :, g], wo_a[g]) for g in range(self.n_groups)], dim=2)
        else:
            o = torch.einsum("btgd,grd->btgr", o.to(wo_a.dtype), wo_a)
        return self.wo_b(o.flatten(2))

    def produce_global_kv(self, u: torch.Tensor, ctx: StepContext) -> None:
        """A KV source's global-KV production for this call's tokens: Compressor, index keys (pre-RoPE latent),
        RoPE at each group's first position, FP4 QDQ, append to the store. This is all that CED prefill runs of
        the decoder's KV source on the prompt rows the decoder skips (docs/system.md §2)."""
        m, cache = self.role.ratio, ctx.cache
        latent, count = self.compressor(u, ctx.start, cache, self.layer, ctx.opts.journal, ctx.static)
        if latent is None:
            return
        row0 = ctx.start // m
        freqs = ctx.memoized(("rope-freqs-groups", self.rope.key, m, latent.size(1)), lambda: h2d(self.rope.freqs(
            (row0.unsqueeze(1) + torch.arange(latent.size(1), device=row0.device)) * m), latent.device))  # groups' 1st
        if self.indexer is not None:
            self.indexer.publish_keys(latent, count, row0, freqs, ctx)
        latent = apply_rope(latent, freqs)
        cache.append_compressed(self.layer, row0, qdq_main_kv(latent) if self.quant else latent, count)

    def with_compressed(self, u, qr, freqs, win_kv: torch.Tensor, win_idx: torch.Tensor, ctx: StepContext):
        """The window KV [B,W',C] and its index lists [B,T,Kw], extended by this layer's selected compressed
        entries when it has m > 0: ([window || compressed] KV, indices into it [B,T,Kw+K])."""
        if not self.role.ratio:
            return win_kv, (canonical_lists(win_idx, None, self.window, 0) if is_deterministic() else win_idx)
        role, m, cache = self.role, self.role.ratio, ctx.cache
        B, T = u.shape[:2]
        n_vis = (ctx.start + T) // m                                                # [B]
        if self.compressor is not None and ctx.opts.produce_kv:
            self.produce_global_kv(u, ctx)
        if role.is_index_source:
            idx = (self.indexer(u, qr, freqs, ctx) if int(n_vis.max())
                   else torch.empty(B, T, 0, dtype=torch.int32, device=u.device))      # no entry visible yet
            ctx.published.topk[self.layer] = idx
            if ctx.record is not None:
                ctx.record[("topk", self.layer)] = idx
                if self.layer in ctx.published.cand:
                    ctx.record[("cand", self.layer)] = ctx.published.cand[self.layer]
        else:
            idx = ctx.published.topk[role.topk_from][:, -T:]                        # source may have run on more rows
        idx = torch.where(idx >= 0, idx + win_kv.size(1), -1).int()
        kv = torch.cat([win_kv, cache.compressed(role.kv_from, n_vis).to(win_kv.dtype)], dim=1)
        if is_deterministic():
            return kv, canonical_lists(win_idx, idx, self.window, self.topk)
        return kv, torch.cat([win_idx, idx.to(win_idx.dtype)], dim=-1)

    def forward(self, u: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if packed_decode.applies(self, ctx):
            return packed_decode.attention_decode_packed(self, u, ctx)
        if ctx.ragged is not None:
            return self.forward_ragged(u, ctx)
        B, T = u.shape[:2]
        freqs = ctx.memoized(("rope-freqs", self.rope.key),                          # [B,T,R/2], once per family
                             lambda: h2d(self.rope.freqs(ctx.positions), u.device))
        qr, q = self.queries(u, freqs)
        kv = self.window_kv(u, freqs)
        o = self.attend(u, qr, q, kv, freqs, ctx)
        return self.output(o, freqs)

    def forward_ragged(self, u: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """A ragged call (`dsv41.model.step.Ragged`): u [1,N,D], the real tokens packed. The projections (queries,
        window KV, the output) run on those N tokens; what reads or writes each row's store (the ring, the
        compressor, the indexer, sparse attention) on the [B,T] layout with zeros in the padding."""
        rag = ctx.ragged
        pos = ctx.memoized("ragged-positions", lambda: rag.pack(ctx.positions))          # [1,N]
        freqs = h2d(self.rope.freqs(pos), u.device)
        qr, q = self.queries(u, freqs)
        kv = self.window_kv(u, freqs)
        u_b, qr_b, q_b, kv_b, freqs_b = (rag.unpack(t) for t in (u, qr, q, kv, freqs))
        o = self.attend(u_b, qr_b, q_b, kv_b, freqs_b, ctx)
        return self.output(rag.pack(o), freqs)

    def attend(self, u, qr, q, kv, freqs, ctx: StepContext) -> torch.Tensor:
        """The step's window KV kv [B,T,C] written to the ring, the global KV produced, the top-k selected and the
        sparse attention of the queries q [B,T,H,C] over the window and the selected entries -> [B,T,H,C]."""
        T = u.size(1)
        prefill = ctx.all_prefill
        floor = ctx.opts.floor_for(self.layer)
        idx = ctx.memoized(("window-indices", self.window, T, prefill, floor),     # [B,T,W], shared by the layers
                           lambda: h2d(window_indices(ctx.start, T, self.window, prefill, floor), u.device).int())
        if packed_decode.verify_applies(self, ctx, prefill):
            return packed_decode.attend_packed(self, u, qr, q, kv, freqs, idx, ctx)
        win_kv = kv if prefill else torch.cat([ctx.cache.window_ring(self.layer).to(kv.dtype), kv], dim=1)
        ctx.cache.write_window(self.layer, ctx.start, kv)
        kv_all, idx = self.with_compressed(u, qr, freqs, win_kv, idx, ctx)
        return sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale)
