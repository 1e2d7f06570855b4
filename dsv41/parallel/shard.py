"""Cutting one module's tensors down to this rank's share, in place: the rows of a Linear (dense or packed), a
slice of a vector parameter. The same cuts apply to real tensors (`apply_plan` on a loaded model) and to meta
tensors (`dsv41.parallel.loading` builds the rank's model on the meta device, cuts it, then reads only the
rows it kept from the shards).

Row slices of a packed fp8 Linear keep whole 32 x 32 scale tiles: they must start on a multiple of 32 and end on
one (or at the last row); ValueError otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.model.common import Linear

TILE = 32


def scale_rows(kind: str, rows: slice, out_features: int) -> slice:
    """The scale rows that go with weight rows `rows` of a packed Linear of `kind` (fp8: one per 32-row tile;
    fp4: one per row)."""
    if kind != "fp8":
        return rows
    if rows.start % TILE or (rows.stop % TILE and rows.stop != out_features):
        raise ValueError(f"packed fp8 rows {rows.start}:{rows.stop} do not keep whole {TILE}x{TILE} scale tiles")
    return slice(rows.start // TILE, -(-rows.stop // TILE))


@torch.no_grad()
def keep_rows(lin: Linear, rows: slice) -> None:
    """Keep output rows `rows` of `lin` (its weight, scales when packed, bias)."""
    if lin.packed:
        sr = scale_rows(lin.kind, rows, lin.out_features)
        codes, scale = lin.weight[rows].clone(), lin.scale[sr].clone()
        del lin.weight, lin.scale
        lin.register_buffer("weight", codes)
        lin.register_buffer("scale", scale)
    else:
        lin.weight = nn.Parameter(lin.weight[rows].clone(), requires_grad=lin.weight.requires_grad)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias[rows].clone(), requires_grad=lin.bias.requires_grad)
    lin.out_features = rows.stop - rows.start


@torch.no_grad()
def keep_part(module: nn.Module, name: str, part: slice) -> None:
    """Keep `part` of the first dimension of parameter `name` of `module`."""
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(p[part].clone(), requires_grad=p.requires_grad))
