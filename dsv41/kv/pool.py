"""The engine's packed KV store (docs/system.md §3): real packed bytes, paged per sequence, bound into the model.

`PackedKVPool` owns the storage of many sequences; `pool.bind(seq_ids)` returns a `BatchView`
(`dsv41.kv.batch_view`) with the methods of `dsv41.model.cache.DenseCache` (the interface the model calls), rows
in the order given. The model never sees the bytes: every read unpacks, every write packs.

What is stored, per the layer specs of `cache_spec(cfg)` (legend: W window rows, C latent width, I index-key
width, m compression ratio, P page size in entries):

  global store   per KV-source layer (spec.ratio > 0): pages of P entries (`dsv41.kv.pages.PagedLayer`, 288 B +
                 68 B per entry for the released geometry), the page count doubling when it runs out. A sequence
                 owns a page table per layer and holds pages only for entries it has written: one entry per
                 *completed* group of m positions (no max_seq_len-sized preallocation).
  SWA ring       per layer (backbone and DSpark stages) per sequence: `[W, C + C/32]` uint8 (528 B rows), the
                 token at position p in slot p % W. Rings of all sequences live in one slab per layer indexed by
                 the sequence's slot (`[n_slots, W, bytes]`, doubling), so a batch reads them with one gather.
  pending        per layer with pending_rows > 0, per sequence: the Compressor's carry, fp32 `[m, C]` kv and
                 score (score starts at -inf). Uncompressed and not part of the global bytes.
  per sequence   position `pos`, the Engram history (opaque LongTensor) and the index-key publisher.

Export / import (prefix caching, docs/system.md §4): `export_global` / `import_global` and `export_swa` / `import_swa`
move a sequence's state in and out as a `GlobalState` / `SwaState` (`dsv41.kv.state_format`, binary layouts there).

Exactness. The model writes values that are already quantize-dequantized in the three formats (`qdq_fp8`,
`qdq_main_kv`, `qdq_index_k`), so the stored bytes decode to exactly the values `DenseCache` would hold.
The SWA and index-key formats use power-of-two scales and `pack(qdq(x))` reproduces `qdq(x)`. The main-KV format
uses an E4M3 scale that `pack_main_kv` re-derives from the group maximum, which is lossy for groups whose scale is
an E4M3 subnormal; writes of main KV therefore go through `dsv41.codecs.pack_main_kv_exact` (the same record
layout, decoding to the input exactly whenever it is representable, which every QDQ output is).

Quantization off. With `set_quantization(model, False)` the written values are not representable in the packed
formats and this store rounds them (a lossy cache); the engine uses `DenseCache` for unquantized models. Pass
`strict=True` to have every write verify its round trip (one host sync per write) and raise ValueError.

Speculative decoding. docs/system.md §3 sizes the ring W + (max_verify - 1) rows so a rejected draft never overwrites
a row still in the window. Here the ring keeps W rows (the model's window lists, the kernels and the SwaState
layout address slot p % W) and a verify step instead saves the <= max_verify ring rows it will overwrite
(`ring_rows`) and puts back those of rejected positions (`set_ring_rows`); `truncate_global` forgets entries of
rejected groups (`dsv41.engine.speculative.VerifyJournal`). Same guarantee: rejected tokens leave no trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from dsv41.codecs import swa_kv_bytes
from dsv41.config import ModelConfig
from dsv41.kv.batch_view import BatchView
from dsv41.kv.pages import KINDS, PageLimit, PagedLayer, grown
from dsv41.kv.state_format import GlobalLayerState, GlobalState, SwaState, carry_rows
from dsv41.model.cache import LayerCacheSpec, cache_spec


@dataclass
class _Sequence:
    slot: int
    pos: int = 0
    pages: dict[int, list[int]] = field(default_factory=dict)       # per global layer: page ids in entry order
    rows: dict[tuple[int, str], int] = field(default_factory=dict)  # (layer, kind) -> entries written
    engram_history: torch.Tensor | None = None
    index_k_publisher: int | None = None


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
    max_pages      pages all KV-source layers may hold together (None: no limit); beyond it an allocation raises
                   `PoolFull` (the engine's scheduler keeps within it, docs/system.md §3)
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", page_size: int = 64,
                 dtype: torch.dtype = torch.float32, initial_pages: int = 4, initial_slots: int = 2,
                 strict: bool = False, max_pages: int | None = None):
        if page_size <= 0 or initial_pages <= 0 or initial_slots <= 0:
            raise ValueError("page_size, initial_pages and initial_slots must be positive")
        self.cfg, self.device, self.page_size = cfg, torch.device(device), page_size
        self.dtype, self.strict = dtype, strict
        self.specs: dict[int, LayerCacheSpec] = {s.layer: s for s in cache_spec(cfg)}
        self.page_limit = PageLimit(max_pages)
        self.global_layers = {L: PagedLayer(s, page_size, initial_pages, self.device, self.page_limit)
                              for L, s in self.specs.items() if s.ratio > 0}
        self.swa = {L: torch.zeros(initial_slots, s.window_rows, swa_kv_bytes(s.width), dtype=torch.uint8,
                                   device=self.device) for L, s in self.specs.items()}
        shape = {L: (initial_slots, s.pending_rows, s.width) for L, s in self.specs.items() if s.pending_rows > 0}
        f32 = {"dtype": torch.float32, "device": self.device}
        self.pending = {L: (torch.zeros(sh, **f32), torch.full(sh, -torch.inf, **f32)) for L, sh in shape.items()}
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
        self.swa = {L: grown(t, new, 0) for L, t in self.swa.items()}
        self.pending = {L: (grown(kv, new, 0), grown(sc, new, -torch.inf)) for L, (kv, sc) in self.pending.items()}
        self.free_slots = list(range(new - 1, old - 1, -1)) + self.free_slots

    def _clear_pending(self, slot: int) -> None:
        for kv, sc in self.pending.values():
            kv[slot].zero_()
            sc[slot].fill_(-torch.inf)

    def _take_slot(self) -> int:
        if not self.free_slots:
            self._grow_slots()
        slot = self.free_slots.pop()
        for t in self.swa.values():
            t[slot].zero_()
        self._clear_pending(slot)
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

    def share_prefix(self, sid: int, src: int, upto: int, carries: dict | None = None,
                     engram_history: torch.Tensor | None = None) -> None:
        """Fresh sequence `sid` continues sequence `src`'s first `upto` positions (the prefix device tier,
        `dsv41.kv.device_tier`): per KV-source layer its first upto // m entries shared page by page (full pages
        get one more holder, no copy: the store is append-only, so neither sequence writes them again; the partly
        filled last page is copied, since both append to it), pos = upto. The compressor carry at `upto`: none
        when upto is a multiple of every ratio, else `carries` {layer: (kv, score)} captured when `src` stood
        there, or src's own when it stands there now. SWA rings stay empty (import_swa, or replay);
        engram_history as `import_global`'s. ValueError for a sequence that is not fresh or lacks the entries."""
        s, d = self._seq(src), self._seq(sid)
        upto = int(upto)
        if d.pos != 0 or any(d.rows.values()):
            raise ValueError(f"share_prefix: sequence {sid} is not fresh (pos {d.pos})")
        if not 0 <= upto <= s.pos:
            raise ValueError(f"share_prefix: upto {upto} is beyond sequence {src}'s position {s.pos}")
        P = self.page_size
        self._clear_pending(d.slot)
        view = None
        for L, pl in self.global_layers.items():
            m = pl.spec.ratio
            e1 = upto // m
            if any(s.rows[(L, k)] < e1 for k in KINDS):
                raise ValueError(f"share_prefix: sequence {src} layer {L} holds fewer than {e1} entries")
            d.pages[L] = pl.share(s.pages[L][:e1 // P])
            if e1 % P:
                (page,) = pl.alloc(1)
                for t in pl.data.values():
                    t[page] = t[s.pages[L][e1 // P]]
                d.pages[L].append(page)
                pl.version += 1
            for k in KINDS:
                d.rows[(L, k)] = e1
            if carry_rows(m, upto):
                if carries is not None and L in carries:
                    kv, sc = carries[L]
                elif upto == s.pos:
                    kv, sc = (t[s.slot] for t in self.pending[L])
                else:
                    raise ValueError(f"share_prefix: layer {L} has an open group at {upto}: pass its carry")
                view = view or self.bind([sid])
                view.set_compressor_state(L, kv.to(self.device).unsqueeze(0), sc.to(self.device).unsqueeze(0))
        d.pos = upto
        history = engram_history
        if history is None and upto == s.pos:
            history = s.engram_history
        if self.history_width and history is None and upto > 0:
            raise ValueError("share_prefix: this config has Engram: pass engram_history at upto")
        d.engram_history = None if history is None or not self.history_width else \
            self._history_arg("share_prefix", history).to(self.device)
        d.index_k_publisher = s.index_k_publisher

    def bind(self, seq_ids) -> BatchView:
        """The DenseCache interface over these sequences, rows in this order."""
        return BatchView(self, list(seq_ids))

    # -------------------------------------------------- export / import (prefix caching, docs/system.md §4)
    def _history_arg(self, what: str, history) -> torch.Tensor:
        """A caller's Engram history as int64 [n-1] on the CPU; ValueError for another length."""
        history = torch.as_tensor(history, dtype=torch.long).cpu().reshape(-1).clone()
        if history.numel() != self.history_width:
            raise ValueError(f"{what}: engram_history must hold {self.history_width} ids, got {history.numel()}")
        return history

    def _export_history(self, s: _Sequence, upto: int, engram_history: torch.Tensor | None) -> torch.Tensor | None:
        if not self.history_width:
            return None
        if engram_history is not None:
            return self._history_arg("export_global", engram_history)
        if upto == s.pos and s.engram_history is not None:
            return s.engram_history.detach().cpu().reshape(-1).clone()
        return None

    def export_global(self, sid: int, upto: int, start: int = 0,
                      engram_history: torch.Tensor | None = None) -> GlobalState:
        """The persistent part of sequence `sid` for its first `upto` positions (docs/system.md §4): per KV-source layer
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
        view, layers = self.bind([sid]), []
        for L, pl in self.global_layers.items():
            m, C = pl.spec.ratio, pl.spec.width
            e0, e1 = start // m, upto // m
            for k in KINDS:
                if s.rows[(L, k)] < e1:
                    raise ValueError(f"export_global: sequence {sid} layer {L} holds {s.rows[(L, k)]} {k} "
                                     f"entries, fewer than the {e1} of {upto} positions")
            if carry_rows(m, upto):                           # all m slots, exactly as held (see GlobalLayerState)
                ckv, csc = (t[0].cpu().clone() for t in view.compressor_state(L))
            else:
                ckv = csc = torch.zeros(0, C, dtype=torch.float32)
            records = (view.read_records(L, k, e1, start=e0)[0][0].cpu() for k in KINDS)
            layers.append(GlobalLayerState(L, m, *records, ckv, csc))
        return GlobalState(start, upto, layers, self._export_history(s, upto, engram_history), s.index_k_publisher)

    def check_global_state(self, state: GlobalState) -> None:
        """ValueError unless `state` fits this pool's config (layers, ratios, record sizes, widths, carry rows)."""
        want = sorted(self.global_layers)
        got = sorted(ls.layer for ls in state.layers)
        if got != want:
            raise ValueError(f"global state holds layers {got}, this pool's KV-source layers are {want}")
        for ls in state.layers:
            pl = self.global_layers[ls.layer]
            m = pl.spec.ratio
            n, r = state.upto // m - state.start // m, carry_rows(m, state.upto)
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

    def import_global(self, sid: int, state: GlobalState, engram_history: torch.Tensor | None = None) -> None:
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
        history = state.engram_history
        if self.history_width and engram_history is not None:
            history = self._history_arg("import_global", engram_history)
        if self.history_width and history is None and state.upto > 0:
            raise ValueError("import_global: this config has Engram and the state carries no Engram history: "
                             "pass engram_history (dsv41.kv.prefix.engram_history_at)")
        self._clear_pending(s.slot)
        view = self.bind([sid])
        for ls in state.layers:
            for kind in KINDS:
                view.write_records(ls.layer, kind, 0, getattr(ls, kind).unsqueeze(0), ls.main.size(0))
            if ls.carry_kv.size(0):                           # the whole m-slot slab (see GlobalLayerState)
                view.set_compressor_state(ls.layer, *(t.to(self.device).unsqueeze(0)
                                                      for t in (ls.carry_kv, ls.carry_score)))
        s.pos = state.upto
        s.engram_history = None if history is None or not self.history_width else \
            history.to(torch.long).clone().to(self.device)
        s.index_k_publisher = state.index_k_publisher

    def export_swa(self, sid: int, extras: dict[str, torch.Tensor] | None = None) -> SwaState:
        """Every layer's SWA ring bytes (backbone and DSpark stages) of sequence `sid` at its current position.
        `extras`: named fp32 / int64 tensors the engine wants back with the snapshot (e.g. the last position's
        logits, so that a hit covering the whole prompt needs no recomputation)."""
        s = self._seq(sid)
        rings = {L: t[s.slot].cpu().clone() for L, t in self.swa.items()}
        return SwaState(s.pos, rings, {k: v.detach().cpu().clone() for k, v in (extras or {}).items()})

    def import_swa(self, sid: int, state: SwaState) -> None:
        """Restore the SWA rings of sequence `sid`, which must stand at the snapshot's position (import the global
        state first). ValueError on a position or layout mismatch."""
        s = self._seq(sid)
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

        global_entries_bytes    packed records actually holding entries (main + index), the figure of docs/system.md §1
        global_allocated_bytes  whole pages handed to the sequence (entries plus the slack of its last pages)
        swa_bytes               its SWA rings (W packed rows per layer, backbone and DSpark, allocated up front)
        pending_bytes           its compressor carry (fp32 kv + score, m x C per layer with m > 1)
        tokens                  its position
        (also global_main_bytes / global_index_bytes, global_entries, global_pages; global_bytes repeats
        global_entries_bytes under the key the engine's dense store uses)"""
        s = self._seq(sid)
        main, index = (sum(s.rows[(L, k)] * pl.record_bytes[k] for L, pl in self.global_layers.items())
                       for k in KINDS)
        return {"packed": True, "global_bytes": main + index,     # global_bytes: the figure under DensePool's key
                "global_entries_bytes": main + index, "global_main_bytes": main, "global_index_bytes": index,
                "global_entries": sum(s.rows[(L, "main")] for L in self.global_layers),
                "global_allocated_bytes": sum(len(s.pages[L]) * pl.page_bytes for L, pl in self.global_layers.items()),
                "global_pages": sum(len(p) for p in s.pages.values()),
                "swa_bytes": sum(t[0].numel() for t in self.swa.values()),
                "pending_bytes": self._pending_bytes(per_slot=True), "tokens": s.pos}

    def _pending_bytes(self, per_slot: bool) -> int:
        """Bytes of the compressor carry (kv + score): one slot's, or every slot's."""
        return sum((t[0] if per_slot else t).numel() * t.element_size() for kv_sc in self.pending.values()
                   for t in kv_sc)

    def global_bytes_per_token(self, sid: int) -> Fraction:
        """Packed global-store bytes per token of one sequence (exact; equals the analytic figure when its length
        is a multiple of every ratio)."""
        b = self.seq_bytes(sid)
        if b["tokens"] == 0:
            raise ValueError(f"sequence {sid} holds no tokens")
        return Fraction(b["global_entries_bytes"], b["tokens"])

    def pool_bytes(self) -> dict[str, int]:
        """Bytes of the pool's storage tensors (capacity) and of what is handed out."""
        pages_used = {L: pl.n_pages - len(pl.free) for L, pl in self.global_layers.items()}
        return {"sequences": len(self.seqs),
                "global_capacity_bytes": sum(pl.n_pages * pl.page_bytes for pl in self.global_layers.values()),
                "global_allocated_bytes": sum(pages_used[L] * pl.page_bytes for L, pl in self.global_layers.items()),
                "global_pages_allocated": sum(pages_used.values()),
                "global_entries_bytes": sum(self.seq_bytes(s)["global_entries_bytes"] for s in self.seqs),
                "swa_capacity_bytes": sum(t.numel() for t in self.swa.values()),
                "pending_capacity_bytes": self._pending_bytes(per_slot=False)}
