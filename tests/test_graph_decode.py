"""The decode step of fixed shapes (`dsv41.engine.graphs`): its eager twin (the very code a CUDA graph captures,
run eagerly on the CPU) equals the ordinary decode step, and it reads nothing back to the host.

The sync guard patches the tensor methods that read a tensor's values on the host (`item`, `__int__`, `__bool__`,
`__float__`, `__index__`, `tolist`, `numpy`, `.cpu()`, `.to("cpu")`): on a GPU each is a host synchronisation
(of a device tensor).
On the CPU every tensor is a host tensor, so the guard sees every such read (a superset of the GPU's syncs). Kernel
ops (`dsv41.kernels`' dispatch) count as one opaque call: on a GPU their Triton twins run, which read nothing
for the arguments the model passes; the packed main-KV encoder reads its codec check only on the CPU.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.graphs import BUCKETS, DecodeGraphs, bucket_for
from dsv41.engine.sampling import SamplingParams
from dsv41.kernels.invariant import deterministic
from dsv41.kv import PackedKVPool
from dsv41.model.attention import set_tie_break
from dsv41.model.engram import DEAD
from dsv41.model.init import random_model

READS = ("item", "__int__", "__bool__", "__float__", "__index__", "tolist", "numpy", "cpu")
# frames inside which reads are not the step's own: kernel ops (sync-free Triton twins on a GPU) and the codec
# check `pack_main_kv_exact` makes only for CPU tensors
EXEMPT = {("kernels/__init__.py", "_dispatch"), ("codecs/fp4.py", "pack_main_kv_exact")}


class SyncGuard:
    """Counts (or raises on) host reads of tensor values, by read and by the innermost dsv41 source lines."""

    def __init__(self, raise_on_read: bool = False):
        self.raise_on_read, self.hits, self.depth = raise_on_read, collections.Counter(), 0

    def _site(self) -> str | None:
        """The dsv41 call site of a read (None: inside an exempt frame)."""
        f, lines = sys._getframe(2), []
        while f is not None:
            name = f.f_code.co_filename.split("/dsv41/")[-1] if "/dsv41/" in f.f_code.co_filename else None
            if name is not None:
                if (name, f.f_code.co_name) in EXEMPT:
                    return None
                if len(lines) < 3:
                    lines.append(f"{name}:{f.f_lineno}")
            f = f.f_back
        return " < ".join(lines) or "?"

    def _wrap(self, name, orig):
        guard = self

        def read(t, *a, **k):
            # `.to("cpu")`: a device result brought to the host (`.to(x.device)` is the compute device's)
            counts = name != "to" or k.get("device", a[0] if a else None) == "cpu"
            if guard.depth == 0 and counts:
                site = guard._site()
                if site is not None:
                    guard.hits[(name, site)] += 1
                    if guard.raise_on_read:
                        raise RuntimeError(f"host read {name} at {site}")
            guard.depth += 1
            try:
                return orig(t, *a, **k)
            finally:
                guard.depth -= 1
        return read

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in READS + ("to",)}
        for n, orig in self.saved.items():
            setattr(torch.Tensor, n, self._wrap(n, orig))
        return self

    def __exit__(self, *exc):
        for n, orig in self.saved.items():
            setattr(torch.Tensor, n, orig)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny")
    model = random_model(cfg, seed=3)
    set_tie_break(model, "recent")                 # selections independent of the score tensor's width
    return cfg, model


def prefilled(model, cfg, lengths, seed=0):
    """A pool (pages of 4 entries: page boundaries everywhere) holding one prefilled sequence per length, plus a
    sequence resumed from the first one's prefix of 64 tokens (exported and imported: prefix reuse)."""
    pool = PackedKVPool(cfg, page_size=4, initial_pages=1, initial_slots=1)
    gen = torch.Generator().manual_seed(seed)
    sids = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            sid = pool.new_sequence()
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
            if i == 0:
                model(ids[:, :64], pool.bind([sid]))
                g, swa = pool.export_global(sid, 64), pool.export_swa(sid)
                model(ids[:, 64:], pool.bind([sid]))
                copy = pool.new_sequence()
                pool.import_global(copy, g)
                pool.import_swa(copy, swa)
                sids.append(copy)
            else:
                model(ids, pool.bind([sid]))
            sids.append(sid)
    return pool, sids


def decode_both(model, cfg, steps, plan, det: bool):
    """Teacher-forced decode steps on two equal pools, eager vs the static step; plan(step) -> row indices taking
    part. Returns the logits of every step from both, and the two pools."""
    pools = [prefilled(model, cfg, (70, 5, 37)) for _ in range(2)]
    graphs = DecodeGraphs(model, pools[1][0], max_seq_len=256, capture=False, min_span=32)
    gen = torch.Generator().manual_seed(1)
    out = ([], [])
    with torch.no_grad(), deterministic(det):
        for step in range(steps):
            rows = plan(step)
            ids = torch.randint(0, cfg.vocab_size, (len(rows), 1), generator=gen)
            for k, (pool, sids) in enumerate(pools):
                view = pool.bind([sids[r] for r in rows])
                res = graphs.forward(ids, view) if k else model(ids, view, last_only=True)
                out[k].append(res.logits[:, -1])
    return out, pools, graphs


def every_row_then_some(step):
    """All four rows (bucket 4), then three (padded to 4), two (bucket 2), one, and all again."""
    return [[0, 1, 2, 3], [0, 1, 3], [2, 3], [1], [0, 1, 2, 3]][min(4, step // 9)]


def assert_same_store(pa, pb, sids):
    for sid in sids:
        a, b = pa.seqs[sid], pb.seqs[sid]
        assert (a.pos, a.rows, a.index_k_publisher) == (b.pos, b.rows, b.index_k_publisher)
        assert torch.equal(a.engram_history, b.engram_history)
        ga, gb = pa.export_global(sid, a.pos), pb.export_global(sid, b.pos)
        for la, lb in zip(ga.layers, gb.layers):
            for name in ("main", "index", "carry_kv", "carry_score"):
                assert torch.equal(getattr(la, name), getattr(lb, name)), (sid, la.layer, name)
        assert all(torch.equal(pa.export_swa(sid).rings[L], pb.export_swa(sid).rings[L]) for L in pa.swa)


def test_eager_twin_equals_decode_bit_for_bit_in_deterministic_mode(tiny):
    """Rows at different positions (one resumed from another's prefix), many steps across group and page
    boundaries, the batch shrinking and padded to its bucket, context spans (page-table widths) changing: the deterministic mode's row-invariant kernels make
    padding and the fixed widths invisible, so logits and the whole store are equal bit for bit."""
    cfg, model = tiny
    (eager, static), pools, graphs = decode_both(model, cfg, 45, every_row_then_some, det=True)
    for a, b in zip(eager, static):
        assert torch.equal(a, b)
    assert_same_store(pools[0][0], pools[1][0], pools[0][1])
    assert sorted({rows for rows, _ in graphs.buckets}) == [1, 2, 4]
    assert len({span for _, span in graphs.buckets}) >= 2          # page tables of two widths


def test_eager_twin_equals_decode_in_default_mode(tiny):
    """The default kernels: padding changes the GEMMs' row counts, and the score / list widths are the capacity's,
    so equality holds up to the summation order (1e-5 relative, fp32)."""
    cfg, model = tiny
    (eager, static), pools, _ = decode_both(model, cfg, 45, every_row_then_some, det=False)
    for a, b in zip(eager, static):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    pa, pb = pools[0][0], pools[1][0]
    for sid in pools[0][1]:
        assert (pa.seqs[sid].pos, pa.seqs[sid].rows) == (pb.seqs[sid].pos, pb.seqs[sid].rows)


def test_engine_with_static_steps_equals_eager_engine(tiny):
    """Through the engine (continuous batching: prompts join and finish at different steps, buckets change),
    deterministic mode: the same tokens and log-probabilities bit for bit."""
    cfg, model = tiny
    prompts = ["hello world, this is a prompt", "x", "def fib(n):\n    return n" * 3, "the quick brown fox " * 4,
               "abc"]
    params = [SamplingParams(max_tokens=n, logprobs=2) for n in (30, 12, 25, 40, 7)]
    runs = []
    for graphs in (False, True):
        eng = Engine(model, max_batch=4, cuda_graphs=graphs, deterministic=True, kv_page_size=4)
        runs.append(eng.generate(prompts, params))
        assert (eng.graphs is not None) == graphs
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    set_tie_break(model, "recent")


def test_engine_prefix_reuse_with_static_steps(tiny, tmp_path):
    """Prompts resumed from the prefix cache (SWA snapshot hits) decode with the static step exactly as eagerly
    (deterministic mode: bit for bit)."""
    cfg, model = tiny
    base = "The shared prefix of every request goes on for a while, long enough to pass the window. " * 2
    prompts = [base + s for s in ("one", "two two", "three three three")]
    runs = []
    for graphs in (False, True):
        eng = Engine(model, max_batch=4, cuda_graphs=graphs, deterministic=True, kv_page_size=4,
                     cache_dir=tmp_path / str(graphs), swa_pool="memory")
        runs.append([c for ps in (prompts, prompts[::-1]) for c in eng.generate(ps, SamplingParams(max_tokens=10,
                                                                                                   logprobs=2))])
    paths = [[c.stats["cache_path"] for c in r] for r in runs]
    assert paths[0] == paths[1] and paths[1][3:] == ["swa-hit"] * 3
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    set_tie_break(model, "recent")


@pytest.fixture(scope="module")
def tiny_host_engram(tiny):
    """The tiny model with its Engram tables packed and held in host memory (`PackedTable.host`)."""
    import copy
    cfg, model = tiny
    model = copy.deepcopy(model)
    for b in model.layers:
        if b.engram is not None:
            b.engram.pack()
            b.engram.embed.host = True
    return cfg, model


def test_static_step_with_host_engram_tables(tiny_host_engram, monkeypatch):
    """Engram tables in host memory: the static step hashes the step's ids on the host and stages only the named
    rows into the bucket's buffers, which its lookups read; bit for bit the eager step (deterministic mode), the
    whole store too. Staged from a wrong history (all DEAD), the logits differ: the staged rows are the ones read."""
    from dsv41.model.engram import PackedTable
    cfg, model = tiny_host_engram
    staged = collections.Counter()
    stage = PackedTable.stage
    monkeypatch.setattr(PackedTable, "stage", lambda self, *a: (staged.update([id(self)]), stage(self, *a))[1])
    (eager, static), pools, graphs = decode_both(model, cfg, 20, every_row_then_some, det=True)
    assert len(graphs._host_engrams) == len(cfg.engram_layer_ids) > 0
    assert sorted(staged.values()) == [20] * len(cfg.engram_layer_ids)
    for a, b in zip(eager, static):
        assert torch.equal(a, b)
    assert_same_store(pools[0][0], pools[1][0], pools[0][1])

    real = DecodeGraphs._engram_rows

    def dead_history(self, bucket, ids):
        bucket.store.history.fill_(DEAD)
        real(self, bucket, ids)
    monkeypatch.setattr(DecodeGraphs, "_engram_rows", dead_history)
    (eager, static), _, _ = decode_both(model, cfg, 3, every_row_then_some, det=True)
    assert not all(torch.equal(a, b) for a, b in zip(eager, static))


@pytest.mark.parametrize("host_tables", [False, True])
def test_static_step_reads_nothing_on_the_host(tiny, tiny_host_engram, host_tables, monkeypatch):
    """The sync guard around the model's forward: the eager step reads values on the host (the census below
    pins the kinds), the static step none (with Engram tables in host memory too: their rows are staged before)."""
    from dsv41.model import moe
    monkeypatch.setattr(moe, "fused_moe", lambda x: True)         # the experts op, as on a GPU
    cfg, model = tiny_host_engram if host_tables else tiny
    pool, sids = prefilled(model, cfg, (70, 5, 37))
    graphs = DecodeGraphs(model, pool, max_seq_len=256, capture=False)
    ids = torch.zeros(3, 1, dtype=torch.long)
    run = graphs._run
    guard = SyncGuard()

    def guarded(bucket):
        with guard:
            return run(bucket)
    graphs._run = guarded
    with torch.no_grad():
        for _ in range(3):                               # group completions of m = 2 in both parities
            graphs.forward(ids, pool.bind(sids[:3]))
    assert not guard.hits, dict(guard.hits)
    census = SyncGuard()
    with torch.no_grad(), census:
        model(ids, pool.bind(sids[:3]), last_only=True)
    sites = " ".join(site for _, site in census.hits)
    # the visible-entry widths, the compressor's groups, the store's host bookkeeping
    for where in ("model/packed_decode.py", "model/attention.py", "kv/batch_view.py"):
        assert where in sites, dict(census.hits)


def test_buckets():
    assert [bucket_for(b) for b in (1, 2, 3, 5, 32, 33)] == [1, 2, 4, 8, 32, 64]
    with pytest.raises(ValueError, match="at most"):
        bucket_for(BUCKETS[-1] + 1)


# ------------------------------------------------------------------------------------------ GPU

def _cuda_tiny(seed=3):
    cfg = load_config("tiny")
    model = random_model(cfg, dtype=torch.bfloat16, seed=seed, device="cuda")
    set_tie_break(model, "recent")
    return cfg, model


@pytest.mark.gpu
@pytest.mark.xfail(strict=False, reason="H100, 2026-12-05: rows are bit-equal step after step until one row departs "
                   "(0.15 / 0.35 / 0.25 at steps 37 / 3 / 40 for 1 / 3 / 8 rows, over the 2e-2 x (1 + max|logit|) "
                   "bound): the two paths write their own KV, so one FP8 rounding flipped by the capacity-wide lists' "
                   "order stays in that row's state; the engine's greedy long run through graphs equals eager "
                   "(test_engine_cuda_graphs_long_run_equals_eager passed)")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_captured_replay_equals_eager_on_cuda(rows):
    """bf16 on the GPU, teacher-forced, rows at different positions, buckets 1 / 4 (padded) / 8: the replayed
    graph against the eager step. Stated tolerance: logits within 2e-2 x (1 + max |logit|) (bf16 roundings of the
    capacity-wide lists), the greedy token equal wherever the eager top two differ by more than that."""
    cfg, model = _cuda_tiny()
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(1, 300, (rows,), generator=gen)]
    states = []
    for _ in range(2):
        pool = PackedKVPool(cfg, device="cuda", dtype=torch.bfloat16, page_size=64)
        sids = [pool.new_sequence() for _ in lengths]
        with torch.no_grad():
            for sid, n in zip(sids, lengths):
                model(torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).cuda(),
                      pool.bind([sid]))
        states.append((pool, sids))
    graphs = DecodeGraphs(model, states[1][0], max_seq_len=2048)
    with torch.no_grad():
        for step in range(200):
            ids = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen).cuda()
            a = model(ids, states[0][0].bind(states[0][1]), last_only=True).logits[:, -1].float()
            b = graphs.forward(ids, states[1][0].bind(states[1][1])).logits[:, -1].float()
            tol = 2e-2 * (1 + float(a.abs().max()))
            assert float((a - b).abs().max()) <= tol, step
            top2 = a.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > tol
            assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear]), step
    assert graphs.failure is None and graphs.captures >= 1 and bucket_for(rows) in {r for r, _ in graphs.buckets}


@pytest.mark.gpu
def test_engine_cuda_graphs_long_run_equals_eager():
    """The engine on the GPU, graphs on by default, greedy, 5 prompts through max_batch 4 (joins, finishes,
    buckets 1-4), 160 tokens each: the same tokens as the eager engine (bf16: the share equal is asserted >= 0.95
    and printed, as both paths' roundings may part at a near tie)."""
    cfg, model = _cuda_tiny()
    prompts = ["hello world", "x" * 100, "def f(x):\n  return x" * 5, "abc", "the quick brown fox " * 10]
    params = [SamplingParams(max_tokens=160, ignore_eos=True) for _ in prompts]
    runs = []
    for g in (False, None):
        eng = Engine(model, max_batch=4, cuda_graphs=g)
        assert (eng.graphs is None) == (g is False)
        runs.append([c.output_ids for c in eng.generate(prompts, params)])
        assert eng.graphs is None or (eng.graphs.failure is None and eng.graphs.capture and eng.graphs.captures)
    same = sum(x == y for a, b in zip(*runs) for x, y in zip(a, b)) / sum(len(a) for a in runs[0])
    print(f"graph vs eager greedy tokens equal: {same:.4f}")
    assert same >= 0.95


@pytest.mark.gpu
def test_engine_cuda_graphs_with_host_engram_tables():
    """The engine on the GPU, graphs on, Engram tables pinned in host memory (rows staged before each replay)
    against the same model with its tables on the device: the same row bytes reach the same kernels, so the
    greedy tokens are equal."""
    import copy
    from dsv41.model.packed_weights import engram_tables_on_host
    cfg = load_config("tiny")
    base = random_model(cfg, dtype=torch.bfloat16, seed=3)
    for b in base.layers:
        if b.engram is not None:
            b.engram.pack()
    models = [copy.deepcopy(base).cuda(), engram_tables_on_host(copy.deepcopy(base)).cuda()]
    assert models[1].layers[cfg.engram_layer_ids[0]].engram.embed.weight.device.type == "cpu"
    prompts = ["hello world", "def f(x):\n  return x" * 5, "the quick brown fox " * 10]
    runs = []
    for model in models:
        set_tie_break(model, "recent")
        eng = Engine(model, max_batch=4)
        runs.append([c.output_ids for c in eng.generate(prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * 3)])
        assert eng.graphs is not None and eng.graphs.failure is None and eng.graphs.captures
    assert runs[0] == runs[1]
