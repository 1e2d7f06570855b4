"""The block-scaled GEMM in the official summation order (docs/model.md §9).

The official CPU GEMM for fp8 / fp4 weights sums each 32-wide K block of the quantized operands on its own (one
small matmul per block), scales the block partial by the two power-of-two scales and accumulates the partials in
float32, block by block in K order, then casts to the output dtype. Our operands are held dequantized (the FP8
activation QDQ'd, the weight dequantized at load), i.e. code x power-of-two scale: scaling by a power of two
commutes with every rounding of the block sum, so `partial(x_blk, w_blk)` here has the bits of the official
`partial(codes) * a_scale * w_scale`, and the accumulation below is the official one.

`F.linear` over the whole K computes the same function in an order the math library picks per CPU and per shape;
~1e-7 of that difference lands an FP8 activation on the other side of an e4m3 rounding midpoint now and then, and
the flip cascades (docs/golden.md §4). This order removes that source: on one machine and torch build the result
equals the official code's bit for bit. Within one 32-wide block the library's order still applies: it can change
with the number of rows (1-7 rows against 512 differ in the last bit on an AMD EPYC) and between CPUs, so this order
is not batch-invariant, and results across machines agree to the gates (docs/golden.md §4), not to the bit.
"""

from __future__ import annotations

import torch

__all__ = ["GEMM_BLOCK", "block_scaled_linear_ref"]

GEMM_BLOCK = 32


def block_scaled_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) summed per 32-wide K block, the blocks accumulated in fp32 in K order.

    x [..., K] (already FP8 QDQ'd when the weight is of a quantized kind), weight [N, K] (dequantized), K a
    multiple of 32. The result is cast to the weight's dtype, as the Linear's F.linear."""
    K = x.size(-1)
    N = weight.size(0)
    if K % GEMM_BLOCK:
        raise ValueError(f"block-scaled GEMM needs K divisible by {GEMM_BLOCK}, got {K}")
    a = x.reshape(-1, K).float().contiguous()
    w = weight.float()
    acc = torch.zeros(a.size(0), N, dtype=torch.float32, device=x.device)
    for k0 in range(0, K, GEMM_BLOCK):
        acc += a[:, k0:k0 + GEMM_BLOCK] @ w[:, k0:k0 + GEMM_BLOCK].T      # one block's partial, then the add
    y = acc.to(weight.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], N)
