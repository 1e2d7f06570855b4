"""Speculative rejection sampling (step 4 of `dsv41.engine.speculative`): each emitted token keeps exactly the
target's distribution given its prefix, whatever the drafter proposed."""

from __future__ import annotations

from typing import Sequence

import torch

from dsv41.engine.sampling import SamplingParams, target_probs


def accept_drafts(logits: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None, params: SamplingParams,
                  gen: torch.Generator) -> tuple[int, int]:
    """Speculative rejection sampling for one row. logits [v+1, V] are the target's at the pending token and
    each of the v drafts; q [v, V] the distributions the drafts were sampled from (None: each draft was a
    deterministic choice, a point mass). Returns (accepted drafts n, the next token: the correction at n < v or
    the bonus at n = v)."""
    v = len(drafts)
    if params.temperature == 0:
        best = logits[:v + 1].argmax(-1).tolist()
        for k in range(v):
            if best[k] != int(drafts[k]):
                return k, best[k]
        return v, best[v]
    p = target_probs(logits[:v + 1].float().cpu(), params)
    for k in range(v):
        d = int(drafts[k])
        qd = 1.0 if q is None else float(q[k, d])
        u = float(torch.rand((), generator=gen))
        if u * qd < float(p[k, d]):                            # accept with probability min(1, p/q)
            continue
        qk = torch.zeros_like(p[k]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[k].float().cpu()
        resid = (p[k] - qk).clamp_min(0)
        if float(resid.sum()) <= 0:                            # p == q up to rounding: rejection had mass 0
            resid = p[k]
        return k, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    return v, int(torch.multinomial(p[v], 1, generator=gen))
