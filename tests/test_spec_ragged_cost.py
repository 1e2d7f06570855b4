"""Guards issue 28's ragged step price: a verify whose rows take different lengths runs its token-wise work on its n
real tokens but lays the store part out [B, 1 + longest], so the scheduler prices a step by its tokens and its
longest row (`choose_verify_lengths(..., by_longest=True)`), the profile measures a ragged shape to split the two
(`padded_share`), and the online cost model keys its measurements by the longest row too."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv41.engine.speculative.profile import StepProfile, padded_share, profile_step
from dsv41.engine.speculative.scheduler import MeasuredCost, choose_verify_lengths, expected_tokens, spec_cost
from tests.conftest import continuous_model


def uniform_profile(B: int, G: int, fixed: float, per_token: float, ragged_s: float | None):
    pts = [{"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": fixed + per_token * B * (1 + V)}
           for V in range(G + 1)]
    rag = [] if ragged_s is None else [{"batch": B, "verify": "ragged", "tokens": B + G, "vmax": G,
                                        "seconds": ragged_s}]
    return StepProfile([p["tokens"] for p in pts], [p["seconds"] for p in pts],
                       {"points": pts, "plain": [{"batch": B, "verify": None, "tokens": B, "seconds": fixed}],
                        "ragged": rag, "fit": "linear"})


def test_by_longest_equals_brute_force():
    """With a price that depends on the tokens and the longest row, the chosen lengths reach the best ratio over
    every assignment of lengths (plain decode for all zeros)."""
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        B, G = int(torch.randint(1, 4, (1,), generator=g)), 3
        S = torch.cumprod(torch.rand(B, G, generator=g), dim=1)
        caps = torch.randint(0, G + 1, (B,), generator=g).tolist()
        a, b, c, pf = torch.rand(4, generator=g).tolist()

        def cost(n, vmax=None, a=a, b=b, c=c, B=B):
            return 0.2 + a + b * n / 4 + (0.0 if vmax is None else c * B * (1 + vmax) / 4)
        plain = (0.2 + a + b * B / 4 + c * B / 4) * (0.3 + pf)
        v = choose_verify_lengths(S, cost, caps, ragged=True, plain=plain, by_longest=True)

        def ratio(w):
            return expected_tokens(S, list(w)) / (plain if max(w) == 0 else cost(sum(1 + x for x in w), max(w)))
        best = max(ratio(w) for w in itertools.product(*[range(k + 1) for k in caps]))
        assert all(x <= k for x, k in zip(v, caps)) and abs(ratio(v) - best) <= 1e-9 * best, (trial, v)


def test_padded_price_evens_out_the_lengths():
    """Rows with unequal survivals: priced by tokens alone the scheduler verifies the sure row long and the unsure
    row not at all; when the longest row sets the price (every row's store part is laid out that long), the unsure
    row's drafts are nearly free and it verifies as long as the sure one."""
    S = torch.cumprod(torch.tensor([[0.95] * 4, [0.3] * 4]), dim=1)

    def by_tokens(n, vmax=None):
        return 1.0 + 0.2 * n

    def by_longest(n, vmax=None):
        return 1.0 + 0.001 * n + 0.199 * 2 * (1 + vmax)
    v_tokens = choose_verify_lengths(S, by_tokens, 4, ragged=True, plain=1.2)
    v_longest = choose_verify_lengths(S, by_longest, 4, ragged=True, plain=1.2, by_longest=True)
    assert v_tokens[0] > v_tokens[1] == 0
    assert v_longest == [4, 4]


def test_padded_share_from_the_ragged_point():
    """A ragged step that costs what every row verifying G costs: the padded slot costs the curve's slope, so
    spec(B, n, G) is the uniform G price whatever n; one that costs what its n tokens cost uniformly: 0, spec
    ignores the longest row; in between, proportionally; without a ragged point spec(B, n, vmax) = spec(B, n)."""
    B, G, fixed, k = 8, 4, 0.1, 0.002
    full = uniform_profile(B, G, fixed, k, fixed + k * B * (1 + G))
    assert padded_share(full._by_batch, full.meta["ragged"])[B] == pytest.approx(k)
    assert full.spec(B, B + G, G) == pytest.approx(full.spec(B, B * (1 + G)))
    assert full.spec(B, 3 * B, 2) == pytest.approx(full.spec(B, 3 * B))          # uniform shapes: unchanged
    none = uniform_profile(B, G, fixed, k, fixed + k * (B + G))
    assert none.spec(B, B + G, G) == pytest.approx(none.spec(B, B + G))
    half = uniform_profile(B, G, fixed, k, fixed + k * (B + G) + 0.5 * k * (B * (1 + G) - B - G))
    assert half.spec(B, B + G, G) == pytest.approx((full.spec(B, B + G, G) + none.spec(B, B + G, G)) / 2)
    bare = uniform_profile(B, G, fixed, k, None)
    assert bare.spec(B, B + G, G) == bare.spec(B, B + G)
    assert spec_cost(full, B)(B + G, G) == full.spec(B, B + G, G)
    assert spec_cost(lambda n: 2.0 * n, B)(5, 3) == 10.0                       # a model of tokens only


def test_measured_cost_keys_the_longest_row():
    """Two steps of the same tokens but different longest rows are different shapes to the online cost model."""
    prof = uniform_profile(4, 4, 0.1, 0.01, 0.1 + 0.01 * 20)
    c = MeasuredCost(prof)
    for t in (9.0, 0.5, 0.5):                                  # the first of a shape is its warm-up
        c.record(8, t, batch=4, vmax=4)
    assert c.spec(4, 8, 4) == pytest.approx(0.5)
    assert c.spec(4, 8, 1) != pytest.approx(0.5)              # not measured: the profile, scaled
    assert c.spec(4, 8, 1) == pytest.approx(prof.spec(4, 8, 1) * 0.5 / prof.spec(4, 8, 4))


@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


def test_profile_measures_the_ragged_shape(debug_model, one_thread, monkeypatch):
    """profile_step times a ragged step at B > 1 (first row G drafts, the others none; seen by the engine's own
    acceptance) and records it, with the padded share it gives."""
    from dsv41.engine import engine as engine_mod
    cfg, m = debug_model
    G = cfg.dspark_block_size
    shapes: list[list[int]] = []
    seen = engine_mod.accept_drafts
    batch: list[int] = []

    def accept(logits, drafts, q, params, gen):
        batch.append(len(drafts))
        if len(batch) == 2:
            shapes.append(list(batch))
            batch.clear()
        return seen(logits, drafts, q, params, gen)
    monkeypatch.setattr(engine_mod, "accept_drafts", accept)
    prof = profile_step(m, batches=(2,), context=12, repeats=1, log=lambda *a: None)
    assert [G, 0] in shapes and [G, G] in shapes
    (r,) = prof.meta["ragged"]
    assert r["batch"] == 2 and r["tokens"] == 2 + G and r["vmax"] == G and r["seconds"] > 0
    assert 2 in prof._padded
