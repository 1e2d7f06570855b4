"""Expert-parallel MoE: each rank holds a contiguous share of a layer's routed experts (ceil(E / N) of them),
the gate and the shared expert whole; tokens are dispatched by the gate, which every rank computes on the same
input, and combined in the one-device order.

Legend: N tokens (B*T), K activated experts, D width, E routed experts.

Dispatch needs no communication at small batch: the input [N,D] is the same on every rank (the attention's
output is gathered), so each rank runs its own experts on the rows routed to them. Combine: each rank writes
its experts' outputs (fp32) into the slot buffer [N,K,D] where token n chose them, zeros elsewhere; one
all-reduce merges the buffers (every slot has exactly one writer, so the sum is that writer's value whatever
order the backend adds in, `Group.merge_disjoint`). Then every rank sums each token's K slots in ascending
expert id from 0, adds the shared expert and casts: `dsv41.kernels.moe_ref.moe_combine`'s order, operation for
operation (its index_add adds one row at a time), and every expert ran on the same rows as on one device.
So the result is the one-device model's bits at any world size, and the same on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv41.model.moe import MoE
from dsv41.parallel.group import Group


def owned_experts(n_experts: int, group: Group) -> range:
    """The routed experts rank `group.rank` holds: a contiguous block of ceil(E / N) (the last rank may hold
    fewer, or none)."""
    per = math.ceil(n_experts / group.world)
    return range(min(n_experts, group.rank * per), min(n_experts, (group.rank + 1) * per))


class ExpertParallelMoE(MoE):
    """`MoE` whose `experts` list holds only the rank's experts (`nn.Identity` placeholders for the others, so
    the names and ids stay those of the checkpoint); the gate, records and replayed routes are `MoE.forward`'s,
    the experts' sum is this class's `module_loop`."""

    group: Group
    owned: range

    def fused_weights(self):
        """None: the experts op reads every expert's weights; the rank's share runs through `module_loop`."""
        return None

    def module_loop(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The rank's experts on their rows, the slots merged over the ranks, the one-device sum: x [N,D] ->
        [N,D] (routing, records and replays are `MoE.forward`'s, which calls this)."""
        slots = x.new_zeros(*indices.shape, self.dim, dtype=torch.float32)          # [N,K,D]
        for e in self.owned:
            rows, k = (indices == e).nonzero(as_tuple=True)                           # tokens ascending
            if len(rows):
                slots[rows, k] = self.experts[e](x[rows], weights[rows, k].unsqueeze(-1)).float()
        slots = self.group.merge_disjoint(slots)
        order = indices.argsort(dim=1)                                                # ascending expert id
        slots = slots.gather(1, order.unsqueeze(-1).expand_as(slots))
        y = torch.zeros_like(x, dtype=torch.float32)
        for k in range(slots.size(1)):
            y = y + slots[:, k]
        y = y + self.shared_experts(x).float()
        return y.type_as(x)


def shard_moe(moe: MoE, group: Group) -> None:
    """Keep the rank's routed experts of `moe` (the others replaced by placeholders, their tensors freed) and
    swap in the expert-parallel forward (in place)."""
    if isinstance(moe, ExpertParallelMoE):
        raise ValueError(f"MoE of layer {moe.layer} is already sharded")
    owned = owned_experts(moe.n_experts, group)
    for e in range(moe.n_experts):
        if e not in owned:
            moe.experts[e] = nn.Identity()
    moe.group, moe.owned = group, owned
    moe.__class__ = ExpertParallelMoE
