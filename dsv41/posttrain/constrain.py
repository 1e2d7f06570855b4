"""A decoding constraint that makes the plan letter fix the trace, applied identically when the engine samples and
when the RL loss computes log-probs (issue #23: "apply the same [mask] to both"; 2026-12-07).

Why: with the plan head (`tasks.plan_head`) the plan letter was meant to fix the trace's stride, but nothing held
the policy to it. Under split credit RL wrote plan S and then the full trace anyway (06e rlA: the length decision
moved one token past the letter that carries the length term); under per-token credit the low levels' penalties
on trace tokens shared by every b removed the long trace at every b (06e rlB). With this grammar a response is

    <band of b> <n digit> <plan letter> <trace of the plan's stride, states as holes> </think> <answer> <EOS>

where every token is forced except the plan letter (one of the plans valid for n), the trace's states (digits for
sums, map letters for chase) and the answer: the plan letter alone decides the length, the forced tokens have
probability 1 under the mask (log-prob 0, no gradient), so the length term's credit lands on the plan letter and
the only freedom left besides it is the arithmetic the task scores.

The same `Grammar.allowed(prefix)` builds the engine's per-step token mask (`GrammarMatcher`, through
`SamplingParams.constraint`, which masks the raw logits to -inf before temperature and sampling) and the training
mask (`allowed_mask`, applied to the logits before the log-softmax in `masked_token_logprobs`), so the sampling
distribution and the trained one are the same masked softmax.

Plan sets (`PLAN_SETS`): "sml", the SFT head's three letters (S: stride n, the empty trace; M: ceil(n / 2); L: 1);
"strides", one letter per stride: S (stride n) and L T U V W for strides 1 2 3 4 5 (a letter is valid for n when its
stride is below n). The SFT head writes only S / M / L; the other letters need an SFT continuation (`sft_example`
with `plans="strides"`) before RL can sample them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsv41.posttrain import tasks as T
from dsv41.server.chat import THINK_END
from dsv41.train.qat import sequence_forward
from dsv41.model.step import ForwardOptions

HOLE = None                          # a template slot the model fills (a state or the answer)
STATE_CHARS = {"sums": "0123456789", "chase": T.LETTERS[:6]}
STRIDE_LETTERS = "LTUVW"             # strides 1..5 of the "strides" plan set (S is stride n)


def stride_of(plans: str, letter: str, n: int) -> int | None:
    """The stride plan `letter` of plan set `plans` fixes at chain length n, or None when it is not a plan of that
    set valid at n."""
    if plans == "sml":
        return T.plan_stride(_Dummy(n), letter) if letter in T.PLANS else None
    if plans == "strides":
        if letter == "S":
            return n
        if letter in STRIDE_LETTERS:
            j = STRIDE_LETTERS.index(letter) + 1
            return j if j < n else None
        return None
    raise ValueError(f"unknown plan set {plans!r}: one of {', '.join(PLAN_SETS)}")


class _Dummy:                        # tasks.plan_stride reads only .difficulty
    def __init__(self, n: int):
        self.difficulty = n


PLAN_SETS = ("sml", "strides")


def plan_letters(plans: str, n: int) -> list[str]:
    """The plan letters valid at chain length n, in the set's order."""
    letters = T.PLANS if plans == "sml" else "S" + STRIDE_LETTERS
    return [c for c in letters if stride_of(plans, c, n) is not None]


def template(p: T.Problem, stride: int) -> list[str | None]:
    """The trace of `stride` as characters with HOLE at every state (tasks.trace with the states left open)."""
    n = p.difficulty
    if not 1 <= stride <= n:
        raise ValueError(f"stride {stride} outside [1, {n}]")
    slots: list[str | None] = []
    if stride == n:
        return slots
    for k, start in enumerate(range(0, n, stride)):
        end = min(start + stride, n)
        if k:
            slots.append(" ")
        chunk = "".join(p.pieces[start:end])
        if chunk:
            slots += list(chunk) + ["="]
        slots.append(HOLE)
    return slots


def response_length(p: T.Problem, stride: int) -> int:
    """Reasoning tokens of a constrained response (the 3 head tokens and the trace; what the length term counts)."""
    return T.HEAD_TOKENS + len(template(p, stride))


class Grammar:
    """The constraint of one (problem, b) request (module docstring). allowed(prefix) -> the token ids that may
    follow the output `prefix` (a list of ids), never empty."""

    def __init__(self, tok, p: T.Problem, b: int, plans: str = "sml", merge_top: bool = True):
        if plans not in PLAN_SETS:
            raise ValueError(f"unknown plan set {plans!r}: one of {', '.join(PLAN_SETS)}")
        self.tok, self.p, self.b, self.plans = tok, p, b, plans
        n = p.difficulty
        cid = tok.tok.token_to_id
        self.head = [[cid(T.effort_band(b, merge_top))], [cid(str(n))],
                     [cid(c) for c in plan_letters(plans, n)]]
        self.letter_of = {cid(c): c for c in plan_letters(plans, n)}
        holes = [cid(c) for c in STATE_CHARS[p.family]]
        self.tails = {}
        for t, c in self.letter_of.items():
            slots = template(p, stride_of(plans, c, n))
            self.tails[t] = ([holes if s is HOLE else [cid(s)] for s in slots]
                             + [[cid(THINK_END)], holes, [tok.eos_id]])
        if any(x is None for row in (*self.head, *(r for tail in self.tails.values() for r in tail)) for x in row):
            raise ValueError("the tokenizer lacks a character of the plan grammar (not the post-training tokenizer)")

    def allowed(self, prefix: list[int]) -> list[int]:
        k = len(prefix)
        if k < len(self.head):
            return self.head[k]
        tail = self.tails.get(prefix[len(self.head) - 1])
        if tail is None:                 # not reachable under the constraint; closes a foreign prefix
            return [self.tok.eos_id]
        k -= len(self.head)
        return tail[k] if k < len(tail) else [self.tok.eos_id]

    def start(self) -> "GrammarMatcher":
        return GrammarMatcher(self)


def checkpoint_plans(ckpt) -> str | None:
    """The plan set a post-trained checkpoint decodes under (its grammar, for serving it), from its posttrain.json:
    the RL run's `constrain`, else that of the run it started from (`init`), down to an SFT whose head is the
    grammar's (band letter, size digit, plan letter, b = 100 merged into J: "sml"); None when the head differs
    (a model trained without the plan head is served unconstrained)."""
    seen = set()
    path = Path(ckpt)
    while path not in seen and (path / "posttrain.json").is_file():
        seen.add(path)
        cfg = json.loads((path / "posttrain.json").read_text()).get("config", {})
        if cfg.get("constrain"):
            return cfg["constrain"]
        if all(cfg.get(k) for k in ("echo", "plan", "echo_size", "merge_top")):
            return "sml"
        if not cfg.get("init"):
            return None
        path = Path(cfg["init"])
    return None


class GrammarMatcher:
    """The engine's view of a Grammar (sampling.ConstraintMatcher): the output so far, and the allowed-token mask."""

    def __init__(self, g: Grammar):
        self.g, self.out = g, []

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        m = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        m[torch.tensor(self.g.allowed(self.out), dtype=torch.long, device=device)] = True
        return m

    def consume(self, token: int) -> None:
        self.out.append(token)


def allowed_rows(g: Grammar, out_ids: list[int], vocab_size: int) -> torch.Tensor:
    """bool [len(out_ids), V]: row t the mask under which out_ids[t] was drawn (the matcher's, replayed)."""
    m = torch.zeros(len(out_ids), vocab_size, dtype=torch.bool)
    for t in range(len(out_ids)):
        m[t, g.allowed(out_ids[:t])] = True
    return m


def allowed_mask(grammars: list[Grammar | None], prompt_lens: list[int], out_ids: list[list[int]], T_: int,
                 vocab_size: int) -> torch.Tensor:
    """bool [B, T_-1, V] for a right-padded batch of prompt + output rows (the positions of token_logprobs:
    position i predicts token i + 1): each response's rows from its grammar, every other position (prompt,
    padding, an unconstrained row) all True."""
    m = torch.ones(len(grammars), T_ - 1, vocab_size, dtype=torch.bool)
    for i, (g, a, out) in enumerate(zip(grammars, prompt_lens, out_ids)):
        if g is not None and out:
            m[i, a - 1:a - 1 + len(out)] = allowed_rows(g, out, vocab_size)
    return m


def masked_token_logprobs(model, ids: torch.Tensor, allowed: torch.Tensor | None = None, routes: dict | None = None,
                          route_log: dict | None = None, entropy: bool = False):
    """dsv41.train.logprobs.token_logprobs with the decoding mask: log p(ids[b, t+1] | ...) under the softmax of
    the logits with the disallowed tokens at -inf (the distribution the engine samples a constrained request
    from at temperature 1); allowed None: exactly token_logprobs. fp32 [B, T-1], differentiable. entropy: also
    return the entropy of that masked distribution at every position ([B, T-1], differentiable; 0 where one
    token is allowed)."""
    if ids.dim() != 2 or ids.size(1) < 2:
        raise ValueError(f"masked_token_logprobs needs ids [B, T] with T >= 2, got shape {tuple(ids.shape)}")
    logits = sequence_forward(model, ids, ForwardOptions(routes=routes, route_log=route_log)).logits
    x = logits[:, :-1].float()
    if allowed is not None:
        if allowed.shape != x.shape:
            raise ValueError(f"mask shape {tuple(allowed.shape)} is not the logits' {tuple(x.shape)}")
        x = x.masked_fill(~allowed.to(x.device), -torch.inf)
    lp = torch.log_softmax(x, dim=-1)
    got = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return got
    keep = torch.isfinite(lp)
    plogp = torch.where(keep, lp.exp() * torch.where(keep, lp, torch.zeros_like(lp)), torch.zeros_like(lp))
    return got, -plogp.sum(-1)


def plan_positions(rs, T_: int) -> torch.Tensor:
    """float [B, T_-1]: 1 at the position whose softmax draws each constrained response's plan letter (its third
    output token, after the forced band letter and n digit), 0 elsewhere."""
    m = torch.zeros(len(rs), T_ - 1)
    for i, r in enumerate(rs):
        if getattr(r, "grammar", None) is not None and len(r.output_ids) > len(r.grammar.head) - 1:
            m[i, len(r.prompt_ids) - 1 + len(r.grammar.head) - 1] = 1.0
    return m
