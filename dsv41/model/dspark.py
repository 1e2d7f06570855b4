"""DSpark drafter: 3 window-only blocks that draft `dspark_block_size` tokens in one forward, a Markov head
for dependencies between consecutive drafts and a confidence head for per-position acceptance (MODEL.md 7,
SYSTEM.md 5). The verification loop and scheduler are the engine's (the official code stops at the forward).

Legend: B batch, T main tokens of this call, G draft block size, D width, S streams, V vocabulary, r Markov rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.config import LayerRole, Mode, ModelConfig
from dsv41.kernels import sparse_attn
from dsv41.model.attention import Attention, lin_kind
from dsv41.model.common import Linear, RMSNorm, warm_up_transcendentals
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.transformer import Block


class DSparkAttention(Attention):
    """Window-only attention whose ring is filled from the target's hidden taps (`main_x`), while the draft
    block attends bidirectionally to itself on top of the ring (MODEL.md 7)."""

    def seed(self, main_x: torch.Tensor, P: int, cache) -> torch.Tensor:
        """Window KV of the main tokens at positions P..P+T-1, written to the ring."""
        freqs = self.rope.freqs(torch.arange(P, P + main_x.size(1))).unsqueeze(0).to(main_x.device)
        main_kv = self.window_kv(main_x, freqs)
        cache.write_window(self.layer, P, main_kv)
        return main_kv

    def forward(self, u: torch.Tensor, ctx, main_x: torch.Tensor) -> torch.Tensor:
        P, cache = ctx.start_pos, ctx.cache
        B, G = u.shape[:2]
        T = main_x.size(1)
        self.seed(main_x, P, cache)
        freqs = self.rope.freqs(torch.arange(P + T, P + T + G)).unsqueeze(0).to(u.device)
        qr, q = self.queries(u, freqs)
        kv = self.window_kv(u, freqs)                                       # drafts: not cached
        W = self.window
        ring = cache.window_ring(self.layer).to(kv.dtype)
        idx = torch.cat([torch.arange(min(W, P + 1)), W + torch.arange(G)]).int().to(u.device)
        idx = idx.view(1, 1, -1).expand(B, G, -1)
        o = sparse_attn(q, torch.cat([ring, kv], dim=1), self.attn_sink, idx, self.softmax_scale)
        return self.output(o, freqs)


class MarkovHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dspark_markov_rank, dtype=dtype)
        self.head = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False, dtype=torch.float32)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(ids)
        return self.head(e.float()), e


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.dim + cfg.dspark_markov_rank, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, markov], dim=-1).float()).squeeze(-1)


class DSparkBlock(Block):
    """Stage k of the drafter, checkpoint namespace `mtp.{k}`: a normal block (128 experts top-3 in the
    release, no Engram, no VL bias) with DSparkAttention; stage 0 owns the tap projection, the last stage
    the output norm and the two heads. Embedding and LM head are tied to the backbone."""

    def __init__(self, cfg: ModelConfig, stage: int, dtype: torch.dtype):
        layer = cfg.n_layers + stage
        role = LayerRole(layer, Mode.SWA_ONLY, 0, None, None)
        super().__init__(cfg, role, dtype, attention=DSparkAttention(cfg, role, dtype))
        self.stage = stage
        if stage == 0:
            self.main_proj = Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim, lin_kind(cfg), dtype)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
            self.markov_head = MarkovHead(cfg, dtype)
            self.confidence_head = ConfidenceHead(cfg)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """The official `sample`: argmax at temperature 0, else the Gumbel/exponential trick on softmax(l / T)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1, dtype=torch.float32)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div_(noise).argmax(dim=-1)


def forward_spec(model, token: torch.Tensor, main_hidden: torch.Tensor, cache, start_pos: int,
                 temperature: float = 0.0):
    """See `Transformer.draft`."""
    from dsv41.model.attention import StepContext

    warm_up_transcendentals()
    cfg, stages = model.cfg, model.mtp
    first, last = stages[0], stages[-1]
    main_x = first.main_norm(first.main_proj(main_hidden))                 # [B,T,D]
    ctx = StepContext(start_pos, main_x.size(1), cache)
    if start_pos == 0:
        for st in stages:
            st.attn.seed(main_x, 0, cache)
        return None
    B, G = token.size(0), cfg.dspark_block_size
    ids = token.new_full((B, G), cfg.dspark_noise_token_id)
    ids[:, 0] = token
    h = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    pre_mix = identity_pre_mix(B, G, cfg.hc_mult, h.device)
    for st in stages:
        h, pre_mix = st(h, pre_mix, ctx, None, attn_extra=main_x)
    x = hc_pre(h, pre_mix)
    logits = model.head(last.norm(x).float())                              # [B,G,V]
    out = token.new_empty(B, G + 1)
    out[:, 0] = token
    embeds = []
    for i in range(G):
        bias, e = last.markov_head(out[:, i])
        logits[:, i] = logits[:, i] + bias
        embeds.append(e)
        out[:, i + 1] = sample(logits[:, i], temperature)
    confidence = last.confidence_head(x, torch.stack(embeds, dim=1))
    return out, logits, confidence

