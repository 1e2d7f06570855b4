"""The indexer's training objective (as DeepSeek-V3.2 trains its lightning indexer; docs/model.md §3.6) and the
measure of what it buys: the indexer's recall of the attention's own top-k.

The top-k selection is not differentiable, so the language-model loss gives the indexers (`wq_b`,
`weights_proj`, and the owners' `wk`, `k_norm`) no gradient at all. The objective aligns, for every query t of
every index-source layer (Full and Reindex), the indexer's distribution over the compressed entries with the
layer's main attention over the same entries:

    target   p_t(n) = sum_h P_h(t, n) / sum_h sum_n' P_h(t, n')        (the heads' mass, renormalised)
    indexer  q_t(n) = softmax_n I[t, n],  I[t, n] = sum_j w[t,j] ReLU(q_j . K_n)     (docs/model.md §3.6)
    loss     mean over the layers and the rows with an entry of KL(p_t || q_t); d KL / d I[t,n] = q_t(n) - p_t(n)

P_h is the attention's probability (`dsv41.train.fast.attn_probs`: scale, the layer's window, the sink) and n
runs over the `support`:
  visible   every compressed entry the query may see: P_h is the attention the layer would compute with all of
            them selected (its exact counterpart, top-k = all entries), the indexer scored over all of them
            (Reindex layers too: the objective teaches the scores, the candidate pool only restricts the pick);
  selected  the entries the forward selected: P_h is the attention the forward computed (DeepSeek-V3.2's
            sparse stage). At top-k >= the visible count both supports are the same objective.

Gradient isolation: the indexer's inputs (the attention input u, the query latent qr, the compressor's
latents) are detached and the target is computed without a graph, so the indexer gets gradients from this loss
only and the main model none from it (`tests/test_train_indexer.py` checks both, bit for bit). Everything is
recomputed from the model's parameters and public methods (`Attention.queries`, `Attention.window_kv`,
`Indexer.queries`) out of what `IndexerTap`'s forward hooks keep, so the reference forward (the model through
`TrainCache`) and the fast one (`dsv41.train.fast`) give the same objective. It runs on a training prefill at
position 0 with QDQ off (training's numerics), unquantized index keys and queries.

Legend: B batch, T tokens, H attention heads, J indexer heads, C head dim, N compressed entries, K top-k.
"""

from __future__ import annotations

import torch

from dsv41.model.attention import window_indices
from dsv41.model.common import apply_rope
from dsv41.train.fast import attn_probs, index_mask

SUPPORTS = ("visible", "selected")
SCORE_BUDGET = 1 << 24          # query rows of the target are computed in blocks of at most this many scores


class IndexerTap:
    """Forward hooks kept for one training forward (`with IndexerTap(model) as tap: model(...)`): per index-source
    layer its indexer's inputs and output (u, qr, freqs, ctx, ids), per KV source its compressor's latents."""

    def __init__(self, model):
        self.model = model
        self.calls: dict[int, tuple] = {}
        self.latents: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "IndexerTap":
        for block in self.model.layers:
            attn = block.attn
            if getattr(attn, "indexer", None) is not None:
                self._handles.append(attn.indexer.register_forward_hook(self._indexer_hook(attn.layer)))
            if getattr(attn, "compressor", None) is not None:
                self._handles.append(attn.compressor.register_forward_hook(self._compressor_hook(attn.layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _indexer_hook(self, layer: int):
        def hook(_mod, args, out):
            u, qr, freqs, ctx = args
            self.calls[layer] = (u.detach(), qr.detach(), freqs, ctx, out)
        return hook

    def _compressor_hook(self, layer: int):
        def hook(_mod, _args, out):
            if out[0] is not None:
                self.latents[layer] = out[0].detach()
        return hook


def index_keys(owner, latent: torch.Tensor) -> torch.Tensor:
    """The owner's index keys [B,N,I] of its latents [B,N,C] (entries 0..N-1, RoPE at each group's first token),
    with the graph into its `wk` / `k_norm` (as `Indexer.publish_keys`, without the QDQ training switches off)."""
    m = owner.role.ratio
    pos = (torch.arange(latent.size(1), device=latent.device) * m).unsqueeze(0)
    ix = owner.indexer
    return apply_rope(ix.k_norm(ix.wk(latent)), owner.rope.freqs(pos).to(latent.device))


def index_scores(attn, u, qr, freqs, keys: torch.Tensor) -> torch.Tensor:
    """I [B,T,N] (docs/model.md §3.6) with the graph into the layer's indexer queries and head weights."""
    q, w = attn.indexer.queries(u, qr, freqs)                                      # [B,T,J,I], [B,T,J]
    s = torch.einsum("btjd,bnd->btjn", q.float(), keys.float()).relu()
    return (s * w.float().unsqueeze(-1)).sum(dim=2)


def support_mask(attn, ctx, N: int, selected: torch.Tensor | None, device) -> torch.Tensor:
    """bool [B,T,N]: the visible entries (selected None) or the selected ids of the forward (-1 = none)."""
    pos = ctx.positions.to(device)
    visible = torch.arange(N, device=pos.device) < ((pos + 1) // attn.role.ratio).unsqueeze(-1)
    return visible if selected is None else index_mask(selected, N) & visible


@torch.no_grad()
def attention_target(attn, u, freqs, ctx, support: torch.Tensor) -> torch.Tensor:
    """p [B,T,N] fp32: the layer's attention probabilities on the `support` entries (window and sink as the
    forward has them, replay floors included), summed over heads and renormalised; 0 off the support."""
    B, T = u.shape[:2]
    _, q = attn.queries(u, freqs)                                                   # [B,T,H,C]
    win = attn.window_kv(u, freqs)                                                  # [B,T,C]: a prefill's window
    widx = window_indices(ctx.start, T, attn.window, True, ctx.opts.floor_for(attn.layer)).to(u.device)
    ckv = ctx.cache.compressed(attn.role.kv_from, (ctx.start + T) // attn.role.ratio).detach()
    kv = torch.cat([win, ckv.to(win.dtype)], dim=1)
    rows = max(1, SCORE_BUDGET // (attn.n_heads * kv.size(1) * B))
    out = []
    for lo in range(0, T, rows):
        sl = slice(lo, lo + rows)
        mask = torch.cat([index_mask(widx[:, sl], T), support[:, sl]], dim=-1)
        p = attn_probs(q[:, sl], kv, attn.attn_sink, mask, attn.softmax_scale)[..., T:].sum(dim=2)
        out.append(p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny))
    return torch.cat(out, dim=1)


def kl_rows(p: torch.Tensor, scores: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p_t || softmax(scores_t over the support)) [B,T], rows with a support [B,T] bool). Rows without one
    give 0 and no gradient (their scores are not -inf filled, so no NaN reaches the backward)."""
    has = support.any(dim=-1, keepdim=True)
    fill = torch.where(has, -torch.inf, 0.0)
    logq = torch.log_softmax(torch.where(support, scores, fill), dim=-1)
    term = torch.xlogy(p, p) - p * torch.where(support, logq, 0.0)
    return torch.where(support, term, 0.0).sum(dim=-1), has.squeeze(-1)


def indexer_kl(model, tap: IndexerTap, support: str = "visible") -> torch.Tensor:
    """The objective of the module docstring over every index-source layer the tapped forward ran (a scalar with
    a graph into the indexers only; 0 without a row that sees an entry)."""
    if support not in SUPPORTS:
        raise ValueError(f"indexer loss support must be one of {SUPPORTS}, got {support!r}")
    total, rows = None, 0
    for layer, (u, qr, freqs, ctx, ids) in sorted(tap.calls.items()):
        attn = model.layers[layer].attn
        owner = model.layers[attn.role.kv_from].attn
        assert int(ctx.start.abs().max()) == 0, "the indexer objective is defined on a training prefill"
        keys = index_keys(owner, tap.latents[owner.layer])
        sup = support_mask(attn, ctx, keys.size(1), ids if support == "selected" else None, u.device)
        p = attention_target(attn, u, freqs, ctx, sup)
        kl, has = kl_rows(p, index_scores(attn, u, qr, freqs, keys), sup)
        n = int(has.sum())
        if n:
            total = kl.sum() / n if total is None else total + kl.sum() / n
            rows += 1
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return total / rows


@torch.no_grad()
def indexer_recall(model, tap: IndexerTap, k: int | None = None) -> dict:
    """How much of the attention's own top-k (over every visible entry: the target of `support="visible"`) the
    forward's selection holds, per index-source layer, over the rows that see more than k entries (below that
    the indexer selects everything); `chance` is a uniform pick's expected recall k / visible on those rows."""
    k = k or model.cfg.index_topk
    per_layer, hits, total, chance = {}, 0, 0, 0.0
    for layer, (u, _qr, freqs, ctx, ids) in sorted(tap.calls.items()):
        attn = model.layers[layer].attn
        N = tap.latents[attn.role.kv_from].size(1)
        sup = support_mask(attn, ctx, N, None, u.device)
        n_vis = sup.sum(dim=-1)                                                     # [B,T]
        rows = n_vis > k
        if not bool(rows.any()):
            continue
        p = attention_target(attn, u, freqs, ctx, sup)
        top = p.masked_fill(~sup, -1.0).topk(k, dim=-1).indices                      # [B,T,k]
        chosen = index_mask(ids, N)
        h = chosen.gather(-1, top).sum(dim=-1)[rows]
        per_layer[layer] = float(h.sum()) / (k * h.numel())
        hits, total = hits + int(h.sum()), total + k * h.numel()
        chance += float((k / n_vis[rows].double()).sum())
    n_rows = total // k if total else 0
    return {"k": k, "layers": per_layer, "recall": hits / total if total else float("nan"),
            "chance": chance / n_rows if n_rows else float("nan"), "rows": n_rows}
