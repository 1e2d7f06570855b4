"""POST /v1/completions: a prompt or a batch of them (text or token ids), `n` choices each, `echo`, legacy
logprobs, and prompt log-probabilities.

`echo` with `logprobs` returns the prompt's own log-probabilities in front of the completion's (the first prompt
token has none: null), `max_tokens: 0` with `echo` only scores the prompt, and `prompt_logprobs` (vLLM's
extension) adds the per-position dicts vLLM returns. That is the protocol `lm-evaluation-harness`'s
`local-completions` model scores multiple-choice and perplexity tasks with (`scoring` computes the numbers).
`response_format` json_object / json_schema constrain the completion as in chat. `return_tokens_as_token_ids`
(vLLM's extension) names each logprobs token "token_id:ID" instead of its text, so a client sees the exact ids
(text_offset still counts the text's characters).
"""

from __future__ import annotations

import itertools
from typing import Iterator

from dsv41.engine.engine import StepOutput
from dsv41.server.logprobs import completion_logprobs, echo_entries, prompt_logprobs_vllm
from dsv41.server.protocol import CompletionRequest, bad_request
from dsv41.server.serving import MAX_SEQUENCES_PER_REQUEST, Choice, OpenAIServing
from dsv41.server.validation import check_ids, encode


def token_id_name(i: int) -> str:
    return f"token_id:{i}"


class ServingCompletion(OpenAIServing):
    endpoint = "completions"
    request_model = CompletionRequest
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def prepare(self) -> None:
        req, st = self.req, self.state
        prompts = req.prompts()
        if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(f"at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n) per request", "n")
        self.prompt, encoded = [], []                           # per prompt: the text to echo, the token ids
        for k, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{k}"
            if p == "":
                raise bad_request(f"{param}: the prompt is empty", param)
            ids = encode(st.tokenizer, p, param) if isinstance(p, str) else list(p)
            check_ids(ids, st.engine.cfg.vocab_size, param)
            self.prompt.append(p if isinstance(p, str) else st.tokenizer.decode(ids) if req.echo else "")
            encoded.append(ids)
        self.prompt_lens = [len(ids) for ids in encoded]
        max_new = self.max_tokens(req.max_tokens, max(self.prompt_lens), "max_tokens", "prompt")
        self.structured(False)
        score = req.scored()
        self.choices = [Choice(i, k, f"{self.rid}-{i}", ids, self.params(max_new, i, req.logprobs),
                               score=score if i == k * req.n else None, generate=max_new > 0)
                        for k, ids in enumerate(encoded)
                        for i in range(k * req.n, (k + 1) * req.n)]
        self.offsets = {c.rid: 0 for c in self.choices}         # text streamed so far (logprobs' text_offset)
        self.echo_logprobs = req.echo and req.logprobs is not None

    def _echo(self, c: Choice) -> str:
        return self.prompt[c.prompt_index] if self.req.echo else ""

    def _logprobs(self, entries: list[dict], offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        text = self.state.token_text.text
        if not self.req.return_tokens_as_token_ids:
            return completion_logprobs(entries, text, offset)
        lps = completion_logprobs(entries, token_id_name, offset)
        lps["text_offset"] = list(itertools.accumulate((len(text(e["token"])) for e in entries), initial=offset))[:-1]
        return lps

    def _prompt_entries(self, c: Choice) -> list[dict]:
        """The echoed prompt's logprob entries (with `echo` and `logprobs`), top alternatives cut to `logprobs`."""
        if not self.echo_logprobs:
            return []
        n = self.req.logprobs
        return [e if e["logprob"] is None else {**e, "top": e["top"][:n]}
                for e in echo_entries(c.prompt_ids, self.scores[c.prompt_index])]

    def full_choice(self, c: Choice, comp) -> dict:
        entries = self._prompt_entries(c) + (comp.logprobs if c.generate else [])
        choice = {"index": c.index, "text": self._echo(c) + comp.text, "finish_reason": comp.finish_reason,
                  "logprobs": self._logprobs(entries)}
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_vllm(self.scores[c.prompt_index], self.state.token_text)
        return choice

    def stream_head(self) -> Iterator[str]:
        if self.req.echo and not self.echo_logprobs:
            for c in self.choices:
                yield self.chunk([{"index": c.index, "text": self._echo(c), "logprobs": None, "finish_reason": None}])

    def scored(self, c: Choice, ev) -> Iterator[str]:
        """With echo and logprobs, a stream opens each choice of the prompt with the prompt and its logprobs."""
        yield from super().scored(c, ev)
        if not self.echo_logprobs:
            return
        for d in [d for d in self.choices if d.prompt_index == c.prompt_index]:
            lps = self._logprobs(self._prompt_entries(d))
            self.offsets[d.rid] = len(self._echo(d))
            yield self.chunk([{"index": d.index, "text": self._echo(d), "logprobs": lps, "finish_reason": None}])

    def delta_choice(self, c: Choice, ev: StepOutput) -> dict | None:
        if not (ev.new_text or ev.new_logprobs):
            return None
        lps = self._logprobs(ev.new_logprobs, self.offsets[c.rid])
        self.offsets[c.rid] += len(ev.new_text)
        return {"index": c.index, "text": ev.new_text, "logprobs": lps, "finish_reason": None}

    def finish_choice(self, c: Choice, comp) -> dict:
        return {"index": c.index, "text": "", "logprobs": None, "finish_reason": comp.finish_reason}
