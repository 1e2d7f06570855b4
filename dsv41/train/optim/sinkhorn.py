"""Sinkhorn-balanced momentum (docs/system.md §6) for the vocabulary-sized tables: the token embedding, the LM head,
the Engram hash tables (lr x 5) and the DSpark Markov tables.

For a table W [n, d] (one row per token / bucket) with gradient G:
    M_t  = beta M_{t-1} + (1 - beta) G_t               one momentum buffer, no second moment
    N_t  = beta M_t + (1 - beta) G_t                   Nesterov
    rows with l2 norm rho_i <= tau * mean(rho) are zeroed          (tau = 1e-3; mean over all n rows)
    U^(0) = N_t; for k = 1..K: odd k divides every row by its l2 norm, even k every column     (K = 11)
    Delta = sqrt(d) * U^(K)
    W <- W - gamma * lr * Delta                        (gamma = 0.18, no weight decay)

The scale. K is odd, so the last step normalises rows: every surviving row of U^(K) has l2 norm exactly 1 and
RMS 1/sqrt(d). The alternation converges to the matrix whose rows have norm 1 and whose columns share one norm
c; the total squared mass is then n_a (surviving rows) = d c^2, so each column has RMS c / sqrt(n_a) =
1/sqrt(d) as well. Multiplying by sqrt(d) therefore makes the row RMS exactly 1, the column RMS ~1 and
RMS(Delta) = 1 over the surviving rows. (docs/report.md writes Delta = n U^(K) for their normalisation; with l2
normalisation sqrt(d) is the factor that gives RMS 1, and gamma = 0.18 then gives the update RMS of Muon and
AdamW, see muon.py.)

Zero-gradient rows: a row whose gradient is exactly zero this step (a token or hash bucket absent from the
batch) keeps its weights AND its momentum bit-identical (lazy rows, like SparseAdam): the update touches only
rows the step saw. Such rows are zero in N_t, so they take no part in the normalisations either.

Momentum beta is not given by the spec; 0.95 (Muon's value) is the default here.
"""

from __future__ import annotations

import math

import torch

from dsv41.train.optim.muon import GAMMA, MomentumOptimizer, apply_update

SINKHORN_ITERS = 11
TAU = 1e-3


def sinkhorn_balance(n: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """Alternate l2 normalisation of rows (odd k) and columns (even k), k = 1..iters. Zero rows and columns
    stay zero. [n, d] -> [n, d] fp32."""
    u = n.float()
    for k in range(1, iters + 1):
        norm = torch.linalg.vector_norm(u, dim=1 if k % 2 else 0, keepdim=True)   # odd: a row's entries
        u = u / torch.where(norm > 0, norm, torch.ones_like(norm))
    return u


def sinkhorn_direction(n: torch.Tensor, iters: int = SINKHORN_ITERS, tau: float = TAU) -> torch.Tensor:
    """Delta of the module docstring for a Nesterov direction N [n, d]: small rows zeroed, balanced, scaled."""
    rho = torch.linalg.vector_norm(n.float(), dim=1)
    keep = rho > tau * rho.mean()
    u = sinkhorn_balance(n.float() * keep.unsqueeze(1), iters)
    return u * math.sqrt(n.size(1))


def sinkhorn_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure step for one table: (update to subtract after multiplying by lr, new momentum), with lazy rows: rows
    whose gradient is all zero keep their momentum and get a zero direction."""
    g = grad.float()
    seen = (g != 0).any(dim=1, keepdim=True)
    m = torch.where(seen, beta * momentum + (1 - beta) * g, momentum)
    n = torch.where(seen, beta * m + (1 - beta) * g, torch.zeros_like(g))
    return GAMMA * sinkhorn_direction(n), m


class SinkhornMomentum(MomentumOptimizer):
    """The optimizer of the module docstring, for [rows, width] tables. Param groups may carry an `lr` of their own
    (Engram: 5x)."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.95):
        if lr < 0 or not 0 <= beta < 1:
            raise ValueError(f"SinkhornMomentum: lr {lr}, beta {beta} out of range")
        super().__init__(params, dict(lr=lr, beta=beta))

    def update_group(self, group: dict) -> None:
        for p, g, state in self.gradients(group):
            upd, state["momentum"] = sinkhorn_update(g, state["momentum"], group["beta"])
            apply_update(p, upd, group["lr"])
