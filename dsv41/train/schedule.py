"""The learning-rate schedule of the pretraining recipe (docs/system.md §6), scaled to a run of any length, and
its re-plan when a resumed run is given a new budget.

Full recipe: linear warmup over 2000 steps to the peak (2.6e-4), constant until 28/45 of the training tokens,
cosine down to 0.1x the peak by 40/45, then constant to the end. A run here has a fixed number of tokens per
step, so token fractions are step fractions. The warmup is the one piece that does not scale with the full
recipe's length (2000 steps of a very long run is ~0 of it); short runs use `WARMUP_FRACTION` of their steps.

Re-plan (`Schedule.replan`): a run planned for N1 steps and resumed at step s with a budget of N2 total steps
follows, from step s on, the recipe planned for N2 steps, except that the learning rate never rises above the
level the old plan had reached at step s (the cap): factor(t) = min(cap, recipe(t, N2)) after the warmup. A run
stopped while still at the peak continues exactly as a run planned for N2 would; one stopped in its decay holds
its learning rate until the N2 plan's cosine comes down to it, then follows that cosine; one that had finished
(s = N1, at 0.1x) continues at 0.1x. Re-warming a decayed model to the peak would first undo part of what the
decay gained, so the rate only ever goes down. The warmup length stays the one first planned. The re-plan is a
pure function of (schedule, s, N2), so a resumed run and one process that re-plans at step s train identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_START = 28 / 45
DECAY_END = 40 / 45
FINAL = 0.1
WARMUP_FRACTION = 0.05


def default_warmup(total_steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * total_steps))


def lr_factor(step: int, total_steps: int, warmup: int) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of `total_steps`.

    warmup: (step + 1) / warmup for step < warmup; 1 until DECAY_START * total; cosine from 1 to FINAL between
    DECAY_START * total and DECAY_END * total; FINAL afterwards."""
    if total_steps < 1 or warmup < 0:
        raise ValueError(f"schedule needs total_steps >= 1 and warmup >= 0, got {total_steps}, {warmup}")
    if step < warmup:
        return (step + 1) / warmup
    t = step / total_steps
    if t < DECAY_START:
        return 1.0
    if t >= DECAY_END:
        return FINAL
    x = (t - DECAY_START) / (DECAY_END - DECAY_START)
    return FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * x))


@dataclass(frozen=True)
class Schedule:
    """A run's plan: `total` steps, `warmup` steps, and `cap`, the ceiling that re-plans leave (1.0 for a run
    planned once, whose factors are exactly `lr_factor`'s)."""
    total: int
    warmup: int
    cap: float = 1.0

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup:
            return lr_factor(step, self.total, self.warmup)
        return min(self.cap, lr_factor(step, self.total, 0))

    def replan(self, step: int, total: int) -> Schedule:
        """This plan re-planned at step `step` (the next optimizer step to run) for `total` steps in all (the
        module docstring). The same total keeps the plan as it is."""
        if total == self.total:
            return self
        if total <= step:
            raise ValueError(f"a re-plan at step {step} needs a total above it, got {total}")
        return Schedule(total, self.warmup, min(self.cap, lr_factor(step, self.total, 0)))

    def state_dict(self) -> dict:
        return {"total": self.total, "warmup": self.warmup, "cap": self.cap}
