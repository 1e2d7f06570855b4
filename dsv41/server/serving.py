"""What the two generation endpoints, POST /v1/chat/completions (`serving_chat.ServingChat`) and POST
/v1/completions (`serving_completion.ServingCompletion`), share (`OpenAIServing`): a request parsed and validated
into engine requests (`Choice`s), run as one `Job`, answered as one JSON body or streamed as server-sent events.
Each endpoint says how a request becomes choices and how a choice looks.

A job (`Job`): the engine requests of one HTTP request (one per choice), submitted to the engine loop together,
their events arriving on one asyncio queue, and the client watched while they run: a client that goes away has
its engine requests aborted, which frees their batch slots.

Extensions beyond OpenAI's fields: request `top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`,
`cache_salt` (vLLM's: requests with different salts never share prefix-cache entries), `prompt_logprobs`,
`return_tokens_as_token_ids` (completions' logprobs name token ids),
`return_prompt` (the response then carries the rendered `prompt`); response `engine_stats` (per choice: prefill mode, timings, KV bytes, cache
path, preemptions); `usage.prompt_tokens_details` carries `cached_tokens_by_tier` and `cache_path` next to OpenAI's
`cached_tokens`.

Streams are server-sent events (`sse`): one `data:` line per chunk, `data: [DONE]` last; a failure once the
headers are gone is an OpenAI error event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsv41.engine.engine import Completion, StepOutput
from dsv41.engine.sampling import SamplingParams
from dsv41.server.grammar import json_body
from dsv41.server.protocol import APIError, bad_request, merge_usage, parse, usage_from_stats
from dsv41.server.runner import Accepted, Failed, Scored
from dsv41.server.state import ServerState
from dsv41.server.validation import check_model, read_json

log = logging.getLogger("dsv41.server")
MAX_SEQUENCES_PER_REQUEST = 64                  # completions: prompts x n
DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def error_sse(message: str, status: int) -> str:
    """A failure inside a stream (the headers are gone), as an OpenAI error event."""
    return sse(APIError(status, message).body())


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` when it is done, whatever happened."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ------------------------------------------------------------------------------------------------ jobs

@dataclass
class Choice:
    """One engine request of a job: a choice of the response."""
    index: int                 # choice index in the response
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    score: int | None = None   # compute the prompt's log-probabilities with this many alternatives
    generate: bool = True      # False: the prompt is only scored (max_tokens 0)
    vision: tuple | None = None   # images: (ImageRecords, token types) of the expanded prompt


class ClientGone(Exception):
    """The client went away while its job ran."""


class Job:
    def __init__(self, state: ServerState, choices: list[Choice]):
        self.state = state
        self.choices = {c.rid: c for c in choices}
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.open: set[str] = set()
        self.early: list = []
        self._get: asyncio.Task | None = None
        self._counted = 0
        self._checked = time.monotonic()

    def _sink(self, ev) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)     # raises once the loop is closed: the runner aborts

    async def start(self, request: Request | None) -> None:
        """Submit every choice and wait until the engine accepted them all (APIError if it refused one)."""
        st = self.state
        n = len(self.choices)
        if st.in_flight + n > st.settings.max_in_flight:
            raise APIError(429, f"the server has {st.in_flight} requests in flight (limit "
                                f"{st.settings.max_in_flight}); retry later", code="too_many_requests")
        if not st.runner.alive():
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        st.in_flight += n
        self._counted = n
        for c in self.choices.values():
            st.runner.submit(c.prompt_ids, c.params, c.rid, self._sink, c.score, c.generate, c.vision)
        pending = set(self.choices)
        failure: Failed | None = None
        try:
            while pending:
                ev = await self._next(request)
                pending.discard(ev.request_id)      # a request's first event is Accepted or Failed
                if isinstance(ev, Accepted):
                    self.open.add(ev.request_id)
                elif isinstance(ev, Failed):
                    failure = failure or ev
                else:
                    self.early.append(ev)
            if failure is not None:
                raise APIError(failure.status, failure.message,
                               code="invalid_request" if failure.status == 400 else None)
        except BaseException:
            self.abort()
            raise

    async def _next(self, request: Request | None):
        """The next event; with a request, check every `disconnect_poll_s` (events flowing or not) whether the
        client went away."""
        poll = self.state.settings.disconnect_poll_s
        while True:
            if request is not None and time.monotonic() - self._checked >= poll:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            if self._get is None:
                self._get = asyncio.ensure_future(self.q.get())
            done, _ = await asyncio.wait({self._get}, timeout=None if request is None else poll)
            if done:
                ev, self._get = self._get.result(), None
                return ev

    async def events(self, request: Request | None):
        """Events until every choice is done (or one fails)."""
        early, self.early = self.early, []
        for ev in early:                        # a request that only scores its prompt may finish before the
            if isinstance(ev, (Completion, Failed)):        # others are accepted
                self.open.discard(ev.request_id)
            yield ev
        while self.open:
            ev = await self._next(request)
            if isinstance(ev, (Completion, Failed)):
                self.open.discard(ev.request_id)
            yield ev

    def abort(self) -> None:
        for rid in list(self.open):
            self.state.runner.abort(rid)
        self.open.clear()
        if self._get is not None:
            self._get.cancel()
            self._get = None

    def release(self) -> None:
        """Abort what still runs and count the job's requests out of the in-flight total (once)."""
        self.abort()
        self.state.in_flight -= self._counted
        self._counted = 0


# ------------------------------------------------------------------------------------------------ endpoints

def derive_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 uses the request's seed itself (so n=1 and the first of n choices agree); choice i > 0 a seed
    derived from (seed, i) by SHA-256."""
    if seed is None or index == 0:
        return seed
    h = hashlib.sha256(f"dsv41-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2 ** 63 - 1)


def engine_stats(c: Choice, comp) -> dict:
    keys = ("prefill_mode", "prefill_s", "decode_s", "ttft_s", "kv_bytes", "cache_path", "cached_tokens", "preemptions",
            "speculative")
    return {"index": c.index, **{k: comp.stats.get(k) for k in keys}}


class OpenAIServing:
    """One request to a generation endpoint. A subclass sets the class attributes and provides:

        prepare()               build `choices` (the engine requests), `prompt_lens` (tokens of each distinct
                                prompt: usage counts each once) and `prompt` (what `return_prompt` puts in the
                                response's "prompt")
        full_choice(c, comp)    a choice of the whole JSON body
        stream_head()           chunks a stream opens with, before any engine event (default: none)
        delta_choice(c, ev)     the chunk choice for new text / logprobs (None: nothing worth a chunk)
        finish_choice(c, comp)  the chunk choice that ends a choice
    """

    endpoint: str                # the metrics label
    request_model: type          # the pydantic request model
    id_prefix: str
    object: str                  # the response's "object"
    chunk_object: str            # a stream chunk's "object"

    def __init__(self, state: ServerState, req):
        self.state, self.req = state, req
        self.rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.constraint = None                  # the grammar of `response_format` / a required tool call
        self.scores: dict[int, list] = {}       # prompt index -> its log-probabilities (when scored)

    @classmethod
    async def handle(cls, request: Request) -> Response:
        """The endpoint: every validation failure is answered in OpenAI's error shape."""
        state: ServerState = request.app.state.dsv41
        t0 = time.perf_counter()
        try:
            req = parse(cls.request_model, await read_json(request, state.settings.max_body_bytes))
            check_model(state.settings, req.model)
            req.check_unsupported()
            serving = cls(state, req)
            serving.prepare()
        except APIError as e:
            return cls._failed(state, e)
        return await serving.respond(request, t0)

    # ---------------------------------------------------------------- shared pieces
    def stream_head(self) -> Iterator[str]:
        return iter(())

    def max_tokens(self, requested: int | None, n_prompt: int, param: str, prompt_param: str) -> int:
        """The completion length: `requested`, or the default capped by the context left; a 400 when the prompt
        leaves no room or prompt + requested exceeds the context."""
        max_len = self.state.engine.max_seq_len
        if n_prompt >= max_len:
            raise bad_request(f"This model's maximum context length is {max_len} tokens; the prompt has {n_prompt}"
                              f" tokens, leaving no room to generate", prompt_param, "context_length_exceeded")
        if requested is None:
            return min(self.state.settings.default_max_tokens, max_len - n_prompt)
        if n_prompt + requested > max_len:
            raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                              f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the "
                              f"completion)", param, "context_length_exceeded")
        return requested

    def params(self, max_new: int, index: int, logprobs: int | None) -> SamplingParams:
        """The engine's sampling parameters for choice `index` (OpenAI's defaults where a field is null)."""
        req, engine = self.req, self.state.engine
        p = SamplingParams(max_tokens=max(1, max_new),
                           temperature=1.0 if req.temperature is None else float(req.temperature),
                           top_k=0 if req.top_k in (None, -1) else req.top_k,
                           top_p=1.0 if req.top_p is None else float(req.top_p), seed=derive_seed(req.seed, index),
                           stop=req.stop_list(), stop_token_ids=list(req.stop_token_ids or []),
                           ignore_eos=req.ignore_eos, logprobs=logprobs,
                           presence_penalty=float(req.presence_penalty or 0.0),
                           frequency_penalty=float(req.frequency_penalty or 0.0),
                           repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                           logit_bias=req.bias(engine.cfg.vocab_size), constraint=self.constraint,
                           cache_salt=req.cache_salt)
        try:
            p.validate(engine.cfg.vocab_size)
        except ValueError as e:
            raise bad_request(str(e)) from None
        if p.processed() and getattr(engine, "drafter", None) is not None:
            raise bad_request("logit_bias, penalties, tools with a required call and response_format need the server "
                              "to run without speculative decoding (--speculative off)", "logit_bias"
                              if req.logit_bias else None, "unsupported_with_speculative")
        return p

    def structured(self, reasoning: bool) -> None:
        """`response_format` -> the grammar every choice follows (`self.constraint`; None for text)."""
        rf, self.constraint = self.req.response_format, None
        if rf is None or rf.get("type", "text") == "text":
            return
        if rf.get("type") == "json_object":
            body = json_body(None)
        elif rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format")
            body = json_body(schema)
        else:
            raise bad_request(f"response_format.type {rf.get('type')!r}: use text, json_object or json_schema",
                              "response_format")
        self.constraint = self.compile(body, reasoning, "response_format")

    def compile(self, body: str, reasoning: bool, param: str):
        try:
            return self.state.grammars.compile(body, reasoning, param)
        except ValueError as e:
            raise bad_request(str(e), param, "invalid_grammar") from None

    def scored(self, c: Choice, ev: Scored) -> Iterator[str]:
        """A prompt's log-probabilities arrived (the first choice of each prompt asks for them): kept, and the
        stream chunks they complete (default: none)."""
        self.scores[c.prompt_index] = ev.entries
        return iter(())

    def usage(self, done: list[tuple[Choice, Any]]) -> dict:
        """The usage of the finished (choice, completion) pairs."""
        return merge_usage([usage_from_stats(comp.stats, len(c.prompt_ids), len(comp.output_ids)) for c, comp in done],
                           self.prompt_lens, [c.prompt_index for c, _ in done])

    def header(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.req.model,
                "system_fingerprint": f"dsv41-{self.state.engine.prefill_mode}"}

    def chunk(self, choices: list[dict]) -> str:
        usage = {"usage": None} if self.include_usage else {}       # the usage comes in a chunk of its own
        return sse({**self.header(self.chunk_object), "choices": choices, **usage})

    def full_body(self, results: dict[str, Any]) -> dict:
        done = [(c, results[c.rid]) for c in self.choices]
        body = {**self.header(self.object), "choices": [self.full_choice(c, r) for c, r in done],
                "usage": self.usage(done), "engine_stats": [engine_stats(c, r) for c, r in done]}
        if self.req.return_prompt:
            body["prompt"] = self.prompt
        return body

    async def stream_body(self, job: Job, request: Request) -> AsyncIterator[str]:
        for piece in self.stream_head():
            yield piece
        done = []
        async for ev in job.events(request):
            c = job.choices[ev.request_id]
            if isinstance(ev, StepOutput):
                choice = self.delta_choice(c, ev)
                if choice is not None:
                    yield self.chunk([choice])
            elif isinstance(ev, Completion):
                done.append((c, ev))
                yield self.chunk([self.finish_choice(c, ev)])
            elif isinstance(ev, Scored):
                for piece in self.scored(c, ev):
                    yield piece
            else:
                yield error_sse(ev.message, ev.status)
                job.abort()
                break
        if self.include_usage:                                   # the final usage-only chunk
            yield sse({**self.header(self.chunk_object), "choices": [], "usage": self.usage(done)})
        yield DONE

    # ---------------------------------------------------------------- the job
    async def respond(self, request: Request, t0: float) -> Response:
        """Run the choices as one job; answer with the whole body, or stream it."""
        job = Job(self.state, self.choices)
        try:
            await job.start(request)
        except BaseException as e:
            job.release()
            if isinstance(e, (ClientGone, APIError)):
                return self._failed(self.state, e)
            raise
        if not self.req.stream:
            return await self._whole(job, request, t0)
        outcome = {"status": 499}                               # until the stream says otherwise

        async def body():
            try:
                async for piece in self.stream_body(job, request):
                    yield piece
                outcome["status"] = 200
            except ClientGone:
                pass
            except Exception as e:                              # report in-band, the headers are gone
                outcome["status"] = 500
                log.exception("stream failed")
                yield error_sse(f"internal server error: {type(e).__name__}", 500)
                yield DONE
            finally:
                job.release()

        def closed():
            # runs however the response ends, even when the body iterator never started (client gone before the
            # headers went out): the job's sequences are aborted and counted out exactly once
            job.release()
            st = outcome["status"]
            self.state.metrics.observe_request(self.endpoint, st, time.perf_counter() - t0 if st == 200 else None)
        return SSEResponse(body(), closed)

    async def _whole(self, job: Job, request: Request, t0: float) -> Response:
        try:
            results: dict[str, Any] = {}
            async for ev in job.events(request):
                if isinstance(ev, Completion):
                    results[ev.request_id] = ev
                elif isinstance(ev, Scored):
                    list(self.scored(job.choices[ev.request_id], ev))
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message)
            body = self.full_body(results)
        except (ClientGone, APIError) as e:
            return self._failed(self.state, e)
        finally:
            job.release()
        self.state.metrics.observe_request(self.endpoint, 200, time.perf_counter() - t0)
        return JSONResponse(body)

    @classmethod
    def _failed(cls, state: ServerState, e: ClientGone | APIError) -> Response:
        """The answer to a request that failed before its body: the error, or 499 when the client went away."""
        status = e.status if isinstance(e, APIError) else 499
        state.metrics.observe_request(cls.endpoint, status)
        return JSONResponse(e.body(), status_code=status) if isinstance(e, APIError) else Response(status_code=499)
