"""The decode step with fixed shapes, replayed from CUDA graphs (docs/system.md §3).

An eager decode step is host-bound on a GPU: thousands of kernel launches and the host reads that size the step
(visible entries per layer, the compressor's groups, page tables rebuilt from Python lists). Here the step is the
model's own forward over a `StaticStore`: for a bucket of rows (1, 2, 4, 8, 16, 32, 64, ...) every input lives in
a buffer of fixed address (token ids, positions, ring slots, page tables, the Engram history) and every width
that depends on the context is fixed (the indexer scores `entry_capacity` entries per row, the counts it masks
with are device tensors; the top-k is `index_topk` wide; the compressor pools the widest row's groups), so the
step reads nothing back to the host and one `torch.cuda.CUDAGraph` per bucket replays it.

What the host does around a replay (`DecodeGraphs.forward`): before it, the pages the step will write are
allocated (`PagedLayer.ensure`) and the rows' positions, slots and page tables copied into the buffers; rows
past the real batch point at a scratch sequence (its own ring slot, one page per layer), and a row that completes
no compressed entry writes its (unused) record there too. After it, the bookkeeping the eager store does inside
its writes: positions, entries held, the index-key publisher, the Engram history. Engram tables held in host
memory (`engram_tables_on_host`): the step's hash ids are computed on the host too, and only the rows they name
are gathered and copied into the bucket's device buffers, which the captured lookups read.

A bucket is (rows, context span): the span, a power of two of positions, sizes the page tables, so a short context
never scores the entries a long one could hold. Capture is lazy, per bucket: a warm-up on a side stream, then the capture, all rows on the scratch sequence, into
one memory pool shared by the buckets. The graphs hold the addresses of the pool's pages and rings, so when the
pool grows (new pages or slots: its tensors are reallocated) they are captured again.

On a CPU (or with `capture=False`) the same static step runs eagerly: the "eager twin" the tests compare with the
ordinary decode step (tests/test_graph_decode.py).

Legend: B real rows, Bp rows of the bucket, MP page-table width, P page size, W window rows.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from dsv41.kernels import pack_swa_kv as pack_swa_rows
from dsv41.codecs import index_k_bytes, main_kv_bytes, pack_index_k, pack_main_kv_exact
from dsv41.kv import PackedKVPool
from dsv41.kv.batch_view import BatchView
from dsv41.kv.pages import KINDS
from dsv41.model.attention import Attention
from dsv41.model.engram import DEAD
from dsv41.model.transformer import ForwardOut

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(batch: int) -> int:
    """The smallest bucket holding `batch` rows; ValueError beyond the largest."""
    for b in BUCKETS:
        if batch <= b:
            return b
    raise ValueError(f"a graph-captured decode step holds at most {BUCKETS[-1]} rows, got {batch}")


class StaticStore:
    """`dsv41.model.cache.PackedKVStore` over fixed-address buffers of Bp rows of a `PackedKVPool`, for a decode
    step of fixed shapes (`StepContext.static`): every read and write is a device op indexed by the buffers."""

    packed = True
    static = True

    def __init__(self, pool, rows: int, capacity: dict[int, int]):
        """capacity: pages each KV-source layer's page table holds per row (its `entry_capacity` over P)."""
        dev, self.pool, self.rows = pool.device, pool, rows
        self.start = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tables = {L: torch.zeros(rows, capacity[L], dtype=torch.int32, device=dev) for L in pool.global_layers}
        self.scratch_rows = {L: torch.zeros((), dtype=torch.long, device=dev) for L in pool.global_layers}
        self.table_keys = {L: [None] * rows for L in pool.global_layers}     # what each table row holds now
        k = pool.history_width
        self.history = torch.full((rows, k), DEAD, dtype=torch.long, device=dev) if k else None
        self.index_k_publisher: int | None = None
        cfg = pool.cfg
        self._none = {kind: (torch.zeros(1, 1, width, dtype=torch.uint8, device=dev),
                             torch.zeros(rows, 1, dtype=torch.int32, device=dev))
                      for kind, width in (("main", main_kv_bytes(cfg.head_dim)),
                                          ("index", index_k_bytes(cfg.index_head_dim)))}

    # ------------------------------------------------------------------ per-row scalars (the host keeps the truth)
    @property
    def pos(self) -> torch.Tensor:
        return self.start

    @pos.setter
    def pos(self, value) -> None:
        """The forward advances the position; the host's bookkeeping does (`DecodeGraphs._finish`)."""

    @property
    def engram_history(self) -> torch.Tensor | None:
        return self.history

    @engram_history.setter
    def engram_history(self, value: torch.Tensor) -> None:
        self.history.copy_(value)

    def entry_capacity(self, ratio: int) -> int:
        """Entries of ratio `ratio` a row's page table addresses (the same for every layer of that ratio)."""
        widths = {self.tables[L].size(1) for L, pl in self.pool.global_layers.items() if pl.spec.ratio == ratio}
        assert len(widths) == 1, widths
        return widths.pop() * self.pool.page_size

    # ------------------------------------------------------------------ window ring
    def write_window(self, layer: int, start: torch.Tensor, kv: torch.Tensor, count=None) -> None:
        """kv [Bp,1,C] at each row's position: ring row start % W of the row's slot."""
        assert kv.size(1) == 1 and count is None, "a static step writes one token per row"
        ring = self.pool.swa[layer]
        ring[self.slots, start % ring.size(1)] = pack_swa_rows(kv[:, 0].detach())

    packed_ring = BatchView.packed_ring

    def packed_pages(self, layer: int | None, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if layer is None:
            return self._none[kind]
        return self.pool.global_layers[layer].data[kind], self.tables[layer]

    # ------------------------------------------------------------------ global KV
    def _write(self, layer: int, kind: str, row0: torch.Tensor, records: torch.Tensor, count: torch.Tensor) -> None:
        """records [Bp, bytes] of entry row0_b of each row; rows with count_b = 0 write the scratch record."""
        pl = self.pool.global_layers[layer]
        P, table = self.pool.page_size, self.tables[layer]
        e = row0.long()
        page = table.gather(1, (e // P).clamp(max=table.size(1) - 1).unsqueeze(1))[:, 0].long()
        flat = torch.where(count > 0, page * P + e % P, self.scratch_rows[layer])
        pl.records(kind)[flat] = records

    def append_compressed(self, layer: int, row0: torch.Tensor, kv: torch.Tensor, count: torch.Tensor) -> None:
        assert kv.size(1) == 1, "a decode step completes at most one group per row"
        self._write(layer, "main", row0, pack_main_kv_exact(kv[:, 0].detach()), count)

    def append_index_k(self, layer: int, row0: torch.Tensor, k: torch.Tensor, count: torch.Tensor) -> None:
        assert k.size(1) == 1, "a decode step completes at most one group per row"
        self._write(layer, "index", row0, pack_index_k(k[:, 0].detach(), check_finite=False), count)

    # ------------------------------------------------------------------ compressor carry, ring: BatchView's own
    # (device gathers and scatters by `self.slots`, as here)
    compressor_state = BatchView.compressor_state
    set_compressor_state = BatchView.set_compressor_state


def _update_table(table: torch.Tensor, keys: list, seqs, layer: int, epoch: int) -> None:
    """Bring the device page table [Bp, MP] up to the rows' page lists, copying only what changed: a list that
    only grew since (same list, same release epoch of the layer) copies its new tail, any other change its whole
    row (a long context's table is large; it gains a page every P * m tokens)."""
    for b, s in enumerate(seqs):
        pages = s.pages[layer]
        old = keys[b]
        if old is not None and old[0] is pages and old[2] == epoch and old[1] == len(pages):
            continue
        lo = old[1] if old is not None and old[0] is pages and old[2] == epoch and old[1] < len(pages) else 0
        row = torch.zeros(table.size(1) - lo, dtype=torch.int32) if lo == 0 else None
        new = torch.tensor(pages[lo:], dtype=torch.int32)
        if row is not None:
            row[:len(new)] = new
            table[b].copy_(row, non_blocking=True)
        elif len(new):
            table[b, lo:lo + len(new)].copy_(new, non_blocking=True)
        keys[b] = (pages, len(pages), epoch)


@dataclass
class _Bucket:
    """One bucket's static step: its store, token-id buffer, outputs, and graph (None: not captured / eager)."""

    store: StaticStore
    ids: torch.Tensor                        # [Bp, 1] long
    out: ForwardOut | None = None
    graph: "torch.cuda.CUDAGraph | None" = None
    engram_rows: list | None = None          # per host Engram table: (codes [Bp*G, W], scales) on the device


def supports(model, pool, capture: bool = True) -> str | None:
    """Why the static decode step cannot serve this model and pool (None: it can): it needs the packed store with
    quantization on (the packed decode path); captured, also no deterministic mode (its reference kernels read
    counts on the host)."""
    from dsv41.kernels.choice import packed_decode
    from dsv41.kernels.invariant import is_deterministic
    if not isinstance(pool, PackedKVPool):
        return "the dense store (quantization off)"
    if not packed_decode(1, True, all(m.quant for m in model.modules() if isinstance(m, Attention))):
        return "the packed decode path is off"
    if not capture:
        return None
    if is_deterministic():
        return "the deterministic mode"
    return None


def host_engrams(model) -> list:
    """The model's Engram modules whose packed tables stay in host memory."""
    return [b.engram for b in model.layers
            if b.engram is not None and b.engram.packed and b.engram.embed.host]


class DecodeGraphs:
    """The decode step of `model` over `pool` with fixed shapes, captured per bucket (capture=True, CUDA) or run
    eagerly (the eager twin). max_seq_len: the longest sequence a row may reach; it and min_span bound the spans
    that size the page tables."""

    def __init__(self, model, pool, max_seq_len: int, capture: bool | None = None, min_span: int = 1024):
        self.model, self.pool, self.device = model, pool, pool.device
        self.capture = pool.device.type == "cuda" if capture is None else capture
        if self.capture and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the pool is on {pool.device}")
        why = supports(model, pool, self.capture)
        if why is not None:
            raise ValueError(f"the {'captured' if self.capture else 'static'} decode step does not support {why}")
        self.max_seq_len, self.min_span = max_seq_len, min_span
        self.buckets: dict[tuple[int, int], _Bucket] = {}      # by (rows, context span)
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.signature = None
        self.captures = 0                           # graphs captured so far (tests, benchmarks)
        self.failure: str | None = None             # why capture failed (then the static step runs eagerly)
        self._stream = None                         # the warm-up and capture stream (made at the first capture)
        self._order = [b.attn for b in model.layers]
        self._scratch = self._scratch_sequence()
        self._rope_on_device()
        self._host_engrams = host_engrams(model)
        self._hasher = copy.deepcopy(model.engram_hasher).to("cpu") if self._host_engrams else None

    def _scratch_sequence(self) -> int:
        """A sequence the padding rows (and rows completing no entry) write into: one page per KV-source layer,
        not counted against the pool's page limit (the scheduler's budget stays the sequences')."""
        sid = self.pool.new_sequence()
        s = self.pool.seqs[sid]
        for L, pl in self.pool.global_layers.items():
            pl.ensure(s.pages[L], 1)
            pl.limit.give(1)
        return sid

    def _rope_on_device(self) -> None:
        """The RoPE frequency tables on the device, one copy per table (a captured step copies nothing from the
        host); layers sharing a table keep sharing it."""
        moved: dict[int, torch.Tensor] = {}
        for a in self._order:
            t = a.rope.inv_freq
            a.rope.inv_freq = moved.setdefault(id(t), t.to(self.device))

    # ------------------------------------------------------------------ the step
    def applies(self, view) -> bool:
        """Whether this batch fits the graphs: at most the largest bucket, no row past max_seq_len."""
        return len(view.seqs) <= BUCKETS[-1] and all(s.pos < self.max_seq_len for s in view.seqs)

    def span(self, seqs) -> int:
        """The context span of a step: positions its page tables address, the next power of two (>= min_span) of
        the longest row's length after the step, at most max_seq_len. Graphs are captured per span too, so a short
        context does not score the entries a long one could hold."""
        need = max(s.pos + 1 for s in seqs)
        return min(self.max_seq_len, max(self.min_span, 1 << (need - 1).bit_length()))

    def _capacity(self, span: int) -> dict[int, int]:
        """Pages per row of each KV-source layer's page table for a span."""
        P = self.pool.page_size
        return {L: max(1, -(-(span // pl.spec.ratio) // P)) for L, pl in self.pool.global_layers.items()}

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, view) -> ForwardOut:
        """The decode step of the rows of `view` (a `BatchView`, one token each: ids [B,1]); -> the model's
        `ForwardOut` (last-position logits [B,1,V]), the store advanced as the eager step advances it."""
        B = ids.size(0)
        bucket = self._bucket(bucket_for(B), self.span(view.seqs))
        self._allocate(view.seqs)
        if self.capture:
            try:
                self._ensure_graph(bucket)
            except RuntimeError as e:              # serve on: the same static step, uncaptured
                self.capture, self.failure = False, f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed; decode steps run the static step eagerly: %s", e)
        self._inputs(bucket.store, view.seqs)
        bucket.ids[:B].copy_(ids)
        bucket.ids[B:].zero_()
        if self._host_engrams:
            self._engram_rows(bucket, ids)
        if self.capture:
            bucket.graph.replay()
            out = bucket.out
        else:
            out = self._run(bucket)
        self._finish(bucket, view.seqs)
        return ForwardOut(*(None if t is None else t[:B].clone() for t in (out.logits, out.hidden, out.main_hidden)))

    def _run(self, bucket: _Bucket) -> ForwardOut:
        """The model's forward over the bucket's buffers (host Engram tables read the bucket's row buffers)."""
        for e, rows in zip(self._host_engrams, bucket.engram_rows or ()):
            e.embed.static = rows
        try:
            return self.model(bucket.ids, bucket.store, last_only=True)
        finally:
            for e in self._host_engrams:
                e.embed.static = None

    def _bucket(self, rows: int, span: int) -> _Bucket:
        if (rows, span) not in self.buckets:
            store = StaticStore(self.pool, rows, self._capacity(span))
            ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
            tables = [tuple(torch.zeros(rows * e.n_cols, t.size(1), dtype=torch.uint8, device=self.device)
                            for t in (e.embed.weight, e.embed.scale)) for e in self._host_engrams]
            self.buckets[(rows, span)] = _Bucket(store, ids, engram_rows=tables or None)
        return self.buckets[(rows, span)]

    # ------------------------------------------------------------------ host work before and after
    def _allocate(self, seqs) -> None:
        """Pages for the entries this step completes (the pool may grow: the graphs are then captured again)."""
        for s in seqs:
            for L, pl in self.pool.global_layers.items():
                done = (s.pos + 1) // pl.spec.ratio
                if done > s.rows[(L, "main")]:
                    pl.ensure(s.pages[L], done)

    def _inputs(self, st: StaticStore, seqs) -> None:
        """Positions, slots, page tables, the Engram history and the scratch rows of `seqs` into st's buffers
        (rows past len(seqs): the scratch sequence at position 0)."""
        pool, scratch = self.pool, self.pool.seqs[self._scratch]
        rows = list(seqs) + [scratch] * (st.rows - len(seqs))
        pos = torch.tensor([s.pos if i < len(seqs) else 0 for i, s in enumerate(rows)], dtype=torch.long)
        st.start.copy_(pos, non_blocking=True)
        st.slots.copy_(torch.tensor([s.slot for s in rows], dtype=torch.long), non_blocking=True)
        P = pool.page_size
        for L, table in st.tables.items():
            _update_table(table, st.table_keys[L], rows, L, pool.global_layers[L].page_epoch)
            st.scratch_rows[L].fill_(scratch.pages[L][0] * P)
        if st.history is not None:
            dead = torch.full((st.history.size(1),), DEAD, dtype=torch.long, device=self.device)
            st.history.copy_(torch.stack([dead if s.engram_history is None or i >= len(seqs)
                                          else s.engram_history.to(self.device) for i, s in enumerate(rows)]))

    def _engram_rows(self, bucket: _Bucket, ids: torch.Tensor) -> None:
        """The rows the step's Engram lookups read from host tables, into the bucket's device buffers before the
        replay: the step's hashes computed on the host (token ids and the rows' history, the bucket's buffers as
        `_inputs` filled them: one small read back, while the device is idle between steps), each table's rows
        gathered there and copied (only those bytes cross to the device; docs/model.md §9)."""
        tok = torch.zeros(bucket.ids.shape, dtype=torch.long)
        tok[:ids.size(0)] = ids.to("cpu")
        hist = bucket.store.history.to("cpu")
        hashes, _ = self._hasher(tok, hist)                                  # [Bp, 1, E, G]
        for e, (codes, scale) in zip(self._host_engrams, bucket.engram_rows):
            e.embed.stage(hashes[:, :, e.layer_index].reshape(-1), codes, scale)

    def _finish(self, bucket: _Bucket, seqs) -> None:
        """What the eager store records inside its writes: entries held, positions, the index-key publisher (the
        last index-key owner that wrote a key: every step for ratio 1, when a row completes a group for m > 1)
        and the Engram history."""
        pool = self.pool
        publisher = None
        for a in self._order:
            L = a.layer
            if L not in pool.global_layers:
                continue
            m = pool.global_layers[L].spec.ratio
            wrote = [s for s in seqs if (s.pos + 1) % m == 0]
            for s in wrote:
                for kind in KINDS:
                    s.rows[(L, kind)] = max(s.rows[(L, kind)], (s.pos + 1) // m)
            if wrote:
                pool.global_layers[L].version += 1
            if a.indexer is not None and (m == 1 or wrote):
                publisher = L
        hist = bucket.store.history
        for b, s in enumerate(seqs):
            s.pos += 1
            if publisher is not None:
                s.index_k_publisher = publisher
            if hist is not None:
                s.engram_history = hist[b].clone()

    # ------------------------------------------------------------------ capture
    def _storage(self) -> tuple:
        """Addresses of the pool's tensors a graph reads and writes (they move when the pool grows)."""
        pool = self.pool
        return (tuple(t.data_ptr() for pl in pool.global_layers.values() for t in pl.data.values()),
                tuple(t.data_ptr() for t in pool.swa.values()),
                tuple(t.data_ptr() for kv_sc in pool.pending.values() for t in kv_sc))

    def _ensure_graph(self, bucket: _Bucket) -> None:
        sig = self._storage()
        if sig != self.signature:                    # the pool grew: every graph points at freed tensors
            for b in self.buckets.values():
                b.graph = b.out = None
            self.signature = sig
        if bucket.graph is None:
            self._capture(bucket)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream, then capture on that same stream, with every row on the scratch sequence (the
        warm-up runs the step: its writes must land nowhere that matters); the caller loads the real rows
        afterwards. The same stream for both: per-stream state that a library creates on first use (cuBLAS's
        workspace) is then made by the warm-up, not inside the capture, where it broke the process's first capture
        (torch 2.11, H100: "use_count > 0 INTERNAL ASSERT" in the caching allocator; later captures worked)."""
        self._inputs(bucket.store, [])
        bucket.ids.zero_()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, stream=side):
            bucket.out = self._run(bucket)
        bucket.graph = graph
        self.captures += 1


def decode_graphs(model, pool, max_seq_len: int, cuda_graphs: bool | None) -> DecodeGraphs | None:
    """The engine's choice: None (eager decode steps) or a `DecodeGraphs`. cuda_graphs None: graphs on a CUDA
    device when `supports` allows, else eager; False: eager; True: the static step (captured on CUDA, its eager
    twin elsewhere), ValueError when the model cannot take it."""
    if cuda_graphs is False or (cuda_graphs is None and (pool.device.type != "cuda" or supports(model, pool))):
        return None
    return DecodeGraphs(model, pool, max_seq_len)
