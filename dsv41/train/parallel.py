"""Parallelism, applied from outside the model and the trainer: the process group (`setup_distributed`, `Dist`)
and `parallelize`, which hands the trainer its loss module already wrapped.

Under `torchrun` with more than one process: data parallelism with `DistributedDataParallel` (gloo on CPU, NCCL
on GPU; each rank takes its slice of every global batch, so W processes with batch B follow the data of one
process with batch W*B), or with `fsdp` FSDP2 (`fully_shard` per Engram module and block, then the root; Muon, the
Sinkhorn optimizer and the balancer work on full tensors, see muon.py; NCCL on GPU, gloo on CPU; run on CPU with
2 processes and on one GPU, never on several GPUs yet). The DTensor helpers (`full_tensor`, `local_tensor`,
`local_rows`) are what the optimizers, the balancer and the checkpoint use to read and write sharded tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (moved through the device for NCCL)."""
        if self.world > 1:
            on_device = t.to(self.device) if self.device.type == "cuda" else t
            tdist.all_reduce(on_device)
            t.copy_(on_device)                     # a no-op when it is t itself
        return t

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        box = [obj]
        if self.world > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]


def setup_distributed(device: str) -> Dist:
    """Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) join the process group (NCCL on GPUs, gloo on CPU),
    also with one process (FSDP2 needs the group); a plain process is rank 0 of 1. `device`: auto | cpu | cuda."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    if not tdist.is_initialized():
        tdist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank, world, torch.device(f"cuda:{local}" if use_cuda else "cpu"))


def parallelize(module: nn.Module, model: nn.Module, dist: Dist, fsdp: bool) -> nn.Module:
    """The loss `module` (which holds `model`) as the trainer runs it. FSDP2 shards `model` in place, a unit per
    module entered through its own forward: Engram (called before its block), each block, then the root
    (embedding, final norm, head); `fully_shard` registers new (DTensor) parameters, so whoever holds the old
    ones (clipping, the optimizers) must collect them again. DDP wraps the module when there are several ranks;
    one plain process runs it as it is."""
    if fsdp:
        if not tdist.is_initialized():
            raise ValueError("--fsdp needs a torchrun launch (also for one process: FSDP2 needs the process group)")
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            if block.engram is not None:
                fully_shard(block.engram)
            fully_shard(block)
        fully_shard(model)
        return module
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [dist.device] if dist.device.type == "cuda" else None
        return DDP(module, device_ids=ids, find_unused_parameters=True)
    return module


# ------------------------------------------------------------------------------------------------ DTensor helpers

def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a no-op for ordinary tensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor as a plain tensor sharing its storage (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_rows(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's row shard of `full` for parameter `p` (FSDP2 Shard(0) splits rows like torch.chunk)."""
    if not hasattr(p, "to_local"):
        return full
    mesh = p.device_mesh
    parts = torch.chunk(full, mesh.size(), dim=0)
    r = mesh.get_local_rank()
    return parts[r] if r < len(parts) else full[:0]
