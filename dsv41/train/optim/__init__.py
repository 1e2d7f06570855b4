"""Optimizers of the pretraining recipe (docs/system.md §6): update math in pure functions (`muon.py`,
`sinkhorn.py`), thin `torch.optim.Optimizer` classes around them, the parameter routing (`routing.py`) and
`OptimizerSet`, which drives the per-kind optimizers as one. AdamW is `torch.optim.AdamW` itself."""

from __future__ import annotations

import torch


class OptimizerSet:
    """Several optimizers stepped, zeroed, scheduled and checkpointed together (keyed by route kind)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)

    def step(self) -> None:
        """Step every optimizer, then clear their parameters' gradients (set to None)."""
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)

    def set_lr_factor(self, factor: float) -> None:
        """lr of every group = its base_lr * factor (the schedule)."""
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * factor

    def params(self) -> list[torch.Tensor]:
        return [p for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        return {k: opt.state_dict() for k, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run builds {sorted(self.optimizers)}")
        for k, opt in self.optimizers.items():
            opt.load_state_dict(state[k])


__all__ = ["OptimizerSet"]
