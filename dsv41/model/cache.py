"""What each layer stores (declared by the model) and the dense reference store (SYSTEM.md 3).

The model never allocates caches: `cache_spec(cfg)` lists per layer what it needs, and a store object with the
methods of `DenseCache` is bound from outside. `DenseCache` holds the quantize-dequantized values in the
compute dtype, which is what the official code simulates; the engine's packed store (`dsv41.kv`) has the same
methods and keeps the packed bytes instead. Values read back are identical (every QDQ value is exact in bf16).

Legend: B batch, W window rows, C latent width (head_dim), I index-key width, m compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    specs = []
    for r in layer_roles(cfg):
        own = r.is_kv_source
        specs.append(LayerCacheSpec(
            r.layer, cfg.window_size, cfg.head_dim, ratio=r.ratio if own else 0,
            index_width=cfg.index_head_dim if own else 0, pending_rows=r.ratio if own and r.ratio > 1 else 0))
    for L in range(cfg.n_layers, cfg.total_layers):
        specs.append(LayerCacheSpec(L, cfg.window_size, cfg.head_dim))
    return specs


class DenseCache:
    """Reference store for one batch of sequences that advance together (the official `start_pos`).

    Window rings hold position p in slot p % W. Global stores grow by doubling (no max_seq_len-sized
    preallocation). `index_k_publisher` emulates the official runtime's stale index-key pointer (MODEL.md 4)."""

    def __init__(self, cfg: ModelConfig, batch: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg, self.batch, self.dtype, self.device = cfg, batch, dtype, torch.device(device)
        self.specs = {s.layer: s for s in cache_spec(cfg)}
        self.pos = 0
        self.window = {L: torch.zeros(batch, s.window_rows, s.width, dtype=dtype, device=self.device)
                       for L, s in self.specs.items()}
        self.ckv: dict[int, torch.Tensor] = {}
        self.kidx: dict[int, torch.Tensor] = {}
        self.rows: dict[int, int] = {}
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for L, s in self.specs.items():
            if s.ratio:
                self.ckv[L] = torch.zeros(batch, 16, s.width, dtype=dtype, device=self.device)
                self.kidx[L] = torch.zeros(batch, 16, s.index_width, dtype=dtype, device=self.device)
                self.rows[L] = 0
            if s.pending_rows:
                self.pending[L] = (
                    torch.zeros(batch, s.pending_rows, s.width, dtype=torch.float32, device=self.device),
                    torch.full((batch, s.pending_rows, s.width), -torch.inf, dtype=torch.float32,
                               device=self.device))
        self.engram_history: torch.Tensor | None = None
        self.index_k_publisher: int | None = None

    # ---------------------------------------------------------------- sliding window
    def window_ring(self, layer: int) -> torch.Tensor:
        return self.window[layer]

    def write_window(self, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        """kv [B,T,C] for positions start_pos..start_pos+T-1; only the last W survive."""
        ring = self.window[layer]
        W = ring.size(1)
        T = kv.size(1)
        first = max(0, T - W)
        slots = (torch.arange(start_pos + first, start_pos + T, device=self.device) % W)
        ring[:, slots] = kv[:, first:].to(ring.dtype)

    # ---------------------------------------------------------------- global KV
    def _ensure(self, layer: int, rows: int) -> None:
        cur = self.ckv[layer].size(1)
        if rows <= cur:
            return
        new = max(rows, 2 * cur)
        for store in (self.ckv, self.kidx):
            old = store[layer]
            grown = torch.zeros(old.size(0), new, old.size(2), dtype=old.dtype, device=old.device)
            grown[:, :cur] = old
            store[layer] = grown

    def append_compressed(self, layer: int, row0: int, kv: torch.Tensor) -> None:
        """Write main-KV entries (RoPE'd, FP4 QDQ'd) [B,n,C] at rows row0.."""
        n = kv.size(1)
        self._ensure(layer, row0 + n)
        self.ckv[layer][:, row0:row0 + n] = kv.to(self.dtype)
        self.rows[layer] = max(self.rows[layer], row0 + n)

    def append_index_k(self, layer: int, row0: int, k: torch.Tensor) -> None:
        n = k.size(1)
        self._ensure(layer, row0 + n)
        self.kidx[layer][:, row0:row0 + n] = k.to(self.dtype)

    def compressed(self, layer: int, n: int) -> torch.Tensor:
        return self.ckv[layer][:, :n]

    def index_k(self, layer: int, n: int) -> torch.Tensor:
        return self.kidx[layer][:, :n]

    # ---------------------------------------------------------------- compressor carry
    def compressor_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pending[layer]

    def set_compressor_state(self, layer: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """kv/score [B,r,C] fp32 of the r tokens of the current partial group (slots 0..r-1)."""
        st_kv, st_sc = self.pending[layer]
        r = kv.size(1)
        st_kv[:, :r] = kv
        st_sc[:, :r] = score

    # ---------------------------------------------------------------- accounting
    def global_bytes(self) -> int:
        """Bytes the reference store holds for global KV (in its simulated dtype, not packed)."""
        return sum(self.rows[L] * (self.ckv[L].size(2) + self.kidx[L].size(2)) * self.ckv[L].element_size()
                   * self.batch for L in self.ckv)
