"""Training checkpoints: the model in our safetensors format (`dsv41.model.loading.save_checkpoint`: config.json,
model.safetensors, tokenizer.json) plus `train_state.pt` (optimizer state, data position, step, RNG, history,
the run's settings), so that a resumed run continues bit for bit.

The run's output directory is itself the checkpoint directory (`dsv41 generate --checkpoint runs/train-tiny`
loads it). A save writes everything into `.partial/` first and then moves each file into place, the train
state last; the step is recorded in both the safetensors metadata and the train state, and resuming refuses a
directory where they disagree (a save interrupted between the moves).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv41.model.loading import save_checkpoint
from dsv41.train.parallel import local_rows, local_tensor

TRAIN_STATE = "train_state.pt"
MODEL_FILE = "model.safetensors"
PROVENANCE = "tokenizer_provenance.json"


def save_training_checkpoint(out_dir: str | Path, state_dict: dict[str, torch.Tensor], cfg,
                             tokenizer_json: str | Path | None, train_state: dict, step: int, extra_meta: dict,
                             provenance: dict | None = None) -> None:
    """Write the checkpoint of the module docstring; `state_dict`: the full (unsharded) CPU tensors."""
    out = Path(out_dir)
    tmp = out / ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(SimpleNamespace(state_dict=lambda: state_dict), cfg, tmp,     # what it asks of a model
                    extra_meta={"step": step, **extra_meta}, tokenizer_json=tokenizer_json)
    if provenance is not None:
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    torch.save({**train_state, "step": step}, tmp / TRAIN_STATE)
    names = [n for n in ("config.json", MODEL_FILE, "tokenizer.json", PROVENANCE) if (tmp / n).exists()]
    for n in names + [TRAIN_STATE]:
        os.replace(tmp / n, out / n)
    shutil.rmtree(tmp)


def checkpoint_step(out_dir: str | Path) -> int | None:
    """The step of the model file in `out_dir` (None when there is none)."""
    path = Path(out_dir) / MODEL_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        step = (f.metadata() or {}).get("step")
    return int(step) if step is not None else None


def read_train_state(out_dir: str | Path) -> dict:
    """The train state saved in `out_dir` (the run's settings under "config")."""
    path = Path(out_dir) / TRAIN_STATE
    if not path.is_file():
        raise ValueError(f"--resume: {out_dir} holds no {TRAIN_STATE} (nothing to resume)")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_training_checkpoint(out_dir: str | Path, model: torch.nn.Module, state: dict | None = None) -> dict:
    """Load the model weights from `out_dir` into `model` (strict; under FSDP2 each rank its own rows) and return
    the train state (`state`: the one already read from `out_dir`, else read here)."""
    out = Path(out_dir)
    state = read_train_state(out) if state is None else state
    step = checkpoint_step(out)
    if step != state["step"]:
        raise ValueError(f"--resume: {out} has model step {step} but train state step {state['step']} "
                         f"(an interrupted save); remove the directory or restore a complete checkpoint")
    tensors = load_file(str(out / MODEL_FILE))
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(f"--resume: {out}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in own.items():
            local_tensor(v).copy_(local_rows(v, tensors[k]))
    return state
