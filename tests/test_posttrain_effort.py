"""Effort-control options of post-training (dsv41/posttrain/): SFT's late diverse-stride phase, dense training
levels with held-out ones (parsing, a few levels per prompt, subgroups kept per (x, b)), the fixed delta_b of the
length term, per-subgroup advantage normalisation, and the level bands of the progress line and plot."""

from __future__ import annotations

import math
import random

import pytest

from dsv41.posttrain import tasks as T
from dsv41.posttrain.cli import parse_levels
from dsv41.posttrain.rl import (LengthReward, RLConfig, band_means, group_advantages, level_bands, prompt_levels,
                                step_items)
from dsv41.posttrain.sft import SFTConfig, TaskMix, run_sft, stride_share


def test_parse_levels_ranges_and_hold_out():
    assert parse_levels("1,25,50,75,100") == (1, 25, 50, 75, 100)
    lv = parse_levels("1-100", "12,37,62,87")
    assert len(lv) == 96 and lv[0] == 1 and lv[-1] == 100
    assert not {12, 37, 62, 87} & set(lv) and {11, 13, 36, 38} <= set(lv)
    assert parse_levels("5-7,1,6") == (1, 5, 6, 7)


def test_sft_late_phase_switches_the_stride_share_at_its_boundary():
    cfg = SFTConfig(steps=100, full_trace=0.8, late_steps=30, late_full_trace=0.1)
    assert [stride_share(cfg, s) for s in (0, 69, 70, 99)] == [0.8, 0.8, 0.1, 0.1]
    assert stride_share(SFTConfig(steps=100), 99) == SFTConfig().full_trace      # no late phase by default
    with pytest.raises(ValueError):
        run_sft(SFTConfig(steps=10, late_steps=11, out="/nonexistent/never-written"))


def test_prompt_levels_all_by_default_without_touching_the_stream():
    levels = parse_levels("1-100", "12,37,62,87")
    a, b = random.Random(5), random.Random(5)
    assert prompt_levels(a, levels, 0) == list(levels)
    assert a.random() == b.random()                  # k = 0 draws nothing: the default run's stream is unchanged
    for seed in range(20):                           # one level from each quarter of the sorted levels
        got = prompt_levels(random.Random(seed), levels, 4)
        assert len(got) == 4 and set(got) <= set(levels)
        assert got[0] <= 25 and 26 <= got[1] <= 50 and 51 <= got[2] <= 75 and got[3] >= 76
    assert len({tuple(prompt_levels(random.Random(s), levels, 4)) for s in range(20)}) > 10


def test_step_items_draw_a_few_levels_per_prompt_with_M_samples_each():
    mix = TaskMix(levels=parse_levels("1-100", "12,37,62,87"))
    cfg = RLConfig(prompts=3, samples=4, levels_per_prompt=5, mix=mix)
    its = step_items(cfg, 7)
    assert len(its) == 3 * 5 * 4
    per_prompt: dict = {}
    for p, b, _ in its:
        per_prompt.setdefault(p.content, []).append(b)
    assert len(per_prompt) == 3
    for bs in per_prompt.values():
        assert len(set(bs)) == 5 and all(bs.count(b) == 4 for b in set(bs))
        assert not {12, 37, 62, 87} & set(bs)
    assert step_items(cfg, 7) == its                 # a pure function of (seed, step)


def test_fixed_delta_b_keeps_the_five_level_length_term_on_a_dense_grid():
    five = LengthReward(k0=4, lam=1.6)
    dense = LengthReward(k0=4, lam=1.6, levels=parse_levels("1-100", "12,37,62,87"), delta_b=24.75)
    assert five.tau == pytest.approx(1.6 * 24.75) == dense.tau
    for b in (1, 37, 100):
        assert dense(20, b) == pytest.approx(five(20, b))
    # without delta_b the dense grid's spacing (~1.04) makes k(b) vanish after a few levels
    assert LengthReward(k0=4, lam=1.6, levels=dense.levels).k(20) < 1e-4


def test_normalised_advantages_stay_within_the_subgroup():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0, 1.0]
    keys = [("x", 1)] * 2 + [("x", 100)] * 2 + [("y", 1)] * 2 + [("y", 100)] * 2
    plain = group_advantages(rewards, keys)
    norm = group_advantages(rewards, keys, norm=True)
    assert plain[:2] == [0.5, -0.5] and norm[0] == pytest.approx(1.0, abs=1e-3)
    assert norm[2:6] == [0.0, 0.0, 0.0, 0.0]          # no variance in the subgroup: no signal, no blow-up
    assert norm[6] == pytest.approx(1.0, abs=1e-3) and norm[7] == pytest.approx(-1.0, abs=1e-3)
    for k in set(keys):
        assert math.isclose(sum(a for a, kk in zip(norm, keys) if kk == k), 0.0, abs_tol=1e-9)


def test_level_bands_group_a_dense_grid_and_weight_by_samples():
    assert level_bands((1, 25, 50, 75, 100)) == [(1, 1), (25, 25), (50, 50), (75, 75), (100, 100)]
    bands = level_bands(parse_levels("1-100", "12,37,62,87"))
    assert bands == [(1, 20), (21, 40), (41, 60), (61, 80), (81, 100)]
    per = {3: {"length": 2.0, "n": 1}, 15: {"length": 5.0, "n": 3}, 99: {"length": 10.0, "n": 2}}
    got = dict(band_means(per, bands, "length"))
    assert got == {(1, 20): pytest.approx(4.25), (81, 100): 10.0}


def test_rl_epochs_take_that_many_optimizer_steps_on_the_same_rollouts(tmp_path):
    import torch

    from dsv41.posttrain.model import build_model
    from dsv41.posttrain.rl import train_step
    from dsv41.posttrain.rollout import make_engine, rollouts
    from dsv41.posttrain.tokenizer import load_post_tokenizer

    tok = load_post_tokenizer(tmp_path)
    model = build_model(tok, seed=3).eval()
    rng = random.Random(0)
    its = [(T.sample_problem(rng, "sums", 2, 3), b, rng.randrange(10 ** 6)) for b in (1, 100, 1, 100)]
    rs = rollouts(make_engine(model, tok), tok, its, max_tokens=6)

    class Counting(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            Counting.steps += 1
            return super().step(closure)

    before = [p.detach().clone() for p in model.parameters()]
    st = train_step(model, Counting(model.parameters(), lr=0.0), rs, [1.0, -1.0, 0.5, -0.5], RLConfig(epochs=3),
                    tok.pad_id)
    assert Counting.steps == 3 and st["tis_mean"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))      # lr 0: nothing moved


def test_k0_controller_holds_the_mean_length():
    from dsv41.posttrain.rl import hold_length, next_k0
    st = hold_length(None, 10.0)
    assert st == {"target": 10.0, "ema": 10.0} and next_k0(4.0, st, 1.0) == 4.0
    short = hold_length(st, 5.0)                      # lengths fell: the penalty eases
    assert short["ema"] == pytest.approx(9.0) and next_k0(4.0, short, 1.0) == pytest.approx(4.0 * math.exp(-0.1))
    long_ = hold_length(st, 15.0)                     # lengths grew: the penalty tightens
    assert next_k0(4.0, long_, 1.0) > 4.0 and next_k0(4.0, long_, 0.0) == 4.0


def test_paired_seeds_share_the_samples_seeds_across_a_prompts_levels():
    mix = TaskMix(levels=(1, 25, 50, 75, 100))
    its = step_items(RLConfig(prompts=2, samples=3, paired_seeds=True, mix=mix), 4)
    by = {}
    for p, b, s in its:
        by.setdefault(p.content, {}).setdefault(b, []).append(s)
    for lv in by.values():
        assert len(lv) == 5 and all(v == lv[1] for v in lv.values()) and len(set(lv[1])) == 3
    un = step_items(RLConfig(prompts=2, samples=3, mix=mix), 4)
    assert len({s for _, _, s in un}) == len(un)                # unpaired: every sample its own seed



def test_plan_heads_fix_the_stride_and_count_as_reasoning(tmp_path):
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    tok = load_post_tokenizer(tmp_path)
    assert [T.effort_band(b) for b in (1, 9, 10, 12, 37, 99, 100)] == ["A", "A", "B", "B", "D", "J", "K"]
    with pytest.raises(ValueError):
        T.effort_band(0)
    with pytest.raises(ValueError):
        T.plan_head(50, "X", True)
    rng = random.Random(3)
    for fam in T.FAMILIES:
        for n in range(2, 7):
            p = T.MAKERS[fam](rng, n)
            lens = {}
            for plan in T.PLANS:
                head = T.plan_head(62, plan, echo=True)
                assert head == "G" + plan
                ids = T.response_ids(tok, p, T.plan_stride(p, plan), head)
                v = T.check(tok, p, ids)
                assert v.correct and v.closed
                lens[plan] = v.reasoning_tokens
            assert lens["S"] == 2                                    # the head alone: the empty trace
            assert lens["S"] < lens["M"] <= lens["L"]
            assert lens["L"] == 2 + len(T.trace(p, 1))
            m = T.trace(p, T.plan_stride(p, "M"))
            assert m.count(" ") == 1                                 # two chunks (n = 2: the full trace)
    assert T.response(p, 1) == T.trace(p, 1) + "</think>" + p.answer   # no head: the default format


def test_sft_plan_is_drawn_independently_of_b_and_the_echo_names_b():
    from dsv41.posttrain.sft import sft_example
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    import tempfile
    tok = load_post_tokenizer(tempfile.mkdtemp())
    mix = TaskMix(levels=parse_levels("1-100", "12,37,62,87"))
    rng = random.Random(0)
    counts = {"lo": {c: 0 for c in T.PLANS}, "hi": {c: 0 for c in T.PLANS}}
    effort_id = tok.tok.token_to_id("Reasoning Effort: ")
    for _ in range(1200):
        ids, tg = sft_example(rng, tok, mix, 0.5, None, echo=True, plan=True)
        k = ids.index(effort_id)
        digits = ""
        while tok.decode([ids[k + 1]]).isdigit():
            digits += tok.decode([ids[k + 1]])
            k += 1
        b = int(digits)
        resp = [t for t in tg if t != -100]
        head = tok.decode(resp[:2])
        assert head[0] == T.effort_band(b) and head[1] in T.PLANS
        counts["lo" if b <= 50 else "hi"][head[1]] += 1
    for side in counts.values():
        tot = sum(side.values())
        assert abs(side["L"] / tot - 0.5) < 0.06 and abs(side["S"] / tot - 0.25) < 0.06
    # off by default: the same stream as before the option existed (no head letters)
    a = sft_example(random.Random(9), tok, mix, 0.5)
    ids, tg = a
    assert tok.decode([t for t in tg if t != -100])[0] not in T.BANDS + T.PLANS


def test_level_stats_count_the_plans_the_responses_opened_with(tmp_path):
    from dsv41.posttrain.rl import level_stats
    from dsv41.posttrain.rollout import Rollout
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    tok = load_post_tokenizer(tmp_path)
    p = T.make_sums(random.Random(2), 4)
    rs = []
    for b, plan in ((1, "S"), (1, "S"), (1, "L"), (1, "M"), (100, "L"), (100, "L")):
        ids = T.response_ids(tok, p, T.plan_stride(p, plan), T.plan_head(b, plan, echo=True))
        rs.append(Rollout(p, b, [0], ids, [0.0] * len(ids), T.check(tok, p, ids)))
    lv = level_stats(rs, [0.0] * len(rs), tok)
    assert lv[1]["plans"] == {"S": 0.5, "M": 0.25, "L": 0.25} and lv[100]["plans"] == {"S": 0, "M": 0, "L": 1.0}
    assert lv[1]["length"] == sum(r.verdict.reasoning_tokens for r in rs[:4]) / 4
    plain = T.response_ids(tok, p, 1)            # no head: no plan shares
    assert "plans" not in level_stats([Rollout(p, 1, [0], plain, [0.0] * len(plain), T.check(tok, p, plain))],
                                      [0.0], tok)[1]


def test_families_option_restricts_the_mix_and_the_rl_prompts():
    import argparse

    from dsv41.posttrain.cli import parse_families, register
    assert parse_families("sums") == ("sums",)
    assert parse_families(" chase, sums ,chase") == ("chase", "sums")
    with pytest.raises(ValueError):
        parse_families(" , ")
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    assert parse_families(ap.parse_args(["posttrain", "rl"]).families) == T.FAMILIES      # default: all
    fams = parse_families(ap.parse_args(["posttrain", "rl", "--families", "sums"]).families)
    with pytest.raises(ValueError):
        TaskMix(families=parse_families("sums,nope")).check()
    cfg = RLConfig(prompts=4, samples=2, mix=TaskMix(families=fams))
    assert {p.family for p, _, _ in step_items(cfg, 3)} == {"sums"}
    assert {p.family for p, _, _ in step_items(RLConfig(prompts=4, samples=2), 3)} == set(T.FAMILIES)
