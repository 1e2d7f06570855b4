"""T(n), the speculative step latency with n tokens in the batch: `StepProfile` (what the scheduler reads) and
`profile_step` (what `dsv41 profile-step` runs to measure it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch

from dsv41.engine.bench import timed
from dsv41.engine.sampling import SamplingParams

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
    non-decreasing in n and in B (meta "fit": "linear", what `profile_step` writes on a CPU: the least-squares line
    in n through each batch's points, `line_fit`). A profile of token counts only (older files, tests) serves both
    from T(n): spec(B, n) = T(n), plain(B) = T(B)."""

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
                                                    list(self.meta.get("plain") or []),
                                                    linear=self.meta.get("fit") == "linear")
        self._padded = padded_share(self._by_batch, list(self.meta.get("ragged") or []))

    def __call__(self, n: int) -> float:
        return _interp(self.n, self.t, n)

    def spec(self, B: int, n: int, vmax: int | None = None) -> float:
        """A speculative step of B rows (drafter proposal, verify forward over n tokens, acceptance, rollback);
        vmax: its longest row's drafts. The curves are measured on uniform shapes (every row V drafts, n = B (1 +
        V)); a ragged step (rows verifying different lengths) runs its token-wise work on its n tokens but lays the
        store part out [B, 1 + vmax], so it costs more than a uniform step of n tokens: T(n) + c_B (B (1 + vmax) -
        n), c_B the price of a padded token slot at batch B (`padded_share`: from the ragged point `profile_step`
        measures; 0 without one)."""
        if not self._by_batch:
            return self(n)

        def at(b, xs, ys):
            m = n * b / B
            pad = 0.0 if vmax is None else self._padded.get(b, 0.0) * max(0.0, b * (1 + vmax) - m)
            return _interp(xs, ys, m) + pad
        return _over_batches(self._by_batch, B, at)

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


def _batch_curves(points: list, linear: bool = False) -> tuple[dict, dict]:
    """From profile points ({batch, verify, tokens, seconds}; verify None: plain decode): {B: (tokens, seconds)} of
    the speculative steps and {B: seconds} of plain decode, each fitted non-decreasing in tokens within a batch
    (linear: the least-squares line a + b n, b >= 0, through the batch's points instead of pooling only the dips),
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
        ys = [sum(pts[x]) / len(pts[x]) for x in xs]
        curves[B] = (xs, line_fit(xs, ys) if linear else non_decreasing(ys, [len(pts[x]) for x in xs]))
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


def padded_share(curves: dict, ragged: list) -> dict:
    """{B: c_B}: the seconds a padded token slot of a ragged verify costs at batch B, from the ragged point ({batch,
    tokens: B + G, vmax: G, seconds}: the first row verifying G drafts, the others none) and the batch's uniform
    curve T: c = (T_ragged - T(B + G)) / (B (1 + G) - (B + G)), between 0 (the store part costs by real tokens
    only, as the token-wise work does) and the curve's slope per token (it costs as if every row verified G).
    On the CPU (deterministic mode, trained tiny, batch 8) a step with rows verifying 0..4 drafts took about
    what every row verifying 4 takes (issue 28)."""
    out = {}
    for p in ragged:
        B, G = int(p["batch"]), int(p["vmax"])
        if B not in curves or B < 2 or G < 1:
            continue
        xs, ys = curves[B]
        n = B + G
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if len(xs) > 1 and xs[-1] > xs[0] else 0.0
        c = (float(p["seconds"]) - _interp(xs, ys, n)) / (B * (1 + G) - n)
        out[B] = min(max(c, 0.0), slope)
    return out


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """The least-squares line a + b x through (xs, ys), with b >= 0 (a decreasing trend is noise: the mean), at xs.

    What a CPU step costs grows in proportion to the tokens it runs, so one line through all verify lengths of a
    batch is the right shape there, and it pools the noise of every point: a point measured while the shared
    machine was busy elsewhere moves the line by a fifth of its error, where an interpolation through the points
    (or pooling only the dips) would hand the scheduler that point's error whole, and a 5 % error is enough to
    pick V = 3 where V = 4 is best (issue 28). Not for GPU profiles, whose T(n) is flat up to a size and then
    steps."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx) if sxx > 0 else 0.0
    return [my + b * (x - mx) for x in xs]


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
                 log=print, warmup: int = 1, tokenizer=None) -> StepProfile:
    """Measure the engine's decode steps through the engine's own step path (`Engine.step`), for each batch size B:
    B greedy requests with random prompts of `context` tokens are prefilled into an engine, then each timed sample
    is one whole `Engine.step()` of a forced shape: the plain decode step (no drafts: what `off` and a skipped step
    run), the speculative step with every row verifying V = 0..G drafts (the drafter's block) and, at B > 1, a
    ragged one (the first row verifies G drafts, the others none: n = B + G tokens, longest row G). So T holds
    everything the engine really runs per step, not only the forward: the scheduler's planning, the drafter's
    proposal, the ragged verify forward, each row's acceptance and `_emit` (stop conditions, detokenizing,
    streaming text), the rollback, the drafter's seeding (issue 28: a profile of the forward alone said V = 3
    at batch 8 where V = 4 was best). `tokenizer`: the one the engine will serve with (its detokenizing is part of
    each row's emit work; default the byte tokenizer).

    Every shape runs `warmup` times untimed first (allocations, kernel choices and compilation are paid there, not
    in the first point); then `repeats` rounds, each over all shapes in turn (so drift of the machine spreads over
    the points instead of biasing one); the median per shape (one outlier of three or more repeats moves nothing);
    `StepProfile` fits the curves non-decreasing (on a CPU a line per batch, `line_fit`). The contexts grow by the tokens each step emits (at most
    (warmup + repeats) (G + 2) (1 + G) a row)."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.speculative.policy import Speculation
    cfg = model.cfg
    if not cfg.dspark_enabled or not len(model.mtp):
        raise ValueError("profile-step measures speculative steps: the model needs the DSpark drafter")
    G = cfg.dspark_block_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    grow = (warmup + repeats) * (G + 3) * (1 + G) + 4
    for B in batches:
        shapes = [None] + list(range(G + 1)) + (["ragged"] if B > 1 else [])    # None: plain decode
        eng = Engine(model, tokenizer, prefill_mode="full", max_batch=B, max_seq_len=context + grow + 8,
                     device=device, speculative=f"fixed:{G}", max_step_tokens=max(2048, B * (1 + G)))
        params = SamplingParams(max_tokens=grow, ignore_eos=True)
        for _ in range(B):
            eng.add_request(torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist(), params)
        while eng.waiting or any(s.pending is None for s in eng.running):
            eng.step()                                   # admit and prefill every request
        times: dict = {V: [] for V in shapes}
        for r in range(warmup + repeats):
            for V in shapes:
                _force_shape(eng, V, Speculation)
                t = timed(eng.step, device)
                assert len(eng.running) == B and eng.last_plan is not None
                if r >= warmup:
                    times[V].append(t)
        for V, ts in times.items():
            t = _median(ts)
            n = B + G if V == "ragged" else B * (1 + (V or 0))
            rows.append({"batch": B, "verify": V, "tokens": n, "seconds": t, "samples": ts,
                         **({"vmax": G} if V == "ragged" else {})})
            what = "plain   " if V is None else "ragged  " if V == "ragged" else f"verify {V}"
            log(f"profile-step  batch {B:3d}  {what}  tokens {n:4d}  {t * 1e3:9.2f} ms")
        for s in list(eng.running):
            eng.abort(s.request_id)
    spec = [r for r in rows if isinstance(r["verify"], int)]
    return StepProfile([r["tokens"] for r in spec], [r["seconds"] for r in spec],
                       {"context": context, "device": str(device), "points": spec,
                        "plain": [r for r in rows if r["verify"] is None],
                        "ragged": [r for r in rows if r["verify"] == "ragged"], "warmup": warmup,
                        "repeats": repeats, "dtype": str(model.dtype).replace("torch.", ""), "path": "engine.step",
                        "fit": "linear" if torch.device(device).type == "cpu" else "isotonic"})


def _force_shape(eng, V, Speculation) -> None:
    """Make the engine's next decode step a plain one (V None), a verify of exactly V drafts a row (as `fixed:V`,
    V = 0 included: a proposal and a verify forward of the pending tokens only) or the ragged one (V "ragged": the
    first row verifies G drafts, the others none)."""
    G = eng.cfg.dspark_block_size
    eng.speculation = Speculation("fixed", G if V == "ragged" else V or 0)
    eng._drafting_pays = (lambda live, drafts: False) if V is None else (lambda live, drafts: True)
    if V == "ragged":
        eng._verify_lengths = lambda S, live, caps: [caps[0]] + [0] * (len(caps) - 1)
    else:
        eng.__dict__.pop("_verify_lengths", None)              # the engine's own method again


def _median(ts: Sequence[float]) -> float:
    s = sorted(ts)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2
