"""The fp8 / fp4-weight GEMM sums in the official order (docs/model.md §9): per 32-wide K block of codes, the block
partial scaled by the activation's and the weight's power-of-two scales, the partials accumulated in fp32 in K
order. `block_scaled_linear_ref` takes the dequantized operands the model holds; written on codes and scales
below as the official CPU kernel does, the two must agree bit for bit (same block shapes, so the same reductions on
any CPU). The quantized Linear uses that order on the CPU, one F.linear when training.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.codecs import qdq_fp8
from dsv41.kernels import block_scaled_linear_ref, quant_linear
from dsv41.model.common import Linear

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def official_form(a_codes, a_scale, w_codes, w_scale_rows):
    """sum_k (A_k . W_k^T) * a_s[:, k] * w_s[:, k] over 32-wide K blocks, fp32, in K order."""
    M, K = a_codes.shape
    acc = torch.zeros(M, w_codes.size(0))
    for k in range(K // 32):
        sl = slice(32 * k, 32 * (k + 1))
        acc += (a_codes[:, sl] @ w_codes[:, sl].T) * a_scale[:, k:k + 1] * w_scale_rows[:, k].unsqueeze(0)
    return acc


def fp8_codes(g, *shape):
    x = torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g).pow(4) * 400
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def pow2(g, *shape, lo=-12, hi=2):
    return torch.exp2(torch.randint(lo, hi, shape, generator=g).float())


@pytest.mark.parametrize("M,K,N", [(1, 256, 64), (7, 96, 40), (201, 256, 1024), (3, 1280, 96)])
@pytest.mark.parametrize("weight", ["fp8", "fp4"])
def test_block_order_equals_official_form_bit_for_bit(M, K, N, weight):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    a_codes, a_s = fp8_codes(g, M, K), pow2(g, M, K // 32)
    if weight == "fp8":          # e4m3 codes, one e8m0 scale per 32 x 32 tile
        w_codes = fp8_codes(g, N, K)
        w_s = pow2(g, (N + 31) // 32, K // 32).repeat_interleave(32, 0)[:N]
    else:                        # e2m1 codes, one e8m0 scale per (row, 32 inputs)
        w_codes = E2M1[torch.randint(0, 16, (N, K), generator=g)]
        w_s = pow2(g, N, K // 32)
    want = official_form(a_codes, a_s, w_codes, w_s)
    a = a_codes * a_s.repeat_interleave(32, 1)
    w = w_codes * w_s.repeat_interleave(32, 1)
    assert torch.equal(block_scaled_linear_ref(a, w), want)
    assert torch.equal(block_scaled_linear_ref(a.bfloat16(), w.bfloat16()), want.bfloat16())   # operands exact in bf16
    assert torch.equal(block_scaled_linear_ref(a.view(M, 1, K), w).view(M, N), want)             # leading dims


def test_block_order_rejects_ragged_k():
    with pytest.raises(ValueError, match="divisible by 32"):
        block_scaled_linear_ref(torch.zeros(2, 40), torch.zeros(3, 40))


def test_quantized_linear_uses_the_block_order_on_cpu_and_f_linear_when_training():
    torch.manual_seed(0)
    lin = Linear(256, 96, "fp8", torch.float32)
    with torch.no_grad():
        lin.weight.copy_(qdq_fp8(torch.randn(96, 256) * 0.05))
    x = torch.randn(5, 9, 256) * 3
    lin.eval()
    want = block_scaled_linear_ref(qdq_fp8(x), lin.weight)
    assert torch.equal(lin(x), want)                                   # eval, grad mode on or off
    with torch.no_grad():
        assert torch.equal(lin(x), want)
    lin.train()
    y = lin(x)
    assert torch.equal(y, F.linear(qdq_fp8(x), lin.weight))            # training: one GEMM, differentiable
    y.sum().backward()
    assert lin.weight.grad is not None
    bf = Linear(256, 96, "bf16", torch.float32).eval()                 # unquantized kinds: a plain matmul
    with torch.no_grad():
        bf.weight.copy_(lin.weight)
        assert torch.equal(bf(x), F.linear(x, bf.weight))
    assert torch.equal(quant_linear(qdq_fp8(x), lin.weight), want)
