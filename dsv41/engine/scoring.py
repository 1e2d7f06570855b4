"""Prompt log-probabilities: log p(ids[t] | ids[:t]) for every prompt position t >= 1, with the top alternatives
and the rank of the prompt's own token (what `echo` + `logprobs` and `prompt_logprobs` return, and what
evaluation harnesses score multiple-choice and perplexity tasks with).

The engine's prefill computes only the last position's logits (and in its CED modes only part of the prompt
through every layer), so a scored prompt runs once more through the model: the full forward (the official
computation) on a reference cache of its own, in chunks of `SCORE_CHUNK` tokens (chunked prefill gives the same
function), on the engine loop thread between engine steps (`Engine.score_prompt`; on several ranks every rank runs it, the
lockstep engine's command). Prefix caches are neither read nor written.
"""

from __future__ import annotations

import torch

from dsv41.model.cache import DenseCache

SCORE_CHUNK = 2048


@torch.no_grad()
def prompt_logprobs(engine, ids: list[int], top_n: int) -> list[dict | None]:
    """One entry per prompt position: None for the first, then {token, logprob, rank, top: [(id, logprob)]}."""
    model = engine.model
    cache = DenseCache(model.cfg, batch=1, dtype=model.dtype, device=engine.device)
    out: list[dict | None] = [None]
    for a in range(0, len(ids) - 1, SCORE_CHUNK):
        chunk = torch.tensor([ids[a:a + SCORE_CHUNK]], device=engine.device)
        lp = torch.log_softmax(model(chunk, cache).logits[0].float(), dim=-1)        # [T, V]
        nxt = torch.tensor(ids[a + 1:a + 1 + chunk.size(1)], device=engine.device)
        lp = lp[:nxt.numel()]
        own = lp.gather(1, nxt[:, None])[:, 0]
        rank = (lp > own[:, None]).sum(-1) + 1
        top = torch.topk(lp, top_n, dim=-1) if top_n else None
        for k in range(nxt.numel()):
            out.append({"token": int(nxt[k]), "logprob": float(own[k]), "rank": int(rank[k]),
                        "top": [] if top is None else [(int(i), float(v)) for v, i in
                                                       zip(top.values[k].tolist(), top.indices[k].tolist())]})
    return out
