"""What every Triton launcher shares: the interpreter switches, the last compiled kernel per launcher, the SM count,
libdevice (the accurate math functions).

Triton's interpreter (TRITON_INTERPRET=1, CPU debugging) gets bf16 dot products wrong: there the operands are
upcast to fp32 before the dot (the same products: bf16 values are exact in fp32). It runs no inline PTX either:
there the decoders take their arithmetic path (the same values) and libdevice calls are avoided.
"""

from __future__ import annotations

import functools
import os

import torch

try:                                                     # the accurate expf (Triton 3.x; older: tl.math.exp)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language import math as libdevice

__all__ = ["INTERPRET", "DOT_BF16", "ASM", "LAST", "sm_count", "libdevice", "aligned_rows"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DOT_BF16 = not INTERPRET
ASM = not INTERPRET

LAST: dict = {}          # the last compiled kernel per launcher (n_regs / n_spills for the benchmark's report)


_properties = functools.cache(torch.cuda.get_device_properties)         # of a CUDA device index


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (8 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 8
    return _properties(device.index if device.index is not None else torch.cuda.current_device()).multi_processor_count


def aligned_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as contiguous rows of `width`, at a 16-byte-aligned address (a copy only when x is not already). Triton
    compiles a kernel per pointer alignment, and a reduction's order can follow the layout the alignment selects, so
    the same row summed from an aligned and from an offset address may give other fp32 bits; one compiled variant
    per kernel rules that out. (It was the suspected cause of the mHC mixes kernel parting eager and CUDA-graph greedy
    runs on an H100; with it in place they still part: dsv41.kernels, HC_MIXES_KERNEL.)"""
    a = x.reshape(-1, width)
    if not a.is_contiguous() or a.data_ptr() % 16:
        a = a.clone(memory_format=torch.contiguous_format)
    return a

