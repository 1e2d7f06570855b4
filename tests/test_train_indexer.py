"""The indexer's training objective (`dsv41.train.indexer_loss`): the KL's gradient against its closed form and
finite differences, the isolation of the main model (its gradients bit for bit the same with and without the
objective, the indexers' only gradient is the objective's), the fast and reference forwards giving the same
objective, the two supports agreeing where they must (top-k = every entry), and the objective teaching the
indexer: its recall of the attention's top-k rises as the KL falls."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.model.common import set_quantization
from dsv41.model.init import init_weights
from dsv41.model.transformer import Transformer
from dsv41.train.indexer_loss import IndexerTap, indexer_kl, indexer_recall, kl_rows
from dsv41.train.pretrain import LMTrainModule
from dsv41.train.qat import TrainCache


pytestmark = pytest.mark.usefixtures("one_thread")         # tests/conftest.py


def _model(preset: str = "debug", **fields):
    cfg = load_config(preset)
    if fields:
        cfg = cfg.replace(**fields)
    m = Transformer(cfg, dtype=torch.float32)
    init_weights(m, 0)
    set_quantization(m, False)
    return m.train()


def _batch(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (B, T), generator=g), torch.randint(3, 200, (B, T), generator=g)


def _support_and_target(B=3, T=5, N=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    support = torch.rand(B, T, N, generator=g) < 0.6
    support[0, 0] = False                                          # a row with no entry
    p = torch.rand(B, T, N, generator=g, dtype=dtype).masked_fill(~support, 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return p, torch.randn(B, T, N, generator=g, dtype=dtype), support


def test_kl_gradient_is_softmax_minus_target():
    p, s, support = _support_and_target()
    s.requires_grad_(True)
    kl, has = kl_rows(p, s, support)
    kl.sum().backward()
    q = torch.softmax(s.detach().masked_fill(~support, -torch.inf), dim=-1).nan_to_num(0.0)
    want = torch.where(support & has.unsqueeze(-1), q - p, 0.0)
    torch.testing.assert_close(s.grad, want, rtol=1e-12, atol=1e-12)
    assert not has[0, 0] and float(kl[0, 0].detach()) == 0.0
    # the value is the KL itself
    row = support[1, 2]
    direct = (p[1, 2, row] * (p[1, 2, row].log() - torch.log_softmax(s.detach()[1, 2, row], -1))).sum()
    torch.testing.assert_close(kl[1, 2].detach(), direct)


def test_kl_gradient_finite_differences():
    p, s, support = _support_and_target(seed=1)
    assert torch.autograd.gradcheck(lambda x: kl_rows(p, x, support)[0], (s.requires_grad_(True),))


def _grads(m, x, y, weight: float, fast: bool) -> tuple[dict, float]:
    m.zero_grad(set_to_none=True)
    loss, metrics = LMTrainModule(m, fast=fast, indexer_loss_weight=weight)(x, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, metrics.get("indexer_kl")


@pytest.mark.parametrize("preset,shape", [("debug", (3, 32)), ("tiny", (1, 128))])
@pytest.mark.parametrize("fast", [False, True])
def test_main_model_gradients_unchanged(preset, shape, fast):
    m = _model(preset)
    x, y = _batch(*shape)
    off, _ = _grads(m, x, y, 0.0, fast)
    on, kl = _grads(m, x, y, 1.0, fast)
    indexer = {n for n in on if ".indexer." in n}
    assert kl > 0
    assert not any(".indexer." in n for n in off)                 # no gradient path without the objective
    n_sources = len(m.cfg.index_source_layers)
    assert len({n.split(".attn")[0] for n in indexer}) == n_sources   # every index source, Reindex ones too
    assert any(".indexer.wk." in n for n in indexer) and any(".indexer.k_norm." in n for n in indexer)
    assert set(on) - indexer == set(off)
    for n, g in off.items():
        assert torch.equal(on[n], g), n                           # bit for bit


def test_fast_and_reference_give_the_same_objective():
    m = _model("tiny")
    x, y = _batch(1, 128, seed=3)
    ref, kl_ref = _grads(m, x, y, 1.0, fast=False)
    fast, kl_fast = _grads(m, x, y, 1.0, fast=True)
    assert kl_ref == pytest.approx(kl_fast, rel=1e-5)
    for n in (n for n in ref if ".indexer." in n):
        torch.testing.assert_close(fast[n], ref[n], rtol=1e-3, atol=1e-6 * float(ref[n].abs().max()))


def _objective(m, x, support: str) -> torch.Tensor:
    with IndexerTap(m) as tap:
        m(x, TrainCache(m.cfg, x.size(0), m.dtype), 0)
    return indexer_kl(m, tap, support)


def test_supports_agree_at_full_topk():
    """top-k = every entry: the selected set is the visible set, so the sparse objective is the dense one; below
    that they differ (the test can fail)."""
    x, _ = _batch(2, 32)
    full = _model(index_topk=64, candidate_topk_blocks=16)
    torch.testing.assert_close(_objective(full, x, "selected"), _objective(full, x, "visible"), rtol=1e-6, atol=0)
    cut = _model()
    assert abs(float(_objective(cut, x, "selected").detach()) - float(_objective(cut, x, "visible").detach())) > 1e-4
    with pytest.raises(ValueError, match="support"):
        _objective(cut, x, "all")


def _recall(m, x) -> dict:
    with torch.no_grad(), IndexerTap(m) as tap:
        m(x, TrainCache(m.cfg, x.size(0), m.dtype), 0)
        return indexer_recall(m, tap)


def test_objective_teaches_the_indexer():
    """A few dozen Adam steps on the indexers alone: the KL falls and the recall of the attention's top-k rises
    above its value at init (which sits near chance)."""
    torch.manual_seed(0)
    m = _model()
    x, _ = _batch(4, 32, seed=5)
    before = _recall(m, x)
    assert before["rows"] > 0 and 0 <= before["recall"] <= 1
    params = [p for n, p in m.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(params, lr=1e-2)
    first = None
    for _ in range(40):
        opt.zero_grad()
        loss = _objective(m, x, "visible")
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    after = _recall(m, x)
    assert float(_objective(m, x, "visible").detach()) < 0.5 * first
    assert after["recall"] > before["recall"] + 0.1, (before, after)
