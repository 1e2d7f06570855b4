"""Torch reference kernels (the model's own math; every fast path is compared against these): the sparse attention
with sinks, the RMSNorm that the model's `RMSNorm` module and the fused mHC step's reference share, and RoPE.

Legend: B batch, T queries, H heads, D head dim, N KV rows, K selected indices per query.
"""

from __future__ import annotations

import torch

from dsv41.kernels.invariant import is_deterministic, row_mean, row_sum, rsqrt

SPARSE_ATTN_BLOCK = 64


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32, cast back to x's dtype (docs/model.md §2)."""
    xf = x.float()
    xf = xf * rsqrt(row_mean(xf.square(), keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def apply_rope_ref(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST R dims of x by adjacent (even, odd) pairs (docs/model.md §3.2). x [B, T, (H,) *], freqs
    complex64 [B or 1, T, R/2]; inverse: by the conjugate angles.

    fp32 arithmetic, result rounded to x's dtype; returns a new tensor (autograd friendly)."""
    R = freqs.size(-1) * 2
    head, tail = x[..., :-R], x[..., -R:]
    z = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs.conj() if inverse else freqs
    if z.ndim == 4:  # [B, T, H, R/2]
        f = f.unsqueeze(-2)
    rot = torch.view_as_real(z * f).flatten(-2).to(x.dtype)
    return torch.cat([head, rot], dim=-1)


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                    scale: float, query_chunk: int = 1024) -> torch.Tensor:
    """Sparse single-KV-head attention with a per-head sink in the denominator (docs/model.md §3.8).

    q [B,T,H,D], kv [B,N,D] (K = V), sink [H] fp32 (not scaled), idx [B,T,K] int (-1 = nothing).
    Online softmax over blocks of 64 indices starting from a running max of -1e30, so a row whose indices
    are all -1 returns exactly 0. In bf16 the probabilities are rounded to bf16 relative to the running max
    before P@V, as the official kernel; in fp32 they are not (the golden float32 mode). Queries are processed
    `query_chunk` rows at a time to bound the gathered [rows, 64, D] working set on long prompts.

    Deterministic mode (`dsv41.kernels.invariant`): the two contractions are products summed along a fixed last
    axis (D for the scores, the block's 64 entries for P.V) instead of batched GEMMs, whose order can change with
    the number of queries; with the caller's canonical lists every query then has one order."""
    if is_deterministic():           # the product-sum's [rows, H, 64, D] intermediate: at most 2^24 values
        query_chunk = max(1, min(query_chunk, (1 << 24) // (q.size(2) * SPARSE_ATTN_BLOCK * q.size(3))))
    if q.size(1) > query_chunk:
        return torch.cat([sparse_attn_ref(q[:, i:i + query_chunk], kv, sink, idx[:, i:i + query_chunk], scale,
                                          query_chunk) for i in range(0, q.size(1), query_chunk)], dim=1)
    B, T, H, D = q.shape
    round_p = q.dtype == torch.bfloat16
    qf = q.float()
    kvf = kv.float()
    acc = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
    den = torch.zeros(B, T, H, dtype=torch.float32, device=q.device)
    run_max = torch.full((B, T, H), -1e30, dtype=torch.float32, device=q.device)
    batch = torch.arange(B, device=q.device).view(B, 1, 1)
    det = is_deterministic()
    for t in range(0, idx.size(-1), SPARSE_ATTN_BLOCK):
        blk = idx[:, :, t:t + SPARSE_ATTN_BLOCK].long()
        valid = blk >= 0
        kv_blk = kvf[batch, blk.clamp_min(0)] * valid.unsqueeze(-1)            # [B,T,k,D]
        if det:
            s = row_sum(qf.unsqueeze(3) * kv_blk.unsqueeze(2))                   # [B,T,H,k]
        else:
            s = torch.einsum("bthd,btkd->bthk", qf, kv_blk)
        s = torch.where(valid.unsqueeze(2), s, -torch.inf) * scale
        prev = run_max
        run_max = torch.maximum(prev, s.amax(dim=-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        den = den * rescale + row_sum(p)
        if round_p:
            p = p.to(torch.bfloat16).float()
        pv = (row_sum(p.unsqueeze(3) * kv_blk.transpose(-1, -2).unsqueeze(2)) if det    # [B,T,H,D]
              else torch.einsum("bthk,btkd->bthd", p, kv_blk))
        acc = acc * rescale.unsqueeze(-1) + pv
    den = den + torch.exp(sink.float() - run_max)
    out = acc / den.unsqueeze(-1)
    return out.to(torch.bfloat16 if round_p else q.dtype)
