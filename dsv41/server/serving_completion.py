"""POST /v1/completions: a prompt or a batch of them (text or token ids), `n` choices each, `echo`, legacy
logprobs."""

from __future__ import annotations

from typing import Iterator

from dsv41.server.jobs import Choice
from dsv41.server.logprobs import completion_logprobs
from dsv41.server.protocol import CompletionRequest, bad_request
from dsv41.server.runner import Delta
from dsv41.server.serving import OpenAIServing
from dsv41.server.validation import check_ids, encode

MAX_SEQUENCES_PER_REQUEST = 64


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
        self.choices = [Choice(i, k, f"{self.rid}-{i}", ids, self.params(max_new, i, req.logprobs))
                        for k, ids in enumerate(encoded)
                        for i in range(k * req.n, (k + 1) * req.n)]
        self.offsets = {c.rid: 0 for c in self.choices}         # text streamed so far (logprobs' text_offset)

    def _echo(self, c: Choice) -> str:
        return self.prompt[c.prompt_index] if self.req.echo else ""

    def full_choice(self, c: Choice, comp) -> dict:
        lps = None if self.req.logprobs is None else completion_logprobs(comp.logprobs, self.state.token_text.text)
        return {"index": c.index, "text": self._echo(c) + comp.text, "finish_reason": comp.finish_reason,
                "logprobs": lps}

    def stream_head(self) -> Iterator[str]:
        if self.req.echo:
            for c in self.choices:
                yield self.chunk([{"index": c.index, "text": self._echo(c), "logprobs": None, "finish_reason": None}])

    def delta_choice(self, c: Choice, ev: Delta) -> dict | None:
        if not (ev.text or ev.logprobs):
            return None
        lps = None
        if self.req.logprobs is not None:
            lps = completion_logprobs(ev.logprobs, self.state.token_text.text, self.offsets[c.rid])
        self.offsets[c.rid] += len(ev.text)
        return {"index": c.index, "text": ev.text, "logprobs": lps, "finish_reason": None}

    def finish_choice(self, c: Choice, comp) -> dict:
        return {"index": c.index, "text": "", "logprobs": None, "finish_reason": comp.finish_reason}
