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

from dsv41.kernels.mhc_math import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn  # noqa: F401 (the model's names)


def identity_pre_mix(B: int, T: int, S: int, device=None) -> torch.Tensor:
    """Block 0's collapse weights: one-hot on stream 0 (fp32)."""
    pre = torch.zeros(B, T, S, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre
