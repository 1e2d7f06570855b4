"""The settings of one training run (`TrainConfig`: what `dsv41 train` parses, what a checkpoint records and a
resumed run restores) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.train.data import DEFAULT_VAL_FRACTION

DEFAULT_MINUTES = 5.0
STAGES = ("pretrain", "dspark")
DSPARK_DATA = ("greedy", "corpus")
OPTIMIZERS = ("muon", "adamw")
REPLAY_MODES = ("off", "decoder", "encoder", "both")
MUON_NS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    preset: str = "tiny"
    stage: str = "pretrain"
    data: str | None = None                # None: the Python standard library (data.py)
    out: str = "runs/train-tiny"
    init: str | None = None                # dspark stage: the pretrained checkpoint directory
    dspark_data: str = "greedy"            # dspark stage: the backbone's own greedy continuations | corpus windows
    dspark_pool: int = 384                 # dspark stage, greedy data: prompts in the pool (dspark_stage.py)
    steps: int | None = None               # in all (a resumed run trains up to it)
    minutes: float | None = None           # wall-time budget of this command (default when steps is None; a resumed
                                           # run adds the steps that fit to its saved step)
    seq_len: int = 128
    batch_size: int = 16                   # per process and micro-batch; tiny, 5 min, fast forward: 16 (41 steps,
                                           # val 5.675) beat 8 (61 steps, 5.718) and 32 (worse per token)
    grad_accum: int = 1
    lr: float = 3e-2                       # peak; tuned on the tiny preset (3e-3, 1e-2, 3e-2, 6e-2 tried)
    weight_decay: float = 0.1
    warmup: int | None = None              # steps; default 5% of the run
    clip: float = 1.0
    optimizer: str = "muon"                # muon: the routed recipe; adamw: AdamW for everything
    muon_ns: str = "auto"                  # Newton-Schulz dtype: auto (bf16 on GPUs and AMX CPUs) | fp32 | bf16
    qat: bool = False
    replay: str = "off"                    # bounded-replay simulation: off | decoder | encoder | both (qat.py)
    fast: bool = True                      # the training-only fast forward (fast.py; not under FSDP2)
    indexer_loss_weight: float = 1.0       # the indexer objective (indexer_loss.py); 0: indexers stay frozen
    balance_rate: float = 1e-2             # 10x DeepSeek-V3's 1e-3: runs here last 10^2, not 10^5 steps
    seed: int = 0
    eval_every: int | None = None          # default: 8 evaluations per run
    eval_windows: int = 32
    val_fraction: float = DEFAULT_VAL_FRACTION
    threads: int | None = None            # CPU default 1: OpenMP threads that spin-wait collapse on shared cores
    device: str = "auto"
    fsdp: bool = False
    sample_tokens: int = 64
    save_every: int | None = None          # default: at every evaluation
    quiet: bool = False

    def validate(self) -> None:
        for name, allowed in (("stage", STAGES), ("optimizer", OPTIMIZERS), ("muon_ns", MUON_NS),
                              ("replay", REPLAY_MODES), ("device", DEVICES), ("dspark_data", DSPARK_DATA)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "eval_windows", "steps", "dspark_pool"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.steps is not None and self.minutes is not None:
            raise ValueError("give --steps or --minutes, not both")
        if self.indexer_loss_weight < 0:
            raise ValueError(f"--indexer-loss-weight must be >= 0, got {self.indexer_loss_weight}")
        if self.lr <= 0 or self.clip < 0 or self.weight_decay < 0:
            raise ValueError(f"--lr {self.lr}, --clip {self.clip}, --weight-decay {self.weight_decay}: out of range")
        if self.stage == "dspark" and not self.init:
            raise ValueError("--stage dspark needs --init CHECKPOINT (a pretrained model directory)")
        if self.stage == "dspark" and self.replay != "off":
            raise ValueError("--replay simulates bounded replay in pretraining; the dspark stage does not take it")
        if self.stage == "dspark" and self.fsdp:
            raise ValueError("--fsdp is wired for pretraining; the drafter stage is small: run it with DDP")

    def muon_ns_dtype(self, device: torch.device) -> torch.dtype:
        """The Newton-Schulz dtype of `--muon-ns`: auto is bf16 on GPUs and on CPUs with AMX bf16 tiles (oneDNN
        runs its batched matmuls ~2.7x faster than fp32 there; singular values land within ~1e-2 of 1 instead of
        ~1e-3, as on GPUs), fp32 on other CPUs."""
        if self.muon_ns == "auto":
            amx = device.type == "cpu" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
            return torch.bfloat16 if device.type == "cuda" or amx else torch.float32
        return torch.bfloat16 if self.muon_ns == "bf16" else torch.float32
