"""The engine's packed KV store (`dsv41.kv`): the model run on a `PackedKVPool` view is bit-identical to the model
run on `DenseCache` (quantization on, fp32 and bf16; prefill, chunked prefill, decode with DSpark drafts, rows at
different positions), the stored bytes are really packed, and the measured global bytes per token equal the
analytic figure for every preset (890 for v41-flash and v41-geometry)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from dsv41.analysis.kv_bytes import global_kv_bytes_per_token
from dsv41.codecs import (index_k_bytes, main_kv_bytes, pack_index_k, pack_main_kv, pack_main_kv_exact, pack_swa_kv,
                          qdq_fp8, qdq_index_k, qdq_main_kv, swa_kv_bytes, unpack_index_k, unpack_main_kv,
                          unpack_swa_kv)
from dsv41.config import load_config
from dsv41.model.attention import set_tie_break
from dsv41.kv import PackedKVPool
from dsv41.kv.accounting import bench_kv, fill_random
from dsv41.model.cache import DenseCache, cache_spec
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.model.step import ForwardOptions

PRESETS = ["debug", "tiny", "v41-flash", "v41-geometry"]


@pytest.fixture(scope="module")
def debug_models():
    """Decode on the packed store reads the bytes in place (dsv41.model.packed_decode: its top-k runs on [B, N]
    scores, the dense path's on [B, 1, N]); torch.topk's pick among exactly tied scores depends on that shape,
    so the equalities below use the deterministic tie rule."""
    cfg = load_config("debug")
    models = {torch.float32: random_model(cfg, seed=1), torch.bfloat16: random_model(cfg, dtype=torch.bfloat16,
                                                                                       seed=1)}
    for m in models.values():
        set_tie_break(m, "recent")
    return cfg, models


def tokens(cfg, B, T, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def small_pool(cfg, dtype=torch.float32, **kw):
    """Pages of 4 entries starting from one page per layer and one slot: page boundaries and growth everywhere."""
    kw = {"page_size": 4, "initial_pages": 1, "initial_slots": 1, "strict": True, **kw}
    return PackedKVPool(cfg, dtype=dtype, **kw)


@torch.no_grad()
def drive(model, cache, ids, chunks, decode_steps):
    """Prefill ids [B,T] in the given chunk sizes, seed the drafter, then greedy decode steps with a DSpark draft
    after each. Returns every tensor produced, in order."""
    out, P = [], 0
    for c in chunks:
        res = model(ids[:, P:P + c], cache)
        out.append(res.logits)
        P += c
    model.draft(None, res.main_hidden, cache, 0)
    nxt = res.logits[:, -1].argmax(-1)
    for _ in range(decode_steps):
        r = model(nxt.unsqueeze(1), cache)
        out.append(r.logits)
        nxt = r.logits[:, -1].argmax(-1)
        d_ids, d_logits, d_conf = model.draft(nxt, r.main_hidden, cache, P)
        out += [d_ids, d_logits, d_conf]
        P += 1
    return out


def assert_store_equals_dense(view, dense: DenseCache):
    """Everything the packed store holds, unpacked, equals DenseCache's tensors."""
    assert torch.equal(view.pos, dense.pos)
    for L in dense.window:
        assert torch.equal(view.window_ring(L), dense.window[L]), f"window {L}"
    for L in dense.ckv:
        n = dense.rows[L]
        assert torch.equal(view.compressed(L, n), dense.ckv[L][:, :int(n.max())]), f"compressed {L}"
        assert torch.equal(view.index_k(L, n), dense.kidx[L][:, :int(n.max())]), f"index {L}"
    for L in dense.pending:
        for a, b in zip(view.compressor_state(L), dense.pending[L]):
            assert torch.equal(a, b), f"pending {L}"
    assert torch.equal(view.engram_history, dense.engram_history)
    assert view.index_k_publisher == dense.index_k_publisher


# ------------------------------------------------------------------------------------------ through the model

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [(21,), (5, 1, 9, 6)])
def test_model_on_packed_store_equals_dense(debug_models, dtype, chunks):
    cfg, models = debug_models
    m = models[dtype]
    ids = tokens(cfg, 2, sum(chunks), seed=3)
    dense = DenseCache(cfg, 2, dtype)
    pool = small_pool(cfg, dtype)
    view = pool.bind([pool.new_sequence(), pool.new_sequence()])
    a = drive(m, dense, ids, chunks, decode_steps=5)
    b = drive(m, view, ids, chunks, decode_steps=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert_store_equals_dense(view, dense)
    assert view.global_bytes() == sum(pool.seq_bytes(s)["global_entries_bytes"] for s in view.seq_ids)


def test_rebinding_every_step_and_official_decode_artifact(debug_models):
    """The engine rebinds a fresh view per step; per-sequence state (positions, carry, Engram history, the stale
    index-key publisher of the official decode artifact) lives in the pool."""
    cfg, models = debug_models
    m = models[torch.float32]
    ids = tokens(cfg, 2, 12, seed=4)
    dense = DenseCache(cfg, 2, torch.float32)
    pool = small_pool(cfg)
    sids = [pool.new_sequence(), pool.new_sequence()]
    with torch.no_grad():
        for c0, c1 in [(0, 7), (7, 12)]:
            assert torch.equal(m(ids[:, c0:c1], dense).logits, m(ids[:, c0:c1], pool.bind(sids)).logits)
        nxt = torch.tensor([1, 2])
        for _ in range(3):
            a = m(nxt.unsqueeze(1), dense, opts=ForwardOptions(official_decode_artifact=True)).logits
            b = m(nxt.unsqueeze(1), pool.bind(sids), opts=ForwardOptions(official_decode_artifact=True)).logits
            assert torch.equal(a, b)
            nxt = a[:, -1].argmax(-1)
    assert_store_equals_dense(pool.bind(sids), dense)
    # a new sequence joins the running batch: its Engram history starts all-DEAD, its position at 0
    from dsv41.model.engram import DEAD

    new = pool.new_sequence()
    view = pool.bind(sids + [new])
    assert torch.equal(view.engram_history[:2], dense.engram_history)
    assert (view.engram_history[2] == DEAD).all()
    assert view.pos.tolist() == [15, 15, 0]
    with torch.no_grad():
        out = m(torch.tensor([[3], [4], [5]]), view).logits
    assert torch.isfinite(out).all() and pool.bind([new]).pos.tolist() == [1]
    assert type(view).stack([pool.bind([new]), pool.bind(sids)]).seq_ids == [new] + sids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_at_different_positions_decode_together(debug_models, dtype):
    """Continuous batching: each sequence prefilled alone (bind([sid])), then decoded in one batch. The packed
    batch equals DenseCache.stack of the same prefills bit for bit, and each sequence decoded alone (a fork)
    equals DenseCache alone bit for bit. Batched versus alone differs by the model's own batch-composition effect
    (GEMM order through the FP8/FP4 quantizer cascade, docs/golden.md §4), the same for both stores."""
    cfg, models = debug_models
    m = models[dtype]
    lens = [13, 26, 9]
    seqs = [tokens(cfg, 1, n + 4, seed=s) for s, n in enumerate(lens)]
    pool = small_pool(cfg, dtype)
    sids, forks, dense_one, p_alone, d_alone = [], [], [], [], []
    with torch.no_grad():
        for s, n in zip(seqs, lens):
            sid = pool.new_sequence()
            d = DenseCache(cfg, 1, dtype)
            assert torch.equal(m(s[:, :n], pool.bind([sid])).logits, m(s[:, :n], d).logits)
            sids.append(sid)
            forks.append(pool.fork(sid))
            dense_one.append(d)
        d_batch = DenseCache.stack(dense_one)
        for f, d, s, n in zip(forks, [DenseCache.stack([c]) for c in dense_one], seqs, lens):
            p_alone.append(torch.cat([m(s[:, n + k:n + k + 1], pool.bind([f])).logits for k in range(4)], 1))
            d_alone.append(torch.cat([m(s[:, n + k:n + k + 1], d).logits for k in range(4)], 1))
        p_steps, d_steps = [], []
        for k in range(4):
            step = torch.cat([s[:, n + k:n + k + 1] for s, n in zip(seqs, lens)])
            p_steps.append(m(step, pool.bind(sids)).logits)
            d_steps.append(m(step, d_batch).logits)
    together, alone = torch.cat(p_steps, 1), torch.cat(p_alone)
    assert torch.equal(together, torch.cat(d_steps, 1))
    assert torch.equal(alone, torch.cat(d_alone))
    assert_store_equals_dense(pool.bind(sids), d_batch)
    # measured, not asserted equal: the batch-composition effect (fp32 ~1e-1 abs on logits, bf16 ~1e-6 here)
    diff = (together - alone).abs().max().item()
    print(f"batched vs alone, {dtype}: max |logit diff| {diff:.3g}")
    assert torch.isfinite(together).all()


@pytest.mark.parametrize("dtype,deterministic", [(torch.float32, False), (torch.bfloat16, True)])
def test_verify_continuations_read_the_packed_store_and_equal_dense(debug_models, dtype, deterministic):
    """Switched on, continuations of 2..window tokens per row (speculative verifies, plain and ragged) take
    `packed_decode.attend_packed` (a virtual row per query token over the packed ring, pages and index keys) on
    rows at different positions, and equal the dense path on DenseCache bit for bit, logits and stores."""
    from dsv41.kernels.choice import set_packed_verify
    from dsv41.kernels.invariant import set_deterministic
    from dsv41.model import packed_decode
    cfg, models = debug_models
    m = models[dtype]
    lens = [11, 30, 7]
    seqs = torch.cat([tokens(cfg, 1, 60, seed=10 + i) for i in range(len(lens))])
    calls = []
    orig = packed_decode.attend_packed

    def spy(attn, u, *a):
        calls.append(u.shape[:2])
        return orig(attn, u, *a)
    set_deterministic(deterministic)
    set_packed_verify(True)
    packed_decode.attend_packed = spy
    try:
        pool = small_pool(cfg, dtype)
        sids, dense = [], []
        with torch.no_grad():
            for i, n in enumerate(lens):                  # each prefilled alone: the rows sit at different positions
                sids.append(pool.new_sequence())
                dense.append(DenseCache(cfg, 1, dtype))
                for c in (pool.bind([sids[-1]]), dense[-1]):
                    m(seqs[i:i + 1, :n], c)
            d = DenseCache.stack(dense)
            pos = list(lens)
            for T, lengths in ((5, None), (2, None), (cfg.window_size, None), (4, [4, 1, 3]), (6, [2, 6, 5])):
                step = torch.stack([seqs[i, p:p + T] for i, p in enumerate(pos)])
                opts = None if lengths is None else ForwardOptions(lengths=torch.tensor(lengths))
                n_before = len(calls)
                a = m(step, pool.bind(sids), opts=opts).logits
                assert len(calls) > n_before, "the packed verify path was not taken"
                b = m(step, d, opts=None if lengths is None else ForwardOptions(lengths=torch.tensor(lengths))).logits
                assert torch.equal(a, b), (T, lengths)
                pos = [p + T for p in pos]
            assert_store_equals_dense(pool.bind(sids), d)
    finally:
        packed_decode.attend_packed = orig
        set_deterministic(False)
        set_packed_verify(False)
    assert {tuple(s) for s in calls} >= {(3, 5), (3, 2), (3, cfg.window_size)}


def test_small_latents_need_the_exact_main_kv_encoder(debug_models):
    """Latents whose group amax is small get an E4M3 *subnormal* scale, where `qdq_main_kv` is not idempotent
    (pack_main_kv of a QDQ'd value may pick another scale and lose it). Shrink one KV source's compressor norm
    so that happens in the model, and check the packed store still reproduces DenseCache exactly."""
    cfg, _ = debug_models
    src = [s.layer for s in cache_spec(cfg) if s.ratio][0]
    ids = tokens(cfg, 2, 20, seed=5)
    for factor in (0.012, 0.015, 0.02, 0.01, 0.008):       # group amax ~0.01-0.05: subnormal-scale groups
        m = random_model(cfg, seed=1)
        set_tie_break(m, "recent")                          # see debug_models
        with torch.no_grad():
            m.layers[src].attn.compressor.norm.weight.mul_(factor)
        dense = DenseCache(cfg, 2, torch.float32)
        pool = small_pool(cfg)
        view = pool.bind([pool.new_sequence(), pool.new_sequence()])
        for x, y in zip(drive(m, dense, ids, (20,), 3), drive(m, view, ids, (20,), 3)):
            assert torch.equal(x, y)
        assert_store_equals_dense(view, dense)
        stored = dense.ckv[src][:, :int(dense.rows[src].max())]
        lossy = (unpack_main_kv(pack_main_kv(stored)) != stored).any(-1).sum().item()
        if lossy:
            break
    assert lossy > 0, "the test no longer exercises subnormal main-KV scales"


def test_unquantized_values_are_rejected_in_strict_mode(debug_models):
    """With quantization off the values are not representable: the packed store is for quantized models only
    (the engine uses DenseCache otherwise); strict mode says so instead of rounding silently."""
    cfg, _ = debug_models
    m = random_model(cfg, seed=1)
    set_quantization(m, False)
    pool = small_pool(cfg)
    with pytest.raises(ValueError, match="not representable"), torch.no_grad():
        m(tokens(cfg, 1, 6), pool.bind([pool.new_sequence()]))


# ------------------------------------------------------------------------------------------ codecs in the store

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_values_round_trip_through_the_store_encoders(dtype):
    g = torch.Generator().manual_seed(0)
    for scale in (1e-4, 3e-3, 1e-2, 2e-2, 3e-2, 0.1, 1.0, 30.0, 1e3):
        x = (torch.randn(512, 64, generator=g) * scale).to(dtype)
        y = qdq_main_kv(x)
        assert torch.equal(unpack_main_kv(pack_main_kv_exact(y)).to(dtype), y), scale
        y = qdq_index_k(x)
        assert torch.equal(unpack_index_k(pack_index_k(y)).to(dtype), y), scale
        y = qdq_fp8(x)
        assert torch.equal(unpack_swa_kv(pack_swa_kv(y)).to(dtype), y), scale
    # same layout and bytes as the codec wherever the codec is exact (raw inputs, normal-scale QDQ values)
    x = torch.randn(256, 512, generator=g)
    assert torch.equal(pack_main_kv_exact(x), pack_main_kv(x))
    assert torch.equal(pack_main_kv_exact(qdq_main_kv(x)), pack_main_kv(qdq_main_kv(x)))
    z = torch.zeros(3, 32)
    z[1] = -0.0
    assert torch.equal(unpack_main_kv(pack_main_kv_exact(z)).signbit(), z.signbit())


def test_storage_is_packed_uint8_records():
    cfg = load_config("v41-flash")
    pool = PackedKVPool(cfg)
    assert pool.global_layers, "v41-flash has KV sources"
    for pl in pool.global_layers.values():
        assert pl.data["main"].dtype == torch.uint8 and pl.data["main"].shape[1:] == (64, 288)
        assert pl.data["index"].dtype == torch.uint8 and pl.data["index"].shape[1:] == (64, 68)
    for L, t in pool.swa.items():
        assert t.dtype == torch.uint8 and t.shape[1:] == (cfg.window_size, 528)
    assert set(pool.swa) == set(range(cfg.total_layers))                        # DSpark stages too
    assert (main_kv_bytes(512), index_k_bytes(128), swa_kv_bytes(512)) == (288, 68, 528)
    for L, (kv, sc) in pool.pending.items():
        assert kv.dtype == sc.dtype == torch.float32 and kv.shape[1:] == (2, 512)
        assert pool.specs[L].ratio == 2


# ------------------------------------------------------------------------------------------ accounting, pages

@pytest.mark.parametrize("name", PRESETS)
def test_measured_global_bytes_per_token_equals_analytic(name):
    cfg = load_config(name)
    N = 2048
    r = bench_kv(name, N)
    analytic = global_kv_bytes_per_token(cfg)
    assert Fraction(r["global_bytes"], N) == analytic
    assert r["measured_global_bytes_per_token"] == r["analytic_global_bytes_per_token"]
    if name.startswith("v41"):
        assert r["measured_global_bytes_per_token"] == 890
        assert r["global_main_bytes"] == 288 * N * 5 // 2 and r["global_index_bytes"] == 68 * N * 5 // 2
    assert r["swa_bytes"] == r["analytic_swa_bytes"]
    assert r["pending_bytes"] == r["analytic_pending_bytes"]
    assert r["global_bytes"] <= r["allocated_global_bytes"] < r["global_bytes"] + len(r["by_layer"]) * 64 * 356
    assert r["checked_entries"] > 0


def test_pages_per_sequence_free_fork_and_growth():
    cfg = load_config("tiny")
    pool = PackedKVPool(cfg, page_size=16, initial_pages=1, initial_slots=1)
    a = pool.new_sequence()
    fill_random(pool, a, 300)
    before = pool.seq_bytes(a)
    for L, pl in pool.global_layers.items():                                     # lazily, ceil(entries / P) pages
        assert len(pool.seqs[a].pages[L]) == -(-(300 // pl.spec.ratio) // 16)
    entry = main_kv_bytes(cfg.head_dim) + index_k_bytes(cfg.index_head_dim)
    assert pool.global_bytes_per_token(a) == Fraction(sum(300 // pl.spec.ratio * entry
                                                          for pl in pool.global_layers.values()), 300)
    # unrelated sequences do not change a's pages or bytes; the pool grew past its initial capacity
    b = pool.new_sequence()
    fill_random(pool, b, 1000, seed=1)
    c = pool.new_sequence()
    assert pool.seq_bytes(a) == before
    assert pool.seq_bytes(c)["global_allocated_bytes"] == 0 and pool.seq_bytes(c)["tokens"] == 0
    assert all(pl.n_pages > 1 for pl in pool.global_layers.values()) and pool.n_slots >= 3
    # free returns pages, a new sequence reuses them without growing
    held = pool.pool_bytes()
    pages_b = pool.seq_bytes(b)["global_pages"]
    cap = {L: pl.n_pages for L, pl in pool.global_layers.items()}
    pool.free(b)
    assert pool.pool_bytes()["global_pages_allocated"] == held["global_pages_allocated"] - pages_b
    d = pool.new_sequence()
    fill_random(pool, d, 1000, seed=2)
    assert {L: pl.n_pages for L, pl in pool.global_layers.items()} == cap
    # fork copies everything (a fresh view of the copy reads the same values)
    e = pool.fork(a)
    va, ve = pool.bind([a]), pool.bind([e])
    for L in pool.global_layers:
        n = torch.tensor([300 // pool.specs[L].ratio])
        assert torch.equal(va.compressed(L, n), ve.compressed(L, n))
        assert torch.equal(va.index_k(L, n), ve.index_k(L, n))
    for L in pool.specs:
        assert torch.equal(va.window_ring(L), ve.window_ring(L))
    assert pool.seq_bytes(e) == pool.seq_bytes(a)
    assert not set(pool.seqs[e].pages[2]) & set(pool.seqs[a].pages[2])
    with pytest.raises(ValueError):
        pool.bind([a, a])
    with pytest.raises(ValueError):
        pool.free(b)


def test_bench_kv_cli():
    from dsv41 import cli

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["bench", "kv", "--config", "v41-geometry", "--tokens", "4K", "--json"]) == 0
    r = json.loads(buf.getvalue())
    assert r["tokens"] == 4096 and r["config"] == "v41-geometry"
    assert r["measured_global_bytes_per_token"] == r["analytic_global_bytes_per_token"] == 890
    for k in ("swa_bytes", "pending_bytes", "global_bytes", "allocated_global_bytes"):
        assert isinstance(r[k], int)


@pytest.mark.gpu
def test_packed_store_on_cuda_equals_dense():
    """The same bit-identity with the model, DenseCache and the pool on a GPU (the exact main-KV encoder takes its
    no-sync path there)."""
    class DenseOnCuda(DenseCache):
        """DenseCache adds the model's row0 (CPU, from the positions) to its count (on the GPU) and fails there;
        the reference gets both on the CPU. The packed view takes them as they come."""

        def append_compressed(self, layer, row0, kv, count):
            super().append_compressed(layer, row0.cpu(), kv, count.cpu())

        def append_index_k(self, layer, row0, k, count):
            super().append_index_k(layer, row0.cpu(), k, count.cpu())

    cfg = load_config("debug")
    m = random_model(cfg, seed=1).cuda()
    set_tie_break(m, "recent")                              # see debug_models
    ids = tokens(cfg, 2, 14, seed=3).cuda()
    dense = DenseOnCuda(cfg, 2, torch.float32, "cuda")
    pool = small_pool(cfg, device="cuda")
    view = pool.bind([pool.new_sequence(), pool.new_sequence()])
    for x, y in zip(drive(m, dense, ids, (9, 5), 3), drive(m, view, ids, (9, 5), 3)):
        assert torch.equal(x, y)
    assert_store_equals_dense(view, dense)
    assert all(t.is_cuda for pl in pool.global_layers.values() for t in pl.data.values())
    x = qdq_main_kv(torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02)
    assert torch.equal(pack_main_kv_exact(x.cuda()).cpu(), pack_main_kv_exact(x))
    assert torch.equal(unpack_main_kv(pack_main_kv_exact(x.cuda())).cpu(), x)


@pytest.mark.gpu
def test_packed_decode_kernels_match_their_references_in_the_model():
    """bf16 on a GPU: every layer's `sparse_attn_packed` / `indexer_topk_packed` call of a real decode step (inputs
    captured from the model's packed decode path) gives what the torch references give: attention up to bf16
    summation order, the same top-k selections. (Whole-model logits are not compared: with FP8/FP4 quantization on,
    summation-order differences flip quantized values and this random model amplifies them to ~0.1; see
    benchmarks/gpu_decode_check.py.)"""
    import dsv41.kernels as K
    from dsv41.kernels.triton import indexer_topk_packed_triton, sparse_attn_packed_triton
    from dsv41.model import packed_decode
    cfg = load_config("tiny")
    m = random_model(cfg, dtype=torch.bfloat16, seed=1, device="cuda")
    set_tie_break(m, "recent")
    ids = tokens(cfg, 2, 300, seed=4).cuda()
    calls = {"attn": [], "idx": []}
    orig_attn, orig_idx = packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed

    def cap_attn(*a):
        calls["attn"].append(a)
        return orig_attn(*a)

    def cap_idx(*a, **kw):
        calls["idx"].append((a, kw))
        return orig_idx(*a, **kw)

    pool = PackedKVPool(cfg, device="cuda", dtype=torch.bfloat16)
    sids = [pool.new_sequence(), pool.new_sequence()]
    with torch.no_grad():
        m(ids[:, :290], pool.bind(sids))
        packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed = cap_attn, cap_idx
        try:
            m(ids[:, 290:291], pool.bind(sids))
        finally:
            packed_decode.sparse_attn_packed, packed_decode.indexer_topk_packed = orig_attn, orig_idx
        assert len(calls["attn"]) == cfg.n_layers and calls["idx"]
        for a in calls["attn"]:
            r, t = K.sparse_attn_packed_ref(*a).float(), sparse_attn_packed_triton(*a).float()
            assert ((t - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max() < 1e-2
        for a, kw in calls["idx"]:
            r, t = K.indexer_topk_packed_ref(*a, **kw), indexer_topk_packed_triton(*a, **kw)
            assert torch.equal(r[0], t[0])
            assert (r[1] is None) == (t[1] is None) and (r[1] is None or torch.equal(r[1], t[1]))
