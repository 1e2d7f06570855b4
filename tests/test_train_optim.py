"""Guards the optimizers of docs/system.md §6 against their definitions: Newton-Schulz orthogonality, head-wise Muon
(one orthogonal factor per head, update RMS gamma), Sinkhorn balancing (row RMS 1, column RMS ~1, RMS(Delta) 1),
zero-gradient rows left bit-identical (weights and momentum), the routing table, and the AdamW route equal to
torch.optim.AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.config import load_config
from dsv41.model.init import random_model
from dsv41.train.optim.muon import (GAMMA, Muon, muon_momentum, muon_update, newton_schulz, orthogonalize_heads)
from dsv41.train.optim.routing import build_optimizers, format_routing, route_parameters
from dsv41.train.optim.sinkhorn import (SinkhornMomentum, sinkhorn_balance, sinkhorn_direction, sinkhorn_update)


def _rms(x: torch.Tensor, dim=None) -> torch.Tensor:
    return x.square().mean(dim=dim).sqrt() if dim is not None else x.square().mean().sqrt()


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (8, 256)])
def test_newton_schulz_is_orthogonal(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    o = newton_schulz(x)
    s = torch.linalg.svdvals(o)
    assert (s - 1).abs().max() < 2e-2, s
    # the polar factor: same singular vectors as x
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(o, u @ vh, atol=2e-2, rtol=0)


def test_headwise_muon_orthogonal_per_head():
    # a query projection [H*Dh, r] with H*Dh > r (tall, like wq_b): one matrix-wide factor cannot make the heads'
    # blocks orthogonal (they share r directions); head-wise Muon makes each block orthogonal
    g = torch.Generator().manual_seed(1)
    H, Dh, r = 4, 16, 16
    grad = torch.randn(H * Dh, r, generator=g)
    grad[:Dh] *= 100.0                                   # one head with a far larger gradient
    upd, m = muon_update(grad, torch.zeros_like(grad), beta=0.9, heads=H)
    scale = GAMMA * math.sqrt(max(Dh, r))
    for h in range(H):
        block = upd[h * Dh:(h + 1) * Dh] / scale
        torch.testing.assert_close(block @ block.T, torch.eye(Dh), atol=3e-2, rtol=0)
        assert abs(float(_rms(upd[h * Dh:(h + 1) * Dh])) - GAMMA) < 5e-3
    whole = orthogonalize_heads(grad, 1) / (GAMMA * math.sqrt(H * Dh))
    for h in range(1, H):
        block = whole[h * Dh:(h + 1) * Dh]
        assert (block @ block.T - torch.eye(Dh)).abs().max() > 0.3
    torch.testing.assert_close(m, 0.1 * grad)


def test_muon_momentum_is_nesterov_ema():
    g, m0 = torch.randn(6, 5), torch.randn(6, 5)
    m, n = muon_momentum(g, m0, 0.95)
    torch.testing.assert_close(m, 0.95 * m0 + 0.05 * g)
    torch.testing.assert_close(n, 0.95 * m + 0.05 * g)


def test_muon_class_matches_pure_function_and_skips_missing_grads():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(8, 12))
    c = torch.nn.Parameter(torch.randn(16, 12))
    ref_a = a.detach().clone()
    ref_c = c.detach().clone()
    a.grad, c.grad = torch.randn(8, 12), torch.randn(16, 12)
    opt = Muon([{"params": [a, b, c], "heads": 2}], lr=0.1, beta=0.9, weight_decay=0.01)
    b0 = b.detach().clone()
    opt.step()
    for p, ref in ((a, ref_a), (c, ref_c)):
        upd, _ = muon_update(p.grad, torch.zeros_like(p), 0.9, heads=2)
        torch.testing.assert_close(p.detach(), ref * (1 - 0.1 * 0.01) - 0.1 * upd)
    assert torch.equal(b.detach(), b0) and b not in opt.state


def test_sinkhorn_balance_rows_and_columns():
    g = torch.Generator().manual_seed(2)
    n, d = 200, 48
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g).mul(50).add(0.1) \
        * torch.rand(1, d, generator=g).mul(20).add(0.1)           # very unequal row and column scales
    delta = sinkhorn_direction(x)
    row = _rms(delta, dim=1)
    col = _rms(delta, dim=0)
    torch.testing.assert_close(row, torch.ones(n), atol=1e-5, rtol=0)  # K odd: rows exact
    assert (col - 1).abs().max() < 0.05, col
    assert abs(float(_rms(delta)) - 1) < 1e-4
    # odd K ends on rows: unit l2 rows
    u = sinkhorn_balance(x, 11)
    torch.testing.assert_close(u.norm(dim=1), torch.ones(n), atol=1e-5, rtol=0)


def test_sinkhorn_small_rows_zeroed():
    x = torch.randn(10, 8)
    x[3] *= 1e-6
    delta = sinkhorn_direction(x, tau=1e-3)
    assert torch.all(delta[3] == 0)
    assert torch.all(delta[[0, 1, 2, 4]].abs().sum(1) > 0)


def test_sinkhorn_zero_gradient_rows_bit_identical():
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(50, 16))
    opt = SinkhornMomentum([{"params": [w], "lr": 0.5}], beta=0.9)
    for step in range(3):
        before = w.detach().clone()
        g = torch.randn(50, 16)
        untouched = torch.arange(50) % 5 == step                # a different set of absent rows each step
        g[untouched] = 0
        mom_before = opt.state[w]["momentum"].clone() if w in opt.state else torch.zeros(50, 16)
        w.grad = g
        opt.step()
        assert torch.equal(w.detach()[untouched], before[untouched])
        assert torch.equal(opt.state[w]["momentum"][untouched], mom_before[untouched])
        assert torch.all((w.detach()[~untouched] != before[~untouched]).any(1))


def test_sinkhorn_update_definition():
    torch.manual_seed(4)
    g, m0 = torch.randn(30, 12), torch.randn(30, 12)
    upd, m = sinkhorn_update(g, m0, beta=0.8)
    torch.testing.assert_close(m, 0.8 * m0 + 0.2 * g)
    n = 0.8 * m + 0.2 * g
    torch.testing.assert_close(upd, 0.18 * math.sqrt(12) * sinkhorn_balance(n, 11))


def test_routing_of_the_tiny_model():
    cfg = load_config("tiny")
    model = random_model(cfg)
    routes = {r.name: r for r in route_parameters(model, cfg, "muon")}
    assert routes["layers.0.attn.wq_b.weight"].kind == "muon_headwise"
    assert routes["layers.0.attn.wq_b.weight"].heads == cfg.n_heads
    assert routes["layers.2.attn.indexer.wq_b.weight"].heads == cfg.index_n_heads
    assert routes["layers.0.attn.wkv.weight"].heads == 1
    assert routes["layers.2.attn.indexer.wk.weight"].kind == "muon_headwise"
    for name in ("embed.weight", "head.weight", "layers.1.engram.embed.weight",
                 f"mtp.{cfg.n_mtp_layers - 1}.markov_head.embed.weight"):
        assert routes[name].kind == "sinkhorn", name
    assert routes["layers.1.engram.embed.weight"].lr_mult == 5.0
    assert routes["layers.0.ffn.experts.0.w1.weight"].kind == "muon"
    assert routes["layers.0.hc_attn_fn"].kind == "adamw" and routes["layers.0.hc_attn_fn"].decay
    assert routes["layers.0.attn_norm.weight"].kind == "adamw" and not routes["layers.0.attn_norm.weight"].decay
    assert routes["layers.0.ffn.gate.bias"].kind == "excluded"
    adamw = {r.name: r for r in route_parameters(model, cfg, "adamw")}
    assert {r.kind for r in adamw.values()} == {"adamw", "excluded"}
    assert "muon_headwise" in format_routing(list(routes.values()))
    # every optimizer leaves the excluded gate biases alone
    opt = build_optimizers(model, list(routes.values()), 1e-3)
    owned = {id(p) for p in opt.params()}
    assert id(model.layers[0].ffn.gate.bias) not in owned


def test_adamw_route_equals_torch_adamw():
    torch.manual_seed(5)
    cfg = load_config("debug")
    model = random_model(cfg)
    twin = random_model(cfg)
    routes = route_parameters(model, cfg, "adamw")
    opt = build_optimizers(model, routes, lr=2e-3, weight_decay=0.1)
    kinds = {r.name: r for r in routes}
    decay = [p for n, p in twin.named_parameters() if kinds[n].kind == "adamw" and kinds[n].decay]
    nodecay = [p for n, p in twin.named_parameters() if kinds[n].kind == "adamw" and not kinds[n].decay]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            g = torch.randn_like(p) if kinds[n].kind == "adamw" else None
            p.grad, q.grad = g, (None if g is None else g.clone())
        opt.set_lr_factor(0.5 + 0.25 * step)
        for grp in ref.param_groups:
            grp["lr"] = 2e-3 * (0.5 + 0.25 * step)
        opt.step()
        ref.step()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), n
