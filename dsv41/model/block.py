"""One block of the stack: attention and MoE, each between a lagged collapse and an expansion of the S
hyper-connection streams (docs/model.md §2), with its Engram module (applied before it) on the layers that have one.

Legend: B batch, T tokens, S streams, D width, M = (2 + S) * S mix coefficients.

Manifold-constrained hyper-connections (mHC): the residual stream as S parallel copies. Each sub-layer
(attention, FFN) computes from the stream it is applied to (`dsv41.kernels.mhc_math`):
  pre  [S]    how to collapse the streams into the sub-layer input  (used one sub-layer LATER: the lag),
  post [S]    how to spread the sub-layer output back over the streams,
  comb [S,S]  a doubly-stochastic (Sinkhorn) mixing of the residual streams, comb[source j, destination k].
The "single-pass" design: attention collapses with the previous block's FFN `pre`, the FFN with this block's
attention `pre`, so each sub-layer reads the stream once (docs/report.md §7.1; docs/model.md §2 item 3). Block 0
collapses with a one-hot `pre` on stream 0 (`Transformer.streams_in`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.config import LayerRole, ModelConfig
from dsv41.kernels import hc_mixes, hc_post, mhc_fused
from dsv41.kernels.mhc_math import hc_pre
from dsv41.model.attention import Attention
from dsv41.model.common import RMSNorm
from dsv41.model.engram import Engram
from dsv41.model.moe import MoE
from dsv41.model.step import StepContext


class Block(nn.Module):
    """A block's forward in three named steps: `attn_input` (the attention side's mHC collapse and mixes),
    `attn_and_ffn` (attention, the fused mHC step, MoE, the expansion or the fused step into the next block), and
    `forward`, which chains the two for a block run on its own."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, dtype: torch.dtype, attention: nn.Module | None = None):
        super().__init__()
        self.cfg, self.layer = cfg, role.layer
        S, D = cfg.hc_mult, cfg.dim
        M = (2 + S) * S
        self.attn = attention if attention is not None else Attention(cfg, role, dtype)
        self.ffn = MoE(cfg, role.layer, dtype)
        self.attn_norm = RMSNorm(D, cfg.norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.norm_eps, dtype)
        # hc_{attn,ffn}_fn [M, S*D], _base [M] (zeros), _scale [3] (ones), fp32
        for k, shape, fill in (("fn", (M, S * D), 0.0), ("base", (M,), 0.0), ("scale", (3,), 1.0)):
            for which in ("attn", "ffn"):
                setattr(self, f"hc_{which}_{k}", nn.Parameter(torch.full(shape, fill, dtype=torch.float32)))
        self.engram = Engram(cfg, role.layer, dtype) if role.has_engram else None

    def mixes(self, x: torch.Tensor, which: str, compute=None):
        """(pre, post, comb) of the sub-layer `which` ("attn" or "ffn") from the stream x [B,T,S,D], by `compute`
        (default `dsv41.kernels.hc_mixes`: the model's function, one Triton launch on a GPU; or a function of its
        signature: the training fast path's)."""
        cfg = self.cfg
        compute = compute or hc_mixes
        fn, scale, base = (getattr(self, f"hc_{which}_{k}") for k in ("fn", "scale", "base"))
        return compute(x, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def attn_input(self, x: torch.Tensor, pre_mix: torch.Tensor):
        """The attention side's mHC step on its own: (normed attention input [B,T,D], (pre, post, comb))."""
        return self.attn_norm(hc_pre(x, pre_mix)), self.mixes(x, "attn")

    def attn_and_ffn(self, x: torch.Tensor, h: torch.Tensor, a_mix, ctx: StepContext, attn_extra=None,
                     nxt: "Block | None" = None):
        """Attention and MoE from the block's input stream x, its normed attention input h and attention mixes
        a_mix (from `attn_input`) -> (x', this block's FFN pre, nxt's `attn_input` or None).

        Each mHC step between two sub-layers is one `dsv41.kernels.mhc_fused` call (the model's own functions on
        CPU, the fused Triton kernel on a GPU): the residual update, the next sub-layer's mixes and its lagged,
        normed input in one pass. The attention -> FFN step always is; with `nxt` (the next block, when nothing
        runs between the two) the FFN -> next attention step is too, and the third item is nxt's `attn_input`."""
        cfg = self.cfg
        residual = x
        a_pre, a_post, a_comb = a_mix
        h = self.attn(h, ctx) if attn_extra is None else self.attn(h, ctx, attn_extra)
        x, h, f_pre, f_post, f_comb = mhc_fused(h, residual, a_post, a_comb, a_pre, self.hc_ffn_fn, self.hc_ffn_scale,
                                                self.hc_ffn_base, self.ffn_norm.weight, cfg.hc_sinkhorn_iters,
                                                cfg.hc_eps, cfg.norm_eps, self.ffn_norm.eps)
        residual = x
        h = self.ffn(h, ctx.image_mask, ctx.record, ctx.opts.routes, ctx.opts.route_log)
        if nxt is None:
            return hc_post(h, residual, f_post, f_comb), f_pre, None
        x, h, n_pre, n_post, n_comb = mhc_fused(h, residual, f_post, f_comb, f_pre, nxt.hc_attn_fn,
                                                nxt.hc_attn_scale, nxt.hc_attn_base, nxt.attn_norm.weight,
                                                cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, nxt.attn_norm.eps)
        return x, f_pre, (h, (n_pre, n_post, n_comb))

    def forward(self, x: torch.Tensor, pre_mix: torch.Tensor, ctx: StepContext, attn_extra=None):
        """x [B,T,S,D], pre_mix [B,T,S] (the previous block's FFN pre) -> (x', this block's FFN pre)."""
        x, pre, _ = self.attn_and_ffn(x, *self.attn_input(x, pre_mix), ctx, attn_extra)
        return x, pre
