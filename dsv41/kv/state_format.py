"""The exported states of the packed KV store and their binary layouts (prefix caching, docs/system.md §4).

`PackedKVPool.export_global(sid, upto)` returns a `GlobalState` (the packed records of positions < upto per
KV-source layer, the compressor carry at upto, the Engram history, the index-key publisher) and `import_global`
loads one into a fresh sequence; `export_swa` / `import_swa` do the same for every SWA ring (`SwaState`). Both
states serialise to the documented little-endian layouts below (`to_bytes` / `from_bytes`; no pickle);
`dsv41.kv.manager` persists them. A sequence restored from both continues bit-identically to the one exported.

Binary layouts (little-endian throughout, no padding, no pickle). Readers reject a wrong magic, an unknown
layout version, a length that does not add up or trailing bytes (ValueError).

GlobalState, layout version 1:
  offset size  field
  0      4     magic b"DSGK"
  4      2     layout version (u16) = 1
  6      2     flags (u16): bit 0 Engram history present, bit 1 index-key publisher present
  8      8     start (u64): first position covered (0 for a whole prefix, a multiple of every ratio otherwise)
  16     8     upto (u64): positions covered end here (exclusive)
  24     4     index-key publisher layer (i32, -1 when absent)
  28     4     number of layer blocks (u32)
  32     4     Engram history length h (u32; 0 when absent)
  36     4     reserved (0)
  40     8h    Engram history (i64 [h]): compressed ids of positions upto-h..upto-1, -1 = DEAD
  then per KV-source layer, in ascending layer order, a 32-byte block header
         4     layer (u32)      4 ratio m (u32)       4 entries n (u32) = upto//m - start//m
         4     main record bytes b_m (u32)            4 index record bytes b_i (u32)
         4     carry rows r (u32) = m when m > 1 and upto % m != 0, else 0   4 width C (u32)   4 reserved (0)
  followed by main records (u8 [n, b_m]), index records (u8 [n, b_i]), carry kv (f32 [r, C]), carry score
  (f32 [r, C]).

SwaState, layout version 1:
  0      4     magic b"DSSW"
  4      2     layout version (u16) = 1
  6      2     reserved (0)
  8      8     pos (u64): the position the rings stand at
  16     4     number of rings (u32)
  20     4     number of extras (u32)
  then per layer (ascending): layer (u32), rows W (u32), row bytes (u32), reserved (u32), ring bytes u8 [W, row]
  then per extra (sorted by name): name length k (u16), dtype code (u8: 0 f32, 1 i64), ndim d (u8), name (utf-8,
  k bytes), d dims (u64 each), data (element size * prod(dims) bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch

GLOBAL_LAYOUT_VERSION = 1
SWA_LAYOUT_VERSION = 1
_GLOBAL_MAGIC = b"DSGK"
_SWA_MAGIC = b"DSSW"
_G_HEAD = struct.Struct("<4sHHQQiIII")
_G_LAYER = struct.Struct("<IIIIIIII")
_S_HEAD = struct.Struct("<4sHHQII")
_S_LAYER = struct.Struct("<IIII")
_S_EXTRA = struct.Struct("<HBB")
_U8, _F32, _I64 = np.dtype("u1"), np.dtype("<f4"), np.dtype("<i8")
_EXTRA_DTYPES = {0: _F32, 1: _I64}                 # an extra's dtype code -> its element layout


def carry_rows(ratio: int, upto: int) -> int:
    """Rows of a layer's compressor carry in a state ending at `upto`: the whole m-slot slab while a group is open
    (ratio m > 1, upto % m != 0), else none."""
    return ratio if ratio > 1 and upto % ratio else 0


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

    def header(self, st: struct.Struct, magic: bytes, version: int) -> list:
        """The fields after the magic and the layout version of header `st`; ValueError for another magic or
        version."""
        got_magic, got_version, *fields = self.unpack(st)
        if got_magic != magic:
            raise ValueError(f"{self.what}: bad magic {bytes(got_magic)!r}")
        if got_version != version:
            raise ValueError(f"{self.what}: layout version {got_version}, this reader knows {version}")
        return fields

    def tensor(self, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        raw = self.take(count * dtype.itemsize)
        return torch.from_numpy(np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy())

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
    """The persistent tier's unit of state (docs/system.md §4): global-KV records of positions start..upto-1 plus what
    resuming at `upto` needs (compressor carry, Engram history, index-key publisher). Binary layout: the module
    docstring."""
    start: int
    upto: int
    layers: list[GlobalLayerState]
    engram_history: torch.Tensor | None = None      # int64 [n-1] at `upto`, or None (not known)
    index_k_publisher: int | None = None

    def to_bytes(self) -> bytes:
        hist = self.engram_history
        flags = (1 if hist is not None else 0) | (2 if self.index_k_publisher is not None else 0)
        layers = sorted(self.layers, key=lambda ls: ls.layer)
        parts = [_G_HEAD.pack(_GLOBAL_MAGIC, GLOBAL_LAYOUT_VERSION, flags, self.start, self.upto,
                              -1 if self.index_k_publisher is None else self.index_k_publisher, len(layers),
                              0 if hist is None else hist.numel(), 0)]
        if hist is not None:
            parts.append(_le_bytes(hist.reshape(-1).to(torch.int64), _I64))
        for ls in layers:
            n, r = ls.main.size(0), ls.carry_kv.size(0)
            if ls.index.size(0) != n or ls.carry_score.shape != ls.carry_kv.shape:
                raise ValueError(f"global state layer {ls.layer}: inconsistent record / carry shapes")
            parts.append(_G_LAYER.pack(ls.layer, ls.ratio, n, ls.main.size(1), ls.index.size(1), r,
                                       ls.carry_kv.size(1), 0))
            parts += [_le_bytes(ls.main, _U8), _le_bytes(ls.index, _U8), _le_bytes(ls.carry_kv, _F32),
                      _le_bytes(ls.carry_score, _F32)]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data) -> "GlobalState":
        rd = _Reader(data, "global state")
        flags, start, upto, publisher, n_layers, h, _ = rd.header(_G_HEAD, _GLOBAL_MAGIC, GLOBAL_LAYOUT_VERSION)
        if start > upto or (not flags & 1 and h):
            raise ValueError("global state: inconsistent header")
        hist = rd.tensor(_I64, (h,)) if flags & 1 else None
        layers = []
        for _ in range(n_layers):
            layer, m, n, bm, bi, r, C, _ = rd.unpack(_G_LAYER)
            if m == 0 or n != upto // m - start // m or r != carry_rows(m, upto):
                raise ValueError(f"global state layer {layer}: entry/carry counts do not match positions "
                                 f"{start}..{upto} at ratio {m}")
            layers.append(GlobalLayerState(layer, m, rd.tensor(_U8, (n, bm)), rd.tensor(_U8, (n, bi)),
                                           rd.tensor(_F32, (r, C)), rd.tensor(_F32, (r, C))))
        rd.done()
        return cls(start, upto, layers, hist, publisher if flags & 2 else None)

    # ---------------------------------------------------------------- segments
    def slice(self, start: int, upto: int) -> "GlobalState":
        """The segment of positions start..upto-1 (self.start <= start <= upto <= self.upto). An entry belongs to
        the segment holding its group's last position (entries start//m .. upto//m - 1), so `start` may be any
        position: segments cut at a position that is not a multiple of m still partition the entries. `upto`
        must be a multiple of every ratio unless it is self.upto (entries of a group open at upto are not
        formed yet). The carry and the Engram history belong to self.upto and are kept only when upto ==
        self.upto."""
        if not self.start <= start <= upto <= self.upto:
            raise ValueError(f"slice {start}..{upto} outside {self.start}..{self.upto}")
        ratios = {ls.ratio for ls in self.layers}
        if upto != self.upto and any(upto % m for m in ratios):
            raise ValueError(f"slice {start}..{upto}: upto must be a multiple of every ratio {sorted(ratios)}")
        end = upto == self.upto
        layers = []
        for ls in self.layers:
            m, base = ls.ratio, self.start // ls.ratio
            e0, e1 = start // m - base, upto // m - base
            r = ls.carry_kv.size(0) if end else 0
            layers.append(GlobalLayerState(ls.layer, m, ls.main[e0:e1].clone(), ls.index[e0:e1].clone(),
                                           ls.carry_kv[:r].clone(), ls.carry_score[:r].clone()))
        return GlobalState(start, upto, layers, self.engram_history if end else None, self.index_k_publisher)

    def records_only(self) -> "GlobalState":
        """The same records without what resuming at `upto` needs (carry, Engram history): a segment read as
        the inner part of a longer prefix, where that state of its end is never used."""
        layers = [GlobalLayerState(ls.layer, ls.ratio, ls.main, ls.index, ls.carry_kv[:0], ls.carry_score[:0])
                  for ls in self.layers]
        return GlobalState(self.start, self.upto, layers, None, self.index_k_publisher)

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
        return GlobalState(parts[0].start, last.upto, layers, last.engram_history, last.index_k_publisher)


@dataclass(eq=False)
class SwaState:
    """Every layer's SWA ring (packed FP8 bytes, backbone and DSpark stages) at position `pos`, plus named extras
    (fp32 / int64 tensors the engine stores with it). Binary layout: the module docstring."""
    pos: int
    rings: dict[int, torch.Tensor]                   # layer -> uint8 [W, row bytes]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        parts = [_S_HEAD.pack(_SWA_MAGIC, SWA_LAYOUT_VERSION, 0, self.pos, len(self.rings), len(self.extras))]
        for L in sorted(self.rings):
            ring = self.rings[L]
            if ring.dtype != torch.uint8 or ring.dim() != 2:
                raise ValueError(f"SWA ring {L} must be uint8 [W, row bytes]")
            parts += [_S_LAYER.pack(L, ring.size(0), ring.size(1), 0), _le_bytes(ring, _U8)]
        for name in sorted(self.extras):
            t = self.extras[name]
            code = int(t.dtype == torch.int64)
            t = t if code else t.float()              # fp32 as is; bf16 / fp16 values are exact in fp32
            raw = name.encode("utf-8")
            if len(raw) > 0xFFFF or t.dim() > 255:
                raise ValueError(f"SWA extra {name!r}: name or rank too large")
            parts += [_S_EXTRA.pack(len(raw), code, t.dim()), raw,
                      struct.pack(f"<{t.dim()}Q", *t.shape), _le_bytes(t, _EXTRA_DTYPES[code])]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data) -> "SwaState":
        rd = _Reader(data, "SWA state")
        _, pos, n_rings, n_extras = rd.header(_S_HEAD, _SWA_MAGIC, SWA_LAYOUT_VERSION)
        rings = {}
        for _ in range(n_rings):
            L, W, row, _ = rd.unpack(_S_LAYER)
            rings[L] = rd.tensor(_U8, (W, row))
        extras = {}
        for _ in range(n_extras):
            k, code, d = rd.unpack(_S_EXTRA)
            if code not in _EXTRA_DTYPES:
                raise ValueError(f"SWA state: unknown extra dtype code {code}")
            name = bytes(rd.take(k)).decode("utf-8")
            extras[name] = rd.tensor(_EXTRA_DTYPES[code], struct.unpack(f"<{d}Q", rd.take(8 * d)))
        rd.done()
        return cls(pos, rings, extras)
