"""Triton sparse attention with the per-head sink on dense bf16 KV (docs/model.md §3.8): twin of `ref.sparse_attn_ref`
(same signature), for prefill and decode; the packed decode (packed_staged.py) runs it on the rows it decodes.

Legend: B rows, T queries per row, H heads, D head dim, BH heads per program, BN indices per tile, K indices per
query, N KV rows per row, S splits of the index list.

One program per (query, block of BH heads, split): it walks its tiles of the index list, gathers the BN KV rows of
each tile, and runs the reference's online softmax on the tile: logits = scale * q.k in fp32 (tensor cores, fp32
accumulation), running max from -1e30, denominator of fp32 p, numerator of bf16(p) @ V. The sink enters the
denominator last. With BN = 64 and an unsplit list the tiles are the reference's blocks of 64, so the result equals
the reference up to summation order and exp rounding; a smaller BN updates the running max more often, which moves
the bf16 rounding of p slightly (differences at the bf16-rounding level).
When the rows and head blocks alone cannot fill the GPU, the list is split (flash-decoding): each split keeps its
own running max, and `_combine_kernel` merges the partial (acc, max, sum) and adds the sink; the bf16 rounding of
p is then relative to the split's running max (differences at the bf16-rounding level).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.triton.common import DOT_BF16, LAST, sm_count

__all__ = ["sparse_attn_triton", "check_head_dim", "CONFIG"]

# Launch parameters picked by benchmarks/kernels.py's sweeps on the H200 (override per call with the keywords).
CONFIG = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}


# ------------------------------------------------------------------------------------------ softmax step

@triton.jit
def _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16: tl.constexpr):
    """One block of `sparse_attn_ref`'s loop: q [BH,D] bf16, kv [BN,D] bf16 (K = V), valid [BN]."""
    if DOT_BF16:
        s = tl.dot(q, tl.trans(kv))
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)))
    s = tl.where(valid[None, :], s * scale, float("-inf"))           # s = where(valid, q.k, -inf) * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))                            # run_max = max(prev, s.amax)
    alpha = tl.exp(m_i - m_new)                                      # rescale = exp(prev - run_max)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)                                 # den: fp32 p
    pb = p.to(tl.bfloat16)                                           # num: bf16(p) @ V
    if DOT_BF16:
        pv = tl.dot(pb, kv)
    else:
        pv = tl.dot(pb.to(tl.float32), kv.to(tl.float32))
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _epilogue(acc, m_i, l_i, heads, hmask, d, row, sp, n_split, H, sink_ptr, out_ptr, acc_ptr, ml_ptr,
              D: tl.constexpr, SPLIT: tl.constexpr):
    """Unsplit: den += exp(sink - max), out = num / den in bf16. Split: store the partial state for the combine."""
    if SPLIT:
        o = (row * n_split + sp) * H + heads
        tl.store(acc_ptr + o[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + o * 2, m_i, mask=hmask)
        tl.store(ml_ptr + o * 2 + 1, l_i, mask=hmask)
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        l_i = l_i + tl.exp(sink - m_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (row * H + heads[:, None]) * D + d[None, :], out.to(tl.bfloat16), mask=hmask[:, None])


# ------------------------------------------------------------------------------------------ kernels

@triton.jit
def _sparse_attn_dense_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, acc_ptr, ml_ptr, scale, T, H, N, K,
                              tiles_per_split, n_split, D: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_BF16: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)                               # query row b * T + t
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = bt // T
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (bt * H + heads[:, None]) * D + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    t0 = sp * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BLOCK_N))
    for t in range(t0, t1):
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        i = tl.load(idx_ptr + bt * K + j, mask=j < K, other=-1)
        valid = i >= 0
        rows = b * N + tl.maximum(i, 0).to(tl.int64)
        kv = tl.load(kv_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _attend(q, kv, valid, acc, m_i, l_i, scale, DOT_BF16)
    _epilogue(acc, m_i, l_i, heads, hmask, d, bt, sp, n_split, H, sink_ptr, out_ptr, acc_ptr, ml_ptr, D, SPLIT)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, sink_ptr, out_ptr, H, n_split, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Merge the splits of one row: max M over splits, num = sum exp(m_s - M) acc_s,
    den = sum exp(m_s - M) l_s + exp(sink - M); out = num / den in bf16."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    m_g = tl.full([BLOCK_H], -1e30, tl.float32)
    for s in range(n_split):
        m_g = tl.maximum(m_g, tl.load(ml_ptr + ((row * n_split + s) * H + heads) * 2, mask=hmask, other=-1e30))
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for s in range(n_split):
        o = (row * n_split + s) * H + heads
        m_s = tl.load(ml_ptr + o * 2, mask=hmask, other=-1e30)
        alpha = tl.exp(m_s - m_g)
        den += alpha * tl.load(ml_ptr + o * 2 + 1, mask=hmask, other=0.0)
        acc += alpha[:, None] * tl.load(acc_ptr + o[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    den += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - m_g)
    tl.store(out_ptr + (row * H + heads[:, None]) * D + d[None, :], (acc / den[:, None]).to(tl.bfloat16),
             mask=hmask[:, None])


# ------------------------------------------------------------------------------------------ launchers

def _split_plan(programs: int, n_tiles: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(splits, tiles per split): split the index list only as far as needed to give every SM a program (each split
    costs a partial [H, D] fp32 write and read)."""
    if n_tiles == 0:
        return 1, 1
    if num_splits is None:
        num_splits = -(-sm_count(device) // max(1, programs))
    num_splits = max(1, min(num_splits, n_tiles))
    tps = -(-n_tiles // num_splits)
    return -(-n_tiles // tps), tps


def check_head_dim(D: int, what: str) -> None:
    """The kernels take power-of-two head dims >= 32 (whole tiles of D channels)."""
    if D < 32 or D & (D - 1):
        raise ValueError(f"{what}: the Triton kernel needs a power-of-two head dim >= 32, got {D}")


def sparse_attn_triton(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                       query_chunk: int = 1024, *, num_splits: int | None = None, block_h: int | None = None,
                       block_n: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> torch.Tensor:
    """Triton twin of `sparse_attn_ref` on dense bf16 KV (any T: prefill and decode) -> [B,T,H,D] bf16; the
    keywords override CONFIG. query_chunk is accepted for the signature and unused (the kernel holds no [T, K, D]
    gather)."""
    B, T, H, D = q.shape
    check_head_dim(D, "sparse_attn")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attn (triton): q and kv must be bfloat16, got {q.dtype} and {kv.dtype}")
    cfg = {**CONFIG, **{k: v for k, v in dict(block_h=block_h, block_n=block_n, num_warps=num_warps,
                                              num_stages=num_stages).items() if v is not None}}
    BH, BN = max(16, min(cfg["block_h"], triton.next_power_of_2(H))), cfg["block_n"]
    K = idx.size(-1)
    n_hb = triton.cdiv(H, BH)
    n_split, tps = _split_plan(B * T * n_hb, triton.cdiv(K, BN), q.device, num_splits)
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16, device=q.device)
    acc_ws = ml_ws = out
    if n_split > 1:
        acc_ws = torch.empty(B * T, n_split, H, D, dtype=torch.float32, device=q.device)
        ml_ws = torch.empty(B * T, n_split, H, 2, dtype=torch.float32, device=q.device)
    if B * T:
        sink = sink.float().contiguous()
        LAST['dense'] = _sparse_attn_dense_kernel[(B * T, n_hb, n_split)](
            q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous(), sink, out,
            acc_ws, ml_ws, float(scale), T, H, kv.size(1), K, tps, n_split, D=D, BLOCK_H=BH, BLOCK_N=BN,
            SPLIT=n_split > 1, DOT_BF16=DOT_BF16, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if n_split > 1:
            _combine_kernel[(B * T, n_hb)](acc_ws, ml_ws, sink, out, H, n_split, D=D, BLOCK_H=BH, num_warps=4)
    return out
