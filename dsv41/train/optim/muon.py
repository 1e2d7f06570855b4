"""Muon and head-wise Muon (docs/system.md §6): momentum, then the orthogonal polar factor of the momentum by
Newton-Schulz iteration, one factor per head block.

Update of a matrix W [R, C] split into `heads` row blocks of [R/heads, C] (heads = 1: plain Muon):
    M_t   = beta M_{t-1} + (1 - beta) G_t                      (EMA momentum)
    N_t   = beta M_t + (1 - beta) G_t                          (Nesterov look-ahead)
    O_h   = NS(N_t[block h])                                   (approximately U V^T of the block's SVD)
    W    <- W (1 - lr wd) - lr * gamma * sqrt(max(r, c)) * O   (r, c: the block's shape)

Head-wise: the query projection `attn.wq_b` [n_heads * head_dim, q_lora_rank] has one block per head, so each
head gets its own preconditioner instead of one shared by all heads (the indexer's `wq_b` likewise with its
heads); the key projections (`attn.wkv`: one shared KV head; `indexer.wk`) are one block each.

Scale: an orthogonal r x c factor has min(r, c) unit singular values, so its RMS is 1 / sqrt(max(r, c));
gamma * sqrt(max(r, c)) makes the update RMS gamma = 0.18, about AdamW's typical update RMS, so Muon, the
Sinkhorn optimizer (also gamma = 0.18) and AdamW share one learning rate and one weight decay (the "match the
AdamW RMS" rule of Moonlight, Liu et al. 2025).

Newton-Schulz: the quintic X <- a X + (b A + c A^2) X, A = X X^T, on X = N / ||N||_F. The hybrid schedule
follows the DeepSeek-V4 report: 8 steps with (3.4445, -4.7750, 2.0315), which push every singular value into
about [0.7, 1.2] fast, then 2 steps with (2, -1.5, 0.5) (f(1) = 1, f'(1) = 0), which pull them onto 1, so the
update is orthogonal to ~1e-3 rather than only roughly (docs/system.md §6 names Newton-Schulz without constants).
The iteration is batched over all blocks of one shape; fp32 on CPU, bf16 on GPUs (the `Muon(ns_dtype=...)`
override: the trainer's `--muon-ns auto` also takes bf16 on CPUs with AMX bf16 tiles, where its batched matmuls
run ~2.7x faster than fp32 on the tiny preset's expert blocks).

FSDP2: a sharded parameter (DTensor) is updated from its full gradient (`full_tensor()`); every rank computes
the same full update and keeps its own row shard (`torch.chunk` rows, the layout of FSDP2's Shard(0)). The
momentum is then a full-size replicated buffer: simple and exact, not the memory-optimal distributed Muon.
"""

from __future__ import annotations

import math

import torch

from dsv41.train.parallel import full_tensor, local_rows, local_tensor

NS_STEPS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
GAMMA = 0.18


def newton_schulz(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate orthogonal polar factor of every matrix in g [..., r, c] (`NS_STEPS`). The iteration runs in
    `dtype` (default: fp32 on CPU, bf16 on GPUs, where its matmuls are the whole cost; singular values then land
    within ~1e-2 of 1 instead of ~1e-3); the result is fp32."""
    dtype = dtype or (torch.bfloat16 if g.is_cuda else torch.float32)
    tall = g.size(-2) > g.size(-1)
    x = g.float().mT if tall else g.float()
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)).to(dtype)
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])                                   # one batch axis: the fused GEMMs below
    for a, b, c in NS_STEPS:
        A = torch.bmm(x, x.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)                  # b A + c A^2
        x = torch.baddbmm(x, B, x, beta=a)                           # a x + B x
    x = x.reshape(shape).float()
    return x.mT if tall else x


def orthogonal_blocks(blocks: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blocks [N, r, c] -> their orthogonal factors scaled to the update RMS gamma: gamma * sqrt(max(r, c)), since
    an orthogonal r x c factor has RMS 1 / sqrt(max(r, c)). fp32."""
    return newton_schulz(blocks, dtype) * (GAMMA * math.sqrt(max(blocks.shape[-2:])))


def orthogonalize_heads(n: torch.Tensor, heads: int) -> torch.Tensor:
    """N [R, C] -> scaled orthogonal factor of each of its `heads` row blocks, [R, C] fp32."""
    return orthogonal_blocks(n.reshape(heads, *_block_shape(n, heads))).reshape(n.shape)


def _block_shape(n: torch.Tensor, heads: int) -> tuple[int, int]:
    """The [R/heads, C] shape of one head block of a matrix [R, C]."""
    R, C = n.shape
    if R % heads:
        raise ValueError(f"a [{R}, {C}] matrix cannot be split into {heads} head blocks")
    return R // heads, C


def muon_momentum(grad: torch.Tensor, momentum: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(new momentum M_t, Nesterov direction N_t) of the module docstring."""
    m = beta * momentum + (1 - beta) * grad.float()
    return m, beta * m + (1 - beta) * grad.float()


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, heads: int = 1):
    """Pure head-wise Muon step for one matrix: (update to subtract after multiplying by lr, new momentum)."""
    m, n = muon_momentum(grad, momentum, beta)
    return orthogonalize_heads(n, heads), m


def apply_update(p: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float = 0.0) -> None:
    """p <- p (1 - lr wd) - lr update, in place (under `no_grad`), on the local shard of a DTensor."""
    data = local_tensor(p)
    u = local_rows(p, update).to(data.dtype)
    if weight_decay:
        data.mul_(1 - lr * weight_decay)
    data.sub_(lr * u)


class MomentumOptimizer(torch.optim.Optimizer):
    """What Muon and SinkhornMomentum share: 2-D parameters only, one fp32 momentum buffer each (created at zero),
    updates computed from the full gradient (FSDP2) one param group at a time (the subclass's
    `update_group(group)`). A parameter without a gradient in a step is skipped (its momentum is left as it was)."""

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        shapes = [tuple(p.shape) for group in self.param_groups for p in group["params"] if p.ndim != 2]
        if shapes:
            raise ValueError(f"{type(self).__name__} takes matrices; got parameters of shapes {shapes}")

    def gradients(self, group: dict):
        """(parameter, full gradient, its state) for each parameter of `group` that has a gradient."""
        for p in group["params"]:
            if p.grad is not None:
                g = full_tensor(p.grad)
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
                yield p, g, state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            self.update_group(group)
        return loss


class Muon(MomentumOptimizer):
    """Head-wise Muon. Each param group has `heads` (row blocks per matrix); matrices of a group whose blocks
    share a shape are orthogonalised in one batched Newton-Schulz call, in `ns_dtype` (None: `newton_schulz`'s
    default; a run setting, not a group's)."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.95, weight_decay: float = 0.0, heads: int = 1,
                 ns_dtype: torch.dtype | None = None):
        if lr < 0 or not 0 <= beta < 1 or weight_decay < 0:
            raise ValueError(f"Muon: lr {lr}, beta {beta}, weight_decay {weight_decay} out of range")
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay, heads=heads))
        self.ns_dtype = ns_dtype

    def update_group(self, group: dict) -> None:
        buckets: dict[tuple[int, int], list] = {}
        for p, g, state in self.gradients(group):
            state["momentum"], n = muon_momentum(g, state["momentum"], group["beta"])
            buckets.setdefault(_block_shape(n, group["heads"]), []).append((p, n))
        for (r, c), items in buckets.items():
            blocks = orthogonal_blocks(torch.cat([n.reshape(-1, r, c) for _, n in items]), self.ns_dtype)
            for (p, n), upd in zip(items, blocks.split([n.numel() // (r * c) for _, n in items])):
                apply_update(p, upd.reshape(n.shape), group["lr"], group["weight_decay"])
