"""The block-scaled GEMM in the official summation order (docs/model.md §9).

The official CPU GEMM for fp8 / fp4 weights sums each 32-wide K block of the quantized operands on its own (one
small matmul per block), scales the block partial by the two power-of-two scales and accumulates the partials in
float32, block by block in K order, then casts to the output dtype. Our operands are dequantized values (the FP8
activation QDQ'd; the weight held dequantized, or held packed as the checkpoint stores it and dequantized here one
chunk of blocks at a time), i.e. code x power-of-two scale: scaling by a power of two
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

from typing import Iterator

import torch

from dsv41.codecs.fp8 import FP8_AMAX_FLOOR, FP8_MAX_INV, pow2_ceil
from dsv41.codecs.weights import PackedWeight

__all__ = ["GEMM_BLOCK", "block_scaled_linear_ref", "weight_column_chunks", "packed_linear_ref"]

GEMM_BLOCK = 32
CHUNK_BYTES = 1 << 22          # fp32 bytes of one dequantized column chunk of a packed weight


def weight_column_chunks(weight: torch.Tensor | PackedWeight) -> Iterator[tuple[int, torch.Tensor]]:
    """(k0, fp32 [N, kc]) column chunks of the weight in K order, kc a multiple of 32: the whole weight as fp32
    when it is held dequantized, chunks of about CHUNK_BYTES dequantized on the fly when it is packed (the values
    of the dequantized twin, docs/model.md §9)."""
    if isinstance(weight, torch.Tensor):
        yield 0, weight.float()
        return
    N, K = weight.shape
    step = max(GEMM_BLOCK, CHUNK_BYTES // (4 * N) // GEMM_BLOCK * GEMM_BLOCK)
    for k0 in range(0, K, step):
        yield k0, weight.cols(k0, min(K, k0 + step))


def block_scaled_linear_ref(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) summed per 32-wide K block, the blocks accumulated in fp32 in K order.

    x [..., K] (already FP8 QDQ'd when the weight is of a quantized kind), weight [N, K] (dequantized, or a
    `PackedWeight` read block by block: the same products, the same order, the same bits), K a multiple of 32.
    The result is cast to the weight's dtype, as the Linear's F.linear."""
    K = x.size(-1)
    N = weight.shape[0]
    if K % GEMM_BLOCK:
        raise ValueError(f"block-scaled GEMM needs K divisible by {GEMM_BLOCK}, got {K}")
    a = x.reshape(-1, K).float().contiguous()
    a_blocks = a.split(GEMM_BLOCK, dim=1)                  # a[:, k:k+32] for each block, as views (one op)
    acc = torch.zeros(a.size(0), N, dtype=torch.float32, device=x.device)
    for c0, w in weight_column_chunks(weight):
        for j, w_t in enumerate(w.T.split(GEMM_BLOCK, dim=0)):          # w[:, k0:k0+32].T, the same views
            acc.add_(torch.mm(a_blocks[c0 // GEMM_BLOCK + j], w_t))      # one block's partial, then the add
    y = acc.to(weight.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], N)


def packed_linear_ref(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for a weight held packed, on any device: the weight dequantized whole (its held dtype),
    then one `F.linear` (the library's order). The GPU twin (`dsv41.kernels.triton.packed_gemm`) reads the bytes
    instead; on a CPU the model takes `block_scaled_linear_ref` (the official order) and not this."""
    return torch.nn.functional.linear(x.to(weight.dtype), weight.dequant(), bias)


def quant_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's codes and scales for the FP8 tensor cores (reference of `dsv41.kernels.triton.fp8_gemm.quant_rows_triton`):
    exact (codes x scales = x) for a QDQ'd x. x [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, K / 32])."""
    g = x.float().unflatten(-1, (-1, 32))
    s = pow2_ceil(g.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR) * FP8_MAX_INV)
    return (g / s[..., None]).flatten(-2).to(torch.float8_e4m3fn), s
