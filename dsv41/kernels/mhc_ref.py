"""Torch reference of the fused mHC step between two sub-layers (docs/model.md §2 items 3-6), built from the model's own
functions (`mhc_math`, which `dsv41.model.block` uses, and `ref.rms_norm_ref`, the model's RMSNorm), with the signature
of its Triton twin (`dsv41.kernels.triton.mhc_fused_triton`).

Legend: S streams (hc_mult), D width, M = (2 + S) * S coefficients, leading dims (B, T) or any.

One step of `Block.forward`, e.g. after attention:
    y                 = hc_post(f, residual, post, comb)          the residual update of the S streams
    pre', post', comb' = hc_mixes(y; fn, scale, base)              the next coefficients (projection, RMS, Sinkhorn)
    h                 = norm(hc_pre(y, pre_lag))                   the lagged collapse and the next sub-layer's pre-norm
where pre_lag is the coefficient computed one sub-layer earlier (the single-pass lag: the FFN collapses with the
attention's pre, the next attention with the FFN's). The fused kernel does all of it in one pass over the streams:
it reads residual (S*D) and f (D) and writes y (S*D) and h (D) per token, the (2S + 2) * D lower bound.
"""

from __future__ import annotations

import torch

from dsv41.kernels.mhc_math import hc_mixes, hc_post, hc_pre
from dsv41.kernels.ref import rms_norm_ref as rms_norm

__all__ = ["mhc_fused_ref"]


def mhc_fused_ref(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  pre_lag: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  norm_weight: torch.Tensor, iters: int, eps: float, norm_eps: float, rms_eps: float):
    """-> (y [..,S,D], h [..,D], pre [..,S], post [..,S], comb [..,S,S]).

    f [..,D] sub-layer output; residual [..,S,D] its input stream; post [..,S], comb [..,S,S] the coefficients of
    that stream; pre_lag [..,S] the lagged collapse weights; fn [M,S*D] fp32, scale [3], base [M] the next mixes'
    parameters; norm_weight [D] the next sub-layer's RMSNorm weight; iters Sinkhorn iterations, eps hc_eps,
    norm_eps the mixes' RMS epsilon, rms_eps the RMSNorm's."""
    S = residual.size(-2)
    y = hc_post(f, residual, post, comb)
    pre_n, post_n, comb_n = hc_mixes(y, fn, scale, base, S, iters, eps, norm_eps)
    h = rms_norm(hc_pre(y, pre_lag), norm_weight, rms_eps)
    return y, h, pre_n, post_n, comb_n
