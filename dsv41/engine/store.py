"""Sequence stores the engine binds into the model: the packed pool (dsv41.kv, the real bytes) for quantized
models, and a dense one (per-sequence `DenseCache`, stacked per step) for models whose quantize-dequantize
steps are switched off (their values are not representable in the packed formats)."""

from __future__ import annotations

import itertools

import torch

from dsv41.model.cache import DenseCache


class DensePool:
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
        if len(sids) > 1:
            for b, s in enumerate(sids):
                self.seqs[s] = view.select(b)

    def seq_bytes(self, sid: int) -> dict:
        c = self.seqs[sid]
        return {"global_bytes": c.global_bytes(), "tokens": int(c.pos[0]), "packed": False}


def make_pool(model, device="cpu"):
    """The packed pool when the model quantizes (official numerics), else the dense reference store."""
    from dsv41.model.common import QuantSite
    quant = all(m.quant for m in model.modules() if isinstance(m, QuantSite))
    if quant:
        from dsv41.kv import PackedKVPool
        return PackedKVPool(model.cfg, device=device, dtype=model.dtype)
    return DensePool(model.cfg, model.dtype, device)
