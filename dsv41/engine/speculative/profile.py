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
from dsv41.engine.speculative.rollback import VerifyJournal
from dsv41.engine.store import make_pool
from dsv41.model.step import ForwardOptions

PROFILE_FILE = "step_profile.json"


class StepProfile:
    """T(n): the engine's measured step latency (seconds) with n tokens in the batch; piecewise linear between
    measured points (duplicates averaged), extended linearly past the ends, never below the smallest time."""

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float], meta: dict | None = None):
        if not tokens or len(tokens) != len(seconds):
            raise ValueError("a step profile needs matching, non-empty token counts and times")
        acc: dict[int, list[float]] = {}
        for n, s in zip(tokens, seconds):
            if n < 1 or not (s > 0 and math.isfinite(s)):
                raise ValueError(f"bad profile point ({n}, {s})")
            acc.setdefault(int(n), []).append(float(s))
        self.n = sorted(acc)
        self.t = [sum(acc[n]) / len(acc[n]) for n in self.n]
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


@torch.no_grad()
def profile_step(model, batches: Sequence[int] = (1, 2, 4, 8), context: int = 256, repeats: int = 3, device="cpu",
                 log=print) -> StepProfile:
    """Measure the speculative step (drafter proposal + verify forward over B x (1 + V) tokens + rollback) at a
    context of `context` tokens, for each batch size and V = 0..G (the drafter's block); median of `repeats`."""
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
        for V in range(G + 1):
            times = []
            for _ in range(repeats):
                view = pool.bind(sids)
                pending = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
                times.append(timed(lambda: _verify_step(model, drafter, view, pending, V, gen, device), device))
                pool.release(view, sids)
            t = sorted(times)[len(times) // 2]
            rows.append({"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": t})
            log(f"profile-step  batch {B:3d}  verify {V}  tokens {B * (1 + V):4d}  {t * 1e3:9.2f} ms")
        for sid in sids:
            pool.free(sid)
    return StepProfile([r["tokens"] for r in rows], [r["seconds"] for r in rows],
                       {"context": context, "device": str(device), "points": rows,
                        "dtype": str(model.dtype).replace("torch.", "")})


def _verify_step(model, drafter, view, pending: torch.Tensor, V: int, gen: torch.Generator, device) -> None:
    """One speculative step of V drafts per row (random drafts without a drafter), every row keeping one token."""
    pos = view.pos.clone()
    if drafter is not None:
        rows = [SimpleNamespace(pending=int(t), params=SamplingParams(), gen=gen) for t in pending]
        drafts = drafter.propose(view, rows, pos).tokens[:, :V]
    else:
        drafts = torch.randint(0, model.cfg.vocab_size, (len(pending), V), generator=gen)
    ids = torch.cat([pending.view(-1, 1), drafts], dim=1).to(device)
    journal = VerifyJournal(model, view, pos, 1 + V)
    model(ids, view, opts=ForwardOptions(journal=journal.model_journal))
    journal.rollback(model, view, ids, torch.ones(len(pending), dtype=torch.long))
