"""Sequence pools the engine binds into the model: the packed pool (dsv41.kv, the real bytes) for quantized
models, and a dense one (per-sequence `DenseCache`, stacked per step) for models whose quantize-dequantize
steps are switched off (their values are not representable in the packed formats).

`SequencePool` is what the engine asks of either; the packed pool adds what prefix caching and the server's page
gauge need, which only the packed bytes can give (the prefix cache stores them as they are)."""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from dsv41.kv import PackedKVPool
from dsv41.model.cache import DenseCache, KVStore
from dsv41.model.common import QuantSite


class SequencePool(Protocol):
    """Sequences by id; `bind` hands the model one store over a batch of them for one forward, `release` ends
    that binding (a store that is a copy writes its rows back)."""

    packed: bool                                  # True: a `PackedPool`

    def new_sequence(self) -> int: ...

    def free(self, sid: int) -> None: ...

    def bind(self, sids: list[int]) -> KVStore: ...

    def release(self, view: KVStore, sids: list[int]) -> None: ...

    def seq_bytes(self, sid: int) -> dict: ...


class PackedPool(PackedKVPool, SequencePool):
    """The packed store as the engine's pool. Beyond `SequencePool` it is what prefix caching and the server's page
    gauge need, which only the packed bytes can give: sequences export and import their persistent (global) and
    SWA state, which the prefix cache stores as they are (`export_global`, `import_global`, `export_swa`,
    `import_swa`; docs/system.md §4), and the pool reports its page allocation (`pool_bytes`)."""

    packed = True

    def release(self, view: KVStore, sids: list[int]) -> None:
        """Nothing to write back: a view reads and writes the pool's pages and rings in place."""


class DensePool(SequencePool):
    packed = False

    def __init__(self, cfg, dtype: torch.dtype, device="cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.seqs: dict[int, DenseCache] = {}
        self._ids = itertools.count()

    def new_sequence(self) -> int:
        sid = next(self._ids)
        self.seqs[sid] = DenseCache(self.cfg, 1, self.dtype, self.device)
        return sid

    def free(self, sid: int) -> None:
        self.seqs.pop(sid, None)

    def bind(self, sids: list[int]) -> DenseCache:
        return self.seqs[sids[0]] if len(sids) == 1 else DenseCache.stack([self.seqs[s] for s in sids])

    def release(self, view: DenseCache, sids: list[int]) -> None:
        """A batch of several sequences was bound as a stacked copy: its rows go back to their sequences."""
        if len(sids) > 1:
            for b, s in enumerate(sids):
                self.seqs[s] = view.select(b)

    def seq_bytes(self, sid: int) -> dict:
        c = self.seqs[sid]
        return {"global_bytes": c.global_bytes(), "tokens": int(c.pos[0]), "packed": False}


def make_pool(model, device="cpu", page_size: int = 64, max_pages: int | None = None) -> SequencePool:
    """The packed pool when the model quantizes (official numerics), else the dense reference store (which holds
    no pages: the engine's scheduler counts its pages by the same rule, `dsv41.kv.pages.pages_at`)."""
    if all(m.quant for m in model.modules() if isinstance(m, QuantSite)):
        return PackedPool(model.cfg, device=device, dtype=model.dtype, page_size=page_size, max_pages=max_pages)
    return DensePool(model.cfg, model.dtype, device)
