"""RL credit assignment (dsv41/posttrain/rl.py, `--credit`): under "split" the plan letter carries the full
advantage (score + length term), the trace and answer the score-only one, the echo is out of the loss; the default
("all") is the advantage of every response token as before; the advantage mass logged per band and plan."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.rl import (LengthReward, RLConfig, RLRun, advantage_mass, batch_tensors, group_advantages,
                                head_positions, policy_loss, rewards_of, scores_of, split_credit)
from dsv41.posttrain.rollout import Rollout
from dsv41.posttrain.sft import TaskMix
from dsv41.posttrain.tokenizer import load_post_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


def scripted(tok):
    """One sums problem (n = 4) at b = 1 and b = 100, two samples each: (plan, correct?) per sample."""
    p = T.make_sums(random.Random(5), 4)
    plans = [(1, "S", False), (1, "L", True), (100, "S", False), (100, "L", True)]
    rs = []
    for b, plan, ok in plans:
        ids = T.response_ids(tok, p, T.plan_stride(p, plan), T.plan_head(b, plan, echo=True))
        if not ok:                                          # a wrong answer: replace the answer digit
            k = ids.index(tok.think_end_id)
            ids[k + 1] = tok.tok.token_to_id(str((int(p.answer) + 1) % 10))
        rs.append(Rollout(p, b, [0, 5], ids, [0.0] * len(ids), T.check(tok, p, ids)))
    return rs


def config(credit="all", norm=False):
    return RLConfig(credit=credit, adv_norm=norm, mix=TaskMix(levels=(1, 100)),
                    length=LengthReward(k0=3.0, c_max=2.0, levels=(1, 100), delta_b=24.75))


def bare_run(tok, cfg):
    run = RLRun.__new__(RLRun)                  # no checkpoint: only what advantages() reads
    run.cfg, run.tok = cfg, tok
    return run


def test_head_positions(tok):
    p = T.make_sums(random.Random(1), 3)
    both = T.response_ids(tok, p, 1, T.plan_head(50, "L", echo=True))
    assert head_positions(tok, both) == (1, [0])
    assert head_positions(tok, T.response_ids(tok, p, 3, T.plan_head(50, "S", echo=False))) == (0, [])
    assert head_positions(tok, T.response_ids(tok, p, 1)) == (None, [])          # no head
    echo_only = T.response_ids(tok, p, 1, T.effort_band(50))
    assert head_positions(tok, echo_only) == (None, [0])


def test_split_credit_per_token_advantages_and_gradient(tok):
    rs = scripted(tok)
    assert [r.verdict.correct for r in rs] == [False, True, False, True]
    cfg = config("split")
    rewards = rewards_of(rs, cfg.length)
    keys = [(r.problem.content, r.effort) for r in rs]
    full, score = group_advantages(rewards, keys), group_advantages(scores_of(rs), keys)
    assert score == [-0.5, 0.5, -0.5, 0.5]
    # at b = 1 the full trace costs more than its correct answer gains (C_max 2): L's full advantage is negative
    assert full[1] < 0 < full[0] and full[3] > 0 > full[2]
    adv, masks = split_credit(tok, rs, full, score)
    for r, a, m, af, as_ in zip(rs, adv, masks, full, score):
        assert len(a) == len(m) == len(r.output_ids)
        assert m[0] == 0.0 and a[0] == 0.0                    # the echo: out of the loss
        assert a[1] == pytest.approx(af) and m[1] == 1.0      # the plan letter: the full advantage
        assert all(x == pytest.approx(as_) for x in a[2:]) and all(x == 1.0 for x in m[2:])   # score-only
    # the gradient of the token-level loss, on-policy: -adv / n at every training token, 0 at the echo
    ids, mu, a_t, mask = batch_tensors(rs, adv, tok.pad_id, masks)
    assert a_t.shape == mask.shape == mu.shape
    lp = mu.clone().requires_grad_()
    loss, _ = policy_loss(lp, mu, mu, a_t, mask, clip=0.2, cap=2.0)
    loss.backward()
    n = sum(len(r.output_ids) - 1 for r in rs)
    for i, r in enumerate(rs):
        s = len(r.prompt_ids) - 1
        g = lp.grad[i, s:s + len(r.output_ids)]
        assert g[0] == 0
        assert g[1].item() == pytest.approx(-full[i] / n, rel=1e-5)
        assert torch.allclose(g[2:], torch.full_like(g[2:], -score[i] / n))
        assert not lp.grad[i, s + len(r.output_ids):].any() and not lp.grad[i, :s].any()


def test_default_credit_is_unchanged(tok):
    rs = scripted(tok)
    cfg = config()
    assert RLConfig().credit == "all"
    rewards = rewards_of(rs, cfg.length)
    adv, masks, mass = bare_run(tok, cfg).advantages(rs, rewards, None)
    keys = [(r.problem.content, r.effort) for r in rs]
    assert adv == group_advantages(rewards, keys) and masks is None       # one number per response, no mask
    ids, mu, a_t, mask = batch_tensors(rs, adv, tok.pad_id, masks)
    assert a_t.shape == (len(rs), 1) and torch.equal(a_t[:, 0], torch.tensor(adv, dtype=torch.float32))
    # the staleness masks of the dispatcher pass through unchanged
    stale = [[1.0] * (len(r.output_ids) - 1) + [0.0] for r in rs]
    assert bare_run(tok, cfg).advantages(rs, rewards, stale)[1] is stale
    # split: the staleness mask times the head mask
    adv_s, masks_s, _ = bare_run(tok, config("split")).advantages(rs, rewards, stale)
    assert all(m[0] == 0.0 and m[-1] == 0.0 and m[1] == 1.0 for m in masks_s)
    with pytest.raises(ValueError):
        RLRun(RLConfig(credit="plan"))


def test_advantage_mass_per_band_and_plan(tok):
    rs = scripted(tok)
    cfg = config()
    rewards = rewards_of(rs, cfg.length)
    keys = [(r.problem.content, r.effort) for r in rs]
    full, score = group_advantages(rewards, keys), group_advantages(scores_of(rs), keys)
    _, _, mass = bare_run(tok, cfg).advantages(rs, rewards, None)
    assert set(mass) == {"b1", "b100"} and set(mass["b1"]) == {"S", "L"}
    c = mass["b1"]["L"]
    assert c["n"] == 1 and c["plan"] == pytest.approx(full[1], abs=1e-4) and c["abs"] == pytest.approx(abs(full[1]),
                                                                                                      abs=1e-4)
    assert c["len"] == pytest.approx(full[1] - score[1], abs=1e-4)
    assert c["trace"] == pytest.approx(full[1] * (len(rs[1].output_ids) - 2), abs=1e-3)   # every token after the head
    _, _, mass_s = bare_run(tok, config("split")).advantages(rs, rewards, None)
    assert mass_s["b1"]["L"]["plan"] == c["plan"]                          # the plan letter's: the same
    assert mass_s["b1"]["L"]["trace"] == pytest.approx(score[1] * (len(rs[1].output_ids) - 2), abs=1e-3)
    # normalised: each of the two advantages by its own subgroup's std
    adv_n, _, _ = bare_run(tok, config("split", norm=True)).advantages(rs, rewards, None)
    assert adv_n[1][1] == pytest.approx(group_advantages(rewards, keys, True)[1])
    assert adv_n[1][2] == pytest.approx(group_advantages(scores_of(rs), keys, True)[1])


def test_cli_credit_option():
    import argparse

    from dsv41.posttrain.cli import register
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    assert ap.parse_args(["posttrain", "rl"]).credit == "all"
    assert ap.parse_args(["posttrain", "rl", "--credit", "split"]).credit == "split"
    with pytest.raises(SystemExit):
        ap.parse_args(["posttrain", "rl", "--credit", "nope"])


def test_pipeline_recipe_fills_the_flags_left_at_their_defaults():
    """`posttrain all` runs the controllable-effort recipe (cli.PIPELINE) on every flag the user left at its
    default, keeps any flag given explicitly, and shares `--minutes` (the total) out over the stages."""
    from dsv41.cli import build_parser
    from dsv41.posttrain import cli as C
    ap = build_parser()
    a = ap.parse_args(["posttrain", "all"])
    assert C.apply_pipeline(a) == 1.0
    assert (a.constrain, a.dispatch, a.credit, a.echo, a.plan, a.echo_size, a.merge_top_band) == \
        ("sml", "sync", "split", True, True, True, True)
    assert a.levels == "1-100" and a.hold_out == "12,37,62,87" and a.plan_entropy == 0.1
    b = ap.parse_args(["posttrain", "all", "--credit", "decision", "--k0", "2.5", "--minutes", "10"])
    assert C.apply_pipeline(b) == 0.5
    assert b.credit == "decision" and b.k0 == 2.5 and b.constrain == "sml"
    assert sum(C.PIPELINE_MINUTES.values()) < C.PIPELINE_TOTAL
    c = ap.parse_args(["posttrain", "rl"])               # a single stage keeps the parser's defaults
    assert c.constrain == "" and c.dispatch == "sample" and not c.echo
