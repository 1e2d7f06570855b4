"""Guards the learning-rate schedule shape of docs/system.md §6: linear warmup, constant to 28/45, cosine to 0.1x by
40/45, constant to the end."""

from __future__ import annotations

import math

import pytest

from dsv41.train.schedule import default_warmup, lr_factor


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
