"""`BatchView`: the model's KV-store interface (`dsv41.model.cache.PackedKVStore`) over a batch of sequences of a
`dsv41.kv.pool.PackedKVPool`, row b = seq_ids[b]. Cheap: rebind every step.

Every write packs (SWA rows with the Triton packer on a GPU, main KV with `pack_main_kv_exact`, index keys with
`pack_index_k`) and every read unpacks. Reads of the global store gather a sequence's pages and unpack the whole
visible history (the dense interface returns [B, N, C]); the unpacked tensor is memoised per view until the next
write to that layer, since every Reuse layer reads its source's entries again. The decode kernels instead read the
bytes in place (`packed_ring`, `packed_pages`).

Legend: B batch, T tokens written, W window rows, C latent width, K saved ring slots, P page size, MP pages per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv41.codecs import (index_k_bytes, main_kv_bytes, pack_index_k, pack_main_kv_exact, unpack_index_k,
                          unpack_main_kv, unpack_swa_kv)
from dsv41.devices import h2d
from dsv41.kernels import pack_swa_kv as pack_swa_rows
from dsv41.kv.pages import KINDS, page_table
from dsv41.model.cache import window_write_mask
from dsv41.model.engram import DEAD

if TYPE_CHECKING:
    from dsv41.kv.pool import PackedKVPool

_UNPACK = {"main": unpack_main_kv, "index": unpack_index_k, "swa": unpack_swa_kv}


class BatchView:
    """`DenseCache`'s interface over a batch of pool sequences (row b = seq_ids[b]). Cheap: rebind every step."""

    def __init__(self, pool: PackedKVPool, seq_ids: list[int]):
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence may appear once in a batch, got {seq_ids}")
        if not seq_ids:
            raise ValueError("bind needs at least one sequence")
        self.pool, self.seq_ids = pool, seq_ids
        self.seqs = [pool._seq(s) for s in seq_ids]
        self.cfg, self.dtype, self.device, self.specs = pool.cfg, pool.dtype, pool.device, pool.specs
        self.batch = len(seq_ids)
        self.slots = h2d(torch.tensor([s.slot for s in self.seqs], dtype=torch.long), pool.device)
        self._memo: dict = {}         # per view: page tables, unpacked records, the window write's ring rows

    # ---------------------------------------------------------------- per-sequence scalars
    @property
    def pos(self) -> torch.Tensor:
        return torch.tensor([s.pos for s in self.seqs], dtype=torch.long)

    @pos.setter
    def pos(self, value) -> None:
        v = torch.as_tensor(value, dtype=torch.long).expand(self.batch).tolist()
        for s, p in zip(self.seqs, v):
            s.pos = int(p)

    @property
    def engram_history(self) -> torch.Tensor | None:
        """[B, n-1] (rows of sequences without one yet start all-DEAD, as the hasher's `init_history`)."""
        hs = [s.engram_history for s in self.seqs]
        if all(h is None for h in hs):
            return None
        ref = next(h for h in hs if h is not None)
        return torch.stack([torch.full_like(ref, DEAD) if h is None else h for h in hs])

    @engram_history.setter
    def engram_history(self, value: torch.Tensor | None) -> None:
        for b, s in enumerate(self.seqs):
            s.engram_history = None if value is None else value[b].clone()

    @property
    def index_k_publisher(self) -> int | None:
        return next((s.index_k_publisher for s in self.seqs if s.index_k_publisher is not None), None)

    @index_k_publisher.setter
    def index_k_publisher(self, layer: int | None) -> None:
        for s in self.seqs:
            s.index_k_publisher = layer

    # ---------------------------------------------------------------- checks and memos
    def _memoized(self, name, key, build):
        """build() memoised per view under `name` while `key` stays the same."""
        hit = self._memo.get(name)
        if hit is None or hit[0] != key:
            hit = self._memo[name] = (key, build())
        return hit[1]

    def _verify(self, kind: str, records: torch.Tensor, x: torch.Tensor) -> None:
        if self.pool.strict and not torch.equal(_UNPACK[kind](records), x.float()):
            raise ValueError(f"packed {kind} store: written values are not representable in the packed format "
                             "(quantization off?); use DenseCache for unquantized models")

    # ---------------------------------------------------------------- sliding window
    def window_ring(self, layer: int) -> torch.Tensor:
        """[B, W, C] unpacked; slot p % W holds position p; never-written slots are 0."""
        return unpack_swa_kv(self.pool.swa[layer][self.slots]).to(self.dtype)

    def write_window(self, layer: int, start: torch.Tensor, kv: torch.Tensor,
                     count: torch.Tensor | None = None) -> None:
        """kv [B,T,C] for positions start_b..start_b+T-1 (only the first count_b of row b when given); only the
        last W of each row survive."""
        ring = self.pool.swa[layer]
        W, T = ring.size(1), kv.size(1)
        first = max(0, T - W)
        if T == 0:
            return
        x = kv[:, first:].detach()
        records = pack_swa_rows(x)                                # the Triton kernel on a GPU
        self._verify("swa", records, x)
        start = torch.as_tensor(start, dtype=torch.long).cpu()
        key = (W, first, T, tuple(start.view(-1).tolist()), None if count is None else
               tuple(torch.as_tensor(count).view(-1).tolist()))
        slot_pos, keep = self._memoized("window-write", key, lambda: (       # every layer of a step: the same rows
            h2d((start.view(-1, 1) + torch.arange(first, T)) % W, self.device),
            None if count is None else h2d(window_write_mask(count, first, T, W), self.device)))
        slots = self.slots.view(-1, 1).expand(-1, slot_pos.size(1))
        if keep is None:
            ring[slots, slot_pos] = records.to(self.device)
            return
        ring[slots[keep], slot_pos[keep]] = records.to(self.device)[keep]

    # ---------------------------------------------------------------- packed inputs of the decode kernels
    packed = True                     # the model's decode attention reads these bytes in place (packed_decode)

    def packed_ring(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's ring slab uint8 [S, W, bytes], each row's slot [B])."""
        return self.pool.swa[layer], self.slots

    def packed_pages(self, layer: int | None, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's pages of `kind` uint8 [NP, P, bytes], page table int32 [B, MP]: entry e of row b is row
        e % P of page table[b, e // P]; padding reads page 0). layer None: an empty stand-in (no global KV)."""
        if layer is None:
            width = main_kv_bytes(self.cfg.head_dim) if kind == "main" else index_k_bytes(self.cfg.index_head_dim)
            return (torch.zeros(1, 1, width, dtype=torch.uint8, device=self.device),
                    torch.zeros(self.batch, 1, dtype=torch.int32, device=self.device))
        pl = self.pool.global_layers[layer]
        tables = [s.pages[layer] for s in self.seqs]
        # the table changes only when a row gains or loses pages (every P entries), not on every record write:
        # between two releases a page list only grows at its tail
        shape = (pl.page_epoch, tuple((id(t), len(t)) for t in tables))
        table = self._memoized((layer, "table"), shape, lambda: h2d(
            page_table(tables, max(1, max(len(t) for t in tables)), torch.int32), self.device))
        return pl.data[kind], table

    # ---------------------------------------------------------------- speculative rollback (dsv41.engine.speculative)
    def ring_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ring slots [B,K] of every row (packed bytes)."""
        return self.pool.swa[layer][self.slots.view(-1, 1), slots.to(self.device)].clone()

    def set_ring_rows(self, layer: int, slots: torch.Tensor, saved: torch.Tensor, mask: torch.Tensor) -> None:
        """Put back `saved` (from `ring_rows`) into the slots where mask [B,K] is set."""
        m = mask.to(self.device)
        seq_slots = self.slots.view(-1, 1).expand_as(slots.to(self.device))
        self.pool.swa[layer][seq_slots[m], slots.to(self.device)[m]] = saved[m]

    def truncate_global(self, n_tokens: torch.Tensor) -> None:
        """Forget global entries of groups not completed within each row's first n_tokens_b positions; pages no
        longer needed go back to the free list."""
        pool = self.pool
        n = torch.as_tensor(n_tokens, dtype=torch.long).cpu().expand(self.batch).tolist()
        for L, pl in pool.global_layers.items():
            m = pool.specs[L].ratio
            for b, s in enumerate(self.seqs):
                entries = int(n[b]) // m
                for kind in KINDS:
                    s.rows[(L, kind)] = min(s.rows[(L, kind)], entries)
                pl.truncate(s.pages[L], max(s.rows[(L, k)] for k in KINDS))
            pl.version += 1

    # ---------------------------------------------------------------- global KV
    def write_records(self, layer: int, kind: str, row0, records: torch.Tensor, count) -> None:
        """Already-packed records [B, n, bytes] of `kind` ('main' or 'index'): row b writes its first count_b at
        entries row0_b.. (pages allocated as needed)."""
        pl = self.pool.global_layers[layer]
        if records.dtype != torch.uint8 or records.size(-1) != pl.record_bytes[kind]:
            raise ValueError(f"layer {layer} {kind} records must be uint8 [..., {pl.record_bytes[kind]}], got "
                             f"{records.dtype} {tuple(records.shape)}")
        r0 = torch.as_tensor(row0).expand(self.batch).tolist()
        cnt = torch.as_tensor(count).expand(self.batch).tolist()
        records = records.to(self.device)
        for b, s in enumerate(self.seqs):
            c, r = int(cnt[b]), int(r0[b])
            if c <= 0:
                continue
            rows = pl.entry_rows(pl.ensure(s.pages[layer], r + c), r, r + c)    # may grow pl.data: first
            pl.records(kind)[rows] = records[b, :c]
            s.rows[(layer, kind)] = max(s.rows[(layer, kind)], r + c)
        pl.version += 1

    def append_compressed(self, layer: int, row0: torch.Tensor, kv: torch.Tensor, count: torch.Tensor) -> None:
        """Main-KV entries (RoPE'd, FP4 QDQ'd) kv [B,n,C]: row b writes its first count_b at rows row0_b.."""
        self._append(layer, "main", row0, kv.detach(), count)

    def append_index_k(self, layer: int, row0: torch.Tensor, k: torch.Tensor, count: torch.Tensor) -> None:
        self._append(layer, "index", row0, k.detach(), count)

    def _append(self, layer: int, kind: str, row0, x: torch.Tensor, count) -> None:
        records = pack_main_kv_exact(x) if kind == "main" else pack_index_k(x, check_finite=False)
        self._verify(kind, records, x)
        self.write_records(layer, kind, row0, records, count)

    def read_records(self, layer: int, kind: str, n, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(records uint8 [B, max n - start, bytes], valid bool [B, max n - start]) of entries start..n_b-1 of each
        row, gathered from its pages; entries at or past a row's n (or never written) are invalid (their bytes are
        whatever the padding gather met)."""
        pool = self.pool
        pl = pool.global_layers[layer]
        P = pool.page_size
        n_list = [int(v) for v in torch.as_tensor(n).expand(self.batch).tolist()]
        have = [min(nb, s.rows[(layer, kind)]) for nb, s in zip(n_list, self.seqs)]
        nmax = max(n_list)
        data = pl.data[kind]
        if nmax <= start:
            return data.new_zeros(self.batch, 0, data.size(2)), torch.zeros(self.batch, 0, dtype=torch.bool)
        p0, n_pages = start // P, -(-nmax // P)
        table = page_table([s.pages[layer][p0:n_pages] for s in self.seqs], n_pages - p0, torch.long)
        e = torch.arange(start, nmax)
        flat = table[:, e // P - p0] * P + e % P                                 # [B, nmax - start]
        valid = e < torch.tensor(have).view(-1, 1)
        flat = h2d(torch.where(valid, flat, 0), self.device)
        return data.view(-1, data.size(2))[flat], valid

    def _read(self, layer: int, kind: str, n) -> torch.Tensor:
        def unpacked() -> torch.Tensor:
            records, valid = self.read_records(layer, kind, n)
            return _UNPACK[kind](records).masked_fill(~h2d(valid, self.device).unsqueeze(-1), 0.0).to(self.dtype)

        n_key = tuple(int(v) for v in torch.as_tensor(n).expand(self.batch).tolist())
        return self._memoized((layer, kind), (self.pool.global_layers[layer].version, n_key), unpacked)

    def compressed(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """[B, max n, C]; entries past a row's n are zeros (never selected)."""
        return self._read(layer, "main", n)

    def index_k(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        return self._read(layer, "index", n)

    # ---------------------------------------------------------------- compressor carry
    def compressor_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, sc = self.pool.pending[layer]
        return kv[self.slots], sc[self.slots]

    def set_compressor_state(self, layer: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """kv/score [B,m,C] fp32: slots m-r_b..m-1 hold the r_b tokens of each row's open group (`carry_after`)."""
        st_kv, st_sc = self.pool.pending[layer]
        st_kv[self.slots] = kv.detach().to(st_kv.dtype)
        st_sc[self.slots] = score.detach().to(st_sc.dtype)

    # ---------------------------------------------------------------- accounting / batching
    def global_bytes(self) -> int:
        """Packed bytes of the global-store entries these sequences hold (main + index records)."""
        return sum(self.pool.seq_bytes(sid)["global_entries_bytes"] for sid in self.seq_ids)

    @staticmethod
    def stack(views: list["BatchView"]) -> "BatchView":
        """One batch from views of one pool (rows keep their own positions): continuous batching."""
        pool = views[0].pool
        if any(v.pool is not pool for v in views):
            raise ValueError("stack: views of different pools")
        return pool.bind([sid for v in views for sid in v.seq_ids])
