"""The mHC math of one step (docs/model.md §2 items 3-6): the functions the model's blocks (`dsv41.model.block`) and the
fused step's reference (`mhc_ref.mhc_fused_ref`) share, kept in the kernels layer so that both import them from here.

Legend: B batch, T tokens, S streams (hc_mult), D width, M = (2 + S) * S mix coefficients.
"""

from __future__ import annotations

import torch

from dsv41.kernels.invariant import linear, row_mean, rsqrt, sigmoid, small_sum

__all__ = ["hc_split_sinkhorn", "hc_mixes", "hc_pre", "hc_post"]


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [B,T,M] fp32 -> pre [B,T,S], post [B,T,S], comb [B,T,S,S] (docs/model.md §2 item 5)."""
    m = mixes.float()
    scale, base = scale.float(), base.float()
    pre = sigmoid(m[..., :S] * scale[0] + base[:S]) + eps
    post = 2 * sigmoid(m[..., S:2 * S] * scale[1] + base[S:2 * S])
    comb = (m[..., 2 * S:] * scale[2] + base[2 * S:]).unflatten(-1, (S, S))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))           # softmax over destinations k
    comb = comb / small_sum(comb, -1, keepdim=True) + eps
    comb = comb / (small_sum(comb, -2, keepdim=True) + eps)              # column normalisation
    for _ in range(iters - 1):
        comb = comb / (small_sum(comb, -1, keepdim=True) + eps)          # rows
        comb = comb / (small_sum(comb, -2, keepdim=True) + eps)          # columns (always last)
    return pre, post, comb


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
             eps: float, norm_eps: float):
    """x [B,T,S,D] -> (pre, post, comb). One RMS statistic per token over all S*D values, applied AFTER the
    projection of the unnormalised stream (docs/model.md §2 item 4, §10.2 item 6)."""
    xf = x.flatten(2).float()                                              # [B,T,S*D], stream-major
    rstd = rsqrt(row_mean(xf.square(), keepdim=True) + norm_eps)
    mixes = linear(xf, fn.float()) * rstd
    return hc_split_sinkhorn(mixes, scale, base, S, iters, eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse: sum_j pre[j] * x[j] in fp32, cast to x's dtype. [B,T,S,D] x [B,T,S] -> [B,T,D]."""
    return small_sum(pre.unsqueeze(-1) * x.float(), 2).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: out[k] = post[k] * f + sum_j comb[j,k] * residual[j] (fp32, cast to f's dtype).

    f [B,T,D], residual [B,T,S,D], post [B,T,S], comb [B,T,S,S] -> [B,T,S,D].
    The official code forms the products comb[j,k] * residual[j] ([B,T,S,S,D]) and sums over j; the CPU sums that
    short axis in index order (as `small_sum` does in the deterministic mode), so the same products accumulated
    j = 0, 1, ... are bit-identical without the S-times larger intermediate (5 GB per call at 32K tokens of the
    V4.1 geometry). An einsum over j (another order) measured 2.5e-5 on a golden block row, past gate 1's 1e-6."""
    acc = comb[..., 0, :].unsqueeze(-1) * residual[..., 0, :].unsqueeze(-2)
    for j in range(1, comb.size(-2)):
        acc = acc + comb[..., j, :].unsqueeze(-1) * residual[..., j, :].unsqueeze(-2)
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + acc
    return y.type_as(f)
