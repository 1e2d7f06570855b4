"""Aux-loss-free MoE load balancing (docs/system.md §6, DeepSeek-V3 section 2.1.2), one bias vector per modality.

Each gate adds a per-expert bias to its scores for expert *selection* only (the routing weights use the raw
scores, `dsv41.model.moe.Gate`). After every optimizer step, each bias moves toward balance by a fixed amount:
    b_e <- b_e + u * sign(mean_e' load_e' - load_e)
an overloaded expert (load above the mean) loses u, an underloaded one gains u. Text tokens select with
`gate.bias` and image-span tokens with `gate.bias_vl`, so each vector is updated from its own modality's load
only (a step without image tokens leaves `bias_vl` untouched). Loads are counted over all micro-batches of the
step and, in data-parallel runs, summed over ranks, so every rank applies the same update.

The routing is what each gate returns (`Gate.forward`); the model keeps none of it. The balancer watches the
gates it balances (a forward hook each, holding their latest selection and image mask), and `observe` counts
what the forward that just ran selected.

The balance report is MaxVio = max_e load_e / mean_e load_e - 1 (0 = perfectly balanced; the DeepSeek
"maximal violation"), averaged over layers and also given for the worst layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dsv41.model.moe import MoE
from dsv41.train.parallel import full_tensor, local_rows, local_tensor


def expert_load(indices: torch.Tensor, n_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert: indices [..., K] (selected experts), mask [...] bool (tokens to count).
    Returns [E] float64."""
    idx = indices.reshape(-1, indices.size(-1))
    if mask is not None:
        idx = idx[mask.reshape(-1).to(idx.device)]
    return torch.bincount(idx.reshape(-1), minlength=n_experts).double().cpu()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """b + rate * sign(mean(load) - load) (pure). A modality with no tokens (all-zero load) is unchanged."""
    return bias + rate * torch.sign(load.mean() - load).to(bias)


def max_violation(load: torch.Tensor) -> float:
    """max load / mean load - 1 (0 when there is no load)."""
    mean = float(load.mean())
    return float(load.max()) / mean - 1.0 if mean > 0 else 0.0


class LoadBalancer:
    """Accumulates expert loads from the gates' selections after each forward and updates the gate biases once per
    optimizer step. `prefix` restricts it to MoEs whose module name starts with it (the DSpark stage balances
    only the drafter's MoEs; the frozen backbone's biases must not move)."""

    def __init__(self, model: nn.Module, rate: float = 1e-3, prefix: str = ""):     # DeepSeek-V3's u
        if rate < 0:
            raise ValueError(f"balance rate must be >= 0, got {rate}")
        self.rate = rate
        self.moes = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and name.startswith(prefix)]
        self.latest: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, m in self.moes:
            m.gate.register_forward_hook(functools.partial(self._selected, name), with_kwargs=True)
        self.reset()

    def _selected(self, name: str, gate, args, kwargs, out) -> None:
        """Forward hook of a balanced gate: keep its selection (indices [N,K]) and image mask [N] (or None)."""
        mask = args[1] if len(args) > 1 else kwargs.get("image_mask")
        self.latest[name] = (out[1].detach(), mask)

    def reset(self) -> None:
        self.loads = {name: {"text": torch.zeros(m.n_experts, dtype=torch.float64),
                             "image": torch.zeros(m.n_experts, dtype=torch.float64)} for name, m in self.moes}

    def observe(self) -> None:
        """Count the selections of the forward that just ran (each gate's latest), split by the gate's image mask."""
        for name, _ in self.moes:
            if name in self.latest:
                self.count(name, *self.latest.pop(name))

    def count(self, name: str, indices: torch.Tensor, image_mask: torch.Tensor | None = None) -> None:
        """Add MoE `name`'s selected experts indices [..., K] to its loads; image_mask [...] marks image-span
        tokens (their load goes to the image bias)."""
        n_experts = self.loads[name]["text"].numel()
        if image_mask is None:
            self.loads[name]["text"] += expert_load(indices, n_experts)
        else:
            mask = image_mask.reshape(indices.shape[:-1])
            self.loads[name]["text"] += expert_load(indices, n_experts, ~mask)
            self.loads[name]["image"] += expert_load(indices, n_experts, mask)

    @torch.no_grad()
    def step(self, all_reduce=None) -> dict[str, float]:
        """Apply the bias updates from the loads seen since the last step, then reset. `all_reduce(t)` sums a
        tensor over data-parallel ranks in place. Returns the balance report of the text loads. Under FSDP2 a bias
        is a sharded DTensor: the update is computed on the gathered vector (a collective; every rank steps with
        the same summed loads) and each rank keeps its own shard."""
        if all_reduce is not None and self.moes:
            vectors = [v for loads in self.loads.values() for v in loads.values()]
            summed = all_reduce(torch.cat(vectors))
            for v, s in zip(vectors, summed.split([v.numel() for v in vectors])):
                v.copy_(s)
        vios = [max_violation(v["text"]) for v in self.loads.values() if v["text"].sum() > 0]
        for name, m in self.moes:
            for kind, bias in (("text", m.gate.bias), ("image", m.gate.bias_vl)):
                load = self.loads[name][kind]
                if load.sum() > 0 and bias is not None:
                    local_tensor(bias).copy_(local_rows(bias, bias_update(full_tensor(bias), load, self.rate)))
        self.reset()
        if not vios:
            return {}
        return {"maxvio": sum(vios) / len(vios), "maxvio_worst": max(vios)}
