"""Data-parallel SFT (`SFTConfig.workers`): the ranks' weighted losses sum to the whole batch's gradient; two
spawned gloo ranks train what one process trains (up to the order of float sums, which Adam's first steps
amplify on near-zero gradients), report the whole batch's loss, and stop together."""

from __future__ import annotations

import json

import pytest
import torch

from dsv41.model.common import set_quantization
from dsv41.posttrain.model import build_model, load
from dsv41.posttrain.sft import SFTConfig, TaskMix, rank_part, run_sft, sft_batch, sft_loss
from dsv41.posttrain.tokenizer import load_post_tokenizer

MIX = TaskMix(levels=(1, 50, 100))


def _grads(model, ids, tg, token_share=1.0, row_share=1.0):
    model.zero_grad(set_to_none=True)
    ce, total = sft_loss(model, ids, tg, 1.0, token_share, row_share)
    total.backward()
    return ce, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("world", [2, 3])
def test_rank_parts_sum_to_the_whole_batch_gradient(tmp_path, world):
    tok = load_post_tokenizer(tmp_path)
    model = build_model(tok, 0).train()
    set_quantization(model, False)
    ids, tg = sft_batch(0, 7, tok, MIX, 7, 0.5, plan=True, echo=True)     # 7 rows: uneven parts
    ce, whole = _grads(model, ids, tg)
    summed, ce_sum = {}, 0.0
    for r in range(world):
        ids_r, tg_r, share, rows = rank_part(ids, tg, r, world)
        assert 0 < share < 1 and rows == ids_r.size(0) / 7
        ce_r, g = _grads(model, ids_r, tg_r, share, rows)
        ce_sum += float(ce_r.detach()) * share
        for n, t in g.items():
            summed[n] = summed[n] + t if n in summed else t
    assert ce_sum == pytest.approx(float(ce.detach()), rel=1e-6)
    assert summed.keys() == whole.keys()
    for n, g in whole.items():
        assert float((summed[n] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-9, n
    _, half = _grads(model, *rank_part(ids, tg, 0, world)[:2])              # unweighted: a different gradient
    assert float((half["embed.weight"] - whole["embed.weight"]).norm()) > 1e-2 * float(whole["embed.weight"].norm())


def _run(tmp_path, name: str, workers: int, steps: int = 3, minutes: float = 10.0):
    cfg = SFTConfig(out=str(tmp_path / name), steps=steps, minutes=minutes, batch=6, quiet=True, workers=workers,
                    mix=MIX, plan=True, echo=True)
    run_sft(cfg, say=lambda *_: None)
    return load(tmp_path / name)


def test_two_workers_train_what_one_process_trains(tmp_path):
    m1, tok, meta1 = _run(tmp_path, "one", 1)
    m2, _, meta2 = _run(tmp_path, "two", 2)
    assert meta1["step"] == meta2["step"] == 3
    assert meta1["losses"] == pytest.approx(meta2["losses"], rel=1e-5)
    fresh = {n: p.detach() for n, p in build_model(tok, 0).named_parameters()}
    p1 = {n: p.detach() for n, p in m1.named_parameters()}
    p2 = {n: p.detach() for n, p in m2.named_parameters()}
    assert p1.keys() == p2.keys()
    for n in p1:
        u1, u2 = p1[n] - fresh[n], p2[n] - fresh[n]
        assert float((u1 - u2).norm()) <= 5e-2 * float(u1.norm()) + 1e-7, n      # the updates, not the weights
    assert sum(float((p1[n] - fresh[n]).norm()) > 0 for n in p1) > len(p1) // 2  # it trained


def test_workers_stop_together_on_the_time_budget_and_are_checked(tmp_path):
    _, _, meta = _run(tmp_path, "budget", 2, steps=1000, minutes=1e-6)
    assert meta["step"] == 1                                     # one step, then every rank stops
    assert json.loads((tmp_path / "budget" / "posttrain.json").read_text())["config"]["workers"] == 2
    with pytest.raises(ValueError, match="workers"):
        run_sft(SFTConfig(out=str(tmp_path / "x"), batch=2, workers=3))
