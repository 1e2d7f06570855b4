"""Log-probabilities in OpenAI's two formats (chat: token, logprob, bytes, top_logprobs; legacy completions:
tokens, token_logprobs, top_logprobs, text_offset), from the engine's entries {token, logprob, top: [(id, lp)]},
and the text and raw bytes of a token id that both formats show."""

from __future__ import annotations

import functools
import itertools
import math

from dsv41.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable bytes stand for themselves, the others are shifted to
    code points from 256 up, in byte order)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


BYTE_DECODER = _byte_decoder()


class TokenText:
    """Token id -> its text and its raw bytes (memoised: logprobs show the same ids over and over)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._get = functools.lru_cache(maxsize=200_000)(self._lookup)

    def _lookup(self, i: int) -> tuple[str, list[int]]:
        raw = None
        if isinstance(self.tok, ByteTokenizer):
            raw = [i - 3] if 3 <= i < 259 else []
        elif isinstance(self.tok, HFTokenizer):
            piece = self.tok.tok.id_to_token(i)
            if piece is not None and all(c in BYTE_DECODER for c in piece):
                raw = [BYTE_DECODER[c] for c in piece]
        if raw is None:
            raw = list(self.tok.decode([i]).encode("utf-8"))
        text = bytes(raw).decode("utf-8", errors="replace") if raw else self.tok.decode([i])
        return text, raw

    def text(self, i: int) -> str:
        return self._get(i)[0]

    def bytes(self, i: int) -> list[int]:
        return self._get(i)[1]


def chat_logprobs(entries: list[dict], tt: TokenText) -> dict:
    """A chat choice's `logprobs`: {"content": one entry per token}."""
    return {"content": [{"token": tt.text(e["token"]), "logprob": _clean(e["logprob"]), "bytes": tt.bytes(e["token"]),
                         "top_logprobs": [{"token": tt.text(i), "logprob": _clean(lp), "bytes": tt.bytes(i)}
                                          for i, lp in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], token_str, text_offset0: int = 0) -> dict:
    """The legacy completions logprobs block: tokens, token_logprobs, top_logprobs (dict per position), text_offset.

    Entries of a scored prompt (`scoring.prompt_logprobs`, the first position as {"token": id, "logprob": None})
    carry a rank: their top dict also holds the prompt's own token, as vLLM's does (an evaluation harness tells a
    greedy continuation by its logprob being the dict's maximum)."""
    tokens = [token_str(e["token"]) for e in entries]
    tops: list[dict | None] = []
    for e in entries:
        if e["logprob"] is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}                      # the first of several ids with one text wins
        for i, lp in e["top"]:
            top.setdefault(token_str(i), _clean(lp))
        if "rank" in e:
            top.setdefault(token_str(e["token"]), _clean(e["logprob"]))
        tops.append(top)
    offsets = list(itertools.accumulate([len(t) for t in tokens], initial=text_offset0))[:-1]
    return {"tokens": tokens, "token_logprobs": [None if e["logprob"] is None else _clean(e["logprob"])
                                                 for e in entries], "top_logprobs": tops, "text_offset": offsets}


def echo_entries(prompt_ids: list[int], scored: list[dict | None]) -> list[dict]:
    """A scored prompt's entries for `completion_logprobs`: the first position (no context) without a logprob."""
    return [{"token": prompt_ids[0], "logprob": None, "top": None}] + [e for e in scored[1:]]


def prompt_logprobs_vllm(scored: list[dict | None], tt: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} over the top alternatives and the prompt's own token."""
    out: list[dict | None] = []
    for e in scored:
        if e is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": _clean(lp), "rank": r + 1, "decoded_token": tt.text(i)}
             for r, (i, lp) in enumerate(e["top"])}
        d[str(e["token"])] = {"logprob": _clean(e["logprob"]), "rank": e["rank"], "decoded_token": tt.text(e["token"])}
        out.append(d)
    return out


def _clean(x: float) -> float:
    # JSON has no -inf: clamp like vLLM does (-9999.0)
    return float(x) if math.isfinite(x) else -9999.0
