"""The closing-report helpers of dsv41/posttrain/report.py (adjacent levels' bootstrap intervals, distillation vs RL
at equal sampled tokens, the closing tables from a run directory), per-family accuracy in summarize, the teachers'
greedy responses (opd.py) and the eval cache (cli.py)."""

from __future__ import annotations

import json
import random

import pytest

from dsv41.posttrain import tasks as T
from dsv41.posttrain.opd import SolverTeacher, teacher_greedy
from dsv41.posttrain.report import adjacent_levels, closing, closing_markdown, equal_tokens
from dsv41.posttrain.rollout import summarize
from dsv41.posttrain.tokenizer import load_post_tokenizer


def _res():
    return {b: {"correct": [1, 0, 1, 1, 0, 1], "length": [b // 10 + k for k in range(6)],
                "difficulty": [2, 3, 2, 3, 2, 3], "family": ["sums", "chase"] * 3} for b in (1, 50, 100)}


def test_summarize_accuracy_by_family_and_adjacent_levels():
    rep = summarize(_res())
    assert rep["accuracy_by_family"] == {"chase": pytest.approx(2 / 3), "sums": pytest.approx(2 / 3)}
    assert rep["levels"][1]["accuracy_by_family"]["sums"] == pytest.approx(2 / 3)
    adj = adjacent_levels(rep)
    assert [(a["from"], a["to"]) for a in adj] == [(1, 50), (50, 100)]
    assert all(a["increasing"] for a in adj)
    assert adj[0]["ci_apart"] and adj[1]["ci_apart"]           # lengths 0-5 vs 5-10 vs 10-15: means 2.5, 7.5, 12.5
    rep["levels"][50]["length_ci95"] = [1.0, 13.0]
    assert not any(a["ci_apart"] for a in adjacent_levels(rep))


def test_equal_tokens_stops_at_the_opd_count():
    opd = [{"sampled_tokens": 100, "accuracy": a} for a in (0.1, 0.2, 0.3)]
    rl = [{"sampled_tokens": 50, "levels": {"1": {"accuracy": a}, "100": {"accuracy": a + 0.2}}}
          for a in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)]
    q = equal_tokens(rl, opd, tail=2)
    assert q["opd_tokens"] == 300 and q["rl_steps_to_equal_tokens"] == 6 and q["rl_tokens"] == 300 and q["rl_reached"]
    assert q["rl_sampled_accuracy_tail"] == pytest.approx((0.5 + 0.6) / 2) and q["opd_sampled_accuracy_tail"] == 0.25


def test_solver_teacher_greedy_is_correct(tmp_path):
    tok = load_post_tokenizer(tmp_path / "tok")
    rng = random.Random(4)
    for fam in T.FAMILIES:
        p = T.sample_problem(rng, fam, 2, 5)
        for b in (1, 100):
            out = teacher_greedy(SolverTeacher(tok), tok, p, b, 64)
            assert out[-1] == tok.eos_id and T.check(tok, p, out).correct


def test_closing_from_a_run_directory(tmp_path):
    rep = {"checkpoint": "x", **summarize(_res())}
    rep["baseline"] = {"checkpoint": "y", **summarize(_res())}
    rep["paired"] = rep["paired_by_problem"] = {"improved": 3, "worsened": 1, "p_one_sided": 0.3125}
    for st in ("sft", "rl", "opd", "dspark"):
        (tmp_path / f"post-{st}").mkdir()
    (tmp_path / "post-rl" / "eval.json").write_text(json.dumps(rep))
    hist = [{"step": 1, "elapsed": 3.0, "sampled_tokens": 40, "levels": {"1": {"accuracy": 0.5}}}]
    (tmp_path / "post-rl" / "posttrain.json").write_text(json.dumps(
        {"step": 1, "history": hist, "dispatch": {"granularity": "sample", "occupancy": 0.8}}))
    (tmp_path / "post-rl-batch").mkdir()
    (tmp_path / "post-rl-batch" / "posttrain.json").write_text(json.dumps(
        {"step": 1, "history": hist, "dispatch": {"granularity": "batch", "occupancy": 0.3}}))
    (tmp_path / "post-opd" / "posttrain.json").write_text(json.dumps(
        {"step": 1, "history": [{"step": 1, "sampled_tokens": 30, "accuracy": 0.4}]}))
    (tmp_path / "post-opd" / "opd.json").write_text(json.dumps(
        {"problems": 4, "levels": [1], "families": {"sums": {"teacher": "SolverTeacher", "n": 2, "teacher_accuracy":
                                                             1.0, "student_accuracy": 0.5, "student_pct_of_teacher": 50.0}}}))
    acc = {"all": {"acceptance": [0.5, 0.25], "tokens_per_step": 1.6}}
    (tmp_path / "post-dspark" / "dspark.json").write_text(json.dumps(
        {"checkpoint": "c", "steps": 2, "held_out": 4, "pool": 8, "backbone_unchanged": True,
         "acceptance_before": acc, "acceptance_after": acc}))
    c = closing(tmp_path)
    assert set(c["eval"]) == {"rl"} and c["eval"]["rl"]["paired"]["improved"] == 3
    assert c["occupancy"]["main"]["occupancy"] == 0.8 and c["occupancy"]["batch"]["occupancy"] == 0.3
    assert c["opd_vs_rl_equal_tokens"]["rl_tokens"] == 40
    md = closing_markdown(c)
    assert "| sums | SolverTeacher | 1.000 | 0.500 | 50.0 |" in md and "0.500 0.250" in md


def test_affine_fit_flags_a_flat_line():
    from dsv41.posttrain.rollout import affine_fit
    assert affine_fit([1, 50, 100], [0.0, 0.0, 0.0])["flat"] and not affine_fit([1, 50, 100], [1, 2, 4])["flat"]
    rep = summarize({b: {"correct": [1, 0], "length": [0, 0], "difficulty": [2, 2], "family": ["sums"] * 2}
                     for b in (1, 100)})
    assert "flat (R^2 undefined)" in closing_markdown({"runs": "r", "stages": {}, "eval": {"x": {
        "levels": rep["levels"], "fit_by_difficulty": rep["fit_by_difficulty"], "adjacent_levels": adjacent_levels(rep)}},
        "occupancy": {}})
