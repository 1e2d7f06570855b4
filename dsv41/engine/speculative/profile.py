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
from dsv41.engine.sampling import SamplingParams, sample_token
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
    scheduler that a longer verify is cheaper.

    What the scheduler reads (`spec`, `plain`): a speculative step's cost depends on the rows B (the drafter's
    proposal, each row's acceptance) and on the tokens n the verify forward runs, and a step without drafts
    (plain decode, what `off` runs: no proposal, one token a row) is cheaper than verifying 0 drafts. When the
    profile's `points` (`profile_step`) say which batch each was measured at, `spec(B, n)` reads the curve measured
    at that batch (tokens per row kept when B lies between or beyond measured batches: linear in B between them,
    proportional to B past the largest) and `plain(B)` the plain decode points; each curve is fitted
    non-decreasing in n and in B. A profile of token counts only (older files, tests) serves both from T(n):
    spec(B, n) = T(n), plain(B) = T(B)."""

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
        self._by_batch, self._plain = _batch_curves(list(self.meta.get("points") or []) +
                                                    list(self.meta.get("plain") or []))

    def __call__(self, n: int) -> float:
        return _interp(self.n, self.t, n)

    def spec(self, B: int, n: int) -> float:
        """A speculative step of B rows (drafter proposal, verify forward over n tokens, acceptance, rollback)."""
        if not self._by_batch:
            return self(n)
        return _over_batches(self._by_batch, B, lambda b, xs, ys: _interp(xs, ys, n * b / B))

    def plain(self, B: int) -> float:
        """A decode step of B rows without drafts (no proposal, one token a row)."""
        if not self._plain:
            return self.spec(B, B) if self._by_batch else self(B)
        return _over_batches({b: ([b], [t]) for b, t in self._plain.items()}, B, lambda b, xs, ys: ys[0])

    def to_json(self) -> dict:
        return {"tokens": self.n, "seconds": self.t, **self.meta}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> "StepProfile":
        d = json.loads(Path(path).read_text())
        return cls(d["tokens"], d["seconds"], {k: v for k, v in d.items() if k not in ("tokens", "seconds")})


def _interp(xs: Sequence[int], ys: Sequence[float], n: float) -> float:
    """Piecewise linear through (xs, ys) (xs increasing), linear past the ends, never below min(ys)."""
    if len(xs) == 1:
        return ys[0] * max(1.0, n / xs[0])
    if n <= xs[0]:
        return ys[0]
    i = next((j for j in range(1, len(xs)) if n <= xs[j]), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(min(ys), y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def _over_batches(curves: dict, B: int, at) -> float:
    """Evaluate at(b, xs, ys) on the measured batches around B: linear in B between two, the nearest below the
    smallest, proportional to B past the largest."""
    bs = sorted(curves)
    if B <= bs[0]:
        return at(bs[0], *curves[bs[0]])
    if B >= bs[-1]:
        return at(bs[-1], *curves[bs[-1]]) * B / bs[-1]
    j = next(j for j in range(1, len(bs)) if B <= bs[j])
    b0, b1 = bs[j - 1], bs[j]
    y0, y1 = at(b0, *curves[b0]), at(b1, *curves[b1])
    return y0 + (y1 - y0) * (B - b0) / (b1 - b0)


def _batch_curves(points: list) -> tuple[dict, dict]:
    """From profile points ({batch, verify, tokens, seconds}; verify None: plain decode): {B: (tokens, seconds)} of
    the speculative steps and {B: seconds} of plain decode, each fitted non-decreasing in tokens within a batch,
    then (cumulative max) in the batch at each verify length."""
    spec: dict[int, dict[int, list[float]]] = {}
    plain: dict[int, list[float]] = {}
    for p in points:
        if not isinstance(p, dict) or "batch" not in p or "seconds" not in p:
            return {}, {}
        B, s = int(p["batch"]), float(p["seconds"])
        if p.get("verify") is None:
            plain.setdefault(B, []).append(s)
        else:
            spec.setdefault(B, {}).setdefault(int(p["tokens"]), []).append(s)
    curves = {}
    for B, pts in spec.items():
        xs = sorted(pts)
        curves[B] = (xs, non_decreasing([sum(pts[x]) / len(pts[x]) for x in xs], [len(pts[x]) for x in xs]))
    prev: list[float] | None = None
    for B in sorted(curves):                         # per row of tokens: more rows never cost less
        xs, ys = curves[B]
        if prev is not None and len(prev) == len(ys):
            ys = [max(a, b) for a, b in zip(ys, prev)]
            curves[B] = (xs, ys)
        prev = ys
    pl = {B: sum(v) / len(v) for B, v in plain.items()}
    best = 0.0
    for B in sorted(pl):
        best = pl[B] = max(pl[B], best)
    return curves, pl


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
    """Measure the engine's decode steps at a context of `context` tokens, for each batch size: the plain decode
    step (no drafts: forward of one token a row, the drafter seeded with its taps, each row's token sampled; what
    `off` and a skipped step run) and the speculative step for V = 0..G (the drafter's block): the drafter's
    proposal, the verify forward over B x (1 + V) tokens, each row's acceptance, rollback, the drafter seeded.
    Every shape runs `warmup` times untimed first (allocations, kernel choices and compilation are paid there, not
    in the first point); then `repeats` rounds, each over all shapes in turn (so drift of the machine spreads over
    the points instead of biasing one); the median per shape (one outlier of three or more repeats moves nothing);
    `StepProfile` fits the curves non-decreasing."""
    cfg = model.cfg
    G = cfg.dspark_block_size
    gen = torch.Generator().manual_seed(0)
    pool = make_pool(model, device)
    drafter = DSparkDrafter(model) if cfg.dspark_enabled and len(model.mtp) else None
    rows = []
    shapes = [None] + list(range(G + 1))                 # None: plain decode
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
        times: dict = {V: [] for V in shapes}
        for r in range(warmup + repeats):
            for V in shapes:
                view = pool.bind(sids)
                pending = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
                if V is None:
                    t = timed(lambda: _plain_step(model, drafter, view, pending, gen, device), device)
                else:
                    t = timed(lambda: _verify_step(model, drafter, view, pending, V, gen, device), device)
                pool.release(view, sids)
                if r >= warmup:
                    times[V].append(t)
        for V, ts in times.items():
            t = _median(ts)
            n = B * (1 + (V or 0))
            rows.append({"batch": B, "verify": V, "tokens": n, "seconds": t, "samples": ts})
            what = "plain   " if V is None else f"verify {V}"
            log(f"profile-step  batch {B:3d}  {what}  tokens {n:4d}  {t * 1e3:9.2f} ms")
        for sid in sids:
            pool.free(sid)
    spec = [r for r in rows if r["verify"] is not None]
    return StepProfile([r["tokens"] for r in spec], [r["seconds"] for r in spec],
                       {"context": context, "device": str(device), "points": spec,
                        "plain": [r for r in rows if r["verify"] is None], "warmup": warmup,
                        "repeats": repeats, "dtype": str(model.dtype).replace("torch.", "")})


def _median(ts: Sequence[float]) -> float:
    s = sorted(ts)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def _plain_step(model, drafter, view, pending: torch.Tensor, gen: torch.Generator, device) -> None:
    """One decode step without drafts, as the engine runs it: one token a row, the drafter seeded with its taps,
    a token sampled per row."""
    pos = view.pos.clone()
    greedy = SamplingParams(temperature=0.0)
    out = model(pending.view(-1, 1).to(device), view, last_only=True)
    if drafter is not None and out.main_hidden is not None:
        drafter.seed(view, out.main_hidden, pos)
    for b in range(len(pending)):
        sample_token(out.logits[b, -1], greedy, gen)


def _verify_step(model, drafter, view, pending: torch.Tensor, V: int, gen: torch.Generator, device) -> None:
    """One speculative step of V drafts per row (random drafts without a drafter): the drafter's proposal, the
    verify forward, each row's acceptance (greedy: the engine's per-row work), every row keeps one token, the
    drafter is seeded with the kept taps."""
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
    keep = torch.ones(len(pending), dtype=torch.long)
    journal.rollback(model, view, ids, keep)
    if drafter is not None and out.main_hidden is not None:
        drafter.seed(view, out.main_hidden, pos, keep)
