"""What differs between the training stages, behind one interface (`Stage`): the trainer asks its stage and never
branches on which one runs (docs/system.md §5 and §6).

A stage decides where the tokenizer, the model and its weights come from, which parameters train, the loss (its
training module: forward(ids, targets, *extras) -> (loss, metrics)), any extra per-micro-batch forward inputs,
what an evaluation measures and what the end of a run adds to the summary. The stages: pretraining from scratch
(`pretrain.PretrainStage`) and the DSpark drafter on a frozen backbone (`dspark_stage.DSparkStage`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dsv41.train.parallel import Dist
from dsv41.train.qat import TrainCache


@dataclass
class Validation:
    """The fixed evaluation set and how to run it."""
    windows: torch.Tensor                  # [N, T+1] validation windows (data.eval_windows)
    token_bytes: torch.Tensor              # [V] UTF-8 bytes per id (0 for special tokens)
    batch_size: int
    dist: Dist
    autocast: Callable                     # () -> the context the model's forwards run in


class Stage(ABC):
    prefix = ""         # what the stage trains: the parameters, and the MoEs whose gate biases the balancer moves,
                        # whose names start with it

    def __init__(self, cfg):
        self.cfg = cfg                     # the run's TrainConfig

    @property
    def source(self) -> str:
        """Where the model comes from (a preset or a checkpoint), for the log."""
        return self.cfg.preset

    @abstractmethod
    def tokenizer(self, out: Path, corpus, dist: Dist, say) -> tuple[Path, dict]:
        """The tokenizer.json to use and its provenance ({"tokenizer_of": {...}} or {})."""

    @abstractmethod
    def build_model(self, tokenizer) -> nn.Module:
        """The Transformer for `tokenizer` (fp32, on the CPU, its config as `.cfg`) with its weights filled."""

    @abstractmethod
    def train_module(self, model: nn.Module, say) -> nn.Module:
        """The module the trainer runs: forward(ids [B,T], targets [B,T], *extras) -> (loss, {metric: float})."""

    def micro_extras(self, step: int, dist: Dist) -> list[tuple]:
        """Extra forward inputs of each of optimizer step `step`'s micro-batches (on this rank)."""
        return [()] * self.cfg.grad_accum

    @abstractmethod
    def evaluate(self, model: nn.Module, val: Validation) -> dict:
        """The validation metrics ({"val_...": value}); called on every rank."""

    @abstractmethod
    def finish(self, model: nn.Module, val: Validation, corpus, tokenizer) -> dict:
        """What the end of a run adds to the summary (the model in eval mode); called on every rank."""


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of prompts [B,P] by `n_new` tokens: one prefill, then one-token decode steps."""
    cache = TrainCache(model.cfg, prompts.size(0), model.dtype, prompts.device)
    seq, logits = prompts, model(prompts, cache, 0, last_only=True).logits
    for k in range(n_new):
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if k + 1 < n_new:
            logits = model(seq[:, -1:], cache).logits
    return seq
