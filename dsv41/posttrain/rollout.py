"""Rollouts on the project's engine and their evaluation: responses to (problem, effort) prompts with the behaviour
log-probs the engine reports, scored by the exact checkers; accuracy and reasoning length per effort level, with
the statistics the acceptance asks for (bootstrap intervals, a paired sign test, the affine fit of length in b).

The engine runs in the deterministic mode (`Engine(..., deterministic=True)`), so a response's log-probs are
those the training forward (`dsv41.train.logprobs.token_logprobs`) gives for the same tokens, bit for bit; every
request carries its own seed, so the same (problem, b, seed) gives the same response whatever the batch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.posttrain import tasks as T
from dsv41.posttrain.routing import RouteRecord, record
from dsv41.train.logprobs import token_logprobs


@dataclass
class Rollout:
    problem: T.Problem
    effort: int
    prompt_ids: list[int]
    output_ids: list[int]            # sampled tokens, the EOS included when it was sampled
    behaviour_lp: list[float]        # the engine's log-prob of each output token
    verdict: T.Verdict
    version: int = 0                 # the policy version that generated it (dispatch.py: per token)
    routes: RouteRecord | None = None    # the expert routing that generated it (routing.py), when recorded
    grammar: object | None = None        # the constrain.Grammar it was sampled under (None: the full softmax)


def make_engine(model, tok, max_batch: int = 32) -> Engine:
    return Engine(model, tok, prefill_mode="full", max_batch=max_batch, deterministic=True)


def sampling(max_tokens: int, seed: int | None, temperature: float = 1.0, constraint=None) -> SamplingParams:
    """Full-softmax sampling (no top-k / top-p), so the sampling mask is the training mask; constraint: a
    constrain.Grammar whose token mask the engine applies to the raw logits (the RL loss applies the same one)."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=0,
                          constraint=constraint)


def rollouts(engine: Engine, tok, items: list[tuple[T.Problem, int, int | None]], max_tokens: int,
             temperature: float | list[float] = 1.0, routes: bool = False, grammar=None,
             masked_lp: bool = True) -> list[Rollout]:
    """One response per (problem, effort, seed), in the order of items; seed None with temperature 0 is greedy;
    temperature: one for all, or one per item. routes: record each response's expert routing at the current
    weights (routing.py; call before the weights change). grammar: None, or (problem, b) -> constrain.Grammar:
    each request samples under that grammar's mask, and its behaviour log-probs are the masked ones (the engine
    reports those of the raw logits; they are recomputed by the masked training forward at the same weights;
    masked_lp False: not recomputed, for an evaluation that reads no log-probs)."""
    prompts = [T.prompt_ids(tok, p, b) for p, b, _ in items]
    grammars = [grammar(p, b) if grammar is not None else None for p, b, _ in items]
    temps = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature] * len(items)
    if len(temps) != len(items):
        raise ValueError(f"{len(temps)} temperatures for {len(items)} items")
    rids = [None] * len(items)
    # equal-length prompts queued together prefill as one batch (the engine groups consecutive ones); in the
    # deterministic mode the order changes no response
    for i in sorted(range(len(items)), key=lambda i: len(prompts[i])):
        rids[i] = engine.add_request(prompts[i], sampling(max_tokens, items[i][2], temps[i], grammars[i]))
    while engine.has_unfinished():
        engine.step()
    out = []
    for (p, b, _), rid in zip(items, rids):
        c = engine.completion(rid)
        ids = c.output_ids + ([tok.eos_id] if c.finish_reason == "stop" else [])
        lps = [x["logprob"] for x in c.logprobs]
        if c.finish_reason == "stop":                     # the engine does not report the stop token's log-prob
            lps.append(float("nan"))
        out.append(Rollout(p, b, c.prompt_ids, ids, lps, T.check(tok, p, ids), grammar=grammars[len(out)]))
        del engine.finished[rid]
    if routes and out:
        for r in out:
            r.routes = RouteRecord()
        lp = record(engine.model, [r.routes for r in out], [r.prompt_ids + r.output_ids for r in out], 0, tok.pad_id)
        for i, r in enumerate(out):
            if r.behaviour_lp and math.isnan(r.behaviour_lp[-1]):
                r.behaviour_lp[-1] = float(lp[i, len(r.prompt_ids) + len(r.output_ids) - 2])
    else:
        fill_stop_logprobs(engine.model, out, tok.pad_id)
    if grammar is not None and masked_lp and out:
        masked_behaviour(engine.model, out, tok.pad_id)
    return out


@torch.no_grad()
def masked_behaviour(model, rs: list[Rollout], pad: int) -> None:
    """Replace the behaviour log-probs of constrained rollouts by those of the masked softmax they were sampled
    from, at the current weights (call before the weights change; recorded routing replayed when present)."""
    from dsv41.posttrain.constrain import allowed_mask, masked_token_logprobs
    from dsv41.posttrain.routing import replay_batch
    todo = [r for r in rs if r.grammar is not None and r.output_ids]
    if not todo:
        return
    rows = [r.prompt_ids + r.output_ids for r in todo]
    T_ = max(map(len, rows))
    ids = torch.tensor([x + [pad] * (T_ - len(x)) for x in rows])
    routes = replay_batch([r.routes for r in todo], list(map(len, rows)), T_) \
        if all(r.routes is not None for r in todo) else None
    V = model.cfg.vocab_size
    allowed = allowed_mask([r.grammar for r in todo], [len(r.prompt_ids) for r in todo],
                           [r.output_ids for r in todo], T_, V)
    lp = masked_token_logprobs(model, ids, allowed, routes=routes)
    for i, r in enumerate(todo):
        a = len(r.prompt_ids) - 1
        r.behaviour_lp = [float(x) for x in lp[i, a:a + len(r.output_ids)]]


@torch.no_grad()
def fill_stop_logprobs(model, rs: list[Rollout], pad: int) -> None:
    """The behaviour log-prob of each sampled EOS, from the training forward at the weights that sampled it (call
    before the weights change): in the deterministic mode it is what the engine would have reported."""
    todo = [r for r in rs if r.behaviour_lp and math.isnan(r.behaviour_lp[-1])]
    if not todo:
        return
    rows = [r.prompt_ids + r.output_ids for r in todo]
    ids = torch.tensor([x + [pad] * (max(map(len, rows)) - len(x)) for x in rows])
    lp = token_logprobs(model, ids)
    for i, r in enumerate(todo):
        r.behaviour_lp[-1] = float(lp[i, len(rows[i]) - 2])


def held_out_problems(mix, n: int, seed: int = 1) -> list[T.Problem]:
    rng = random.Random(f"eval:{seed}")
    return [T.sample_problem(rng, mix.families[i % len(mix.families)], mix.lo, mix.hi, split="held_out")
            for i in range(n)]


@torch.no_grad()
def evaluate(model, tok, problems: list[T.Problem], levels, max_tokens: int, temperature: float = 0.0,
             batch: int = 32, grammar=None, first: int = 0) -> dict:
    """Responses to every problem at every level: {b: {"correct": [0/1...], "length": [...]}}; greedy at
    temperature 0, else sampled from the full softmax at that temperature with a seed per (problem, level), so a
    sampled evaluation is reproducible (greedy hides a change of the policy that has not moved its mode).
    batch: the engine's slots; in its deterministic mode a response does not depend on which requests share a
    batch, so only the time changes. grammar: as rollouts' (the decoding constraint every response is sampled
    under; None: the full softmax). first: the index of problems[0] in the whole held-out list (the seeds follow
    that index, so a slice evaluated on its own answers as it does inside the whole list)."""
    eng = make_engine(model, tok, max_batch=batch)
    res = {}
    for b in levels:
        seeds = [None if temperature == 0 else 7919 * (first + i) + b for i in range(len(problems))]
        rs = rollouts(eng, tok, [(p, b, s) for p, s in zip(problems, seeds)], max_tokens, temperature=temperature,
                      grammar=grammar, masked_lp=False)
        res[b] = {"correct": [int(r.verdict.correct) for r in rs], "length": [r.verdict.reasoning_tokens for r in rs],
                  "difficulty": [p.difficulty for p in problems], "family": [p.family for p in problems]}
    return res


def bootstrap_ci(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(xs, dtype=torch.float64)
    means = x[torch.randint(0, len(xs), (n, len(xs)), generator=g)].mean(1).sort().values
    return float(means[int(0.025 * n)]), float(means[int(0.975 * n) - 1])


def sign_test(before: list[int], after: list[int]) -> dict:
    """Paired exact sign test (McNemar's exact form) on 0/1 outcomes: one-sided p of `after` better."""
    up = sum(1 for a, b in zip(before, after) if b > a)
    down = sum(1 for a, b in zip(before, after) if b < a)
    n = up + down
    p = sum(math.comb(n, k) for k in range(up, n + 1)) / 2 ** n if n else 1.0
    return {"improved": up, "worsened": down, "p_one_sided": p}


def affine_fit(bs: list[float], ls: list[float]) -> dict:
    """Least-squares l = a + s b and its R^2."""
    x, y = torch.tensor(bs, dtype=torch.float64), torch.tensor(ls, dtype=torch.float64)
    xm, ym = x.mean(), y.mean()
    sxx = ((x - xm) ** 2).sum()
    s = float(((x - xm) * (y - ym)).sum() / sxx) if sxx > 0 else 0.0
    a = float(ym) - s * float(xm)
    ss_tot = float(((y - ym) ** 2).sum())
    ss_res = float(((y - (a + s * x)) ** 2).sum())
    # flat: every level has the same mean, R^2 is then 1 by convention and says nothing
    return {"intercept": a, "slope": s, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0, "flat": ss_tot == 0}


def summarize(res: dict) -> dict:
    """Per level: accuracy, mean length and its bootstrap interval; per difficulty: the affine fit of the
    mean length against b."""
    levels = sorted(res)
    out = {"levels": {}}
    for b in levels:
        r = res[b]
        out["levels"][b] = {"accuracy": sum(r["correct"]) / len(r["correct"]),
                            "mean_length": sum(r["length"]) / len(r["length"]),
                            "length_ci95": bootstrap_ci(r["length"]), "n": len(r["length"])}
        if "family" in r:
            fams = sorted(set(r["family"]))
            out["levels"][b]["accuracy_by_family"] = {
                f: sum(c for c, ff in zip(r["correct"], r["family"]) if ff == f) / r["family"].count(f) for f in fams}
    diffs = sorted(set(res[levels[0]]["difficulty"]))
    fits = {}
    for d in diffs:
        means = []
        for b in levels:
            ls = [l for l, dd in zip(res[b]["length"], res[b]["difficulty"]) if dd == d]
            means.append(sum(ls) / len(ls))
        fits[d] = affine_fit(levels, means)
    out["fit_by_difficulty"] = fits
    if "family" in res[levels[0]]:
        fam = res[levels[0]]["family"]
        out["accuracy_by_family"] = {f: sum(c for b in levels for c, ff in zip(res[b]["correct"], fam) if ff == f)
                                     / (fam.count(f) * len(levels)) for f in sorted(set(fam))}
    return out
