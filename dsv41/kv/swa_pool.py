"""The SWA pool (docs/system.md §4): SWA-KV snapshots at the end of a prompt and the end of an output, kept for minutes.

    pool.get(key) -> bytes | None          a miss when absent, expired, or the pool is down / slow
    pool.put(key, data, ttl_s=None) -> bool
    pool.stats() -> counters

Two implementations behind one interface:

  MemorySwaPool(max_bytes, ttl_s, clock=time.monotonic)   in-process (the default; lives as long as the process):
      LRU by bytes under `max_bytes`, every entry expires `ttl_s` after its put (the clock is injectable).
  RedisSwaPool(urls, ttl_s, timeout_s)                     a Redis pool shared by machines: `SET key value PX ttl`,
      keys sharded over several Redis URLs by rendezvous hashing of the key (stable: every process maps a key to
      the same URL; adding a URL moves only the keys it wins). Redis itself should run with `maxmemory` and a
      `volatile-*` policy (every key has an expiry). A shard that errors or exceeds `timeout_s` is a miss; it is
      logged once and skipped for `retry_s` before being tried again; nothing raises to the caller.

`make_swa_pool("memory" | "redis://h:p[,redis://h2:p2]" | None)` builds one from a CLI string.

Values are opaque bytes; the prefix manager wraps them with the unit key and a checksum so that a wrong or damaged
value is never served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from contextlib import suppress

from dsv41.kv.counted import Counted

log = logging.getLogger("dsv41.kv.swa_pool")

DEFAULT_TTL_S = 600.0
COUNTERS = ("hits", "misses", "puts", "put_bytes", "evictions", "expired", "rejected", "errors")


def default_pool_bytes() -> int:
    """About 10% of host DRAM (docs/system.md §4); 1 GiB if it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class SwaPool(Counted):
    """Interface: bytes by key with a TTL. Implementations never raise on a storage fault."""

    ttl_s: float = DEFAULT_TTL_S
    kind: str = "none"

    def __init__(self) -> None:
        super().__init__(COUNTERS, log)

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, data: bytes, ttl_s: float | None = None) -> bool:
        raise NotImplementedError

    def stats(self) -> dict:
        with self._mu:
            return {"kind": self.kind, **self.counters}

    def close(self) -> None:
        pass


class MemorySwaPool(SwaPool):
    """In-process pool: LRU by bytes under `max_bytes`, TTL from each put (clock injectable). Thread-safe."""

    kind = "memory"

    def __init__(self, max_bytes: int | None = None, ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        super().__init__()
        self.max_bytes = default_pool_bytes() if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be positive")
        self.ttl_s, self.clock = float(ttl_s), clock
        self._items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()    # key -> (data, expiry); LRU first
        self._bytes = 0

    def _drop(self, key: str, counter: str | None) -> None:
        data, _ = self._items.pop(key)
        self._bytes -= len(data)
        if counter:
            self.counters[counter] += 1

    def _expire(self, now: float) -> None:
        for k in [k for k, (_, exp) in self._items.items() if exp <= now]:
            self._drop(k, "expired")

    def get(self, key: str) -> bytes | None:
        with self._mu:
            item = self._items.get(key)
            if item is not None and item[1] <= self.clock():
                self._drop(key, "expired")
                item = None
            if item is None:
                self.counters["misses"] += 1
                return None
            self._items.move_to_end(key)
            self.counters["hits"] += 1
            return item[0]

    def put(self, key: str, data: bytes, ttl_s: float | None = None) -> bool:
        data = bytes(data)
        ttl = self.ttl_s if ttl_s is None else float(ttl_s)
        with self._mu:
            if len(data) > self.max_bytes or ttl <= 0:
                self.counters["rejected"] += 1
                return False
            now = self.clock()
            if key in self._items:
                self._drop(key, None)
            self._expire(now)
            while self._bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._items)), "evictions")
            self._items[key] = (data, now + ttl)
            self._bytes += len(data)
            self.counters["puts"] += 1
            self.counters["put_bytes"] += len(data)
            return True

    def keys(self) -> list[str]:
        """Live keys, least recently used first (expired ones dropped)."""
        with self._mu:
            self._expire(self.clock())
            return list(self._items)

    def stats(self) -> dict:
        with self._mu:
            return {"kind": self.kind, **self.counters, "entries": len(self._items), "bytes": self._bytes,
                    "max_bytes": self.max_bytes, "ttl_s": self.ttl_s}


class RedisSwaPool(SwaPool):
    """Redis pool sharded over `urls` (redis-py). Down or slow shards are misses, logged once, retried after
    `retry_s`. Keys are stored under `prefix`."""

    kind = "redis"

    def __init__(self, urls: list[str] | str, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 0.25,
                 retry_s: float = 2.0, prefix: str = "dsv41:swa:", clock=time.monotonic):
        super().__init__()
        try:
            import redis                                 # redis-py; imported here so the package works without it
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ValueError("a Redis SWA pool needs redis-py: pip install redis") from None
        self._redis = redis
        self.urls = [u.strip() for u in (urls.split(",") if isinstance(urls, str) else urls) if u.strip()]
        if not self.urls:
            raise ValueError("RedisSwaPool needs at least one redis:// URL")
        if ttl_s <= 0 or timeout_s <= 0:
            raise ValueError("ttl_s and timeout_s must be positive")
        self.ttl_s, self.timeout_s, self.retry_s, self.prefix, self.clock = (
            float(ttl_s), float(timeout_s), float(retry_s), prefix, clock)
        # no client-side retries: a failed call is a miss at once and the shard rests for retry_s
        self._clients = [redis.Redis.from_url(u, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry_on_timeout=False, retry=Retry(NoBackoff(), 0))
                         for u in self.urls]
        self._down_until = [float("-inf")] * len(self.urls)
        self.counters.update(skipped_down=0)

    def shard(self, key: str) -> int:
        """Rendezvous (highest random weight) hashing: the URL whose sha256(url || key) is largest."""
        weights = [hashlib.sha256(u.encode() + b"\0" + key.encode()).digest() for u in self.urls]
        return max(range(len(self.urls)), key=weights.__getitem__)

    def _call(self, key: str, fn):
        """fn(the client of the key's shard), or None when that shard is marked down or fails."""
        i = self.shard(key)
        if self.clock() < self._down_until[i]:
            self._count("skipped_down")
            return None
        try:
            return fn(self._clients[i])
        except (self._redis.exceptions.RedisError, OSError) as e:
            self._down_until[i] = self.clock() + self.retry_s
            self._count("errors")
            self._log_once(i, "SWA pool %s unavailable (%s: %s): treating it as misses (logged once)", self.urls[i],
                           type(e).__name__, e)
            return None

    def get(self, key: str) -> bytes | None:
        v = self._call(key, lambda c: c.get(self.prefix + key))
        self._count("misses" if v is None else "hits")
        return None if v is None else bytes(v)

    def put(self, key: str, data: bytes, ttl_s: float | None = None) -> bool:
        ttl_ms = int(round(1000 * (self.ttl_s if ttl_s is None else float(ttl_s))))
        if ttl_ms <= 0:
            self._count("rejected")
            return False
        ok = self._call(key, lambda c: c.set(self.prefix + key, bytes(data), px=ttl_ms))
        if ok:
            self._count("puts")
            self._count("put_bytes", len(data))
        return bool(ok)

    def stats(self) -> dict:
        return {**super().stats(), "urls": list(self.urls),
                "shards_down": sum(self.clock() < t for t in self._down_until), "ttl_s": self.ttl_s}

    def close(self) -> None:
        for c in self._clients:
            with suppress(Exception):
                c.close()


def make_swa_pool(spec: str | None, ttl_s: float = DEFAULT_TTL_S, max_bytes: int | None = None,
                  timeout_s: float = 0.25) -> SwaPool | None:
    """None / "" / "none" -> no pool; "memory" -> MemorySwaPool; "redis://h:p[,redis://h2:p2,...]" (also rediss://,
    unix://) -> RedisSwaPool sharded over those URLs. ValueError for anything else."""
    if spec is None or spec.strip().lower() in ("", "none", "off"):
        return None
    if spec.strip().lower() == "memory":
        return MemorySwaPool(max_bytes, ttl_s)
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if urls and all(u.startswith(("redis://", "rediss://", "unix://")) for u in urls):
        return RedisSwaPool(urls, ttl_s, timeout_s)
    raise ValueError(f"--swa-pool must be 'memory' or redis://HOST:PORT[,redis://HOST:PORT...], got {spec!r}")
