"""Host -> GPU copies that do not stall the host.

`tensor.to("cuda")` from ordinary (pageable) host memory makes PyTorch synchronize the stream after the copy: the
host waits until the GPU has run everything queued before it. A decode step copies dozens of small index tensors
(positions, page tables, window rows, slots) this way, and each wait empties the GPU's queue, so host and GPU take
turns instead of overlapping. `h2d` asks for the asynchronous copy instead. For a pageable source CUDA copies the
bytes to its own staging buffer before `cudaMemcpyAsync` returns, so the source may be changed or freed at once,
and stream order puts the copy before every kernel launched after it. A pinned source would be read later by the
DMA engine (a later in-place write would race it), so it keeps the synchronous copy. Device -> host copies are
never made asynchronous here: the host reads their result.
"""

from __future__ import annotations

import torch


def h2d(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`; a pageable host tensor going to a GPU is copied without synchronizing the stream."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        return t.to(device, non_blocking=True)
    return t.to(device)
