"""The confidence scheduler (step 2 of `dsv41.engine.speculative`, docs/system.md §5): how many drafts to verify, from
the prefix survivals S and the step latency T(n), and the online corrections of both inputs (`dspark:online`)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class AcceptanceCalibration:
    """Online per-position correction of the drafter's acceptance estimates a_r,k for the scheduler.

    Over the drafts verified so far at position k (those reached with drafts < k accepted), accepted_k counts the
    accepted ones and predicted_k sums their a_r,k; ratio_k = (accepted_k + n0) / (predicted_k + n0) (n0 pseudo-
    drafts pull it to 1 while there are few) and the scheduler uses min(1, a_r,k * ratio_k). A confidence head that
    over-predicts (the tiny model's at batch 8 chose 4 drafts where 1 was best) is scaled down by what the engine
    measures; one that is right is left alone. Only the choice of V changes, never the output distribution."""

    def __init__(self, G: int, n0: float = 8.0):
        self.n0 = n0
        self.accepted, self.predicted = [0.0] * G, [0.0] * G

    def update(self, k: int, predicted: float, accepted: bool) -> None:
        self.predicted[k] += predicted
        self.accepted[k] += float(accepted)

    def ratios(self) -> torch.Tensor:
        return torch.tensor([(a + self.n0) / (p + self.n0) for a, p in zip(self.accepted, self.predicted)])

    def apply(self, accept: torch.Tensor) -> torch.Tensor:
        """a [B, G] -> calibrated a [B, G]."""
        return (accept * self.ratios()[:accept.size(1)]).clamp(max=1.0)


class MeasuredCost:
    """T(n) for the scheduler, corrected by the engine's own speculative step times.

    The profile is the prior. Each engine step records (n, seconds); the first step at each n is a warm-up and is
    dropped. A measured n costs its mean; any other n costs profile(n) times the mean measured/profile ratio, which
    puts a profile from another context length or machine on the engine's scale. A V whose verify costs more than
    the profile said is corrected the first time the scheduler chooses it."""

    def __init__(self, profile: Callable[[int], float]):
        self.profile = profile
        self.seen: set[int] = set()
        self.times: dict[int, list[float]] = {}                 # n -> measured seconds after the warm-up

    def record(self, n: int, seconds: float) -> None:
        if n in self.seen:
            self.times.setdefault(n, []).append(seconds)
        self.seen.add(n)

    def mean(self, n: int) -> float:
        return sum(self.times[n]) / len(self.times[n])

    def __call__(self, n: int) -> float:
        if n in self.times:
            return self.mean(n)
        if not self.times:
            return self.profile(n)
        scale = sum(self.mean(m) / self.profile(m) for m in self.times) / len(self.times)
        return self.profile(n) * scale


def expected_tokens(S: torch.Tensor, v: Sequence[int]) -> float:
    """sum_r (1 + sum_{k<=v_r} S_r,k)."""
    return sum(1.0 + float(S[r, :v[r]].sum()) for r in range(S.size(0)))


def choose_verify_lengths(S: torch.Tensor, cost: Callable[[int], float], max_v: int | Sequence[int],
                          ragged: bool = True) -> list[int]:
    """The {v_r} maximising expected_tokens(S, v) / cost(tokens in the batch) (module docstring).
    S [B,G] prefix survivals (non-increasing along k); max_v: the most drafts per row (int or per row).
    ragged: tokens = sum_r (1 + v_r); otherwise (a padded forward) tokens = B (1 + max v) and every row gets
    the same v."""
    S = torch.as_tensor(S, dtype=torch.float64).cpu()
    B, G = S.shape
    caps = [max(0, min(G, int(c))) for c in (max_v if isinstance(max_v, Sequence) else [max_v] * B)]
    if not ragged:
        best, best_v = -1.0, 0
        for V in range(max(caps) + 1):
            ratio = expected_tokens(S, [min(V, c) for c in caps]) / cost(B * (1 + V))
            if ratio > best + 1e-12 * abs(best):
                best, best_v = ratio, V
        return [best_v] * B
    gains = sorted(((float(S[r, k]), k, r) for r in range(B) for k in range(caps[r])), key=lambda g: (-g[0], g[1]))
    num, best, best_b = float(B), B / cost(B), 0
    for b, (s, _, _) in enumerate(gains, start=1):
        num += s
        ratio = num / cost(B + b)
        if ratio > best + 1e-12 * abs(best):
            best, best_b = ratio, b
    v = [0] * B
    for _, _, r in gains[:best_b]:
        v[r] += 1
    return v
