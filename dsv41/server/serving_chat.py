"""POST /v1/chat/completions: messages rendered by the chat template (reasoning effort, `chat_template_kwargs`
{"thinking": bool}), `n` choices of one prompt, the answer split into `reasoning_content` and `content` when
the model thinks."""

from __future__ import annotations

from typing import Iterator

from dsv41.server.chat import ReasoningSplitter, effort_budget
from dsv41.server.jobs import Choice
from dsv41.server.logprobs import chat_logprobs
from dsv41.server.protocol import ChatCompletionRequest, bad_request
from dsv41.server.runner import Delta
from dsv41.server.serving import OpenAIServing, sse
from dsv41.server.validation import check_ids, encode


class ServingChat(OpenAIServing):
    endpoint = "chat"
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prepare(self) -> None:
        req, st = self.req, self.state
        try:
            effort = effort_budget(req.reasoning_effort)
        except ValueError as e:
            raise bad_request(str(e), "reasoning_effort", "invalid_reasoning_effort") from None
        thinking = (req.chat_template_kwargs or {}).get("thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise bad_request("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
        messages = [{"role": m.role, "content": m.text(), "reasoning_content": m.reasoning_content}
                    for m in req.messages]
        try:
            self.prompt = st.template.render(messages, effort, thinking)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = encode(st.tokenizer, self.prompt, "messages")
        check_ids(ids, st.engine.cfg.vocab_size, "messages")
        max_new = self.max_tokens(req.max_new_tokens(), len(ids),
                                  "max_completion_tokens" if req.max_completion_tokens else "max_tokens", "messages")
        self.lp = (req.top_logprobs or 0) if req.logprobs else None
        self.choices = [Choice(i, 0, f"{self.rid}-{i}", ids, self.params(max_new, i, self.lp)) for i in range(req.n)]
        self.prompt_lens = [len(ids)]
        self.split = st.template.name != "simple" and (thinking if thinking is not None else effort is not None)
        self.splitters: dict[str, ReasoningSplitter] = {}

    def _delta(self, c: Choice, text: str, final: bool = False) -> dict:
        """New answer text as a delta: reasoning and answer apart when the model thinks."""
        if not self.split:
            return {"content": text} if text else {}
        r, a = self.splitters.setdefault(c.rid, ReasoningSplitter(True)).feed(text, final=final)
        return {k: v for k, v in (("reasoning_content", r), ("content", a)) if v}

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.lp is None else chat_logprobs(entries, self.state.token_text)

    def full_choice(self, c: Choice, comp) -> dict:
        msg = {"role": "assistant", "content": comp.text}
        if self.split:
            r, a = ReasoningSplitter(True).feed(comp.text, final=True)
            msg = {"role": "assistant", "content": a, "reasoning_content": r}
        return {"index": c.index, "message": msg, "finish_reason": comp.finish_reason,
                "logprobs": self._logprobs(comp.logprobs)}

    def stream_head(self) -> Iterator[str]:
        if self.req.return_prompt:
            yield sse({"id": self.rid, "object": self.chunk_object, "created": self.created, "model": self.req.model,
                       "choices": [], "prompt": self.prompt})
        for c in self.choices:
            yield self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])

    def delta_choice(self, c: Choice, ev: Delta) -> dict | None:
        delta = self._delta(c, ev.text)
        if not (delta or ev.logprobs):
            return None
        return {"index": c.index, "delta": delta, "finish_reason": None, "logprobs": self._logprobs(ev.logprobs)}

    def finish_choice(self, c: Choice, comp) -> dict:
        return {"index": c.index, "delta": self._delta(c, "", final=True), "logprobs": None,
                "finish_reason": comp.finish_reason}
