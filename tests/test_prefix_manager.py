"""`PrefixCache` end to end on the random debug model (window 8 = n_win, interval 16): a multi-turn continuation
and a regenerate resume exactly from the SWA snapshot (bit-identical logits); without a snapshot (pool dropped,
new process) the hit is the replay path with the exact global state; the longest unit wins; short hits are not
adopted; lookups cost O(units); storage faults degrade to shorter hits or misses, never to a wrong state, and
never raise."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dsv41.config import load_config
from dsv41.kv.accounting import fill_random
from dsv41.kv.manager import PrefixCache
from dsv41.kv.pool import PackedKVPool
from dsv41.kv.prefix import chain_keys, engram_history_at, fingerprint
from dsv41.kv.swa_pool import MemorySwaPool, RedisSwaPool
from dsv41.model.init import random_model
from redis_service import RedisService, unavailable_reason  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def debug():
    cfg = load_config("debug")
    return cfg, random_model(cfg, seed=11)


def new_cache(cfg, model, d, swa="memory", **kw):
    kw = {"interval": I, "hasher": model.engram_hasher, "min_age_s": 0.0, "durable": False, "refresh_s": 0.0, **kw}
    return PrefixCache.from_config(cfg, "weights", "tok", cache_dir=d, swa_pool=swa, **kw)


def toks(cfg, n, seed):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


class Turn:
    """One conversation on a pool sequence: prefill, greedy decode, and the saves an engine makes."""

    def __init__(self, model, pool):
        self.model, self.pool = model, pool
        self.sid = pool.new_sequence()
        self.ids: list[int] = []                   # tokens the sequence has processed
        self.logits = None

    @torch.no_grad()
    def feed(self, ids):
        ids = torch.as_tensor(ids).view(1, -1)
        r = self.model(ids, self.pool.bind([self.sid]))
        self.ids += ids[0].tolist()
        self.logits = r.logits[0, -1]
        return r.logits

    def decode(self, steps):
        out = []
        for _ in range(steps):
            out.append(self.feed([int(self.logits.argmax())]))
        return out

    def save(self, cache, with_swa=True, logits=True):
        pos = len(self.ids)
        start = cache.export_start(self.ids, pos)
        g = self.pool.export_global(self.sid, pos, start=start)
        s = self.pool.export_swa(self.sid, extras={"logits": self.logits} if logits else None) if with_swa else None
        return cache.save(self.ids, pos, g, s)

    def ref_prefix(self, upto):
        """The exact global state of this sequence's first `upto` tokens (upto a multiple of 2 or the position)."""
        hist = None if upto == len(self.ids) else engram_history_at(self.model.engram_hasher, self.ids, upto)
        return self.pool.export_global(self.sid, upto, engram_history=hist).to_bytes()


def resume(model, pool, hit):
    t = Turn(model, pool)
    pool.import_global(t.sid, hit.global_state)
    if hit.swa_state is not None:
        pool.import_swa(t.sid, hit.swa_state)
    return t


# ------------------------------------------------------------------------------------------ exact resume

def test_multi_turn_continuation_is_an_exact_swa_hit(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    a = Turn(model, pool)
    p1 = toks(cfg, 37, 1)
    a.feed(p1)
    assert a.save(cache)["units_written"] == 3                   # units 0-16, 16-32 and the tail 32-37
    a.decode(5)
    out_end = len(a.ids)                                          # 42: end of output
    r = a.save(cache)
    assert r["units_written"] == 1 and r["swa"]                   # only the new tail 32-42
    p2 = a.ids + [int(a.logits.argmax())] + toks(cfg, 6, 2).tolist()   # next turn: output + a new message
    ref = [a.feed(p2[out_end:])] + a.decode(3)

    hit = cache.lookup(p2, max_len=len(p2))
    assert hit is not None and hit.boundary == out_end and hit.path == "swa-hit"
    assert hit.tiers == {"disk": out_end, "swa": out_end}
    b = resume(model, pool, hit)
    got = [b.feed(p2[out_end:])] + b.decode(3)
    for x, y in zip(ref, got):
        assert torch.equal(x, y)


def test_regenerate_same_prompt_resumes_from_stored_logits(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    p = toks(cfg, 37, 3)
    a = Turn(model, pool)
    a.feed(p)
    a.save(cache)
    first = a.logits.clone()
    ref = a.decode(4)
    hit = cache.lookup(p, max_len=len(p))                         # the whole prompt: needs the stored logits
    assert hit.boundary == 37 and hit.path == "swa-hit"
    assert torch.equal(hit.swa_state.extras["logits"], first)
    b = resume(model, pool, hit)
    b.logits = hit.swa_state.extras["logits"]
    for x, y in zip(ref, b.decode(4)):
        assert torch.equal(x, y)


def test_whole_prompt_without_logits_falls_back_to_a_shorter_unit(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    p = toks(cfg, 37, 4)
    a = Turn(model, pool)
    a.feed(p)
    a.save(cache, logits=False)
    hit = cache.lookup(p, max_len=len(p))
    assert hit.boundary == 32 and hit.path == "replay" and hit.tiers == {"disk": 32, "swa": 0}
    assert hit.global_state.to_bytes() == a.ref_prefix(32)        # Engram history filled in by the hasher
    assert cache.lookup(p, max_len=36).boundary == 32
    longer = p.tolist() + [5, 6]
    assert cache.lookup(longer).boundary == 37                    # with tokens left to prefill: the tail unit


# ------------------------------------------------------------------------------------------ replay path

def test_new_process_without_swa_pool_gets_the_replay_path(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    a = Turn(model, pool)
    a.feed(toks(cfg, 45, 5))
    a.save(cache)
    query = a.ids + [1, 2, 3]
    want = hashlib.sha256(a.ref_prefix(45)).hexdigest()
    code = ("import sys, json, hashlib, torch; from dsv41.config import load_config;"
            "from dsv41.kv.manager import PrefixCache; from dsv41.model.init import random_model;"
            "cfg = load_config('debug'); m = random_model(cfg, seed=11);"
            "c = PrefixCache.from_config(cfg, 'weights', 'tok', cache_dir=sys.argv[1], interval=16,"
            " hasher=m.engram_hasher, swa_pool='memory');"
            "h = c.lookup(json.loads(sys.argv[2]));"
            "print(json.dumps([h.boundary, h.path, h.tiers, hashlib.sha256(h.global_state.to_bytes()).hexdigest()]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), json.dumps(query)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=180)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [45, "replay", {"disk": 45, "swa": 0}, want]


def test_dropped_swa_snapshot_is_replay_with_exact_global_state(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    now = [0.0]
    swa = MemorySwaPool(1 << 20, ttl_s=60, clock=lambda: now[0])
    cache = new_cache(cfg, model, tmp_path, swa=swa)
    a = Turn(model, pool)
    a.feed(toks(cfg, 29, 6))
    a.save(cache)
    q = a.ids + [7]
    assert cache.lookup(q).path == "swa-hit"
    now[0] = 61.0                                                 # the snapshot's TTL ran out
    hit = cache.lookup(q)
    assert hit.path == "replay" and hit.boundary == 29 and hit.global_state.to_bytes() == a.ref_prefix(29)
    assert swa.stats()["expired"] == 1


# ------------------------------------------------------------------------------------------ boundaries

def test_short_hits_are_not_adopted_and_longest_wins(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    a = Turn(model, pool)
    a.feed(toks(cfg, 8, 7))                                       # 8 = n_win: not worth adopting
    a.save(cache)
    assert cache.lookup(a.ids + [1, 2]) is None
    assert cache.stats()["cache"]["short_hits"] == 1
    a.feed(toks(cfg, 2, 8))                                       # 10 > n_win
    a.save(cache)
    a.feed(toks(cfg, 11, 9))                                      # 21: interval unit 16 and tail 21
    a.save(cache)
    q = a.ids + [3]
    assert cache.lookup(q).boundary == 21
    assert cache.lookup(q, max_len=20).boundary == 16
    assert cache.lookup(q, max_len=15).boundary == 10
    assert cache.lookup(q[:9] + [0] * 20) is None                 # diverges before every unit > n_win


def test_tails_saved_by_another_process_are_found(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    reader = new_cache(cfg, model, tmp_path, refresh_s=0.0)
    writer = new_cache(cfg, model, tmp_path)                      # another worker on the same directory
    a = Turn(model, pool)
    a.feed(toks(cfg, 27, 10))
    a.save(writer, with_swa=False)
    hit = reader.lookup(a.ids + [1])
    assert hit.boundary == 27 and hit.global_state.to_bytes() == a.ref_prefix(27)


def _fake_prefix(cfg, n, seed=0):
    pool = PackedKVPool(cfg, page_size=64)
    sid = pool.new_sequence()
    fill_random(pool, sid, n, seed=seed)
    pool.seqs[sid].pos = n
    pool.seqs[sid].engram_history = torch.tensor([1, 2])
    return pool, sid


def test_lookup_is_linear_in_units(debug, tmp_path, monkeypatch):
    cfg, model = debug
    n = 4000
    pool, sid = _fake_prefix(cfg, n)
    ids = toks(cfg, n + 50, 12).tolist()
    cache = new_cache(cfg, model, tmp_path, swa=None)
    cache.save(ids[:n], n, pool.export_global(sid, n))           # 250 interval units (and no tail: 4000 = 250 I)
    pool2, sid2 = _fake_prefix(cfg, 3990, seed=1)
    cache.save(ids[:3990], 3990, pool2.export_global(sid2, 3990))  # a tail off unit 249
    calls = {"contains": 0, "get_entry": 0}
    for name in calls:
        orig = getattr(cache.disk, name)

        def counted(*a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(*a)
        monkeypatch.setattr(cache.disk, name, counted)
    t0 = time.perf_counter()
    hit = cache.lookup(ids)
    dt = time.perf_counter() - t0
    assert hit.boundary == n and hit.global_state.to_bytes() == pool.export_global(sid, n).to_bytes()
    units = n // I
    assert calls["contains"] <= units + 1 and calls["get_entry"] <= units
    assert dt < 10.0
    # a request diverging at token 2000 stops at the first missing unit
    calls.update(contains=0, get_entry=0)
    other = ids[:2000] + [(x + 1) % cfg.vocab_size for x in ids[2000:]]
    assert cache.lookup(other).boundary == 2000
    assert calls["contains"] == 2000 // I + 1


# ------------------------------------------------------------------------------------------ faults

def _unit_path(cache, ids, j):
    return cache.disk.dir / (chain_keys(cache.fp, ids, I)[j].hex() + ".kv")


@pytest.mark.parametrize("fault", ["flip", "truncate", "zero", "delete"])
def test_damaged_middle_unit_gives_a_shorter_exact_hit(debug, tmp_path, fault):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path, swa=None)
    a = Turn(model, pool)
    a.feed(toks(cfg, 53, 13))
    a.save(cache)
    path = _unit_path(cache, a.ids, 2)                            # positions 16..32
    data = bytearray(path.read_bytes())
    if fault == "flip":
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
    elif fault == "truncate":
        path.write_bytes(bytes(data[:-100]))
    elif fault == "zero":
        path.write_bytes(b"")
    else:
        path.unlink()
    hit = cache.lookup(a.ids + [1])
    assert hit.boundary == 16 and hit.global_state.to_bytes() == a.ref_prefix(16)
    assert not path.exists()
    d = cache.stats()["disk"]
    assert (d["corrupt_removed"] == 1) == (fault in ("flip", "truncate", "zero"))
    a.save(cache)                                                 # the next save repairs the chain
    assert cache.lookup(a.ids + [1]).boundary == 53


def test_storage_faults_never_raise(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)

    def enospc(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")
    cache.disk._os_write = enospc
    a = Turn(model, pool)
    a.feed(toks(cfg, 30, 14))
    r = a.save(cache)
    assert r == {"units_written": 0, "bytes": 0, "swa": False}
    assert cache.lookup(a.ids + [1]) is None
    s = cache.stats()
    assert s["disk"]["write_errors"] == 1 and s["cache"]["errors"] == 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp.")]
    cache.disk._os_write = os.write
    assert a.save(cache)["units_written"] == 2


def test_damaged_swa_value_is_a_miss(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    swa = MemorySwaPool(1 << 20, 60)
    cache = new_cache(cfg, model, tmp_path, swa=swa)
    a = Turn(model, pool)
    a.feed(toks(cfg, 25, 15))
    a.save(cache)
    (k,) = swa.keys()
    good = swa.get(k)
    for bad in (good[:-10], good[:20], good[:-1] + bytes([good[-1] ^ 1]), b""):
        swa.put(k, bad)
        hit = cache.lookup(a.ids + [1])
        assert hit.boundary == 25 and hit.path == "replay"
    assert cache.stats()["cache"]["swa_bad"] == 4
    other = cache.stats()["cache"]["hits_swa"]
    swa.put(k, good)
    assert cache.lookup(a.ids + [1]).path == "swa-hit" and cache.stats()["cache"]["hits_swa"] == other + 1


def test_redis_swa_pool_stopped_mid_run(debug, tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Redis unavailable: {reason}")
    cfg, model = debug
    srv = RedisService()
    srv.start()
    try:
        pool = PackedKVPool(cfg, page_size=4)
        cache = new_cache(cfg, model, tmp_path, swa=RedisSwaPool([srv.url], ttl_s=60, timeout_s=0.2, retry_s=0.1))
        a = Turn(model, pool)
        a.feed(toks(cfg, 25, 16))
        assert a.save(cache)["swa"]
        q = a.ids + [1]
        assert cache.lookup(q).path == "swa-hit"
        srv.stop()
        hit = cache.lookup(q)
        assert hit.path == "replay" and hit.global_state.to_bytes() == a.ref_prefix(25)
        a.feed([4, 5])
        r = a.save(cache)                                         # global KV persists; the snapshot does not
        assert r["units_written"] == 1 and r["swa"] is False
        s = cache.stats()
        assert s["swa"]["errors"] >= 1 and s["cache"]["errors"] == 0
    finally:
        srv.close()


def test_metrics_are_flat_numbers(debug, tmp_path):
    cfg, model = debug
    cache = new_cache(cfg, model, tmp_path)
    cache.lookup(list(range(20)))
    m = cache.metrics()
    assert m["prefix_cache_lookups"] == 1 and m["prefix_cache_misses"] == 1
    for k in ("prefix_disk_hits", "prefix_disk_evictions", "prefix_disk_corrupt_removed", "prefix_disk_bytes",
              "prefix_swa_hits", "prefix_swa_evictions"):
        assert k in m
    assert all(isinstance(v, (int, float)) for v in m.values())
    assert PrefixCache(fingerprint(cfg, "w", "t")).lookup(list(range(200))) is None     # no cache dir: misses


@pytest.mark.slow
def test_fault_benchmark_reports_no_wrong_outputs(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import prefix_faults

    rc = prefix_faults.main(["--steps", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and last["corrupt_served"] == 0 and last["wrong_outputs"] == 0 and last["exceptions"] == 0
    assert last["faults_injected"] > 0 and all("skipped" in r or r["requests"] for r in last["rows"])
