"""RL driven by the asynchronous dispatcher (dispatch.py, docs/system.md §7): generation and training time-share
the machine through one engine whose model the updates change in place.

A group is one training prompt x at every effort level b (or `levels_per_prompt` of them), M_b samples each (the
(x, b) subgroups of the advantages); `cfg.prompts` finished groups make one update. Samples still running at an update continue from their
KV cache at the new weights; their tokens carry the version that generated them (older than `max_staleness`
versions: masked out of the loss), and their expert routing is recorded per version and replayed by the update's
forward (routing.py). The granularity (`cfg.dispatch`: sample, prompt or batch) only changes when groups enter
the slots; each history row keeps the slot occupancy so far, the number the three are compared by.

Resuming restarts the stream of prompts after the last one drawn; samples in flight when a run stopped are lost.
"""

from __future__ import annotations

import random
from pathlib import Path

from dsv41.posttrain import tasks as T
from dsv41.posttrain.dispatch import DispatchConfig, Dispatcher, EngineBackend, Group, Sample
from dsv41.posttrain.rl import RLConfig, RLRun, level_seeds, prompt_levels
from dsv41.posttrain.rollout import Rollout, make_engine


def group_source(cfg: RLConfig, tok, first: int = 0):
    """Groups first, first + 1, ...: each a pure function of (seed, gid)."""
    gid = first
    while True:
        rng = random.Random(f"rl-dispatch:{cfg.seed}:{gid}")
        p = T.sample_problem(rng, cfg.mix.families[gid % len(cfg.mix.families)], cfg.mix.lo, cfg.mix.hi)
        levels = prompt_levels(rng, cfg.mix.levels, cfg.levels_per_prompt)
        seeds = [s for ss in level_seeds(rng, len(levels), cfg.samples, cfg.paired_seeds) for s in ss]
        efforts = [b for b in levels for _ in range(cfg.samples)]
        samples = [Sample(f"g{gid}s{j}", T.prompt_ids(tok, p, b), seed)
                   for j, (b, seed) in enumerate(zip(efforts, seeds))]
        yield Group(gid, p.family, samples, meta=(p, efforts))
        gid += 1


def group_rollouts(groups: list[Group], backend: EngineBackend, tok) -> list[Rollout]:
    """The finished samples of groups as scored rollouts with their recorded routing (taken from the backend)."""
    out = []
    for g in groups:
        p, efforts = g.meta
        for s, b in zip(g.samples, efforts):
            out.append(Rollout(p, b, s.prompt, s.tokens, s.logprobs, T.check(tok, p, s.tokens),
                               version=min(s.versions, default=0), routes=backend.records.pop(s.sid)))
    return out


def run_rl_dispatched(cfg: RLConfig, say=print) -> Path:
    run = RLRun(cfg, say)
    eng = make_engine(run.model, run.tok, max_batch=cfg.slots)
    backend = EngineBackend(eng, run.tok, cfg.max_tokens)
    first = max((h.get("last_gid", -1) for h in run.history), default=-1) + 1
    d: Dispatcher

    def train(groups, masks):
        rs = group_rollouts(groups, backend, run.tok)
        flat = [m for ms in masks for m in ms]
        crossed = sum(len(set(s.versions)) > 1 for g in groups for s in g.samples)
        run.update(rs, flat, occupancy=d.occupancy(), version=d.version, crossed=crossed,
                   masked=sum(len(m) - sum(m) for m in flat), last_gid=max(g.gid for g in groups))

    d = Dispatcher(backend, group_source(cfg, run.tok, first), train,
                   DispatchConfig(granularity=cfg.dispatch, train_groups=cfg.prompts,
                                  max_staleness=cfg.max_staleness))
    while run.running():
        before = d.version
        d.run(1)
        if d.version == before:
            break                                   # nothing left to run (not reached with the endless source)
    drops = [e for e in d.log if e[0].startswith("drop")]
    return run.finish(dispatch={"granularity": cfg.dispatch, "occupancy": d.occupancy(),
                                "engine_steps": d.engine_steps, "dropped_groups": len(drops)})
