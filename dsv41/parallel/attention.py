"""Tensor-parallel attention: each rank runs its share of the heads and the `wo` groups that read them; the
latent KV, the compressor and the indexer stay whole on every rank (see the package docstring for why).

Legend: B batch, T tokens, H heads (Hr = H / N on a rank), C head dim, G output groups (Gr = G / N), R o_lora_rank,
D width, N ranks.

Cuts (`shard_attention`): `wq_b` keeps the rows of the rank's heads (a head is C consecutive rows), `attn_sink`
its heads, `wo_a` the rows of its groups (group g reads heads g H/G .. (g+1) H/G - 1: a rank's groups read
exactly its heads, which is why N must divide G), `wo_b` a 1/N share of its output rows (of D).

The model's own `Attention.output` then runs on a rank's Hr heads and Gr groups; its wo_b is swapped for a
`GatheredLinear`: the groups' wo_a products [B,T,Gr*R] are gathered from every rank in rank order (= group
order) to the whole wo_b input [B,T,G*R]; each rank multiplies it by its wo_b rows and the D / N outputs are
gathered again. Every output element is the one-device model's own sum (the activation QDQ of wo_b sees the
whole input, each row's K blocks accumulate in the same order), so no reduction across ranks enters the result:
in the deterministic mode (exact block sums) it is the same bits at any world size.
"""

from __future__ import annotations

import torch

from dsv41.model.attention import Attention
from dsv41.model.common import Linear
from dsv41.parallel.group import Group
from dsv41.parallel.shard import keep_part, keep_rows


class GatheredLinear(Linear):
    """The Linear of one rank's output rows between two gathers: the input's columns from every rank in rank order,
    this rank's rows of the product, then every rank's rows (names and storage those of the model's Linear)."""

    group: Group

    def forward(self, x: torch.Tensor, input_quantized: bool = False) -> torch.Tensor:
        y = super().forward(self.group.gather(x, dim=-1), input_quantized)
        return self.group.gather(y, dim=-1)


def shard_attention(attn: Attention, group: Group) -> None:
    """Cut `attn` to this rank's heads, groups and wo_b rows and make its wo_b a `GatheredLinear` (in place): the
    model's own `Attention.output` then runs the rank's groups and gathers through it."""
    if isinstance(attn.wo_b, GatheredLinear):
        raise ValueError(f"attention of layer {attn.layer} is already sharded")
    H, G, C = attn.n_heads, attn.n_groups, attn.head_dim
    groups = group.part(G, f"layer {attn.layer}: output groups (o_groups)")
    heads = group.part(H, f"layer {attn.layer}: heads")
    R = attn.o_lora_rank
    keep_rows(attn.wq_b, slice(heads.start * C, heads.stop * C))
    keep_part(attn, "attn_sink", heads)
    keep_rows(attn.wo_a, slice(groups.start * R, groups.stop * R))
    keep_rows(attn.wo_b, group.part(attn.wo_b.out_features, f"layer {attn.layer}: wo_b rows (dim)"))
    attn.n_heads, attn.n_groups = heads.stop - heads.start, groups.stop - groups.start
    attn.wo_b.group = group
    attn.wo_b.__class__ = GatheredLinear
