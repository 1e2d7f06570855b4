"""Guards issue 28's "T(n) over what the engine really runs": `profile_step` times whole `Engine.step()` calls of
forced shapes (plain decode, every row verifying V = 0..G drafts), so each row's accept and emit work and the
drafter's proposal are in the scheduler's cost model, not only the verify forward."""

from __future__ import annotations

import time

import pytest

from dsv41.engine import engine as engine_mod
from dsv41.engine.engine import Engine
from dsv41.engine.speculative.profile import profile_step
from tests.conftest import continuous_model


@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


def test_profile_runs_each_shape_through_the_engine_step(debug_model, one_thread, monkeypatch):
    """Each timed sample is one engine step of its shape: the speculative shapes verify exactly V = 0..G drafts in
    every row (seen by the engine's own acceptance), the plain one none; a per-row cost of `_emit` (the engine's
    bookkeeping, not part of any forward) shows in every point, in proportion to the rows."""
    cfg, m = debug_model
    G = cfg.dspark_block_size
    verified: list[int] = []
    inner_accept = engine_mod.accept_drafts

    def accept(logits, drafts, q, params, gen):
        verified.append(len(drafts))
        return inner_accept(logits, drafts, q, params, gen)
    monkeypatch.setattr(engine_mod, "accept_drafts", accept)
    prof = profile_step(m, batches=(1,), context=20, repeats=1, log=lambda *a: None)
    assert sorted(verified) == sorted(list(range(G + 1)) * 2)            # 1 warm-up + 1 round of V = 0..G
    assert prof.meta["path"] == "engine.step"
    fast = max(p["seconds"] for p in prof.meta["points"] + prof.meta["plain"])

    emit_cost = 0.05 + 2 * fast
    inner_emit = Engine._emit

    def slow_emit(self, seq, new_ids, logits):
        time.sleep(emit_cost)
        return inner_emit(self, seq, new_ids, logits)
    monkeypatch.setattr(Engine, "_emit", slow_emit)
    slow = profile_step(m, batches=(1, 2), context=20, repeats=1, log=lambda *a: None)
    for B in (1, 2):                 # lower bounds the sleeps guarantee: B rows' emits in every point of batch B
        assert slow.plain(B) >= B * emit_cost
        for V in range(G + 1):
            assert slow.spec(B, B * (1 + V)) >= B * emit_cost


def test_profile_leaves_the_model_serving_exactly(debug_model, one_thread):
    """Profiling runs engines of its own: afterwards the model decodes as before (no state left behind)."""
    from dsv41.engine.sampling import SamplingParams
    from tests.test_speculative import _prompts
    cfg, m = debug_model
    prompts = _prompts(cfg.vocab_size, (5, 17))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    before = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    profile_step(m, batches=(2,), context=12, repeats=1, log=lambda *a: None)
    after = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    assert before == after


def _profile_at_8(ms, fit):
    from dsv41.engine.speculative.profile import StepProfile
    pts = [{"batch": 8, "verify": V, "tokens": 8 * (1 + V), "seconds": t / 1e3} for V, t in enumerate(ms)]
    plain = [{"batch": 8, "verify": None, "tokens": 8, "seconds": 0.163}]
    return StepProfile([p["tokens"] for p in pts], [p["seconds"] for p in pts],
                       {"points": pts, "plain": plain, "fit": fit})


def test_linear_fit_pools_a_noisy_point():
    """Issue 28's batch-8 profile of 2026-12-06 (V = 0..4: 194, 233, 262, 253, 297 ms; V = 3 measured while the
    machine was less busy): interpolating it (dips pooled) makes V = 3 look free and the scheduler picks it where
    V = 4 was best; the CPU fit, one line through all points, picks 4. On clean linear points both fits agree."""
    import torch

    from dsv41.engine.speculative.profile import line_fit
    from dsv41.engine.speculative.scheduler import choose_verify_lengths, plain_cost, spec_cost
    S = torch.cumprod(torch.full((8, 4), 0.8), dim=1)
    noisy = [193.74, 232.83, 262.23, 253.4, 297.23]

    def choice(ms, fit):
        p = _profile_at_8(ms, fit)
        return choose_verify_lengths(S, spec_cost(p, 8), 4, ragged=True, plain=plain_cost(p, 8))
    assert choice(noisy, "isotonic") == [3] * 8
    assert choice(noisy, "linear") == [4] * 8
    clean = [200.0 + 3.0 * 8 * V for V in range(5)]
    assert choice(clean, "isotonic") == choice(clean, "linear")
    assert line_fit([1, 2, 3], [3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]              # never decreasing: the mean
    assert line_fit([1, 2, 3], [1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])


def test_resolve_speculation_flags_a_forward_only_profile(debug_model, tmp_path):
    """A step_profile.json from the older profile-step (the verify forward only) still loads, with a log line
    asking for a new one; a profile of engine steps loads silently."""
    from dsv41.engine.speculative.policy import resolve_speculation
    from dsv41.engine.speculative.profile import StepProfile
    cfg, m = debug_model
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    StepProfile([1, 5], [0.1, 0.2]).save(old)
    StepProfile([1, 5], [0.1, 0.2], {"path": "engine.step"}).save(new)
    for path, warned in ((old, True), (new, False)):
        logs: list[str] = []
        spec, prof = resolve_speculation(m, None, "dspark", profile_path=path, log=logs.append)
        assert str(spec) == "dspark" and prof(5) == pytest.approx(0.2)
        assert any("forward only" in x for x in logs) == warned, logs
