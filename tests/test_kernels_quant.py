"""Guards the FP8 quantizer ops (activation QDQ, packed SWA-KV rows, the expert's SwiGLU + QDQ): the dispatch (CPU:
the references; an explicit Triton backend on CPU is an error), and (marked gpu) each Triton kernel bit-identical to
its reference on fresh random inputs: bf16 and fp32, one group to many, magnitudes across the fp32 range, exact
ties, values past 448 * scale, zeros, NaN and inf."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dsv41.codecs import pack_swa_kv as codec_pack_swa_kv
from dsv41.codecs import qdq_fp8 as codec_qdq_fp8
from dsv41.codecs import unpack_swa_kv
from dsv41.kernels import backend as kb
from dsv41.kernels import expert_act, expert_act_ref, pack_swa_kv, qdq_fp8, qdq_fp8_ref


def quant_case(shape, dtype, seed):
    """Random activations with a per-group magnitude spread over many binades, some exact E4M3 ties, zero groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    groups = x.unflatten(-1, (shape[-1] // 32, 32))
    groups *= torch.exp2(torch.randint(-30, 30, groups.shape[:-1] + (1,), generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randint(0, n, (max(1, n // 50),), generator=g)
    flat[pick] = torch.exp2(torch.randint(-8, 8, pick.shape, generator=g).float()) * 1.0625   # halfway mantissas
    if n >= 64:
        flat[:32] = 0.0                                                                       # an all-zero group
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


def test_qdq_fp8_dispatch_cpu_is_the_codec(restore_backend):
    assert qdq_fp8_ref is codec_qdq_fp8
    kb.set_backend("auto")
    x = quant_case((3, 5, 96), torch.bfloat16, 0)
    assert torch.equal(qdq_fp8(x), codec_qdq_fp8(x))
    assert torch.equal(pack_swa_kv(x), codec_pack_swa_kv(x))
    assert torch.equal(unpack_swa_kv(pack_swa_kv(x)).to(x.dtype), qdq_fp8(x))
    kb._state["triton"] = True                         # present, but CPU inputs: an explicit request is an error
    kb.set_backend("triton")
    with pytest.raises(ValueError, match="CUDA"):
        qdq_fp8(x)
    with pytest.raises(ValueError, match="CUDA"):
        pack_swa_kv(x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 32), (1, 1, 5120), (3, 7, 2304), (2, 1, 64 * 512), (4099, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qdq_fp8_triton_is_bit_identical(shape, dtype, restore_backend):
    from dsv41.kernels.triton import qdq_fp8_triton
    for seed in range(3):
        x = quant_case(shape, dtype, seed).cuda()
        ref = codec_qdq_fp8(x)
        out = qdq_fp8_triton(x)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert same_bits(out, ref), f"shape {shape} {dtype} seed {seed}: {int((out != ref).sum())} values differ"
    kb.set_backend("triton")
    with torch.no_grad():
        assert same_bits(qdq_fp8(x), ref)


@pytest.mark.gpu
def test_qdq_fp8_triton_nonfinite_groups():
    from dsv41.kernels.triton import qdq_fp8_triton
    x = quant_case((4, 128), torch.float32, 7)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = -float("inf")
    x[3, 100] = 3.0e38                                   # finite, the largest scales
    x = x.cuda()
    out, ref = qdq_fp8_triton(x), codec_qdq_fp8(x)
    assert same_bits(out, ref)
    assert torch.isnan(out[0, :32]).all() and torch.isnan(out[1, 32:64]).all() and torch.isfinite(out[0, 32:]).all()
    # a non-contiguous input and a non-multiple of 32 as in the reference
    y = quant_case((6, 64), torch.bfloat16, 8).cuda().t().contiguous().t()
    assert same_bits(qdq_fp8_triton(y), codec_qdq_fp8(y))
    with pytest.raises(ValueError, match="multiple of 32"):
        qdq_fp8_triton(torch.zeros(3, 40, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 32), (2, 1, 512), (3, 9, 512), (5, 160), (700, 64)])
def test_pack_swa_kv_triton_is_bit_identical(shape):
    from dsv41.kernels.triton import pack_swa_kv_triton
    for seed in range(3):
        for dtype in (torch.bfloat16, torch.float32):
            x = quant_case(shape, dtype, seed).cuda()
            out, ref = pack_swa_kv_triton(x), codec_pack_swa_kv(x)
            assert out.dtype == torch.uint8 and out.shape == ref.shape
            assert torch.equal(out, ref), f"{shape} {dtype} seed {seed}: {int((out != ref).sum())} bytes differ"
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_swa_kv_triton(torch.zeros(3, 40, device="cuda"))


def act_case(n, F, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(n, F, generator=g) * 6).bfloat16()          # past the clamp limit of 10 at the tails
    up = (torch.randn(n, F, generator=g) * 6).bfloat16()
    w = torch.rand(n, 1, generator=g)
    return gate.to(device), up.to(device), w.to(device)


def test_expert_act_ref_is_the_expert_middle(restore_backend):
    """The op is the expert's own math: with it, Expert.forward = w2(QDQ(bf16(weights * silu(min(w1 x, L)) *
    clamp(w3 x, -L, L)))) written out here."""
    from dsv41.model.moe import Expert
    torch.manual_seed(0)
    ex = Expert(64, 96, "fp4", torch.bfloat16, 10.0)
    for p in ex.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(5, 64).bfloat16() * 4
    w = torch.rand(5, 1)
    xq = codec_qdq_fp8(x)
    gate, up = (xq @ ex.w1.weight.T).float().clamp(max=10.0), (xq @ ex.w3.weight.T).float().clamp(-10.0, 10.0)
    h = codec_qdq_fp8((w * (torch.nn.functional.silu(gate) * up)).bfloat16())
    with torch.no_grad():
        assert torch.equal(ex(x, w), h @ ex.w2.weight.T)
    gate, up, w = act_case(3, 64, 1)
    assert torch.equal(expert_act(gate, up, w, 10.0, True, torch.bfloat16),
                       expert_act_ref(gate, up, w, 10.0, True, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("n,F", [(1, 2304), (7, 2304), (33, 96), (300, 2048)])
def test_expert_act_triton_is_bit_identical(n, F):
    from dsv41.kernels.triton import expert_act_triton
    for seed in range(3):
        gate, up, w = act_case(n, F, seed, "cuda")
        for kw in (dict(weights=w, limit=10.0, quantize=True), dict(weights=None, limit=10.0, quantize=True),
                   dict(weights=w, limit=0.0, quantize=True), dict(weights=w, limit=10.0, quantize=False)):
            ref = expert_act_ref(gate, up, dtype=torch.bfloat16, **kw)
            out = expert_act_triton(gate, up, dtype=torch.bfloat16, **kw)
            what = {k: (v is not None if k == "weights" else v) for k, v in kw.items()}
            assert same_bits(out, ref), f"{n}x{F} seed {seed} {what}: {int((out != ref).sum())} of {out.numel()} differ"


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)] + (["cpu"] if INTERPRETER else []))
@pytest.mark.parametrize("shape", [(1, 1, 32), (1, 64, 128), (3, 7, 2304)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qdq_index_k_triton_is_bit_identical(device, shape, dtype):
    """The indexer's MXFP4 QDQ kernel equals the codec bit for bit (signed zeros included) on magnitudes across
    the fp32 range, halfway values of the E2M1 grid, values past 6 * scale and zero groups; a NaN group is NaN."""
    from dsv41.codecs import qdq_index_k as codec_qdq_index_k
    from dsv41.kernels.triton import qdq_index_k_triton
    for seed in range(3):
        x = quant_case(shape, dtype, seed)
        flat = x.view(-1)
        flat[1::37] = -0.0
        flat[2::41] = flat[2::41].sign() * 0.75 * flat[2::41].abs().amax()            # E2M1 halfway points
        x = x.to(device)
        out, ref = qdq_index_k_triton(x), codec_qdq_index_k(x)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert same_bits(out.cpu(), ref.cpu()), f"{shape} {dtype} seed {seed}: {int((out != ref).sum())} differ"
    x = quant_case(shape, dtype, 0).to(device)
    x.view(-1)[3] = float("nan")
    assert torch.isnan(qdq_index_k_triton(x).view(-1)[:32]).all()
