"""DSpark drafter: 3 window-only blocks that draft `dspark_block_size` tokens in one forward, a Markov head
for dependencies between consecutive drafts and a confidence head for per-position acceptance (docs/model.md §7,
docs/system.md §5). The verification loop and scheduler are the engine's (the official code stops at the forward).

Legend: B batch, T main tokens of this call, G draft block size, D width, S streams, V vocabulary, r Markov rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.config import LayerRole, Mode, ModelConfig
from dsv41.kernels import sparse_attn
from dsv41.kernels.mhc_math import hc_pre
from dsv41.model.attention import Attention
from dsv41.model.block import Block
from dsv41.model.common import Linear, RMSNorm, lin_kind, warm_up_transcendentals
from dsv41.model.step import StepContext


class DSparkAttention(Attention):
    """Window-only attention whose ring is filled from the target's hidden taps (`main_x`), while the draft
    block attends bidirectionally to itself on top of the ring (docs/model.md §7)."""

    def seed(self, main_x: torch.Tensor, start: torch.Tensor, cache, count: torch.Tensor | None = None) -> None:
        """Window KV of the main tokens at positions start_b..start_b+T-1 (the first count_b of row b when
        given: speculative decoding seeds only accepted positions), written to the ring."""
        if main_x.size(1) == 0:
            return
        pos = start.view(-1, 1) + torch.arange(main_x.size(1))
        cache.write_window(self.layer, start, self.window_kv(main_x, self.rope.freqs(pos).to(main_x.device)), count)

    def forward(self, u: torch.Tensor, ctx, main_x: torch.Tensor) -> torch.Tensor:
        cache, start = ctx.cache, ctx.start
        B, G = u.shape[:2]
        T = main_x.size(1)
        self.seed(main_x, start, cache)
        freqs = self.rope.freqs(start.view(-1, 1) + T + torch.arange(G)).to(u.device)
        qr, q = self.queries(u, freqs)
        kv = self.window_kv(u, freqs)                                       # drafts: not cached
        W = self.window
        filled = torch.clamp(start + T, max=W)                              # ring slots holding a position
        width = int(filled.max()) if ctx.uniform_start is not None else W   # official width when uniform
        slots = torch.arange(width).expand(B, -1)
        slots = torch.where(slots < filled.view(-1, 1), slots, -1)
        idx = torch.cat([slots, W + torch.arange(G).expand(B, -1)], dim=1).int().to(u.device)
        idx = idx.unsqueeze(1).expand(B, G, -1)
        ring = cache.window_ring(self.layer).to(kv.dtype)
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


def forward_spec(model, token: torch.Tensor | None, main_hidden: torch.Tensor, cache, start,
                 temperature: float = 0.0, generator: torch.Generator | None = None, count=None, sampler=None):
    """See `Transformer.draft`. Extensions for the engine's speculative decoding (`dsv41.engine.speculative`):
    `count` [B] seeds only each row's first count_b main tokens (token None); main_hidden may hold 0 tokens, the
    rings then already hold every position before `start`, the position of `token`; `sampler(i, logits [B,V])`
    replaces the official `sample` (per-request temperatures and generators)."""
    warm_up_transcendentals()
    cfg, stages = model.cfg, model.mtp
    first, last = stages[0], stages[-1]
    B = main_hidden.size(0)
    start = torch.as_tensor(start, dtype=torch.long).expand(B).clone()
    if main_hidden.size(1):
        main_x = first.main_norm(first.main_proj(main_hidden))             # [B,T,D]
    else:                                                                  # rings already seeded up to start-1
        main_x = main_hidden.new_zeros(B, 0, cfg.dim, dtype=model.dtype)
    if token is None:                                                      # prefill: seed the rings only
        for st in stages:
            st.attn.seed(main_x, start, cache, count)
        return None
    ctx = StepContext(start, main_x.size(1), cache)
    G = cfg.dspark_block_size
    ids = token.new_full((B, G), cfg.dspark_noise_token_id)
    ids[:, 0] = token
    h, pre_mix = model.run_layers(*model.streams_in(model.embed(ids)), ctx, stages,
                                  step=lambda st, x, pre, c: st(x, pre, c, main_x))
    x = hc_pre(h, pre_mix)
    logits = model.head(last.norm(x).float())                              # [B,G,V]
    out = token.new_empty(B, G + 1)
    out[:, 0] = token
    embeds = []
    for i in range(G):
        bias, e = last.markov_head(out[:, i])
        logits[:, i] = logits[:, i] + bias
        embeds.append(e)
        out[:, i + 1] = sample(logits[:, i], temperature, generator) if sampler is None else sampler(i, logits[:, i])
    confidence = last.confidence_head(x, torch.stack(embeds, dim=1))
    return out, logits, confidence
