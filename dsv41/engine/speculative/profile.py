"""T(n), the speculative step latency with n tokens in the batch: `StepProfile` (what the scheduler reads) and
`profile_step` (what `dsv41 profile-step` runs to measure it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch

from dsv41.engine.bench import timed
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative.drafter import DSparkDrafter
from dsv41.engine.speculative.rejection import accept_drafts
from dsv41.engine.speculative.rollback import VerifyJournal
from dsv41.engine.store import make_pool
from dsv41.model.step import ForwardOptions

PROFILE_FILE = "step_profile.json"


class StepProfile:
    """T(n): the engine's measured step latency (seconds) with n tokens in the batch; piecewise linear between
    measured points (duplicates averaged), extended linearly past the ends, never below the smallest time.

    A step over more tokens never costs less, so the points are fitted non-decreasing (`non_decreasing`): a dip
    (noise, a point measured while the machine was busy elsewhere) pools with its neighbours instead of telling the
    scheduler that a longer verify is cheaper."""

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float], meta: dict | None = None):
        if not tokens or len(tokens) != len(seconds):
            raise ValueError("a step profile needs matching, non-empty token counts and times")
        acc: dict[int, list[float]] = {}
        for n, s in zip(tokens, seconds):
            if n < 1 or not (s > 0 and math.isfinite(s)):
                raise ValueError(f"bad profile point ({n}, {s})")
            acc.setdefault(int(n), []).append(float(s))
        self.n = sorted(acc)
        self.t = non_decreasing([sum(acc[n]) / len(acc[n]) for n in self.n], [len(acc[n]) for n in self.n])
        self.meta = dict(meta or {})

    def __call__(self, n: int) -> float:
        xs, ys = self.n, self.t
        if len(xs) == 1:
            return ys[0] * max(1.0, n / xs[0])
        if n <= xs[0]:
            return ys[0]
        i = next((j for j in range(1, len(xs)) if n <= xs[j]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(min(ys), y0 + (y1 - y0) * (n - x0) / (x1 - x0))

    def to_json(self) -> dict:
        return {"tokens": self.n, "seconds": self.t, **self.meta}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> "StepProfile":
        d = json.loads(Path(path).read_text())
        return cls(d["tokens"], d["seconds"], {k: v for k, v in d.items() if k not in ("tokens", "seconds")})


def non_decreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators): runs that decrease are
    replaced by their weighted mean."""
    blocks: list[list[float]] = []                       # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return [m for m, _, c in blocks for _ in range(c)]


@torch.no_grad()
def profile_step(model, batches: Sequence[int] = (1, 2, 4, 8), context: int = 256, repeats: int = 5, device="cpu",
                 log=print, warmup: int = 1) -> StepProfile:
    """Measure the speculative step as the engine runs it (drafter proposal, verify forward over B x (1 + V) tokens,
    each row's acceptance, rollback) at a context of `context` tokens, for each batch size and V = 0..G (the
    drafter's block). Every shape runs `warmup` times untimed first (allocations, kernel choices and compilation
    are paid there, not in the first point); then `repeats` rounds, each over all V in turn (so drift of the machine
    spreads over the points instead of biasing one); the median per shape."""
    cfg = model.cfg
    G = cfg.dspark_block_size
    gen = torch.Generator().manual_seed(0)
    pool = make_pool(model, device)
    drafter = DSparkDrafter(model) if cfg.dspark_enabled and len(model.mtp) else None
    rows = []
    for B in batches:
        sids = []
        for _ in range(B):
            sid = pool.new_sequence()
            view = pool.bind([sid])
            ids = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
            out = model(ids, view, last_only=True)
            if drafter is not None and out.main_hidden is not None:
                drafter.seed(view, out.main_hidden[:, -cfg.window_size:], view.pos - min(context, cfg.window_size))
            pool.release(view, [sid])
            sids.append(sid)
        times: dict[int, list[float]] = {V: [] for V in range(G + 1)}
        for r in range(warmup + repeats):
            for V in range(G + 1):
                view = pool.bind(sids)
                pending = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
                t = timed(lambda: _verify_step(model, drafter, view, pending, V, gen, device), device)
                pool.release(view, sids)
                if r >= warmup:
                    times[V].append(t)
        for V, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            rows.append({"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": t, "samples": ts})
            log(f"profile-step  batch {B:3d}  verify {V}  tokens {B * (1 + V):4d}  {t * 1e3:9.2f} ms")
        for sid in sids:
            pool.free(sid)
    return StepProfile([r["tokens"] for r in rows], [r["seconds"] for r in rows],
                       {"context": context, "device": str(device), "points": rows,
                        "dtype": str(model.dtype).replace("torch.", "")})


def _verify_step(model, drafter, view, pending: torch.Tensor, V: int, gen: torch.Generator, device) -> None:
    """One speculative step of V drafts per row (random drafts without a drafter): the verify forward, each row's
    acceptance (greedy: the engine's per-row work), then every row keeps one token."""
    pos = view.pos.clone()
    greedy = SamplingParams(temperature=0.0)
    if drafter is not None:
        rows = [SimpleNamespace(pending=int(t), params=greedy, gen=gen) for t in pending]
        drafts = drafter.propose(view, rows, pos).tokens[:, :V]
    else:
        drafts = torch.randint(0, model.cfg.vocab_size, (len(pending), V), generator=gen)
    ids = torch.cat([pending.view(-1, 1), drafts], dim=1).to(device)
    journal = VerifyJournal(model, view, pos, 1 + V)
    out = model(ids, view, opts=ForwardOptions(journal=journal.model_journal))
    for b in range(len(pending)):
        accept_drafts(out.logits[b, :V + 1], drafts[b].tolist(), None, greedy, gen)
    journal.rollback(model, view, ids, torch.ones(len(pending), dtype=torch.long))
