"""The plan grammar (dsv41/posttrain/constrain.py): the plan letter fixes the trace, and the token mask the engine
samples under is the one the RL loss applies (2026-12-07)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.posttrain import constrain as C
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import build_model
from dsv41.posttrain.rl import RLConfig, decoding_mask, train_step
from dsv41.posttrain.rollout import make_engine, rollouts
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.train.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=5).eval()


def problems(k, seed=0, lo=2, hi=6):
    rng = random.Random(seed)
    return [T.sample_problem(rng, T.FAMILIES[i % 2], lo, hi) for i in range(k)]


def test_template_is_the_trace_with_its_states_open():
    for p in problems(40):
        for j in range(1, p.difficulty + 1):
            slots = C.template(p, j)
            ref = T.trace(p, j)
            assert len(slots) == len(ref)
            states = iter(p.states[min(s + j, p.difficulty) - 1] for s in range(0, p.difficulty, j))
            filled = "".join(next(states) if s is C.HOLE else s for s in slots)
            assert filled == ref
            assert all(ref[i] in C.STATE_CHARS[p.family] for i, s in enumerate(slots) if s is C.HOLE)


def test_plan_sets():
    assert C.plan_letters("sml", 2) == ["S", "M", "L"]
    assert [C.stride_of("sml", c, 5) for c in "SML"] == [5, 3, 1]
    assert C.plan_letters("strides", 2) == ["S", "L"]
    assert C.plan_letters("strides", 6) == ["S", "L", "T", "U", "V", "W"]
    assert C.stride_of("strides", "U", 3) is None and C.stride_of("strides", "U", 4) == 3
    with pytest.raises(ValueError):
        C.stride_of("abc", "S", 3)


@pytest.mark.parametrize("plans", C.PLAN_SETS)
def test_grammar_accepts_the_sft_response_and_forces_all_but_plan_states_and_answer(tok, plans):
    for p in problems(20, seed=1):
        b = 37
        for letter in C.plan_letters(plans, p.difficulty):
            j = C.stride_of(plans, letter, p.difficulty)
            head = T.effort_band(b, merge_top=True) + str(p.difficulty) + letter       # plan_head's form, any letter
            ids = T.response_ids(tok, p, j, head)
            g = C.Grammar(tok, p, b, plans)
            free = []
            for t, x in enumerate(ids):
                allowed = g.allowed(ids[:t])
                assert x in allowed, (p.content, letter, t)
                free.append(len(allowed) > 1)
            # the head's band and n digit and every trace character but the states are forced; EOS is last
            assert free[:3] == [False, False, len(C.plan_letters(plans, p.difficulty)) > 1]
            holes = sum(s is C.HOLE for s in C.template(p, j))
            assert sum(free[3:]) == holes + 1          # the states and the answer
            assert T.check(tok, p, ids).reasoning_tokens == C.response_length(p, j)
            assert g.allowed(ids) == [tok.eos_id]


class Recording(C.Grammar):
    """A Grammar whose engine matchers log the mask of every step they are asked for."""

    def __init__(self, *a, log, **k):
        super().__init__(*a, **k)
        self.log = log

    def start(self):
        m = super().start()
        orig = m.allowed

        def allowed(V, device):
            x = orig(V, device)
            self.log.append(x.clone())
            return x
        m.allowed = allowed
        return m


def test_engine_samples_under_the_mask_the_loss_applies(tok, model):
    """The engine's per-step mask (logged from its matcher) equals the loss's allowed_mask rows for the sampled
    tokens; the behaviour log-probs are the masked ones, equal to the loss's at the same weights; forced tokens
    have log-prob 0; and the masked log-prob is the raw one renormalised over the allowed tokens."""
    eng = make_engine(model, tok, max_batch=8)
    logs = {}

    def grammar(p, b):
        logs[(p.content, b)] = []
        return Recording(tok, p, b, "sml", log=logs[(p.content, b)])
    ps = problems(6, seed=2)
    items = [(p, [1, 100][i % 2], 100 + i) for i, p in enumerate(ps)]
    rs = rollouts(eng, tok, items, T.MAX_TOKENS, temperature=1.0, grammar=grammar)
    V = model.cfg.vocab_size
    for r in rs:
        log = logs[(r.problem.content, r.effort)]
        assert len(log) == len(r.output_ids)
        rows = C.allowed_rows(r.grammar, r.output_ids, V)
        assert torch.equal(torch.stack(log), rows)                     # same mask, step by step
        assert all(rows[t, x] for t, x in enumerate(r.output_ids))     # every sampled token allowed
        assert r.output_ids[-1] == tok.eos_id and T.opened_plan(tok, r.output_ids) in T.PLANS
    rows_ = [r.prompt_ids + r.output_ids for r in rs]
    T_ = max(map(len, rows_))
    ids = torch.tensor([x + [tok.pad_id] * (T_ - len(x)) for x in rows_])
    allowed = decoding_mask(model, rs, T_)
    with torch.no_grad():
        lp = C.masked_token_logprobs(model, ids, allowed)
        raw = token_logprobs(model, ids)
        full = torch.log_softmax(model_logits(model, ids), -1)
    for i, r in enumerate(rs):
        a = len(r.prompt_ids) - 1
        got = lp[i, a:a + len(r.output_ids)]
        assert torch.equal(got, torch.tensor(r.behaviour_lp))          # behaviour = the loss's masked log-probs
        forced = allowed[i, a:a + len(r.output_ids)].sum(-1) == 1
        assert forced.sum() > 0 and (got[forced] == 0).all()
        norm = torch.logsumexp(full[i, a:a + len(r.output_ids)].masked_fill(
            ~allowed[i, a:a + len(r.output_ids)], -torch.inf), -1)
        assert torch.allclose(got, raw[i, a:a + len(r.output_ids)] - norm, atol=1e-5)
    # without a mask, masked_token_logprobs is token_logprobs bit for bit
    assert torch.equal(C.masked_token_logprobs(model, ids[:2]), token_logprobs(model, ids[:2]))


def model_logits(model, ids):
    from dsv41.model.step import ForwardOptions
    from dsv41.train.qat import sequence_forward
    return sequence_forward(model, ids, ForwardOptions()).logits[:, :-1].float()


def test_constrained_update_is_on_policy_and_trains_only_free_tokens(tok):
    """train_step scores constrained rollouts with the mask: the importance weight against the (masked)
    behaviour log-probs is exactly 1 (it would not be if the loss used the raw softmax), and the forced tokens
    contribute no gradient (an advantage on them alone leaves the weights unchanged)."""
    model = build_model(tok, seed=6).eval()
    eng = make_engine(model, tok, max_batch=8)
    ps = problems(4, seed=3, lo=3, hi=5)
    rs = rollouts(eng, tok, [(p, 50, 7 + i) for i, p in enumerate(ps)], T.MAX_TOKENS, temperature=1.0,
                  routes=True, grammar=lambda p, b: C.Grammar(tok, p, b, "sml"))
    cfg = RLConfig(lr=1e-2)
    V = model.cfg.vocab_size
    forced_only = []
    for r in rs:
        rows = C.allowed_rows(r.grammar, r.output_ids, V)
        forced_only.append([1.0 if rows[t].sum() == 1 else 0.0 for t in range(len(r.output_ids))])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = train_step(model, opt, rs, [[1.0] * len(r.output_ids) for r in rs], cfg, tok.pad_id, forced_only)
    assert stats["tis_mean"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # the same update on the free tokens (plan letter, states, answer) does move the weights
    free = [[1.0 - m for m in ms] for ms in forced_only]
    train_step(model, opt, rs, [[1.0] * len(r.output_ids) for r in rs], cfg, tok.pad_id, free)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_plan_entropy_is_the_masked_distributions_and_the_bonus_raises_it(tok):
    """The entropy masked_token_logprobs returns is that of the softmax over the allowed tokens (closed form at
    the plan position: over the valid plan letters; 0 at forced positions), and an update with zero advantages and
    a plan-entropy bonus raises the plan letter's entropy (plan_positions marks the position that draws it)."""
    model = build_model(tok, seed=7).eval()
    eng = make_engine(model, tok, max_batch=8)
    ps = problems(4, seed=4, lo=3, hi=5)
    rs = rollouts(eng, tok, [(p, 20, 11 + i) for i, p in enumerate(ps)], T.MAX_TOKENS, temperature=1.0,
                  routes=True, grammar=lambda p, b: C.Grammar(tok, p, b, "sml"))
    rows_ = [r.prompt_ids + r.output_ids for r in rs]
    T_ = max(map(len, rows_))
    ids = torch.tensor([x + [tok.pad_id] * (T_ - len(x)) for x in rows_])
    allowed = decoding_mask(model, rs, T_)
    at = C.plan_positions(rs, T_)
    assert at.sum() == len(rs)
    with torch.no_grad():
        _, ent = C.masked_token_logprobs(model, ids, allowed, entropy=True)
        logits = model_logits(model, ids)
    letters = [tok.tok.token_to_id(c) for c in "SML"]
    for i, r in enumerate(rs):
        k = int(at[i].nonzero()[0, 0])
        assert r.output_ids[k - len(r.prompt_ids) + 1] in letters     # the position draws the plan letter
        p = torch.softmax(logits[i, k, letters], -1)
        assert torch.allclose(ent[i, k], -(p * p.log()).sum(), atol=1e-5)
        a = len(r.prompt_ids) - 1
        forced = allowed[i, a:a + len(r.output_ids)].sum(-1) == 1
        assert (ent[i, a:a + len(r.output_ids)][forced] == 0).all()

    def plan_entropy():
        with torch.no_grad():
            return float((C.masked_token_logprobs(model, ids, allowed, entropy=True)[1] * at).sum())
    before = plan_entropy()
    cfg = RLConfig(plan_entropy=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)           # one small step along the bonus's gradient
    stats = train_step(model, opt, rs, [0.0] * len(rs), cfg, tok.pad_id)
    assert abs(stats["plan_entropy"] - before / len(rs)) < 1e-5
    assert plan_entropy() > before + 0.05


def test_plan_weight_scales_the_plan_letters_term_alone(tok):
    """RLConfig.plan_weight w multiplies the plan letter's surrogate (and its entropy bonus) by w and leaves every
    other token's term as it was: with advantages on the plan letter alone a plain SGD step moves the weights w
    times the gradient; with advantages on the other tokens alone the gradient is the same at every w."""
    model = build_model(tok, seed=8).eval()
    eng = make_engine(model, tok, max_batch=8)
    ps = problems(4, seed=5, lo=3, hi=5)
    rs = rollouts(eng, tok, [(p, 40, 21 + i) for i, p in enumerate(ps)], T.MAX_TOKENS, temperature=1.0,
                  routes=True, grammar=lambda p, b: C.Grammar(tok, p, b, "sml"))
    T_ = max(len(r.prompt_ids) + len(r.output_ids) for r in rs)
    at = C.plan_positions(rs, T_)
    on_plan = [[float(at[i, len(r.prompt_ids) - 1 + t]) * 1e-3 for t in range(len(r.output_ids))]
               for i, r in enumerate(rs)]
    elsewhere = [[1e-3 - a for a in row] for row in on_plan]

    def delta(adv, w):            # the step's gradient (lr 0 leaves the weights; the norm stays under the clip)
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rs, adv, RLConfig(plan_weight=w), tok.pad_id)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    d1, d4 = delta(on_plan, 1.0), delta(on_plan, 4.0)
    assert d1.abs().max() > 0
    assert torch.allclose(d4, 4.0 * d1, rtol=1e-4, atol=1e-12)
    e1, e4 = delta(elsewhere, 1.0), delta(elsewhere, 4.0)
    assert e1.abs().max() > 0
    assert torch.equal(e4, e1)
    with pytest.raises(ValueError, match="needs --constrain"):
        from dsv41.posttrain.rl import RLRun
        RLRun(RLConfig(plan_weight=2.0))
