"""Guards the MoE experts op: its reference over weight lists equals the model's module loop bit for bit (CPU, with
and without quantization, unused experts, ties of routing weights), the model keeps the module loop on CPU and
whenever experts have hooks or disagree on quantization, and (marked gpu) the Triton kernels against the reference
and the model's fused decode path against its module loop."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dsv41.config import load_config
from dsv41.kernels import moe_experts, moe_experts_ref
from dsv41.kernels.moe_ref import moe_route_ref
from dsv41.kernels.choice import FUSED_MOE_MAX_TOKENS
from dsv41.model.common import set_quantization
from dsv41.model.moe import MoE


def make_moe(quant=True, dim=64, inter=64, experts=6, topk=3, dtype=torch.bfloat16, device="cpu", seed=0):
    cfg = load_config("debug")
    cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts, cfg.n_activated_experts = dim, inter, experts, topk
    torch.manual_seed(seed)
    moe = MoE(cfg, layer_id=5, dtype=dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=dim ** -0.5) if p.dim() == 2 else torch.nn.init.normal_(p, std=0.1)
    set_quantization(moe, quant)
    return moe.to(device).requires_grad_(False)


@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_moe_experts_ref_is_the_module_loop(quant, n):
    moe = make_moe(quant)
    x = torch.randn(n, moe.dim).bfloat16() * 3
    weights, indices, _ = moe.gate(x)
    w = moe.fused_weights()
    assert w is not None and w[3] == quant and w[4] == quant
    ref = moe_experts_ref(x, indices, weights, *w[:3], moe.shared_experts.limit, *w[3:])
    assert torch.equal(ref, moe.module_loop(x, indices, weights))
    assert torch.equal(moe(x.view(1, n, -1)).view(n, -1), ref)                  # CPU: the module loop
    assert torch.equal(moe_experts(x, indices, weights, *w[:3], moe.shared_experts.limit, *w[3:]), ref)


def test_moe_fused_weights_declines():
    moe = make_moe()
    moe.shared_experts.w3.quant = False                                         # one Linear without the QDQ
    assert moe.fused_weights() is None
    moe = make_moe()
    moe.experts[2].register_forward_hook(lambda *a: None)
    assert moe.fused_weights() is None


def routing(n, k, e, seed=0):
    """Random top-k routing: [n, k] distinct expert ids of e per row, fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, e, generator=g).argsort(1)[:, :k], torch.rand(n, k, generator=g)


@pytest.mark.parametrize("n,k,e", [(1, 6, 16), (5, 3, 6), (40, 2, 8)])
def test_moe_route_ref_is_the_slot_order_by_definition(n, k, e):
    """The fused op's slots, built here from their definition: token t's pairs are its experts ascending then the
    shared expert (id e), pair p = t (k + 1) + r; slots list the pairs by expert, tokens ascending within one."""
    indices, weights = routing(n, k, e, seed=n)
    order, inv, pw, counts, offs = moe_route_ref(indices, weights, e)
    pairs = []                                          # (expert, pair, weight)
    for t in range(n):
        row = sorted(zip(indices[t].tolist(), weights[t].tolist())) + [(e, 1.0)]
        pairs += [(ex, t * (k + 1) + r, w) for r, (ex, w) in enumerate(row)]
    by_slot = sorted(pairs)
    assert order.tolist() == [p for _, p, _ in by_slot]
    assert inv[order].tolist() == list(range(n * (k + 1)))
    assert pw.tolist() == [w for _, _, w in sorted(pairs, key=lambda x: x[1])]
    assert counts.tolist() == [sum(ex == x for ex, _, _ in pairs) for x in range(e + 1)]
    assert offs.tolist() == [sum(ex < x for ex, _, _ in pairs) for x in range(e + 1)]


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else []))
@pytest.mark.parametrize("n,k,e", [(1, 6, 16), (5, 3, 6), (64, 6, 16), (37, 8, 256), (146, 6, 256)])
def test_moe_route_kernel_equals_its_reference(device, n, k, e):
    """The one-program routing kernel (decode sizes, up to ROUTE_MAX_PAIRS pairs) gives `moe_route_ref`'s integer
    slots and weights exactly; bf16 weights are read as the reference's fp32 cast."""
    from dsv41.kernels.triton.moe_kernel import ROUTE_MAX_PAIRS, moe_route_triton
    indices, weights = routing(n, k, e, seed=k)
    assert n * (k + 1) <= ROUTE_MAX_PAIRS
    for w in (weights, weights.bfloat16()):
        want = moe_route_ref(indices, w, e)
        got = moe_route_triton(indices.to(device), w.to(device), e)
        for name, a, b in zip(("order", "inv", "pw", "counts", "offs"), got, want):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name
    with pytest.raises(ValueError, match="at most"):
        moe_route_triton(*routing(ROUTE_MAX_PAIRS // (k + 1) + 1, k, e), e)


# ------------------------------------------------------------------------------------------ GPU

def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.parametrize("shape", [(1, 64, 64, 6, 3), (16, 256, 96, 8, 2), (64, 512, 2304 // 8, 16, 6),
                                   (3, 5120, 2304, 16, 6), (512, 1024, 256, 16, 6)])     # the last: a prefill size
def test_moe_experts_triton(quant, shape):
    from dsv41.kernels.triton import moe_experts_triton
    n, dim, inter, experts, topk = shape
    moe = make_moe(quant, dim, inter, experts, topk, device="cuda", seed=n)
    x = torch.randn(n, dim, device="cuda").bfloat16() * 3
    weights, indices, _ = moe.gate(x)
    w = moe.fused_weights()
    ref = moe_experts_ref(x, indices, weights, *w[:3], moe.shared_experts.limit, *w[3:])
    out = moe_experts_triton(x, indices, weights, *w[:3], moe.shared_experts.limit, *w[3:])
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    print(f"\nMAXERR moe_experts {shape} quant={quant}: rel {err:.2e} max|d| {float((out - ref).abs().max()):.2e}")
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    assert err < 2e-2


@pytest.mark.gpu
def test_moe_decode_uses_the_op_on_cuda():
    moe = make_moe(device="cuda", dim=256, inter=128, experts=8, topk=2)
    x = torch.randn(1, 4, 256, device="cuda").bfloat16()
    with torch.no_grad():
        fused = moe(x)
        weights, indices, _ = moe.gate(x.view(4, -1))
        ref = moe.module_loop(x.view(4, -1), indices, weights).view_as(fused)
    assert rel_err(fused, ref) < 2e-2
    big = torch.randn(1, FUSED_MOE_MAX_TOKENS + 1, 256, device="cuda").bfloat16()
    with torch.no_grad():                                                      # above the cut: the module loop
        weights, indices, _ = moe.gate(big.view(-1, 256))
        assert torch.equal(moe(big).view(-1, 256), moe.module_loop(big.view(-1, 256), indices, weights))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else []))
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("n,e,k,temp,norm", [(1, 16, 6, 1.0, True), (5, 256, 8, 0.7, True), (3, 12, 1, 1.0, False),
                                             (2, 16, 6, 1.0, False)])
def test_moe_gate_kernel(device, score_func, n, e, k, temp, norm):
    """The gate in one program per token against `moe_gate_ref`: the same experts in the same order, the scores
    and weights up to the fp32 projection's summation order; bf16 and fp32 gate weights."""
    from dsv41.kernels.moe_ref import moe_gate_ref
    from dsv41.kernels.triton import moe_gate_triton
    g = torch.Generator().manual_seed(e + k)
    D = 320
    x = (torch.randn(n, D, generator=g) * 3).bfloat16().to(device)
    bias = (torch.randn(e, generator=g) * 0.1).to(device)
    for w in (torch.randn(e, D, generator=g) / D ** 0.5, (torch.randn(e, D, generator=g) / D ** 0.5).bfloat16()):
        w = w.to(device)
        args = (x, w, bias, k, score_func, temp, norm, 1.5)
        (rw, ri, rs), (gw, gi, gs) = moe_gate_ref(*args), moe_gate_triton(*args)
        assert gi.dtype == ri.dtype and torch.equal(gi.cpu(), ri.cpu())
        assert gw.shape == rw.shape and gs.shape == rs.shape
        assert rel_err(gw, rw) < 1e-5 and rel_err(gs, rs) < 1e-5
    with pytest.raises(ValueError, match="score_func"):
        moe_gate_triton(x, w, bias, k, "relu", temp, norm, 1.5)
