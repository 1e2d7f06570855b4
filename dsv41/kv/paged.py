"""The engine's packed KV store (SYSTEM.md 3): real packed bytes, paged per sequence, bound into the model.

`PackedKVPool` owns the storage of many sequences; `pool.bind(seq_ids)` returns a `BatchView` with exactly the
methods of `dsv41.model.cache.DenseCache` (the interface the model calls), rows in the order given. The model
never sees the bytes: every read unpacks, every write packs.

What is stored, per the layer specs of `cache_spec(cfg)` (legend: W window rows, C latent width, I index-key
width, m compression ratio, P page size in entries):

  global store   per KV-source layer (spec.ratio > 0): pages of P entries, `main [n_pages, P, C/2 + C/16]` and
                 `index [n_pages, P, I/2 + I/32]` uint8 (288 B + 68 B for the released geometry), one free list
                 per layer, the page count doubling when it runs out. A sequence owns a page table per layer and
                 holds pages only for entries it has written: one entry per *completed* group of m positions
                 (no max_seq_len-sized preallocation). The main and index records of entry e share page e // P.
  SWA ring       per layer (backbone and DSpark stages) per sequence: `[W, C + C/32]` uint8 (528 B rows), the
                 token at position p in slot p % W. Rings of all sequences live in one slab per layer indexed by
                 the sequence's slot (`[n_slots, W, bytes]`, doubling), so a batch reads them with one gather.
  pending        per layer with pending_rows > 0, per sequence: the Compressor's carry, fp32 `[m, C]` kv and
                 score (score starts at -inf). Uncompressed and not part of the global bytes.
  per sequence   position `pos`, the Engram history (opaque LongTensor) and the index-key publisher.

Export / import (prefix caching, SYSTEM.md 4; `dsv41.kv.manager` persists them). `export_global(sid, upto)`
returns a `GlobalState` (the packed records of positions < upto per KV-source layer, the compressor carry at upto,
the Engram history, the index-key publisher) and `import_global` loads one into a fresh sequence; `export_swa` /
`import_swa` do the same for every SWA ring (`SwaState`). Both states serialise to a documented little-endian
layout (`to_bytes` / `from_bytes`, at the end of this module; no pickle). A sequence restored from both continues
bit-identically to the one exported.

Exactness. The model writes values that are already quantize-dequantized in the three formats (`qdq_fp8`,
`qdq_main_kv`, `qdq_index_k`), so the stored bytes decode to exactly the values `DenseCache` would hold.
The SWA and index-key formats use power-of-two scales and `pack(qdq(x))` reproduces `qdq(x)`. The main-KV format
uses an E4M3 scale, and `pack_main_kv` re-derives the scale from the group maximum; for groups whose scale is an
E4M3 *subnormal* (group amax below about 0.09) that re-derivation can pick another scale and the round trip is
lossy (`qdq_main_kv` is not idempotent there). Writes of main KV therefore go through `pack_main_kv_exact`: the
same record layout, with the scale chosen among the few candidates (amax / c for every E2M1 magnitude c) so the
record decodes to the input exactly whenever the input is representable, which every QDQ output is.

Quantization off. With `set_quantization(model, False)` the written values are not representable in the packed
formats and this store rounds them (a lossy cache); the engine uses `DenseCache` for unquantized models. Pass
`strict=True` to have every write verify its round trip (one host sync per write) and raise ValueError.

Speculative decoding. SYSTEM.md 3 sizes the ring W + (max_verify - 1) rows so a rejected draft never overwrites
a row still in the window. Here the ring keeps W rows (the model's window lists, the kernels and the SwaState
layout address slot p % W) and a verify step instead saves the <= max_verify ring rows it will overwrite
(`ring_rows`) and puts back those of rejected positions (`set_ring_rows`); `truncate_global` forgets entries of
rejected groups (`dsv41.engine.speculative.VerifyJournal`). Same guarantee: rejected tokens leave no trace.

Reads of the global store gather a sequence's pages and unpack the whole visible history (the dense interface
returns [B, N, C]); the unpacked tensor is memoised per view until the next write to that layer, since every
Reuse layer reads its source's entries again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from dsv41.codecs import (
    E2M1_MAX,
    MAIN_KV_AMAX_FLOOR,
    MAIN_KV_GROUP,
    float_to_e2m1,
    float_to_e4m3,
    index_k_bytes,
    main_kv_bytes,
    pack_index_k,
    pack_nibbles,
    pack_swa_kv,
    round_to_e2m1,
    round_to_e4m3,
    swa_kv_bytes,
    unpack_index_k,
    unpack_main_kv,
    unpack_swa_kv,
)
from dsv41.config import ModelConfig
from dsv41.devices import h2d
from dsv41.kernels import pack_swa_kv as pack_swa_rows
from dsv41.model.cache import LayerCacheSpec, cache_spec, window_write_mask

__all__ = ["PackedKVPool", "BatchView", "pack_main_kv_exact", "KINDS", "GlobalState", "GlobalLayerState", "SwaState",
           "GLOBAL_LAYOUT_VERSION", "SWA_LAYOUT_VERSION"]

KINDS = ("main", "index")                   # the two record kinds of a global-store entry

_E2M1_MAGNITUDES = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


# ------------------------------------------------------------------------------------------ exact main-KV records

def _represents(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., G, 1] bool: every value of the group is E2M1(code) * scale exactly (|code| <= 6)."""
    return (round_to_e2m1((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale == g).all(dim=-1, keepdim=True)


def pack_main_kv_exact(x: torch.Tensor) -> torch.Tensor:
    """x[..., d] -> uint8[..., d/2 + d/16], the `pack_main_kv` record layout, decoding to x exactly when x is
    representable (every `qdq_main_kv` output is).

    The scale is `pack_main_kv`'s (e4m3(max(amax, floor) / 6)) when that reproduces the group; otherwise the first
    of amax / c, c in the E2M1 magnitudes 6, 4, ..., 0.5, that is an E4M3 value and reproduces it (for a
    representable group amax = c_max * scale, so one candidate is the group's true scale). Groups matching no
    candidate (unrepresentable input) keep the codec's scale and round like `pack_main_kv`. No host sync on
    accelerators (every candidate is evaluated); on CPU the candidates are skipped when the codec's scale fits."""
    d = x.shape[-1]
    if d % MAIN_KV_GROUP:
        raise ValueError(f"main-KV width must be a multiple of {MAIN_KV_GROUP}, got {d}")
    g = x.float().unflatten(-1, (d // MAIN_KV_GROUP, MAIN_KV_GROUP))
    amax = g.abs().amax(dim=-1, keepdim=True)
    floored = amax.clamp_min(MAIN_KV_AMAX_FLOOR)
    scale = round_to_e4m3(floored / torch.full_like(floored, E2M1_MAX))
    ok = _represents(g, scale)
    if not (g.device.type == "cpu" and bool(ok.all())):
        for c in _E2M1_MAGNITUDES:
            s = amax / torch.full_like(amax, c)               # tensor divisor: a true division on every device
            good = (s > 0) & (round_to_e4m3(s) == s) & _represents(g, s)
            scale = torch.where(ok | ~good, scale, s)
            ok = ok | good
    codes = float_to_e2m1((g / scale).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    return torch.cat([pack_nibbles(codes), float_to_e4m3(scale.squeeze(-1))], dim=-1)


def _pack(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "main":
        return pack_main_kv_exact(x)
    if kind == "index":
        return pack_index_k(x, check_finite=False)
    return pack_swa_kv(x, check_finite=False)


def _unpack(kind: str, b: torch.Tensor) -> torch.Tensor:
    if kind == "main":
        return unpack_main_kv(b)
    if kind == "index":
        return unpack_index_k(b)
    return unpack_swa_kv(b)


# ------------------------------------------------------------------------------------------ storage pieces

class _PagedLayer:
    """One KV-source layer's global store: uint8 pages for main and index records and a free list."""

    def __init__(self, spec: LayerCacheSpec, page_size: int, n_pages: int, device: torch.device):
        self.spec, self.page_size, self.device = spec, page_size, device
        self.record_bytes = {"main": main_kv_bytes(spec.width), "index": index_k_bytes(spec.index_width)}
        self.data = {k: torch.zeros(n_pages, page_size, b, dtype=torch.uint8, device=device)
                     for k, b in self.record_bytes.items()}
        self.free: list[int] = list(range(n_pages - 1, -1, -1))       # pop() hands out the lowest id first
        self.version = 0                                               # bumped on every write (view memos)
        self.page_epoch = 0                                            # bumped whenever pages are released

    @property
    def n_pages(self) -> int:
        return self.data["main"].size(0)

    @property
    def page_bytes(self) -> int:
        return self.page_size * sum(self.record_bytes.values())

    def alloc(self, k: int) -> list[int]:
        while len(self.free) < k:
            self._grow()
        return [self.free.pop() for _ in range(k)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))
        self.page_epoch += 1

    def _grow(self) -> None:
        """Double the page count (copying the held pages); the new pages join the free list uninitialised (reads
        mask every entry a sequence has not written)."""
        old = self.n_pages
        new = max(1, 2 * old)
        for k, t in self.data.items():
            grown = torch.empty(new, self.page_size, t.size(2), dtype=torch.uint8, device=self.device)
            grown[:old] = t
            self.data[k] = grown
        self.free = list(range(new - 1, old - 1, -1)) + self.free


@dataclass
class _Sequence:
    slot: int
    pos: int = 0
    pages: dict[int, list[int]] = field(default_factory=dict)       # per global layer: page ids in entry order
    rows: dict[tuple[int, str], int] = field(default_factory=dict)  # (layer, kind) -> entries written
    engram_history: torch.Tensor | None = None
    index_k_publisher: int | None = None


# ------------------------------------------------------------------------------------------ the pool

class PackedKVPool:
    """Packed KV storage for many sequences of one model config.

    cfg            the model config (what each layer stores comes from `cache_spec(cfg)`)
    device         where the bytes live
    page_size      global-store entries per page (P)
    dtype          dtype of the values handed to the model (the model casts to its compute dtype; every stored
                   value is exact in bf16 and fp32)
    initial_pages  pages per KV-source layer to start with (doubling afterwards)
    initial_slots  sequence slots (rings, pending state) to start with (doubling afterwards)
    strict         verify every packed write decodes to the written values (one host sync); ValueError if not
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", page_size: int = 64,
                 dtype: torch.dtype = torch.float32, initial_pages: int = 4, initial_slots: int = 2,
                 strict: bool = False):
        if page_size <= 0 or initial_pages <= 0 or initial_slots <= 0:
            raise ValueError("page_size, initial_pages and initial_slots must be positive")
        self.cfg, self.device, self.page_size = cfg, torch.device(device), page_size
        self.dtype, self.strict = dtype, strict
        self.specs: dict[int, LayerCacheSpec] = {s.layer: s for s in cache_spec(cfg)}
        self.global_layers = {L: _PagedLayer(s, page_size, initial_pages, self.device)
                              for L, s in self.specs.items() if s.ratio > 0}
        self.swa = {L: torch.zeros(initial_slots, s.window_rows, swa_kv_bytes(s.width), dtype=torch.uint8,
                                   device=self.device) for L, s in self.specs.items()}
        f32 = torch.float32
        self.pending = {L: (torch.zeros(initial_slots, s.pending_rows, s.width, dtype=f32, device=self.device),
                            torch.full((initial_slots, s.pending_rows, s.width), -torch.inf, dtype=f32,
                                       device=self.device))
                        for L, s in self.specs.items() if s.pending_rows > 0}
        self.free_slots: list[int] = list(range(initial_slots - 1, -1, -1))
        self.seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.history_width = cfg.engram_max_ngram_size - 1 if cfg.engram_enabled else 0

    # ---------------------------------------------------------------- sequences
    @property
    def n_slots(self) -> int:
        return next(iter(self.swa.values())).size(0) if self.swa else 0

    def _grow_slots(self) -> None:
        old = self.n_slots
        new = 2 * old
        for L, t in self.swa.items():
            grown = torch.zeros(new, *t.shape[1:], dtype=t.dtype, device=self.device)
            grown[:old] = t
            self.swa[L] = grown
        for L, (kv, sc) in self.pending.items():
            gkv = torch.zeros(new, *kv.shape[1:], dtype=kv.dtype, device=self.device)
            gsc = torch.full((new, *sc.shape[1:]), -torch.inf, dtype=sc.dtype, device=self.device)
            gkv[:old], gsc[:old] = kv, sc
            self.pending[L] = (gkv, gsc)
        self.free_slots = list(range(new - 1, old - 1, -1)) + self.free_slots

    def _take_slot(self) -> int:
        if not self.free_slots:
            self._grow_slots()
        slot = self.free_slots.pop()
        for t in self.swa.values():
            t[slot].zero_()
        for kv, sc in self.pending.values():
            kv[slot].zero_()
            sc[slot].fill_(-torch.inf)
        return slot

    def new_sequence(self) -> int:
        """A new empty sequence (position 0, no pages); returns its id."""
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = _Sequence(self._take_slot(),
                                   pages={L: [] for L in self.global_layers},
                                   rows={(L, k): 0 for L in self.global_layers for k in KINDS})
        return sid

    def _seq(self, sid: int) -> _Sequence:
        try:
            return self.seqs[sid]
        except KeyError:
            raise ValueError(f"no such sequence: {sid!r}") from None

    def free(self, sid: int) -> None:
        """Forget a sequence; its pages and slot return to the free lists."""
        s = self._seq(sid)
        for L, pages in s.pages.items():
            self.global_layers[L].release(pages)
            self.global_layers[L].version += 1
        self.free_slots.append(s.slot)
        del self.seqs[sid]

    def fork(self, sid: int) -> int:
        """A copy of a sequence (pages copied, not shared); returns the new id."""
        src = self._seq(sid)
        nid = self.new_sequence()
        dst = self.seqs[nid]
        for L, pl in self.global_layers.items():
            n = len(src.pages[L])
            if n:
                dst.pages[L] = pl.alloc(n)
                a = torch.tensor(src.pages[L], device=self.device)
                b = torch.tensor(dst.pages[L], device=self.device)
                for t in pl.data.values():
                    t[b] = t[a]
        for t in self.swa.values():
            t[dst.slot] = t[src.slot]
        for kv, sc in self.pending.values():
            kv[dst.slot], sc[dst.slot] = kv[src.slot], sc[src.slot]
        dst.pos, dst.rows = src.pos, dict(src.rows)
        dst.engram_history = None if src.engram_history is None else src.engram_history.clone()
        dst.index_k_publisher = src.index_k_publisher
        return nid

    def bind(self, seq_ids) -> "BatchView":
        """The DenseCache interface over these sequences, rows in this order."""
        return BatchView(self, list(seq_ids))

    def _ensure_pages(self, s: _Sequence, layer: int, entries: int) -> list[int]:
        pl = self.global_layers[layer]
        need = -(-entries // self.page_size) - len(s.pages[layer])
        if need > 0:
            s.pages[layer].extend(pl.alloc(need))
        return s.pages[layer]

    # ---------------------------------------------------------------- export / import (prefix caching, SYSTEM.md 4)
    def _gather_entries(self, s: _Sequence, layer: int, kind: str, e0: int, e1: int) -> torch.Tensor:
        """uint8 [e1 - e0, bytes] on the CPU: the sequence's records e0..e1-1 of one layer and kind."""
        pl = self.global_layers[layer]
        if e1 <= e0:
            return torch.zeros(0, pl.record_bytes[kind], dtype=torch.uint8)
        P = self.page_size
        pages = torch.tensor(s.pages[layer], dtype=torch.long)
        e = torch.arange(e0, e1)
        flat = (pages[e // P] * P + e % P).to(self.device)
        data = pl.data[kind]
        return data.view(-1, data.size(2))[flat].cpu()

    def export_global(self, sid: int, upto: int, start: int = 0,
                      engram_history: torch.Tensor | None = None) -> "GlobalState":
        """The persistent part of sequence `sid` for its first `upto` positions (SYSTEM.md 4): per KV-source layer
        the packed records of entries start//m .. upto//m - 1, the compressor carry of the open group at `upto`
        (ratio > 1 layers with upto % m != 0: the m-slot fp32 kv and score slab, see `GlobalLayerState`), the
        Engram history at `upto` and the index-key publisher.

        upto == pos    any upto; the carry and the Engram history are the sequence's current ones.
        upto <  pos    upto must be a multiple of every ratio (the carry is empty; the global store is append-only,
                       so its first upto // m entries are those the sequence held when it stood at upto). The
                       Engram history at upto is not in the pool: pass `engram_history` (see
                       `dsv41.kv.prefix.engram_history_at`) or the state carries none.
        start          0, or a multiple of every ratio: export only entries from that position on (a segment, for
                       a store that already holds the rest; `GlobalState.join` puts segments back together).
        ValueError for anything else (upto > pos, misaligned positions, a sequence lacking entries)."""
        s = self._seq(sid)
        upto, start = int(upto), int(start)
        if not 0 <= start <= upto <= s.pos:
            raise ValueError(f"export_global: need 0 <= start ({start}) <= upto ({upto}) <= pos ({s.pos}) "
                             f"of sequence {sid}")
        ratios = sorted({pl.spec.ratio for pl in self.global_layers.values()})
        if any(start % m for m in ratios):
            raise ValueError(f"export_global: start {start} is not a multiple of every compression ratio {ratios}")
        if upto < s.pos and any(upto % m for m in ratios):
            raise ValueError(f"export_global: upto {upto} < pos {s.pos} must be a multiple of every compression "
                             f"ratio {ratios} (the compressor carry exists only at the current position)")
        layers = []
        for L, pl in self.global_layers.items():
            m, C = pl.spec.ratio, pl.spec.width
            e0, e1 = start // m, upto // m
            for k in KINDS:
                if s.rows[(L, k)] < e1:
                    raise ValueError(f"export_global: sequence {sid} layer {L} holds {s.rows[(L, k)]} {k} "
                                     f"entries, fewer than the {e1} of {upto} positions")
            if m > 1 and upto % m:
                kv, sc = self.pending[L]                      # all m slots, exactly as held (see GlobalLayerState)
                ckv, csc = kv[s.slot].cpu().clone(), sc[s.slot].cpu().clone()
            else:
                ckv = csc = torch.zeros(0, C, dtype=torch.float32)
            layers.append(GlobalLayerState(L, m, self._gather_entries(s, L, "main", e0, e1),
                                           self._gather_entries(s, L, "index", e0, e1), ckv, csc))
        history = None
        if self.history_width:
            if engram_history is not None:
                history = torch.as_tensor(engram_history, dtype=torch.long).cpu().reshape(-1).clone()
                if history.numel() != self.history_width:
                    raise ValueError(f"export_global: engram_history must hold {self.history_width} ids, got "
                                     f"{history.numel()}")
            elif upto == s.pos and s.engram_history is not None:
                history = s.engram_history.detach().cpu().reshape(-1).clone()
        return GlobalState(start, upto, layers, history, s.index_k_publisher)

    def check_global_state(self, state: "GlobalState") -> None:
        """ValueError unless `state` fits this pool's config (layers, ratios, record sizes, widths, carry rows)."""
        if state.layout_version != GLOBAL_LAYOUT_VERSION:
            raise ValueError(f"global state layout version {state.layout_version}, this pool reads "
                             f"{GLOBAL_LAYOUT_VERSION}")
        want = sorted(self.global_layers)
        got = sorted(ls.layer for ls in state.layers)
        if got != want:
            raise ValueError(f"global state holds layers {got}, this pool's KV-source layers are {want}")
        for ls in state.layers:
            pl = self.global_layers[ls.layer]
            m = pl.spec.ratio
            n = state.upto // m - state.start // m
            r = m if m > 1 and state.upto % m else 0
            shapes = {"main": (n, pl.record_bytes["main"]), "index": (n, pl.record_bytes["index"]),
                      "carry_kv": (r, pl.spec.width), "carry_score": (r, pl.spec.width)}
            if ls.ratio != m:
                raise ValueError(f"global state layer {ls.layer}: ratio {ls.ratio}, the pool's is {m}")
            for name, shape in shapes.items():
                t = getattr(ls, name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"global state layer {ls.layer} {name}: shape {tuple(t.shape)}, expected "
                                     f"{shape} for positions {state.start}..{state.upto}")
        if state.engram_history is not None and state.engram_history.numel() != self.history_width:
            raise ValueError(f"global state Engram history holds {state.engram_history.numel()} ids, this pool's "
                             f"config {self.history_width}")

    def import_global(self, sid: int, state: "GlobalState", engram_history: torch.Tensor | None = None) -> None:
        """Load an exported global state (start 0) into a fresh sequence: pages allocated and filled, carry
        restored, pos = state.upto, Engram history and index-key publisher set. The SWA rings stay empty (restore
        them with `import_swa`, or regenerate them by replay). `engram_history` overrides the state's; a config
        with Engram needs one of the two when upto > 0 (ValueError otherwise, rather than a silently wrong
        resume)."""
        s = self._seq(sid)
        if s.pos != 0 or any(s.rows.values()):
            raise ValueError(f"import_global: sequence {sid} is not fresh (pos {s.pos})")
        if state.start != 0:
            raise ValueError(f"import_global: the state starts at position {state.start}: join it onto the "
                             "segments before it (GlobalState.join) first")
        self.check_global_state(state)
        history = state.engram_history if engram_history is None else \
            torch.as_tensor(engram_history, dtype=torch.long).cpu().reshape(-1)
        if self.history_width:
            if history is None and state.upto > 0:
                raise ValueError("import_global: this config has Engram and the state carries no Engram history: "
                                 "pass engram_history (dsv41.kv.prefix.engram_history_at)")
            if history is not None and history.numel() != self.history_width:
                raise ValueError(f"import_global: engram_history must hold {self.history_width} ids")
        P = self.page_size
        for ls in state.layers:
            L, pl = ls.layer, self.global_layers[ls.layer]
            n = ls.main.size(0)
            if n:
                pages = torch.tensor(self._ensure_pages(s, L, n), dtype=torch.long)
                e = torch.arange(n)
                flat = (pages[e // P] * P + e % P).to(self.device)
                for kind, rec in (("main", ls.main), ("index", ls.index)):
                    data = pl.data[kind]
                    data.view(-1, data.size(2))[flat] = rec.to(self.device)
            for kind in KINDS:
                s.rows[(L, kind)] = n
            pl.version += 1
            if L in self.pending:
                kv, sc = self.pending[L]
                kv[s.slot].zero_()
                sc[s.slot].fill_(-torch.inf)
                r = ls.carry_kv.size(0)
                if r:
                    kv[s.slot, :r] = ls.carry_kv.to(self.device)
                    sc[s.slot, :r] = ls.carry_score.to(self.device)
        s.pos = state.upto
        s.engram_history = None if history is None or not self.history_width else \
            history.to(torch.long).clone().to(self.device)
        s.index_k_publisher = state.index_k_publisher

    def export_swa(self, sid: int, extras: dict[str, torch.Tensor] | None = None) -> "SwaState":
        """Every layer's SWA ring bytes (backbone and DSpark stages) of sequence `sid` at its current position.
        `extras`: named fp32 / int64 tensors the engine wants back with the snapshot (e.g. the last position's
        logits, so that a hit covering the whole prompt needs no recomputation)."""
        s = self._seq(sid)
        rings = {L: t[s.slot].cpu().clone() for L, t in self.swa.items()}
        return SwaState(s.pos, rings, {k: v.detach().cpu().clone() for k, v in (extras or {}).items()})

    def import_swa(self, sid: int, state: "SwaState") -> None:
        """Restore the SWA rings of sequence `sid`, which must stand at the snapshot's position (import the global
        state first). ValueError on a position or layout mismatch."""
        s = self._seq(sid)
        if state.layout_version != SWA_LAYOUT_VERSION:
            raise ValueError(f"SWA state layout version {state.layout_version}, this pool reads {SWA_LAYOUT_VERSION}")
        if state.pos != s.pos:
            raise ValueError(f"import_swa: the snapshot is at position {state.pos}, sequence {sid} at {s.pos}")
        if sorted(state.rings) != sorted(self.swa):
            raise ValueError(f"SWA state holds layers {sorted(state.rings)}, the pool {sorted(self.swa)}")
        for L, ring in state.rings.items():
            if tuple(ring.shape) != tuple(self.swa[L].shape[1:]) or ring.dtype != torch.uint8:
                raise ValueError(f"SWA state layer {L}: {ring.dtype} {tuple(ring.shape)}, the pool's rings are "
                                 f"uint8 {tuple(self.swa[L].shape[1:])}")
        for L, ring in state.rings.items():
            self.swa[L][s.slot] = ring.to(self.device)

    # ---------------------------------------------------------------- accounting
    def seq_bytes(self, sid: int) -> dict[str, int]:
        """Bytes one sequence holds, by kind.

        global_entries_bytes    packed records actually holding entries (main + index), the figure of SYSTEM.md 1
        global_allocated_bytes  whole pages handed to the sequence (entries plus the slack of its last pages)
        swa_bytes               its SWA rings (W packed rows per layer, backbone and DSpark, allocated up front)
        pending_bytes           its compressor carry (fp32 kv + score, m x C per layer with m > 1)
        tokens                  its position
        (also global_main_bytes / global_index_bytes, global_entries, global_pages; global_bytes repeats
        global_entries_bytes under the key the engine's dense store uses)"""
        s = self._seq(sid)
        main = sum(s.rows[(L, "main")] * pl.record_bytes["main"] for L, pl in self.global_layers.items())
        index = sum(s.rows[(L, "index")] * pl.record_bytes["index"] for L, pl in self.global_layers.items())
        return {
            "packed": True,
            "global_bytes": main + index,                      # the same figure under DensePool's key
            "global_entries_bytes": main + index,
            "global_main_bytes": main,
            "global_index_bytes": index,
            "global_entries": sum(s.rows[(L, "main")] for L in self.global_layers),
            "global_allocated_bytes": sum(len(s.pages[L]) * pl.page_bytes for L, pl in self.global_layers.items()),
            "global_pages": sum(len(p) for p in s.pages.values()),
            "swa_bytes": sum(t[0].numel() for t in self.swa.values()),
            "pending_bytes": sum(kv[0].numel() * kv.element_size() + sc[0].numel() * sc.element_size()
                                 for kv, sc in self.pending.values()),
            "tokens": s.pos,
        }

    def global_bytes_per_token(self, sid: int) -> Fraction:
        """Packed global-store bytes per token of one sequence (exact; equals the analytic figure when its length
        is a multiple of every ratio)."""
        b = self.seq_bytes(sid)
        if b["tokens"] == 0:
            raise ValueError(f"sequence {sid} holds no tokens")
        return Fraction(b["global_entries_bytes"], b["tokens"])

    def pool_bytes(self) -> dict[str, int]:
        """Bytes of the pool's storage tensors (capacity) and of what is handed out."""
        pages_used = sum(pl.n_pages - len(pl.free) for pl in self.global_layers.values())
        return {
            "sequences": len(self.seqs),
            "global_capacity_bytes": sum(pl.n_pages * pl.page_bytes for pl in self.global_layers.values()),
            "global_allocated_bytes": sum((pl.n_pages - len(pl.free)) * pl.page_bytes
                                          for pl in self.global_layers.values()),
            "global_pages_allocated": pages_used,
            "global_entries_bytes": sum(self.seq_bytes(s)["global_entries_bytes"] for s in self.seqs),
            "swa_capacity_bytes": sum(t.numel() for t in self.swa.values()),
            "pending_capacity_bytes": sum(kv.numel() * kv.element_size() + sc.numel() * sc.element_size()
                                          for kv, sc in self.pending.values()),
        }


# ------------------------------------------------------------------------------------------ the bound batch

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
        from dsv41.model.engram import DEAD
        ref = next(h for h in hs if h is not None)
        return torch.stack([torch.full_like(ref, DEAD) if h is None else h for h in hs])

    @engram_history.setter
    def engram_history(self, value: torch.Tensor | None) -> None:
        for b, s in enumerate(self.seqs):
            s.engram_history = None if value is None else value[b].clone()

    @property
    def index_k_publisher(self) -> int | None:
        for s in self.seqs:
            if s.index_k_publisher is not None:
                return s.index_k_publisher
        return None

    @index_k_publisher.setter
    def index_k_publisher(self, layer: int | None) -> None:
        for s in self.seqs:
            s.index_k_publisher = layer

    # ---------------------------------------------------------------- checks
    def _verify(self, kind: str, records: torch.Tensor, x: torch.Tensor) -> None:
        if self.pool.strict and not torch.equal(_unpack(kind, records), x.float()):
            raise ValueError(f"packed {kind} store: written values are not representable in the packed format "
                             "(quantization off?); use DenseCache for unquantized models")

    # ---------------------------------------------------------------- sliding window
    def window_ring(self, layer: int) -> torch.Tensor:
        """[B, W, C] unpacked; slot p % W holds position p; never-written slots are 0."""
        return unpack_swa_kv(self.pool.swa[layer][self.slots]).to(self.dtype)

    def write_window(self, layer: int, start: torch.Tensor, kv: torch.Tensor, count: torch.Tensor | None = None) -> None:
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
        hit = self._memo.get("window-write")              # every layer of a step writes the same ring rows
        if hit is None or hit[0] != key:
            slot_pos = h2d((start.view(-1, 1) + torch.arange(first, T)) % W, self.device)
            keep = None if count is None else h2d(window_write_mask(count, first, T, W), self.device)
            hit = self._memo["window-write"] = (key, slot_pos, keep)
        slot_pos, keep = hit[1], hit[2]
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
        key = (layer, "table")
        tables = [s.pages[layer] for s in self.seqs]
        # the table changes only when a row gains or loses pages (every P entries), not on every record write:
        # between two releases a page list only grows at its tail
        shape = (pl.page_epoch, tuple((id(t), len(t)) for t in tables))
        hit = self._memo.get(key)
        if hit is None or hit[0] != shape:
            table = torch.zeros(self.batch, max(1, max(len(t) for t in tables)), dtype=torch.int32)
            for b, t in enumerate(tables):
                if t:
                    table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
            hit = (shape, None, h2d(table, self.device))
            self._memo[key] = hit
        return pl.data[kind], hit[2]

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
                need = -(-max(s.rows[(L, k)] for k in KINDS) // pool.page_size)
                if len(s.pages[L]) > need:
                    pl.release(s.pages[L][need:])
                    del s.pages[L][need:]
            pl.version += 1

    # ---------------------------------------------------------------- global KV
    def write_records(self, layer: int, kind: str, row0, records: torch.Tensor, count) -> None:
        """Already-packed records [B, n, bytes] of `kind` ('main' or 'index'): row b writes its first count_b at
        entries row0_b.. (pages allocated as needed)."""
        pool = self.pool
        pl = pool.global_layers[layer]
        P = pool.page_size
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
            pages = pool._ensure_pages(s, layer, r + c)
            p0 = r // P                                      # only the pages this write touches (O(c), not O(context))
            sub = torch.tensor(pages[p0:(r + c - 1) // P + 1], dtype=torch.long)
            e = torch.arange(r, r + c)
            flat = h2d(sub[e // P - p0] * P + e % P, self.device)
            data = pl.data[kind]
            data.view(-1, data.size(2))[flat] = records[b, :c]
            s.rows[(layer, kind)] = max(s.rows[(layer, kind)], r + c)
        pl.version += 1

    def append_compressed(self, layer: int, row0: torch.Tensor, kv: torch.Tensor, count: torch.Tensor) -> None:
        """Main-KV entries (RoPE'd, FP4 QDQ'd) kv [B,n,C]: row b writes its first count_b at rows row0_b.."""
        x = kv.detach()
        records = pack_main_kv_exact(x)
        self._verify("main", records, x)
        self.write_records(layer, "main", row0, records, count)

    def append_index_k(self, layer: int, row0: torch.Tensor, k: torch.Tensor, count: torch.Tensor) -> None:
        x = k.detach()
        records = pack_index_k(x, check_finite=False)
        self._verify("index", records, x)
        self.write_records(layer, "index", row0, records, count)

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
        table = torch.zeros(self.batch, n_pages - p0, dtype=torch.long)
        for b, s in enumerate(self.seqs):
            pg = s.pages[layer][p0:n_pages]
            if pg:
                table[b, :len(pg)] = torch.tensor(pg, dtype=torch.long)
        e = torch.arange(start, nmax)
        flat = table[:, e // P - p0] * P + e % P                                 # [B, nmax - start]
        valid = e < torch.tensor(have).view(-1, 1)
        flat = h2d(torch.where(valid, flat, 0), self.device)
        return data.view(-1, data.size(2))[flat], valid

    def _read(self, layer: int, kind: str, n) -> torch.Tensor:
        key = (layer, kind)
        n_key = tuple(int(v) for v in torch.as_tensor(n).expand(self.batch).tolist())
        version = self.pool.global_layers[layer].version
        hit = self._memo.get(key)
        if hit is not None and hit[0] == version and hit[1] == n_key:
            return hit[2]
        records, valid = self.read_records(layer, kind, n)
        vals = _unpack(kind, records).masked_fill(~h2d(valid, self.device).unsqueeze(-1), 0.0).to(self.dtype)
        self._memo[key] = (version, n_key, vals)
        return vals

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


# ------------------------------------------------------------------------------------------ exported states
#
# Binary layouts (little-endian throughout, no padding, no pickle). Readers reject a wrong magic, an unknown
# layout version, a length that does not add up or trailing bytes (ValueError).
#
# GlobalState, layout version 1:
#   offset size  field
#   0      4     magic b"DSGK"
#   4      2     layout version (u16) = 1
#   6      2     flags (u16): bit 0 Engram history present, bit 1 index-key publisher present
#   8      8     start (u64): first position covered (0 for a whole prefix, a multiple of every ratio otherwise)
#   16     8     upto (u64): positions covered end here (exclusive)
#   24     4     index-key publisher layer (i32, -1 when absent)
#   28     4     number of layer blocks (u32)
#   32     4     Engram history length h (u32; 0 when absent)
#   36     4     reserved (0)
#   40     8h    Engram history (i64 [h]): compressed ids of positions upto-h..upto-1, -1 = DEAD
#   then per KV-source layer, in ascending layer order, a 32-byte block header
#          4     layer (u32)      4 ratio m (u32)       4 entries n (u32) = upto//m - start//m
#          4     main record bytes b_m (u32)            4 index record bytes b_i (u32)
#          4     carry rows r (u32) = m when m > 1 and upto % m != 0, else 0   4 width C (u32)   4 reserved (0)
#   followed by main records (u8 [n, b_m]), index records (u8 [n, b_i]), carry kv (f32 [r, C]), carry score
#   (f32 [r, C]).
#
# SwaState, layout version 1:
#   0      4     magic b"DSSW"
#   4      2     layout version (u16) = 1
#   6      2     reserved (0)
#   8      8     pos (u64): the position the rings stand at
#   16     4     number of rings (u32)
#   20     4     number of extras (u32)
#   then per layer (ascending): layer (u32), rows W (u32), row bytes (u32), reserved (u32), ring bytes u8 [W, row]
#   then per extra (sorted by name): name length k (u16), dtype code (u8: 0 f32, 1 i64), ndim d (u8), name (utf-8,
#   k bytes), d dims (u64 each), data (element size * prod(dims) bytes).

GLOBAL_LAYOUT_VERSION = 1
SWA_LAYOUT_VERSION = 1
_GLOBAL_MAGIC = b"DSGK"
_SWA_MAGIC = b"DSSW"
_G_HEAD = struct.Struct("<4sHHQQiIII")
_G_LAYER = struct.Struct("<IIIIIIII")
_S_HEAD = struct.Struct("<4sHHQII")
_S_LAYER = struct.Struct("<IIII")
_S_EXTRA = struct.Struct("<HBB")
_EXTRA_DTYPES = {0: (torch.float32, np.dtype("<f4")), 1: (torch.int64, np.dtype("<i8"))}


class _Reader:
    """Bounds-checked cursor over a byte buffer (every overrun is a ValueError)."""

    def __init__(self, data, what: str):
        self.buf, self.off, self.what = memoryview(data).cast("B"), 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.off + n > len(self.buf):
            raise ValueError(f"{self.what}: truncated (need {n} bytes at offset {self.off}, have {len(self.buf)})")
        v = self.buf[self.off:self.off + n]
        self.off += n
        return v

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        raw = self.take(count * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()

    def done(self) -> None:
        if self.off != len(self.buf):
            raise ValueError(f"{self.what}: {len(self.buf) - self.off} trailing bytes")


def _le_bytes(t: torch.Tensor, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=dtype).tobytes()


@dataclass(eq=False)
class GlobalLayerState:
    """One KV-source layer's part of a `GlobalState` (CPU tensors)."""
    layer: int
    ratio: int
    main: torch.Tensor           # uint8 [n, main record bytes]
    index: torch.Tensor          # uint8 [n, index record bytes]
    carry_kv: torch.Tensor       # fp32 [r, C]: the compressor carry at `upto` (see below)
    carry_score: torch.Tensor    # fp32 [r, C]

    # The carry is the pool's whole pending slab of the layer, r = m rows, when upto % m != 0 (the last upto % m
    # slots hold the open group's tokens, `dsv41.model.attention.carry_after`; all m are kept so that a resume is
    # bit-identical whatever the other slots hold), and 0 rows when the group is closed (then it is never read).


@dataclass(eq=False)
class GlobalState:
    """The persistent tier's unit of state (SYSTEM.md 4): global-KV records of positions start..upto-1 plus what
    resuming at `upto` needs (compressor carry, Engram history, index-key publisher). Binary layout above."""
    start: int
    upto: int
    layers: list[GlobalLayerState]
    engram_history: torch.Tensor | None = None      # int64 [n-1] at `upto`, or None (not known)
    index_k_publisher: int | None = None
    layout_version: int = GLOBAL_LAYOUT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of the packed records (main + index) the state holds."""
        return sum(ls.main.numel() + ls.index.numel() for ls in self.layers)

    def to_bytes(self) -> bytes:
        hist = self.engram_history
        flags = (1 if hist is not None else 0) | (2 if self.index_k_publisher is not None else 0)
        layers = sorted(self.layers, key=lambda ls: ls.layer)
        parts = [_G_HEAD.pack(_GLOBAL_MAGIC, self.layout_version, flags, self.start, self.upto,
                              -1 if self.index_k_publisher is None else self.index_k_publisher, len(layers),
                              0 if hist is None else hist.numel(), 0)]
        if hist is not None:
            parts.append(_le_bytes(hist.reshape(-1).to(torch.int64), np.dtype("<i8")))
        for ls in layers:
            n, r = ls.main.size(0), ls.carry_kv.size(0)
            if ls.index.size(0) != n or ls.carry_score.shape != ls.carry_kv.shape:
                raise ValueError(f"global state layer {ls.layer}: inconsistent record / carry shapes")
            parts.append(_G_LAYER.pack(ls.layer, ls.ratio, n, ls.main.size(1), ls.index.size(1), r,
                                       ls.carry_kv.size(1), 0))
            parts += [_le_bytes(ls.main, np.dtype("u1")), _le_bytes(ls.index, np.dtype("u1")),
                      _le_bytes(ls.carry_kv, np.dtype("<f4")), _le_bytes(ls.carry_score, np.dtype("<f4"))]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data) -> "GlobalState":
        rd = _Reader(data, "global state")
        magic, version, flags, start, upto, publisher, n_layers, h, _ = rd.unpack(_G_HEAD)
        if magic != _GLOBAL_MAGIC:
            raise ValueError(f"global state: bad magic {bytes(magic)!r}")
        if version != GLOBAL_LAYOUT_VERSION:
            raise ValueError(f"global state: layout version {version}, this reader knows {GLOBAL_LAYOUT_VERSION}")
        if start > upto or (not flags & 1 and h):
            raise ValueError("global state: inconsistent header")
        hist = torch.from_numpy(rd.array(np.dtype("<i8"), (h,))) if flags & 1 else None
        layers = []
        for _ in range(n_layers):
            layer, m, n, bm, bi, r, C, _ = rd.unpack(_G_LAYER)
            if m == 0 or n != upto // m - start // m or r != (m if m > 1 and upto % m else 0):
                raise ValueError(f"global state layer {layer}: entry/carry counts do not match positions "
                                 f"{start}..{upto} at ratio {m}")
            layers.append(GlobalLayerState(
                layer, m, torch.from_numpy(rd.array(np.dtype("u1"), (n, bm))),
                torch.from_numpy(rd.array(np.dtype("u1"), (n, bi))),
                torch.from_numpy(rd.array(np.dtype("<f4"), (r, C))),
                torch.from_numpy(rd.array(np.dtype("<f4"), (r, C)))))
        rd.done()
        return cls(start, upto, layers, hist, publisher if flags & 2 else None, version)

    # ---------------------------------------------------------------- segments
    def slice(self, start: int, upto: int) -> "GlobalState":
        """The segment of positions start..upto-1 (self.start <= start <= upto <= self.upto). `start` must be a
        multiple of every ratio; so must `upto` unless it is self.upto. The carry and the Engram history belong
        to self.upto and are kept only when upto == self.upto."""
        if not self.start <= start <= upto <= self.upto:
            raise ValueError(f"slice {start}..{upto} outside {self.start}..{self.upto}")
        ratios = {ls.ratio for ls in self.layers}
        if any(start % m for m in ratios) or (upto != self.upto and any(upto % m for m in ratios)):
            raise ValueError(f"slice {start}..{upto}: positions must be multiples of every ratio {sorted(ratios)}")
        layers = []
        for ls in self.layers:
            m, base = ls.ratio, self.start // ls.ratio
            e0, e1 = start // m - base, upto // m - base
            end = upto == self.upto
            layers.append(GlobalLayerState(ls.layer, m, ls.main[e0:e1].clone(), ls.index[e0:e1].clone(),
                                           ls.carry_kv.clone() if end else ls.carry_kv[:0].clone(),
                                           ls.carry_score.clone() if end else ls.carry_score[:0].clone()))
        end = upto == self.upto
        return GlobalState(start, upto, layers, self.engram_history if end else None,
                           self.index_k_publisher, self.layout_version)

    @staticmethod
    def join(parts: list["GlobalState"]) -> "GlobalState":
        """Consecutive segments (each starting where the previous ends, every carry but the last empty) as one
        state; carry, Engram history and publisher come from the last."""
        if not parts:
            raise ValueError("join: no segments")
        for a, b in zip(parts, parts[1:]):
            if a.upto != b.start:
                raise ValueError(f"join: segment ending at {a.upto} followed by one starting at {b.start}")
            if any(ls.carry_kv.size(0) for ls in a.layers):
                raise ValueError(f"join: a segment ending at {a.upto} that is not the last carries compressor state")
        order = [sorted(ls.layer for ls in p.layers) for p in parts]
        if any(o != order[0] for o in order):
            raise ValueError("join: segments hold different layers")
        last = parts[-1]
        by_layer = [{ls.layer: ls for ls in p.layers} for p in parts]
        layers = []
        for L in order[0]:
            pieces = [d[L] for d in by_layer]
            if len({p.ratio for p in pieces}) != 1:
                raise ValueError(f"join: layer {L} ratios differ between segments")
            layers.append(GlobalLayerState(L, pieces[0].ratio, torch.cat([p.main for p in pieces]),
                                           torch.cat([p.index for p in pieces]), pieces[-1].carry_kv.clone(),
                                           pieces[-1].carry_score.clone()))
        return GlobalState(parts[0].start, last.upto, layers, last.engram_history, last.index_k_publisher,
                           last.layout_version)


@dataclass(eq=False)
class SwaState:
    """Every layer's SWA ring (packed FP8 bytes, backbone and DSpark stages) at position `pos`, plus named extras
    (fp32 / int64 tensors the engine stores with it). Binary layout above."""
    pos: int
    rings: dict[int, torch.Tensor]                   # layer -> uint8 [W, row bytes]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    layout_version: int = SWA_LAYOUT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(r.numel() for r in self.rings.values())

    def to_bytes(self) -> bytes:
        parts = [_S_HEAD.pack(_SWA_MAGIC, self.layout_version, 0, self.pos, len(self.rings), len(self.extras))]
        for L in sorted(self.rings):
            ring = self.rings[L]
            if ring.dtype != torch.uint8 or ring.dim() != 2:
                raise ValueError(f"SWA ring {L} must be uint8 [W, row bytes]")
            parts += [_S_LAYER.pack(L, ring.size(0), ring.size(1), 0), _le_bytes(ring, np.dtype("u1"))]
        for name in sorted(self.extras):
            t = self.extras[name]
            code = next((c for c, (td, _) in _EXTRA_DTYPES.items() if td == t.dtype), None)
            if code is None:
                t, code = t.float(), 0                # bf16 / fp16 values are exact in fp32
            raw = name.encode("utf-8")
            if len(raw) > 0xFFFF or t.dim() > 255:
                raise ValueError(f"SWA extra {name!r}: name or rank too large")
            parts += [_S_EXTRA.pack(len(raw), code, t.dim()), raw,
                      struct.pack(f"<{t.dim()}Q", *t.shape), _le_bytes(t, _EXTRA_DTYPES[code][1])]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data) -> "SwaState":
        rd = _Reader(data, "SWA state")
        magic, version, _, pos, n_rings, n_extras = rd.unpack(_S_HEAD)
        if magic != _SWA_MAGIC:
            raise ValueError(f"SWA state: bad magic {bytes(magic)!r}")
        if version != SWA_LAYOUT_VERSION:
            raise ValueError(f"SWA state: layout version {version}, this reader knows {SWA_LAYOUT_VERSION}")
        rings = {}
        for _ in range(n_rings):
            L, W, row, _ = rd.unpack(_S_LAYER)
            rings[L] = torch.from_numpy(rd.array(np.dtype("u1"), (W, row)))
        extras = {}
        for _ in range(n_extras):
            k, code, d = rd.unpack(_S_EXTRA)
            if code not in _EXTRA_DTYPES:
                raise ValueError(f"SWA state: unknown extra dtype code {code}")
            name = bytes(rd.take(k)).decode("utf-8")
            shape = struct.unpack(f"<{d}Q", rd.take(8 * d))
            extras[name] = torch.from_numpy(rd.array(_EXTRA_DTYPES[code][1], tuple(shape)))
        rd.done()
        return cls(pos, rings, extras, version)
