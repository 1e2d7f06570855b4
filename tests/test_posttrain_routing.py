"""Expert routing recorded at generation time and replayed by the RL update (dsv41/posttrain/routing.py), on the
real engine in the deterministic mode: the record is the engine's own routing; after a weight switch that moves
the gates, the update's forward routes by the record (it would not if it selected again), and the dispatched RL
loop trains with it."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.model.moe import Gate
from dsv41.posttrain import tasks as T
from dsv41.posttrain.dispatch import DispatchConfig, Dispatcher, EngineBackend
from dsv41.posttrain.model import build_model
from dsv41.posttrain.rl import RLConfig, train_step
from dsv41.posttrain.rl_dispatch import group_rollouts, group_source
from dsv41.posttrain.rollout import make_engine, rollouts
from dsv41.posttrain.sft import TaskMix
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.train.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


def gates(model):
    """{layer: gate} of the routed MoE layers the training forward runs."""
    log = {}
    token_logprobs(model, torch.tensor([[0, 5, 6]]), route_log=log)
    return {layer: m.gate for layer in log for m in model.modules() if getattr(m, "layer", None) == layer
            and isinstance(getattr(m, "gate", None), Gate)}


class GateTap:
    """Forward hooks keeping every gate call's expert ids, per layer."""

    def __init__(self, model):
        self.calls = {layer: [] for layer in gates(model)}
        self.hooks = [g.register_forward_hook(lambda m, i, o, layer=layer: self.calls[layer].append(o[1].clone()))
                      for layer, g in gates(model).items()]

    def close(self):
        for h in self.hooks:
            h.remove()


def test_recorded_routing_is_the_engines(tok):
    model = build_model(tok, seed=5).eval()
    rng = random.Random(1)
    p = T.sample_problem(rng, "sums", 3, 5)
    eng = make_engine(model, tok, max_batch=1)
    tap = GateTap(model)
    try:
        r, = rollouts(eng, tok, [(p, 50, 7)], max_tokens=12, routes=False)
    finally:
        tap.close()
    n = len(r.prompt_ids) + len(r.output_ids) - 1                     # positions the engine forwarded
    rec, = rollouts(make_engine(model, tok, max_batch=1), tok, [(p, 50, 7)], max_tokens=12, routes=True)
    assert rec.output_ids == r.output_ids and rec.routes.upto == n
    for layer, x in rec.routes.stitched().items():
        engine_ids = torch.cat(tap.calls[layer])                      # prefill rows, then one row per decode step
        assert engine_ids.shape == x.shape and torch.equal(engine_ids, x)


def test_update_replays_recorded_routing_across_a_weight_switch(tok):
    model = build_model(tok, seed=6).eval()
    cfg = RLConfig(prompts=1, samples=1, max_tokens=10, mix=TaskMix(families=("sums",), levels=(1, 100)))
    eng = make_engine(model, tok, max_batch=4)
    limits = iter([3, 10] * 10)
    sizes = {}
    backend = EngineBackend(eng, tok, lambda sid: sizes.setdefault(sid, next(limits)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)                 # the update itself leaves the weights
    seen = []

    def train(groups, masks):
        rs = group_rollouts(groups, backend, tok)
        tap = GateTap(model)
        try:
            train_step(model, opt, rs, [1.0] * len(rs), cfg, tok.pad_id, [m for ms in masks for m in ms])
        finally:
            tap.close()
        rows = [r.prompt_ids + r.output_ids for r in rs]
        T_ = max(map(len, rows))
        ids = torch.tensor([x + [tok.pad_id] * (T_ - len(x)) for x in rows])
        fresh = {}
        token_logprobs(model, ids, route_log=fresh)                   # what selecting again would route
        seen.append((rs, {layer: c[0].view(len(rs), T_, -1) for layer, c in tap.calls.items()}, fresh))
        with torch.no_grad():                                         # the weight switch: every gate reverses
            for g in gates(model).values():
                g.weight.neg_()

    d = Dispatcher(backend, group_source(cfg, tok), train, DispatchConfig(train_groups=1, max_staleness=10))
    d.run(3)
    crossed = differs = 0
    for rs, used, fresh in seen:
        for i, r in enumerate(rs):
            n = len(r.prompt_ids) + len(r.output_ids) - 1
            vs = set(r.routes.versions())
            crossed += len(vs) > 1
            for layer, x in r.routes.stitched().items():
                assert torch.equal(used[layer][i, :n], x[:n])        # the update routed by the record
                differs += not torch.equal(fresh[layer][i, :n], x[:n])
    assert crossed > 0 and differs > 0                                # recomputing would have routed otherwise


def test_dispatched_rl_trains_with_replayed_routing(tok, tmp_path, monkeypatch):
    from dsv41.posttrain import rl
    from dsv41.posttrain.model import save
    from dsv41.posttrain.rl import run_rl
    # an untrained model never closes its think span within 6 tokens: every task reward is equal, every advantage
    # 0; a reward read off the sampled tokens makes the update move the weights
    monkeypatch.setattr(rl, "rewards_of", lambda rs, length: [sum(r.output_ids) % 7 / 7 for r in rs])
    model = build_model(tok, seed=2).eval()
    save(model, tok, tmp_path / "init", {"stage": "sft"})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = RLConfig(init=str(tmp_path / "init"), out=str(tmp_path / "rl"), steps=2, prompts=1, samples=2,
                   max_tokens=6, slots=8, quiet=True, mix=TaskMix(levels=(1, 100)))
    out = run_rl(cfg, say=lambda *_: None)
    from dsv41.posttrain.model import load
    after, _, meta = load(out)
    assert meta["step"] == 2 and meta["dispatch"]["granularity"] == "sample"
    assert 0 < meta["dispatch"]["occupancy"] <= 1 and (out / "rl_curves.png").is_file()
    changed = [k for k, v in after.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert any(".gate." in k for k in changed) and any("ffn.experts" in k for k in changed)
