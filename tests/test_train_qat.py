"""Guards QAT (docs/system.md §6): the straight-through FP4 main-KV quantizer gives the QDQ values forward and the
identity gradient backward, and the training cache applies it to exactly the compressed entries the model
stores, with gradients still reaching the compressor."""

from __future__ import annotations

import torch

from dsv41.codecs import qdq_main_kv
from dsv41.config import load_config
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.train.qat import TrainCache, qdq_main_kv_ste, straight_through


def test_ste_forward_qdq_backward_identity():
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 2).requires_grad_()
    y = qdq_main_kv_ste(x)
    assert torch.equal(y.detach(), qdq_main_kv(x.detach()))
    assert not torch.equal(y.detach(), x.detach())
    w = torch.randn(3, 5, 64)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)
    z = torch.randn(4, requires_grad=True)
    straight_through(z, torch.round).sum().backward()
    assert torch.equal(z.grad, torch.ones(4))


def test_train_cache_qat_on_compressed_entries():
    cfg = load_config("debug")
    model = random_model(cfg)
    set_quantization(model, False)
    ids = torch.randint(3, 500, (2, 24))
    plain, qat = TrainCache(cfg, 2, torch.float32), TrainCache(cfg, 2, torch.float32, kv_qat=True)
    out_p = model(ids, plain, 0)
    out_q = model(ids, qat, 0)
    L = cfg.kv_source_layers[0]
    n = int(plain.rows[L].max())
    assert n > 0
    torch.testing.assert_close(qat.ckv[L][:, :n], qdq_main_kv(plain.ckv[L][:, :n]), atol=0, rtol=0)
    assert not torch.equal(out_p.logits, out_q.logits)
    out_q.logits.logsumexp(-1).mean().backward()
    g = model.layers[L].attn.compressor.wkv.weight.grad
    assert g is not None and g.abs().sum() > 0
