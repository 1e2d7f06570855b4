"""Guards the device-memory prefix tier (dsv41/kv/device_tier.py, docs/system.md §4): a finished sequence's pages
stay in the pool and a repeated prompt shares them (no disk read, the answer identical); a prompt extending a
RUNNING sequence's prompt shares that sequence's pages; shared pages are held by reference and never written
again; retained prefixes are evicted under the page budget before any running sequence is preempted; namespaces
(cache_salt) do not mix. Deterministic mode, so "identical" is bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.model.init import random_model

PROMPT = [0] + [3 + (7 * i) % 250 for i in range(45)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("debug"), seed=4)


def engine(model, tmp_path, **kw):
    return Engine(model, prefill_mode="ced-exact", cache_dir=tmp_path, swa_pool="memory", cache_interval=16,
                  deterministic=True, **kw)


def count_disk_lookups(eng) -> list:
    calls = []
    inner = eng.prefix_cache.lookup
    eng.prefix_cache.lookup = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    return calls


def test_repeated_prompt_shares_the_retained_pages(model, tmp_path):
    eng = engine(model, tmp_path)
    cold = eng.generate([PROMPT], PARAMS)[0]
    assert len(eng.device_tier.retained) == 1
    disk = count_disk_lookups(eng)
    warm = eng.generate([PROMPT], PARAMS)[0]
    U = len(PROMPT) - 1
    assert warm.stats["cache_path"] == "swa-hit" and warm.stats["cached_tokens"] == U
    assert warm.stats["cached_tokens_by_tier"] == {"device": U, "swa": U}
    assert disk == []                                                 # served from the pool: no disk read
    assert warm.output_ids == cold.output_ids
    fresh = Engine(model, prefill_mode="ced-exact", deterministic=True).generate([PROMPT], PARAMS)[0]
    assert fresh.output_ids == cold.output_ids


def test_prompt_extending_a_running_sequence_shares_its_pages(model, tmp_path):
    eng = engine(model, tmp_path, kv_page_size=4)                     # pages small enough to fill
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    a = eng.add_request(PROMPT, long)
    while not any(s.request_id == a and s.output_ids for s in eng.running):
        eng.step()
    src = next(s for s in eng.running if s.request_id == a)
    disk = count_disk_lookups(eng)
    extended = PROMPT + [5, 9, 11, 13, 17, 19]
    b = eng.add_request(extended, PARAMS)
    eng.step()                                                        # admits b next to the running a
    seq_b = next(s for s in eng.running if s.request_id == b)
    assert seq_b.cache_path == "swa-hit" and seq_b.cached_tiers == {"device": len(PROMPT) - 1, "swa": len(PROMPT) - 1}
    assert disk == []
    shared = {L: set(eng.pool.seqs[src.sid].pages[L]) & set(eng.pool.seqs[seq_b.sid].pages[L])
              for L in eng.pool.global_layers}
    assert any(shared.values())                                       # the same pages, not copies
    before = {L: eng.pool.global_layers[L].data["main"][sorted(p)].clone() for L, p in shared.items() if p}
    while eng.has_unfinished():
        eng.step()
    for L, old in before.items():                                     # neither sequence wrote a shared page
        assert torch.equal(eng.pool.global_layers[L].data["main"][sorted(shared[L])], old)
    got = eng.completion(b)
    want = Engine(model, prefill_mode="ced-exact", deterministic=True).generate([extended], PARAMS)[0]
    assert got.output_ids == want.output_ids


def test_shared_pages_outlive_their_source(model, tmp_path):
    """Evicting the retained source frees only the pages nobody else holds; the sharer keeps decoding right."""
    eng = engine(model, tmp_path)
    eng.generate([PROMPT], PARAMS)
    b = eng.add_request(PROMPT + [7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    assert eng.device_tier.counts["hits"] == 1
    held_before = eng.pool.page_limit.used
    eng.device_tier.clear()
    assert not eng.device_tier.retained and eng.pool.page_limit.used < held_before
    while eng.has_unfinished():
        eng.step()
    want = Engine(model, prefill_mode="ced-exact", deterministic=True).generate(
        [PROMPT + [7, 8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert eng.completion(b).output_ids == want.output_ids


def test_retained_prefixes_are_evicted_before_preemption(model, tmp_path):
    """A small page budget: finished sequences stay retained while there is room, and give way to a new request
    (evicted) instead of any running sequence being preempted."""
    eng = engine(model, tmp_path, kv_pages=40, kv_page_size=4)
    prompts = [[0] + [3 + (k * 13 + 5 * i) % 250 for i in range(40)] for k in range(4)]
    outs = [eng.generate([p], PARAMS)[0] for p in prompts]
    assert eng.device_tier.counts["evicted"] > 0
    assert all(o.stats["preemptions"] == 0 for o in outs)
    assert eng.pool.page_limit.used <= 40


def test_namespaces_do_not_share(model, tmp_path):
    eng = engine(model, tmp_path)
    eng.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, cache_salt="alice"))
    other = eng.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, cache_salt="bob"))[0]
    assert other.stats["cache_path"] == "cold" and "device" not in other.stats["cached_tokens_by_tier"]


def test_a_shared_page_is_freed_with_its_last_holder(model):
    """Refcounts: releasing one holder of a shared page keeps it held (not on the free list, not reallocated);
    the last holder's release frees it, once."""
    from dsv41.kv.pool import PackedKVPool

    pool = PackedKVPool(model.cfg, page_size=4)
    src = pool.new_sequence()
    with torch.no_grad():
        model(torch.tensor([PROMPT[:32]]), pool.bind([src]))
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.share_prefix(a, src, 32)
    pool.share_prefix(b, src, 32)
    L, pl = next((L, pl) for L, pl in pool.global_layers.items() if len(pool.seqs[a].pages[L]) > 1)
    full = pool.seqs[src].pages[L][:(32 // pl.spec.ratio) // 4]
    assert full and pool.seqs[a].pages[L][:len(full)] == full == pool.seqs[b].pages[L][:len(full)]
    assert all(pl.refs[p] == 3 for p in full)
    used = pool.page_limit.used
    pool.free(src)
    assert not set(full) & set(pl.free) and all(pl.refs[p] == 2 for p in full)
    fresh = pool.new_sequence()
    with torch.no_grad():
        model(torch.tensor([PROMPT[:40]]), pool.bind([fresh]))       # allocations take other pages
    assert not set(full) & set(pool.seqs[fresh].pages[L])
    pool.free(fresh)
    pool.free(a)
    assert not set(full) & set(pl.free) and all(p not in pl.refs for p in full)
    pool.free(b)
    assert set(full) <= set(pl.free) and len(pl.free) == len(set(pl.free))
    assert pool.page_limit.used == 0 < used


def test_eviction_is_least_recently_used_first(model, tmp_path):
    """Three retained prompts, the first used again (a hit makes it the most recent): under a budget that forces
    one eviction the second prompt's pages go, the first's stay."""
    eng = engine(model, tmp_path, kv_page_size=4)
    prompts = [[0] + [3 + (k * 29 + 3 * i) % 250 for i in range(40)] for k in range(3)]
    for p in prompts:
        eng.generate([p], PARAMS)
    sids = list(eng.device_tier.retained)
    assert len(sids) == 3
    eng.generate([prompts[0]], PARAMS)                                # a hit: prompts[0]'s source is now the newest
    order = [eng.device_tier.retained[s].ids[:len(prompts[0])] for s in eng.device_tier.retained]
    assert order[-1] == prompts[0] and order[0] == prompts[1]
    evicted = eng.device_tier.counts["evicted"]
    assert eng.device_tier.evict_lru()
    assert eng.device_tier.counts["evicted"] == evicted + 1
    left = [s.ids[:len(prompts[0])] for s in eng.device_tier.retained.values()]
    assert prompts[1] not in left and prompts[0] in left and prompts[2] in left


def test_device_tier_reports_as_its_own_tier(model, tmp_path):
    eng = engine(model, tmp_path)
    eng.generate([PROMPT], PARAMS)
    eng.generate([PROMPT], PARAMS)
    s = eng.prefix_cache.stats()["device"]
    assert s["hits"] == 1 and s["hit_tokens"] == len(PROMPT) - 1 and s["sequences"] == 2 and s["pages"] > 0
    m = eng.prefix_cache.metrics()
    assert m["prefix_device_hits"] == 1 and m["prefix_device_pages"] == s["pages"]
