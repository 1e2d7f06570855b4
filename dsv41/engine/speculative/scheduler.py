"""The confidence scheduler (step 2 of `dsv41.engine.speculative`, docs/system.md §5): how many drafts to verify, from
the prefix survivals S and the step latency T(n), and the online corrections of both inputs (`dspark:online`)."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Sequence

import torch


class AcceptanceCalibration:
    """Online per-position, per-confidence correction of the drafter's acceptance estimates a_r,k for the scheduler.

    The verified drafts at position k (those reached with drafts < k accepted) are counted by the confidence the
    head gave them, in `bins` equal bins of a: R_k,b reached, A_k,b accepted (R_k, A_k over all bins). A draft with
    confidence a in bin b is then estimated as

        g = (A_k - A_k,b + n0 a) / (R_k - R_k,b + n0)   the other bins' measured rate (n0 pseudo-drafts of a)
        est = (A_k,b + m g) / (R_k,b + m)               the bin's measured rate (m pseudo-drafts of g)

    Without data est = a (the head is trusted); with data at the position but none in the bin, the position's rate;
    with data in the bin, that bin's rate. So a head that is over-confident (the trained tiny drafter's: a = 0.98
    on drafts accepted 71 % of the time, batch 8) is pulled down where it is, one that calls drafts hopeless that
    are accepted 43 % of the time (its a ~ 0.05 bin) is pulled up, and what it does discriminate (0.71 vs 0.43
    there) is kept. A single ratio per position (this class before issue 28's rework: est = a A_k / sum a) kept the
    head's spread and, because the scheduler verifies only the drafts it rates high, never saw the low ones: at
    batch 8 it still predicted 455 tokens for 376 emitted. Only the choice of v changes, never the output
    distribution."""

    def __init__(self, G: int, n0: float = 8.0, m: float = 8.0, bins: int = 10):
        self.n0, self.m, self.bins = n0, m, bins
        self.reached = torch.zeros(G, bins, dtype=torch.float64)
        self.accepted = torch.zeros(G, bins, dtype=torch.float64)

    def _bin(self, a: torch.Tensor) -> torch.Tensor:
        return (a.double() * self.bins).long().clamp(0, self.bins - 1)

    def update(self, k: int, predicted: float, accepted: bool) -> None:
        b = int(self._bin(torch.tensor(float(predicted))))
        self.reached[k, b] += 1.0
        self.accepted[k, b] += float(accepted)

    def rates(self) -> list:
        """The measured acceptance per position (None where nothing was verified)."""
        R, A = self.reached.sum(1), self.accepted.sum(1)
        return [None if float(r) == 0 else float(a / r) for a, r in zip(A, R)]

    def apply(self, accept: torch.Tensor) -> torch.Tensor:
        """a [B, G] -> calibrated a [B, G] (same dtype)."""
        G = accept.size(1)
        a = accept.double()
        R, A = self.reached[:G], self.accepted[:G]
        b = self._bin(a)
        k = torch.arange(G).expand_as(b)
        Ab, Rb = A[k, b], R[k, b]                                                   # [B,G]
        g = (A.sum(1) - Ab + self.n0 * a) / (R.sum(1) - Rb + self.n0)
        est = (Ab + self.m * g) / (Rb + self.m)
        return est.clamp(0.0, 1.0).to(accept.dtype)


class MeasuredCost:
    """T(n) for the scheduler, corrected by the engine's own step times.

    The profile is the prior. Each engine step records (n, seconds) with its rows B and whether it was a plain
    decode step (no drafts) or a speculative one, the time being the whole step as the engine runs it (proposal,
    forward, each row's acceptance and emitted tokens, rollback); the first step of each kind at each (B, n) is a
    warm-up and is dropped. A measured shape costs its mean; any other shape costs the profile's figure times the
    mean measured/profile ratio of its kind (speculative or plain; the other kind's while it has none), which puts a
    profile from another context length or machine on the engine's scale. A V whose verify costs more than the
    profile said is corrected the first time the scheduler chooses it. `__call__(n)` is the one-dimensional view
    (shapes recorded without a batch)."""

    def __init__(self, profile: Callable[[int], float]):
        self.profile = profile
        self.seen: set[int] = set()                             # token counts of the steps recorded
        self._keys: set = set()
        self.times: dict = {}                                   # (B, n) or ("plain", B) -> seconds after warm-up
        self._memo: dict = {}                                   # costs asked since the last record

    def record(self, n: int, seconds: float, batch: int | None = None, plain: bool = False,
               vmax: int | None = None) -> None:
        """vmax: the longest row's drafts of a speculative step (its ragged verify lays the store part out [B, 1 +
        vmax]); None: a shape known by its tokens only."""
        key = ("plain", n if batch is None else batch) if plain else (batch, n, vmax)
        self._memo.clear()
        if key in self._keys:
            self.times.setdefault(key, []).append(seconds)
        self._keys.add(key)
        self.seen.add(n)

    def mean(self, key) -> float:
        ts = self.times[key]
        return sum(ts) / len(ts)

    def _prior(self, key) -> float:
        if key[0] == "plain":
            return plain_cost(self.profile, key[1])
        B, n, vmax = key
        return self.profile(n) if B is None else spec_cost(self.profile, B)(n, vmax)

    def _scale(self, plain: bool) -> float:
        for kind in (plain, not plain):
            ks = [k for k in self.times if (k[0] == "plain") == kind]
            if ks:
                return sum(self.mean(k) / self._prior(k) for k in ks) / len(ks)
        return 1.0

    def _cost(self, key) -> float:
        if key not in self._memo:          # the scheduler asks many shapes a step (closed batches: every batch size)
            self._memo[key] = (self.mean(key) if key in self.times
                               else self._prior(key) * self._scale(key[0] == "plain"))
        return self._memo[key]

    def __call__(self, n: int) -> float:
        return self._cost((None, n, None))

    def spec(self, B: int, n: int, vmax: int | None = None) -> float:
        return self._cost((B, n, vmax))

    def plain(self, B: int) -> float:
        return self._cost(("plain", B))


def spec_cost(cost, B: int) -> Callable[..., float]:
    """(n, vmax=None) -> the cost of a speculative step of B rows over n tokens, the longest row verifying vmax
    drafts: cost.spec(B, n, vmax) when the cost model knows the batch (`StepProfile`, `MeasuredCost`), else cost(n)
    (a model of token counts only)."""
    f = getattr(cost, "spec", None)
    return (lambda n, vmax=None: f(B, n, vmax)) if f is not None else (lambda n, vmax=None: cost(n))


def plain_cost(cost, B: int) -> float:
    """The cost of a decode step of B rows without drafts: cost.plain(B), else cost(B)."""
    f = getattr(cost, "plain", None)
    return f(B) if f is not None else cost(B)


def expected_tokens(S: torch.Tensor, v: Sequence[int]) -> float:
    """sum_r (1 + sum_{k<=v_r} S_r,k)."""
    return sum(1.0 + float(S[r, :v[r]].sum()) for r in range(S.size(0)))


def choose_verify_lengths(S: torch.Tensor, cost: Callable[..., float], max_v: int | Sequence[int],
                          ragged: bool = True, plain: float | None = None, by_longest: bool = False) -> list[int]:
    """The {v_r} maximising expected_tokens(S, v) / cost(tokens in the batch) (module docstring).
    S [B,G] prefix survivals (non-increasing along k); max_v: the most drafts per row (int or per row).
    ragged: tokens = sum_r (1 + v_r); otherwise (a padded forward) tokens = B (1 + max v) and every row gets
    the same v. plain: the cost of the step with no drafts at all when it differs from cost(B) (plain decode: no
    proposal, no verify bookkeeping); all zeros are chosen when nothing beats B / plain, so the objective never
    prefers a verify that is slower than not speculating.

    by_longest (ragged): cost is cost(n, vmax), the step's price depending on its longest row too (the ragged
    forward runs the token-wise work on the n real tokens but lays what reads and writes each row's store out [B,
    1 + vmax]; on the CPU that part made a step with rows verifying 0..4 drafts cost nearly what every row
    verifying 4 costs, issue 28). Then each vmax = 1..G is tried with the rows capped at it (the budget search
    below within each), and the best ratio wins."""
    S = torch.as_tensor(S, dtype=torch.float64).cpu()
    B, G = S.shape
    caps = [max(0, min(G, int(c))) for c in (max_v if isinstance(max_v, Sequence) else [max_v] * B)]
    base = B / (cost(B) if plain is None else plain)
    if not ragged:
        best, best_v = base, 0
        for V in range(1, max(caps) + 1):
            ratio = expected_tokens(S, [min(V, c) for c in caps]) / cost(B * (1 + V))
            if ratio > best + 1e-12 * abs(best):
                best, best_v = ratio, V
        return [best_v] * B
    best, best_v = base, [0] * B
    for vmax in (range(1, max(caps, default=0) + 1) if by_longest else [None]):
        capped = caps if vmax is None else [min(c, vmax) for c in caps]
        at = (lambda n: cost(n)) if vmax is None else (lambda n, V=vmax: cost(n, V))
        gains = sorted(((float(S[r, k]), k, r) for r in range(B) for k in range(capped[r])),
                       key=lambda g: (-g[0], g[1]))
        num, best_b = float(B), 0
        for b, (s, _, _) in enumerate(gains, start=1):
            num += s
            ratio = num / at(B + b)
            if ratio > best + 1e-12 * abs(best):
                best, best_b = ratio, b
        if best_b:
            best_v = [0] * B
            for _, _, r in gains[:best_b]:
                best_v[r] += 1
    return best_v


def row_acceptance(reached: Sequence[int], accepted: Sequence[int], prior: Sequence[float], m: float = 4.0
                   ) -> list[float]:
    """One row's conditional acceptance per draft position: its own verified drafts (reached_k, accepted_k) shrunk
    to the batch-wide rate prior_k with m pseudo-drafts, (accepted_k + m prior_k) / (reached_k + m); prior_k alone
    where the row verified nothing at k. Rows differ persistently (their text: on the trained tiny model, greedy
    acceptance per prompt from 0.44 to 0.78 at the first draft), and the slowest row sets a closed batch's end."""
    out = []
    for k, g in enumerate(prior):
        r = reached[k] if k < len(reached) else 0
        a = accepted[k] if k < len(accepted) else 0
        out.append((a + m * g) / (r + m))
    return out


def shrinkage_strength(reached: Sequence[int], accepted: Sequence[int], lo: float = 4.0, hi: float = 64.0) -> float:
    """The pseudo-draft count m for `row_acceptance`, estimated from the rows themselves (empirical Bayes): the
    rows' verified / accepted drafts at one position (n_r, a_r) are read as beta-binomial, whose intra-row
    correlation rho = 1 / (m + 1) has the moment estimate (Kleinman 1973) rho = (S / (R - 1) - p q) / (p q (n0 - 1)),
    S = sum_r n_r (a_r / n_r - p)^2, p the pooled rate, n0 = (N - sum n_r^2 / N) / (R - 1); clipped to [lo, hi].
    Rows that differ little get a large m (each row's few drafts say little beyond the batch's rate); rows that
    differ persistently a small one. Why (issue 28): with a fixed m = 4, a closed batch of 32 rows that had
    verified 2-3 drafts each took the lowest of 32 noisy estimates (0.34 where the batch's rate was 0.69) as its
    slowest row, and decoded plainly where fixed:2 was 14% faster than off."""
    rows = [(int(n), int(a)) for n, a in zip(reached, accepted) if n > 0]
    R, N = len(rows), sum(n for n, _ in rows)
    if R < 2 or N <= R:
        return hi
    p = sum(a for _, a in rows) / N
    pq = p * (1 - p)
    if pq <= 0:
        return hi
    S = sum(n * (a / n - p) ** 2 for n, a in rows)
    n0 = (N - sum(n * n for n, _ in rows) / N) / (R - 1)
    if n0 <= 1:
        return hi
    rho = (S / (R - 1) - pq) / (pq * (n0 - 1))
    rho = min(max(rho, 1.0 / (hi + 1)), 1.0 / (lo + 1))
    return 1.0 / rho - 1.0


def closed_batch_times(remaining: Sequence[int], accept: torch.Tensor, plain: Callable[[int], float],
                       spec: Callable[[int, int], float], max_v: int) -> list[float]:
    """The predicted seconds until every row of a closed batch (no request waiting to take a finished row's place)
    has emitted its remaining tokens R_r, under each uniform policy v = 0..max_v kept to the end: v = 0 decodes
    plainly (one token a step, plain(b) a step with b rows left), v >= 1 verifies min(v, R_r - 1) drafts a row
    (spec(b, v) a step with b rows left, every row verifying v), row r emitting rho_r = 1 + sum_{k<=v}
    prod_{i<=k} a_r,i tokens a step in expectation (accept [B, G]: its conditional acceptance per position,
    `row_acceptance`), so it is done after ceil(R_r / rho_r) steps; the rows leave one by one and each step is
    priced at the rows still running. A row's tokens a step vary (`row_rate`), so its end does too (sd_r = sqrt(R_r
    var_r / rho_r^3) steps), and the batch waits for the latest: the largest sd_r times the expected largest of B
    normal deviates (`straggle`: 2.0 at 32 rows) more steps of one row are added to every verify policy (at batch
    32, rows of mean 20 steps at fixed:2 ended after 30).

    Why (issue 28): a per-step objective (tokens per second of this step) counts every row's tokens alike, but when
    requests start together and nobody waits, the batch ends with its slowest row: at batch 32 (CPU, trained tiny,
    48 tokens a request) fixed:2's steps emitted 15 % more tokens per second than plain ones, yet the batch took 31
    steps where its mean row needed 22, the last ones running a few low-acceptance rows at nearly a full step's
    price, and it finished 4 % slower than off. v = 0 is exactly off's remaining time, so a scheduler that
    verifies only while some v > 0 is predicted faster keeps off's end time in expectation (a one-step policy
    improvement over off)."""
    R = [max(0, int(r)) for r in remaining]
    a = torch.as_tensor(accept, dtype=torch.float64).cpu()
    out = []
    for v in range(max_v + 1):
        steps, sd = [], 0.0
        for r, left in enumerate(R):
            if left == 0:
                continue
            if v == 0:
                steps.append(left)
                continue
            w = min(v, left - 1, a.size(1))
            rho, var = row_rate(a[r, :w])
            steps.append(math.ceil(left / rho - 1e-9))
            sd = max(sd, math.sqrt(left * var / rho ** 3))
        total = _drain_time(steps, plain if v == 0 else (lambda b, v=v: spec(b, v)))
        if v and steps:
            total += straggle(len(steps)) * sd * spec(1, v)
        out.append(total)
    return out


def _drain_time(steps: Sequence[float], price: Callable[[int], float]) -> float:
    """Seconds until every row is done, the rows leaving one by one: steps[r] the steps row r still needs, price(b)
    the seconds of a step with b rows running."""
    total, prev, alive = 0.0, 0.0, len(steps)
    for s in sorted(steps):
        total += (s - prev) * price(alive)
        prev, alive = s, alive - 1
    return total


def row_rate(a: torch.Tensor) -> tuple[float, float]:
    """The mean and variance of the tokens a verify step of w = len(a) drafts emits, a [w] the conditional
    acceptance per position: 1 + J with P(J >= k) = prod_{i<=k} a_i."""
    S = torch.cumprod(torch.as_tensor(a, dtype=torch.float64), 0)
    k = torch.arange(1, S.numel() + 1, dtype=torch.float64)
    mean = float(S.sum())
    return 1.0 + mean, max(0.0, float(((2 * k - 1) * S).sum()) - mean * mean)


def straggle(rows: int) -> float:
    """The expected largest of `rows` standard normal deviates (Blom's approximation; 0 for one row): how many
    standard deviations of its own the last of a batch's rows lands after its mean."""
    return 0.0 if rows < 2 else NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))


def closed_batch_lengths(S: torch.Tensor, remaining: Sequence[int], accept: torch.Tensor,
                         step: Callable[[int, int], float], plain: Callable[[int], float],
                         spec: Callable[[int, int], float], candidates: Sequence[Sequence[int]]) -> list[int]:
    """The verify lengths of this step for a closed batch (`closed_batch_times`): of the `candidates` (per-row
    lengths), the one after which the batch is predicted to end soonest: this step's price step(n, vmax) plus
    the least time any uniform policy (plain decoding, or every row verifying u drafts at its measured rate
    accept [B, G]) then takes for the rows' remaining tokens, each row's R_r less this step's expected tokens
    1 + sum_{k<=v_r} S_r,k (S [B, G]: this step's prefix survivals, the head's calibrated confidence). A
    per-step objective counts every row's tokens alike; here a draft is worth what it takes off the batch's end,
    so rows that are ahead verify less and the rows that set the end more (issue 28: at batch 8 the per-step
    lengths cost more per step than fixed:2 and ended the batch no sooner). The remaining times are continuous
    in the rows' steps (a row with R tokens left at rho a step takes R / rho), so candidates that differ by a
    fraction of a token compare; the latest row's spread is added as in `closed_batch_times`."""
    S = torch.as_tensor(S, dtype=torch.float64).cpu()
    a = torch.as_tensor(accept, dtype=torch.float64).cpu()
    B, G = a.shape
    rates = [[(1.0, 0.0)] + [row_rate(a[r, :u]) for u in range(1, G + 1)] for r in range(B)]
    rho = [[m for m, _ in row] for row in rates]                                              # rho[r][u]
    prices = [[plain(b) for b in range(B + 1)]] + [[spec(b, u) if b else 0.0 for b in range(B + 1)]
                                                   for u in range(1, G + 1)]

    def future(left: list[float]) -> float:
        best = math.inf
        for u in range(G + 1):
            live = [(x, r) for r, x in enumerate(left) if x > 1e-9]
            total = _drain_time([x / rho[r][u] for x, r in live], prices[u].__getitem__)
            if u and live:
                sd = max(math.sqrt(x * rates[r][u][1] / rho[r][u] ** 3) for x, r in live)
                total += straggle(len(live)) * sd * prices[u][1]
            best = min(best, total)
        return best

    best_v, best_t = None, math.inf
    for v in candidates:
        v = [int(x) for x in v]
        e = [1.0 + float(S[r, :v[r]].sum()) for r in range(B)]
        t = step(sum(1 + x for x in v), max(v)) + future([max(0.0, R - x) for R, x in zip(remaining, e)])
        if t < best_t - 1e-12:
            best_v, best_t = v, t
    return best_v
