"""Guards issue 28's "never slower than off": the confidence scheduler compares every verify length with a plain
decode step (V = 0, no proposal) costed as the engine runs it, and decodes without drafting when no verify pays;
`profile-step` is warmed, repeated, median-robust and monotone in tokens and batch; greedy outputs stay token for
token those of no speculation in every mode (and in the deterministic mode, log-probs too)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative.profile import StepProfile, profile_step
from dsv41.engine.speculative.scheduler import MeasuredCost, choose_verify_lengths, expected_tokens
from dsv41.model.attention import set_tie_break
from dsv41.model.init import random_model
from tests.conftest import continuous_model
from tests.test_speculative import FLAT, CountingDrafter, OracleDrafter, _prompts


def batch_profile(batches, G, spec_per_token, spec_fixed, plain_per_row):
    """A 2-D profile as `profile_step` writes it: speculative steps cost spec_fixed + spec_per_token * tokens at
    each batch, plain decode plain_per_row * B."""
    pts = [{"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": spec_fixed + spec_per_token * B * (1 + V)}
           for B in batches for V in range(G + 1)]
    plain = [{"batch": B, "verify": None, "tokens": B, "seconds": plain_per_row * B} for B in batches]
    return StepProfile([p["tokens"] for p in pts], [p["seconds"] for p in pts], {"points": pts, "plain": plain})


@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


# ------------------------------------------------------------------------------------------------ the objective

def test_scheduler_picks_zero_when_plain_decode_is_cheaper():
    """Verification that pays against cost(B) (a verify of 0 drafts) loses against a cheaper plain step: V = 0
    for every row, padded and ragged; with acceptance 1 and T linear in tokens nothing beats plain either."""
    S = torch.cumprod(torch.full((2, 4), 0.9), dim=1)

    def cost(n):
        return 1.0 + 0.1 * n
    for ragged in (False, True):
        assert sum(choose_verify_lengths(S, cost, 4, ragged=ragged)) > 0
        assert choose_verify_lengths(S, cost, 4, ragged=ragged, plain=0.3) == [0, 0]
        assert choose_verify_lengths(torch.ones(3, 4), lambda n: 0.01 * n + 0.001, 4, ragged=ragged,
                                     plain=0.03) == [0, 0, 0]
        assert sum(choose_verify_lengths(S, cost, 4, ragged=ragged, plain=cost(2))) > 0    # plain = cost(B): as before


@pytest.mark.parametrize("ragged", [True, False])
def test_scheduler_with_plain_equals_brute_force(ragged):
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        B, G = int(torch.randint(1, 4, (1,), generator=g)), 3
        S = torch.cumprod(torch.rand(B, G, generator=g), dim=1)
        caps = torch.randint(0, G + 1, (B,), generator=g).tolist()
        base, slope, plain_f = torch.rand(3, generator=g).tolist()

        def cost(n, base=base, slope=slope):
            return 0.2 + base + slope * n / 4
        plain = cost(B) * (0.3 + plain_f)
        v = choose_verify_lengths(S, cost, caps, ragged=ragged, plain=plain)
        best = -1.0
        space = (itertools.product(*[range(c + 1) for c in caps]) if ragged
                 else ([x] * B for x in range(max(caps) + 1)))
        for w in space:
            n = sum(1 + x for x in w) if ragged else B * (1 + max(w))
            r = expected_tokens(S, [min(x, c) for x, c in zip(w, caps)]) / (plain if max(w) == 0 else cost(n))
            best = max(best, r)
        n = sum(1 + x for x in v) if ragged else B * (1 + max(v))
        got = expected_tokens(S, [min(x, c) for x, c in zip(v, caps)]) / (plain if max(v) == 0 else cost(n))
        assert abs(got - best) <= 1e-9 * best, (trial, v)


def test_two_dimensional_profile_reads_its_batch():
    """spec(B, n) reads the curve measured at batch B (tokens per row kept between batches; proportional past
    the largest), plain(B) the plain points; a 1-D profile serves both from T(n)."""
    prof = batch_profile((1, 4), 3, 0.01, 0.005, 0.008)
    assert prof.spec(4, 8) == pytest.approx(0.005 + 0.08)
    assert prof.spec(1, 3) == pytest.approx(0.005 + 0.03)
    assert prof.plain(4) == pytest.approx(0.032) and prof.plain(1) == pytest.approx(0.008)
    assert prof.spec(2, 4) == pytest.approx((prof.spec(1, 2) * 2 + prof.spec(4, 8)) / 3)     # linear in B
    assert prof.spec(8, 16) == pytest.approx(prof.spec(4, 8) * 2)
    assert prof.plain(8) == pytest.approx(0.064)
    assert FLAT.spec(3, 12) == 1.0 and FLAT.plain(3) == 1.0


def test_profile_is_monotone_in_tokens_and_batch():
    """A dip in V at one batch pools with its neighbours; a batch measured cheaper than a smaller one at the same
    V is lifted; plain decode likewise; so no more tokens or rows ever look cheaper."""
    pts = [{"batch": 1, "verify": V, "tokens": 1 + V, "seconds": s} for V, s in enumerate([1.0, 3.0, 1.0, 4.0])]
    pts += [{"batch": 2, "verify": V, "tokens": 2 * (1 + V), "seconds": s} for V, s in enumerate([0.5, 4.0, 5.0, 6.0])]
    plain = [{"batch": 1, "verify": None, "tokens": 1, "seconds": 0.9}, {"batch": 2, "verify": None, "tokens": 2,
                                                                          "seconds": 0.4}]
    prof = StepProfile([p["tokens"] for p in pts], [p["seconds"] for p in pts], {"points": pts, "plain": plain})
    for B in (1, 2, 3, 5):
        assert all(prof.spec(B, n) <= prof.spec(B, n + 1) + 1e-12 for n in range(B, 6 * B))
    for n_per_row in (1, 2, 3, 4):
        assert prof.spec(1, n_per_row) <= prof.spec(2, 2 * n_per_row) + 1e-12
    assert prof.spec(1, 2) == pytest.approx(2.0) and prof.spec(1, 3) == pytest.approx(2.0)
    assert prof.spec(2, 2) == pytest.approx(1.0)                       # lifted to batch 1's V = 0
    assert prof.plain(2) == pytest.approx(0.9)


def test_profile_step_ignores_warmup_and_an_outlier(debug_model, one_thread, monkeypatch):
    """A slow warm-up of every shape and one outlier sample (the first point's first timed run, 50x) leave the
    profile exactly as a clean run's: medians of 3 repeats, warm-ups discarded."""
    from dsv41.engine.speculative import profile as prof_mod
    cfg, m = debug_model
    G = cfg.dspark_block_size
    shapes = G + 2                                                     # plain, V = 0..G per round

    def run(outlier: bool):
        calls = itertools.count()

        def fake_timed(fn, device):
            fn()
            i = next(calls)
            rnd, k = divmod(i % (4 * shapes), shapes)                  # per batch: 1 warm-up + 3 rounds
            if rnd == 0:
                return 100.0
            if outlier and i == shapes:
                return 50.0
            return 0.010 + 0.002 * k + 0.001 * (i // (4 * shapes))
        monkeypatch.setattr(prof_mod, "timed", fake_timed)
        return profile_step(m, batches=(1, 2), context=20, repeats=3, log=lambda *a: None)
    clean, noisy = run(False), run(True)
    assert clean.t == noisy.t and clean.n == noisy.n
    for B in (1, 2, 3):
        assert clean.plain(B) == noisy.plain(B) and noisy.plain(B) < 0.05
        assert [clean.spec(B, n) for n in range(B, B * (G + 2))] == [noisy.spec(B, n) for n in range(B, B * (G + 2))]


def test_measured_cost_is_per_batch_and_kind():
    """dspark:online's correction keys plain and speculative steps apart, per batch; unmeasured shapes are the
    profile's figure on the measured scale of their kind."""
    prof = batch_profile((1, 4), 3, 0.01, 0.005, 0.008)
    c = MeasuredCost(prof)
    assert c.spec(4, 8) == prof.spec(4, 8) and c.plain(4) == prof.plain(4)
    c.record(8, 1.0, batch=4)                                          # warm-up
    c.record(8, 0.17, batch=4)
    c.record(8, 0.17, batch=4)
    assert c.spec(4, 8) == pytest.approx(0.17) and c.spec(4, 4) == pytest.approx(prof.spec(4, 4) * 2)
    assert c.plain(4) == pytest.approx(prof.plain(4) * 2)              # no plain step yet: the spec scale
    c.record(4, 1.0, batch=4, plain=True)
    c.record(4, 0.016, batch=4, plain=True)
    assert c.plain(4) == pytest.approx(0.016) and c.plain(1) == pytest.approx(prof.plain(1) * 0.5)
    assert c.spec(4, 4) == pytest.approx(prof.spec(4, 4) * 2)          # plain steps do not move the spec scale


# ------------------------------------------------------------------------------------------------ the engine

def test_engine_never_drafts_where_verification_cannot_pay(debug_model, one_thread):
    """A profile where a speculative step costs its tokens plus a proposal and plain decode costs its rows: even
    drafts that are always accepted would not pay, so dspark (and dspark:online) never call the drafter, and
    decode exactly as off; with a flat profile the same engine drafts."""
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17, 40))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    dear = batch_profile((1, 2, 3), G, 0.01, 0.005, 0.01)
    for spec in ("dspark", "dspark:online"):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=dear)
        eng.drafter = SeedCountingDrafter(G, cfg.vocab_size)
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == want, spec
        assert eng.drafter.proposals == 0, spec
        # nor is it kept seeded: each row stops drafting for good at its first decode step (only the steps that
        # feed a prompt's last token, at most one or two per prompt, seed it; drafting would seed every step)
        assert eng.drafter.seeds <= 2 * len(prompts) and eng.spec_counts["stopped_never_pays"] > 0, spec
        st = [c.stats["speculative"] for c in got]
        assert all(set(s["verify_lengths"]) == {0} and s["drafted_tokens"] == 0 for s in st), st
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark", step_profile=FLAT)
    eng.drafter = SeedCountingDrafter(G, cfg.vocab_size)
    assert [c.output_ids for c in eng.generate(prompts, params)] == want
    assert eng.drafter.proposals > 0 and eng.drafter.seeds > 2 * len(prompts)


class SeedCountingDrafter(CountingDrafter):
    """CountingDrafter that also counts (and, with seed_s, takes that long for) its seedings."""

    def __init__(self, G: int, vocab: int, seed_s: float = 0.0):
        super().__init__(G, vocab)
        self.seeds, self.seed_s = 0, seed_s

    def seed(self, *args, **kwargs):
        self.seeds += 1
        if self.seed_s:
            time.sleep(self.seed_s)


def test_costly_seeding_stops_drafting_once_it_does_not_pay(debug_model, one_thread):
    """Once the verified drafts say no verify pays, dspark decodes plainly and probes every PROBE_EVERY-th step,
    which needs the drafter seeded at every plain step; when that seeding costs more than SEED_SHARE of a plain
    step (here a slow drafter, as the eager seeding beside a CUDA-graph step on a GPU), the rows stop drafting for
    good instead: no more proposals, probes or seedings; outputs stay greedy's. A cheap seeding keeps the probes."""
    from dsv41.engine.engine import MIN_EVIDENCE, PROBE_EVERY, SEED_EVIDENCE
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5,))
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    prof = StepProfile([1, 1 + G], [1.0, 1.2])              # pays at acceptance 1; the wrong drafts never do
    runs = {}
    for seed_s in (0.0, 0.2):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark", step_profile=prof)
        eng.drafter = SeedCountingDrafter(G, cfg.vocab_size, seed_s)
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == want
        runs[seed_s] = (eng.drafter.proposals, eng.drafter.seeds, dict(eng.spec_counts))
    (p_cheap, s_cheap, sc_cheap), (p_dear, s_dear, sc_dear) = runs[0.0], runs[0.2]
    assert sc_cheap["stopped_seeding_cost"] == 0 and p_cheap > MIN_EVIDENCE + 1     # probes went on
    assert sc_dear["stopped_seeding_cost"] == 1
    assert p_dear <= MIN_EVIDENCE + SEED_EVIDENCE // PROBE_EVERY + 1 < p_cheap
    # seeded by its verifies and then by plain steps only until the seeding's share was measured, then never
    assert s_dear <= p_dear + SEED_EVIDENCE + 2 < s_cheap


def test_fixed_zero_decodes_without_drafting(debug_model, one_thread):
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="fixed:0")
    eng.drafter = CountingDrafter(G, cfg.vocab_size)
    assert [c.output_ids for c in eng.generate(prompts, params)] == want and eng.drafter.proposals == 0


def test_greedy_identity_in_every_mode(debug_model, one_thread):
    """off, fixed:1, fixed:G, dspark (a profile where verifying pays, one where it never does) and dspark:online,
    with the model's own drafter and with an oracle that is partly right: every output token for token off's."""
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17, 40), seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    pays = batch_profile((1, 2, 3), G, 0.001, 0.01, 0.01)
    dear = batch_profile((1, 2, 3), G, 0.01, 0.005, 0.01)
    for spec, prof in (("fixed:1", None), (f"fixed:{G}", None), ("dspark", pays), ("dspark", dear),
                       ("dspark:online", pays)):
        for oracle in (False, True):
            eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=prof)
            if oracle:
                eng.drafter = OracleDrafter({f"req-{i}": w for i, w in enumerate(want)}, G, cfg.vocab_size)
            got = eng.generate(prompts, params)
            assert [c.output_ids for c in got] == want, (spec, oracle)
            st = [c.stats["speculative"] for c in got]
            assert all(s["realised_tokens"] <= params.max_tokens for s in st)


def test_deterministic_mode_identity_with_the_scheduler(one_thread):
    """The deterministic mode on the packed store: outputs and log-probs bit for bit off's, for the scheduler
    whether it verifies or decodes plainly."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=2)
    set_tie_break(m, "recent")
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17, 40))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)

    def result(cs):
        return [(c.output_ids, [lp["logprob"] for lp in c.logprobs]) for c in cs]
    plain = Engine(m, prefill_mode="full", max_seq_len=256, deterministic=True).generate(prompts, params)
    want = result(plain)
    pays = batch_profile((1, 2, 3), G, 0.001, 0.01, 0.01)
    dear = batch_profile((1, 2, 3), G, 0.01, 0.005, 0.01)
    for spec, prof in (("dspark", pays), ("dspark", dear), ("dspark:online", pays)):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=prof,
                     deterministic=True)
        eng.drafter = OracleDrafter({f"req-{i}": c.output_ids for i, c in enumerate(plain)}, G, cfg.vocab_size)
        assert result(eng.generate(prompts, params)) == want, (spec, prof is dear)
