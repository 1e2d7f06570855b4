"""Each approximation of the inference path and its named exact counterpart, as switches of one teacher-forced
run: a prefill of the prompt, then one-token decode steps through the continuation (docs/system.md §9).

  switch    approximation (the design)                   exact counterpart (its own code path)
  kv        fp4: main KV stored FP4 (E2M1 + E4M3 scale    bf16: the main KV as computed (training numerics:
            per 16, `dsv41.codecs.qdq_main_kv`)            QDQ off everywhere else in both)
  reuse     source: Reuse layers attend to the top-k of   own: every Reuse layer selects its own top-k, the K
            their index source (cross-layer index reuse)   entries its own attention weighs most (per-head
                                                           softmax over the visible compressed entries, summed
                                                           over heads), through a forward pre-hook
  pool      cut: Reindex indexers score only the           full: the candidate mask all true (every visible
            candidate source's block pool                  entry scored), through a forward pre-hook
  prefill   bounded: `ced-bounded` (decoder replays the    exact: `ced-exact` (equal to `full` up to float
            last n_win tokens, windows truncated)          order, `dsv41.engine.prefill`)
  decode    stale: the official decode's stale index-key   fixed: each indexer reads its own keys
            pointer (`official_decode_artifact`)           (docs/model.md §4)

`EXACT` has every counterpart, `STACKED` every approximation; `alone(name)` flips one switch. The model runs with
its QDQ sites off (fp32 here), so each row of a study isolates one approximation.

Legend: B batch, P prompt tokens, D decoded tokens, T tokens of a call, H heads, N compressed entries, K top-k.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from dsv41.config import Mode
from dsv41.engine.prefill import prefill
from dsv41.model.common import QuantSite, set_quantization
from dsv41.model.step import ForwardOptions
from dsv41.train.qat import TrainCache


@dataclass(frozen=True)
class Variant:
    kv: str = "bf16"            # | "fp4"
    reuse: str = "own"          # | "source"
    pool: str = "full"          # | "cut"
    prefill: str = "exact"      # | "bounded"
    decode: str = "fixed"       # | "stale"


EXACT = Variant()
STACKED = Variant("fp4", "source", "cut", "bounded", "stale")
APPROXIMATIONS = {"kv": "FP4 main KV", "reuse": "index reuse", "pool": "candidate-pool cut",
                  "prefill": "bounded replay (ced-bounded)", "decode": "stale index keys (official decode)"}
COUNTERPARTS = {"kv": "bf16 main KV", "reuse": "own top-k per layer", "pool": "full scoring",
                "prefill": "ced-exact", "decode": "fixed index keys"}


def alone(name: str) -> Variant:
    """EXACT with only approximation `name` switched on."""
    return replace(EXACT, **{name: getattr(STACKED, name)})


def own_topk(attn, u: torch.Tensor, ctx) -> torch.Tensor:
    """A layer's own selection: ids [B,T,K] (ascending, -1 at the tail for none) of the K compressed entries its
    attention weighs most (module docstring)."""
    m = attn.role.ratio
    n_vis = (ctx.start + ctx.seqlen) // m
    ckv = ctx.cache.compressed(attn.role.kv_from, n_vis).to(u.device)              # [B,N,C]
    N = ckv.size(1)
    freqs = attn.rope.freqs(ctx.positions).to(u.device)
    _, q = attn.queries(u, freqs)                                                   # [B,T,H,C]
    s = torch.einsum("bthc,bnc->bthn", q.float(), ckv.float()) * attn.softmax_scale
    visible = torch.arange(N, device=u.device) < ((ctx.positions.to(u.device) + 1) // m).unsqueeze(-1)
    p = s.masked_fill(~visible.unsqueeze(2), -torch.inf).softmax(dim=-1).nan_to_num(0.0).sum(dim=2)
    k = min(attn.topk, N)
    val, idx = p.masked_fill(~visible, -1.0).topk(k, dim=-1)
    idx = torch.where(val >= 0, idx, N + k).sort(dim=-1).values                     # none -> the tail
    return torch.where(idx < N, idx, -1).int()


@contextmanager
def switched(model, variant: Variant):
    """The model with the reuse / pool counterparts hooked in (the other switches are per call)."""
    handles = []
    for block in model.layers:
        attn, role = block.attn, block.attn.role
        if variant.reuse == "own" and role.mode == Mode.REUSE:
            def pre(mod, args, role=role):
                u, ctx = args
                ctx.published.topk[role.topk_from] = own_topk(mod, u, ctx)
            handles.append(attn.register_forward_pre_hook(pre))
        if variant.pool == "full" and role.uses_candidates:
            def pre_full(mod, args, role=role):
                u, ctx = args
                N = int(((ctx.start + ctx.seqlen) // role.ratio).max())
                ctx.published.cand[role.candidates_from] = torch.ones(u.size(0), ctx.seqlen, N, dtype=torch.bool,
                                                                      device=u.device)
            handles.append(attn.register_forward_pre_hook(pre_full))
    quant = [(mod, mod.quant) for mod in model.modules() if isinstance(mod, QuantSite)]
    set_quantization(model, False)
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for mod, q in quant:
            mod.quant = q


@torch.no_grad()
def run_variant(model, ids: torch.Tensor, P: int, variant: Variant) -> torch.Tensor:
    """Logits [B,D+1,V] fp32 at positions P-1 .. P+D-1 of ids [B,P+D]: the prompt ids[:, :P] prefilled in the
    variant's mode, then ids[:, P+i] decoded one token at a time (teacher-forced)."""
    B, total = ids.shape
    if not 0 < P <= total:
        raise ValueError(f"prompt length {P} must lie in [1, {total}]")
    cache = TrainCache(model.cfg, B, model.dtype, ids.device, kv_qat=variant.kv == "fp4")
    opts = ForwardOptions(official_decode_artifact=variant.decode == "stale")
    with switched(model, variant):
        out = [prefill(model, ids[:, :P], cache, "ced-bounded" if variant.prefill == "bounded" else "ced-exact")
               .logits.float()]
        for i in range(P, total):
            out.append(model(ids[:, i:i + 1], cache, opts=opts).logits[:, -1].float())
    return torch.stack(out, dim=1)


def compare(exact: torch.Tensor, approx: torch.Tensor) -> dict:
    """Mean KL(exact || approx) in nats and top-1 agreement over the positions of logits [B,D,V]."""
    lp, lq = exact.log_softmax(-1), approx.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((exact.argmax(-1) == approx.argmax(-1)).float().mean())}
