"""Fault injection into the prefix cache's two tiers: every request still returns the correct output, nothing
corrupt is ever served, no exception escapes, and the counters record each fault.

    PYTHONPATH=. python benchmarks/prefix_faults.py [--steps 3] [--no-redis]

Setup (random `debug` model, n_win = window = 8, interval 16): turn 1 is a 37-token prompt, saved at its end
(global units 0-16, 16-32, tail 32-37, and an SWA snapshot carrying the last logits) and, after 4 greedy tokens,
at the end of the output (the unit at 41, whose segment 37-41 links to the tail at 37, and a snapshot). Per fault, a fresh cache directory gets turn 1's saves, the
fault is injected, then two requests are served through the hit flow:

  continuation  turn 2 = turn 1 + its output + 6 new tokens; reference: the original sequence continuing
  regenerate    turn 1's prompt again; reference: the original sequence's decode after the prompt

A request takes the longest hit: with an SWA snapshot it resumes exactly (import global + SWA state, prefill the
rest); without one it is a `replay` hit, whose Encoder SWA Bounded Replay is the engine's (here the output is
recomputed cold, after the served global state is checked); no hit is `cold`. Checks per request: any state
served equals, byte for byte, the reference state at that boundary ("corrupt served"); greedy tokens equal the
reference bit for bit ("wrong outputs"; a recomputation follows the reference's chunk schedule, since the quantized
model's FP4 rounding and top-k choices make logits depend on chunking); no exception escapes.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from dsv41.config import load_config  # noqa: E402
from dsv41.kv.manager import PrefixCache  # noqa: E402
from dsv41.kv.pool import PackedKVPool  # noqa: E402
from dsv41.kv.prefix import chain_keys, engram_history_at, prefix_key  # noqa: E402
from dsv41.kv.swa_pool import MemorySwaPool, RedisSwaPool  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402

INTERVAL = 16


class Harness:
    """The model, the reference conversation and its exact states at every boundary."""

    def __init__(self, steps: int):
        self.cfg = load_config("debug")
        self.model = random_model(self.cfg, seed=21)
        self.steps = steps
        g = torch.Generator().manual_seed(5)
        self.p1 = torch.randint(0, self.cfg.vocab_size, (37,), generator=g).tolist()
        pool = self.pool = PackedKVPool(self.cfg, page_size=4)
        a = pool.new_sequence()
        self.ref_global: dict[int, bytes] = {}
        self.ref_swa: dict[int, bytes] = {}
        self.saves = []                                  # turn 1's saves: (ids, upto, GlobalState, SwaState)
        ids = list(self.p1)
        logits = self._feed(a, ids)
        self._capture(a, ids, logits)
        self.regen_ref = [logits]
        out = []
        for _ in range(4):
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            logits = self._feed(a, [tok])
            self.regen_ref.append(logits)
        ids = ids + out
        self._capture(a, ids, logits)
        self.regen_ref = self.regen_ref[:1 + steps]
        self.p2 = ids + [int(logits[0, -1].argmax())] + torch.randint(0, self.cfg.vocab_size, (6,),
                                                                        generator=g).tolist()
        # the engine-independent schedule of each prompt (chunks fed to the model): the quantized model's
        # FP4 / top-k decisions make logits depend on the chunking, so a recomputation follows the reference's
        self.schedule = {len(self.p1): [37], len(self.p2): [37, 1, 1, 1, 1, len(self.p2) - len(ids)]}
        self.p2_ref = [self._feed(a, self.p2[len(ids):])]
        for _ in range(steps):
            self.p2_ref.append(self._feed(a, [int(self.p2_ref[-1][0, -1].argmax())]))
        for U in (16, 32):                               # interval units: prefixes of the append-only store
            hist = engram_history_at(self.model.engram_hasher, self.p2, U)
            self.ref_global[U] = pool.export_global(a, U, engram_history=hist).to_bytes()

    @torch.no_grad()
    def _feed(self, sid, ids):
        return self.model(torch.tensor([ids]), self.pool.bind([sid])).logits[:, -1:]

    def _capture(self, sid, ids, logits):
        U = len(ids)
        g = self.pool.export_global(sid, U)
        s = self.pool.export_swa(sid, extras={"logits": logits[0, -1]})
        self.ref_global[U], self.ref_swa[U] = g.to_bytes(), s.to_bytes()
        self.saves.append((list(ids), U, g, s))

    def cache(self, d, swa="memory", **kw) -> PrefixCache:
        kw = {"interval": INTERVAL, "hasher": self.model.engram_hasher, "min_age_s": 0.0, "refresh_s": 0.0, **kw}
        return PrefixCache.from_config(self.cfg, "bench-weights", "bench-tok", cache_dir=d, swa_pool=swa, **kw)

    def turn1(self, cache) -> None:
        for ids, U, g, s in self.saves:
            cache.save(ids, U, g, s)

    # ---------------------------------------------------------------- serving one request
    @torch.no_grad()
    def serve(self, cache, prompt, ref) -> dict:
        r = {"path": "cold", "corrupt_served": 0, "wrong": 0, "exception": 0, "dev": 0.0}
        try:
            hit = cache.lookup(prompt, max_len=len(prompt))
        except Exception as e:                           # counted: must never happen
            r["exception"] += 1
            r["error"] = repr(e)
            hit = None
        if hit is not None:
            if hit.global_state.to_bytes() != self.ref_global.get(hit.boundary):
                r["corrupt_served"] += 1
            if hit.swa_state is not None and hit.swa_state.to_bytes() != self.ref_swa.get(hit.boundary):
                r["corrupt_served"] += 1
        pool = PackedKVPool(self.cfg, page_size=4)
        sid = pool.new_sequence()
        feed = lambda ids: self.model(torch.tensor([ids]), pool.bind([sid])).logits[:, -1:]
        cuts, P = [], 0
        for n in self.schedule[len(prompt)]:
            P += n
            cuts.append(P)
        if hit is not None and hit.swa_state is not None and not r["corrupt_served"]:
            r["path"] = "swa-hit"
            pool.import_global(sid, hit.global_state)
            pool.import_swa(sid, hit.swa_state)
            start = hit.boundary
            if start == len(prompt):
                logits = hit.swa_state.extras["logits"].view(1, 1, -1)
        else:
            r["path"] = "replay" if hit is not None else "cold"
            start = 0                                    # replay itself is the engine's: recompute here
        for c in cuts:
            if c > start:
                logits = feed(prompt[start:c])
                start = c
        outs = [logits]
        for _ in range(self.steps):
            outs.append(feed([int(outs[-1][0, -1].argmax())]))
        for x, y in zip(outs, ref):
            r["dev"] = max(r["dev"], float((x - y).abs().max()))
        r["wrong"] = int(r["dev"] != 0.0)                # every path here must reproduce the reference bit for bit
        return r

    def requests(self, cache) -> list[dict]:
        return [self.serve(cache, self.p2, self.p2_ref), self.serve(cache, self.p1, self.regen_ref)]


# ------------------------------------------------------------------------------------------ faults

def unit_files(h: Harness, cache) -> list[Path]:
    return sorted(cache.disk.dir.glob("*.kv"))


def _flip(off_fn):
    def f(path: Path):
        b = bytearray(path.read_bytes())
        i = off_fn(len(b))
        b[i] ^= 0x20
        path.write_bytes(bytes(b))
    return f


def scenario_files(h, d, mutate, name) -> dict:
    """Mutate one unit file at a time (each a separate fault), serve, re-save (the next request repairs)."""
    cache = h.cache(d, swa=None)
    h.turn1(cache)
    reqs = []
    files = unit_files(h, cache)
    for path in files:
        mutate(path)
        reqs += h.requests(cache)
        h.turn1(cache)
    return {"count": len(files), "requests": reqs, "cache": cache}


def foreign(h, d) -> dict:
    """Each unit file replaced by a valid entry of another namespace under the same key (intact payload and
    checksums; only the fingerprint differs), e.g. two models' cache directories merged."""
    from dsv41.kv.disk import DiskStore

    cache = h.cache(d, swa=None)
    h.turn1(cache)
    other_dir = Path(d).parent / (Path(d).name + "-other")
    other = DiskStore(other_dir, 1 << 30, fingerprint="f" * 64, durable=False)
    reqs = []
    for path in unit_files(h, cache):
        key = path.name[:-3]
        meta, payload = cache.disk.get_entry(key)
        other.put(key, payload, meta)
        shutil.copyfile(other_dir / path.name, path)
        reqs += h.requests(cache)
        h.turn1(cache)
    shutil.rmtree(other_dir, ignore_errors=True)
    return {"count": len(reqs) // 2, "requests": reqs, "cache": cache}


HANG = """
import sys, time
from dsv41.kv.disk import DiskStore
s = DiskStore(sys.argv[1], 1 << 30, fingerprint=sys.argv[2], durable=True)
def hang(fd):
    print("in fsync", flush=True)
    time.sleep(300)
s._os_fsync = hang
s.put(sys.argv[3], b"partial unit bytes" * 1000)
"""


def killed_writer(h, d) -> dict:
    cache = h.cache(d, swa=None)
    h.turn1(cache)
    key = chain_keys(cache.fp, h.p1, INTERVAL)[2].hex()
    (cache.disk.dir / (key + ".kv")).unlink()            # the unit the killed writer was rewriting
    p = subprocess.Popen([sys.executable, "-c", HANG, str(d), cache.fp, key], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "in fsync"
    p.send_signal(signal.SIGKILL)
    p.wait()
    cache = h.cache(d, swa=None)                         # a restart after the crash
    return {"count": 1, "requests": h.requests(cache), "cache": cache}


def write_fault(h, d, hook, code) -> dict:
    cache = h.cache(d, durable=True)

    def fail(*_a):
        raise OSError(code, os.strerror(code))
    setattr(cache.disk, hook, fail)
    h.turn1(cache)                                       # every unit write fails: nothing persisted
    n = cache.disk.counters["write_errors"]
    reqs = h.requests(cache)
    setattr(cache.disk, hook, getattr(os, hook[4:]))     # the disk recovers
    h.turn1(cache)
    reqs += h.requests(cache)
    return {"count": n, "requests": reqs, "cache": cache}


def disk_full(h, d) -> dict:
    cache = h.cache(d, swa=None, min_free_bytes=1 << 20)
    cache.disk.disk_usage = lambda _p: types.SimpleNamespace(total=1 << 30, used=(1 << 30) - 4096, free=4096)
    h.turn1(cache)
    return {"count": cache.disk.counters["skipped_full"], "requests": h.requests(cache), "cache": cache}


def evicted_unit(h, d) -> dict:
    cache = h.cache(d, swa=None)
    h.turn1(cache)
    key = chain_keys(cache.fp, h.p1, INTERVAL)[2].hex()
    (cache.disk.dir / (key + ".kv")).unlink()
    return {"count": 1, "requests": h.requests(cache), "cache": cache}


def evicted_link(h, d) -> dict:
    """The end-of-prompt segment (32-37) that the end-of-output unit (41) needs is evicted; then turn 1's saves
    again (the next conversation through it repairs the path) and the requests once more."""
    cache = h.cache(d)
    h.turn1(cache)
    (cache.disk.dir / (prefix_key(cache.fp, h.p1, 37, INTERVAL) + ".kv")).unlink()
    reqs = h.requests(cache)
    h.turn1(cache)
    return {"count": 1, "requests": reqs + h.requests(cache), "cache": cache}


def two_writers(h, d) -> dict:
    """Several writers of the same units on one directory: one with a stale boundary index (it stores 41 from 32,
    not knowing 37), then four threads saving turn 1 at once, each both units in both orders."""
    swa = MemorySwaPool(1 << 24, 600)
    stale = h.cache(d, swa=swa, refresh_s=1e9)
    caches = [h.cache(d, swa=swa), stale] + [h.cache(d, swa=swa) for _ in range(2)]
    caches[0].save(*h.saves[0])
    stale.save(*h.saves[1])
    barrier = threading.Barrier(len(caches))

    def writer(cache):
        barrier.wait()
        for ids, U, g, sw in h.saves[::-1] + h.saves:
            cache.save(ids, U, g, sw)
    threads = [threading.Thread(target=writer, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = h.cache(d, swa=swa)
    return {"count": 2 + 4 * len(caches), "requests": h.requests(reader) + h.requests(stale), "cache": caches[0]}


def swa_corrupt_memory(h, d) -> dict:
    swa = MemorySwaPool(1 << 24, 600)
    cache = h.cache(d, swa=swa)
    h.turn1(cache)
    keys = swa.keys()
    for k in keys:
        v = bytearray(swa.get(k))
        v[len(v) // 2] ^= 1
        swa.put(k, bytes(v))
    return {"count": len(keys), "requests": h.requests(cache), "cache": cache}


def swa_expired(h, d) -> dict:
    now = [0.0]
    swa = MemorySwaPool(1 << 24, 60, clock=lambda: now[0])
    cache = h.cache(d, swa=swa)
    h.turn1(cache)
    n = len(swa.keys())
    now[0] = 61.0
    return {"count": n, "requests": h.requests(cache), "cache": cache}


def redis_scenario(h, d, mode) -> dict:
    from redis_service import RedisService, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    srv = RedisService()
    srv.start()
    try:
        pool = RedisSwaPool([srv.url], ttl_s=600, timeout_s=0.2, retry_s=0.2)
        cache = h.cache(d, swa=pool)
        h.turn1(cache)
        reqs = h.requests(cache)                          # healthy: swa-hits
        if mode == "stopped":
            srv.stop()
            count = 1
        else:
            import redis
            raw = redis.Redis.from_url(srv.url)
            keys = raw.keys("dsv41:swa:*")
            for k in keys:
                v = bytearray(raw.get(k))
                v[-1] ^= 1
                raw.set(k, bytes(v), px=600_000)
            raw.close()
            count = len(keys)
        reqs += h.requests(cache)
        h.turn1(cache)                                    # saves while down: global persists, no exception
        reqs += h.requests(cache)
        return {"count": count, "requests": reqs, "cache": cache}
    finally:
        srv.close()


def healthy(h, d) -> dict:
    cache = h.cache(d)
    h.turn1(cache)
    return {"count": 0, "requests": h.requests(cache), "cache": cache}


# ------------------------------------------------------------------- the device tier (pages shared in one pool)

@torch.no_grad()
def _device_source(h):
    """A pool whose sequence has served turn 1 (prompt, then 4 greedy tokens: it stands at 41), on the reference's
    schedule: the pages the engine's device tier keeps for a finished or running sequence."""
    pool = PackedKVPool(h.cfg, page_size=4)
    src = pool.new_sequence()
    logits = h.model(torch.tensor([h.p1]), pool.bind([src])).logits[:, -1:]
    for _ in range(4):
        logits = h.model(torch.tensor([[int(logits[0, -1].argmax())]]), pool.bind([src])).logits[:, -1:]
    return pool, src


def _share(h, pool, src, U) -> int:
    """A new sequence resuming turn 1 at U (37: end of prompt, 41: end of output) from src's pages, with the carry
    and Engram history the engine's device tier notes at a saved unit and the SWA snapshot of that unit."""
    _, _, g, swa = next(x for x in h.saves if x[1] == U)
    sid = pool.new_sequence()
    pool.share_prefix(sid, src, U, {ls.layer: (ls.carry_kv, ls.carry_score) for ls in g.layers
                                    if ls.carry_kv.size(0)}, g.engram_history)
    pool.import_swa(sid, swa)
    return sid


@torch.no_grad()
def _shared_request(h, pool, sid, U, r):
    """Serve one request from a shared prefix (continuation from 41, regenerate from 37), yielding after every
    model call so that several sharers of one pool interleave; fills `r`."""
    prompt, ref = (h.p2, h.p2_ref) if U == 41 else (h.p1, h.regen_ref)
    if pool.export_global(sid, U).to_bytes() != h.ref_global[U]:
        r["corrupt_served"] += 1
    feed = lambda ids: h.model(torch.tensor([ids]), pool.bind([sid])).logits[:, -1:]
    if U == len(prompt):
        logits = next(x for x in h.saves if x[1] == U)[3].extras["logits"].view(1, 1, -1)
    else:
        logits = feed(prompt[U:])                        # the reference schedule's last chunk
        yield
    outs = [logits]
    for _ in range(h.steps):
        outs.append(feed([int(outs[-1][0, -1].argmax())]))
        yield
    r["dev"] = max(float((x - y).abs().max()) for x, y in zip(outs, ref))
    r["wrong"] = int(r["dev"] != 0.0)


def _serve_shared(h, pool, jobs) -> list[dict]:
    """Run (sid, U) requests round-robin, one model call each per turn; an exception is counted, never raised."""
    reqs = [{"path": "swa-hit", "corrupt_served": 0, "wrong": 0, "exception": 0, "dev": 0.0} for _ in jobs]
    live = [(r, _shared_request(h, pool, sid, U, r)) for r, (sid, U) in zip(reqs, jobs)]
    while live:
        for r, g in list(live):
            try:
                next(g)
            except StopIteration:
                live.remove((r, g))
            except Exception as e:
                r["exception"], r["error"] = 1, repr(e)
                live.remove((r, g))
    return reqs


def _shared_pages(pool) -> dict:
    """The bytes of every page held by more than one sequence, per layer."""
    return {L: {p: pl.data["main"][p].clone() for p in pl.refs} for L, pl in pool.global_layers.items()}


def device_evicted(h, d) -> dict:
    """Device tier: the source's pages evicted (the sequence freed) right after two sharers took them, then a
    third sequence allocates and writes pages: the sharers' prefix is still theirs (refcounted), byte for byte."""
    pool, src = _device_source(h)
    jobs = [(_share(h, pool, src, 41), 41), (_share(h, pool, src, 37), 37)]
    pool.free(src)
    other = pool.new_sequence()
    with torch.no_grad():
        h.model(torch.tensor([h.p2[::-1]]), pool.bind([other]))
    reqs = _serve_shared(h, pool, jobs)
    held = sum(len(v) for v in _shared_pages(pool).values())
    return {"count": 1, "requests": reqs, "cache": None, "counter": f"device.shared_pages={held}"}


def device_two_writers(h, d) -> dict:
    """Device tier: one segment, several writers: the source itself and three sharers (two continuing from 41,
    one regenerating from 37) decode interleaved, each appending after the shared pages (a partly filled page is
    copied at sharing); no shared page changes."""
    pool, src = _device_source(h)
    jobs = [(src, 41)] + [(_share(h, pool, src, U), U) for U in (41, 41, 37)]
    before = _shared_pages(pool)
    reqs = _serve_shared(h, pool, jobs)
    changed = sum(not torch.equal(pool.global_layers[L].data["main"][p], b) for L, v in before.items()
                  for p, b in v.items())
    reqs[0]["corrupt_served"] += changed
    held = sum(len(v) for v in before.values())
    return {"count": 4, "requests": reqs, "cache": None, "counter": f"device.shared_pages={held} changed={changed}"}


SCENARIOS = [
    ("none (healthy)", healthy, "hits_swa"),
    ("bit flip (payload)", lambda h, d: scenario_files(h, d, _flip(lambda n: n - 7), "flip"), "corrupt_removed"),
    ("bit flip (header)", lambda h, d: scenario_files(h, d, _flip(lambda n: 90), "hflip"), "corrupt_removed"),
    ("truncation", lambda h, d: scenario_files(h, d, lambda p: p.write_bytes(p.read_bytes()[:-64]), "trunc"),
     "corrupt_removed"),
    ("zero-length file", lambda h, d: scenario_files(h, d, lambda p: p.write_bytes(b""), "zero"),
     "corrupt_removed"),
    ("foreign file (other fingerprint)", foreign, "foreign_removed"),
    ("killed writer (stale temp file)", killed_writer, "stale_tmp_removed"),
    ("ENOSPC on write", lambda h, d: write_fault(h, d, "_os_write", errno.ENOSPC), "write_errors"),
    ("EIO on write", lambda h, d: write_fault(h, d, "_os_write", errno.EIO), "write_errors"),
    ("EIO on fsync", lambda h, d: write_fault(h, d, "_os_fsync", errno.EIO), "write_errors"),
    ("disk below free-space watermark", disk_full, "skipped_full"),
    ("evicted middle unit", evicted_unit, "cache.hit_tokens"),
    ("segment evicted under a unit", evicted_link, "cache.hits_swa"),
    ("two writers of one segment", two_writers, "cache.units_existing"),
    ("device: source evicted under sharers", device_evicted, None),
    ("device: four writers of one segment", device_two_writers, None),
    ("SWA snapshot corrupt (memory pool)", swa_corrupt_memory, "swa_bad"),
    ("SWA snapshot expired (TTL)", swa_expired, "expired"),
    ("Redis server stopped mid-run", lambda h, d: redis_scenario(h, d, "stopped"), "swa.errors"),
    ("Redis value corrupt", lambda h, d: redis_scenario(h, d, "corrupt"), "swa_bad"),
]


def counter_value(cache, name):
    s = cache.stats()
    if "." in name:
        tier, name = name.split(".")
        return f"{tier}.{name}={(s.get(tier) or {}).get(name, '?')}"
    for tier in ("disk", "cache", "swa"):
        if s.get(tier) and name in s[tier]:
            return f"{tier}.{name}={s[tier][name]}"
    return f"{name}=?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="greedy tokens decoded per request (default 3)")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis scenarios")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    t0 = time.perf_counter()
    h = Harness(args.steps)
    rows = []
    hdr = f"{'fault':<36}{'count':>6}{'requests':>9}{'cold':>6}{'swa-hit':>8}{'replay':>7}" \
          f"{'corrupt served':>15}{'wrong outputs':>14}{'exceptions':>11}{'max |dlogit|':>13}  counter"
    print(hdr)
    print("-" * (len(hdr) + 24))
    for name, fn, counter in SCENARIOS:
        if args.no_redis and name.startswith("Redis"):
            continue
        d = tempfile.mkdtemp(prefix="dsv41-pcf-")
        try:
            try:
                res = fn(h, d)
            except Exception as e:                        # the harness itself failed: reported, counted
                res = {"count": 0, "requests": [{"path": "cold", "corrupt_served": 0, "wrong": 0, "exception": 1,
                                                 "dev": 0.0, "error": repr(e)}], "cache": None}
            if "skipped" in res:
                rows.append({"fault": name, "skipped": res["skipped"]})
                print(f"{name:<36}  skipped: {res['skipped']}")
                continue
            reqs = res["requests"]
            paths = {p: sum(r["path"] == p for r in reqs) for p in ("cold", "swa-hit", "replay")}
            row = {"fault": name, "count": res["count"], "requests": len(reqs), **paths,
                   "corrupt_served": sum(r["corrupt_served"] for r in reqs),
                   "wrong_outputs": sum(r["wrong"] for r in reqs),
                   "exceptions": sum(r["exception"] for r in reqs),
                   "max_abs_logit_dev": max(r["dev"] for r in reqs),
                   "counter": res.get("counter") or (counter_value(res["cache"], counter) if res["cache"] else "-")}
            errs = [r["error"] for r in reqs if "error" in r]
            if errs:
                row["errors"] = errs
            rows.append(row)
            print(f"{name:<36}{row['count']:>6}{row['requests']:>9}{paths['cold']:>6}{paths['swa-hit']:>8}"
                  f"{paths['replay']:>7}{row['corrupt_served']:>15}{row['wrong_outputs']:>14}{row['exceptions']:>11}"
                  f"{row['max_abs_logit_dev']:>13.2e}  {row['counter']}")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    ran = [r for r in rows if "skipped" not in r]
    summary = {"rows": rows, "faults_injected": sum(r["count"] for r in ran),
               "requests": sum(r["requests"] for r in ran),
               "corrupt_served": sum(r["corrupt_served"] for r in ran),
               "wrong_outputs": sum(r["wrong_outputs"] for r in ran),
               "exceptions": sum(r["exceptions"] for r in ran), "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(summary))
    return 0 if not (summary["corrupt_served"] or summary["wrong_outputs"] or summary["exceptions"]) else 1


if __name__ == "__main__":
    sys.exit(main())
