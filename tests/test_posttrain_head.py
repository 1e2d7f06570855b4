"""The reasoning head's second form (2026-12-06e): the band letter with b = 100 merged into J (`--merge-top-band`),
the chain length n as a digit after it (`--echo-size`), and RL's credit "decision" (a response that leaves the
plan letter out gives the full advantage to the token it wrote in its place). Defaults unchanged."""

from __future__ import annotations

import random
import tempfile

import pytest

from dsv41.posttrain import tasks as T
from dsv41.posttrain.cli import parse_levels
from dsv41.posttrain.rl import decision_position, group_advantages, head_positions, rewards_of, scores_of, \
    split_credit, LengthReward
from dsv41.posttrain.rollout import Rollout
from dsv41.posttrain.sft import TaskMix, sft_example
from dsv41.posttrain.tokenizer import load_post_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_post_tokenizer(tempfile.mkdtemp())


def test_merged_top_band_and_size_digit():
    assert [T.effort_band(b, merge_top=True) for b in (1, 10, 89, 90, 99, 100)] == ["A", "B", "I", "J", "J", "J"]
    assert T.effort_band(100) == "K"                           # the default keeps b = 100's own letter
    assert T.plan_head(100, "L", True, 4, True) == "J4L"
    assert T.plan_head(37, "S", True, 2) == "D2S"
    assert T.plan_head(37, "M", True) == "DM"                  # no size: the first form
    with pytest.raises(ValueError):
        T.plan_head(50, "L", True, 10)                         # n must be one digit


def test_sft_size_echo_is_the_chain_length(tok):
    mix = TaskMix(levels=parse_levels("1-100", "12,37,62,87"))
    rng = random.Random(4)
    think = tok.think_start_id
    seen = set()
    for _ in range(300):
        ids, tg = sft_example(rng, tok, mix, 0.5, None, echo=True, plan=True, echo_size=True, merge_top=True)
        resp = [t for t in tg if t != -100]
        text = tok.decode(ids[:ids.index(think)])
        content = text[text.index("sum "):] if "sum " in text else text[text.index("chase "):]
        content = content.split("<")[0].strip()
        n = len(content.split()) - 1 if content.startswith("sum") else int(content.split()[-1])
        head = tok.decode(resp[:3])
        assert head[0] in T.BANDS[:10] and head[1] == str(n) and head[2] in T.PLANS
        seen.add((head[0], n))
    assert {n for _, n in seen} == {2, 3, 4, 5, 6} and "J" in {h for h, _ in seen}
    for merge, letter in ((True, "J"), (False, "K")):          # b = 100: J merged, K by default
        ids, tg = sft_example(rng, tok, TaskMix(levels=(100,)), 0.5, None, True, True, True, merge)
        assert tok.decode([t for t in tg if t != -100][:1]) == letter


def response(tok, p, b, plan, size=True, correct=True):
    ids = T.response_ids(tok, p, T.plan_stride(p, plan or "L"), T.plan_head(b, plan, True,
                                                                             p.difficulty if size else None, True))
    if not correct:
        k = ids.index(tok.think_end_id)
        ids[k + 1] = tok.tok.token_to_id(str((int(p.answer) + 1) % 10))
    return ids


def test_head_positions_with_the_size_digit(tok):
    p = T.make_sums(random.Random(1), 4)
    assert head_positions(tok, response(tok, p, 50, "L")) == (2, [0, 1])
    assert T.opened_plan(tok, response(tok, p, 50, "M")) == "M"
    no_plan = response(tok, p, 50, None)                        # band, size, then the trace
    assert head_positions(tok, no_plan) == (None, [0, 1]) and decision_position(tok, no_plan) == 2
    assert T.opened_plan(tok, no_plan) is None
    # the first form still parses as before
    assert head_positions(tok, response(tok, p, 50, "L", size=False)) == (1, [0])
    assert decision_position(tok, T.response_ids(tok, p, 1)) == 0            # no head at all: token 0
    assert decision_position(tok, []) is None


def test_decision_credit_charges_the_missing_plan_letter(tok):
    p = T.make_sums(random.Random(5), 4)
    rows = [(1, "S", False), (1, None, True), (1, "S", False), (1, None, True)]
    rs = [Rollout(p, b, [0, 5], ids, [0.0] * len(ids), T.check(tok, p, ids))
          for b, plan, ok in rows for ids in [response(tok, p, b, plan, correct=ok)]]
    length = LengthReward(k0=3.0, c_max=2.0, levels=(1, 100), delta_b=24.75)
    keys = [(r.problem.content, r.effort) for r in rs]
    full = group_advantages(rewards_of(rs, length), keys)
    score = group_advantages(scores_of(rs), keys)
    assert full[1] < 0 < score[1]       # at b = 1 the long no-plan trace: right, but its length costs more
    split, _ = split_credit(tok, rs, full, score)
    dec, masks = split_credit(tok, rs, full, score, decision=True)
    for i in (1, 3):                    # no plan letter: split gives it no length credit, decision does at token 2
        assert all(a == pytest.approx(score[i]) for a in split[i][2:])
        assert dec[i][2] == pytest.approx(full[i]) and all(a == pytest.approx(score[i]) for a in dec[i][3:])
        assert masks[i][:2] == [0.0, 0.0] and dec[i][:2] == [0.0, 0.0]     # band and size digit out of the loss
    for i in (0, 2):                    # with a plan letter both credits are the same
        assert dec[i] == split[i] and dec[i][2] == pytest.approx(full[i])


def test_eval_batch_changes_no_response(tok):
    """`posttrain eval --eval-batch`: the engine's deterministic mode makes each response independent of which
    requests share its batch, greedy and sampled (a random-init post model: its responses are long and varied)."""
    from dsv41.posttrain.model import build_model
    from dsv41.posttrain.rollout import evaluate
    model = build_model(tok, 0)
    model.eval()
    problems = [T.make_sums(random.Random(i), 2 + i % 5) for i in range(4)]
    for temperature in (0.0, 1.0):
        small = evaluate(model, tok, problems, (50,), 10, temperature, batch=2)
        large = evaluate(model, tok, problems, (50,), 10, temperature, batch=16)
        assert small == large
