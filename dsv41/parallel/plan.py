"""The parallel plan, applied to a built `Transformer` from outside: which module is cut how on each rank.

  attention (backbone layers and DSpark stages)   heads, `wo` groups and `wo_b` rows over the ranks, wo_b
                                                  between two gathers (`dsv41.parallel.attention`)
  routed experts (every MoE)                      contiguous blocks of ceil(E / N) per rank, tokens dispatched by
                                                  the gate, combined in the one-device order
                                                  (`dsv41.parallel.experts`)
  everything else                                 whole on every rank: embedding, mHC, norms, gate, shared
                                                  expert, wq_a / wkv, compressor, indexer, Engram, head, the
                                                  DSpark heads, the vision tower

The model code does not know: the plan replaces the cut modules' tensors by the rank's slices and swaps the class
of the two modules whose arithmetic needs a collective (`wo_b`: a Linear between gathers; the MoE: its experts'
sum) for a subclass of the model's own that overrides only that method.
`apply_plan` cuts a model that holds every weight (tests, a checkpoint small enough to load whole);
`dsv41.parallel.loading` builds the rank's model without ever holding the rest.
"""

from __future__ import annotations

from torch import nn

from dsv41.model.attention import Attention
from dsv41.model.moe import MoE
from dsv41.parallel.attention import shard_attention
from dsv41.parallel.experts import shard_moe
from dsv41.parallel.group import Group


def apply_plan(model: nn.Module, group: Group | None = None) -> nn.Module:
    """Cut `model` in place to rank `group.rank` of `group.world` (default: the current process group) and
    return it. At world size 1 it changes nothing but the classes (the same math)."""
    group = group or Group.current()
    targets = [m for m in model.modules() if isinstance(m, (Attention, MoE))]
    for m in targets:
        (shard_attention if isinstance(m, Attention) else shard_moe)(m, group)
    model.parallel_group = group
    return model


def check_plan(cfg, world: int) -> None:
    """ValueError naming the first size the plan cannot split over `world` ranks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    for what, n in (("heads (n_heads)", cfg.n_heads), ("output groups (o_groups)", cfg.o_groups),
                    ("width (dim)", cfg.dim)):
        if n % world:
            raise ValueError(f"{what}: {n} cannot be split evenly over {world} ranks")
