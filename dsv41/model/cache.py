"""What each layer stores (declared by the model) and the dense reference store (docs/system.md §3).

The model never allocates caches: `cache_spec(cfg)` lists per layer what it needs, and a store with the
interface `KVStore` is bound from outside. `DenseCache` holds the quantize-dequantized values in the compute
dtype, which is what the official code simulates; the engine's packed store (`dsv41.kv`) keeps the packed bytes
instead and adds in-place reads (`PackedKVStore`). Values read back are identical (every QDQ value is exact in
bf16).

Legend: B batch, W window rows, C latent width (head_dim), I index-key width, m compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from dsv41.config import ModelConfig, layer_roles


@dataclass(frozen=True)
class LayerCacheSpec:
    layer: int                 # backbone layer id, or n_layers + k for DSpark stage k
    window_rows: int           # SWA ring rows (W)
    width: int                 # latent width C of window / compressed entries
    ratio: int = 0             # m of the global store (0: this layer owns no global store)
    index_width: int = 0       # I of the index keys (0: none)
    pending_rows: int = 0      # compressor carry slots (m for m > 1, else 0)


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """Every layer (backbone, then DSpark stages) has a window; KV sources add their global store."""
    specs = [LayerCacheSpec(L, cfg.window_size, cfg.head_dim) for L in range(cfg.total_layers)]
    for r in layer_roles(cfg):
        if r.is_kv_source:
            specs[r.layer] = replace(specs[r.layer], ratio=r.ratio, index_width=cfg.index_head_dim,
                                     pending_rows=r.ratio if r.ratio > 1 else 0)
    return specs


class KVStore(Protocol):
    """The per-layer KV store the model reads and writes during a forward (rows = the batch's sequences)."""

    pos: torch.Tensor                          # [B] tokens each row holds; the forward advances it
    engram_history: torch.Tensor | None        # the Engram hasher's last tokens per row
    index_k_publisher: int | None              # the layer whose index keys were written last (docs/model.md §4)
    packed: bool                               # True: a `PackedKVStore` (decode may read its bytes in place)

    def window_ring(self, layer: int) -> torch.Tensor: ...

    def write_window(self, layer: int, start: torch.Tensor, kv: torch.Tensor,
                     count: torch.Tensor | None = None) -> None: ...

    def append_compressed(self, layer: int, row0: torch.Tensor, kv: torch.Tensor, count: torch.Tensor) -> None: ...

    def append_index_k(self, layer: int, row0: torch.Tensor, k: torch.Tensor, count: torch.Tensor) -> None: ...

    def compressed(self, layer: int, n: torch.Tensor) -> torch.Tensor: ...

    def index_k(self, layer: int, n: torch.Tensor) -> torch.Tensor: ...

    def compressor_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_compressor_state(self, layer: int, kv: torch.Tensor, score: torch.Tensor) -> None: ...


class PackedKVStore(KVStore, Protocol):
    """A store that keeps the packed bytes (`dsv41.kv.batch_view.BatchView`): the decode attention reads them in place
    (`dsv41.model.packed_decode`)."""

    def packed_ring(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def packed_pages(self, layer: int | None, kind: str) -> tuple[torch.Tensor, torch.Tensor]: ...


def window_write_mask(count: torch.Tensor, first: int, T: int, W: int) -> torch.Tensor:
    """bool [B, T - first]: which of a write's rows first..T-1 land, when row b writes only its first count_b
    rows and a ring keeps the last W of them."""
    j = torch.arange(first, T).unsqueeze(0)
    c = torch.as_tensor(count, dtype=torch.long).cpu().view(-1, 1)
    return (j < c) & (j >= c - W)


class DenseCache:
    """Reference store for a batch of B sequences (rows may sit at different positions).

    Window rings hold position p in slot p % W. Global stores grow by doubling (no max_seq_len-sized
    preallocation). `index_k_publisher` emulates the official runtime's stale index-key pointer (docs/model.md §4)."""

    packed = False

    def __init__(self, cfg: ModelConfig, batch: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg, self.batch, self.dtype, self.device = cfg, batch, dtype, torch.device(device)
        self.specs = {s.layer: s for s in cache_spec(cfg)}
        self.pos = torch.zeros(batch, dtype=torch.long)
        self.window = {L: torch.zeros(batch, s.window_rows, s.width, dtype=dtype, device=self.device)
                       for L, s in self.specs.items()}
        # per layer with a global store: compressed KV, index keys [B, capacity, *], rows held [B]; carry (kv, score)
        self.ckv, self.kidx, self.rows, self.pending = {}, {}, {}, {}
        for L, s in self.specs.items():
            if s.ratio:
                self.ckv[L] = torch.zeros(batch, 16, s.width, dtype=dtype, device=self.device)
                self.kidx[L] = torch.zeros(batch, 16, s.index_width, dtype=dtype, device=self.device)
                self.rows[L] = torch.zeros(batch, dtype=torch.long)
            if s.pending_rows:                                          # kv 0, score -inf
                self.pending[L] = tuple(torch.full((batch, s.pending_rows, s.width), v, dtype=torch.float32,
                                                   device=self.device) for v in (0.0, -torch.inf))
        self.engram_history: torch.Tensor | None = None
        self.index_k_publisher: int | None = None

    # ---------------------------------------------------------------- sliding window
    def window_ring(self, layer: int) -> torch.Tensor:
        return self.window[layer]

    def write_window(self, layer: int, start: torch.Tensor, kv: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """kv [B,T,C] for positions start_b..start_b+T-1 (only the first count_b of row b when given); only the
        last W of each row survive."""
        ring = self.window[layer]
        W, T = ring.size(1), kv.size(1)
        first = max(0, T - W)
        pos = start.view(-1, 1).to(self.device) + torch.arange(first, T, device=self.device)
        rows = torch.arange(kv.size(0), device=self.device).unsqueeze(1)
        if count is None:
            ring[rows, pos % W] = kv[:, first:].to(ring.dtype)
            return
        keep = window_write_mask(count, first, T, W).to(self.device)
        ring[rows.expand_as(pos)[keep], (pos % W)[keep]] = kv[:, first:][keep].to(ring.dtype)

    # ---------------------------------------------------------------- speculative rollback (dsv41.engine.speculative)
    def ring_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ring slots [B,K] of every row (the store's own representation)."""
        return self.window[layer][torch.arange(self.batch, device=self.device).unsqueeze(1), slots.to(self.device)].clone()

    def set_ring_rows(self, layer: int, slots: torch.Tensor, saved: torch.Tensor, mask: torch.Tensor) -> None:
        """Put back `saved` (from `ring_rows`) into the slots where mask [B,K] is set."""
        rows = torch.arange(self.batch, device=self.device).unsqueeze(1).expand_as(slots)
        m = mask.to(self.device)
        self.window[layer][rows[m], slots.to(self.device)[m]] = saved[m]

    def truncate_global(self, n_tokens: torch.Tensor) -> None:
        """Forget global entries of groups not completed within each row's first n_tokens_b positions."""
        n = torch.as_tensor(n_tokens, dtype=torch.long).cpu().expand(self.batch)
        for L in self.ckv:
            self.rows[L] = torch.minimum(self.rows[L], n // self.specs[L].ratio)

    # ---------------------------------------------------------------- global KV
    def _ensure(self, layer: int, rows: int) -> None:
        cur = self.ckv[layer].size(1)
        if rows <= cur:
            return
        new = max(rows, 2 * cur)
        for store in (self.ckv, self.kidx):
            store[layer] = torch.nn.functional.pad(store[layer], (0, 0, 0, new - cur))      # zero rows appended

    def _append(self, store: dict, layer: int, row0: torch.Tensor, x: torch.Tensor, count: torch.Tensor) -> None:
        row0, count = row0.cpu(), count.cpu()
        self._ensure(layer, int((row0 + count).max()))
        for b in range(x.size(0)):
            r, n = int(row0[b]), int(count[b])
            store[layer][b, r:r + n] = x[b, :n].to(self.dtype)                  # n = 0 writes nothing

    def append_compressed(self, layer: int, row0: torch.Tensor, kv: torch.Tensor, count: torch.Tensor) -> None:
        """Main-KV entries (RoPE'd, FP4 QDQ'd) kv [B,n,C]: row b writes its first count_b at rows row0_b.."""
        self._append(self.ckv, layer, row0, kv, count)
        self.rows[layer] = torch.maximum(self.rows[layer], row0.cpu() + count.cpu())

    def append_index_k(self, layer: int, row0: torch.Tensor, k: torch.Tensor, count: torch.Tensor) -> None:
        self._append(self.kidx, layer, row0, k, count)

    def compressed(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """[B, max n, C]; entries past a row's n are padding (never selected)."""
        return self.ckv[layer][:, :int(n.max())]

    def index_k(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        return self.kidx[layer][:, :int(n.max())]

    # ---------------------------------------------------------------- compressor carry
    def compressor_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pending[layer]

    def set_compressor_state(self, layer: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """kv/score [B,m,C] fp32: slots m-r_b..m-1 hold the r_b tokens of each row's open group (`carry_after`)."""
        for state, new in zip(self.pending[layer], (kv, score)):
            state.copy_(new)

    # ---------------------------------------------------------------- accounting
    def global_bytes(self) -> int:
        """Bytes the reference store holds for global KV (in its simulated dtype, not packed)."""
        return sum(int(self.rows[L].sum()) * (self.ckv[L].size(2) + self.kidx[L].size(2)) * self.ckv[L].element_size()
                   for L in self.ckv)

    # ---------------------------------------------------------------- batching
    @classmethod
    def stack(cls, caches: list["DenseCache"]) -> "DenseCache":
        """One batch from single-sequence stores (rows keep their own positions): continuous batching."""
        c0 = caches[0]
        out = cls(c0.cfg, sum(c.batch for c in caches), c0.dtype, c0.device)
        out.pos = torch.cat([c.pos for c in caches])
        out.window = {L: torch.cat([c.window[L] for c in caches]) for L in c0.window}
        for L in c0.ckv:
            n = max(c.ckv[L].size(1) for c in caches)
            out.ckv[L] = torch.cat([torch.nn.functional.pad(c.ckv[L], (0, 0, 0, n - c.ckv[L].size(1))) for c in caches])
            out.kidx[L] = torch.cat([torch.nn.functional.pad(c.kidx[L], (0, 0, 0, n - c.kidx[L].size(1))) for c in caches])
            out.rows[L] = torch.cat([c.rows[L] for c in caches])
        out.pending = {L: tuple(torch.cat([c.pending[L][i] for c in caches]) for i in range(2)) for L in c0.pending}
        if c0.engram_history is not None:
            out.engram_history = torch.cat([c.engram_history for c in caches])
        return out

    def select(self, b: int) -> "DenseCache":
        """Row b as a one-sequence store (views of this store's tensors)."""
        out = DenseCache.__new__(DenseCache)
        out.cfg, out.batch, out.dtype, out.device, out.specs = self.cfg, 1, self.dtype, self.device, self.specs
        out.pos = self.pos[b:b + 1].clone()
        out.window = {L: t[b:b + 1] for L, t in self.window.items()}
        out.ckv = {L: t[b:b + 1, :max(16, int(self.rows[L][b]))] for L, t in self.ckv.items()}
        out.kidx = {L: t[b:b + 1, :max(16, int(self.rows[L][b]))] for L, t in self.kidx.items()}
        out.rows = {L: t[b:b + 1].clone() for L, t in self.rows.items()}
        out.pending = {L: (k[b:b + 1], s[b:b + 1]) for L, (k, s) in self.pending.items()}
        out.engram_history = None if self.engram_history is None else self.engram_history[b:b + 1]
        out.index_k_publisher = self.index_k_publisher
        return out
