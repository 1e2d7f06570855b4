"""SFT batches, RL with controllable effort (length term, subgroup advantages, the clipped token-level loss with
truncated importance weights), rollouts and the dispatcher on the real engine in the deterministic mode, and
on-policy distillation's reverse KL (dsv41/posttrain/)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.dispatch import DispatchConfig, Dispatcher, EngineBackend, Group, Sample
from dsv41.posttrain.model import build_model
from dsv41.posttrain.opd import (DenseTeacher, SolverTeacher, opd_loss, reverse_kl, reverse_kl_grad)
from dsv41.posttrain.rl import LengthReward, RLConfig, group_advantages, policy_loss, train_step
from dsv41.posttrain.rollout import affine_fit, make_engine, rollouts, sign_test
from dsv41.posttrain.sft import IGNORE, TaskMix, sft_batch, sft_loss
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.train.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=3).eval()


def items(n, seed=0):
    rng = random.Random(seed)
    return [(T.sample_problem(rng, T.FAMILIES[i % 2], 2, 4), [1, 100][i % 2], rng.randrange(10 ** 6)) for i in range(n)]


def test_sft_batch_is_a_function_of_seed_and_step_and_masks_the_prompt(tok):
    mix = TaskMix()
    a, b = sft_batch(0, 5, tok, mix, 8), sft_batch(0, 5, tok, mix, 8)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], sft_batch(0, 6, tok, mix, 8)[0])
    ids, tg = a
    for i in range(ids.size(0)):
        think = (ids[i] == tok.think_start_id).nonzero()[0, 0]
        assert (tg[i, :think] == IGNORE).all() and tg[i, think] != IGNORE      # the first response token trains
        assert tok.think_end_id in tg[i].tolist() and tok.eos_id in tg[i].tolist()


def test_sft_full_trace_share_and_the_indexer_objective(tok, model):
    mix = TaskMix(lo=4, hi=6)

    def strides(full):                      # reasoning tokens vs each problem's stride-1 length
        ids, tg = sft_batch(0, 1, tok, mix, 64, full_trace=full)
        out = []
        for row in tg.tolist():
            resp = [t for t in row if t != IGNORE]
            out.append(resp.index(tok.think_end_id))
        return out
    full_lengths = set(strides(1.0))
    assert 0 not in full_lengths and min(full_lengths) >= 7            # every example the longest trace
    assert 0 in strides(0.0)                                           # stride n (empty) drawn too
    only_sums = sft_batch(0, 1, tok, mix, 32, 0.5, weights=(1.0, 0.0))[0]
    assert all(" ".join(tok.decode(r.tolist()).split("sum ")[1:]) for r in only_sums)   # every row a sums prompt
    ids, tg = sft_batch(0, 2, tok, TaskMix(lo=2, hi=4), 2, 0.5)
    model.zero_grad(set_to_none=True)
    ce, total = sft_loss(model, ids, tg, 0.0)
    assert torch.equal(ce, total)
    ce.backward()
    idx = [p for n, p in model.named_parameters() if ".indexer." in n]
    assert idx and all(p.grad is None or not p.grad.any() for p in idx)   # the cross-entropy leaves them
    model.zero_grad(set_to_none=True)
    ce2, total = sft_loss(model, ids, tg, 1.0)
    assert torch.equal(ce2, ce) and total > ce                         # same forward, plus the objective
    total.backward()
    assert any(p.grad is not None and p.grad.any() for p in idx)       # the objective trains them
    model.zero_grad(set_to_none=True)


def test_length_reward_and_subgroup_advantages():
    lr = LengthReward(k0=0.5, c_max=0.4, l_norm=10.0, lam=2.0, levels=(1, 25, 50, 75, 100))
    assert lr.tau == pytest.approx(2.0 * 99 / 4)
    assert lr(10, 1) == pytest.approx(-0.4)                              # capped at C_max
    assert lr(4, 50) == pytest.approx(-0.5 * math.exp(-49 / lr.tau) * 0.4)
    assert lr(4, 100) > lr(4, 50) > lr(4, 25) and lr(0, 1) == 0
    rewards = [1.0, 0.0, 1.0, 1.0, 5.0, 7.0]
    keys = [("x", 1), ("x", 1), ("x", 100), ("x", 100), ("y", 1), ("y", 1)]
    assert group_advantages(rewards, keys) == [0.5, -0.5, 0.0, 0.0, -1.0, 1.0]   # never across levels


def test_policy_loss_gradient_weights_and_clipping():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g)).requires_grad_()
    old = lp.detach() + torch.tensor([[0.0] * 5, [0.0] * 5, [-0.5] * 5])     # row 2: ratio e^0.5 > 1 + clip, A > 0: clipped
    mu = old - torch.log(torch.tensor([[1.0], [1.5], [4.0]]))                # weights 1, 1.5, capped at 2
    adv, mask = torch.tensor([[1.0], [-2.0], [1.0]]), torch.ones(3, 5)
    mask[0, 4] = 0
    loss, st = policy_loss(lp, old, mu, adv, mask, clip=0.2, cap=2.0)
    loss.backward()
    n = mask.sum()
    assert torch.allclose(lp.grad[0, :4], torch.full((4,), -1.0 / n)) and lp.grad[0, 4] == 0
    assert torch.allclose(lp.grad[1], torch.full((5,), 1.5 * 2.0 / n))
    assert torch.equal(lp.grad[2], torch.zeros(5))                           # clipped: no gradient
    assert st["clipped"] == pytest.approx(5 / 14)


def test_rollout_behaviour_logprobs_are_the_training_forward(tok, model):
    eng = make_engine(model, tok)
    rs = rollouts(eng, tok, items(6), max_tokens=10)
    rows = [r.prompt_ids + r.output_ids for r in rs]
    ids = torch.tensor([x + [tok.pad_id] * (max(map(len, rows)) - len(x)) for x in rows])
    lp = token_logprobs(model, ids)
    for i, r in enumerate(rs):
        a = len(r.prompt_ids) - 1
        assert lp[i, a:a + len(r.output_ids)].tolist() == r.behaviour_lp               # bit for bit
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    st = train_step(model, opt, rs, [1.0, -1.0] * 3, RLConfig(), tok.pad_id)
    assert st["tis_mean"] == 1.0 and st["clipped"] == 0.0                   # on-policy: the weights are exactly 1


def _samples(gid, prompts):
    return Group(gid, "d", [Sample(f"g{gid}s{j}", p, s) for j, (p, s) in enumerate(prompts)])


def test_dispatcher_on_the_engine_resumes_bit_identically_without_prefill(tok, model):
    its = items(8, seed=5)
    reqs = [(T.prompt_ids(tok, p, b), s) for p, b, s in its]
    eng = make_engine(model, tok, max_batch=4)
    limit = [4, 12, 7, 3, 12, 5, 9, 2]                      # staggered finishes: samples cross weight switches
    straight = [rollouts(eng, tok, [it], max_tokens=n)[0] for it, n in zip(its, limit)]
    prefills = []
    orig = eng._admit
    eng._admit = lambda seqs: prefills.extend(s.request_id for s in seqs) or orig(seqs)
    versions = []
    d = Dispatcher(EngineBackend(eng, tok, lambda sid: limit[2 * int(sid[1]) + int(sid[3])]), iter([_samples(g, reqs[2 * g:2 * g + 2]) for g in range(4)]),
                   lambda gs, ms: versions.append(len(gs)), DispatchConfig(train_groups=1, max_staleness=10))
    d.run(4)
    samples = [d.by_sid[f"g{g}s{j}"] for g in range(4) for j in range(2)]
    assert d.version == 4 and any(len(set(s.versions)) > 1 for s in samples)   # sampling crossed weight switches
    assert sorted(prefills) == sorted(s.sid for s in samples)                   # admitted (prefilled) once each
    for s, r in zip(samples, straight):
        assert s.tokens == r.output_ids and s.logprobs == r.behaviour_lp       # bit for bit


def test_reverse_kl_gradient_is_the_closed_form():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, 11, generator=g).requires_grad_()
    t = torch.log_softmax(torch.randn(6, 11, generator=g), -1)
    kl = reverse_kl(z, t)
    assert (kl >= 0).all()
    kl.sum().backward()
    assert torch.allclose(z.grad, reverse_kl_grad(z.detach(), t), atol=1e-6)
    assert reverse_kl(t, t).abs().max() < 1e-6


def test_solver_teacher_distribution(tok):
    p = T.make_sums(random.Random(2), 4)
    teacher = SolverTeacher(tok, eps=0.01)
    good = T.response_ids(tok, p, 1)
    lp = teacher.logprobs(p, good)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(len(good)), atol=1e-5)
    assert all(lp[t, good[t]] >= math.log(0.99 / 4) for t in range(len(good)))    # a valid path keeps its mass
    assert all(lp[t].argmax() == good[t] for t in range(3, len(good)))        # after `a3=`, the stride is known
    first = {T.response_ids(tok, p, s)[0] for s in range(1, 5)}
    assert set(lp[0].exp().topk(len(first)).indices.tolist()) == first        # every stride may start
    end = tok.think_end_id                                                    # stride 4 = n: the empty trace
    assert lp[0, end].exp() == pytest.approx(0.99 * 0.2 / 4 + 0.01 / tok.vocab_size, rel=1e-5)   # the SFT prior
    even = SolverTeacher(tok, eps=0.01, full_trace=0.0).logprobs(p, good)
    assert even[0, end].exp() == pytest.approx(0.99 / 4 + 0.01 / tok.vocab_size, rel=1e-5)
    wrong = list(good)
    wrong[3] = tok.encode("9")[0] if good[3] != tok.encode("9")[0] else tok.encode("8")[0]   # a wrong partial
    assert teacher.logprobs(p, wrong)[4].argmax() == good[4]                  # off the path: it steers back


def test_opd_loss_trains_the_student_and_dense_teacher_shapes(tok, model):
    dense = DenseTeacher(tok.vocab_size, dim=32, layers=1, heads=2)
    eng = make_engine(model, tok)
    rs = rollouts(eng, tok, items(4, seed=9), max_tokens=8)
    out = dense.logprobs(rs[1].problem, rs[1].output_ids, rs[1].prompt_ids)
    assert out.shape == (len(rs[1].output_ids), tok.vocab_size)
    model.train()
    try:
        loss = opd_loss(model, rs, {"sums": SolverTeacher(tok), "chase": dense}, tok.pad_id)
        loss.backward()
        assert loss > 0 and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_statistics():
    fit = affine_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(1) and fit["r2"] == pytest.approx(1)
    st = sign_test([0, 0, 0, 0, 1], [1, 1, 1, 1, 1])
    assert st["improved"] == 4 and st["p_one_sided"] == pytest.approx(1 / 16)


def test_eval_plot_from_a_report(tmp_path):
    from dsv41.posttrain.report import plot_eval
    from dsv41.posttrain.rollout import summarize
    res = {b: {"correct": [1, 0, 1, 1], "length": [b // 10, b // 5, 3, 1], "difficulty": [2, 3, 2, 3],
               "family": ["sums"] * 4} for b in (1, 50, 100)}
    rep = {"checkpoint": "a", **summarize(res), "baseline": {"checkpoint": "b", **summarize(res)}}
    assert rep["levels"][100]["mean_length"] > rep["levels"][1]["mean_length"]
    out = plot_eval(rep, tmp_path / "eval.png")
    assert out.stat().st_size > 1000


def test_sampled_evaluation_is_reproducible_and_greedy_is_the_default(tok, model):
    from dsv41.posttrain.rollout import evaluate
    rng = random.Random(5)
    probs = [T.sample_problem(rng, T.FAMILIES[i % 2], 2, 3) for i in range(3)]
    g1, g2 = evaluate(model, tok, probs, (1, 100), 8), evaluate(model, tok, probs, (1, 100), 8, temperature=0.0)
    assert g1 == g2                                                     # temperature 0 is the greedy default
    s1, s2 = (evaluate(model, tok, probs, (1, 100), 8, temperature=1.0) for _ in range(2))
    assert s1 == s2                                                     # one seed per (problem, level)
    assert set(s1) == {1, 100} and all(len(s1[b]["length"]) == 3 for b in s1)


def test_a_slice_of_the_evaluation_answers_as_inside_the_whole_and_workers_join_in_order(tok, model, tmp_path):
    """Sampled evaluation: the seeds follow a problem's index in the whole list (`first`), so a slice evaluated
    alone, and `posttrain eval --eval-workers 2` (spawned processes over a saved checkpoint), equal one process."""
    from dsv41.posttrain.cli import _evaluate_sharded
    from dsv41.posttrain.model import save
    from dsv41.posttrain.rollout import evaluate
    rng = random.Random(11)
    probs = [T.sample_problem(rng, T.FAMILIES[i % 2], 2, 3) for i in range(5)]
    n = T.MAX_TOKENS                                                    # the budget `posttrain eval` uses
    whole = evaluate(model, tok, probs, (1, 100), n, temperature=1.0)
    tail = evaluate(model, tok, probs[2:], (1, 100), n, temperature=1.0, first=2)
    shifted = evaluate(model, tok, probs[2:], (1, 100), n, temperature=1.0)
    for b in (1, 100):
        assert tail[b] == {k: v[2:] for k, v in whole[b].items()}
    assert shifted != tail or all(len(set(whole[b]["length"])) == 1 for b in whole)   # the index moves the seeds
    save(model, tok, tmp_path / "ck", {"stage": "test"})
    assert _evaluate_sharded(str(tmp_path / "ck"), probs, (1, 100), 1.0, 8, "", 2) == whole
