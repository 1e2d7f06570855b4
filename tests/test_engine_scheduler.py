"""Guards the engine's scheduler (dsv41.engine.scheduler, docs/system.md §3) in the deterministic mode with
quantization on (the packed pool): under twice more requests than the KV pool holds every request completes, with
the tokens and log-probs of the same request run alone; a long prompt prefills in chunks while the running
streams get a token on every step; no step feeds more than the token budget; the youngest sequence is preempted
and resumes with the same output; the pool's pages never exceed the budget and match the scheduler's count; a
request that can never fit is refused; speculative decoding runs under the scheduler."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.body_batch import forward_plan
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.kv.pages import PoolFull, pages_at
from dsv41.model.init import random_model

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
P = 8                                                   # entries per page: small, so that pages run out


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("debug"), seed=3)   # quantization on: the packed pool


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
            for n in (30, 19, 19, 19, 41, 7, 26, 19)]


def outputs(completions):
    return [(c.output_ids, [lp["logprob"] for lp in c.logprobs]) for c in completions]


@pytest.fixture(scope="module")
def alone(model, prompts):
    return [outputs(Engine(model, max_seq_len=256, deterministic=True).generate([p], PARAMS))[0] for p in prompts]


def counted(eng):
    """Count the tokens each step feeds to the model (every forward and every encoder chunk embeds its tokens)."""
    fed = [0]
    embed = eng.model.embed_tokens

    def counting(ids, *a, **k):
        fed[0] += ids.numel()
        return embed(ids, *a, **k)
    eng.model.embed_tokens = counting
    return fed


def run_steps(eng, check=None):
    """Step to the end; per step: tokens fed, its outputs; `check(eng)` after every step."""
    fed, steps = counted(eng), []
    try:
        while eng.has_unfinished():
            before = fed[0]
            outs = eng.step()
            steps.append((fed[0] - before, outs))
            if check is not None:
                check(eng)
    finally:
        del eng.model.embed_tokens
    return steps


def pages_held(eng) -> int:
    return sum(pages_at(eng.scheduler.ratios, P, eng.pool.seq_bytes(s.sid)["tokens"]) for s in eng.running)


def test_twice_the_pool_completes_with_alone_outputs(model, prompts, alone):
    ratios = [2, 1]
    need = [pages_at(ratios, P, len(p) + PARAMS.max_tokens) for p in prompts]
    kv_pages = sum(need) // 2                            # the pool holds half of the requests at once
    eng = Engine(model, max_seq_len=256, deterministic=True, kv_pages=kv_pages, kv_page_size=P, max_step_tokens=24)
    assert eng.scheduler.ratios == ratios
    rids = [eng.add_request(p, PARAMS) for p in prompts]

    def check(e):
        assert e.pool.page_limit.used == pages_held(e) <= kv_pages
    steps = run_steps(eng, check)
    got = [eng.completion(r) for r in rids]
    assert all(c.finish_reason == "length" for c in got)
    assert outputs(got) == alone
    assert sum(c.stats["preemptions"] for c in got) > 0                     # the pool really ran out
    assert max(n for n, _ in steps) <= 24                                   # the token budget, counted at the model
    assert eng.pool.page_limit.used == 0


def test_long_prompt_does_not_stall_running_streams(model, prompts):
    budget, streams = 8, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    eng = Engine(model, max_seq_len=256, deterministic=True, max_step_tokens=budget)
    short = [eng.add_request(p, streams) for p in prompts[5:7]]
    while len(eng.running) < 2 or not all(s.pending is not None for s in eng.running):
        eng.step()                                                          # both short requests decoding
    long = torch.randint(0, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    rid = eng.add_request(long, PARAMS)
    prefill_steps = 0
    while not any(s.request_id == rid and s.pending is not None for s in eng.running):
        fed = counted(eng)
        outs = eng.step()
        del eng.model.embed_tokens
        assert fed[0] <= budget
        assert set(short) <= {o.request_id for o in outs if o.new_token_ids}   # a token for each, every step
        prefill_steps += 1
    assert prefill_steps >= 90 // budget                                    # the prompt really was chunked
    assert not eng.finished                                                 # the streams ran all along
    while eng.has_unfinished():
        eng.step()
    ref = [Engine(model, max_seq_len=256, deterministic=True).generate([p], streams)[0] for p in prompts[5:7]]
    assert outputs([eng.completion(r) for r in short]) == outputs(ref)
    ref = Engine(model, max_seq_len=256, deterministic=True).generate([long], PARAMS)
    assert outputs([eng.completion(rid)]) == outputs(ref)


def test_waiting_prompts_prefill_as_one_batch_in_few_forwards(model, prompts, alone):
    """The 8 prompts (5 body lengths) are admitted as one group and fed in the forwards `forward_plan` picks (here
    one per distinct length, each over the rows still short of it), their last tokens joining one decode forward:
    the same outputs as alone."""
    eng = Engine(model, max_seq_len=256, deterministic=True)
    rids = [eng.add_request(p, PARAMS) for p in prompts]
    calls, embed = [], eng.model.embed_tokens
    eng.model.embed_tokens = lambda ids, *a, **k: calls.append(tuple(ids.shape)) or embed(ids, *a, **k)
    eng.step()
    del eng.model.embed_tokens
    assert len(eng.last_plan.bodies) == 1 and len(eng.last_plan.join) == len(prompts)
    bodies = [len(p) - 1 for p in prompts]
    plan = forward_plan(bodies)
    assert len(plan) == len(set(bodies)) == 5
    assert calls == [(len(rows), T) for T, rows in plan] + [(len(prompts), 1)]
    while eng.has_unfinished():
        eng.step()
    assert outputs([eng.completion(r) for r in rids]) == alone


def test_a_short_body_leaves_the_batch_and_decodes_while_a_long_one_prefills(model, prompts, alone):
    """A step budget that feeds the long body over several steps: the short prompt's body is fed in the first
    step (its last token joins the next step's decode: the body took the budget) and it gets a token on every
    step after, while the long body goes on; the outputs are each prompt's alone."""
    long = torch.randint(0, model.cfg.vocab_size, (120,), generator=torch.Generator().manual_seed(11)).tolist()
    eng = Engine(model, max_seq_len=256, deterministic=True, max_batch=2, max_step_tokens=40)
    r_long, r_short = eng.add_request(long, PARAMS), eng.add_request(prompts[5], PARAMS)
    short_tokens, steps = [], 0
    while not any(s.request_id == r_long and s.pending is not None for s in eng.running):
        outs = eng.step()
        steps += 1
        short_tokens.append(r_short in {o.request_id for o in outs if o.new_token_ids})
    assert steps >= 3 and short_tokens[0] is False and all(short_tokens[1:])
    while eng.has_unfinished():
        eng.step()
    ref = Engine(model, max_seq_len=256, deterministic=True).generate([long], PARAMS)
    assert outputs([eng.completion(r_long), eng.completion(r_short)]) == outputs(ref) + [alone[5]]


@pytest.mark.parametrize("amounts", [[5], [3, 3, 3], [29, 18, 18, 18, 40, 6, 25, 18], list(range(1, 40)),
                                     [0, 7, 0, 100, 64], [512, 300, 700, 256, 511, 513]])
def test_forward_plan_feeds_each_row_its_amount_in_few_forwards(amounts):
    plan = forward_plan(amounts)
    fed = [0] * len(amounts)
    for T, rows in plan:
        assert T > 0 and rows == sorted(set(rows)) and all(amounts[b] > 0 for b in rows)
        for b in rows:
            fed[b] += T
    assert fed == amounts
    live = [a for a in amounts if a]
    spread = max(live) - min(live)
    assert len(plan) <= min(len(set(live)), 1 + spread.bit_length())


def test_youngest_is_preempted_and_resumes_identically(model, prompts, alone):
    a, b = prompts[0], prompts[4]
    fits_prompts = pages_at([2, 1], P, len(a) + 1) + pages_at([2, 1], P, len(b) + 1)
    eng = Engine(model, max_seq_len=256, deterministic=True, kv_pages=fits_prompts + 1, kv_page_size=P)
    ra, rb = eng.add_request(a, PARAMS), eng.add_request(b, PARAMS)
    steps = run_steps(eng)
    ca, cb = eng.completion(ra), eng.completion(rb)
    assert ca.stats["preemptions"] == 0 and cb.stats["preemptions"] >= 1
    assert outputs([ca, cb]) == [alone[0], alone[4]]
    # the preempted request's stream: every token once, in order
    streamed = [t for _, outs in steps for o in outs if o.request_id == rb for t in o.new_token_ids]
    assert streamed == cb.output_ids


def test_never_fitting_request_is_refused(model):
    eng = Engine(model, max_seq_len=256, kv_pages=6, kv_page_size=P)
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request(list(range(40)), SamplingParams(max_tokens=8))
    eng.add_request(list(range(10)), SamplingParams(max_tokens=8))           # one that fits is served
    while eng.has_unfinished():
        eng.step()
    with pytest.raises(ValueError, match="max_step_tokens"):
        Engine(model, max_batch=8, max_step_tokens=4)
    with pytest.raises(PoolFull):                                            # the pool's own limit, unscheduled
        pool = eng.pool
        sid = pool.new_sequence()
        pool.global_layers[4].alloc(7)
        pool.free(sid)


def test_speculation_under_the_scheduler(model, prompts, alone):
    need = [pages_at([2, 1], P, len(p) + PARAMS.max_tokens) for p in prompts]
    # a third of what all need (the largest fits): admitted together, the rows outgrow it and preemption happens
    eng = Engine(model, max_seq_len=256, deterministic=True, speculative="fixed:2", kv_pages=sum(need) // 3,
                 kv_page_size=P, max_step_tokens=16)
    assert max(need) <= sum(need) // 3
    rids = [eng.add_request(p, PARAMS) for p in prompts]
    steps = run_steps(eng, lambda e: None)
    got = [eng.completion(r) for r in rids]
    assert outputs(got) == alone
    assert sum(c.stats["preemptions"] for c in got) > 0
    assert max(n for n, _ in steps) <= 16 + 16                  # verify rows plus the drafter's own embeddings


def test_request_filling_the_pool_alone_completes(model, prompts):
    """Speculative rows reserve their drafts' pages, never beyond prompt plus max_tokens: a request that fits the
    pool exactly is never preempted by its own reservation."""
    p = (prompts[0] + prompts[1])[:36]
    assert (len(p) + PARAMS.max_tokens) % P == 0                 # its last drafts would cross into new pages
    eng = Engine(model, max_seq_len=256, deterministic=True, speculative="fixed:2",
                 kv_pages=pages_at([2, 1], P, len(p) + PARAMS.max_tokens), kv_page_size=P)
    rid = eng.add_request(p, PARAMS)
    for _ in range(4 * PARAMS.max_tokens):
        if not eng.has_unfinished():
            break
        eng.step()
    got = eng.completion(rid)
    ref = Engine(model, max_seq_len=256, deterministic=True).generate([p], PARAMS)
    assert got.stats["preemptions"] == 0 and outputs([got]) == outputs(ref)
