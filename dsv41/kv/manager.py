"""`PrefixCache`: the two persistence tiers behind one facade (docs/system.md §4).

    cache = PrefixCache.from_config(cfg, weights_id, tokenizer_id, cache_dir=DIR, swa_pool="memory",
                                    hasher=model.engram_hasher)
    hit = cache.lookup(prompt_ids, max_len=len(prompt_ids))          # before prefill
    if hit: pool.import_global(sid, hit.global_state); if hit.swa_state: pool.import_swa(sid, hit.swa_state)
    ...
    cache.save(ids_processed, upto=pos, global_state=pool.export_global(sid, pos, start=cache.export_start(...)),
               swa_state=pool.export_swa(sid, extras={"logits": last_logits}))   # end of prompt, end of output

Storage: segments shared by the units that cover them. Units follow `dsv41.kv.prefix`: interval units (every
`interval` tokens) and tail units (an extra boundary U hanging off the last interval unit before it). Each unit is
one `DiskStore` entry, under its key, holding only the segment of global KV between the nearest stored boundary
below it on the same token path and U: a `GlobalState` covering start..U-1, with the compressor carry and Engram
history at U when U ends a save. Its meta names that lower boundary's key (the link), so a prefix at U is the join
of the segments along the links from U down to 0. Every position of a token path is stored once however many
units cover it: an end-of-prompt unit at P, then the end-of-output unit at O > P store 0..P and P..O (not 0..O
again), and the interval unit at I*k between them stores only its own piece. Prompts sharing a prefix share every
segment below their last common boundary. A start need not be a multiple of the compression ratios: an entry
belongs to the segment holding its group's last position (`GlobalState.slice`), and the carry a segment holds for
its own end is dropped when it is read as an inner part.

Entry meta (88 bytes, little-endian): magic b"DSPU", kind (u8: 0 interval, 1 tail), version (u8) = 2, reserved
(u16), start (u64), boundary U (u64), chain parent (32 bytes: C_{j-1} for interval unit j, C_j for a tail off C_j),
link (32 bytes: the key of the unit at start; zeros when start is 0). A reader checks every field against the keys
it computes from the request's own tokens, so a unit is only ever joined to segments of the same token path.

How lookup finds boundaries (O(units), not O(tokens^2)). Interval boundaries are known (multiples of I): one pass
over the request's tokens computes C_1..C_J (a hash of each block), and the longest run C_1..C_j present on disk
(one stat each) bounds every hit (a save writes every interval unit below its boundary). Extra boundaries (end of
prompt / output) are arbitrary positions, so the cache keeps a boundary index: parent key -> set of tail offsets,
built from the entries' metas when the store is scanned at start-up and refreshed (new entries of other processes)
at most every `refresh_s`; for each present C_j the lookup hashes only the tails recorded under it. Candidates are
tried longest first: the longest unit whose segments all load and check wins (a segment evicted under a unit makes
that unit a miss and a shorter one is tried; segments loaded for one candidate are reused for the next).

How a save picks segments. It walks the boundaries of its path in ascending order (the interval ones, the tails the
index knows, its own U): a stored unit whose meta checks and whose link is a boundary already found usable is
usable; a required boundary (every interval one up to U, and U) that is not is written as the segment from the
highest usable boundary below it. `export_start` runs the same walk without writing, so the caller exports only
from the first segment it needs. Two writers of one unit each write a complete, self-consistent entry (the last
rename wins); a unit whose link was evicted is rewritten by the next save through it. After a hit or a save the
path's entries are touched leaf first, so LRU eviction takes a path's deepest segments before the ones they need.

SWA snapshots live in the SWA pool under the unit's key, wrapped as magic b"DSWE" || unit key (32 bytes) ||
SHA-256 of the payload (32 bytes) || `SwaState` bytes, so a damaged, truncated or misfiled value is a miss.

Adoption rules (docs/system.md §4): a hit no longer than `n_win` tokens is not adopted. A hit covering the whole request
(U == len(token_ids)) is adopted only with an SWA snapshot carrying the extra "logits" (the last position's logits:
nothing is left to prefill that would produce them); otherwise the next shorter unit is tried.

Nothing here raises on a storage fault: lookups degrade to misses, saves to not persisting; both are counted
(`stats()`). ValueError is raised only for arguments that are wrong (a programming error in the caller).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import struct
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from dsv41.kv.counted import Counted
from dsv41.kv.disk import DiskStore
from dsv41.kv.state_format import GlobalState, SwaState
from dsv41.kv.prefix import (DEFAULT_INTERVAL, chain_keys, check_key, encode_ids, engram_history_at,
                             fingerprint as make_fingerprint, ratio_align, tail_key)
from dsv41.kv.swa_pool import SwaPool, make_swa_pool

log = logging.getLogger("dsv41.kv.manager")

UNIT_META = struct.Struct("<4sBBHQQ32s32s")       # 88 bytes: see the module docstring
_UNIT_MAGIC = b"DSPU"
_UNIT_VERSION = 2
_NO_LINK = bytes(32)                              # the link of a segment starting at 0
KIND_INTERVAL, KIND_TAIL = 0, 1
SWA_ENVELOPE = struct.Struct("<4s32s32s")         # magic, unit key, sha256(payload)
_SWA_MAGIC = b"DSWE"
COUNTERS = ("lookups", "hits", "hits_swa", "misses", "short_hits", "hit_tokens", "saves", "units_written",
            "unit_bytes_written", "units_existing", "save_gaps", "bad_units", "swa_puts", "swa_bad", "errors")


class UnitMeta(NamedTuple):
    kind: int
    start: int
    boundary: int
    parent: bytes
    link: bytes


def parse_unit_meta(meta) -> UnitMeta | None:
    """The fields of a unit entry's meta, or None for anything that is not one of this layout version (another
    program's entry, an older layout: such units are misses and the next save through them rewrites them)."""
    if not meta or len(meta) != UNIT_META.size:
        return None
    magic, kind, version, _, start, boundary, parent, link = UNIT_META.unpack(meta)
    if magic != _UNIT_MAGIC or version != _UNIT_VERSION or kind not in (KIND_INTERVAL, KIND_TAIL):
        return None
    if not start < boundary or (start == 0) != (link == _NO_LINK):
        return None
    return UnitMeta(kind, start, boundary, parent, link)


@dataclass(eq=False)
class Hit:
    """A usable cached prefix: tokens[:boundary]. `global_state` starts at 0 (import with `import_global`);
    `swa_state` is the exact SWA snapshot at `boundary` or None (then the engine replays). `tiers`: cached tokens
    per tier."""
    boundary: int
    global_state: GlobalState
    swa_state: SwaState | None
    tiers: dict[str, int] = field(default_factory=dict)
    key: str = ""

    @property
    def path(self) -> str:
        """"swa-hit" (exact resume) or "replay" (Encoder SWA Bounded Replay of the last n_win cached tokens)."""
        return "swa-hit" if self.swa_state is not None else "replay"


def _disk_defaults(cache_dir, max_bytes, min_free_bytes) -> tuple[int, int]:
    try:
        total = shutil.disk_usage(cache_dir).total
    except OSError:
        total = 1 << 40
    return (max(1, total // 2) if max_bytes is None else max_bytes,
            min(total // 20, 8 << 30) if min_free_bytes is None else min_free_bytes)


class PrefixCache(Counted):
    """Prefix caching over a persistent tier (global KV, `DiskStore`) and an SWA pool (`SwaPool`).

    fingerprint     the namespace (`dsv41.kv.prefix.fingerprint`)
    cache_dir       the persistent tier's directory (None: no caching; every lookup misses)
    swa_pool        a `SwaPool`, or "memory" / "redis://..." (`make_swa_pool`), or None (every hit replays)
    interval        fixed unit interval in tokens; a positive multiple of `align`
    n_win           hits of at most this many tokens are not adopted (the window, cfg.window_size)
    align           the least common multiple of the compression ratios (`dsv41.kv.prefix.ratio_align(cfg)`)
    max_bytes, min_free_bytes, min_age_s, clock, durable   the `DiskStore`'s (defaults: half the file system,
                    min(5% of it, 8 GiB) free, 300 s minimum age, time.time)
    hasher          the model's `NgramHasher` (model.engram_hasher): fills in the Engram history of hits whose
                    unit carries none (interval units); None for models without Engram
    refresh_s       rescan the directory for other processes' units at most this often
    """

    def __init__(self, fingerprint: str, cache_dir=None, swa_pool: SwaPool | str | None = None, *,
                 interval: int = DEFAULT_INTERVAL, n_win: int = 128, align: int = 1, max_bytes: int | None = None,
                 min_free_bytes: int | None = None, min_age_s: float = 300.0, clock=time.time, hasher=None,
                 refresh_s: float = 2.0, durable: bool = True):
        super().__init__(COUNTERS, log)
        self.fp = check_key(fingerprint)
        if interval <= 0 or align <= 0 or interval % align:
            raise ValueError(f"interval {interval} must be a positive multiple of {align} (the compression ratios)")
        if n_win < 0:
            raise ValueError("n_win must be >= 0")
        self.interval, self.n_win, self.align = int(interval), int(n_win), int(align)
        self.clock, self.hasher, self.refresh_s = clock, hasher, float(refresh_s)
        self._extras: dict[bytes, set[int]] = {}          # parent chain key -> tail offsets (the boundary index)
        self._last_refresh = float("-inf")
        self.disk = None
        if cache_dir is not None:
            self.disk = DiskStore(cache_dir, *_disk_defaults(cache_dir, max_bytes, min_free_bytes), min_age_s, clock,
                                  fingerprint=self.fp, durable=durable)
            self._note_metas((key, self.disk.meta(key)) for key in self.disk.keys())
        self.swa = make_swa_pool(swa_pool) if isinstance(swa_pool, str) else swa_pool   # its TTL: DEFAULT_TTL_S
        self.device = None          # the engine's device tier (`dsv41.kv.device_tier`), for its stats only

    @classmethod
    def from_config(cls, cfg, weights_id: str, tokenizer_id: str, **kw) -> "PrefixCache":
        """A cache for a model config: fingerprint of (cfg, weights, tokenizer, KV layout), n_win =
        cfg.window_size, align = lcm of the compression ratios; other keywords as the constructor's."""
        kw.setdefault("n_win", cfg.window_size)
        kw.setdefault("align", ratio_align(cfg))
        return cls(make_fingerprint(cfg, weights_id, tokenizer_id), **kw)

    # ---------------------------------------------------------------- bookkeeping
    def _guarded(self, what: str, consequence: str, fn, *args):
        """fn(*args), or None after an unexpected error the operation degrades on (storage trouble of any kind, or
        a pool that raised although it must not): to a miss, to not persisting. Counted under "errors", logged once
        per operation and exception type."""
        try:
            return fn(*args)
        except Exception as e:
            self._count("errors")
            self._log_once((what, type(e).__name__), "%s failed (%s: %s): %s", what, type(e).__name__, e,
                           consequence)
            return None

    def _note_metas(self, entries) -> None:
        """Record the tail units among (key, meta) entries (the store's at start-up, then those each refresh finds
        new) in the boundary index; metas not ours are ignored."""
        for _key, meta in entries:
            f = parse_unit_meta(meta)
            if f is not None and f.kind == KIND_TAIL and f.boundary % self.interval:
                with self._mu:
                    self._extras.setdefault(f.parent, set()).add(f.boundary % self.interval)
        self._last_refresh = self.clock()

    def _drop_tail(self, chain: list[bytes], U: int) -> None:
        """Forget tail boundary U of this path in the boundary index (its entry is gone or unusable)."""
        if U % self.interval:
            with self._mu:
                self._extras.get(chain[U // self.interval], set()).discard(U % self.interval)

    # ---------------------------------------------------------------- keys along one token path
    def _key_at(self, chain: list[bytes], ids, b: int) -> bytes:
        """The key of the unit ending at boundary b of this path (chain: C_0..C_J with J >= b // interval)."""
        j = b // self.interval
        return chain[j] if b % self.interval == 0 else tail_key(chain[j], ids[j * self.interval:b])

    def _expected(self, chain: list[bytes], U: int) -> tuple[int, bytes]:
        """(kind, chain parent) a unit ending at U must carry in its meta."""
        j = U // self.interval
        return (KIND_INTERVAL, chain[j - 1]) if U % self.interval == 0 else (KIND_TAIL, chain[j])

    def _check_meta(self, meta, chain: list[bytes], ids, U: int, links: dict[int, bytes] | None = None):
        """The unit meta of the entry ending at U if it belongs to this path, else None. Its link must be the key
        of its start on this path (`links`: boundary -> key of the boundaries allowed as a start; None: any)."""
        f = parse_unit_meta(meta)
        if f is None or f.boundary != U or (f.kind, f.parent) != self._expected(chain, U):
            return None
        if links is not None:
            return f if links.get(f.start) == f.link else None
        return f if f.link == (self._key_at(chain, ids, f.start) if f.start else _NO_LINK) else None

    # ---------------------------------------------------------------- loading
    def _load_unit(self, chain: list[bytes], ids, U: int) -> GlobalState | None:
        """The segment of the unit ending at U on this path, fully checked (store checksum, meta, link, layout,
        positions), or None (absent: a miss; unusable: removed and counted)."""
        key = self._key_at(chain, ids, U)
        entry = self.disk.get_entry(key.hex())
        if entry is None:
            self._drop_tail(chain, U)
            return None
        meta, payload = entry
        try:
            f = self._check_meta(meta, chain, ids, U)
            if f is None:
                raise ValueError("unit meta does not match its key's position and path")
            st = GlobalState.from_bytes(payload)
            if st.start != f.start or st.upto != U:
                raise ValueError(f"unit covers {st.start}..{st.upto}, expected {f.start}..{U}")
        except ValueError as e:
            self._count("bad_units")
            log.warning("prefix cache: unit %s is unusable (%s): removed", key.hex()[:16], e)
            self.disk.remove(key.hex())
            self._drop_tail(chain, U)
            return None
        return st

    def _resolve(self, chain: list[bytes], ids, U: int, loaded: dict) -> list[GlobalState] | None:
        """The segments of the prefix at U in position order, following the links down to 0, or None when one is
        missing or unusable. `loaded`: boundary -> segment (or None), shared by the candidates of one lookup."""
        parts, b = [], U
        while b > 0:
            if b not in loaded:
                loaded[b] = self._load_unit(chain, ids, b)
            if loaded[b] is None:
                return None
            parts.append(loaded[b])
            b = loaded[b].start
        return parts[::-1]

    def _swa_get(self, key: bytes, boundary: int) -> SwaState | None:
        raw = None if self.swa is None else self._guarded("SWA pool get", "a miss", self.swa.get, key.hex())
        if raw is None:
            return None
        try:
            if len(raw) < SWA_ENVELOPE.size:
                raise ValueError("truncated")
            magic, k, digest = SWA_ENVELOPE.unpack_from(raw)
            body = memoryview(raw)[SWA_ENVELOPE.size:]
            if magic != _SWA_MAGIC or k != key or hashlib.sha256(body).digest() != digest:
                raise ValueError("envelope check failed")
            st = SwaState.from_bytes(body)
            if st.pos != boundary:
                raise ValueError(f"snapshot at {st.pos}, unit ends at {boundary}")
        except ValueError as e:
            self._count("swa_bad")
            self._log_once(("swa-bad",), "SWA pool value for %s is unusable (%s): a miss", key.hex()[:16], e)
            return None
        return st

    # ---------------------------------------------------------------- lookup
    def _stored_run(self, chain: list[bytes]) -> int:
        """The largest j such that the interval units 1..j of the chain C_0..C_J are all on disk."""
        j = 0
        while j + 1 < len(chain) and self.disk.contains(chain[j + 1].hex()):
            j += 1
        return j

    def lookup(self, token_ids, max_len: int | None = None, salt: str | None = None) -> Hit | None:
        """The longest cached unit U <= min(max_len, len(token_ids)), U > n_win, whose tokens are token_ids[:U]
        (see the module docstring) in the namespace of `salt` (`prefix.root_key`), or None. Never raises on
        storage faults."""
        ids = encode_ids(token_ids)
        self._count("lookups")
        limit = len(ids) if max_len is None else min(len(ids), int(max_len))
        hit = self._guarded("prefix cache lookup", "a miss", self._lookup, ids, limit, salt)
        if hit is None:
            self._count("misses")
        else:
            self._count("hits")
            self._count("hit_tokens", hit.boundary)
            if hit.swa_state is not None:
                self._count("hits_swa")
        return hit

    def _lookup(self, ids, limit: int, salt: str | None) -> Hit | None:
        if self.disk is None or limit <= self.n_win:
            return None
        if self.clock() - self._last_refresh >= self.refresh_s:
            self._note_metas(self.disk.refresh(full=False))
        I = self.interval
        chain = chain_keys(self.fp, ids, I, limit, salt)
        jmax = self._stored_run(chain)
        with self._mu:
            tails = {j * I + off for j in range(jmax + 1) for off in self._extras.get(chain[j], ())}
        cands = {j * I for j in range(1, jmax + 1)} | {U for U in tails if U <= limit}
        adoptable = sorted((U for U in cands if U > self.n_win), reverse=True)
        if cands and not adoptable:
            self._count("short_hits")
        loaded: dict[int, GlobalState | None] = {}
        for U in adoptable:                               # longest first
            parts = self._resolve(chain, ids, U, loaded)
            if parts is None:
                continue
            key = self._key_at(chain, ids, U)
            swa = self._swa_get(key, U)
            if U == len(ids) and (swa is None or "logits" not in swa.extras):
                continue                                  # nothing left to prefill: needs the stored logits
            state = GlobalState.join([p.records_only() for p in parts[:-1]] + parts[-1:])
            if state.engram_history is None and self.hasher is not None:
                state.engram_history = engram_history_at(self.hasher, ids, U)
            self._touch_path(chain, ids, [p.upto for p in parts])
            return Hit(U, state, swa, {"disk": U, "swa": U if swa is not None else 0}, key.hex())
        return None

    def swa_at(self, token_ids, upto: int, salt: str | None = None) -> SwaState | None:
        """The SWA snapshot of the unit ending at `upto` of these tokens, from the SWA pool alone (no disk read:
        the device tier's hits take the global KV from the pool), or None. Never raises on storage faults."""
        ids = encode_ids(token_ids)
        if self.swa is None or not 0 < upto <= len(ids):
            return None
        chain = chain_keys(self.fp, ids, self.interval, upto, salt)
        return self._guarded("SWA snapshot lookup", "a miss", self._swa_get, self._key_at(chain, ids, upto), upto)

    def _touch_path(self, chain: list[bytes], ids, bounds: list[int]) -> None:
        """Mark the units ending at `bounds` (one path, ascending) used, the deepest first: under LRU a path's
        longer units are evicted before the segments they need."""
        self.disk.touch([self._key_at(chain, ids, b).hex() for b in reversed(bounds)])

    # ---------------------------------------------------------------- save
    def export_start(self, token_ids, upto: int, salt: str | None = None) -> int:
        """The first position `save(token_ids, upto, ...)` needs the global state to cover: the start of the first
        segment it would write (see the module docstring), rounded down to a multiple of every ratio. Pass it as
        `start` to `PackedKVPool.export_global` to skip copying what is stored; 0 is always correct."""
        if self.disk is None:
            return 0
        ids, upto = encode_ids(token_ids), int(upto)
        if not 0 < upto <= len(ids):
            return 0
        plan = self._guarded("prefix cache export_start", "exporting from 0",
                             lambda: self._plan(ids, upto, chain_keys(self.fp, ids, self.interval, upto, salt)))
        if plan is None:
            return 0
        first = plan[0][0][0] if plan[0] else upto
        return first - first % self.align

    def _plan(self, ids, upto: int, chain: list[bytes]):
        """(writes, existing, path, links): the segments a save of the unit at `upto` writes, [(start, boundary)]
        ascending; the number of required units already stored; the boundaries of the prefix at `upto` after the
        save (ascending, down from upto along the links); boundary -> key of every usable boundary after the
        save, 0 included (its link value). Reads metas only."""
        I = self.interval
        with self._mu:
            tails = {j * I + off for j in range(upto // I + 1) for off in self._extras.get(chain[j], ())}
        required = set(range(I, upto + 1, I)) | {upto}
        links: dict[int, bytes] = {0: _NO_LINK}           # usable boundary -> its key (the link to it)
        via: dict[int, int] = {}                           # usable boundary -> its segment's start
        writes, existing = [], 0
        for b in sorted(required | {t for t in tails if t < upto}):
            key = self._key_at(chain, ids, b)
            f = self._check_meta(self.disk.meta(key.hex()), chain, ids, b, links) \
                if self.disk.contains(key.hex()) else None
            if f is not None:
                existing += b in required
                via[b] = f.start
            elif b in required:
                via[b] = max(links)
                writes.append((via[b], b))
            else:
                continue
            links[b] = key
        path, b = [], upto
        while b > 0:
            path.append(b)
            b = via[b]
        return writes, existing, path[::-1], links

    def save(self, token_ids, upto: int, global_state: GlobalState, swa_state: SwaState | None = None,
             salt: str | None = None) -> dict:
        """Persist the unit ending at `upto` (token_ids[:upto] are the tokens the sequence processed): the interval
        units up to it not yet stored, its tail unit, and the SWA snapshot (if given) in the SWA pool. Returns
        {"units_written", "bytes", "swa"}; never raises on storage faults (ValueError for inconsistent
        arguments: a state not ending at upto, an SWA snapshot at another position)."""
        ids = encode_ids(token_ids)
        upto = int(upto)
        if not 0 < upto <= len(ids):
            raise ValueError(f"save: upto {upto} outside 1..{len(ids)}")
        if global_state.upto != upto:
            raise ValueError(f"save: the global state ends at {global_state.upto}, not at upto {upto}")
        if swa_state is not None and swa_state.pos != upto:
            raise ValueError(f"save: the SWA snapshot is at {swa_state.pos}, not at upto {upto}")
        out = {"units_written": 0, "bytes": 0, "swa": False}
        if self.disk is None:
            return out
        self._count("saves")
        self._guarded("prefix cache save", "not persisted", self._save, ids, upto, global_state, swa_state, out, salt)
        return out

    def _put_unit(self, chain: list[bytes], seg: GlobalState, links: dict[int, bytes], out: dict) -> bool:
        key = links[seg.upto]
        kind, parent = self._expected(chain, seg.upto)
        data = seg.to_bytes()
        meta = UNIT_META.pack(_UNIT_MAGIC, kind, _UNIT_VERSION, 0, seg.start, seg.upto, parent, links[seg.start])
        if not self.disk.put(key.hex(), data, meta):
            return False
        out["units_written"] += 1
        out["bytes"] += len(data)
        self._count("units_written")
        self._count("unit_bytes_written", len(data))
        return True

    def _save(self, ids, upto: int, gs: GlobalState, swa: SwaState | None, out: dict, salt: str | None) -> None:
        I = self.interval
        chain = chain_keys(self.fp, ids, I, upto, salt)
        writes, existing, path, links = self._plan(ids, upto, chain)
        self._count("units_existing", existing)
        for start, b in writes:
            if start < gs.start:
                self._count("save_gaps")                  # evicted since export_start: the rest is unreachable
                return
            if not self._put_unit(chain, gs.slice(start, b), links, out):
                return
        if upto % I:
            with self._mu:
                self._extras.setdefault(chain[upto // I], set()).add(upto % I)
        self._touch_path(chain, ids, path)
        key = self._key_at(chain, ids, upto)
        if swa is not None and self.swa is not None:
            body = swa.to_bytes()
            env = SWA_ENVELOPE.pack(_SWA_MAGIC, key, hashlib.sha256(body).digest()) + body
            if self._guarded("SWA pool put", "not persisted", self.swa.put, key.hex(), env):
                out["swa"] = True
                self._count("swa_puts")

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Counters of the facade and its tiers: {"cache": {...}, "device": {...} | None, "disk": {...} | None,
        "swa": {...} | None} (device: the pages an engine keeps in its pool, `dsv41.kv.device_tier`)."""
        with self._mu:
            cache = {**self.counters, "boundary_index_tails": sum(len(v) for v in self._extras.values())}
        return {"cache": cache, "device": None if self.device is None else self.device.stats(),
                "disk": None if self.disk is None else self.disk.stats(),
                "swa": None if self.swa is None else self.swa.stats()}

    def metrics(self) -> dict[str, int | float]:
        """Flat numeric counters for a /metrics endpoint (prefix_cache_*, prefix_disk_*, prefix_swa_*)."""
        return {f"prefix_{tier}_{k}": v for tier, d in self.stats().items() for k, v in (d or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def close(self) -> None:
        if self.swa is not None:
            self.swa.close()
