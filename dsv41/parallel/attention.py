"""Tensor-parallel attention: each rank runs its share of the heads and the `wo` groups that read them; the
latent KV, the compressor and the indexer stay whole on every rank (see the package docstring for why).

Legend: B batch, T tokens, H heads (Hr = H / N on a rank), C head dim, G output groups (Gr = G / N), R o_lora_rank,
D width, N ranks.

Cuts (`shard_attention`): `wq_b` keeps the rows of the rank's heads (a head is C consecutive rows), `attn_sink`
its heads, `wo_a` the rows of its groups (group g reads heads g H/G .. (g+1) H/G - 1: a rank's groups read
exactly its heads, which is why N must divide G), `wo_b` a 1/N share of its output rows (of D).

`output` on a rank: its groups' wo_a products [B,T,Gr,R] are gathered from every rank in rank order (= group
order) to the whole wo_b input [B,T,G*R]; each rank multiplies it by its wo_b rows and the D / N outputs are
gathered again. Every output element is the one-device model's own sum (the activation QDQ of wo_b sees the
whole input, each row's K blocks accumulate in the same order), so no reduction across ranks enters the result:
in the deterministic mode (exact block sums) it is the same bits at any world size.
"""

from __future__ import annotations

import torch

from dsv41.kernels.invariant import is_deterministic, tiled_linear
from dsv41.model.attention import Attention
from dsv41.model.common import apply_rope
from dsv41.parallel.group import Group
from dsv41.parallel.shard import keep_part, keep_rows


class TensorParallelOutput:
    """Mixed in front of an attention class (`Attention`, `DSparkAttention`): the grouped output projection over
    the rank's heads and groups, gathered as the module docstring says."""

    group: Group

    def output(self, o: torch.Tensor, freqs: torch.Tensor, conj_freqs: torch.Tensor | None = None) -> torch.Tensor:
        """o [B,T,Hr,C] (this rank's heads) -> [B,T,D] (every rank the same)."""
        B, T = o.shape[:2]
        o = apply_rope(o, freqs, inverse=True) if conj_freqs is None else apply_rope(o, conj_freqs)
        o = o.reshape(B, T, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        if is_deterministic():
            o = torch.stack([tiled_linear(o[:, :, g], wo_a[g]) for g in range(self.n_groups)], dim=2)
        else:
            o = torch.einsum("btgd,grd->btgr", o.to(wo_a.dtype), wo_a)
        o = self.group.gather(o.flatten(2), dim=-1)                                  # [B,T,G*R]
        return self.group.gather(self.wo_b(o), dim=-1)                               # [B,T,D]


_classes: dict[type, type] = {}


def tensor_parallel_class(cls: type) -> type:
    """`cls` with the tensor-parallel output in front (one class per attention class)."""
    if cls not in _classes:
        _classes[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelOutput, cls), {})
    return _classes[cls]


def shard_attention(attn: Attention, group: Group) -> None:
    """Cut `attn` to this rank's heads, groups and wo_b rows and swap in the tensor-parallel output (in place)."""
    if isinstance(attn, TensorParallelOutput):
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
    attn.group = group
    attn.__class__ = tensor_parallel_class(type(attn))
