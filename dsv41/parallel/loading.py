"""Loading a checkpoint onto one rank of the plan: the rank's model is built on the meta device (no storage),
cut by the plan, given storage for what it kept, and filled from the shards with only the rank's slices.

`dsv41.model.shards.ShardReader` maps each shard file and hands out zero-copy views; a row slice of a view
touches only the pages of those rows, so a rank reads its heads' `wq_b` / `wo_a` rows, its `wo_b` rows and its
own experts, and nothing of the other ranks' experts. Either checkpoint layout (official, ours) and either
weight storage (dense: decoded to floats; packed: the codes and scales as stored, `dsv41/model/packed_weights.py`).

A packed fp8 Linear is stored in 32 x 32 tiles: a slice starting and ending on tile rows reads its codes and
scale rows as they are; a dense load of a slice that cuts a tile (small configs split over many ranks) decodes
the tile-aligned rows around it and keeps the slice.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch

from dsv41.codecs.weights import CODECS
from dsv41.config import load_config
from dsv41.model.common import Rope, warm_up_transcendentals, weight_storage
from dsv41.model.loading import scale_name, storage_map, weight_slots
from dsv41.model.shards import ShardReader
from dsv41.parallel.group import Group
from dsv41.parallel.plan import apply_plan, check_plan
from dsv41.parallel.shard import TILE


def _tokenizer_map(path: Path, cfg):
    tok = path / "tokenizer.json"
    if not (cfg.engram_enabled and tok.is_file()):
        return None
    from tokenizers import Tokenizer

    from dsv41.model.engram import build_compressed_token_map
    return build_compressed_token_map(Tokenizer.from_file(str(tok)))


def build_rank_model(cfg, group: Group, dtype: torch.dtype, storage: str, token_map=None):
    """The rank's cut model with uninitialised storage for exactly what it keeps (built on the meta device).

    What the constructor computes rather than allocates is computed off the meta device: the RoPE tables (cached
    per setting: computed first) and the Engram hasher (its tables from the token map: built afterwards)."""
    from dsv41.model import transformer
    from dsv41.model.engram import NgramHasher, identity_token_map

    check_plan(cfg, group.world)
    warm_up_transcendentals()
    Rope(cfg, 0), Rope(cfg, 1)
    with torch.device("meta"), weight_storage(storage), mock.patch.object(transformer, "NgramHasher",
                                                                          lambda *_: None):
        model = transformer.Transformer(cfg, dtype=dtype, token_map=token_map)
    apply_plan(model, group)
    model = model.to_empty(device="cpu")
    if cfg.engram_enabled:
        model.engram_hasher = NgramHasher(cfg, identity_token_map(cfg.vocab_size) if token_map is None else token_map)
    return model


def _rows_of(slot_shape: tuple, full_shape: tuple, group: Group, name: str) -> slice | None:
    """Which rows of checkpoint tensor `name` the rank's slot holds: None for the whole tensor; a cut tensor's
    share is found from the sizes (every cut is one even share of the first dimension)."""
    if tuple(slot_shape) == tuple(full_shape):
        return None
    if tuple(slot_shape[1:]) != tuple(full_shape[1:]) or full_shape[0] != slot_shape[0] * group.world:
        raise ValueError(f"tensor {name!r}: the rank holds {tuple(slot_shape)}, the checkpoint {tuple(full_shape)}")
    n = slot_shape[0]
    return slice(group.rank * n, (group.rank + 1) * n)


def _read_quantized(reader: ShardReader, name: str, kind: str, rows: slice | None, dst, dst_scale) -> None:
    """A quantized weight's rows: bytes into a packed slot, decoded values into a dense one."""
    with reader.tensor(name) as w, reader.tensor(scale_name(name)) as s:
        if rows is None:
            w_part, s_part, keep = w, s, slice(None)
        elif kind == "fp8":
            lo, hi = rows.start // TILE * TILE, min(w.size(0), -(-rows.stop // TILE) * TILE)
            w_part, s_part, keep = w[lo:hi], s[lo // TILE:-(-hi // TILE)], slice(rows.start - lo, rows.stop - lo)
        else:
            w_part, s_part, keep = w[rows], s[rows], slice(None)
        if dst_scale is not None:
            if keep != slice(None) and (keep.start or keep.stop != w_part.size(0)):
                raise ValueError(f"tensor {name!r}: packed rows {rows.start}:{rows.stop} cut a {TILE}x{TILE} tile")
            dst.copy_(w_part.view(torch.uint8))
            dst_scale.copy_(s_part.view(torch.uint8))
        else:
            dst.copy_(CODECS[kind][1](w_part, s_part)[keep])


def _fill(model, cfg, reader: ShardReader, group: Group) -> None:
    slots, smap = weight_slots(model), storage_map(model, cfg)
    with torch.no_grad():
        for name, slot in slots.items():
            if name not in reader:
                raise ValueError(f"checkpoint: missing tensor {name!r}")
            kind = smap[name]
            stored = kind in CODECS and scale_name(name) in reader
            full = slot.shape if not stored else None
            if full is None:                                   # the dequantized shape from the scale tensor
                codes = reader.info(name)[1]
                full = (codes[0], slot.shape[1])
            else:
                full = reader.info(name)[1]
            rows = _rows_of(slot.shape, full, group, name)
            if stored:
                _read_quantized(reader, name, kind, rows, slot.tensor, slot.scales)
                continue
            with reader.tensor(name) as t:
                part = t if rows is None else t[rows]
                if slot.scales is None:
                    slot.tensor.copy_(part)
                else:                                           # a float tensor into a packed slot: quantize
                    codes, scales = CODECS[kind][0](part)
                    slot.tensor.copy_(codes.view(torch.uint8))
                    slot.scales.copy_(scales.view(torch.uint8))
        held = set(slots) | {scale_name(n) for n, slot in slots.items() if slot.scales is not None}
        for name, buf in model.named_buffers():               # persistent buffers our own format holds
            if name not in held and name in reader:
                with reader.tensor(name) as t:
                    buf.copy_(t)


def load_sharded(path: str | Path, group: Group | None = None, dtype: torch.dtype = torch.float32,
                 storage: str = "dense", engram_tables: str = "auto", device: str | torch.device = "cpu"):
    """Load checkpoint directory `path` (official layout or ours) as rank `group.rank` of the plan -> (model, cfg),
    on `device`. Packed Engram tables stay in each rank's host memory, the step's rows prefetched to its device,
    as `load_model`'s `engram_tables` decides (`dsv41.model.loading.engram_host`)."""
    from dsv41.model.loading import engram_host
    from dsv41.model.packed_weights import engram_tables_on_host

    group = group or Group.current()
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: not a directory")
    cfg = load_config(path)
    model = build_rank_model(cfg, group, dtype, storage, _tokenizer_map(path, cfg))
    with ShardReader(path) as reader:
        _fill(model, cfg, reader, group)
    if storage == "packed" and engram_host(model, engram_tables, torch.device(device)):
        engram_tables_on_host(model)
    return model.eval().to(device), cfg
