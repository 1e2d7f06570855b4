"""Torch reference of the routed + shared experts of one MoE layer (docs/model.md §5), over weight lists.

Legend: N tokens, D width, F expert hidden width, E routed experts, K activated experts per token.

`moe_combine` is the layer's summation, shared by the model's module loop and `moe_experts_ref`: routed outputs
accumulate in fp32 in ascending expert id (each token's experts are distinct, so a token's sum is
0 + o_e1 + o_e2 + ... with e1 < e2 < ...), the shared expert last, cast to x's dtype.
`moe_experts_ref` is `dsv41.model.moe.Expert` written on its weights, for experts whose Linears agree on the
activation QDQ: x QDQ'd once for w1 and w3 (quant_in), gate and up rounded to the weights' dtype by the Linear,
`expert_act_ref` (clamped SwiGLU, routing weight, cast, w2's QDQ when quant_mid), w2; the GEMMs behind a QDQ
sum in the official block order (`block_scaled_linear_ref`), as the model's Linears do on the CPU.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dsv41.codecs import qdq_fp8 as qdq_fp8_ref
from dsv41.codecs.weights import PackedWeight
from dsv41.kernels.gemm_ref import block_scaled_linear_ref
from dsv41.kernels.invariant import exact_block_linear, is_deterministic, linear, sigmoid, silu, small_sum, softplus

__all__ = ["moe_combine", "moe_experts_ref", "expert_act_ref", "moe_route_ref", "gate_scores", "moe_gate_ref"]


def gate_scores(x: torch.Tensor, weight: torch.Tensor, score_func: str, gate_temp: float) -> torch.Tensor:
    """The gate's scores: score_func(x W_g^T / gate_temp) in fp32 (docs/model.md §5). x [N, D], weight [E, D]."""
    z = linear(x.float(), weight.float())
    if gate_temp != 1.0:                                       # x / 1.0 is x: one launch less per layer
        z = z / gate_temp
    if score_func == "softmax":
        return z.softmax(dim=-1)
    if score_func == "sigmoid":
        return sigmoid(z)
    return softplus(z).sqrt()


def moe_gate_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str,
                 gate_temp: float, norm_topk_prob: bool, route_scale: float):
    """The gate's routing (docs/model.md §5): experts by top-K of scores + bias (selection only), weights the
    unbiased scores at them, normalised (+ 1e-20) when norm_topk_prob and K > 1, times route_scale ->
    (weights [N, K] fp32, indices [N, K] long, scores [N, E] fp32)."""
    scores = gate_scores(x, weight, score_func, gate_temp)
    indices = (scores + bias).detach().topk(topk, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob and topk > 1:
        weights = weights / (small_sum(weights, -1, keepdim=True) + 1e-20)    # literal 1e-20, not norm_eps
    return weights * route_scale, indices, scores


def moe_route_ref(indices: torch.Tensor, weights: torch.Tensor, n_experts: int):
    """The slots of the fused experts op (`dsv41.kernels.triton.moe_kernel`): each token's K routed experts sorted
    ascending (stable), the shared expert (id E = n_experts) appended, so token t's pair r is p = t (K + 1) + r; then
    the pairs sorted by expert, stable (within an expert, tokens ascending). indices [N, K] (distinct per row, as
    the gate's top-k), weights [N, K] ->
      order [P] int64   sorted slot -> pair
      inv [P] int64     pair -> slot
      pw [P] fp32       pair -> routing weight (1 for the shared expert)
      counts [E+1]      pairs per expert
      offs [E+1]        the expert's first slot (exclusive prefix sum of counts)
    Equivalently slot(p) = #{pairs of a smaller expert} + #{pairs of the same expert with a smaller p}: the closed
    form the one-program kernel `moe_route_triton` evaluates."""
    N, dev = indices.size(0), indices.device
    sidx, perm = indices.sort(dim=1, stable=True)
    pe = torch.cat([sidx, torch.full((N, 1), n_experts, dtype=sidx.dtype, device=dev)], 1).flatten()
    pw = torch.cat([weights.float().gather(1, perm), torch.ones(N, 1, device=dev)], 1).flatten()
    order = torch.argsort(pe, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, pe, torch.ones_like(pe))
    offs = torch.cumsum(counts, 0) - counts
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    return order, inv, pw, counts, offs


def expert_act_ref(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float, quantize: bool,
                   dtype: torch.dtype) -> torch.Tensor:
    """The expert's middle (docs/model.md §5): silu(min(gate, L)) * clamp(up, -L, L) in fp32 (no clamp when
    L <= 0), times the routing weight, cast to `dtype`, then (quantize) the FP8 QDQ that w2 applies to its input."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = silu(g) * u
    if weights is not None:
        h = weights * h
    h = h.to(dtype)
    return qdq_fp8_ref(h) if quantize else h


def moe_combine(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, n_experts: int,
                expert: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
                shared: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [N,D], indices [N,K], weights [N,K] fp32 -> [N,D] in x's dtype: sum over the routed experts (ascending id)
    of index_add(expert(e, x[rows], w[rows, 1]).float()), plus shared(x).float()."""
    y = torch.zeros_like(x, dtype=torch.float32)
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)              # (token, slot) pairs grouped by expert, tokens ascending
    rows_of, w_of = order // indices.size(1), weights.flatten()[order].unsqueeze(-1)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    for e, (rows, w) in enumerate(zip(rows_of.split(counts), w_of.split(counts))):
        if len(rows):
            y.index_add_(0, rows, expert(e, x[rows], w).float())      # in place: no copy of y per expert
    y = y + shared(x).float()
    return y.type_as(x)


def moe_experts_ref(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: Sequence[torch.Tensor],
                    w3: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], limit: float, quant_in: bool,
                    quant_mid: bool) -> torch.Tensor:
    """Routed + shared experts -> [N,D] in x's dtype. x [N,D]; indices [N,K] routed expert ids (distinct per
    token); weights [N,K] fp32 routing weights; w1, w3 [F,D] and w2 [D,F] per expert, E routed then the shared
    expert last (E+1 each), each dequantized or a `PackedWeight` (checkpoint storage, read block by block);
    limit the SwiGLU clamp; quant_in / quant_mid: the FP8 activation QDQ in front of w1 and w3 / of w2."""
    xq = qdq_fp8_ref(x) if quant_in else x

    def lin(a: torch.Tensor, weight: torch.Tensor | PackedWeight, quantized: bool) -> torch.Tensor:
        if quantized:
            return exact_block_linear(a, weight) if is_deterministic() else block_scaled_linear_ref(a, weight)
        return linear(a, weight if isinstance(weight, torch.Tensor) else weight.dequant())

    def run(e: int, xe: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        gate, up = lin(xe, w1[e], quant_in), lin(xe, w3[e], quant_in)
        h = expert_act_ref(gate, up, w, limit, quant_mid, x.dtype)
        return lin(h, w2[e], quant_mid)

    E = len(w1) - 1
    return moe_combine(xq, indices, weights, E, run, lambda xe: run(E, xe, None))
