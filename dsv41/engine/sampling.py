"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, and the per-request
logits processing of OpenAI's and vLLM's fields (logit bias, repetition / frequency / presence penalties, a grammar
constraint).

Each request owns its torch.Generator, so a seeded request samples the same tokens whatever else is in the batch.

Processing order, as vLLM applies it: the constraint's token mask, then `logit_bias`, then the repetition penalty
(every token of the prompt or the output so far: a positive logit is divided by it, a negative one multiplied),
then the frequency and presence penalties (output tokens only: logit -= f * count + p * [count > 0]), then
temperature, top-k, top-p. Everything stays on the device the logits live on. Log-probabilities returned to the
client are those of the raw logits (vLLM's default `raw_logprobs`). A request with any of these fields gets its own
`LogitsState` (`SamplingParams.for_prompt`, when the engine admits it), which records every token sampled for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

MAX_BIAS = 100.0                      # logit_bias values are clamped to [-100, 100], as OpenAI documents


class Constraint(Protocol):
    """A grammar the output must follow (`dsv41.server.grammar`): `start()` gives one request's matcher."""

    def start(self) -> "ConstraintMatcher": ...


class ConstraintMatcher(Protocol):
    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor: ...   # bool [V]: may come next

    def consume(self, token: int) -> None: ...


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
    presence_penalty: float = 0.0     # in [-2, 2]
    frequency_penalty: float = 0.0    # in [-2, 2]
    repetition_penalty: float = 1.0   # > 0; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: Constraint | None = None
    cache_salt: str | None = None     # prefix-cache namespace of the request (vLLM's cache_salt)
    state: "LogitsState | None" = field(default=None, repr=False, compare=False)

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not (math.isfinite(rp) and rp > 0):
            raise bad("repetition_penalty", "must be a finite number > 0")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise bad("logit_bias", f"token id {t!r} is outside [0, {vocab_size})")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
                raise bad("logit_bias", f"the bias of token {t} must be a finite number")

    def processed(self) -> bool:
        """Whether the logits are processed before sampling (bias, penalties or a constraint)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.constraint is not None)

    def for_prompt(self, prompt_ids: list[int]) -> "SamplingParams":
        """The parameters one request samples with: a copy holding a fresh `LogitsState` when its logits are
        processed (so parameters shared by several requests never share counts or a matcher), else self."""
        return replace(self, state=LogitsState(self, prompt_ids)) if self.processed() else self


class LogitsState:
    """One request's logits processing (the module docstring): the prompt's token set, the output's token counts
    and the constraint's matcher, on the logits' device (created at the first call)."""

    def __init__(self, p: SamplingParams, prompt_ids: list[int]):
        self.p, self.prompt_ids = p, list(prompt_ids)
        self.matcher = None if p.constraint is None else p.constraint.start()
        self.counts: torch.Tensor | None = None        # [V] fp32: output tokens so far
        self.seen: torch.Tensor | None = None          # [V] bool: prompt or output tokens
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.early: list[int] = []                     # tokens recorded before the first call

    def _init(self, V: int, device: torch.device) -> None:
        self.counts = torch.zeros(V, dtype=torch.float32, device=device)
        self.seen = torch.zeros(V, dtype=torch.bool, device=device)
        self.seen[torch.tensor([t for t in self.prompt_ids if 0 <= t < V], dtype=torch.long, device=device)] = True
        if self.p.logit_bias:
            ids = torch.tensor(list(self.p.logit_bias), dtype=torch.long, device=device)
            vals = torch.tensor([min(MAX_BIAS, max(-MAX_BIAS, float(b))) for b in self.p.logit_bias.values()],
                                dtype=torch.float32, device=device)
            self.bias = ids, vals
        for t in self.early:
            self._count(t)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw logits [V] -> the processed logits (fp32, same device)."""
        p, x = self.p, logits.float().clone()
        if self.counts is None:
            self._init(x.size(-1), x.device)
        if self.matcher is not None:
            x.masked_fill_(~self.matcher.allowed(x.size(-1), x.device), -torch.inf)
        if self.bias is not None:
            x.index_add_(0, *self.bias)
        if p.repetition_penalty != 1.0:
            rp = p.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / rp, x * rp), x)
        if p.frequency_penalty:
            x -= p.frequency_penalty * self.counts
        if p.presence_penalty:
            x -= p.presence_penalty * (self.counts > 0).float()
        return x

    def record(self, token: int) -> None:
        """`token` was sampled for this request (it is the next output token, or a stop)."""
        if self.counts is None:
            self.early.append(token)
        else:
            self._count(token)
        if self.matcher is not None:
            self.matcher.consume(token)

    def _count(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """logits [V] fp32 -> one token id (after the request's logits processing, when it has any)."""
    if p.state is not None:
        logits = p.state.process(logits)
    if p.temperature == 0:
        tok = int(logits.argmax())
    else:
        tok = int(torch.multinomial(target_probs(logits.float().cpu(), p), 1, generator=gen))   # CPU generator
    if p.state is not None:
        p.state.record(tok)
    return tok
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
