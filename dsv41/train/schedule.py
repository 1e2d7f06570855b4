"""The learning-rate schedule of the pretraining recipe (docs/system.md §6), scaled to a run of any length.

Full recipe: linear warmup over 2000 steps to the peak (2.6e-4), constant until 28/45 of the training tokens,
cosine down to 0.1x the peak by 40/45, then constant to the end. A run here has a fixed number of tokens per
step, so token fractions are step fractions. The warmup is the one piece that does not scale with the full
recipe's length (2000 steps of a very long run is ~0 of it); short runs use `WARMUP_FRACTION` of their steps.
"""

from __future__ import annotations

import math

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
