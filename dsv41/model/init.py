"""Random initialisation with checkpoint-like statistics, so random models give finite, non-degenerate logits at
every preset. The figures are the released checkpoint's measured statistics as the golden case-a checkpoint
records them (golden/case-a/case.json: per-norm means, per-projection gains, embedding RMS 0.12).

A matrix with gain g is N(0, g^2 / fan_in); a norm with mean mu is mu * (1 + 0.1 N(0,1)).
"""

from __future__ import annotations

import re

import torch
from torch import nn

NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5}
# by the weight's leaf name; the compressor's wkv measures the same 1.8 as the attention's, its wgate 1.0
GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
        "w2": 1.05, "weights_proj": 0.97, "wk": 1.0}
EMBED_STD = 0.12
# (pattern searched in the parameter name, std, mean, whether std is divided by sqrt(fan_in)): the first match
# wins; other parameters are norms (1-D: NORM_MEAN) or projections (GAIN)
RULES = (
    (r"^(vision|aligner)\..*norm", 0.1, 1.0, False),
    (r"^(vision|aligner)\..*bias$", 0.02, 0.0, False),
    (r"^aligner\.w2", 0.35, 0.0, True),
    (r"^(vision|aligner)\.", 1.0, 0.0, True),
    (r"^image_|^embed\.weight$|markov_head\.embed\.weight$", EMBED_STD, 0.0, False),
    (r"hc_(attn|ffn)_fn$", 1.0, 0.0, True),
    (r"hc_(attn|ffn)_base$", 0.5, 0.0, False),
    (r"hc_(attn|ffn)_scale$", 0.4, 0.0, False),
    (r"attn_sink$", 0.5, 0.0, False),
    (r"gate\.bias(_vl)?$", 0.1, 0.0, False),
    (r"engram\.embed\.weight$", 1.0, 0.0, False),
    (r"engram\.(q|k)_weight$", 0.1, 1.0, False),
)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter of a `Transformer` in place, deterministically from `seed` (per device type: the
    values are drawn on the parameters' device, so a GPU-built model never round-trips through host memory)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        rule = next((r for r in RULES if re.search(r[0], name)), None)
        if rule is not None:
            _, std, mean, per_fan_in = rule
            std = std / p.shape[-1] ** 0.5 if per_fan_in else std
        elif p.ndim == 1:                                     # RMSNorm weights
            mean = next((mu for key, mu in NORM_MEAN.items() if name.endswith(key + ".weight")), 1.0)
            std = 0.1 * mean
        else:
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
            std, mean = GAIN.get(leaf, 1.0) / p.shape[-1] ** 0.5, 0.0
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.numel() <= HUGE:
            p.copy_((torch.randn(p.shape, generator=g, device=p.device) * std + mean).to(p.dtype))
        else:                                  # a huge table (v41-geometry's Engram): its fp32 draw in row chunks
            rows = max(1, HUGE // max(1, p[0].numel()))
            for r0 in range(0, p.size(0), rows):
                part = p[r0:r0 + rows]
                part.copy_((torch.randn(part.shape, generator=g, device=p.device) * std + mean).to(p.dtype))
    return model


HUGE = 1 << 28      # parameters above this many elements are drawn in chunks (the fp32 draw of a whole one took 4.6
                    # GiB beside a 67 GiB v41-geometry on an 80 GB H100); smaller ones in one draw, as always


def random_model(cfg, dtype: torch.dtype = torch.float32, seed: int = 0, token_map=None, device="cpu"):
    """A Transformer of `cfg` with checkpoint-like random weights, built directly on `device`."""
    from dsv41.model.transformer import Transformer

    with torch.device(device):
        model = Transformer(cfg, dtype=dtype, token_map=token_map)
    return init_weights(model, seed).eval()
