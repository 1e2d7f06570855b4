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
GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
        "w2": 1.05, "compressor.wkv": 1.8, "compressor.wgate": 1.0, "weights_proj": 0.97, "wk": 1.0}
EMBED_STD = 0.12


def _gain(name: str) -> float:
    for key in ("compressor.wkv", "compressor.wgate"):
        if key in name:
            return GAIN[key]
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
    return GAIN.get(leaf, 1.0)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter of a `Transformer` in place, deterministically from `seed` (per device type: the
    values are drawn on the parameters' device, so a GPU-built model never round-trips through host memory)."""
    gens: dict[torch.device, torch.Generator] = {}

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.copy_((torch.randn(p.shape, generator=g, device=p.device) * std + mean).to(p.dtype))

    for name, p in model.named_parameters():
        if name.startswith(("vision.", "aligner.")):
            if "norm" in name:
                normal(p, 0.1, 1.0)
            elif name.endswith("bias"):
                normal(p, 0.02)
            else:
                normal(p, (0.35 if name.startswith("aligner.w2") else 1.0) / p.shape[-1] ** 0.5)
        elif name.startswith("image_"):
            normal(p, EMBED_STD)
        elif name == "embed.weight" or name.endswith("markov_head.embed.weight"):
            normal(p, EMBED_STD)
        elif re.search(r"hc_(attn|ffn)_fn$", name):
            normal(p, 1.0 / p.shape[-1] ** 0.5)
        elif re.search(r"hc_(attn|ffn)_base$", name):
            normal(p, 0.5)
        elif re.search(r"hc_(attn|ffn)_scale$", name):
            normal(p, 0.4)
        elif name.endswith("attn_sink"):
            normal(p, 0.5)
        elif re.search(r"gate\.bias(_vl)?$", name):
            normal(p, 0.1)
        elif name.endswith("engram.embed.weight"):
            normal(p, 1.0)
        elif re.search(r"engram\.(q|k)_weight$", name):
            normal(p, 0.1, 1.0)
        elif p.ndim == 1:                                     # RMSNorm weights
            mean = 1.0
            for key, mu in NORM_MEAN.items():
                if name.endswith(key + ".weight"):
                    mean = mu
            normal(p, 0.1 * mean, mean)
        else:
            normal(p, _gain(name) / p.shape[-1] ** 0.5)
    return model


def random_model(cfg, dtype: torch.dtype = torch.float32, seed: int = 0, token_map=None, device="cpu"):
    """A Transformer of `cfg` with checkpoint-like random weights, built directly on `device`."""
    from dsv41.model.transformer import Transformer

    with torch.device(device):
        model = Transformer(cfg, dtype=dtype, token_map=token_map)
    return init_weights(model, seed).eval()
