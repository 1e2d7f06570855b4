"""The page allocator of one KV-source layer's global store (docs/system.md §3).

Legend: P page size in entries, C latent width, I index-key width.

Pages of P entries, `main [n_pages, P, C/2 + C/16]` and `index [n_pages, P, I/2 + I/32]` uint8 (288 B + 68 B for
the released geometry), one free list, the page count doubling when it runs out. A sequence holds a page list per
layer (page ids in entry order) and holds pages only for entries it has written; the main and index records of
entry e share page e // P.
"""

from __future__ import annotations

import torch

from dsv41.codecs import index_k_bytes, main_kv_bytes
from dsv41.devices import h2d
from dsv41.model.cache import LayerCacheSpec

KINDS = ("main", "index")                   # the two record kinds of a global-store entry


def grown(t: torch.Tensor, n: int, fill: float | None = None) -> torch.Tensor:
    """t with its first dim grown to n rows; the new rows hold `fill` (None: left uninitialised)."""
    shape = (n, *t.shape[1:])
    out = t.new_empty(shape) if fill is None else t.new_full(shape, fill)
    out[:t.size(0)] = t
    return out


def page_table(page_lists: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(page_lists), width] page ids (on the CPU): row b is page_lists[b], padded with page 0."""
    table = torch.zeros(len(page_lists), width, dtype=dtype)
    for b, pages in enumerate(page_lists):
        if pages:
            table[b, :len(pages)] = torch.tensor(pages, dtype=dtype)
    return table


def pages_at(ratios, page_size: int, tokens: int) -> int:
    """Pages a sequence of `tokens` positions holds over KV-source layers of these compression ratios: one entry
    per completed group of m positions, pages of page_size entries (what `PagedLayer.ensure` allocates)."""
    return sum(-(-(tokens // m) // page_size) for m in ratios)


class PoolFull(RuntimeError):
    """The pool's page limit would be exceeded. The engine's scheduler admits and preempts by pages so that it never
    is (docs/system.md §3); raised by direct users of a limited pool."""


class PageLimit:
    """Pages all KV-source layers of one pool hold together, against an optional limit (None: the layers grow
    freely)."""

    def __init__(self, limit: int | None = None):
        if limit is not None and limit <= 0:
            raise ValueError(f"page limit must be positive, got {limit}")
        self.limit, self.used = limit, 0

    def take(self, k: int) -> None:
        if self.limit is not None and self.used + k > self.limit:
            raise PoolFull(f"{k} more pages exceed the pool's limit of {self.limit} ({self.used} held)")
        self.used += k

    def give(self, k: int) -> None:
        self.used -= k


class PagedLayer:
    """One KV-source layer's global store: uint8 pages for main and index records and a free list."""

    def __init__(self, spec: LayerCacheSpec, page_size: int, n_pages: int, device: torch.device,
                 limit: PageLimit | None = None):
        self.spec, self.page_size, self.device = spec, page_size, device
        self.limit = limit or PageLimit()
        self.record_bytes = {"main": main_kv_bytes(spec.width), "index": index_k_bytes(spec.index_width)}
        self.data = {k: torch.zeros(n_pages, page_size, b, dtype=torch.uint8, device=device)
                     for k, b in self.record_bytes.items()}
        self.free: list[int] = list(range(n_pages - 1, -1, -1))       # pop() hands out the lowest id first
        self.refs: dict[int, int] = {}                                 # holders of shared pages (absent: one)
        self.version = 0                                               # bumped on every write (view memos)
        self.page_epoch = 0                                            # bumped whenever pages are released

    @property
    def n_pages(self) -> int:
        return self.data["main"].size(0)

    @property
    def page_bytes(self) -> int:
        return self.page_size * sum(self.record_bytes.values())

    def pages_for(self, entries: int) -> int:
        return -(-entries // self.page_size)

    def alloc(self, k: int) -> list[int]:
        self.limit.take(k)
        while len(self.free) < k:
            self._grow()
        return [self.free.pop() for _ in range(k)]

    def release(self, pages: list[int]) -> None:
        """One holder lets go of these pages; a page returns to the free list with its last holder."""
        freed = []
        for p in pages:
            n = self.refs.pop(p, 1)
            if n > 2:
                self.refs[p] = n - 1
            elif n == 2:
                pass                                               # one holder left: no entry
            else:
                freed.append(p)
        self.limit.give(len(freed))
        self.free.extend(reversed(freed))
        self.page_epoch += 1
        self.version += 1

    def share(self, pages: list[int]) -> list[int]:
        """One more holder of these (full, never again written) pages; returns them. The prefix device tier's
        sharing (`PackedKVPool.share_prefix`): a page holds only entries its holders have written before."""
        for p in pages:
            self.refs[p] = self.refs.get(p, 1) + 1
        return list(pages)

    def ensure(self, pages: list[int], entries: int) -> list[int]:
        """Extend a sequence's page list (in place) to hold `entries` entries; returns it."""
        need = self.pages_for(entries) - len(pages)
        if need > 0:
            pages.extend(self.alloc(need))
        return pages

    def truncate(self, pages: list[int], entries: int) -> None:
        """Release the pages of a sequence's page list (in place) beyond those `entries` entries need."""
        need = self.pages_for(entries)
        if len(pages) > need:
            self.release(pages[need:])
            del pages[need:]

    def _grow(self) -> None:
        """Double the page count (copying the held pages); the new pages join the free list uninitialised (reads
        mask every entry a sequence has not written)."""
        old = self.n_pages
        new = max(1, 2 * old)
        self.data = {k: grown(t, new) for k, t in self.data.items()}
        self.free = list(range(new - 1, old - 1, -1)) + self.free

    # ---------------------------------------------------------------- records by entry
    def records(self, kind: str) -> torch.Tensor:
        """uint8 [n_pages * P, bytes]: the records of `kind`, row page * P + slot."""
        data = self.data[kind]
        return data.view(-1, data.size(2))

    def entry_rows(self, pages: list[int], e0: int, e1: int) -> torch.Tensor:
        """Rows of `records` (on the device) holding entries e0..e1-1 (e1 > e0) of a sequence with this page
        list; only the pages those entries lie in are read (O(e1 - e0), not O(context))."""
        P = self.page_size
        p0 = e0 // P
        sub = torch.tensor(pages[p0:(e1 - 1) // P + 1], dtype=torch.long)
        e = torch.arange(e0, e1)
        return h2d(sub[e // P - p0] * P + e % P, self.device)
