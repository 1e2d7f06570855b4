"""The one place that picks a kernel backend (docs/architecture.md §5: chosen once, explicitly).

Backends:
  "torch"   the references (`*_ref`, the model's own math) on any device.
  "triton"  the Triton kernels (`dsv41.kernels.triton`); a requested backend that cannot run is an error:
            RuntimeError when Triton does not import, ValueError when the inputs are not what the kernel takes
            (CPU tensors, non-bf16 activations, inputs that need a gradient: the kernels have no backward).
  "auto"    (default) the Triton kernel when every tensor is on CUDA, Triton imports, the activations are bf16
            and no gradient is needed; the reference otherwise. Each (op, choice) is logged once, with the reason.

The choice is made here and nowhere else; `DSV41_KERNELS=torch|triton|auto` sets the initial backend. Triton is
imported lazily (only when a CUDA tensor asks for it), so CPU-only installs never need it.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["BACKENDS", "set_backend", "get_backend", "triton_available", "resolve"]

BACKENDS = ("auto", "torch", "triton")
log = logging.getLogger("dsv41.kernels")

_state: dict = {"backend": None, "triton": None, "triton_error": None, "logged": set()}


def triton_available() -> bool:
    """True when `triton` imports (tried once; the import error is kept for the messages)."""
    if _state["triton"] is None:
        try:
            import triton  # noqa: F401
            _state["triton"] = True
        except Exception as e:  # ImportError, or a broken install raising something else at import
            _state["triton"], _state["triton_error"] = False, f"{type(e).__name__}: {e}"
    return _state["triton"]


def set_backend(name: str) -> None:
    """Select the kernel backend for every op: "auto", "torch" or "triton" (RuntimeError if Triton is missing)."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    if name == "triton" and not triton_available():
        raise RuntimeError(f"kernel backend 'triton' requested but triton does not import ({_state['triton_error']})")
    _state["backend"] = name
    _state["logged"] = set()


def get_backend() -> str:
    if _state["backend"] is None:
        set_backend(os.environ.get("DSV41_KERNELS", "auto"))
    return _state["backend"]


def _log_once(op: str, choice: str, why: str) -> None:
    key = (op, choice, why)
    if key not in _state["logged"]:
        _state["logged"].add(key)
        log.info("kernels: %s -> %s (%s)", op, choice, why)


def resolve(op: str, tensors: list[torch.Tensor], bf16: torch.Tensor | None = None) -> str:
    """'torch' or 'triton' for one call of `op` on these tensors (see the module docstring).

    bf16: the activation tensor the Triton kernel requires in bfloat16 (the kernels round like the bf16 model)."""
    backend = get_backend()
    if backend == "torch":
        return "torch"
    # each check: why auto takes the reference, and the error of an explicit 'triton'
    if not all(t.is_cuda for t in tensors):
        why_auto, error = "CPU tensors", f"needs CUDA tensors, got devices {sorted({str(t.device) for t in tensors})}"
    elif not triton_available():                 # (never with an explicit 'triton': set_backend checked it)
        why_auto, error = f"triton unavailable ({_state['triton_error']})", "needs triton"
    elif torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        why_auto, error = ("gradient needed, the Triton kernel has no backward",
                           "has no backward; call it under torch.no_grad() or use the 'torch' backend for training")
    elif bf16 is not None and bf16.dtype != torch.bfloat16:
        why_auto = f"{bf16.dtype} activations, the Triton kernel is bf16-only"
        error = f"takes bfloat16 activations, got {bf16.dtype}"
    else:
        _log_once(op, "triton", "requested" if backend == "triton" else "auto: CUDA tensors and triton available")
        return "triton"
    if backend == "triton":
        raise ValueError(f"kernel backend 'triton': {op} {error}")
    _log_once(op, "torch", f"auto: {why_auto}")
    return "torch"
