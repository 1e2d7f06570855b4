"""The SWA pool (`dsv41.kv.swa_pool`): the embedded pool's LRU-by-bytes and TTL against a reference model with a
fake clock (hypothesis); the Redis pool on a real redis-server (started by `tests/redis_service.py` on a loopback
port): SET PX expiry, sharding over several servers, a server stopped mid-run is a miss logged once, never an
exception, and the pool recovers when the server returns."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import given, settings, strategies as st

from dsv41.kv.swa_pool import MemorySwaPool, RedisSwaPool, make_swa_pool
from redis_service import RedisService, SkipUnavailable, redis_server  # noqa: E402  (tests/ is on sys.path)


# ------------------------------------------------------------------------------------------ embedded pool

OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 400), st.sampled_from([None, 5.0, 30.0])),
    st.tuples(st.just("get"), st.integers(0, 7), st.just(0), st.just(None)),
    st.tuples(st.just("tick"), st.integers(0, 20), st.just(0), st.just(None))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, max_bytes=st.integers(1, 1200), ttl=st.sampled_from([1.0, 10.0, 100.0]))
def test_memory_pool_is_lru_by_bytes_with_ttl(ops, max_bytes, ttl):
    now = [0.0]
    pool = MemorySwaPool(max_bytes, ttl, clock=lambda: now[0])
    model: dict[int, tuple[bytes, float]] = {}                    # insertion order = LRU order
    for op, k, n, t in ops:
        if op == "tick":
            now[0] += k
        elif op == "get":
            item = model.get(k)
            if item is not None and item[1] <= now[0]:
                del model[k]
                item = None
            got = pool.get(str(k))
            assert got == (None if item is None else item[0])
            if item is not None:
                model[k] = model.pop(k)                            # most recently used
        else:
            data = bytes([k]) * n
            ok = pool.put(str(k), data, t)
            assert ok == (n <= max_bytes)
            if ok:
                model.pop(k, None)
                for kk in [kk for kk, (_, exp) in model.items() if exp <= now[0]]:
                    del model[kk]
                while sum(len(v) for v, _ in model.values()) + n > max_bytes:
                    del model[next(iter(model))]
                model[k] = (data, now[0] + (ttl if t is None else t))
        live = [str(kk) for kk, (_, exp) in model.items() if exp > now[0]]
        assert pool.keys() == live
        assert pool.stats()["bytes"] <= max_bytes


def test_memory_pool_ttl_expiry_exact_edges():
    now = [100.0]
    pool = MemorySwaPool(1000, ttl_s=10.0, clock=lambda: now[0])
    pool.put("a", b"x")
    now[0] = 109.999
    assert pool.get("a") == b"x"
    now[0] = 110.0
    assert pool.get("a") is None
    s = pool.stats()
    assert s["expired"] == 1 and s["hits"] == 1 and s["misses"] == 1 and s["entries"] == 0


def test_make_swa_pool():
    assert make_swa_pool(None) is None and make_swa_pool("none") is None
    assert isinstance(make_swa_pool("memory"), MemorySwaPool)
    p = make_swa_pool("redis://127.0.0.1:1,redis://127.0.0.1:2", timeout_s=0.05)
    assert isinstance(p, RedisSwaPool) and p.urls == ["redis://127.0.0.1:1", "redis://127.0.0.1:2"]
    with pytest.raises(ValueError):
        make_swa_pool("memcached://x")


def test_redis_pool_down_from_the_start_is_a_miss_not_an_error(caplog):
    """No server at all (a closed loopback port): misses and failed puts, one log line, no exception."""
    from redis_service import free_port

    pool = RedisSwaPool([f"redis://127.0.0.1:{free_port()}"], ttl_s=5, timeout_s=0.1, retry_s=0.0)
    with caplog.at_level(logging.WARNING, logger="dsv41.kv.swa_pool"):
        for i in range(5):
            assert pool.put(f"k{i}", b"v") is False
            assert pool.get(f"k{i}") is None
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    s = pool.stats()
    assert s["errors"] == 10 and s["misses"] == 5 and s["puts"] == 0


def test_redis_pool_slow_server_is_a_miss(caplog):
    """A server that accepts connections and never answers (hung): each call waits at most timeout_s, then the
    shard is skipped for retry_s; misses, no exception, one log line."""
    import socket

    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    try:
        pool = RedisSwaPool([f"redis://127.0.0.1:{lst.getsockname()[1]}"], ttl_s=5, timeout_s=0.1, retry_s=30.0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dsv41.kv.swa_pool"):
            for i in range(10):
                assert pool.get(f"k{i}") is None
                assert pool.put(f"k{i}", b"v") is False
        assert time.monotonic() - t0 < 2.0                         # one timeout, then skipped while down
        s = pool.stats()
        assert s["errors"] == 1 and s["skipped_down"] == 19 and s["shards_down"] == 1
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    finally:
        lst.close()


# ------------------------------------------------------------------------------------------ Redis pool

@pytest.fixture(scope="module")
def redis_srv():
    try:
        with redis_server() as srv:
            yield srv
    except SkipUnavailable as e:
        pytest.skip(f"Redis unavailable: {e}")


def test_redis_set_px_get_and_expiry(redis_srv):
    import redis

    pool = RedisSwaPool([redis_srv.url], ttl_s=30, timeout_s=1.0)
    assert pool.put("abc", b"\x00snapshot\xff" * 100)
    assert pool.get("abc") == b"\x00snapshot\xff" * 100
    raw = redis.Redis.from_url(redis_srv.url)
    ttl_ms = raw.pttl("dsv41:swa:abc")
    assert 0 < ttl_ms <= 30_000                                    # SET ... PX
    assert pool.put("short", b"v", ttl_s=0.15)
    assert pool.get("short") == b"v"
    time.sleep(0.3)
    assert pool.get("short") is None                               # expired by Redis
    assert pool.get("never") is None
    s = pool.stats()
    assert s["hits"] == 2 and s["misses"] == 2 and s["errors"] == 0
    raw.close()
    pool.close()


def test_redis_sharding_over_several_servers(redis_srv):
    import redis

    second = RedisService()
    second.start()
    try:
        urls = [redis_srv.url, second.url]
        pool = RedisSwaPool(urls, ttl_s=30, timeout_s=1.0, prefix="shardtest:")
        again = RedisSwaPool(list(reversed(urls)), ttl_s=30, timeout_s=1.0, prefix="shardtest:")
        keys = [f"{i:064x}" for i in range(40)]
        for k in keys:
            assert pool.put(k, k.encode())
        clients = [redis.Redis.from_url(u) for u in urls]
        where = [[bool(c.exists("shardtest:" + k)) for c in clients] for k in keys]
        assert all(sum(w) == 1 for w in where)                     # every key on exactly one shard
        assert 5 <= sum(w[0] for w in where) <= 35                 # and both shards used
        for k in keys:                                             # stable: URL order does not matter
            assert urls[pool.shard(k)] == again.urls[again.shard(k)]
            assert again.get(k) == k.encode()
        for c in clients:
            c.close()
    finally:
        second.close()


def test_redis_server_stopped_mid_run(redis_srv, caplog):
    srv = RedisService()
    srv.start()
    try:
        pool = RedisSwaPool([srv.url], ttl_s=30, timeout_s=0.2, retry_s=0.2)
        assert pool.put("k1", b"one") and pool.get("k1") == b"one"
        srv.stop()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dsv41.kv.swa_pool"):
            for _ in range(20):
                assert pool.get("k1") is None                      # a miss, never an exception
                assert pool.put("k2", b"two") is False
        assert time.monotonic() - t0 < 5.0                         # a down shard is skipped, not waited on
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
        s = pool.stats()
        assert s["errors"] >= 1 and s["misses"] == 20 and s["errors"] + s["skipped_down"] == 40
        srv.start()                                                # the server returns (empty: no persistence)
        time.sleep(0.25)
        assert pool.put("k3", b"three") and pool.get("k3") == b"three"
        pool.close()
    finally:
        srv.close()


def test_redis_helper_says_why_when_it_cannot_install(monkeypatch):
    import redis_service

    monkeypatch.setenv("DSV41_NO_INSTALL", "1")
    assert "not installed" in redis_service._install_redis_server()
    monkeypatch.delenv("DSV41_NO_INSTALL")
    monkeypatch.setattr(redis_service.shutil, "which", lambda _name: None)
    assert "apt-get is not available" in redis_service._install_redis_server()
