"""The persistent tier (docs/system.md §4): a directory of entries, one file per prefix-unit key.

    store = DiskStore(dir, max_bytes, min_free_bytes, min_age_s, fingerprint=fp)
    store.put(key, payload, meta)      -> bool     (False: not persisted; never raises on storage faults)
    store.get(key) / get_entry(key)    -> payload / (meta, payload) or None (a miss)

Entry files `<key>.kv` (key: 64 lowercase hex) are laid out as `dsv41.kv.disk_format` says: a header with the
namespace fingerprint, the key, the lengths and a SHA-256 of the body, itself CRC-checked.

Writes are atomic (`dsv41.kv.disk_files.write_atomic`: a temp file `.tmp.<key>.<pid>.<random>` in the same
directory, written, fsync'd, renamed over `<key>.kv`, the directory fsync'd), then the file's mtime is set to the
store clock (mtime is the LRU recency; hits touch it). A reader therefore sees either no file or a complete one,
from any process.

Start-up scans the directory: every entry's header is read (not its payload) into the index, so the index survives
restarts; a header that is unreadable, inconsistent with the file size, or zero-length is a corrupt entry and is
removed; temp files of writers that are gone (dead pid, or older than `stale_tmp_s`) are removed. A `get` reads the
whole file and checks everything (magic, version, header CRC, key, fingerprint, lengths, SHA-256): any failure is a
miss, the file is removed (only if it is still the file that was read) and counted, nothing is served.
Entries of another fingerprint are left alone by the scan (another model may share the directory; they age out
under LRU) but are never served: a `get` that meets one removes it (`foreign_removed`).

Eviction: when a write would take the entries over `max_bytes`, or the file system's free space below
`min_free_bytes` (`shutil.disk_usage`), the writer takes an advisory `fcntl.flock` on `.lock`, rescans (other
processes write too), and removes entries in LRU order (mtime, then key) until the write fits; entries younger
than `min_age_s` (by their header's created time) and entries this process is writing or reading are never
evicted, and temp files are never entries. If the write still does not fit, it is skipped (`skipped_full`).
An OSError while writing (ENOSPC, EIO, ...) skips the write too (`write_errors`): the temp file is removed and
the caller gets False. Nothing here raises on a storage fault; ValueError only for bad arguments.

Several worker processes may share a directory: unique temp names, atomic renames, a flock around eviction, and
every path tolerates files appearing and disappearing underneath it (a vanished file is a miss). Each process's
in-memory byte total is refreshed by a rescan whenever it nears a limit and every `rescan_s` seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from dsv41.kv.counted import Counted
from dsv41.kv.disk_files import TMP_PREFIX, flock, fsync_dir, is_stale_tmp, read_file, tmp_name, write_atomic
from dsv41.kv.disk_format import (HEADER_BYTES, MAX_META, BadEntry, entry_header, fingerprint_bytes, parse_entry,
                                  parse_header)
from dsv41.kv.prefix import check_key

log = logging.getLogger("dsv41.kv.disk")

SUFFIX = ".kv"
LOCK_NAME = ".lock"
COUNTERS = ("hits", "misses", "writes", "bytes_written", "bytes_read", "evictions", "evicted_bytes",
            "corrupt_removed", "foreign_removed", "write_errors", "read_errors", "skipped_full",
            "skipped_too_large", "stale_tmp_removed", "dir_fsync_errors")


@dataclass
class _Info:
    size: int            # file bytes
    used_ns: int         # recency (file mtime, ns)
    created: float       # header: store clock at write
    fingerprint: bytes
    meta: bytes


def _entry_key(name: str) -> str | None:
    """The key of an entry file `<key>.kv`, or None for any other name."""
    if name.endswith(SUFFIX):
        with suppress(ValueError):
            return check_key(name[:-len(SUFFIX)])
    return None


class DiskStore(Counted):
    """One directory of prefix-unit entries (see the module docstring).

    dir             the directory (created if missing)
    max_bytes       cap on the bytes of entry files (headers included)
    min_free_bytes  free-space watermark of the file system: writes evict (or skip) to stay above it
    min_age_s       entries younger than this (store clock) are never evicted
    clock           wall-clock seconds (injectable for tests); it stamps created times and mtimes
    fingerprint     the namespace (64-hex) written into and required of entries; None: a read-only / admin
                    store that serves entries of any fingerprint (the `dsv41 cache` CLI) and cannot put
    durable         fsync file and directory (tests may turn it off for speed)
    disk_usage      `shutil.disk_usage`-like callable (injectable for tests)
    stale_tmp_s     temp files older than this are stale even if their writer's pid is alive (pid reuse)
    rescan_s        rescan the directory at least this often (store clock) when writing
    repair          remove corrupt entries and stale temp files met by scans (False: leave the directory
                    untouched, bad entries are just not indexed; for `dsv41 cache verify --keep`)
    """

    def __init__(self, dir: str | os.PathLike, max_bytes: int, min_free_bytes: int = 0, min_age_s: float = 0.0,
                 clock=time.time, *, fingerprint: str | None = None, durable: bool = True,
                 disk_usage=shutil.disk_usage, stale_tmp_s: float = 3600.0, rescan_s: float = 30.0,
                 repair: bool = True):
        if max_bytes <= 0 or min_free_bytes < 0 or min_age_s < 0:
            raise ValueError("max_bytes must be positive; min_free_bytes and min_age_s non-negative")
        super().__init__(COUNTERS, log)
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.min_free_bytes, self.min_age_s = int(max_bytes), int(min_free_bytes), float(min_age_s)
        self.clock, self.durable, self.disk_usage = clock, durable, disk_usage
        self.fingerprint = None if fingerprint is None else check_key(fingerprint)
        self._fp = fingerprint_bytes(self.fingerprint)
        self.stale_tmp_s, self.rescan_s, self.repair = float(stale_tmp_s), float(rescan_s), repair
        self._index: dict[str, _Info] = {}
        self._total = 0
        self._pinned: Counter = Counter()
        self._own_tmp: set[str] = set()
        # indirections for fault-injection tests (ENOSPC / EIO)
        self._os_write, self._os_fsync = os.write, os.fsync
        self._last_scan = float("-inf")
        self.refresh()

    # ---------------------------------------------------------------- paths and helpers
    def _path(self, key: str) -> Path:
        return self.dir / (key + SUFFIX)

    @contextmanager
    def _pin(self, key: str):
        with self._mu:
            self._pinned[key] += 1
        try:
            yield
        finally:
            with self._mu:
                self._pinned -= Counter((key,))      # drops the key at zero

    def _set_index(self, key: str, info: _Info | None) -> None:
        with self._mu:
            old = self._index.pop(key, None)
            if old is not None:
                self._total -= old.size
            if info is not None:
                self._index[key] = info
                self._total += info.size

    def _remove(self, key: str, counter: str, ino: int | None = None, used_ns: int | None = None) -> bool:
        """Unlink <key>.kv, drop it from the index and count it under `counter`; only if it is still inode `ino`
        and not used after `used_ns` (when given: a file rewritten or touched by another process meanwhile is
        kept)."""
        path = self._path(key)
        try:
            st = os.stat(path)
            if (ino is not None and st.st_ino != ino) or (used_ns is not None and st.st_mtime_ns > used_ns):
                return False                              # replaced or used meanwhile: keep it
            os.unlink(path)
        except FileNotFoundError:
            self._set_index(key, None)
            return False
        except OSError as e:
            self._log_once(("unlink", e.errno), "prefix cache %s: cannot remove %s (%s)", self.dir, path, e)
            return False
        self._set_index(key, None)
        self._count(counter)
        if counter == "evictions":
            self._count("evicted_bytes", st.st_size)
        return True

    def _read_info(self, key: str) -> _Info | None:
        """Header of <key>.kv as an index record; None if the file is gone; BadEntry if it is not an entry."""
        try:
            with open(self._path(key), "rb") as f:
                st = os.fstat(f.fileno())
                head = parse_header(f.read(HEADER_BYTES), key, st.st_size)
                meta = f.read(head.meta_len)
                if len(meta) != head.meta_len:
                    raise BadEntry("truncated meta")
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BadEntry(f"unreadable ({e})") from None
        except BadEntry as bad:
            bad.ino = st.st_ino                           # the file that was read (only it may be removed)
            raise
        return _Info(st.st_size, st.st_mtime_ns, head.created, head.fingerprint, meta)

    def _record(self, key: str, size: int, used: float, created: float, fingerprint: bytes, meta: bytes) -> None:
        """Index an entry just read or written; its recency (the file's mtime) is set to store time `used`."""
        ns = int(round(used * 1e9))
        with suppress(OSError):
            os.utime(self._path(key), ns=(ns, ns))
        self._set_index(key, _Info(size, ns, created, fingerprint, meta))

    def _drop_bad(self, key: str, bad: BadEntry) -> None:
        """Remove a corrupt entry met by a scan or a lookup (only the very file that was read)."""
        log.info("prefix cache %s: removing %s (%s)", self.dir, key + SUFFIX, bad.reason)
        if bad.ino is not None:
            self._remove(key, "corrupt_removed", bad.ino)

    # ---------------------------------------------------------------- scanning
    def refresh(self, full: bool = True, repair: bool | None = None) -> list[tuple[str, bytes]]:
        """Sync the index with the directory (pick up other processes' entries): new entries' headers read
        (corrupt ones removed), vanished ones dropped, stale temp files removed, and (full=True) every entry's size
        and recency refreshed from a stat. `repair` overrides the store's. Returns [(key, meta)] of entries new to
        this index."""
        repair = self.repair if repair is None else repair
        new: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        try:
            entries = list(os.scandir(self.dir))
        except OSError as e:
            self._log_once(("scan", e.errno), "prefix cache %s: cannot scan (%s)", self.dir, e)
            return new
        for de in entries:
            name = de.name
            try:
                if name.startswith(TMP_PREFIX):
                    if (repair and name not in self._own_tmp
                            and is_stale_tmp(name, de.stat().st_mtime, self.stale_tmp_s)):
                        os.unlink(de.path)
                        self._count("stale_tmp_removed")
                    continue
                key = _entry_key(name)
                if key is None:
                    continue
                if not full:
                    with self._mu:
                        if key in self._index:
                            seen.add(key)
                            continue
                st = de.stat()
            except OSError:                               # vanished (FileNotFoundError) or unreadable
                continue
            with self._mu:
                info = self._index.get(key)
                if info is not None and info.size == st.st_size:
                    info.used_ns = max(info.used_ns, st.st_mtime_ns)
                    seen.add(key)
                    continue
            try:
                info = self._read_info(key)
            except BadEntry as bad:
                if repair and bad.ino is not None:
                    self._drop_bad(key, bad)
                continue
            if info is not None:
                seen.add(key)
                self._set_index(key, info)
                new.append((key, info.meta))
        with self._mu:
            for key in [k for k in self._index if k not in seen and not self._pinned.get(k)]:
                self._set_index(key, None)
        self._last_scan = self.clock()
        return new

    # ---------------------------------------------------------------- reads
    def contains(self, key: str) -> bool:
        """Whether an entry file for `key` exists now (a header-valid one; its payload is checked on get)."""
        check_key(key)
        with self._mu:
            known = key in self._index
        if known and self._path(key).exists():
            return True
        try:
            info = self._read_info(key)
        except BadEntry as bad:
            self._drop_bad(key, bad)
            return False
        self._set_index(key, info)                        # None: drops an entry whose file vanished
        return info is not None

    def meta(self, key: str) -> bytes | None:
        with self._mu:
            info = self._index.get(key)
        return None if info is None else info.meta

    def get_entry(self, key: str) -> tuple[bytes, bytes] | None:
        """(meta, payload) of a fully checked entry, or None (a miss: absent, corrupt, truncated, foreign or
        unreadable; every bad file is removed and counted). Touches the entry's recency."""
        check_key(key)
        with self._pin(key):
            entry = self._read_entry(key)
        self._count("misses" if entry is None else "hits")
        return entry

    def _read_entry(self, key: str) -> tuple[bytes, bytes] | None:
        path = self._path(key)
        try:
            data, ino = read_file(path)
            head, meta, payload = parse_entry(data, key, self.fingerprint)
        except FileNotFoundError:
            self._set_index(key, None)
            return None
        except OSError as e:
            self._log_once(("read", e.errno), "prefix cache %s: read error (%s); treating as a miss", self.dir, e)
            self._count("read_errors")
            return None
        except BadEntry as bad:
            log.warning("prefix cache %s: entry %s is bad (%s): removed, not served", self.dir, path.name, bad.reason)
            if not self._remove(key, bad.counter, ino):
                self._count(bad.counter)                  # someone else removed or replaced it: still counted
            return None
        self._record(key, len(data), self.clock(), head.created, head.fingerprint, meta)
        self._count("bytes_read", len(data))
        return meta, payload

    def touch(self, keys: list[str]) -> None:
        """Mark indexed entries used now, in this order: each one's recency is a nanosecond after the previous
        one's, so LRU eviction takes them first to last even under a coarse or frozen clock."""
        base = int(round(self.clock() * 1e9))
        for i, key in enumerate(keys):
            with self._mu:
                info = self._index.get(key)
            if info is None:
                continue
            ns = base + i
            with suppress(OSError):
                os.utime(self._path(key), ns=(ns, ns))
                info.used_ns = ns

    def remove(self, key: str) -> bool:
        """Remove an entry (e.g. one whose payload its owner found unusable); counted as corrupt."""
        check_key(key)
        return self._remove(key, "corrupt_removed")

    def get(self, key: str) -> bytes | None:
        e = self.get_entry(key)
        return None if e is None else e[1]

    # ---------------------------------------------------------------- writes
    def _free(self) -> int:
        try:
            return int(self.disk_usage(self.dir).free)
        except OSError:
            return 1 << 62

    def _fits(self, total: int, free: int, size: int) -> bool:
        return total + size <= self.max_bytes and free - size >= self.min_free_bytes

    def _total_without(self, key: str) -> int:
        """Bytes of the indexed entries but `key`'s (which a write of `key` replaces)."""
        with self._mu:
            old = self._index.get(key)
            return self._total - (old.size if old else 0)

    def _lock_failed(self, e: OSError) -> None:
        self._log_once(("flock", e.errno), "prefix cache %s: cannot lock (%s); evicting without it", self.dir, e)

    def _make_room(self, key: str, size: int) -> bool:
        """Evict (LRU, under the directory lock) until an entry of `size` bytes fits; False if it cannot."""
        recent = self.clock() - self._last_scan < self.rescan_s
        if recent and self._fits(self._total_without(key), self._free(), size):
            return True
        with flock(self.dir / LOCK_NAME, self._lock_failed):
            self.refresh()
            with self._mu:
                total, free = self._total_without(key), self._free()
                now = self.clock()
                order = sorted((info.used_ns, k) for k, info in self._index.items()
                               if k != key and not self._pinned.get(k) and now - info.created >= self.min_age_s)
                plan = []
                for used, k in order:
                    if self._fits(total, free, size):
                        break
                    plan.append((k, used))
                    total -= self._index[k].size
                    free += self._index[k].size
            if not self._fits(total, free, size):
                self._count("skipped_full")
                self._log_once("full", "prefix cache %s: full (cap %d B, free-space watermark %d B, nothing old "
                               "enough to evict): not persisting", self.dir, self.max_bytes, self.min_free_bytes)
                return False
            for k, used in plan:
                self._remove(k, "evictions", used_ns=used)
            return True

    def put(self, key: str, payload, meta: bytes = b"") -> bool:
        """Persist one entry atomically; True when it is on disk. False (counted, logged once) when it does not
        fit (`skipped_full`, `skipped_too_large`) or the write failed (`write_errors`: ENOSPC, EIO, ...)."""
        check_key(key)
        if self.fingerprint is None:
            raise ValueError("this DiskStore has no fingerprint (admin mode): it cannot write entries")
        meta = bytes(meta)
        if len(meta) > MAX_META:
            raise ValueError(f"meta is {len(meta)} bytes, at most {MAX_META}")
        payload = memoryview(payload).cast("B")
        size = HEADER_BYTES + len(meta) + len(payload)
        if size > self.max_bytes:
            self._count("skipped_too_large")
            return False
        with self._pin(key):
            try:
                if not self._make_room(key, size):
                    return False
                created = self.clock()
                self._write_atomic(key, entry_header(key, self._fp, meta, payload, created), meta, payload)
            except OSError as e:
                self._count("write_errors")
                self._log_once(("write", e.errno), "prefix cache %s: write failed (%s): not persisting (further "
                               "errors of this kind are counted, not logged)", self.dir, e)
                return False
            self._record(key, size, created, created, self._fp, meta)
            self._count("writes")
            self._count("bytes_written", size)
            return True

    def _write_atomic(self, key: str, *parts) -> None:
        """`write_atomic` of <key>.kv through a temp file this process owns meanwhile (scans leave it alone)."""
        tmp = self.dir / tmp_name(key)
        with self._mu:
            self._own_tmp.add(tmp.name)
        try:
            write_atomic(tmp, self._path(key), parts, self.durable, self._os_write, self._os_fsync)
        finally:
            with self._mu:
                self._own_tmp.discard(tmp.name)
        if self.durable:
            e = fsync_dir(self.dir, self._os_fsync)
            if e is not None:
                self._count("dir_fsync_errors")
                self._log_once(("dirsync", e.errno), "prefix cache %s: directory fsync failed (%s)", self.dir, e)

    # ---------------------------------------------------------------- operations
    def keys(self) -> list[str]:
        with self._mu:
            return list(self._index)

    def stats(self) -> dict:
        free = self._free()
        with self._mu:
            return {**self.counters, "entries": len(self._index), "bytes": self._total, "max_bytes": self.max_bytes,
                    "min_free_bytes": self.min_free_bytes, "min_age_s": self.min_age_s, "free_bytes": free}

    def entry_files(self) -> list[str]:
        """Keys of every `<key>.kv` file in the directory now (valid or not)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(k for k in map(_entry_key, names) if k is not None)

    def describe(self) -> list[dict]:
        """Indexed entries: key, size, created (store clock), last used (mtime), fingerprint (hex), meta (bytes)."""
        with self._mu:
            return [{"key": k, "size": i.size, "created": i.created, "used": i.used_ns / 1e9,
                     "fingerprint": i.fingerprint.hex(), "meta": i.meta} for k, i in self._index.items()]

    def verify(self, remove: bool = True) -> dict:
        """Read every entry file in full and check it (header, lengths, key, SHA-256; the fingerprint too when this
        store has one). Bad entries are reported and, with remove=True, removed (stale temp files too)."""
        report = {"checked": 0, "ok": 0, "ok_bytes": 0, "bad": [], "removed": 0, "fingerprints": {}}
        for key in self.entry_files():
            try:
                data, ino = read_file(self._path(key))
            except FileNotFoundError:
                continue
            except OSError as e:
                report["bad"].append({"key": key, "reason": f"unreadable ({e})"})
                continue
            report["checked"] += 1
            try:
                fp = parse_entry(data, key, self.fingerprint)[0].fingerprint.hex()
            except BadEntry as bad:
                report["bad"].append({"key": key, "reason": bad.reason})
                if remove and self._remove(key, bad.counter, ino):
                    report["removed"] += 1
                continue
            report["fingerprints"][fp] = report["fingerprints"].get(fp, 0) + 1
            report["ok"] += 1
            report["ok_bytes"] += len(data)
        if remove:
            self.refresh(repair=True)
        return report

    def clear(self) -> dict:
        """Remove every entry file, valid or not (and stale temp files; those of live writers are left to them)."""
        removed = freed = 0
        for key in self.entry_files():
            path = self._path(key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except OSError:
                continue
            removed += 1
            freed += size
        with self._mu:
            self._index.clear()
            self._total = 0
        self.refresh(repair=True)
        return {"removed": removed, "bytes": freed}
