"""The ranks a parallel model spans and the three collectives its plan uses, each with a result that does not
depend on how the backend orders a reduction (so every rank holds the same bits, and they equal one process's).

`gather(t, dim)`   every rank's `t` concatenated along `dim` in rank order (wo_a groups, wo_b output rows);
`merge_disjoint(t)`  the sum of tensors of which at most one rank holds a nonzero value per element (the routed
                   experts' outputs, each (token, slot) computed by its expert's owner): x + 0 = x exactly, so
                   the sum is every element's owner value whatever order the backend adds in;
`broadcast(obj)`   rank 0's picklable object on every rank (the lockstep engine's commands).
A `Group` of one rank does none of them (the plan at world size 1 is the one-device model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Group":
        """The default process group (initialised by the caller: `dsv41.parallel.launch.init`), or one rank."""
        if not tdist.is_available() or not tdist.is_initialized():
            return cls()
        return cls(tdist.get_rank(), tdist.get_world_size())

    def part(self, n: int, what: str) -> slice:
        """This rank's contiguous share of n items split evenly (ValueError unless the world size divides n)."""
        if n % self.world:
            raise ValueError(f"{what}: {n} cannot be split evenly over {self.world} ranks")
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        tdist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    def merge_disjoint(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            tdist.all_reduce(t)
        return t

    def broadcast(self, obj):
        box = [obj]
        if self.world > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]
