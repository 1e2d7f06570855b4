"""Guards the fused mHC step: the reference (`mhc_fused_ref`, built from the model's functions) against docs/model.md
section 2 written out independently in float64 (CPU), the dispatch, and (marked gpu) the Triton kernel against the
reference on fresh random inputs: ragged token counts, widths that are not a multiple of the chunk, one token; both
the split path for few tokens and the tiled path for many, each run twice with the same bits."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dsv41.kernels import backend as kb
from dsv41.kernels import mhc_fused, mhc_fused_ref


def mhc_case(B=2, T=5, D=64, S=4, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random inputs of one step: coefficients shaped like real ones (post in (0, 2), comb column-stochastic)."""
    g = torch.Generator().manual_seed(seed)
    M = (2 + S) * S
    f = torch.randn(B, T, D, generator=g).to(dtype)
    x = torch.randn(B, T, S, D, generator=g).to(dtype)
    post = 2 * torch.rand(B, T, S, generator=g)
    comb = torch.rand(B, T, S, S, generator=g)
    comb = comb / comb.sum(-2, keepdim=True)
    pre = torch.rand(B, T, S, generator=g) + 1e-6
    fn = torch.randn(M, S * D, generator=g) / (S * D) ** 0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(M, generator=g) * 0.5
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    args = [f, x, post, comb, pre, fn, scale, base, nw]
    return [a.to(device) for a in args] + [20, 1e-6, 1e-20, 1e-20]


def spec_step(f, x, post, comb, pre, fn, scale, base, nw, iters, eps, norm_eps, rms_eps):
    """docs/model.md §2 items 3-6 in float64, loops as written there."""
    f, x, post, comb, pre, fn = (t.double() for t in (f, x, post, comb, pre, fn))
    scale, base, nw = scale.double(), base.double(), nw.double()
    S = x.size(-2)
    y = torch.stack([post[..., k, None] * f + sum(comb[..., j, k, None] * x[..., j, :] for j in range(S))
                     for k in range(S)], dim=-2)
    flat = y.flatten(-2)
    rho = (flat.square().mean(-1, keepdim=True) + norm_eps).rsqrt()
    mix = (flat @ fn.T) * rho
    pre_n = torch.sigmoid(mix[..., :S] * scale[0] + base[:S]) + eps
    post_n = 2 * torch.sigmoid(mix[..., S:2 * S] * scale[1] + base[S:2 * S])
    C = (mix[..., 2 * S:] * scale[2] + base[2 * S:]).unflatten(-1, (S, S)).softmax(-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    h = sum(pre[..., j, None] * y[..., j, :] for j in range(S))
    h = h * (h.square().mean(-1, keepdim=True) + rms_eps).rsqrt() * nw
    return y, h, pre_n, post_n, C


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_mhc_fused_ref_is_the_spec():
    """float32 reference (no bf16 rounding between the stages) = the spec in float64 to fp32 accuracy."""
    args = mhc_case(B=2, T=7, D=48, dtype=torch.float32, seed=1)
    got, want = mhc_fused_ref(*args), spec_step(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel(g, w) < 1e-5


def test_mhc_fused_ref_bf16_roundings():
    """bf16: y and h are bf16 (the model's casts), the coefficients fp32 and close to the float64 spec."""
    args = mhc_case(B=1, T=4, D=64, seed=2)
    y, h, p, q, C = mhc_fused_ref(*args)
    assert y.dtype == h.dtype == torch.bfloat16 and p.dtype == q.dtype == C.dtype == torch.float32
    sy, sh, sp, sq, sC = spec_step(*args)
    assert rel(y, sy) < 1e-2 and rel(h, sh) < 1e-2
    assert rel(C, sC) < 1e-2 and torch.allclose(C.sum(-2), torch.ones_like(C.sum(-2)), atol=1e-4)


def test_mhc_dispatch_cpu_is_reference():
    saved = dict(kb._state)
    try:
        kb.set_backend("auto")
        args = mhc_case(seed=3)
        for a, b in zip(mhc_fused(*args), mhc_fused_ref(*args)):
            assert torch.equal(a, b)
    finally:
        kb._state.clear()
        kb._state.update(saved)


# (B, T, D): up to 64 tokens the split path (1, 40, 64 tokens), above it the tiled path (74, 300, 195, 1100 tokens);
# widths that are and are not multiples of the chunks (256 channels) and tiles.
MHC_GPU_CASES = [(1, 1, 5120), (2, 20, 200), (1, 64, 1040), (2, 37, 5120), (1, 300, 200), (3, 65, 512),
                 (1, 1100, 1040)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MHC_GPU_CASES)
def test_mhc_fused_triton(shape):
    """The kernel against the reference, and run twice: bit-identical (no order depends on scheduling: the partials
    are summed in chunk order)."""
    from dsv41.kernels.triton import mhc_fused_triton
    B, T, D = shape
    args = mhc_case(B=B, T=T, D=D, device="cuda", seed=sum(shape))
    ref = mhc_fused_ref(*args)
    out = mhc_fused_triton(*args)
    again = mhc_fused_triton(*args)
    torch.cuda.synchronize()
    names = ("y", "h", "pre", "post", "comb")
    errs = {n: rel(o, r) for n, o, r in zip(names, out, ref)}
    mism = {n: float((o != r).float().mean()) for n, o, r in zip(names[:2], out, ref)}
    print(f"\nMAXERR mhc_fused {shape}: {errs} bf16 mismatches {mism}")
    for n, o, r, a in zip(names, out, ref, again):
        assert o.shape == r.shape and o.dtype == r.dtype and torch.isfinite(o).all(), n
        assert torch.equal(o, a), f"{n} differs between two runs"
    coef_tol = 1e-4                          # fp32 projection over 20480 terms, tensor-core accumulation order
    assert errs["y"] < 1e-3 and errs["h"] < 4e-3
    assert max(errs["pre"], errs["post"], errs["comb"]) < coef_tol


@pytest.mark.gpu
def test_mhc_fn_cache_is_per_tensor():
    """A new fn that lands on a freed fn's memory (same address, shape and version) must not reuse the tiled path's
    permuted copy of the old one: the cause of the wrong coefficients earlier runs showed for some configs."""
    from dsv41.kernels.triton import mhc_fused_triton
    args = mhc_case(B=1, T=80, D=256, device="cuda", seed=11)                 # 80 tokens: the tiled path
    mhc_fused_triton(*args)
    ptr = args[5].data_ptr()
    args[5] = None
    torch.cuda.synchronize()
    args[5] = (torch.randn(24, 4 * 256, generator=torch.Generator().manual_seed(12)) / 32).cuda()  # same size
    if args[5].data_ptr() != ptr:
        pytest.skip("the allocator did not reuse the address")
    out, ref = mhc_fused_triton(*args), mhc_fused_ref(*args)
    assert rel(out[4], ref[4]) < 1e-4 and rel(out[2], ref[2]) < 1e-4


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else []))
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 200), (1, 1, 5120)])
def test_hc_mixes_kernel(device, shape):
    """`hc_mixes_triton` (the mixes alone, a program per token) against `mhc_math.hc_mixes`: the same coefficients
    up to the fp32 projection's summation order; the reference's shapes; one call equals the next."""
    from dsv41.kernels.mhc_math import hc_mixes as hc_mixes_ref
    from dsv41.kernels.triton import hc_mixes_triton
    B, T, D = shape
    _, x, _, _, _, fn, scale, base, _, iters, eps, norm_eps, _ = mhc_case(B=B, T=T, D=D, device=device, seed=D)
    ref = hc_mixes_ref(x, fn, scale, base, 4, iters, eps, norm_eps)
    out = hc_mixes_triton(x, fn, scale, base, 4, iters, eps, norm_eps)
    again = hc_mixes_triton(x, fn, scale, base, 4, iters, eps, norm_eps)
    for n, o, r, a in zip(("pre", "post", "comb"), out, ref, again):
        assert o.shape == r.shape and o.dtype == r.dtype and torch.equal(o, a), n
        assert rel(o, r) < 1e-5, (n, rel(o, r))
    with pytest.raises(ValueError, match="4 streams"):
        hc_mixes_triton(x[..., :3, :], fn, scale, base, 3, iters, eps, norm_eps)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else []))
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 200), (1, 5, 5120)])
def test_hc_post_kernel_is_the_reference_bit_for_bit(device, shape):
    """`hc_post_triton` (the residual update alone) equals `mhc_math.hc_post` bit for bit on bf16 streams (the
    same operations in the same order, no fused multiply-adds); through `dsv41.kernels.hc_post` too."""
    from dsv41.kernels import hc_post
    from dsv41.kernels.mhc_math import hc_post as hc_post_ref
    from dsv41.kernels.triton import hc_post_triton
    B, T, D = shape
    g = torch.Generator().manual_seed(D + T)
    f = torch.randn(B, T, D, generator=g).bfloat16().to(device)
    x = torch.randn(B, T, 4, D, generator=g).bfloat16().to(device)
    post = (torch.rand(B, T, 4, generator=g) * 2).to(device)
    comb = torch.rand(B, T, 4, 4, generator=g).to(device)
    ref = hc_post_ref(f, x, post, comb)
    out = hc_post_triton(f, x, post, comb)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, 4, D)
    assert torch.equal(out, ref)
    if device == "cuda":
        assert torch.equal(hc_post(f, x, post, comb), ref)
    with pytest.raises(ValueError, match="4 streams"):
        hc_post_triton(f, x[..., :3, :], post[..., :3], comb[..., :3, :3])
