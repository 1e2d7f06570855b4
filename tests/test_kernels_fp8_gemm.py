"""Guards the prefill GEMM on the FP8 tensor cores (`dsv41.kernels.triton.fp8_gemm`): x's e4m3 codes and per-32
power-of-two scales are exact for a QDQ'd x (CPU: the reference; GPU: the kernel equals it bit for bit), and the
GEMM with its per-block promotion follows `packed_linear_ref` (the weight dequantized, one F.linear) within the FP8
tensor cores' in-block accumulation error (measured values printed with pytest -s), for fp32 and bf16 outputs, odd
shapes, bias; `packed_linear_triton` sends prefill-size fp8 calls of a bf16 model there
when FP8_PREFILL is on."""

from __future__ import annotations

import pytest
import torch

from dsv41.codecs import qdq_fp8
from dsv41.kernels.gemm_ref import packed_linear_ref, quant_rows_ref
from tests.test_kernels_packed_gemm import packed, rel_rows


def test_codes_and_scales_of_a_qdq_input_are_exact():
    x = qdq_fp8(torch.randn(37, 320, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 320))
    x[3] = 0.0
    q, s = quant_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 10)
    assert torch.equal((q.float().unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2), x)
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))          # powers of two
    raw = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))          # not QDQ'd: not exact
    q, s = quant_rows_ref(raw)
    assert not torch.equal((q.float().unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2), raw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_rows_kernel_equals_reference(dtype):
    from dsv41.kernels.triton.fp8_gemm import quant_rows_triton
    x = qdq_fp8((torch.randn(70, 512, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)).cuda()
    x[5] = 0.0
    q, s = quant_rows_triton(x)
    rq, rs = quant_rows_ref(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("M,N,K", [(65, 100, 160), (300, 72, 512), (1000, 2304, 1280), (4096, 512, 5120)])
def test_fp8_gemm_follows_the_reference(M, N, K, blocks, monkeypatch):
    """Both loop shapes (one K block a step, or two with both dots issued first; K = 160 leaves one block over)."""
    from dsv41.kernels.triton import fp8_gemm
    from dsv41.kernels.triton.fp8_gemm import fp8_linear_triton
    monkeypatch.setitem(fp8_gemm.PREFILL_CONFIG, "blocks", blocks)
    w = packed(N, K, "fp8", dtype=torch.bfloat16, device="cuda", seed=M)
    x = qdq_fp8((torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3).bfloat16()).cuda()
    for bias in (None, torch.randn(N).bfloat16().cuda()):
        want = packed_linear_ref(x.float(), _as_fp32(w), None if bias is None else bias.float())
        got = fp8_linear_triton(x, w, bias, out_dtype=torch.float32)
        assert got.shape == (M, N) and got.dtype == torch.float32
        err = rel_rows(got, want)
        print(f"fp8 GEMM M {M} N {N} K {K} bias {bias is not None}: fp32 output, max relative row error {err:.2e}")
        assert err < 2e-4         # measured 0.7-1.0e-4 on an H100: the FP8 tensor cores' in-block accumulation
        got16 = fp8_linear_triton(x, w, bias)
        assert got16.dtype == torch.bfloat16
        assert rel_rows(got16, want) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("M,N,K", [(1, 2304, 1024), (5, 100, 160), (16, 520, 2048), (33, 64, 4096), (64, 300, 512)])
def test_fp8_decode_follows_the_reference(kind, M, N, K):
    """The decode kernel on the FP8 tensor cores (swap AB, fp4 nibbles as E4M3 bytes, split-K summed in the kernel)
    against the reference, bf16 output: within a bf16 rounding plus the FP8 MMA's in-block accumulation."""
    from dsv41.kernels.triton.fp8_decode import FP8_DECODE_CONFIG, fp8_decode_triton
    w = packed(N, K, kind, dtype=torch.bfloat16, device="cuda", seed=M)
    x = qdq_fp8((torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3).bfloat16()).cuda()
    for bias in (None, torch.randn(N).bfloat16().cuda()):
        want = packed_linear_ref(x.float(), _as_fp32(w), None if bias is None else bias.float())
        for per_sm in (1, 16):                     # unsplit and split along K
            got = fp8_decode_triton(x, w, bias, config={**FP8_DECODE_CONFIG, "block_n": 64, "programs_per_sm": per_sm})
            assert got.shape == (M, N) and got.dtype == torch.bfloat16
            err = rel_rows(got, want)
            print(f"fp8 decode {kind} M {M} N {N} K {K} split {per_sm}: max relative row error {err:.2e}")
            assert err < 5e-3


def _as_fp32(w):
    from dsv41.codecs.weights import PackedWeight
    return PackedWeight(w.codes, w.scale, w.kind, w.shape, torch.float32)


@pytest.mark.gpu
def test_packed_linear_sends_prefill_fp8_to_the_tensor_cores(monkeypatch):
    from dsv41.kernels.triton import packed_gemm
    monkeypatch.setattr(packed_gemm, "FP8_PREFILL", True)
    w = packed(256, 512, "fp8", dtype=torch.bfloat16, device="cuda")
    x = qdq_fp8(torch.randn(200, 512).bfloat16()).cuda()
    monkeypatch.setattr(packed_gemm, "dequant_triton", lambda weight: pytest.fail("decoded the fp8 weight"))
    got = packed_gemm.packed_linear_triton(x, w)
    assert got.dtype == torch.bfloat16 and rel_rows(got, packed_linear_ref(x, w)) < 5e-3
