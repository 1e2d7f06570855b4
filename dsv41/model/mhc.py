"""Manifold-constrained hyper-connections (mHC): the residual stream as S parallel copies (MODEL.md 2).

Legend: B batch, T tokens, S streams (hc_mult), D width, M = (2 + S) * S mix coefficients.

Each sub-layer (attention, FFN) computes from the stream it is applied to:
  pre  [S]    how to collapse the streams into the sub-layer input  (used one sub-layer LATER: the lag),
  post [S]    how to spread the sub-layer output back over the streams,
  comb [S,S]  a doubly-stochastic (Sinkhorn) mixing of the residual streams, comb[source j, destination k].
The "single-pass" design: attention collapses with the previous block's FFN `pre`, the FFN with this block's
attention `pre`, so each sub-layer reads the stream once (report section on mHC; MODEL.md 2 item 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [B,T,M] fp32 -> pre [B,T,S], post [B,T,S], comb [B,T,S,S] (MODEL.md 2 item 5)."""
    m = mixes.float()
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :S] * scale[0] + base[:S]) + eps
    post = 2 * torch.sigmoid(m[..., S:2 * S] * scale[1] + base[S:2 * S])
    comb = (m[..., 2 * S:] * scale[2] + base[2 * S:]).unflatten(-1, (S, S))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))           # softmax over destinations k
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)                 # column normalisation
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)             # rows
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)             # columns (always last)
    return pre, post, comb


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
             eps: float, norm_eps: float):
    """x [B,T,S,D] -> (pre, post, comb). One RMS statistic per token over all S*D values, applied AFTER the
    projection of the unnormalised stream (MODEL.md 2 item 4, 10.2 item 6)."""
    xf = x.flatten(2).float()                                              # [B,T,S*D], stream-major
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(xf, fn.float()) * rstd
    return hc_split_sinkhorn(mixes, scale, base, S, iters, eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse: sum_j pre[j] * x[j] in fp32, cast to x's dtype. [B,T,S,D] x [B,T,S] -> [B,T,D]."""
    return torch.sum(pre.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: out[k] = post[k] * f + sum_j comb[j,k] * residual[j] (fp32, cast to f's dtype).

    f [B,T,D], residual [B,T,S,D], post [B,T,S], comb [B,T,S,S] -> [B,T,S,D].
    The product-then-sum form is the official summation order: an einsum over j (no [B,T,S,S,D] intermediate,
    ~1.5x faster in training) measured 2.5e-5 on a golden block row, past gate 1's 1e-6 headroom."""
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return y.type_as(f)


def identity_pre_mix(B: int, T: int, S: int, device=None) -> torch.Tensor:
    """Block 0's collapse weights: one-hot on stream 0 (fp32)."""
    pre = torch.zeros(B, T, S, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre
