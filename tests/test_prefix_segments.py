"""Prefix units that share segments (`PrefixCache`, docs/system.md §4) on the random debug model (window 8 = n_win,
interval 16): every position of a token path is stored once however many units cover it; a unit whose segment
below was evicted is a miss (a shorter exact hit instead) and the next save repairs it; two writers of one unit
leave a consistent cache; `dsv41 cache stats` reports the stored positions and the analytic bytes per token."""

from __future__ import annotations

import json
import threading

import pytest

from dsv41.analysis.kv_bytes import global_kv_bytes_per_token
from dsv41.kv.cache_cli import cache_stats
from dsv41.kv.manager import UNIT_META, parse_unit_meta
from dsv41.kv.pool import PackedKVPool
from dsv41.kv.prefix import prefix_key
from dsv41.kv.state_format import GlobalState
from test_prefix_manager import I, Turn, debug, new_cache, resume, toks  # noqa: F401  (debug: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def units(cache) -> dict[int, tuple[int, int]]:
    """boundary -> (segment start, file bytes) of every unit entry in the cache directory."""
    out = {}
    for e in cache.disk.describe():
        f = parse_unit_meta(e["meta"])
        out[f.boundary] = (f.start, e["size"])
    return out


def conversation(model, pool, cache, seed=1):
    """Prompt of 37 tokens saved at its end, 5 decoded tokens saved at the end of output (42), 8 more at 50;
    returns the turn and the exact global state bytes at each save."""
    a = Turn(model, pool)
    refs = {}
    a.feed(toks(model.cfg, 37, seed))
    for steps in (0, 5, 8):
        a.decode(steps)
        a.save(cache)
        refs[len(a.ids)] = a.ref_prefix(len(a.ids))
    return a, refs


def test_every_position_is_stored_once(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    a, refs = conversation(model, pool, cache)
    got = units(cache)
    assert {U: s for U, (s, _) in got.items()} == {16: 0, 32: 16, 37: 32, 42: 37, 48: 42, 50: 48}
    payload = sum(len(cache.disk.get_entry(e["key"])[1]) for e in cache.disk.describe())
    full = GlobalState.from_bytes(refs[50])
    records = sum(ls.main.numel() + ls.index.numel() for ls in full.layers)
    assert records == 50 * global_kv_bytes_per_token(cfg)          # the analytic figure, for reference
    segs = [GlobalState.from_bytes(cache.disk.get_entry(e["key"])[1]) for e in cache.disk.describe()]
    assert sum(ls.main.numel() + ls.index.numel() for s in segs for ls in s.layers) == records
    assert payload < records * 1.6                                # headers and carries only on top
    for U in (37, 42, 50):                                        # every unit resumes exactly
        hit = cache.lookup(a.ids[:U] + [1], max_len=U)
        assert hit.boundary == U and hit.global_state.to_bytes() == refs[U] and hit.path == "swa-hit"
    s = cache_stats(str(tmp_path))["fingerprints"][cache.fp]
    assert s["tokens"] == 50 and s["units"] == 6
    assert s["analytic_bytes_per_token"] == float(global_kv_bytes_per_token(cfg))
    assert s["bytes_per_token"] == s["bytes"] / 50


def test_a_resumed_turn_writes_only_its_new_positions(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    a, refs = conversation(model, pool, cache)
    p2 = a.ids + toks(cfg, 9, 2).tolist()                         # the next turn: 59 tokens
    hit = cache.lookup(p2, max_len=len(p2) - 1)
    assert hit.boundary == 50 and hit.path == "swa-hit"
    b = resume(model, pool, hit)
    b.ids = list(a.ids)
    b.feed(p2[50:-1])                                             # the engine's end of prompt: 58 tokens
    start = cache.export_start(b.ids, 58)
    assert start == 50                                           # only the new positions are exported
    r = cache.save(b.ids, 58, pool.export_global(b.sid, 58, start=start), pool.export_swa(b.sid))
    assert r["units_written"] == 1 and units(cache)[58][0] == 50


def test_segment_evicted_under_a_unit_is_a_shorter_exact_hit_then_repaired(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path, swa=None)
    a, refs = conversation(model, pool, cache)
    key37 = prefix_key(cache.fp, a.ids, 37, interval=I)
    (tmp_path / (key37 + ".kv")).unlink()                         # the segment 32..37 that 42, 48 and 50 need
    hit = cache.lookup(a.ids + [1])
    assert hit.boundary == 32 and hit.global_state.to_bytes() == a.ref_prefix(32)
    r = a.save(cache)                                             # the next save through the path repairs it:
    assert r["units_written"] == 1 and units(cache)[48][0] == 32  # 48 now from 32 (50 hangs off 48 as before)
    hit = cache.lookup(a.ids + [1])
    assert hit.boundary == 50 and hit.global_state.to_bytes() == refs[50]
    assert cache.lookup(a.ids[:42] + [1]).boundary == 32          # 42 still hangs off the missing 37


def test_two_writers_of_one_unit(debug, tmp_path):
    """Writers with different views of the directory (one has not seen the tail at 37) write the same units with
    different segment starts, in turn and at once; every entry stays self-consistent and every hit exact."""
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    ref_cache = new_cache(cfg, model, tmp_path / "ref")
    a, refs = conversation(model, pool, ref_cache)
    saves = []                                                    # (ids, upto, GlobalState) of the three saves
    for U in (37, 42, 50):
        g = GlobalState.from_bytes(refs[U])
        saves.append((a.ids[:U], U, g))
    d = tmp_path / "shared"
    w1 = new_cache(cfg, model, d, swa=None)
    w2 = new_cache(cfg, model, d, swa=None, refresh_s=1e9)        # a stale boundary index: never rescans
    w1.save(*saves[0])
    w2.save(*saves[1])                                            # does not know 37: 42 stored from 32
    w1.save(*saves[1])                                            # knows 37 and finds 42 usable: nothing new
    assert units(w1)[42][0] == 32
    barrier = threading.Barrier(4)

    def writer(cache):
        barrier.wait()
        for s in saves[::-1] + saves:
            cache.save(*s)
    caches = [w1, w2] + [new_cache(cfg, model, d, swa=None) for _ in range(2)]
    threads = [threading.Thread(target=writer, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = new_cache(cfg, model, d, swa=None)
    assert reader.disk.verify(remove=False)["bad"] == []
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp.")]
    for U in (37, 42, 50):
        hit = reader.lookup(a.ids[:U] + [1])
        assert hit.boundary == U and hit.global_state.to_bytes() == refs[U]
    assert sum(c.stats()["cache"]["errors"] for c in caches + [reader]) == 0


def test_units_of_the_older_layout_are_misses_and_rewritten(debug, tmp_path):
    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path, swa=None)
    a = Turn(model, pool)
    a.feed(toks(cfg, 20, 3))
    a.save(cache)
    key16 = prefix_key(cache.fp, a.ids, 16, interval=I)
    meta, payload = cache.disk.get_entry(key16)
    cache.disk.put(key16, payload, meta[:56])                     # the 56-byte meta of the first layout
    assert parse_unit_meta(cache.disk.meta(key16)) is None and len(meta) == UNIT_META.size
    assert cache.lookup(a.ids + [1]) is None                       # 20 needs 16: nothing usable
    assert cache.stats()["cache"]["bad_units"] == 1 and not (tmp_path / (key16 + ".kv")).exists()
    assert a.save(cache)["units_written"] == 1                    # 16 again; 20 still links to it
    assert cache.lookup(a.ids + [1]).global_state.to_bytes() == a.ref_prefix(20)


def test_cache_stats_cli_prints_bytes_per_token(debug, tmp_path, capsys):
    from dsv41.kv.cache_cli import register
    import argparse

    cfg, model = debug
    pool = PackedKVPool(cfg, page_size=4)
    cache = new_cache(cfg, model, tmp_path)
    conversation(model, pool, cache)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", "stats", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "50 token positions stored" in out and "analytic global KV 52.5 B/token" in out
    args = parser.parse_args(["cache", "stats", "--cache-dir", str(tmp_path), "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["fingerprints"][cache.fp]["tokens"] == 50
