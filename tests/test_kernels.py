"""Guards the kernels: the packed-store references against the model's dense math (CPU, exact), the backend
switch, and (marked gpu) the Triton kernels against their references on fresh random inputs at several shapes:
ragged lengths, -1 indices, empty selections, split and unsplit index lists, a candidate pool smaller than the
context, every index width the indexer's kernels take (v3, its v2 fallback, v1 above 128 channels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv41.codecs import pack_index_k, pack_main_kv, pack_swa_kv, qdq_index_q, unpack_index_k, unpack_main_kv
from dsv41.codecs import unpack_swa_kv
from dsv41.kernels import backend as kb
from dsv41.kernels import (candidate_pool, decode_window_rows, indexer_scores_packed_ref, indexer_topk_packed_ref,
                           sparse_attn, sparse_attn_packed_ref, sparse_attn_ref)
from dsv41.model.attention import Indexer, window_indices


# ------------------------------------------------------------------------------------------ case builders

def _pages(n_vis: list[int], P: int, gen: torch.Generator, spare: int = 3):
    """A shuffled page assignment: page_table [B, MP] int32 and the page count."""
    need = [-(-n // P) for n in n_vis]
    n_pages = sum(need) + spare
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.zeros(len(n_vis), max(1, max(need)), dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at:at + k].int()
        at += k
    return table, n_pages


def _scatter(records: list[torch.Tensor], table: torch.Tensor, n_pages: int, P: int, nbytes: int,
             gen: torch.Generator) -> torch.Tensor:
    """Pages uint8 [n_pages, P, nbytes] holding each row's records at its page-table slots; the rest random
    valid-looking bytes (scale bytes small, so garbage decodes finitely) that a correct kernel never reads."""
    pages = torch.randint(0, 0x70, (n_pages, P, nbytes), generator=gen, dtype=torch.uint8)
    for b, rec in enumerate(records):
        e = torch.arange(rec.size(0))
        pages[table[b, e // P].long(), e % P] = rec
    return pages


def attn_case(B=3, H=8, D=64, W=32, K=80, P=16, n_entries=(200, 37, 0), pos=(300, 20, 5), empty_rows=(),
              floor=None, device="cpu", seed=0):
    """Random decode inputs in the pool's packed layout, plus the dense tensors the model would hold.

    Row b sits at position pos[b] with n_entries[b] compressed entries; its top-k picks min(K, n) distinct
    entries (ascending, -1 tail), none for rows in empty_rows."""
    gen = torch.Generator().manual_seed(seed)
    S = B + 2
    slots = torch.randperm(S, generator=gen)[:B]
    ring_after = pack_swa_kv(torch.randn(S, W, D, generator=gen))                    # the pool's ring after the write
    ring_before = ring_after.clone()                                                  # before: slot pos % W is older
    pos_t = torch.tensor(pos)
    ring_before[slots, pos_t % W] = pack_swa_kv(torch.randn(B, D, generator=gen))
    table, n_pages = _pages(list(n_entries), P, gen)
    mains = [pack_main_kv(torch.randn(n, D, generator=gen) * 0.5) for n in n_entries]
    pages = _scatter(mains, table, n_pages, P, D // 2 + D // 16, gen)
    topk = torch.full((B, K), -1, dtype=torch.int32)
    for b, n in enumerate(n_entries):
        if n and b not in empty_rows:
            k = min(K, n)
            topk[b, :k] = torch.randperm(n, generator=gen)[:k].sort().values.int()
    q = torch.randn(B, H, D, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    fl = None if floor is None else torch.tensor(floor)
    win = decode_window_rows(pos_t, W, fl)
    c = SimpleNamespace(q=q, ring=ring_after, slots=slots, win=win, pages=pages, table=table, topk=topk, sink=sink,
                        scale=D ** -0.5, ring_before=ring_before, mains=mains, pos=pos_t, floor=fl, W=W)
    for k in ("q", "ring", "slots", "win", "pages", "table", "topk", "sink"):
        setattr(c, k, getattr(c, k).to(device))
    return c


def attn_args(c):
    return c.q, c.ring, c.slots, c.win, c.pages, c.table, c.topk, c.sink, c.scale


def index_case(B=3, J=8, I=64, P=16, n_vis=(150, 40, 3), device="cpu", seed=0):
    """Random packed index keys (pool layout), MXFP4-QDQ'd queries and bf16 head weights of one decode query."""
    gen = torch.Generator().manual_seed(seed)
    table, n_pages = _pages(list(n_vis), P, gen)
    recs = [pack_index_k(torch.randn(n, I, generator=gen)) for n in n_vis]
    pages = _scatter(recs, table, n_pages, P, I // 2 + I // 32, gen)
    q = qdq_index_q(torch.randn(B, J, I, generator=gen)).bfloat16()
    w = (torch.randn(B, J, generator=gen) / 8).bfloat16()
    c = SimpleNamespace(q=q, w=w, pages=pages, table=table, n_vis=torch.tensor(n_vis), recs=recs)
    for k in ("q", "w", "pages", "table", "n_vis"):
        setattr(c, k, getattr(c, k).to(device))
    return c


def blocks_to_mask(blocks: torch.Tensor, N: int, bs: int) -> torch.Tensor:
    mask = torch.zeros(blocks.size(0), -(-N // bs) + 1, dtype=torch.bool)
    b = blocks.long().cpu()
    mask.scatter_(1, torch.where(b >= 0, b, mask.size(1) - 1), True)
    return mask[:, :-1].repeat_interleave(bs, dim=1)[:, :N]


# ------------------------------------------------------------------------------------------ CPU: the references

@pytest.mark.parametrize("kw", [
    {},                                                                   # ragged rows, a row with no entries
    dict(B=2, K=150, n_entries=(400, 90), pos=(10, 900), W=64),          # window -1s at the ring start; K > 128
    dict(B=2, n_entries=(60, 60), pos=(100, 100), empty_rows=(0, 1), floor=(95, 0)),   # empty top-k, replay floor
])
def test_sparse_attn_packed_ref_is_the_model_decode(kw):
    """The packed reference equals sparse_attn_ref over the KV the model holds at decode: [ring before the write
    || this token's row || all compressed entries], with the model's window list and top-k + offset."""
    c = attn_case(**kw)
    B, W = c.q.size(0), c.W
    N = max(m.size(0) for m in c.mains)
    comp = torch.zeros(B, N, c.q.size(-1))
    for b, m in enumerate(c.mains):
        comp[b, :m.size(0)] = unpack_main_kv(m)
    chunk = unpack_swa_kv(c.ring[c.slots, c.pos % W]).unsqueeze(1)
    kv = torch.cat([unpack_swa_kv(c.ring_before[c.slots]), chunk, comp], dim=1).bfloat16()
    widx = window_indices(c.pos, 1, W, False, c.floor)[:, 0]
    cidx = torch.where(c.topk >= 0, c.topk + W + 1, -1)
    dense = sparse_attn_ref(c.q.unsqueeze(1), kv, c.sink, torch.cat([widx, cidx], -1).int().unsqueeze(1),
                            c.scale)[:, 0]
    out = sparse_attn_packed_ref(*attn_args(c))
    assert out.dtype == torch.bfloat16 and out.shape == c.q.shape
    assert torch.equal(out, dense)
    for b in kw.get("empty_rows", ()):               # only the window left: the window part alone
        assert out[b].abs().sum() > 0


def test_sparse_attn_packed_ref_all_empty_is_zero():
    c = attn_case(B=2, n_entries=(30, 0), pos=(50, 3), empty_rows=(0,))
    c.win = torch.full_like(c.win, -1)
    assert torch.equal(sparse_attn_packed_ref(*attn_args(c)), torch.zeros_like(c.q))


def test_decode_window_rows_match_model_lists():
    pos, W = torch.tensor([0, 5, 31, 32, 1000]), 32
    rows = decode_window_rows(pos, W, torch.tensor([0, 0, 10, 0, 990]))
    model = window_indices(pos, 1, W, False, torch.tensor([0, 0, 10, 0, 990]))[:, 0]
    # the model addresses this token as chunk row W; the ring after the write holds it at pos % W
    assert torch.equal(torch.where(model == W, (pos % W).view(-1, 1), model).int(), rows)


def _model_select(c, topk, ties, source=False, cand=None, blocks=0, bs=8):
    """The model's Indexer.select on the dense keys (what the cache's index_k returns) for one decode query."""
    N = int(c.n_vis.max())
    keys = torch.zeros(c.q.size(0), N, c.q.size(-1))
    for b, r in enumerate(c.recs):
        keys[b, :r.size(0)] = unpack_index_k(r)
    me = SimpleNamespace(role=SimpleNamespace(is_candidate_source=source), cand_blocks=blocks, cand_size=bs,
                         ties=ties, topk=topk)
    idx, mask = Indexer.select(me, c.q.unsqueeze(1), keys.bfloat16(), c.w.unsqueeze(1), c.n_vis.view(-1, 1, 1),
                               None if cand is None else cand.unsqueeze(1))
    return idx[:, 0], None if mask is None else mask[:, 0]


@pytest.mark.parametrize("n_vis", [(150, 40, 3), (64, 64, 64), (300, 0, 17)])
def test_indexer_topk_packed_ref_is_the_model_indexer(n_vis):
    """Full, candidate-source and Reindex modes equal the model's Indexer.select (ties='recent': exact ids), with
    a pool (6 blocks of 4 = 24 entries) smaller than the context and than some rows."""
    c = index_case(n_vis=n_vis)
    topk, blocks, bs = 10, 6, 4
    want, _ = _model_select(c, topk, "recent")
    got, pool = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, topk, ties="recent")
    assert pool is None and torch.equal(got, want)
    want, mask = _model_select(c, topk, "recent", source=True, blocks=blocks, bs=bs)
    got, pool = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, topk, pool_blocks=blocks,
                                        block_size=bs, ties="recent")
    assert torch.equal(got, want)
    assert torch.equal(blocks_to_mask(pool, mask.size(-1), bs), mask)
    c2 = index_case(n_vis=n_vis, seed=1)                 # a Reindex layer: its own q, w over the source's keys
    c2.pages, c2.table, c2.recs = c.pages, c.table, c.recs
    want, _ = _model_select(c2, topk, "recent", cand=mask)
    got, _ = indexer_topk_packed_ref(c2.q, c2.w, c2.pages, c2.table, c2.n_vis, topk, cand_blocks=pool,
                                     block_size=bs, ties="recent")
    assert torch.equal(got, want)
    # official ties: the same selected scores (the set may differ only inside exact ties)
    full = indexer_scores_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis)
    want, _ = _model_select(c, topk, "official")
    got, _ = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, topk)
    assert torch.equal(_picked(full, got), _picked(full, want))
    assert torch.equal(indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, topk, n_max=max(n_vis))[0], got)


def _picked(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sorted scores of the selected ids per row (-1 -> -inf): equal for selections that differ only in ties."""
    s = scores.gather(1, ids.long().clamp_min(0)).masked_fill(ids < 0, -torch.inf)
    return s.sort(dim=1).values


def test_indexer_empty_context():
    c = index_case(B=2, n_vis=(0, 0))
    idx, pool = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, 8, pool_blocks=4, block_size=4)
    assert idx.shape == (2, 0) and pool.shape == (2, 0)


def test_candidate_pool_pins_newest_block():
    s = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.5, -torch.inf, -torch.inf]])
    assert candidate_pool(s, torch.tensor([6]), 1, 2).tolist() == [[2]]      # block 2 holds entry 5: pinned
    assert candidate_pool(s, torch.tensor([6]), 2, 2).tolist() == [[0, 2]]


# ------------------------------------------------------------------------------------------ CPU: the switch

def test_backend_switch(restore_backend, monkeypatch):
    with pytest.raises(ValueError):
        kb.set_backend("cuda")
    kb.set_backend("torch")
    assert kb.get_backend() == "torch" and kb.resolve("x", [torch.zeros(1)]) == "torch"
    kb.set_backend("auto")
    assert kb.resolve("x", [torch.zeros(1)]) == "torch"                     # CPU tensors: the reference
    monkeypatch.setitem(kb._state, "triton", False)
    monkeypatch.setitem(kb._state, "triton_error", "ImportError: none here")
    with pytest.raises(RuntimeError, match="triton"):
        kb.set_backend("triton")
    monkeypatch.setitem(kb._state, "triton", True)                          # present, but CPU inputs: explicit
    kb.set_backend("triton")
    with pytest.raises(ValueError, match="CUDA"):
        kb.resolve("x", [torch.zeros(1)])


def test_sparse_attn_dispatch_cpu_is_reference(restore_backend):
    kb.set_backend("auto")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 4, 32, generator=gen).bfloat16()
    kv = torch.randn(1, 20, 32, generator=gen).bfloat16()
    idx = torch.randint(-1, 20, (1, 5, 12), generator=gen).int()
    sink = torch.randn(4, generator=gen)
    assert torch.equal(sparse_attn(q, kv, sink, idx, 0.2), sparse_attn_ref(q, kv, sink, idx, 0.2))


# ------------------------------------------------------------------------------------------ GPU: Triton vs reference

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (METHOD.md)."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


ATTN_GPU_CASES = [
    dict(B=4, H=64, D=512, W=128, K=512, P=64, n_entries=(5000, 700, 512, 90), pos=(10_000, 1400, 1100, 127)),
    dict(B=3, H=8, D=64, W=32, K=80, P=16, n_entries=(200, 37, 0), pos=(300, 20, 5)),
    dict(B=2, H=20, D=128, W=48, K=100, P=8, n_entries=(300, 50), pos=(700, 60), empty_rows=(1,), floor=(690, 0)),
    dict(B=1, H=64, D=512, W=128, K=512, P=64, n_entries=(3000,), pos=(6001,)),
    dict(B=2, H=64, D=512, W=128, K=512, P=64, n_entries=(0, 600), pos=(50, 900), floor=(51, 0)),  # row 0: empty
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", ATTN_GPU_CASES)
@pytest.mark.parametrize("opts", [dict(), dict(num_splits=1), dict(num_splits=3), dict(block_h=32)])
def test_sparse_attn_packed_triton(kw, opts):
    from dsv41.kernels.triton import sparse_attn_packed_triton
    c = attn_case(device="cuda", seed=hash((str(kw), str(opts))) % 1000, **kw)
    ref = sparse_attn_packed_ref(*attn_args(c))
    out = sparse_attn_packed_triton(*attn_args(c), **opts)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, ref)
    print(f"\nMAXERR sparse_attn_packed {kw.get('H')}x{kw.get('D')} {opts}: rel {err:.2e} "
          f"max|d| {float((out.float() - ref.float()).abs().max()):.2e}")
    assert err < 2e-2
    empty = ((c.win < 0).all(1) & (c.topk < 0).all(1)).nonzero().flatten()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))                # nothing to attend: exactly 0


@pytest.mark.gpu
@pytest.mark.parametrize("kw", ATTN_GPU_CASES[1:3])
def test_sparse_attn_packed_triton_verify_layout(kw):
    """The layout of a verify (`dsv41.model.packed_decode.attend_packed`): a ring of W + T rows per row (the ring
    before the call, then its T new rows), T virtual rows reading each, window lists from `window_indices`."""
    from dsv41.kernels.triton import sparse_attn_packed_triton
    from dsv41.model.attention import window_indices
    T = 3
    c = attn_case(device="cuda", seed=11, **kw)
    B, W = c.slots.numel(), c.W
    new = c.ring[c.slots.long(), :T].flip(1)                                   # any valid records as the new rows
    ring = torch.cat([c.ring[c.slots.long()], new], 1)                         # [B, W+T, bytes]
    win = window_indices(c.pos.cpu() - T + 1, T, W, False, None if c.floor is None else c.floor).flatten(0, 1)
    args = (c.q.repeat_interleave(T, 0), ring, torch.arange(B, device="cuda").repeat_interleave(T), win.cuda().int(),
            c.pages, c.table.repeat_interleave(T, 0), c.topk.repeat_interleave(T, 0), c.sink, c.scale)
    ref = sparse_attn_packed_ref(*args)
    out = sparse_attn_packed_triton(*args)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kw", ATTN_GPU_CASES)
@pytest.mark.parametrize("opts", [dict(), dict(block_n=32), dict(block_n=64, num_warps=8)])
def test_stage_packed_rows_exact(kw, opts):
    """The staged path's first kernel: every listed entry decoded bit for bit as the codecs do, -1 where empty."""
    from dsv41.kernels.packed_ref import gather_records
    from dsv41.kernels.triton.packed_staged import stage_packed_rows
    c = attn_case(device="cuda", seed=7, **kw)
    rows, idx = stage_packed_rows(c.ring, c.slots, c.win, c.pages, c.table, c.topk, **opts)
    ring = unpack_swa_kv(c.ring[c.slots.long()])
    win = c.win.long()
    window = torch.stack([ring[b, win[b].clamp_min(0)] for b in range(win.size(0))])
    want = torch.cat([window, unpack_main_kv(gather_records(c.pages, c.table, c.topk))], 1).bfloat16()
    valid = torch.cat([c.win >= 0, c.topk >= 0], 1)
    pos = torch.arange(valid.size(1), device=valid.device).expand_as(valid)
    assert torch.equal(idx[:, 0], torch.where(valid, pos, -1).int())
    assert torch.equal(rows[valid], want[valid])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 70, 16, 128, 300, 100), (3, 1, 64, 512, 5000, 640), (1, 257, 64, 512, 900, 640)])
def test_sparse_attn_dense_triton(shape):
    from dsv41.kernels.triton import sparse_attn_triton
    B, T, H, D, N, K = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(B, T, H, D, generator=gen).bfloat16().cuda()
    kv = torch.randn(B, N, D, generator=gen).bfloat16().cuda()
    idx = torch.randint(0, N, (B, T, K), generator=gen).int()
    idx[..., K // 2:] = torch.where(torch.rand(B, T, K - K // 2, generator=gen) < 0.3, -1, idx[..., K // 2:])
    idx[0, 0] = -1                                                            # an empty row: exactly 0
    idx = idx.cuda()
    sink = torch.randn(H, generator=gen).cuda()
    ref = sparse_attn_ref(q, kv, sink, idx, D ** -0.5)
    out = sparse_attn_triton(q, kv, sink, idx, D ** -0.5)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    print(f"\nMAXERR sparse_attn_dense {shape}: rel {err:.2e}")
    assert torch.isfinite(out).all() and err < 2e-2
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


INDEX_GPU_CASES = [
    dict(B=3, J=32, I=128, P=64, n_vis=(20_000, 3000, 1)),
    dict(B=2, J=8, I=64, P=16, n_vis=(150, 0)),
    dict(B=1, J=32, I=128, P=64, n_vis=(70_001,)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", INDEX_GPU_CASES + [dict(B=2, J=20, I=32, P=16, n_vis=(999, 64)),
                                                  dict(B=2, J=16, I=256, P=16, n_vis=(700, 90))])   # v1: I > 128
def test_indexer_triton(kw):
    from dsv41.kernels.triton import indexer_scores_packed_triton, indexer_topk_packed_triton
    c = index_case(device="cuda", **kw)
    ref = indexer_scores_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis)
    out = indexer_scores_packed_triton(c.q, c.w, c.pages, c.table, c.n_vis)
    torch.cuda.synchronize()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))                            # the same visibility
    d = (out[fin] - ref[fin]).abs()
    scale = ref[fin].abs().max().clamp_min(1e-30)
    mismatch = float((d > 0).float().mean()) if fin.any() else 0.0
    print(f"\nMAXERR indexer_scores {kw['n_vis']}: max|d|/max|ref| {float(d.max() / scale) if fin.any() else 0:.2e}"
          f" mismatched {mismatch:.2e}")
    assert not fin.any() or float(d.max() / scale) < 2e-2
    for mode in (dict(), dict(pool_blocks=64, block_size=8)):
        want, wpool = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, 512, **mode)
        got, gpool = indexer_topk_packed_triton(c.q, c.w, c.pages, c.table, c.n_vis, 512, **mode)
        assert got.shape == want.shape
        assert torch.allclose(_picked(ref, got), _picked(ref, want), rtol=2e-2, atol=0)
        if wpool is not None:                                                 # Reindex over the published pool
            rwant, _ = indexer_topk_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, 512, cand_blocks=wpool)
            rgot, _ = indexer_topk_packed_triton(c.q, c.w, c.pages, c.table, c.n_vis, 512, cand_blocks=wpool)
            assert torch.allclose(_picked(ref, rgot), _picked(ref, rwant), rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_indexer_triton_gather_negative_and_invisible():
    """Explicit entry lists (a Reindex pool) with -1 and ids past n_vis: -inf there, the reference elsewhere."""
    from dsv41.kernels.triton import indexer_scores_packed_triton
    c = index_case(device="cuda", B=2, J=32, I=128, P=64, n_vis=(5000, 300), seed=4)
    gen = torch.Generator().manual_seed(4)
    ent = torch.randint(-1, 6000, (2, 777), generator=gen).int().cuda()
    ref = indexer_scores_packed_ref(c.q, c.w, c.pages, c.table, c.n_vis, ent)
    out = indexer_scores_packed_triton(c.q, c.w, c.pages, c.table, c.n_vis, ent)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)) and fin.any() and (~fin).any()
    d = (out[fin] - ref[fin]).abs()
    print(f"\nMAXERR indexer_scores gather: max|d|/max|ref| {float(d.max() / ref[fin].abs().max()):.2e}")
    assert float(d.max() / ref[fin].abs().max()) < 2e-2


def _unaligned(pages: torch.Tensor) -> torch.Tensor:
    """The same bytes at an odd address (v3 reads 32-bit words: such pages take v2)."""
    out = torch.empty(pages.numel() + 1, dtype=torch.uint8, device=pages.device)[1:].view(pages.shape)
    out.copy_(pages)
    assert out.data_ptr() % 4
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(B=2, J=32, I=128, P=64, n_vis=(9000, 700)),      # one page per tile
                                dict(B=2, J=32, I=128, P=16, n_vis=(3000, 5)),       # pages smaller than a tile
                                dict(B=1, J=24, I=128, P=24, n_vis=(2000,)),         # P not a power of two
                                dict(B=3, J=32, I=128, P=256, n_vis=(5000, 0, 257))])
@pytest.mark.parametrize("opts", [dict(), dict(block_n=128, num_warps=8, tiles_per_program=3)])
def test_indexer_triton_v3_exact(kw, opts):
    """The v3 kernel (word loads, one K=128 fp16 dot per tile) gives the reference's scores bit for bit, as v2 (its
    fallback, taken for pages at an address that is not a multiple of 4) does: whole contexts, entry lists (a
    Reindex pool, with -1 and ids past n_vis), and programs holding an entry whose group scales span more than
    fp16's window (v2's per-group path)."""
    from dsv41.kernels.triton import indexer_scores_packed_triton
    c = index_case(device="cuda", seed=hash((str(kw), str(opts))) % 1000, **kw)
    spread = c.pages.clone()                                   # entry 5 of row 0: group scales 2^23 ... 2^-30
    spread[int(c.table[0, 0]), 5, 64:68] = torch.tensor([150, 97, 127, 120], dtype=torch.uint8)
    gen = torch.Generator().manual_seed(7)
    ent = torch.randint(-1, max(kw["n_vis"]) + 40, (kw["B"], 1000), generator=gen).int().cuda()
    for pages, entries in ((c.pages, None), (spread, None), (c.pages, ent)):
        ref = indexer_scores_packed_ref(c.q, c.w, pages, c.table, c.n_vis, entries)
        out = indexer_scores_packed_triton(c.q, c.w, pages, c.table, c.n_vis, entries, **opts)
        v2 = indexer_scores_packed_triton(c.q, c.w, _unaligned(pages), c.table, c.n_vis, entries)
        torch.cuda.synchronize()
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(out))
        mism = int((out[fin] != ref[fin]).sum())
        print(f"\nMAXERR indexer_scores v3 {kw['n_vis']} {opts} list={entries is not None}: "
              f"max|d| {float((out[fin] - ref[fin]).abs().max()) if fin.any() else 0:.2e} mismatched {mism}")
        assert torch.equal(out, v2)                                               # the same bits as v2
        if pages is c.pages:                                                      # and as the reference
            assert mism == 0
        else:           # (the spread entry's fp32 sum of 2^23- and 2^-30-scaled terms rounds: v2's bits, 1 ulp)
            assert float(((out[fin] - ref[fin]).abs() / ref[fin].abs().clamp_min(1e-30)).max()) < 2e-2


@pytest.mark.gpu
def test_model_dispatch_uses_triton_on_cuda(restore_backend):
    kb.set_backend("triton")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 16, 64, generator=gen).bfloat16().cuda()
    kv = torch.randn(1, 40, 64, generator=gen).bfloat16().cuda()
    idx = torch.randint(-1, 40, (1, 3, 30), generator=gen).int().cuda()
    sink = torch.randn(16, generator=gen).cuda()
    with torch.no_grad():
        out = sparse_attn(q, kv, sink, idx, 0.125)
    assert rel_err(out, sparse_attn_ref(q, kv, sink, idx, 0.125)) < 2e-2
    with pytest.raises(ValueError, match="bfloat16"):
        sparse_attn(q.float(), kv, sink, idx, 0.125)
