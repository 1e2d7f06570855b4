"""Which kernel path the model takes for a given call, decided here rather than inside the model's modules.

The model asks, per call: may the MoE run its experts as one op (`fused_moe`), may a decode step read the packed
store in place (`packed_decode`), may one fused mHC step span two blocks (`fused_mhc_across`)? Each answer depends
on the inputs (device, token count, store kind, hooks) and never on the numerics the model wants: every path
computes the same function (the references are the model's own math).

Legend: N tokens of the call.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# Up to this many tokens on a CUDA GPU the experts run as one op over their weights (`moe_experts`: Triton grouped
# kernels, no host sync, ~10 launches instead of ~10 per active expert). Above it the module loop's cuBLAS GEMMs
# read each expert's weights once, where the op's tiles of 16 pairs re-read them. Measured on an H100, v41-geometry
# packed, an eager ced-bounded prefill (`benchmarks/prefill_launches.py`, results/gpu-serving-h100-2026-12-07h):
# the op's prefill wall x0.67 of the loop's at 128 tokens and x0.60 at 512 (host-bound: 5.2K / 6.5K launches
# instead of 11K / 12K), though its GPU time is x1.3 / x2.1; at 2,048 tokens x1.36 (GPU time x3.4). Under load (the
# serving benchmark, another run) the idle TTFT halved but output tokens/s fell 53.4 -> 45.8: not yet compared in
# one run; $DSV41_FUSED_MOE_MAX_TOKENS sets the limit for such a comparison.
FUSED_MOE_MAX_TOKENS = 512

_packed = {"enabled": True, "verify": False}
_fused = {"moe_max_tokens": int(os.environ.get("DSV41_FUSED_MOE_MAX_TOKENS", FUSED_MOE_MAX_TOKENS)), "mhc": True}


def fused_moe(x: torch.Tensor) -> bool:
    """Take the experts op for these tokens x [N, D]: on a CUDA GPU, up to `set_fused_moe_max_tokens`'s limit
    (FUSED_MOE_MAX_TOKENS unless set)."""
    return x.is_cuda and x.size(0) <= _fused["moe_max_tokens"]


def set_fused_moe_max_tokens(n: int) -> None:
    """The most tokens a call runs through the experts op (comparisons: `benchmarks/prefill_launches.py`)."""
    _fused["moe_max_tokens"] = int(n)


def fused_mhc_across(*modules: nn.Module) -> bool:
    """Whether one fused mHC step may span these modules. A module with forward hooks (e.g. FSDP2 unsharding a
    block's parameters) must be entered through its __call__: its parameters may only be valid there; and
    `set_fused_mhc(False)` makes every block run on its own."""
    return _fused["mhc"] and not any(m._forward_pre_hooks or m._forward_hooks for m in modules)


def set_fused_mhc(enabled: bool) -> None:
    """`False`: no fused mHC step spans two blocks (each block computes its own attention mixes; the same function,
    more kernel launches on a GPU: comparisons and profiles)."""
    _fused["mhc"] = bool(enabled)


def set_packed_decode(enabled: bool) -> None:
    """`False` forces the dense decode path everywhere (comparisons, profiles)."""
    _packed["enabled"] = bool(enabled)


def set_packed_verify(enabled: bool) -> None:
    """`True`: continuations of a few tokens per row (speculative verifies) read the packed store in place too,
    a virtual row per query token (`dsv41.model.packed_decode.attend_packed`). Off by default: on a CPU the
    torch references then unpack the index keys once per query token, where the dense path unpacks them once per
    call (measured slower, docs/system.md §5, `benchmarks/verify_packed_ab.py`). It is the layout a
    graph-captured verify needs (fixed widths, no unpacked history)."""
    _packed["verify"] = bool(enabled)


def packed_verify() -> bool:
    return _packed["enabled"] and _packed["verify"]


def packed_decode(tokens: int, store_packed: bool, quantized: bool) -> bool:
    """Decode attention straight from the packed store: one token per row, a store that keeps packed bytes, and
    quantization on (the packed bytes hold the quantized values)."""
    return _packed["enabled"] and tokens == 1 and store_packed and quantized
