"""Grammar-constrained decoding with llguidance: `response_format` (`json_object`, `json_schema`) and the forced
tool call of `tool_choice` `required` / named, as token masks the sampler applies on the logits' device
(`dsv41.engine.sampling.LogitsState`).

A grammar is compiled once per request (`Grammars.compile`, a 400 naming the field when it does not compile) and
each choice gets its own matcher (`Grammar.start`). In thinking mode the model reasons first: the grammar then
begins with free text ending at `</think>` (llguidance's `stop` attribute), as vLLM enforces structured output
only once the reasoning is over. When the grammar is complete only EOS is allowed, so the answer ends there.

llguidance is an optional dependency (`pip install 'dsv41[structured]'`, part of `.[test]`): without it these
fields are answered with a 400 that says so.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from dsv41.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

REASONING_RULE = 'reason[stop="</think>"]: /(.|\\n)*/\n'


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class _ByteVocab:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer, for `ByteTokenizer` (ids 0..2 special)."""

    def __init__(self, tok: ByteTokenizer):
        self.eos_token_id, self.bos_token_id, self.special_token_ids = tok.eos_id, tok.bos_id, [0, 1, 2]
        self.tokens = [b"<|bos|>", b"<|eos|>", b"<|pad|>"] + [bytes([b]) for b in range(256)]

    def __call__(self, s):
        return [3 + b for b in (s.encode("utf-8") if isinstance(s, str) else s)]


class Grammars:
    """The llguidance tokenizer of one server (built on first use: about a second for a large vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None

    def ll_tokenizer(self):
        import llguidance as llg
        if self._ll is None:
            t = self.tokenizer
            if isinstance(t, HFTokenizer):
                self._ll = llg.LLTokenizer(t.tok.to_str(), n_vocab=self.vocab_size, eos_token=t.eos_id)
            elif isinstance(t, ByteTokenizer):
                self._ll = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(t)), n_vocab=self.vocab_size)
            else:
                raise ValueError(f"structured output does not know the tokenizer {type(t).__name__}")
        return self._ll

    def compile(self, body: str, reasoning: bool, param: str) -> "Grammar":
        """`body`: Lark rules whose start symbol is `body` -> a grammar (ValueError naming `param` if it does not
        compile). With `reasoning`, free text up to `</think>` comes first."""
        if not available():
            raise ValueError(f"{param}: structured output needs the llguidance package (pip install "
                             f"'dsv41[structured]')")
        import llguidance as llg
        start = "start: reason body\n" + REASONING_RULE if reasoning else "start: body\n"
        grammar = llg.LLMatcher.grammar_from_lark(start + body)
        err = llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        if err:
            raise ValueError(f"{param}: the grammar does not compile: {err.strip().splitlines()[0][:300]}")
        return Grammar(self.ll_tokenizer(), grammar, self.tokenizer.eos_id)


def json_body(schema: dict | None) -> str:
    """Lark rules for one JSON value: any object (`json_object`), or one valid under `schema`."""
    return "body: %json " + json.dumps({"type": "object"} if schema is None else schema) + "\n"


class Grammar:
    """A compiled grammar; `start()` gives one request's matcher (`dsv41.engine.sampling.Constraint`)."""

    def __init__(self, ll_tokenizer, grammar: str, eos_id: int | None):
        self.ll_tokenizer, self.grammar, self.eos_id = ll_tokenizer, grammar, eos_id

    def start(self) -> "Matcher":
        import llguidance as llg
        return Matcher(llg.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0), self.eos_id)


class Matcher:
    """One request's position in the grammar: the allowed next tokens as a bool mask on the logits' device."""

    def __init__(self, m, eos_id: int | None):
        self.m, self.eos_id = m, eos_id

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, bits.size)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if not bool(mask.any()):                        # an error state: nothing fits; end the answer
            mask[self.eos_id if self.eos_id is not None else slice(None)] = True
        return mask.to(device, non_blocking=True)

    def consume(self, token: int) -> None:
        self.m.consume_token(token)
