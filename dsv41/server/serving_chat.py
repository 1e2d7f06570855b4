"""POST /v1/chat/completions: messages rendered by the chat template (`chat`), `n` choices of one prompt, each
answer split into `reasoning_content`, `content` and `tool_calls` (`parsing`).

Modes (official template): thinking by default with the effort line of `reasoning_effort` (default `high`), chat
mode for `reasoning_effort: "none"` or `chat_template_kwargs: {"thinking": false}` (`enable_thinking` too, and
`chat_template_kwargs.reasoning_effort`, as vLLM reads them). Tools (`tools`, `tool_choice` none / auto /
required / a named function): the definitions go into the prompt, the model's DSML call blocks come back as
`tool_calls` (finish reason `tool_calls`); `required` and a named function constrain decoding to a call
(`grammar`). `response_format` json_object / json_schema constrain the answer after the reasoning.
`usage.completion_tokens_details.reasoning_tokens` counts the tokens of the reasoning.
"""

from __future__ import annotations

from typing import Iterator

from dsv41.engine.engine import StepOutput
from dsv41.server.chat import IMAGE, chat_mode, encode_prompt
from dsv41.server.images import decode_image, expand
from dsv41.server.logprobs import chat_logprobs, prompt_logprobs_vllm
from dsv41.server.parsing import Delta, OutputParser, parse_all
from dsv41.server.protocol import ChatCompletionRequest, ImagePart, bad_request
from dsv41.server.serving import Choice, OpenAIServing, sse
from dsv41.server.tools import call_grammar, check_tools
from dsv41.server.validation import check_ids, check_text


class ServingChat(OpenAIServing):
    endpoint = "chat"
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prepare(self) -> None:
        req = self.req
        ids = self.render()
        max_new = self.max_tokens(req.max_new_tokens(), len(ids),
                                  "max_completion_tokens" if req.max_completion_tokens else "max_tokens", "messages")
        if req.task_grammar is not None:
            self.constraint = self.task_constraint()
        elif self.tool_mode not in (None, "auto"):
            self.constraint = self.compile(call_grammar(self.tools, self.tool_mode), self._reasoning_first(),
                                           "tool_choice")
        else:
            self.structured(self._reasoning_first())
        self.lp = (req.top_logprobs or 0) if req.logprobs else None
        if self.vision is not None and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are not available for prompts with images", "prompt_logprobs")
        self.choices = [Choice(i, 0, f"{self.rid}-{i}", ids, self.params(max_new, i, self.lp),
                               score=req.prompt_logprobs if i == 0 else None, vision=self.vision)
                        for i in range(req.n)]
        self.prompt_lens = [len(ids)]
        self.parsers: dict[str, OutputParser] = {}
        self.reasoning_tokens: dict[str, int] = {}

    def render(self) -> list[int]:
        """The prompt (`self.prompt`) and its token ids; sets the mode (`thinking`) and the tools."""
        req, st = self.req, self.state
        kw = req.chat_template_kwargs or {}
        thinking = kw.get("thinking", kw.get("enable_thinking"))
        if thinking is not None and not isinstance(thinking, bool):
            raise bad_request("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
        effort = req.reasoning_effort if req.reasoning_effort is not None else kw.get("reasoning_effort")
        try:
            self.thinking, self.budget = chat_mode(effort, thinking, st.template.name != "simple")
        except ValueError as e:
            raise bad_request(str(e), "reasoning_effort", "invalid_reasoning_effort") from None
        try:
            self.tools, self.tool_mode = check_tools(req.tools, req.tool_choice)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(":")[0].split(" ")[0], "invalid_tools") from None
        self.rendered = messages = self.messages()
        try:
            self.prompt = st.template.render(messages, self.budget, self.thinking, self.tools or None)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        bos, self.vision = st.tokenizer.bos_id, None
        if self.images:
            ids, self.vision = expand(st.tokenizer, check_text(self.prompt, "messages"), self.images, st.engine.cfg)
        else:
            ids = ([] if bos is None else [bos]) + encode_prompt(st.tokenizer, check_text(self.prompt, "messages"))
        check_ids(ids, st.engine.cfg.vocab_size, "messages")
        return ids

    def task_constraint(self):
        """`task_grammar` -> the plan grammar of the task the last user message states at this request's effort
        (posttrain/constrain.py): the band letter, size digit and trace template forced, the plan letter, the
        states and the answer free. A 400 when it cannot apply."""
        from dsv41.posttrain.constrain import PLAN_SETS, Grammar
        from dsv41.posttrain.tasks import parse_problem
        req = self.req
        if req.task_grammar not in PLAN_SETS:
            raise bad_request(f"task_grammar {req.task_grammar!r}: use one of {', '.join(PLAN_SETS)}", "task_grammar")
        if (req.response_format or {}).get("type", "text") != "text" or self.tools:
            raise bad_request("task_grammar cannot be combined with response_format or tools", "task_grammar")
        if not self._reasoning_first() or self.budget is None:
            raise bad_request("task_grammar needs thinking mode with an effort (reasoning_effort)", "task_grammar")
        if req.messages[-1].role != "user":
            raise bad_request("task_grammar applies to a final user message", "task_grammar")
        try:
            p = parse_problem(self.rendered[-1]["content"])
            return Grammar(self.state.tokenizer, p, self.budget, req.task_grammar)
        except ValueError as e:
            raise bad_request(f"task_grammar: {e}", "task_grammar") from None

    def messages(self) -> list[dict]:
        """The request's messages as the templates read them: text parts joined by a blank line, an image part
        as the image placeholder, tool calls as dicts."""
        out, self.images = [], []
        for i, m in enumerate(self.req.messages):
            parts = []
            for j, p in enumerate(m.parts()):
                if isinstance(p, ImagePart):
                    self.images.append(decode_image(p.image_url.url, f"messages.{i}.content.{j}.image_url"))
                    parts.append(IMAGE)
                    continue
                if IMAGE in p.text:
                    raise bad_request(f"messages.{i}.content: the text holds the image placeholder {IMAGE}; send "
                                      f"images as image_url parts", f"messages.{i}.content")
                parts.append(p.text)
            out.append({"role": m.role, "content": "\n\n".join(parts),
                        "reasoning_content": m.reasoning_content if m.reasoning_content is not None else m.reasoning,
                        "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None,
                        "tool_call_id": m.tool_call_id})
        return out

    # ---------------------------------------------------------------- answers
    def _reasoning_first(self) -> bool:
        """Whether the answer starts inside the reasoning: thinking mode, unless a final assistant message (whose
        reasoning the prompt already closed) is being continued."""
        return self.thinking and self.req.messages[-1].role != "assistant"

    def _parser(self, c: Choice) -> OutputParser:
        return self.parsers.setdefault(c.rid, OutputParser(self._reasoning_first(), self.tool_mode is not None))

    def _count_reasoning(self, c: Choice, comp, chars: int) -> None:
        """Tokens of the answer that hold its first `chars` characters (all of them while it never left the
        reasoning)."""
        if not self.thinking:
            return
        tok, ids = self.state.tokenizer, comp.output_ids
        lo, hi = 0, len(ids)
        while lo < hi:                                  # the fewest tokens whose text covers `chars` characters
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(tok.decode(ids[:mid])) < chars else (lo, mid)
        self.reasoning_tokens[c.rid] = lo

    def _delta(self, d: Delta, first_call: int) -> dict:
        out = {k: v for k, v in (("reasoning_content", d.reasoning), ("content", d.content)) if v}
        if d.calls:
            out["tool_calls"] = [{"index": first_call + k, **call} for k, call in enumerate(d.calls)]
        return out

    def _finish_reason(self, comp, calls: int) -> str:
        return "tool_calls" if calls and comp.finish_reason == "stop" else comp.finish_reason

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.lp is None else chat_logprobs(entries, self.state.token_text)

    def full_choice(self, c: Choice, comp) -> dict:
        d, chars = parse_all(comp.text, self._reasoning_first(), self.tool_mode is not None)
        self._count_reasoning(c, comp, chars)
        msg = {"role": "assistant", "content": d.content if d.content or not d.calls else None}
        if self.thinking:
            msg["reasoning_content"] = d.reasoning
        if d.calls:
            msg["tool_calls"] = d.calls
        return {"index": c.index, "message": msg, "finish_reason": self._finish_reason(comp, len(d.calls)),
                "logprobs": self._logprobs(comp.logprobs)}

    def full_body(self, results: dict) -> dict:
        body = super().full_body(results)
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_vllm(self.scores.get(0, []), self.state.token_text)
        return body

    def usage(self, done: list) -> dict:
        u = super().usage(done)
        u["completion_tokens_details"]["reasoning_tokens"] = sum(self.reasoning_tokens.get(c.rid, 0) for c, _ in done)
        return u

    def stream_head(self) -> Iterator[str]:
        if self.req.return_prompt:
            yield sse({"id": self.rid, "object": self.chunk_object, "created": self.created, "model": self.req.model,
                       "choices": [], "prompt": self.prompt})
        for c in self.choices:
            yield self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])

    def delta_choice(self, c: Choice, ev: StepOutput) -> dict | None:
        p = self._parser(c)
        first = p.n_calls
        delta = self._delta(p.feed(ev.new_text), first)
        if not (delta or ev.new_logprobs):
            return None
        return {"index": c.index, "delta": delta, "finish_reason": None, "logprobs": self._logprobs(ev.new_logprobs)}

    def finish_choice(self, c: Choice, comp) -> dict:
        p = self._parser(c)
        first = p.n_calls
        delta = self._delta(p.feed("", final=True), first)
        self._count_reasoning(c, comp, p.reasoning_chars)
        return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": self._finish_reason(comp,
                                                                                                         p.n_calls)}
