"""`PrefixCache`: the two persistence tiers behind one facade (docs/system.md §4).

    cache = PrefixCache.from_config(cfg, weights_id, tokenizer_id, cache_dir=DIR, swa_pool="memory",
                                    hasher=model.engram_hasher)
    hit = cache.lookup(prompt_ids, max_len=len(prompt_ids))          # before prefill
    if hit: pool.import_global(sid, hit.global_state); if hit.swa_state: pool.import_swa(sid, hit.swa_state)
    ...
    cache.save(ids_processed, upto=pos, global_state=pool.export_global(sid, pos, start=cache.export_start(...)),
               swa_state=pool.export_swa(sid, extras={"logits": last_logits}))   # end of prompt, end of output

Storage. Units follow `dsv41.kv.prefix`: interval units (every `interval` tokens) and tail units (an extra boundary
U hanging off the last interval unit before it). Each unit is one `DiskStore` entry holding only its own segment of
global KV, a `GlobalState` covering positions start..U-1 (start = the previous interval boundary), with the
compressor carry and Engram history at U when it ends a save. A prefix at U is the join of interval units
1..floor(U/I) and, when U is not a multiple of I, its tail unit: the bytes on disk grow linearly with the tokens
cached (not quadratically), and prompts sharing a prefix share its interval units.

Entry meta (56 bytes, little-endian): magic b"DSPU", kind (u8: 0 interval, 1 tail), version (u8) = 1, reserved
(u16), start (u64), boundary U (u64), parent key (32 bytes: C_{j-1} for interval unit j, C_j for a tail off C_j).

How lookup finds boundaries (O(units), not O(tokens^2)). Interval boundaries are known (multiples of I): one pass
over the request's tokens computes C_1..C_J (a hash of each block), and the longest run C_1..C_j present on disk
(one stat each) bounds every hit. Extra boundaries (end of prompt / output) are arbitrary positions, so the cache
keeps a boundary index: parent key -> set of tail offsets, built from the entries' metas when the store is scanned
at start-up and refreshed (new entries of other processes) at most every `refresh_s`; for each present C_j the
lookup hashes only the tails recorded under it. Candidates are tried longest first: the longest unit whose
segments all load and check wins.

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

from dsv41.kv.counted import Counted
from dsv41.kv.disk import DiskStore
from dsv41.kv.state_format import GlobalState, SwaState
from dsv41.kv.prefix import (DEFAULT_INTERVAL, chain_keys, check_key, encode_ids, engram_history_at,
                             fingerprint as make_fingerprint, ratio_align, tail_key)
from dsv41.kv.swa_pool import SwaPool, make_swa_pool

log = logging.getLogger("dsv41.kv.manager")

UNIT_META = struct.Struct("<4sBBHQQ32s")          # 56 bytes: see the module docstring
_UNIT_MAGIC = b"DSPU"
_UNIT_VERSION = 1
KIND_INTERVAL, KIND_TAIL = 0, 1
SWA_ENVELOPE = struct.Struct("<4s32s32s")         # magic, unit key, sha256(payload)
_SWA_MAGIC = b"DSWE"
COUNTERS = ("lookups", "hits", "hits_swa", "misses", "short_hits", "hit_tokens", "saves", "units_written",
            "unit_bytes_written", "units_existing", "save_gaps", "bad_units", "swa_puts", "swa_bad", "errors")


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
        self.interval, self.n_win = int(interval), int(n_win)
        self.clock, self.hasher, self.refresh_s = clock, hasher, float(refresh_s)
        self._extras: dict[bytes, set[int]] = {}          # parent chain key -> tail offsets (the boundary index)
        self._last_refresh = float("-inf")
        self.disk = None
        if cache_dir is not None:
            self.disk = DiskStore(cache_dir, *_disk_defaults(cache_dir, max_bytes, min_free_bytes), min_age_s, clock,
                                  fingerprint=self.fp, durable=durable)
            self._note_metas((key, self.disk.meta(key)) for key in self.disk.keys())
        self.swa = make_swa_pool(swa_pool) if isinstance(swa_pool, str) else swa_pool   # its TTL: DEFAULT_TTL_S

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
            if not meta or len(meta) != UNIT_META.size:
                continue
            magic, kind, version, _, start, boundary, parent = UNIT_META.unpack(meta)
            off = boundary - start
            if (magic == _UNIT_MAGIC and version == _UNIT_VERSION and kind == KIND_TAIL and 0 < off < self.interval
                    and start % self.interval == 0):
                with self._mu:
                    self._extras.setdefault(parent, set()).add(int(off))
        self._last_refresh = self.clock()

    # ---------------------------------------------------------------- loading
    def _load_unit(self, key: bytes, kind: int, start: int, boundary: int, parent: bytes) -> GlobalState | None:
        """The segment of one unit, fully checked (store checksum, meta, layout, positions), or None."""
        entry = self.disk.get_entry(key.hex())
        if entry is None:
            return None
        meta, payload = entry
        try:
            if meta != UNIT_META.pack(_UNIT_MAGIC, kind, _UNIT_VERSION, 0, start, boundary, parent):
                raise ValueError("unit meta does not match its key's position")
            st = GlobalState.from_bytes(payload)
            if st.start != start or st.upto != boundary:
                raise ValueError(f"unit covers {st.start}..{st.upto}, expected {start}..{boundary}")
        except ValueError as e:
            self._count("bad_units")
            log.warning("prefix cache: unit %s is unusable (%s): removed", key.hex()[:16], e)
            self.disk.remove(key.hex())
            return None
        return st

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
            tails = [(j * I + off, j) for j in range(jmax + 1) for off in self._extras.get(chain[j], ())]
        cands = [(j * I, j, chain[j]) for j in range(1, jmax + 1)]      # (U, j, unit key)
        cands += [(U, j, tail_key(chain[j], ids[j * I:U])) for U, j in tails if U <= limit]
        adoptable = sorted((c for c in cands if c[0] > self.n_win), reverse=True)
        if cands and not adoptable:
            self._count("short_hits")
        segs: list[GlobalState] = []                      # interval units 1..len(segs), up to the first unusable
        for k in range(1, max((j for _, j, _ in adoptable), default=0) + 1):
            st = self._load_unit(chain[k], KIND_INTERVAL, (k - 1) * I, k * I, chain[k - 1])
            if st is None:
                break
            segs.append(st)
        for U, j, key in adoptable:                       # longest first
            if j > len(segs):
                continue
            parts = segs[:j]
            if U != j * I:
                tail = self._load_unit(key, KIND_TAIL, j * I, U, chain[j])
                if tail is None:
                    with self._mu:
                        self._extras.get(chain[j], set()).discard(U - j * I)
                    continue
                parts.append(tail)
            swa = self._swa_get(key, U)
            if U == len(ids) and (swa is None or "logits" not in swa.extras):
                continue                                  # nothing left to prefill: needs the stored logits
            state = GlobalState.join(parts)
            if state.engram_history is None and self.hasher is not None:
                state.engram_history = engram_history_at(self.hasher, ids, U)
            return Hit(U, state, swa, {"disk": U, "swa": U if swa is not None else 0}, key.hex())
        return None

    # ---------------------------------------------------------------- save
    def export_start(self, token_ids, upto: int, salt: str | None = None) -> int:
        """The first position `save(token_ids, upto, ...)` needs the global state to cover: the end of the run of
        interval units already on disk (a multiple of every ratio). Pass it as `start` to
        `PackedKVPool.export_global` to skip copying what is stored; 0 is always correct."""
        if self.disk is None:
            return 0
        run = self._guarded("prefix cache export_start", "exporting from 0",
                            lambda: self._stored_run(chain_keys(self.fp, encode_ids(token_ids), self.interval, upto,
                                                                salt)))
        return 0 if run is None else run * self.interval

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

    def _put_unit(self, key: bytes, seg: GlobalState, kind: int, parent: bytes, out: dict) -> bool:
        data = seg.to_bytes()
        meta = UNIT_META.pack(_UNIT_MAGIC, kind, _UNIT_VERSION, 0, seg.start, seg.upto, parent)
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
        J = upto // I
        for j in range(1, J + 1):
            if self.disk.contains(chain[j].hex()):
                self._count("units_existing")
                continue
            s0 = (j - 1) * I
            if gs.start > s0:
                self._count("save_gaps")                  # evicted since export_start: the rest is unreachable
                return
            if not self._put_unit(chain[j], gs.slice(s0, j * I), KIND_INTERVAL, chain[j - 1], out):
                return
        key = chain[J]
        if upto % I:
            key = tail_key(chain[J], ids[J * I:upto])
            if self.disk.contains(key.hex()):
                self._count("units_existing")
            elif not self._put_unit(key, gs.slice(J * I, upto), KIND_TAIL, chain[J], out):
                return
            with self._mu:
                self._extras.setdefault(chain[J], set()).add(upto - J * I)
        if swa is not None and self.swa is not None:
            body = swa.to_bytes()
            env = SWA_ENVELOPE.pack(_SWA_MAGIC, key, hashlib.sha256(body).digest()) + body
            if self._guarded("SWA pool put", "not persisted", self.swa.put, key.hex(), env):
                out["swa"] = True
                self._count("swa_puts")

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Counters of the facade and both tiers: {"cache": {...}, "disk": {...} | None, "swa": {...} | None}."""
        with self._mu:
            cache = {**self.counters, "boundary_index_tails": sum(len(v) for v in self._extras.values())}
        return {"cache": cache, "disk": None if self.disk is None else self.disk.stats(),
                "swa": None if self.swa is None else self.swa.stats()}

    def metrics(self) -> dict[str, int | float]:
        """Flat numeric counters for a /metrics endpoint (prefix_cache_*, prefix_disk_*, prefix_swa_*)."""
        return {f"prefix_{tier}_{k}": v for tier, d in self.stats().items() for k, v in (d or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def close(self) -> None:
        if self.swa is not None:
            self.swa.close()
