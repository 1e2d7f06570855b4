"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

Each request owns its torch.Generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # return this many top log-probabilities per token (None = off)

    def validate(self, vocab_size: int) -> None:
        def bad(name, why):
            return ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """logits [V] fp32 -> one token id."""
    if p.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits.float().cpu(), p), 1, generator=gen))   # CPU generator


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample_token` draws from at temperature > 0 (temperature, then top-k, then top-p), as
    probabilities [..., V]; at temperature 0 the point mass on the argmax. Speculative verification compares
    drafts against exactly this distribution."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).float()
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.size(-1):
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > p.top_p                  # keep the smallest prefix whose mass reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    return torch.softmax(x, dim=-1)


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, n) if n else None
    return {"token": token, "logprob": float(lp[token]),
            "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]}
