"""Split-K summed inside the kernel, shared by the decode GEMMs (packed_gemm.py, fp8_decode.py).

When a decode GEMM's N / BN output tiles leave SMs idle, K is split into S parts, one program each. Each part stores
its fp32 partial of the tile and counts itself done on the tile's counter (a device int32, atomically, after a
barrier: the partial is visible before the count); the part that finds S - 1 parts done adds the S partials (in a
fixed order: the result does not depend on which part finishes last), adds the bias, casts, stores y, and resets the
counter to 0 for the next call (so CUDA-graph replays need no memset). The earlier decode path summed the parts with
torch (`out.sum(0)`, then the bias and the cast): two or three more launches per GEMM.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["splitk_finish", "tile_counters"]

_COUNTERS: dict = {}
# fp32 values the finish may load at once (below). 0 = one partial at a time, the default: on the H100 loading 8
# partials of a 16 x 64 tile at once (8192) made wq_b 1.7x and wkv 2.1x slower at M = 1 (the larger finish raised
# the register use of the whole kernel it is inlined into), 2048 was even with 0 on wq_b and 8% slower on wkv
# (benchmarks/results/packed_gemm_h100-2026-12-06b-finish*.log).
FINISH_VALUES = int(os.environ.get("DSV41_SPLITK_FINISH", "0"))


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """The split-K counters of a device (int32 zeros, at least n; every finishing part resets its tile's to 0).
    Allocated once per device, outside any CUDA-graph capture where the first call is a warm-up (as the graph
    runner's is)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


@triton.jit
def splitk_finish(acc, part, ws_ptr, cnt_ptr, b_ptr, y_ptr, rm, rn, mm, nm, M, N, S, HAS_BIAS: tl.constexpr):
    """acc [R, BN] is split part `part`'s fp32 partial of the y tile (rows rm, columns rn): stored at ws[part],
    counted on cnt_ptr (this tile's counter); the last part to finish sums ws[0..S-1] (+ bias), casts into y and
    resets the counter. With S == 1 it stores acc (+ bias) directly.

    The sum loads CHUNK partials at once ([CHUNK, R, BN], as many as keep CHUNK x R x BN within FINISH_VALUES;
    1 by default) and adds each chunk's tree sum in chunk order: a fixed order either way."""
    mask = mm[:, None] & nm[None, :]
    off = rm[:, None].to(tl.int64) * N + rn[None, :]
    if S == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + part.to(tl.int64) * M * N + off, acc, mask=mask)
        tl.debug_barrier()                                   # every thread's partial stored before the count
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            CHUNK: tl.constexpr = _chunk(acc.shape[0] * acc.shape[1])
            tot = tl.zeros(acc.shape, tl.float32)
            for p0 in range(0, S, CHUNK):
                pp = p0 + tl.arange(0, CHUNK)
                at = ws_ptr + pp[:, None, None].to(tl.int64) * M * N + off[None, :, :]
                tot += tl.sum(tl.load(at, mask=(pp < S)[:, None, None] & mask[None, :, :], other=0.0,
                                      cache_modifier=".cg"), axis=0)
            if HAS_BIAS:
                tot += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + off, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.constexpr_function
def _chunk(tile: int) -> int:
    """Partials summed per load in the split-K finish: a power of two <= 8 keeping CHUNK x tile <= FINISH_VALUES
    (1 where the tile alone exceeds it: one partial at a time)."""
    c = 8
    while c > 1 and c * tile > FINISH_VALUES:
        c //= 2
    return c
