"""The engine's `SamplingParams` for one choice of an OpenAI request (OpenAI's defaults where a field is null)."""

from __future__ import annotations

import hashlib

from dsv41.engine.sampling import SamplingParams
from dsv41.server.protocol import bad_request


def derive_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 uses the request's seed itself (so n=1 and the first of n choices agree); choice i > 0 a seed
    derived from (seed, i) by SHA-256."""
    if seed is None or index == 0:
        return seed
    h = hashlib.sha256(f"dsv41-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2 ** 63 - 1)


def sampling_params(req, max_new: int, index: int, logprobs: int | None, vocab: int) -> SamplingParams:
    """req: a chat or completions request; index: the choice's index in the response."""
    p = SamplingParams(
        max_tokens=max_new,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=derive_seed(req.seed, index),
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs)
    try:
        p.validate(vocab)
    except ValueError as e:
        raise bad_request(str(e)) from None
    return p
