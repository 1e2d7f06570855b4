"""The model-level switch between the two weight storages (docs/model.md §9).

dense   every quantized weight held dequantized as a float Parameter (exact in bf16): what training updates, what
        the GPU kernels read today.
packed  fp8 Linears as e4m3 codes + one e8m0 scale per 32 x 32 tile, routed experts as packed e2m1 + one e8m0 per
        row and 32 inputs, Engram tables as e4m3 rows + one e8m0 per 32 of a row: the checkpoint's own bytes under
        the checkpoint's names, for serving. bf16 / fp32 weights, and those the official code converts at load
        (`wo_a` dequantized to bf16, the heads promoted to fp32), are the same in both.

On the CPU a packed model computes the dense model's function bit for bit (the GEMMs read a block's bytes and
dequantize it exactly, in the same summation order); `load_model(..., storage="packed")` builds a model packed from
the start, and `pack_weights` turns a dense one (e.g. `dsv41 train` output) into it, rounding master weights to the
checkpoint formats as the release's quantizer does.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.model.common import Linear
from dsv41.model.engram import Engram, PackedTable

__all__ = ["pack_weights", "unpack_weights", "is_packed", "resident_weight_bytes", "engram_tables_on_host"]


def _switchable(model: nn.Module):
    return [m for m in model.modules() if (isinstance(m, Linear) and m.packable) or isinstance(m, Engram)]


def pack_weights(model: nn.Module) -> nn.Module:
    """Hold every fp8 / fp4 Linear weight and Engram table of `model` in its checkpoint storage (in place)."""
    for m in _switchable(model):
        m.pack()
    return model


def unpack_weights(model: nn.Module) -> nn.Module:
    """Back to dense Parameters holding the dequantized values (in place), e.g. to train from a packed model."""
    for m in _switchable(model):
        m.unpack()
    return model


def is_packed(model: nn.Module) -> bool:
    """Whether any weight of `model` is held packed."""
    return any(getattr(m, "packed", False) for m in _switchable(model))


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model's weights occupy as held: {"weights": parameters and persistent buffers outside the Engram
    tables, "engram_tables": the tables}; the figures `dsv41.analysis.memory` computes from the config
    (`weights.bytes`, `engram_tables.bytes` for a bfloat16 model in the checkpoint storage)."""
    out = {"weights": 0, "engram_tables": 0}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        leaf = name.rpartition(".")[0]
        owner = model.get_submodule(leaf) if leaf else model
        if name.rpartition(".")[2] in owner._non_persistent_buffers_set:
            continue
        key = "engram_tables" if ".engram.embed." in f".{name}" else "weights"
        out[key] += t.numel() * t.element_size()
    return out


def engram_tables_on_host(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Keep the packed Engram tables in host memory (pinned where a CUDA device exists, so the looked-up rows copy
    asynchronously) when the model moves to an accelerator, or let them move with it (`enabled=False`, the default:
    small models and tests). Call on a packed model still in host memory; ValueError otherwise."""
    for m in model.modules():
        if isinstance(m, Engram):
            if not isinstance(m.embed, PackedTable):
                raise ValueError("Engram tables in host memory need the packed storage: pack_weights(model) first")
            if m.embed.weight.device.type != "cpu":
                raise ValueError(f"Engram table on {m.embed.weight.device}: set the placement before moving the model")
            m.embed.host = enabled
            if enabled and torch.cuda.is_available():
                m.embed.weight, m.embed.scale = m.embed.weight.pin_memory(), m.embed.scale.pin_memory()
    return model
