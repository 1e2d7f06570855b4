"""The training-only fast forward of a language-model training step (`LMTrainModule(fast=True)`, pretrain.py).

It computes the same function as `Transformer.forward` on a training prefill (every row at position 0, no
images, FP8/FP4 QDQ off), loss and gradients, up to the order of float summations, with three pieces of the
forward written for throughput instead of for the official summation order:

  attention   the sliding-window + selected-compressed sparse attention with sinks (`sparse_attn_ref`: a
              gather of [B,T,K,D] rows and a blocked online softmax) as one dense masked attention over
              [window || compressed] KV: the boolean mask is scattered from the SAME index lists the model
              builds (`window_indices`, the indexer's top-k, replay floors included), and the sink is one extra
              logit column (its probability is dropped from the numerator, kept in the denominator). A row with
              no visible key gets the sink alone and returns 0, as the reference does. Two matmuls per layer
              and no [B,T,K,D] gather, whose backward was a scatter-add.
  mHC         `hc_post` as a batched [S,S]^T x [S,D] matmul instead of the official product-then-sum over a
              [B,T,S,S,D] intermediate; the Sinkhorn projection with an explicit backward (`SinkhornFn`)
              instead of autograd through its ~120 small ops (same iterations, same forward values).
  MoE         the routed experts as three batched matmuls over expert-sorted, zero-padded token slots (the
              expert weights stacked) instead of a Python loop of gathers, linears and index_adds per expert.

Everything else (embedding, Engram, the RMSNorms, queries / KV / compressor / indexer / output projection, the
gate, the shared expert, the head) calls the model's own modules. Differences that are not summation order:
the training cache's window rings are not written (a training prefill never reads them back), the DSpark taps
are not computed (the LM loss does not use them), and in bf16 the attention probabilities are not rounded to
bf16 before P@V (the reference rounds them as the official inference kernel does; training on a GPU under
bf16 autocast is therefore not bit-comparable, only close). Inference never takes this path: it is used only
by `LMTrainModule` when the trainer sets `fast`, and `tests/test_train_fast.py` checks it against the
reference forward (loss and every gradient) on the debug and tiny presets.

Not applicable (the trainer falls back to the reference forward): FSDP2 (its unshard hooks sit on the modules'
own forwards, which this path bypasses) and QDQ switched on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.kernels.mhc_math import hc_pre
from dsv41.kernels.moe_ref import expert_act_ref
from dsv41.model.attention import Attention, window_indices
from dsv41.model.common import QuantSite
from dsv41.model.step import ForwardOptions, StepContext


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


# ------------------------------------------------------------------------------------------------ attention

def dense_sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`sparse_attn_ref(q, kv, sink, idx, scale)` as a dense masked attention (fp32 math).

    q [B,T,H,D], kv [B,N,D] (K = V, one KV head), sink [H], idx [B,T,K] int (-1 = nothing, no duplicates:
    window lists and top-k are both duplicate-free) -> [B,T,H,D] in q's dtype."""
    (B, T, H, D), N = q.shape, kv.size(1)
    with _no_autocast(q.device):
        p = attn_probs(q, kv, sink, index_mask(idx, N), scale)
        out = torch.matmul(p.reshape(B, T * H, N), kv.float()).view(B, T, H, D)
    return out.to(q.dtype)


def index_mask(idx: torch.Tensor, N: int) -> torch.Tensor:
    """Index lists idx [B,T,K] (-1 = nothing) as a bool mask [B,T,N] over the KV axis."""
    col = torch.where(idx >= 0, idx.long(), N)                                     # -1 -> a dummy column N
    return torch.zeros(*idx.shape[:2], N + 1, dtype=torch.bool, device=idx.device).scatter_(-1, col, True)[..., :N]


def attn_probs(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """The attention probabilities [B,T,H,N] fp32 of queries q [B,T,H,D] over the keys kv [B,N,D] that `mask`
    [B,T,N] shows, with the per-head sink as one more logit whose probability is dropped (a row that sees nothing
    gives zeros). Also the indexer objective's target (`dsv41.train.indexer_loss`)."""
    (B, T, H, D), N = q.shape, kv.size(1)
    with _no_autocast(q.device):
        s = torch.matmul(q.float().reshape(B, T * H, D), kv.float().transpose(1, 2)).view(B, T, H, N)
        s = s.masked_fill(~mask.unsqueeze(2), -torch.inf) * scale
        logits = torch.cat([s, sink.float().view(1, 1, H, 1).expand(B, T, H, 1)], dim=-1)
        return torch.softmax(logits, dim=-1)[..., :N]


def attention_forward(attn: Attention, u: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """`Attention.forward` of a training prefill (ctx.start all 0) with `dense_sparse_attn`."""
    freqs = attn.rope.freqs(ctx.positions).to(u.device)
    qr, q = attn.queries(u, freqs)
    kv = attn.window_kv(u, freqs)
    idx = window_indices(ctx.start, u.size(1), attn.window, True, ctx.opts.floor_for(attn.layer)).to(u.device)
    kv_all, idx = attn.with_compressed(u, qr, freqs, kv, idx, ctx)
    o = dense_sparse_attn(q, kv_all, attn.attn_sink, idx, attn.softmax_scale)
    return attn.output(o, freqs)


# ------------------------------------------------------------------------------------------------ mHC

def hc_post_fast(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`hc_post` (out[k] = post[k] f + sum_j comb[j,k] residual[j], fp32) as one batched matmul."""
    with _no_autocast(f.device):
        y = torch.matmul(comb.float().transpose(-1, -2), residual.float())
        y = y + post.float().unsqueeze(-1) * f.float().unsqueeze(-2)
    return y.type_as(f)


class SinkhornFn(torch.autograd.Function):
    """The Sinkhorn part of `hc_split_sinkhorn` on comb logits z [..,S,S] (fp32): softmax over the last axis,
    + eps, a column normalisation, then (iters - 1) x (rows, columns); the same operations in the same order as
    the model's loop. The backward replays the iterations in reverse from the saved per-step denominators:
    for c = a / r (r = a summed along one axis + eps), dL/da = (g - sum(g * c)) / r along that axis.

    The iterations run on the [S,S] axes moved to the front ([S,S,N], N the flattened tokens, contiguous): each
    row / column sum is then S adds of contiguous N-vectors, where the [..,S,S] layout reduces S strided elements
    per token (a call is ~3 x faster on a CPU: `benchmarks/sft_step.py`; its ~80 small ops were about a third of
    the post preset's SFT step). The values are the model loop's up to the order of S-element sums."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        shape = z.shape
        zt = z.reshape(-1, *shape[-2:]).permute(1, 2, 0).contiguous()         # [S(row), S(col), N]
        e = torch.exp(zt - zt.amax(dim=1, keepdim=True))
        sm = e / e.sum(dim=1, keepdim=True)
        a, saved = sm + eps, [sm]
        for k in range(2 * iters - 1):                                       # columns first, then rows, columns
            r = a.sum(dim=0 if k % 2 == 0 else 1, keepdim=True) + eps
            a = a / r
            saved += [a, r]
        ctx.save_for_backward(*saved)
        ctx.shape = shape
        return a.permute(2, 0, 1).contiguous().view(shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        sm, *steps = ctx.saved_tensors                                       # sm, then (a, r) of every step
        g = g.reshape(-1, *ctx.shape[-2:]).permute(1, 2, 0).contiguous()
        for k in range(len(steps) // 2 - 1, -1, -1):
            a, r = steps[2 * k], steps[2 * k + 1]
            g = (g - (g * a).sum(dim=0 if k % 2 == 0 else 1, keepdim=True)) / r
        g = sm * (g - (g * sm).sum(dim=1, keepdim=True))                     # softmax backward
        return g.permute(2, 0, 1).contiguous().view(ctx.shape), None, None


def hc_mixes_fast(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, iters: int,
                  eps: float, norm_eps: float):
    """`hc_mixes` (projection, RMS, `hc_split_sinkhorn`) with `SinkhornFn` for the Sinkhorn loop."""
    with _no_autocast(x.device):
        xf = x.flatten(2).float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
        m = F.linear(xf, fn.float()) * rstd
        scale, base = scale.float(), base.float()
        pre = torch.sigmoid(m[..., :S] * scale[0] + base[:S]) + eps
        post = 2 * torch.sigmoid(m[..., S:2 * S] * scale[1] + base[S:2 * S])
        z = (m[..., 2 * S:] * scale[2] + base[2 * S:]).unflatten(-1, (S, S))
        comb = SinkhornFn.apply(z, iters, eps)
    return pre, post, comb


# ------------------------------------------------------------------------------------------------ MoE

def moe_forward(moe, x: torch.Tensor) -> torch.Tensor:
    """`MoE.forward` (no image mask, QDQ off) with the routed experts batched: assignments sorted by expert into
    [E, cap] slots (cap = the largest load; empty slots read a zero row and are written to a dummy row); the
    expert's middle is the kernels' own `expert_act_ref`. Experts without tokens are left out, so their weights get
    no gradient, as in the reference."""
    shape, D = x.shape, moe.dim
    x = x.reshape(-1, D)
    weights, indices, _ = moe.gate(x, None)
    N, K = indices.shape
    counts = torch.bincount(indices.flatten(), minlength=moe.n_experts)
    # only the experts that got tokens take part (as in the reference loop): an unused expert's weights must get
    # no gradient at all (Muon skips a parameter without one), not a zero gradient
    used = [e for e, n in enumerate(counts.tolist()) if n]
    compact = torch.full((moe.n_experts,), -1, dtype=torch.long, device=x.device)
    compact[used] = torch.arange(len(used), device=x.device)
    flat = compact[indices.flatten()]
    counts, E = counts[used], len(used)
    order = torch.argsort(flat, stable=True)
    cap = max(1, int(counts.max()))
    e_sorted = flat[order]
    slot = torch.arange(N * K, device=x.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    dest = e_sorted * cap + slot                                               # [N*K] into [E*cap]
    src = torch.full((E * cap,), N, dtype=torch.long, device=x.device).index_copy_(0, dest, order // K)
    w_slot = torch.zeros(E * cap, dtype=torch.float32, device=x.device).index_copy(0, dest, weights.flatten()[order])
    w1, w3, w2 = (torch.stack([getattr(moe.experts[e], w).weight for e in used]) for w in ("w1", "w3", "w2"))
    xs = torch.cat([x, x.new_zeros(1, D)])[src].view(E, cap, D).to(w1.dtype)
    h = expert_act_ref(torch.bmm(xs, w1.mT), torch.bmm(xs, w3.mT), w_slot.view(E, cap, 1), moe.experts[used[0]].limit,
                       False, x.dtype)
    out = torch.bmm(h.to(w2.dtype), w2.mT)                                    # [E,cap,D]
    y = torch.zeros(N + 1, D, dtype=torch.float32, device=x.device).index_add(0, src, out.reshape(-1, D).float())
    return (y[:N] + moe.shared_experts(x).float()).type_as(x).view(shape)


# ------------------------------------------------------------------------------------------------ the stack

def block_forward(block, x: torch.Tensor, pre_mix: torch.Tensor, ctx: StepContext):
    """`Block.forward` (x [B,T,S,D], the previous block's FFN pre) -> (x', this block's FFN pre)."""
    a_pre, a_post, a_comb = block.mixes(x, "attn", hc_mixes_fast)
    h = block.attn_norm(hc_pre(x, pre_mix))
    h = attention_forward(block.attn, h, ctx) if type(block.attn) is Attention else block.attn(h, ctx)
    x = hc_post_fast(h, x, a_post, a_comb)
    f_pre, f_post, f_comb = block.mixes(x, "ffn", hc_mixes_fast)
    h = moe_forward(block.ffn, block.ffn_norm(hc_pre(x, a_pre)))
    return hc_post_fast(h, x, f_post, f_comb), f_pre


def fast_forward(model, ids: torch.Tensor, cache, opts: ForwardOptions) -> torch.Tensor:
    """Logits [B,T,V] fp32 of `model(ids, cache, 0, opts)` (a training prefill at position 0; `opts` carries the
    replay floors) through the fast pieces of the module docstring; advances cache.pos like it."""
    start = cache.pos.clone()
    assert int(start.abs().max()) == 0, "the fast training forward runs a prefill at position 0 only"
    hashes = model.engram_hashes(ids, cache, None)
    ctx = StepContext(start, ids.size(1), cache, opts)
    h, pre_mix = model.run_layers(*model.streams_in(model.embed_tokens(ids)), ctx, model.layers, hashes,
                                  step=block_forward)
    logits, _ = model.logits_from(h, pre_mix)
    cache.pos = start + ids.size(1)
    return logits


def fast_applies(model) -> bool:
    """Whether the fast path may stand in for the reference forward (QDQ off everywhere)."""
    return not any(m.quant for m in model.modules() if isinstance(m, QuantSite))
