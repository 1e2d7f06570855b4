"""What every Triton launcher shares: the interpreter switches, the last compiled kernel per launcher, the SM count.

Triton's interpreter (TRITON_INTERPRET=1, CPU debugging) gets bf16 dot products wrong: there the operands are
upcast to fp32 before the dot (the same products: bf16 values are exact in fp32). It runs no inline PTX either:
there the decoders take their arithmetic path (the same values) and libdevice calls are avoided.
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET", "DOT_BF16", "ASM", "LAST", "sm_count"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DOT_BF16 = not INTERPRET
ASM = not INTERPRET

LAST: dict = {}          # the last compiled kernel per launcher (n_regs / n_spills for the benchmark's report)

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (8 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 8
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]
