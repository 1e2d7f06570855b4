"""Issue 28's straggler tail: when no request waits for a finished row's place and every row's length is known, the
dspark scheduler prices a policy by the time until the batch's LAST row is done (`closed_batch_times`), with each
row's own measured acceptance (`row_acceptance`), and decodes plainly (no proposal) where no verify length is
predicted to end the batch sooner than plain decoding would; outputs stay greedy's."""

from __future__ import annotations

import pytest
import torch

from dsv41.engine import engine as engine_module
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative.drafter import Proposal
from dsv41.engine.speculative.profile import StepProfile
from dsv41.engine.speculative.scheduler import (choose_verify_lengths, closed_batch_lengths, closed_batch_times,
                                                row_acceptance, row_rate, shrinkage_strength, straggle)
from tests.conftest import continuous_model
from tests.test_speculative import _prompts


def plain_heavy(a: float = 0.010, c: float = 0.0005, spec_fixed: float = 0.012, spec_token: float = 0.0005):
    """Times of a step: plain a + c B (a fixed part most of it, as on the CPU), speculative spec_fixed +
    spec_token * tokens."""
    return (lambda b: a + c * b), (lambda b, v: spec_fixed + spec_token * b * (1 + v))


def test_plain_time_is_the_rows_leaving_one_by_one():
    plain, spec = plain_heavy()
    t = closed_batch_times([3, 5, 5], torch.zeros(3, 4), plain, spec, 4)
    assert t[0] == pytest.approx(3 * plain(3) + 2 * plain(2))
    # acceptance 0: every verify length emits one token a step, at a verify's price
    assert all(t[v] == pytest.approx(3 * spec(3, v) + 2 * spec(2, v)) for v in range(1, 5))


def test_rows_finishing_at_different_steps_by_hand():
    plain, spec = plain_heavy()
    a = torch.tensor([[1.0, 1.0], [0.5, 0.5]])
    t = closed_batch_times([10, 10], a, plain, spec, 2)
    z = 0.5894                                         # the expected larger of two standard normals (Blom)
    # v = 1: row 0 emits 2 a step (5 steps), row 1 1.5 (ceil(10 / 1.5) = 7 steps), each step's tokens of row 1
    # varying by 0.25: its end by sqrt(10 * 0.25 / 1.5^3) steps, z of them added at one row's price
    assert t[1] == pytest.approx(5 * spec(2, 1) + 2 * spec(1, 1) + z * (2.5 / 1.5 ** 3) ** 0.5 * spec(1, 1), rel=1e-4)
    # v = 2: rho 3 (ceil 10/3 = 4) and 1.75 (ceil 10/1.75 = 6); row 1's variance 1 * .5 + 3 * .25 - .75^2
    var = 0.5 + 3 * 0.25 - 0.75 ** 2
    assert t[2] == pytest.approx(4 * spec(2, 2) + 2 * spec(1, 2) + z * (10 * var / 1.75 ** 3) ** 0.5 * spec(1, 2),
                                 rel=1e-4)
    # a row with one token left verifies nothing (its cap is R - 1): one step whatever v is
    assert closed_batch_times([1], torch.ones(1, 4), plain, spec, 4)[1:] == [pytest.approx(spec(1, v))
                                                                           for v in range(1, 5)]


def test_closed_batch_refuses_what_the_step_objective_takes():
    """Two rows, one whose drafts are always accepted and one whose never are: each step of verifying 4 emits 6
    tokens for 0.017 s where a plain step emits 2 for 0.011, so the per-step objective verifies; but the second
    row still needs a step per token, so the batch ends later than with plain decoding, and the closed-batch
    times say so (every v slower than v = 0)."""
    plain, spec = plain_heavy()
    S = torch.tensor([[1.0] * 4, [0.0] * 4])
    assert choose_verify_lengths(S, lambda n, vmax=None: 0.012 + 0.0005 * n, 4, plain=plain(2),
                                 by_longest=True) != [0, 0]
    t = closed_batch_times([12, 12], torch.tensor([[1.0] * 4, [0.0] * 4]), plain, spec, 4)
    assert min(t[1:]) > t[0]
    # the same drafter on both rows: verifying ends the batch sooner
    t = closed_batch_times([12, 12], torch.ones(2, 4), plain, spec, 4)
    assert min(t[1:]) < t[0]


def test_closed_batch_lengths_give_the_drafts_to_the_row_that_sets_the_end():
    """Row 0 has 3 tokens left and confident drafts, row 1 30 left and weaker ones: a step verifying 4 drafts on
    either row costs the same; the per-step objective verifies row 0's (more expected tokens), but those end a row
    that was ending anyway, while row 1's take steps off the batch's end, so the closed-batch lengths verify row 1."""
    plain, spec = plain_heavy()
    S = torch.cumprod(torch.tensor([[0.95] * 4, [0.6] * 4]), dim=1)
    step = lambda n, vmax=None: 0.012 + 0.0005 * n                  # noqa: E731
    assert choose_verify_lengths(S, step, [2, 4], by_longest=True)[0] > 0
    acc = torch.tensor([[0.95] * 4, [0.6] * 4])
    assert closed_batch_lengths(S, [3, 30], acc, step, plain, spec, [[2, 0], [0, 4]]) == [0, 4]
    # (ending row 0 in this step as well saves it a later step's price: both)
    assert closed_batch_lengths(S, [3, 30], acc, step, plain, spec, [[2, 0], [0, 4], [2, 4]]) == [2, 4]
    # two rows alike: both verify
    S2, acc2 = torch.cumprod(torch.full((2, 4), 0.9), 1), torch.full((2, 4), 0.9)
    assert closed_batch_lengths(S2, [30, 30], acc2, step, plain, spec, [[0, 4], [4, 0], [4, 4]]) == [4, 4]


def test_row_rate_and_straggle():
    assert row_rate(torch.tensor([1.0, 1.0])) == (3.0, 0.0)
    assert row_rate(torch.tensor([0.5])) == (1.5, 0.25)
    assert row_rate(torch.tensor([])) == (1.0, 0.0)
    assert straggle(1) == 0.0 and straggle(2) == pytest.approx(0.5894, abs=1e-3)
    assert 1.9 < straggle(32) < 2.2 and straggle(8) < straggle(32)


def test_shrinkage_strength_is_read_off_the_rows():
    """Empirical Bayes: rows that share one true acceptance get a strong pull to the batch's rate (their spread is
    binomial noise), rows that differ persistently a weak one, near the beta-binomial's m = p q / tau^2 - 1."""
    g = torch.Generator().manual_seed(0)

    def median_m(spread: float, drafts: int) -> float:
        ms = []
        for _ in range(41):
            p = (0.7 + spread * torch.randn(32, generator=g)).clamp(0.02, 0.98)
            a = torch.binomial(torch.full((32,), float(drafts)), p, generator=g)
            ms.append(shrinkage_strength([drafts] * 32, a.long().tolist()))
        return sorted(ms)[20]

    assert median_m(0.0, 10) == 64.0                           # no spread: the upper clip
    assert 10 < median_m(0.1, 30) < 40                         # tau 0.1 at p 0.7: m = 0.21 / 0.01 - 1 = 20
    assert median_m(0.2, 30) < 9                               # tau 0.2: m = 4.25
    assert shrinkage_strength([3], [1]) == 64.0 and shrinkage_strength([], []) == 64.0
    assert shrinkage_strength([5, 5, 5, 5], [0, 5, 0, 5]) == 4.0  # rows all-or-nothing: the lower clip
    # the lowest row of 32 with 3 drafts each is pulled to the batch rate under the estimated m (issue 28: with
    # m = 4 the minimum of 32 noisy rates set the closed batch's end)
    p = torch.full((32,), 0.7)
    a = torch.binomial(torch.full((32,), 3.0), p, generator=g).long().tolist()
    m = shrinkage_strength([3] * 32, a)
    low = min(row_acceptance([3], [x], [sum(a) / 96], m)[0] for x in a)
    assert low > min(row_acceptance([3], [x], [sum(a) / 96], 4.0)[0] for x in a) and low > 0.55


def test_row_acceptance_shrinks_to_the_batch_rate():
    assert row_acceptance([], [], [0.6, 0.5]) == [0.6, 0.5]
    r = row_acceptance([12, 0], [0, 0], [0.6, 0.5], m=4.0)
    assert r[0] == pytest.approx(4 * 0.6 / 16) and r[1] == 0.5
    assert row_acceptance([100], [100], [0.2], m=4.0)[0] > 0.95


# ------------------------------------------------------------------------------------------------ the engine

class SplitDrafter:
    """The greedy continuation (known in advance) for the rows in `good`, a wrong token everywhere for the others;
    a confident head on every row; counts proposals."""

    def __init__(self, futures: dict, good: set, G: int, vocab: int):
        self.futures, self.good, self.G, self.vocab = futures, good, G, vocab
        self.proposals = self.seeds = 0

    def seed(self, *args, **kwargs):
        self.seeds += self.proposals > 0              # seeds after the first proposal (the prompts' are before it)

    def propose(self, view, seqs, pos) -> Proposal:
        self.proposals += 1
        rows = []
        for s in seqs:
            fut, k = self.futures[s.request_id], len(s.output_ids)
            d = [fut[k + i] if k + i < len(fut) else 0 for i in range(self.G)]
            if s.request_id not in self.good:
                d = [(t + 1) % self.vocab for t in d]
            rows.append(d)
        return Proposal(torch.tensor(rows), [None] * len(seqs), torch.full((len(seqs), self.G), 0.9))


@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


def _profile(G):
    """Plain steps cost 0.010 + 0.0005 B, speculative ones 0.012 + 0.0005 tokens, at batches 1..4."""
    pts = [{"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": 0.012 + 0.0005 * B * (1 + V)}
           for B in (1, 2, 3, 4) for V in range(G + 1)]
    plain = [{"batch": B, "verify": None, "tokens": B, "seconds": 0.010 + 0.0005 * B} for B in (1, 2, 3, 4)]
    return StepProfile([p["tokens"] for p in pts], [p["seconds"] for p in pts], {"points": pts, "plain": plain})


@pytest.mark.parametrize("spec", ["dspark", "dspark:online"])
def test_engine_stops_drafting_for_a_closed_batch_with_stragglers(debug_model, one_thread, spec, monkeypatch):
    """Four rows started together, two whose drafts are always accepted and two whose never are: once the
    verified drafts show it (CLOSED_EVIDENCE first drafts, 16 here: 4 steps), the closed batch decodes plainly to
    its end without seeding the drafter (the two slow rows need a step a token either way), where the per-step
    objective, which the same engine keeps when the rows' ends are unknown (EOS not ignored), drafts on; outputs
    greedy's in both."""
    monkeypatch.setattr(engine_module, "CLOSED_EVIDENCE", 16)
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 9, 17, 23), seed=4)
    prof = _profile(G)
    counts = {}
    for closed in (True, False):
        params = SamplingParams(max_tokens=40, ignore_eos=closed)
        want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=prof)
        if spec == "dspark:online":                   # its costs stay the profile's (this machine's step times
            eng.step_cost.record = lambda *a, **k: None   # would replace them): the calibrated acceptance is tested
        eng.drafter = SplitDrafter({f"req-{i}": w for i, w in enumerate(want)}, {"req-0", "req-1"}, G,
                                   cfg.vocab_size)
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == want, (spec, closed)
        counts[closed] = (eng.drafter.proposals, eng.spec_counts["closed_plain"], eng.spec_counts["closed_spec"],
                          eng.drafter.seeds)
    proposals, planned_plain, _, seeds = counts[True]
    # the evidence steps (MIN_EVIDENCE first drafts: 4 steps), a few more while each row's own rate, shrunk to the
    # batch's, comes down, then plain to the end
    assert 4 <= proposals <= 12 and planned_plain == 1, counts    # decided once: its rows draft no more
    assert seeds <= proposals + 1, counts                            # nor are they seeded
    assert all(s.drafter_off for s in eng.finished.values()) is False   # (the open run's rows draft to the end)
    assert counts[False][0] > 2 * proposals and counts[False][1] == 0, counts


def test_engine_keeps_drafting_a_closed_batch_that_gains(debug_model, one_thread, monkeypatch):
    """The same closed batch with every row's drafts accepted: verifying ends it sooner, so the engine drafts to
    the end (no plain step planned)."""
    monkeypatch.setattr(engine_module, "CLOSED_EVIDENCE", 16)
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 9, 17, 23), seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark:online", step_profile=_profile(G))
    eng.drafter = SplitDrafter({f"req-{i}": w for i, w in enumerate(want)}, {f"req-{i}" for i in range(4)}, G,
                               cfg.vocab_size)
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == want
    assert eng.spec_counts["closed_plain"] == 0 and eng.spec_counts["closed_spec"] > 0
