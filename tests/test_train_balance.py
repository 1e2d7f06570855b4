"""Guards aux-loss-free balancing (docs/system.md §6): the bias moves against the load (overloaded experts down,
underloaded up), text and image biases follow their own modality's load only, and the balancer counts the
routes the model's gates returned in a forward (split by the image mask they routed with)."""

from __future__ import annotations

import torch

from dsv41.config import load_config
from dsv41.model.init import random_model
from dsv41.train.balance import LoadBalancer, bias_update, expert_load, max_violation


def test_bias_update_direction():
    bias = torch.zeros(4)
    load = torch.tensor([10.0, 2.0, 4.0, 4.0])           # mean 5
    new = bias_update(bias, load, 0.01)
    assert torch.equal(new, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert torch.equal(bias_update(bias, torch.zeros(4), 0.01), bias)
    assert max_violation(load) == 1.0


def test_expert_load_counts_masked_tokens():
    idx = torch.tensor([[[0, 1], [1, 2]], [[3, 1], [0, 0]]])      # [B=2, T=2, K=2]
    assert expert_load(idx, 4).tolist() == [3, 3, 1, 1]
    mask = torch.tensor([[True, False], [False, True]])
    assert expert_load(idx, 4, mask).tolist() == [3, 1, 0, 0]


def test_text_and_image_biases_follow_their_own_load():
    cfg = load_config("debug")                                   # has a vision tower, so gates have bias_vl
    model = random_model(cfg)
    bal = LoadBalancer(model, rate=0.5, prefix="layers.")
    name, moe = bal.moes[0]
    E = moe.n_experts
    with torch.no_grad():
        moe.gate.bias.zero_()
        moe.gate.bias_vl.zero_()
    # text tokens all pick expert 0 (+1), image tokens all pick expert E-1 (+E-2)
    idx = torch.tensor([[[0, 1], [0, 1], [E - 1, E - 2]]])
    image = torch.tensor([[False, False, True]])
    bal.count(name, idx, image)
    rep = bal.step()
    b, bv = moe.gate.bias, moe.gate.bias_vl
    assert b[0] < 0 and b[1] < 0 and torch.all(b[2:] > 0)
    assert bv[E - 1] < 0 and bv[E - 2] < 0 and torch.all(bv[:E - 2] > 0)
    assert rep["maxvio"] > 0
    # a text-only step leaves the image bias alone
    before = bv.clone()
    bal.count(name, idx[:, :2])
    bal.step()
    assert torch.equal(bv, before)


def test_balancer_reads_model_routes():
    cfg = load_config("debug")
    model = random_model(cfg)
    from dsv41.model.common import set_quantization
    from dsv41.train.qat import TrainCache
    set_quantization(model, False)
    bal = LoadBalancer(model, rate=1e-2, prefix="layers.")
    ids = torch.randint(3, 500, (2, 16))
    model(ids, TrainCache(cfg, 2, torch.float32), 0)
    bal.observe()
    total = sum(float(v["text"].sum()) for v in bal.loads.values())
    assert total == cfg.n_layers * 2 * 16 * cfg.n_activated_experts
    before = [m.gate.bias.clone() for _, m in bal.moes]
    bal.step()
    assert all(not torch.equal(b, m.gate.bias) for b, (_, m) in zip(before, bal.moes))


def test_balancer_splits_model_routes_by_modality():
    cfg = load_config("debug")
    model = random_model(cfg)
    from dsv41.model.cache import DenseCache
    from dsv41.model.step import ForwardOptions
    bal = LoadBalancer(model, prefix="layers.")
    ids = torch.randint(3, 500, (1, 12))
    types = torch.full((1, 12), -1)
    types[0, 4:9] = 0                                            # 5 image-span tokens
    with torch.no_grad():
        model(ids, DenseCache(cfg, 1, torch.float32), opts=ForwardOptions(token_types=types))
    bal.observe()
    k = cfg.n_activated_experts
    assert sum(float(v["image"].sum()) for v in bal.loads.values()) == cfg.n_layers * 5 * k
    assert sum(float(v["text"].sum()) for v in bal.loads.values()) == cfg.n_layers * 7 * k
    bal.observe()                                                # nothing new ran: nothing more is counted
    assert sum(float(v["text"].sum()) for v in bal.loads.values()) == cfg.n_layers * 7 * k
