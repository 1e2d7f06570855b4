"""Guards speculative decoding (dsv41.engine.speculative): greedy with speculation == greedy without, token for
token (batches of different lengths, across compression-group boundaries and window wrap-around, oracle drafts
that are partly right and the model's own DSpark drafter); rejected tokens leave no trace in the packed store;
sampling keeps the target distribution (chi-square, also against an adversarial drafter, with a negative control
showing the test can fail); the confidence scheduler equals a brute-force optimum and reacts to T(n)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams, target_probs
from dsv41.engine.speculative.drafter import Proposal
from dsv41.engine.speculative.policy import Speculation
from dsv41.engine.speculative.profile import StepProfile, profile_step
from dsv41.engine.speculative.rejection import accept_drafts
from dsv41.engine.speculative.rollback import VerifyJournal
from dsv41.engine.speculative.scheduler import (AcceptanceCalibration, MeasuredCost, choose_verify_lengths,
                                                expected_tokens)
from dsv41.engine.store import make_pool
from dsv41.model.attention import set_tie_break
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.model.step import ForwardOptions
from tests.conftest import continuous_model

FLAT = StepProfile([1, 1000], [1.0, 1.0])


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < min_expected are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    exp = probs / probs.sum() * n
    big = exp >= min_expected
    obs_c, exp_c = counts[big], exp[big]
    if (~big).any():
        obs_c = torch.cat([obs_c, counts[~big].sum().view(1)])
        exp_c = torch.cat([exp_c, exp[~big].sum().view(1)])
    stat = ((obs_c - exp_c) ** 2 / exp_c.clamp_min(1e-12)).sum()
    dof = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ------------------------------------------------------------------------------------------------ drafters

class OracleDrafter:
    """Proposes the plain greedy continuation (known in advance), wrong at every `wrong`-th draft, so steps
    accept all, some or none of their drafts."""

    def __init__(self, futures: dict[str, list[int]], G: int, vocab: int, wrong: int = 3):
        self.futures, self.G, self.vocab, self.wrong = futures, G, vocab, wrong
        self.calls = itertools.count()

    def seed(self, *args, **kwargs):
        pass

    def propose(self, view, seqs, pos) -> Proposal:
        rows = []
        for s in seqs:
            fut = self.futures[s.request_id]
            k = len(s.output_ids)
            d = [fut[k + i] if k + i < len(fut) else 0 for i in range(self.G)]
            c = next(self.calls)
            if c % self.wrong == 0:
                i = c % self.G
                d[i] = (d[i] + 1) % self.vocab
            rows.append(d)
        acc = torch.linspace(0.9, 0.5, self.G).expand(len(seqs), -1).clone()
        return Proposal(torch.tensor(rows), [None] * len(seqs), acc)


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------ greedy exactness

@pytest.fixture(scope="module")
def debug_model():
    return continuous_model("debug")


def test_greedy_with_speculation_equals_greedy(debug_model, one_thread):
    cfg, m = debug_model
    assert cfg.window_size < 40 and 2 in cfg.compress_ratios           # windows wrap, groups of 2 close mid-step
    prompts = _prompts(cfg.vocab_size, (5, 17, 40))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)
    want = [c.output_ids for c in plain]
    G = cfg.dspark_block_size
    for spec in ("fixed:1", f"fixed:{G}", "dspark", "dspark:online"):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=FLAT)
        eng.drafter = OracleDrafter({f"req-{i}": w for i, w in enumerate(want)}, G, cfg.vocab_size)
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == want, spec
        st = [c.stats["speculative"] for c in got]
        acc, dr = sum(s["accepted_tokens"] for s in st), sum(s["drafted_tokens"] for s in st)
        assert 0 < acc < dr, st                                        # both acceptance and rejection happened
        assert all(s["target_forwards"] < params.max_tokens - 1 for s in st)     # fewer forwards than tokens
    # the model's own (random) DSpark drafter: proposals mostly rejected, output unchanged
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=f"fixed:{G}")
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == want
    assert sum(c.stats["speculative"]["drafted_tokens"] for c in got) > 0


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
def test_greedy_speculation_on_the_packed_store(det, one_thread):
    """Quantization on (the engine's packed pool, decode through dsv41.model.packed_decode, verify chunks through
    the dense path): still token for token on CPU; in the deterministic mode (tests/test_deterministic.py) the
    log-probs too, bit for bit, for fixed:N and the scheduler."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=2)
    set_tie_break(m, "recent")
    prompts = _prompts(cfg.vocab_size, (5, 17, 40))
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0 if det else None)

    def result(cs):
        return [(c.output_ids, [lp["logprob"] for lp in c.logprobs] if det else None) for c in cs]
    plain = Engine(m, prefill_mode="full", max_seq_len=256, deterministic=det).generate(prompts, params)
    want = result(plain)
    G = cfg.dspark_block_size
    for spec in (f"fixed:{G}", "dspark") if det else (f"fixed:{G}",):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=FLAT, deterministic=det)
        assert hasattr(eng.pool, "swa")                               # the packed store
        eng.drafter = OracleDrafter({f"req-{i}": c.output_ids for i, c in enumerate(plain)}, G, cfg.vocab_size)
        got = eng.generate(prompts, params)
        assert result(got) == want, spec
        assert 0 < sum(c.stats["speculative"]["accepted_tokens"] for c in got)


def test_speculation_with_ced_prefill_and_stops(debug_model, one_thread):
    """Batched rows joining at different steps, CED prefill seeding the drafter, stop strings and logprobs."""
    cfg, m = debug_model
    prompts = _prompts(cfg.vocab_size, (30, 9, 21), seed=5)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    plain = Engine(m, prefill_mode="ced-bounded", max_seq_len=256, max_batch=2).generate(prompts, params)
    want = [c.output_ids for c in plain]
    G = cfg.dspark_block_size
    eng = Engine(m, prefill_mode="ced-bounded", max_seq_len=256, max_batch=2, speculative=f"fixed:{G}")
    eng.drafter = OracleDrafter({f"req-{i}": w for i, w in enumerate(want)}, G, cfg.vocab_size, wrong=4)
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == want
    for a, b in zip(got, plain):
        assert len(a.logprobs) == len(a.output_ids)
        assert [d["token"] for d in a.logprobs] == [d["token"] for d in b.logprobs]
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # a stop token inside an accepted block ends the request there, as without speculation
    stop = want[0][6]
    p2 = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    ref = Engine(m, prefill_mode="ced-bounded", max_seq_len=256).generate(prompts[:1], p2)[0]
    eng = Engine(m, prefill_mode="ced-bounded", max_seq_len=256, speculative=f"fixed:{G}")
    eng.drafter = OracleDrafter({"req-0": want[0]}, G, cfg.vocab_size, wrong=1000)
    out = eng.generate(prompts[:1], p2)[0]
    assert out.output_ids == ref.output_ids and out.finish_reason == ref.finish_reason == "stop"


# ------------------------------------------------------------------------------------------------ no trace

def _snapshot(pool, sid):
    s = pool.seqs[sid]
    rings = {L: t[s.slot].clone() for L, t in pool.swa.items()}
    glob = {}
    for L in pool.global_layers:
        for kind in ("main", "index"):
            glob[(L, kind)] = pool.bind([sid]).read_records(L, kind, s.rows[(L, kind)])[0][0].cpu()
    pend = {}
    for L, (kv, sc) in pool.pending.items():
        m = pool.specs[L].pending_rows
        r = s.pos % m                                                  # slots the next call reads
        pend[L] = (kv[s.slot, m - r:].clone(), sc[s.slot, m - r:].clone())
    return s.pos, rings, glob, pend, None if s.engram_history is None else s.engram_history.clone()


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_rejected_tokens_leave_no_trace_in_packed_store(one_thread):
    """Quantization on (packed pool): verify [kept + junk A] and [kept + junk B], roll both back to the kept
    prefix: every byte the model can read afterwards is identical, and so is what decoding computes next.
    Every token is routed to every expert here, so the kept rows' arithmetic cannot depend on how many junk rows
    share an expert's GEMM (with top-k routing it can, in the last bit, which is not what this test is about)."""
    cfg = dataclasses.replace(load_config("debug"), n_activated_experts=load_config("debug").n_routed_experts)
    m = random_model(cfg, seed=2)
    set_tie_break(m, "recent")
    g = torch.Generator().manual_seed(3)
    W = cfg.window_size
    for P in (W + 3, 2 * W + 4):                                       # odd / even start: groups close in the step
        prompt = torch.randint(0, cfg.vocab_size, (1, P), generator=g)
        T = cfg.dspark_block_size + 1
        kept = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
        for keep in range(1, T + 1):
            states, nexts = [], []
            for junk_seed in (10, 11):
                pool = make_pool(m)
                assert hasattr(pool, "swa")
                sid = pool.new_sequence()
                view = pool.bind([sid])
                with torch.no_grad():
                    m(prompt, view)
                    ids = kept.clone()
                    ids[:, keep:] = torch.randint(0, cfg.vocab_size, (1, T - keep),
                                                  generator=torch.Generator().manual_seed(junk_seed))
                    j = VerifyJournal(m, view, view.pos.clone(), T)
                    m(ids, view, opts=ForwardOptions(journal=j.model_journal))
                    j.rollback(m, view, ids, torch.tensor([keep]))
                    states.append(_snapshot(pool, sid))
                    nexts.append(m(torch.tensor([[5, 6]]), pool.bind([sid])).logits)
            assert states[0][0] == P + keep
            assert _equal(states[0], states[1]), (P, keep)
            assert torch.equal(nexts[0], nexts[1]), (P, keep)


# ------------------------------------------------------------------------------------------------ sampling

def _accept_samples(p_logits, drafts, q, params, n, seed=0, accept=accept_drafts):
    """n runs of `accept`; the drafts are drawn afresh from q each run (fixed when q is None: point masses)."""
    gen = torch.Generator().manual_seed(seed)
    firsts, seconds = [], []
    for _ in range(n):
        if q is not None:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(q.size(0))]
        k, nxt = accept(p_logits, drafts, q, params, gen)
        toks = list(drafts[:k]) + [nxt]
        firsts.append(toks[0])
        seconds.append(toks[1] if len(toks) > 1 else -1)
    return torch.tensor(firsts), torch.tensor(seconds)


@pytest.mark.parametrize("adversarial", [False, True])
def test_rejection_sampling_keeps_target_distribution(adversarial):
    V = 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = target_probs(logits, params)
    if adversarial:                        # always the least likely token (outside top-k: probability 0)
        drafts, q = [int(p[0].argmin()), int(p[1].argmin())], None
    else:
        q = torch.softmax(torch.randn(2, V, generator=g), -1)
        drafts = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
    N = 20000
    first, second = _accept_samples(logits, drafts, q, params, N)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) > 1e-3
    # the second token exists when the first draft was accepted; with position-independent target rows here
    # (p_1 does not depend on the first token) it must follow p_1
    sel = second[second >= 0]
    if not adversarial:
        assert sel.numel() > 1000
        assert chi2_pvalue(torch.bincount(sel, minlength=V), p[1]) > 1e-3
    else:
        assert sel.numel() == 0                   # a zero-probability draft is never accepted


def test_chi_square_has_power():
    """Negative control: accepting every draft (no rejection step) must fail the same test."""
    V = 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g)
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits, params)
    draft = [int(p[0].argmin())]

    def accept_all(lg, drafts, q, prm, gen):
        return len(drafts), int(torch.multinomial(target_probs(lg[-1], prm), 1, generator=gen))

    first, _ = _accept_samples(logits, draft, None, params, 5000, accept=accept_all)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) < 1e-6


def _small_vocab_model():
    cfg = dataclasses.replace(load_config("debug"), vocab_size=8, dspark_noise_token_id=7,
                              engram_compressed_vocab_size=8)
    m = random_model(cfg, seed=3)
    set_quantization(m, False)
    set_tie_break(m, "recent")
    return cfg, m


class LetterTokenizer:
    vocab_size, bos_id, eos_id = 8, None, None

    def encode(self, s):
        return [ord(c) - 65 for c in s]

    def decode(self, ids):
        return "".join(chr(65 + i) for i in ids)


class AdversarialDrafter:
    """Proposes, after each pending token, the token the TARGET finds least likely there (a point mass)."""

    def __init__(self, table: dict[int, int], G: int):
        self.table, self.G = table, G

    def seed(self, *args, **kwargs):
        pass

    def propose(self, view, seqs, pos) -> Proposal:
        rows = [[self.table[s.pending]] * self.G for s in seqs]
        return Proposal(torch.tensor(rows), [None] * len(seqs), torch.full((len(seqs), self.G), 0.9))


@pytest.mark.parametrize("drafter", [pytest.param("dspark", marks=pytest.mark.slow), "adversarial"])
def test_engine_sampling_matches_target_distribution(drafter, one_thread):
    """Joint distribution of the first two generated tokens (t1 from prefill, t2 from the first speculative step)
    against the target's p(t1) p(t2 | t1), computed by teacher-forced forwards."""
    cfg, m = _small_vocab_model()
    prompt = [1, 2, 3, 4, 5, 6]
    V = cfg.vocab_size
    from dsv41.model.cache import DenseCache
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([prompt]), DenseCache(cfg, 1, torch.float32)).logits[0, -1], -1)
        p2 = torch.stack([torch.softmax(m(torch.tensor([prompt + [t]]), DenseCache(cfg, 1, torch.float32))
                                        .logits[0, -1], -1) for t in range(V)])
    G = cfg.dspark_block_size
    eng = Engine(m, LetterTokenizer(), prefill_mode="full", max_batch=64, max_seq_len=64, speculative=f"fixed:{G}")
    if drafter == "adversarial":
        eng.drafter = AdversarialDrafter({t: int(p2[t].argmin()) for t in range(V)}, G)
    N = 512
    for i in range(N):
        eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    pairs = torch.tensor([eng.finished[f"req-{i}"].output_ids[:2] for i in range(N)])
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert chi2_pvalue(counts, (p1.view(-1, 1) * p2).flatten()) > 1e-3
    drafted = sum(eng.finished[f"req-{i}"].drafted for i in range(N))
    assert drafted > 0


# ------------------------------------------------------------------------------------------------ scheduler

def _brute(S, cost, caps, ragged):
    B = S.size(0)
    best, arg = -1.0, None
    space = (itertools.product(*[range(c + 1) for c in caps]) if ragged
             else ([v] * B for v in range(max(caps) + 1)))
    for v in space:
        n = sum(1 + x for x in v) if ragged else B * (1 + max(v))
        eff = [min(x, c) for x, c in zip(v, caps)]
        r = expected_tokens(S, eff) / cost(n)
        if r > best + 1e-12:
            best, arg = r, list(v)
    return best, arg


@pytest.mark.parametrize("ragged", [True, False])
def test_scheduler_equals_brute_force(ragged):
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        B, G = int(torch.randint(1, 4, (1,), generator=g)), 4
        a = torch.rand(B, G, generator=g)
        S = torch.cumprod(a, dim=1)
        caps = torch.randint(0, G + 1, (B,), generator=g).tolist()
        base, slope, curve = torch.rand(3, generator=g).tolist()

        def cost(n, base=base, slope=slope, curve=curve):
            return 0.2 + base + slope * n / 8 + curve * (n / 8) ** 2

        v = choose_verify_lengths(S, cost, caps, ragged=ragged)
        best, _ = _brute(S, cost, caps, ragged)
        n = sum(1 + x for x in v) if ragged else B * (1 + max(v))
        got = expected_tokens(S, [min(x, c) for x, c in zip(v, caps)]) / cost(n)
        assert abs(got - best) <= 1e-9 * best, (trial, v)


def test_scheduler_flat_vs_steep():
    S = torch.cumprod(torch.full((4, 5), 0.8), dim=1)
    flat = choose_verify_lengths(S, lambda n: 1.0, 5)
    steep = choose_verify_lengths(S, lambda n: float(n), 5)
    mid = choose_verify_lengths(S, lambda n: 1.0 + n / 20, 5)
    assert flat == [5] * 4 and steep == [0] * 4
    assert sum(steep) < sum(mid) < sum(flat)
    assert choose_verify_lengths(S, lambda n: 1.0, 5, ragged=False) == [5] * 4
    assert choose_verify_lengths(S, lambda n: float(n), 5, ragged=False) == [0] * 4


def test_step_profile_and_parse(tmp_path):
    prof = StepProfile([1, 2, 4, 4], [1.0, 2.0, 3.0, 5.0], {"device": "cpu"})
    assert prof(1) == 1.0 and prof(3) == 3.0 and prof(4) == 4.0 and prof(6) == 6.0 and prof(0) == 1.0
    prof.save(tmp_path / "p.json")
    again = StepProfile.load(tmp_path / "p.json")
    assert again.n == prof.n and again.t == prof.t and again.meta["device"] == "cpu"
    assert Speculation.parse("fixed:3") == Speculation("fixed", 3) and str(Speculation.parse("dspark")) == "dspark"
    onl = Speculation.parse("dspark:online")
    assert onl.mode == "dspark" and onl.online and str(onl) == "dspark:online" and not Speculation.parse("dspark").online
    for bad in ("fixed", "fixed:-1", "fixed:x", "maybe"):
        with pytest.raises(ValueError):
            Speculation.parse(bad)
    with pytest.raises(ValueError):
        StepProfile([], [])


def test_acceptance_calibration():
    """Identity without data; an over-confident head is pulled to the measured rate of its confidence bin, a head
    that calls drafts hopeless is pulled up to theirs, a bin without data takes the position's measured rate;
    pseudo-counts shrink the correction while there are few drafts; results stay probabilities."""
    cal = AcceptanceCalibration(3, n0=8.0, m=8.0, bins=10)
    a = torch.tensor([[0.9, 0.8, 0.7]])
    assert torch.equal(cal.apply(a), a)
    for i in range(200):                          # position 0: confidence 0.95 accepted 30 %, 0.05 accepted 60 %
        cal.update(0, 0.95, i % 10 < 3)
        cal.update(0, 0.05, i % 10 < 6)
        cal.update(1, 0.5, i % 2 == 0)            # position 1: right
    out = cal.apply(torch.tensor([[0.95, 0.5, 0.7], [0.05, 0.5, 1.0], [0.55, 0.5, 0.7]]))
    assert abs(float(out[0, 0]) - 0.3) < 0.02 and abs(float(out[1, 0]) - 0.6) < 0.02   # each bin its own rate
    assert abs(float(out[2, 0]) - 0.45) < 0.01    # an empty bin: the position's rate (180 of 400)
    assert abs(float(out[0, 1]) - 0.5) < 1e-6 and torch.equal(out[:, 2], torch.tensor([0.7, 1.0, 0.7]))
    assert float(out.max()) <= 1.0 and cal.rates()[:2] == [0.45, 0.5] and cal.rates()[2] is None
    few = AcceptanceCalibration(1)
    few.update(0, 0.9, False)
    assert 0.75 < float(few.apply(torch.tensor([[0.9]]))) < 0.9                  # one rejection barely moves it


def test_measured_cost_corrects_the_profile(debug_model, one_thread):
    """The profile until measured; warm-up steps dropped; measured n at their mean; the rest scaled onto the
    measured scale; a profile that calls long verifies free stops winning once one is measured as dear. The engine
    records every dspark:online step (not with dspark)."""
    prof = StepProfile([1, 5], [1.0, 1.0])                                  # flat: long verifies look free
    c = MeasuredCost(prof)
    assert c(5) == 1.0
    c.record(5, 9.0)                                                        # warm-up, dropped
    assert c(5) == 1.0
    c.record(5, 0.05)
    c.record(5, 0.07)
    assert abs(c(5) - 0.06) < 1e-12 and abs(c(1) - 0.06) < 1e-12          # n = 1 scaled by 0.06 / 1.0
    S = torch.tensor([[0.5, 0.25, 0.125, 0.0625]])
    assert choose_verify_lengths(S, prof, 4, ragged=False)[0] == 4
    c.record(1, 0.0)
    c.record(1, 0.02)                                                       # a plain step measured cheap
    assert choose_verify_lengths(S, c, 4, ragged=False)[0] < 4
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5, 17))
    for spec, online in (("dspark:online", True), ("dspark", False)):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=FLAT)
        eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert isinstance(eng.step_cost, MeasuredCost) == online
        if online:
            assert eng.step_cost.seen and eng.step_cost.seen <= {b * (1 + v) for b in (1, 2) for v in range(G + 1)}


def test_calibrated_scheduler_verifies_fewer_when_the_head_over_predicts(debug_model, one_thread):
    """With a T(n) that makes long verifies pay only at high acceptance, an over-confident drafter (reports
    0.9..0.5, wrong on most steps) gets long verifies from the plain scheduler and shorter ones once calibrated;
    both keep greedy output token for token."""
    cfg, m = debug_model
    prompts = _prompts(cfg.vocab_size, (5, 17, 40))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    G = cfg.dspark_block_size
    prof = StepProfile([3, 3 * (1 + G)], [1.0, 2.0])
    drafted = {}
    for spec in ("dspark", "dspark:online"):
        eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative=spec, step_profile=prof)
        eng.step_cost = prof                      # this test isolates the acceptance calibration (T: the profile)
        eng.drafter = OracleDrafter({f"req-{i}": w for i, w in enumerate(want)}, G, cfg.vocab_size, wrong=1)
        got = eng.generate(prompts, params)
        assert [c.output_ids for c in got] == want, spec
        st = [c.stats["speculative"] for c in got]
        drafted[spec] = sum(s["drafted_tokens"] for s in st) / sum(s["target_forwards"] for s in st)
    assert drafted["dspark:online"] < drafted["dspark"], drafted


def test_engine_speculation_errors(debug_model):
    cfg, m = debug_model
    with pytest.raises(ValueError, match="profile"):
        Engine(m, speculative="dspark")
    no_draft = dataclasses.replace(cfg, n_mtp_layers=0)
    m2 = random_model(no_draft, seed=0)
    with pytest.raises(ValueError, match="DSpark"):
        Engine(m2, speculative="fixed:2")


def test_profile_step_measures_every_shape(debug_model, one_thread):
    cfg, m = debug_model
    prof = profile_step(m, batches=(1, 2), context=20, repeats=1, log=lambda *a: None)
    G = cfg.dspark_block_size
    assert len(prof.meta["points"]) == 2 * (G + 1)
    assert sorted({p["tokens"] for p in prof.meta["points"]}) == prof.n
    assert all(t > 0 for t in prof.t)


def test_profile_step_warms_up_each_shape(debug_model, one_thread, monkeypatch):
    """The first run of every (batch, verify) shape is not timed into the profile: a warm-up that costs 100 s
    leaves no trace; the rounds visit every shape in turn (plain decode and V = 0..G)."""
    from dsv41.engine.speculative import profile as prof_mod
    cfg, m = debug_model
    G = cfg.dspark_block_size
    seen: list[int] = []

    def fake_timed(fn, device):
        fn()
        seen.append(len(seen))
        return 100.0 if len(seen) <= G + 2 else 1.0 + 0.01 * len(seen)
    monkeypatch.setattr(prof_mod, "timed", fake_timed)
    prof = profile_step(m, batches=(1,), context=20, repeats=2, log=lambda *a: None)
    assert len(seen) == 3 * (G + 2)                                  # 1 warm-up + 2 rounds per shape
    pts = prof.meta["points"] + prof.meta["plain"]
    assert len(pts) == G + 2
    assert max(max(p["samples"]) for p in pts) < 2.0
    assert all(len(p["samples"]) == 2 for p in pts)


def test_step_profile_never_cheaper_with_more_tokens():
    """A dip between measured points is pooled with its neighbours (weighted by their repeats); a monotone series
    is unchanged."""
    from dsv41.engine.speculative.profile import non_decreasing
    prof = StepProfile([1, 2, 3, 4], [1.0, 3.0, 1.0, 4.0])
    assert prof.t == [1.0, 2.0, 2.0, 4.0]
    assert all(prof(n) <= prof(n + 1) for n in range(1, 8))
    assert non_decreasing([1.0, 3.0, 1.0], [1, 1, 2]) == [1.0, pytest.approx(5 / 3), pytest.approx(5 / 3)]
    assert non_decreasing([1.0, 2.0, 5.0], [1, 1, 1]) == [1.0, 2.0, 5.0]


# ------------------------------------------------------------------------------------------------ CLI / server

def test_auto_speculation_follows_the_checkpoint(tmp_path, debug_model):
    import json

    from dsv41.engine.speculative.policy import has_trained_drafter, resolve_speculation
    cfg, m = debug_model
    assert not has_trained_drafter(tmp_path) and not has_trained_drafter(None)
    assert resolve_speculation(m, tmp_path, "auto")[0].mode == "off"
    (tmp_path / "summary.json").write_text(json.dumps({"stage": "dspark"}))
    StepProfile([1, 4], [0.1, 0.2]).save(tmp_path / "step_profile.json")
    spec, prof = resolve_speculation(m, tmp_path, "auto", log=lambda *a: None)
    assert spec.mode == "dspark" and spec.online and prof(4) == 0.2          # the calibrated scheduler
    assert resolve_speculation(m, tmp_path, "fixed:2", log=lambda *a: None) == (Speculation("fixed", 2), None)


def test_server_reports_drafted_and_accepted_tokens(tmp_path):
    from tests.test_server_fixtures import make_checkpoint, openai_client, running_server
    ckpt = make_checkpoint(tmp_path / "ckpt")
    outs = {}
    for spec in ("off", "fixed:2"):
        with running_server(ckpt, speculative=spec) as (handle, app):
            r = openai_client(handle).completions.create(model="dbg", prompt="def f(x):", max_tokens=10,
                                                         temperature=0, extra_body={"ignore_eos": True})
            outs[spec] = (r.choices[0].text, r.usage)
    assert outs["off"][0] == outs["fixed:2"][0]
    d = outs["fixed:2"][1].completion_tokens_details
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
    assert outs["off"][1].completion_tokens_details.rejected_prediction_tokens == 0


class CountingDrafter:
    """Wrong drafts (the pending token + 1 repeated) with an over-confident head; counts its proposals."""

    def __init__(self, G: int, vocab: int):
        self.G, self.vocab, self.proposals = G, vocab, 0

    def seed(self, *args, **kwargs):
        pass

    def propose(self, view, seqs, pos) -> Proposal:
        self.proposals += 1
        rows = [[(s.pending + 1) % self.vocab] * self.G for s in seqs]
        return Proposal(torch.tensor(rows), [None] * len(seqs), torch.full((len(seqs), self.G), 0.9))


def test_scheduler_stops_drafting_when_it_does_not_pay(debug_model, one_thread):
    """Once the verified drafts show that no verify length pays, dspark decodes without proposing (probing every
    PROBE_EVERY-th step); a drafter whose drafts are accepted keeps drafting every step; outputs stay greedy's."""
    from dsv41.engine.engine import MIN_EVIDENCE, PROBE_EVERY
    cfg, m = debug_model
    G = cfg.dspark_block_size
    prompts = _prompts(cfg.vocab_size, (5,))
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    want = [c.output_ids for c in Engine(m, prefill_mode="full", max_seq_len=256).generate(prompts, params)]
    prof = StepProfile([1, 1 + G], [1.0, 1.2])
    eng = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark", step_profile=prof)
    eng.drafter = CountingDrafter(G, cfg.vocab_size)
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == want
    steps = got[0].stats["speculative"]["target_forwards"]
    assert steps >= params.max_tokens - 1                             # nothing accepted: a forward per token
    skipped = steps - eng.drafter.proposals
    assert eng.drafter.proposals >= MIN_EVIDENCE
    assert skipped >= (steps - MIN_EVIDENCE) * (PROBE_EVERY - 1) // PROBE_EVERY - 1, (steps, eng.drafter.proposals)
    good = Engine(m, prefill_mode="full", max_seq_len=256, speculative="dspark", step_profile=prof)
    good.drafter = OracleDrafter({"req-0": want[0]}, G, cfg.vocab_size, wrong=7)
    calls = itertools.count()
    inner = good.drafter.propose
    good.drafter.propose = lambda *a: (next(calls), inner(*a))[1]
    decisions = []                                 # (drafted, drafts that could still be emitted) per step
    inner_pays = good._drafting_pays

    def pays(live, drafts):
        r = inner_pays(live, drafts)
        decisions.append((r, max(s.params.max_tokens - len(s.output_ids) - 1 for s in live)))
        return r
    good._drafting_pays = pays
    res = good.generate(prompts, params)
    assert [c.output_ids for c in res] == want
    assert len(decisions) == res[0].stats["speculative"]["target_forwards"]
    assert all(r for r, room in decisions if room > 0)      # drafted at every step where a draft could be emitted
    assert next(calls) == sum(r for r, _ in decisions)
