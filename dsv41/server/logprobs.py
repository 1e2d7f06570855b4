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
    """The legacy completions logprobs block: tokens, token_logprobs, top_logprobs (dict per position), text_offset."""
    tokens = [token_str(e["token"]) for e in entries]
    tops = []
    for e in entries:
        top: dict[str, float] = {}                      # the first of several ids with one text wins
        for i, lp in e["top"]:
            top.setdefault(token_str(i), _clean(lp))
        tops.append(top)
    offsets = list(itertools.accumulate([len(t) for t in tokens], initial=text_offset0))[:-1]
    return {"tokens": tokens, "token_logprobs": [_clean(e["logprob"]) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def _clean(x: float) -> float:
    # JSON has no -inf: clamp like vLLM does (-9999.0)
    return float(x) if math.isfinite(x) else -9999.0
