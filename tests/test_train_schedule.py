"""Guards the learning-rate schedule shape of docs/system.md §6: linear warmup, constant to 28/45, cosine to 0.1x by
40/45, constant to the end; and its re-plan for a new total at a step: the new total's plan, never above the level
already reached."""

from __future__ import annotations

import math

import pytest

from dsv41.train.schedule import Schedule, default_warmup, lr_factor


def test_schedule_shape():
    T, W = 4500, 100
    f = [lr_factor(s, T, W) for s in range(T)]
    assert f[0] == pytest.approx(1 / W) and f[W - 1] == 1.0
    assert all(b > a for a, b in zip(f[:W - 1], f[1:W]))                    # warmup rises
    assert set(f[W:2800]) == {1.0}                                           # constant until 28/45
    assert all(b <= a for a, b in zip(f[2800:4000], f[2801:4000]))           # cosine falls
    assert f[3400] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert set(f[4000:]) == {0.1}                                            # 0.1x from 40/45
    assert default_warmup(1000) == 50 and default_warmup(3) == 1
    with pytest.raises(ValueError):
        lr_factor(0, 0, 1)


def test_schedule_planned_once_is_lr_factor():
    for T, W in ((4500, 100), (7, 1), (3, 1)):
        plan = Schedule(T, W)
        assert [plan.factor(s) for s in range(T + 2)] == [lr_factor(s, T, W) for s in range(T + 2)]
        assert plan.replan(T // 2, T) is plan                               # the same total keeps the plan


def test_replan_follows_the_new_total_without_raising_the_rate():
    N1, N2, W = 450, 900, 10
    old = Schedule(N1, W)
    # at the peak (before 28/45 of N1): from s on, exactly the plan for N2
    s = 200
    new = old.replan(s, N2)
    assert new == Schedule(N2, W) and [new.factor(t) for t in range(s, N2)] == [lr_factor(t, N2, W)
                                                                                 for t in range(s, N2)]
    # in the decay: held at the level reached, then the N2 plan's cosine once it is lower, down to 0.1x
    s = 340
    level = lr_factor(s, N1, W)
    new = old.replan(s, N2)
    f = [new.factor(t) for t in range(s, N2)]
    assert 0.1 < level < 1 and f[0] == level and old.factor(s - 1) >= f[0]
    assert all(b <= a for a, b in zip(f, f[1:])) and f[-1] == 0.1
    assert f == [min(level, lr_factor(t, N2, W)) for t in range(s, N2)]
    assert f[600 - s] == level and f[720 - s] < level                       # held, then the N2 plan's cosine
    # a finished run (s = N1, at 0.1x) extended: 0.1x to the end; re-plans compose (the cap only falls)
    done = old.replan(N1, N2)
    assert {done.factor(t) for t in range(N1, N2)} == {0.1}
    assert done.replan(N2, 2 * N2).cap == 0.1
    # a re-plan during the warmup keeps the warmup
    early = old.replan(3, N2)
    assert [early.factor(t) for t in range(3, W)] == [lr_factor(t, N1, W) for t in range(3, W)]
    with pytest.raises(ValueError, match="above"):
        old.replan(300, 300)
