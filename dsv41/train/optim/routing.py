"""Which optimizer updates which parameter (docs/system.md §6), decided by name and shape, explicit and printable.

Rules, first match wins (`optimizer="muon"`, the default):
  excluded        `ffn.gate.bias`, `ffn.gate.bias_vl`: selection-only biases, moved by aux-loss-free balancing
                  (`dsv41.train.balance`) and never by a gradient optimizer.
  frozen          parameters outside the stage's trainable set (the backbone in the DSpark stage) and those with
                  no gradient path (found by a probe backward: the indexer's projections, whose only use is a
                  non-differentiable top-k, and the drafter during pretraining).
  muon_headwise   query / key projections, one Newton-Schulz block per head:
                  `attn.wq_b` (n_heads blocks), `attn.indexer.wq_b` (index_n_heads blocks),
                  `attn.wkv` (one KV head: 1 block), `attn.indexer.wk` (1 block).
  sinkhorn        vocabulary-sized tables: `embed.weight`, `head.weight`, `*.engram.embed.weight` (lr x 5),
                  `*.markov_head.embed.weight`, `*.markov_head.head.weight`.
  adamw           matrices that are not hidden-to-hidden maps: `hc_attn_fn` / `hc_ffn_fn` (the mHC mixing
                  projections: 24 logits per token that feed sigmoids and a 20-step Sinkhorn, whose scale matters
                  and which an orthogonal update of fixed spectral norm would disturb), Engram's `q_weight` /
                  `k_weight` (elementwise gate scales stored as [streams, dim]) and the DSpark confidence head's
                  [1, dim + rank] projection (a vector); then every tensor that is not 2-D (norms, biases, sinks,
                  mHC base/scale, scalars). Weight decay on matrices only.
  muon            every other 2-D matrix: wq_a, wo_a, wo_b, the router `gate.weight`, routed and shared experts,
                  compressor `wkv` / `wgate`, Engram `wkv`, the indexer's `weights_proj`, DSpark `main_proj`,
                  the vision tower's matrices.

`optimizer="adamw"` sends every trainable parameter to AdamW (the comparison baseline).

All routes share one learning rate: Muon and Sinkhorn updates are scaled to AdamW's RMS (see muon.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from dsv41.train.optim import OptimizerSet
from dsv41.train.optim.muon import Muon
from dsv41.train.optim.sinkhorn import SinkhornMomentum

KINDS = ("muon_headwise", "muon", "sinkhorn", "adamw", "excluded", "frozen")
EXCLUDED = re.compile(r"ffn\.gate\.bias(_vl)?$")
HEADWISE = ((re.compile(r"attn\.indexer\.wq_b\.weight$"), "index_n_heads"),
            (re.compile(r"attn\.wq_b\.weight$"), "n_heads"),
            (re.compile(r"attn\.(indexer\.wk|wkv)\.weight$"), 1))
SINKHORN = ((re.compile(r"(^|markov_head\.)(embed|head)\.weight$"), 1.0),
            (re.compile(r"engram\.embed\.weight$"), 5.0))
ADAMW_MATRICES = re.compile(r"(hc_(attn|ffn)_fn|engram\.(q|k)_weight|confidence_head\.proj\.weight)$")


@dataclass(frozen=True)
class Route:
    name: str
    kind: str
    shape: tuple[int, ...]
    heads: int = 1
    lr_mult: float = 1.0
    decay: bool = False


def route_parameter(name: str, p: torch.Tensor, cfg, optimizer: str = "muon", frozen: bool = False) -> Route:
    """The route of one parameter by the rules of the module docstring; `frozen`: it may not train (outside the
    stage's trainable set, or without a gradient path)."""
    shape = tuple(p.shape)
    if EXCLUDED.search(name):                               # a selection-only bias (aux-loss-free balancing)
        return Route(name, "excluded", shape)
    if frozen:
        return Route(name, "frozen", shape)
    if optimizer == "adamw":
        return Route(name, "adamw", shape, decay=p.ndim >= 2)
    for pat, heads in HEADWISE:
        if pat.search(name):
            return Route(name, "muon_headwise", shape, heads=getattr(cfg, heads) if isinstance(heads, str) else heads,
                         decay=True)
    for pat, mult in SINKHORN:
        if pat.search(name):
            return Route(name, "sinkhorn", shape, lr_mult=mult)         # a vocabulary-sized table
    if ADAMW_MATRICES.search(name):
        return Route(name, "adamw", shape, decay=True)                  # a mixing / gate-scale matrix
    if p.ndim == 2 and min(shape) > 1:
        return Route(name, "muon", shape, decay=True)                   # a hidden matrix
    return Route(name, "adamw", shape)                                   # a vector, norm or scalar


def route_parameters(model: torch.nn.Module, cfg, optimizer: str = "muon", trainable: set[str] | None = None,
                     no_grad_path: set[str] | frozenset = frozenset()) -> list[Route]:
    """Routes of every named parameter. `trainable` (None: all) limits what may train; `no_grad_path` names
    parameters that a probe backward found without gradient."""
    return [route_parameter(name, p, cfg, optimizer, (trainable is not None and name not in trainable)
                            or name in no_grad_path) for name, p in model.named_parameters()]


def format_routing(routes: list[Route]) -> str:
    """A table: per kind, how many tensors and parameters, and the name patterns."""
    lines = [f"{'route':<14} {'tensors':>8} {'params':>12}  examples"]
    for kind in KINDS:
        rs = [r for r in routes if r.kind == kind]
        if not rs:
            continue
        n = sum(math.prod(r.shape) for r in rs)
        patterns = sorted({re.sub(r"\.\d+\.", ".*.", r.name) for r in rs})
        shown = ", ".join(patterns[:4]) + (f", ... ({len(patterns)} patterns)" if len(patterns) > 4 else "")
        lines.append(f"{kind:<14} {len(rs):>8} {n:>12,}  {shown}")
    return "\n".join(lines)


def build_optimizers(model: torch.nn.Module, routes: list[Route], lr: float, weight_decay: float = 0.1,
                     muon_ns_dtype: torch.dtype | None = None) -> OptimizerSet:
    """One optimizer per kind present, param groups by (heads, lr multiplier, decay); AdamW with betas (0.9, 0.95),
    Muon and Sinkhorn with momentum 0.95. Every group records its `base_lr`; `OptimizerSet.set_lr_factor` scales
    them all by the schedule. `muon_ns_dtype`: the Newton-Schulz compute dtype of the Muon routes (None: fp32 on
    CPU, bf16 on GPUs)."""
    params = dict(model.named_parameters())
    groups: dict[str, dict[tuple, list]] = {}
    for r in routes:
        if r.kind not in ("excluded", "frozen"):
            groups.setdefault(r.kind, {}).setdefault((r.heads, r.lr_mult, r.decay), []).append(params[r.name])
    opts: dict[str, torch.optim.Optimizer] = {}
    for kind, by_key in groups.items():
        pgs = []
        for (heads, mult, decay), ps in by_key.items():
            pg = {"params": ps, "lr": lr * mult, "base_lr": lr * mult}
            if kind in ("muon", "muon_headwise"):
                pg["heads"] = heads
            if kind != "sinkhorn":
                pg["weight_decay"] = weight_decay if decay else 0.0
            pgs.append(pg)
        if kind == "sinkhorn":
            opts[kind] = SinkhornMomentum(pgs, lr=lr, beta=0.95)
        elif kind == "adamw":
            opts[kind] = torch.optim.AdamW(pgs, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
        else:
            opts[kind] = Muon(pgs, lr=lr, beta=0.95, ns_dtype=muon_ns_dtype)
    return OptimizerSet(opts)
