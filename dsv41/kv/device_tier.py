"""The device-memory tier of prefix caching (docs/system.md §4): global KV that is still in the packed pool.

A finished sequence's pages are kept in the pool (`retain`), least recently used first out, and a running
sequence's pages are there anyway; a new prompt that shares a prefix with either takes those pages without a copy
(`PackedKVPool.share_prefix`: full pages get one more holder, the partly filled last page is copied). The disk
tier would read the same records back from files; here nothing is read.

Where a shared prefix may end (its boundary U): at a multiple of every compression ratio (`align`: the compressor
carry is empty there), or at a position where the source sequence saved a unit (end of prompt, end of output),
whose carry and Engram history `note` kept at that moment. The SWA state at U comes from the SWA pool when that
unit's snapshot is still there (an exact resume), else the engine replays the window (bounded replay), as for a
disk hit. Sources and requests match only within one cache namespace (`cache_salt`), and only text prompts.

Budget: the scheduler counts the retained sequences' pages (`pages_held`) against the KV-page budget and evicts
the least recently used one (`evict_lru`) before it preempts any running sequence, and when a waiting request
does not fit. A page is freed with its last holder (`PagedLayer.release`), so evicting a source never takes pages
from a sequence that shares them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["DeviceTier", "DeviceHit", "Anchor"]


@dataclass
class Anchor:
    """What resuming at a saved unit's boundary needs beyond the shared pages: the compressor carry per layer
    ({layer: (kv, score)}, only layers whose ratio does not divide U) and the Engram history there."""

    carries: dict
    engram_history: torch.Tensor | None


@dataclass
class DeviceHit:
    source: int                 # the pool sequence whose pages are shared
    boundary: int               # U: positions 0..U-1 are taken from it
    anchor: Anchor | None       # None: U is a multiple of every ratio (no carry)


@dataclass
class _Source:
    ids: list[int]              # its tokens (the retained ones: everything it fed)
    salt: str | None


class DeviceTier:
    """Retained finished sequences of one pool (LRU) and the anchors of every sequence the engine noted.

    pool        the engine's `PackedKVPool`
    align       lcm of the compression ratios
    n_win       the shortest useful hit (the window: a shorter prefix saves less than its replay costs)
    capacity    retained sequences kept at most (the page budget may evict sooner)"""

    def __init__(self, pool, align: int, n_win: int, capacity: int = 64):
        if align <= 0 or capacity < 0:
            raise ValueError(f"align ({align}) must be positive and capacity ({capacity}) >= 0")
        self.pool, self.align, self.n_win, self.capacity = pool, align, n_win, capacity
        self.retained: OrderedDict[int, _Source] = OrderedDict()
        self.anchors: dict[int, dict[int, Anchor]] = {}
        self.counts = {"hits": 0, "hit_tokens": 0, "retained": 0, "evicted": 0}

    # ---------------------------------------------------------------- sources
    def note(self, sid: int, upto: int, carries: dict, engram_history: torch.Tensor | None) -> None:
        """Sequence `sid` stands at `upto` (a unit was saved there): keep what resuming there needs."""
        self.anchors.setdefault(sid, {})[int(upto)] = Anchor(dict(carries), engram_history)

    def retain(self, sid: int, ids: list[int], salt: str | None) -> None:
        """Keep a finished sequence's pages (it fed `ids`) instead of freeing them."""
        self.retained[sid] = _Source(list(ids), salt)
        self.counts["retained"] += 1
        while len(self.retained) > self.capacity:
            self.evict_lru()

    def forget(self, sid: int) -> None:
        """A sequence that is not retained (freed or preempted): drop its anchors."""
        self.anchors.pop(sid, None)

    def evict_lru(self) -> bool:
        """Free the least recently used retained sequence's pages; False when none is retained."""
        if not self.retained:
            return False
        sid, _ = self.retained.popitem(last=False)
        self.anchors.pop(sid, None)
        self.pool.free(sid)
        self.counts["evicted"] += 1
        return True

    def pages_held(self) -> int:
        """Pages the retained sequences hold (a page shared with a running sequence counted here too)."""
        return sum(len(p) for sid in self.retained for p in self.pool.seqs[sid].pages.values())

    def clear(self) -> None:
        while self.evict_lru():
            pass

    def stats(self) -> dict:
        """Counters (hits, hit_tokens, retained, evicted) and what the tier holds now (sequences, pages)."""
        return {**self.counts, "sequences": len(self.retained), "pages": self.pages_held()}

    # ---------------------------------------------------------------- lookup
    def lookup(self, ids: list[int], limit: int, salt: str | None, running: dict[int, _Source]) -> list[DeviceHit]:
        """Usable boundaries U <= limit, U > n_win, at which a retained or running sequence (same namespace) holds
        ids[:U], longest first: per source its saved units' anchors and the aligned boundary below the common
        prefix. running: {sid: source}, each standing at len(source.ids). The caller picks one (`use`)."""
        hits = []
        for sid, src in [*self.retained.items(), *running.items()]:
            if src.salt != salt:
                continue
            c = _common(ids, src.ids, min(limit, len(src.ids)))
            hits += [DeviceHit(sid, U, a) for U, a in self.anchors.get(sid, {}).items() if self.n_win < U <= c]
            if c // self.align * self.align > self.n_win:
                hits.append(DeviceHit(sid, c // self.align * self.align, None))
        return sorted(hits, key=lambda h: (h.boundary, h.anchor is not None), reverse=True)

    def use(self, hit: DeviceHit) -> None:
        """Count a hit the engine takes; a retained source becomes the most recently used."""
        self.counts["hits"] += 1
        self.counts["hit_tokens"] += hit.boundary
        if hit.source in self.retained:
            self.retained.move_to_end(hit.source)

    @staticmethod
    def source(ids: list[int], salt: str | None) -> _Source:
        return _Source(list(ids), salt)


def _common(a: list[int], b: list[int], n: int) -> int:
    """Length of the common prefix of a and b within the first n positions."""
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
