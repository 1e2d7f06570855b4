"""The OpenAI-compatible HTTP API (FastAPI): `create_app(engine, ...)`, and `serve_in_thread` to run it on loopback.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.

One engine loop thread (`EngineRunner`) owns the engine; each HTTP request becomes one engine request per choice
(`n` choices, and for completions one per prompt of a batch), whose events come back on an asyncio queue. A client
that disconnects (mid-stream or while waiting for a non-streamed answer) has its engine requests aborted, which
frees their batch slots. Every failure is answered in OpenAI's error shape; nothing a client sends can stop the
engine loop or the server.

Extensions beyond OpenAI's fields: request `top_k`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`
({"thinking": bool}), `return_prompt` (the response then carries the rendered `prompt`); response `engine_stats`
(per choice: prefill mode, timings, KV bytes, cache path); `usage.prompt_tokens_details` carries
`cached_tokens_by_tier` and `cache_path` next to OpenAI's `cached_tokens`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsv41.engine.sampling import SamplingParams
from dsv41.server.chat import ReasoningSplitter, effort_budget, pick_template
from dsv41.server.metrics import ServerMetrics
from dsv41.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request,
                                   chat_logprob_entry, completion_logprobs, error_body, merge_usage, parse,
                                   public_usage, usage_from_stats)
from dsv41.server.runner import Accepted, Delta, Done, EngineRunner, Failed

log = logging.getLogger("dsv41.server")

MAX_SEQUENCES_PER_REQUEST = 64


@dataclass
class ServerSettings:
    model_name: str = "dsv41"
    aliases: tuple[str, ...] = ()
    chat_template: str = "auto"              # auto | official | simple
    default_max_tokens: int = 256            # when a request gives none (capped by the context left)
    max_body_bytes: int = 8 << 20
    max_in_flight: int = 1024                # engine requests queued or running; beyond: 429
    disconnect_poll_s: float = 0.5
    checkpoint: str | None = None


@dataclass
class _State:
    engine: Any
    tokenizer: Any
    runner: EngineRunner
    metrics: ServerMetrics
    settings: ServerSettings
    template: Any
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0


class ClientGone(Exception):
    pass


# ------------------------------------------------------------------------------------------------ helpers

def _now() -> int:
    return int(time.time())


def derive_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 uses the request's seed itself (so n=1 and the first of n choices agree); choice i > 0 a seed
    derived from (seed, i) by SHA-256."""
    if seed is None or index == 0:
        return seed
    h = hashlib.sha256(f"dsv41-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2 ** 63 - 1)


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (printable bytes stand for themselves, the others are shifted to
    code points from 256 up, in byte order)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
        table, extra = {}, 0
        for b in range(256):
            if b in keep:
                table[chr(b)] = b
            else:
                table[chr(256 + extra)] = b
                extra += 1
        _BYTE_DECODER = table
    return _BYTE_DECODER


class _TokenText:
    """Token id -> its text and its raw bytes, for logprobs."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def _get(self, i: int) -> tuple[str, list[int]]:
        hit = self.cache.get(i)
        if hit is not None:
            return hit
        from dsv41.engine.tokenizer import ByteTokenizer
        if isinstance(self.tok, ByteTokenizer):
            raw = [i - 3] if 3 <= i < 259 else []
        else:
            raw = None
            piece = getattr(getattr(self.tok, "tok", None), "id_to_token", lambda _: None)(i)
            if piece is not None:
                dec = _byte_decoder()
                if all(c in dec for c in piece):
                    raw = [dec[c] for c in piece]
            if raw is None:
                raw = list(self.tok.decode([i]).encode("utf-8"))
        text = bytes(raw).decode("utf-8", errors="replace") if raw else self.tok.decode([i])
        if len(self.cache) < 200_000:
            self.cache[i] = (text, raw)
        return text, raw

    def text(self, i: int) -> str:
        return self._get(i)[0]

    def bytes(self, i: int) -> list[int]:
        return self._get(i)[1]


# ------------------------------------------------------------------------------------------------ jobs

@dataclass
class _Seq:
    index: int                 # choice index in the response
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


class _Job:
    """The engine requests of one HTTP request, and the asyncio queue their events arrive on."""

    def __init__(self, state: _State, seqs: list[_Seq]):
        self.state = state
        self.seqs = {s.rid: s for s in seqs}
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.open: set[str] = set()
        self.early: list = []
        self._get: asyncio.Task | None = None
        self._counted = 0
        self._checked = time.monotonic()

    def _sink(self, rid: str):
        loop, q = self.loop, self.q

        def sink(ev):
            loop.call_soon_threadsafe(q.put_nowait, ev)     # raises once the loop is closed: the runner aborts
        return sink

    async def start(self, request: Request | None) -> None:
        st = self.state
        n = len(self.seqs)
        if st.in_flight + n > st.settings.max_in_flight:
            raise APIError(429, f"the server has {st.in_flight} requests in flight (limit "
                                f"{st.settings.max_in_flight}); retry later", code="too_many_requests")
        if not st.runner.alive():
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        st.in_flight += n
        self._counted = n
        for s in self.seqs.values():
            st.runner.submit(s.prompt_ids, s.params, s.rid, self._sink(s.rid))
        pending = set(self.seqs)
        failure: Failed | None = None
        try:
            while pending:
                ev = await self._next(request)
                if isinstance(ev, Accepted):
                    pending.discard(ev.request_id)
                    self.open.add(ev.request_id)
                elif isinstance(ev, Failed):
                    pending.discard(ev.request_id)
                    failure = failure or ev
                else:
                    self.early.append(ev)
        except BaseException:
            self.abort()
            raise
        if failure is not None:
            self.abort()
            raise APIError(failure.status, failure.message,
                           code="invalid_request" if failure.status == 400 else None)

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
            if request is None:
                ev = await self._get
                self._get = None
                return ev
            done, _ = await asyncio.wait({self._get}, timeout=poll)
            if done:
                ev = self._get.result()
                self._get = None
                return ev

    async def events(self, request: Request | None):
        """Events until every sequence is done (or one fails)."""
        for ev in self.early:
            yield ev
        self.early = []
        while self.open:
            ev = await self._next(request)
            if isinstance(ev, (Done, Failed)):
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
        self.abort()
        self.state.in_flight -= self._counted
        self._counted = 0


# ------------------------------------------------------------------------------------------------ the app

def create_app(engine, settings: ServerSettings | None = None, metrics: ServerMetrics | None = None,
               tokenizer=None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = metrics or ServerMetrics()
    tokenizer = tokenizer or engine.tokenizer
    runner = EngineRunner(engine, metrics)
    state = _State(engine, tokenizer, runner, metrics, settings, pick_template(tokenizer, settings.chat_template))
    toktext = _TokenText(tokenizer)
    vocab = engine.cfg.vocab_size
    max_len = engine.max_seq_len

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="dsv41", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False                 # /v1/completions/ is a 404, not a redirect
    app.state.dsv41 = state

    # -------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
               f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(msg, "invalid_request_error" if e.status_code < 500 else "server_error"),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"),
                            status_code=500)

    # -------------------------------------------------------------- request pieces
    async def read_json(request: Request) -> Any:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > settings.max_body_bytes:
            raise APIError(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
        chunks, size = [], 0
        try:
            async for c in request.stream():
                size += len(c)
                if size > settings.max_body_bytes:
                    raise APIError(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
                chunks.append(c)
        except ClientDisconnect:
            raise bad_request("the client disconnected while sending the request body") from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise bad_request("the request body is empty: send a JSON object", code="invalid_json")

        def no_constants(name):
            raise ValueError(f"{name} is not valid JSON")
        try:
            return json.loads(raw, parse_constant=no_constants)
        except RecursionError:
            raise bad_request("malformed JSON: nested too deeply", code="invalid_json") from None
        except ValueError as e:
            raise bad_request(f"malformed JSON: {str(e)[:200]}", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != settings.model_name and name not in settings.aliases:
            raise APIError(404, f"The model `{name[:200]}` does not exist; this server serves "
                                f"`{settings.model_name}`", param="model", code="model_not_found")

    def encode(text: str, param: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{param}: text is not valid Unicode (lone surrogate)", param) from None
        ids = list(tokenizer.encode(text))
        bos = getattr(tokenizer, "bos_id", None)
        return ([bos] if bos is not None else []) + ids

    def check_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"{param}: token ids must be in [0, {vocab})", param, "invalid_token_id")

    def resolve_max_tokens(requested: int | None, n_prompt: int, param: str, prompt_param: str) -> int:
        if n_prompt >= max_len:
            raise bad_request(f"This model's maximum context length is {max_len} tokens; the prompt has {n_prompt}"
                              f" tokens, leaving no room to generate", prompt_param, "context_length_exceeded")
        if requested is None:
            return min(settings.default_max_tokens, max_len - n_prompt)
        if n_prompt + requested > max_len:
            raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                              f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the "
                              f"completion)", param, "context_length_exceeded")
        return requested

    def sampling(req, max_new: int, index: int, logprobs: int | None) -> SamplingParams:
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

    def engine_stats(seq: _Seq, comp) -> dict:
        st = comp.stats
        u = usage_from_stats(st)
        return {"index": seq.index, "prefill_mode": st.get("prefill_mode"), "prefill_s": st.get("prefill_s"),
                "decode_s": st.get("decode_s"), "ttft_s": st.get("ttft_s"), "kv_bytes": st.get("kv_bytes"),
                "cache_path": u["prompt_tokens_details"]["cache_path"],
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "speculative": st.get("speculative")}

    def seq_usage(seq: _Seq, comp) -> dict:
        u = usage_from_stats(comp.stats, len(seq.prompt_ids), len(comp.output_ids))
        u["_prompt_index"] = seq.prompt_index
        return u

    def fingerprint() -> str:
        return f"dsv41-{engine.prefill_mode}"

    # -------------------------------------------------------------- common driver
    async def run_job(request: Request, endpoint: str, seqs: list[_Seq], stream: bool, t0: float,
                      build_full, build_stream):
        job = _Job(state, seqs)
        try:
            await job.start(request)
        except ClientGone:
            job.release()
            metrics.observe_request(endpoint, 499)
            return Response(status_code=499)
        except APIError as e:
            job.release()
            metrics.observe_request(endpoint, e.status)
            return JSONResponse(e.body(), status_code=e.status)
        except BaseException:
            job.release()
            raise
        if not stream:
            try:
                results: dict[str, Any] = {}
                async for ev in job.events(request):
                    if isinstance(ev, Done):
                        results[ev.request_id] = ev.completion
                    elif isinstance(ev, Failed):
                        raise APIError(ev.status, ev.message)
                body = build_full(results)
            except ClientGone:
                metrics.observe_request(endpoint, 499)
                return Response(status_code=499)
            except APIError as e:
                metrics.observe_request(endpoint, e.status)
                return JSONResponse(e.body(), status_code=e.status)
            finally:
                job.release()
            metrics.observe_request(endpoint, 200, time.perf_counter() - t0)
            return JSONResponse(body)

        outcome = {"status": 499}                               # until the stream says otherwise

        async def sse():
            try:
                async for piece in build_stream(job, request):
                    yield piece
                outcome["status"] = 200
            except ClientGone:
                pass
            except Exception as e:                              # report in-band, the headers are gone
                outcome["status"] = 500
                log.exception("stream failed")
                yield _sse(error_body(f"internal server error: {type(e).__name__}", "server_error"))
                yield "data: [DONE]\n\n"
            finally:
                job.release()

        def closed():
            # runs however the response ends, even when the body iterator never started (client gone before the
            # headers went out): the job's sequences are aborted and counted out exactly once
            job.release()
            st = outcome["status"]
            metrics.observe_request(endpoint, st, time.perf_counter() - t0 if st == 200 else None)
        return _SSEResponse(sse(), closed)

    # -------------------------------------------------------------- endpoints
    @app.get("/health")
    async def health():
        ok = runner.alive()
        body = {"status": "ok" if ok else "engine loop stopped", "running": runner.n_running,
                "waiting": runner.n_waiting, "in_flight": state.in_flight, "steps": runner.n_steps,
                "aborted": runner.n_aborted, "step_failures": runner.n_step_failures}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=metrics.content_type)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": state.created, "owned_by": "dsv41",
                "root": settings.checkpoint, "max_model_len": max_len, "chat_template": state.template.name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        try:
            req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request))
            check_model(req.model)
            req.check_unsupported()
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
                prompt = state.template.render(messages, effort, thinking)
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
            ids = encode(prompt, "messages")
            check_ids(ids, "messages")
            max_new = resolve_max_tokens(req.max_new_tokens(), len(ids),
                                         "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                                         "messages")
            lp = (req.top_logprobs or 0) if req.logprobs else None
            rid0 = f"chatcmpl-{uuid.uuid4().hex}"
            seqs = [_Seq(i, 0, f"{rid0}-{i}", ids, sampling(req, max_new, i, lp)) for i in range(req.n)]
        except APIError as e:
            metrics.observe_request("chat", e.status)
            return JSONResponse(e.body(), status_code=e.status)
        split = state.template.name != "simple" and (thinking if thinking is not None else effort is not None)
        created = _now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def choice_logprobs(entries):
            return {"content": [chat_logprob_entry(e, toktext.text, toktext.bytes) for e in entries]}

        def build_full(results):
            choices, usages, stats = [], [], []
            for s in sorted(seqs, key=lambda s: s.index):
                comp = results[s.rid]
                text = comp.text
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if split:
                    sp = ReasoningSplitter(True)
                    r, c = sp.feed(text, final=True)
                    msg = {"role": "assistant", "content": c, "reasoning_content": r}
                choices.append({"index": s.index, "message": msg, "finish_reason": comp.finish_reason,
                                "logprobs": choice_logprobs(comp.logprobs[:len(comp.output_ids)])
                                if lp is not None else None})
                usages.append(seq_usage(s, comp))
                stats.append(engine_stats(s, comp))
            body = {"id": rid0, "object": "chat.completion", "created": created, "model": req.model,
                    "system_fingerprint": fingerprint(), "choices": choices,
                    "usage": public_usage(merge_usage(usages, [len(ids)])), "engine_stats": stats}
            if req.return_prompt:
                body["prompt"] = prompt
            return body

        async def build_stream(job: _Job, request: Request):
            def chunk(choices):
                c = {"id": rid0, "object": "chat.completion.chunk", "created": created, "model": req.model,
                     "system_fingerprint": fingerprint(), "choices": choices}
                if include_usage:
                    c["usage"] = None
                return _sse(c)
            by_rid = job.seqs
            splitters = {rid: ReasoningSplitter(True) for rid in by_rid} if split else {}
            first = {"role": "assistant", "content": ""}
            if req.return_prompt:
                yield _sse({"id": rid0, "object": "chat.completion.chunk", "created": created, "model": req.model,
                            "choices": [], "prompt": prompt})
            for s in sorted(seqs, key=lambda s: s.index):
                yield chunk([{"index": s.index, "delta": first, "logprobs": None, "finish_reason": None}])
            usages = []
            async for ev in job.events(request):
                s = by_rid[ev.request_id]
                if isinstance(ev, Delta):
                    delta: dict[str, Any] = {}
                    if split:
                        r, c = splitters[s.rid].feed(ev.text)
                        if r:
                            delta["reasoning_content"] = r
                        if c:
                            delta["content"] = c
                    elif ev.text:
                        delta["content"] = ev.text
                    if delta or ev.logprobs:
                        yield chunk([{"index": s.index, "delta": delta, "finish_reason": None,
                                      "logprobs": choice_logprobs(ev.logprobs) if lp is not None else None}])
                elif isinstance(ev, Done):
                    delta = {}
                    if split:
                        r, c = splitters[s.rid].feed("", final=True)
                        if r:
                            delta["reasoning_content"] = r
                        if c:
                            delta["content"] = c
                    usages.append(seq_usage(s, ev.completion))
                    yield chunk([{"index": s.index, "delta": delta, "logprobs": None,
                                  "finish_reason": ev.completion.finish_reason}])
                else:
                    yield _error_sse(ev)
                    job.abort()
                    break
            if include_usage:
                yield _usage_sse(rid0, "chat.completion.chunk", created, req.model, fingerprint(),
                                 merge_usage(usages, [len(ids)]))
            yield "data: [DONE]\n\n"

        return await run_job(request, "chat", seqs, req.stream, t0, build_full, build_stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        try:
            req: CompletionRequest = parse(CompletionRequest, await read_json(request))
            check_model(req.model)
            req.check_unsupported()
            prompts = req.prompts()
            if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
                raise bad_request(f"at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n) per request", "n")
            encoded: list[tuple[str, list[int]]] = []
            for k, p in enumerate(prompts):
                param = "prompt" if len(prompts) == 1 else f"prompt.{k}"
                if isinstance(p, str):
                    if not p:
                        raise bad_request(f"{param}: the prompt is empty", param)
                    ids = encode(p, param)
                    text = p
                else:
                    ids = list(p)
                    check_ids(ids, param)
                    text = tokenizer.decode(ids) if req.echo else ""
                check_ids(ids, param)
                encoded.append((text, ids))
            longest = max(len(ids) for _, ids in encoded)
            max_new = resolve_max_tokens(req.max_tokens, longest, "max_tokens", "prompt")
            rid0 = f"cmpl-{uuid.uuid4().hex}"
            seqs = []
            for k, (_, ids) in enumerate(encoded):
                for j in range(req.n):
                    i = k * req.n + j
                    seqs.append(_Seq(i, k, f"{rid0}-{i}", ids, sampling(req, max_new, i, req.logprobs)))
        except APIError as e:
            metrics.observe_request("completions", e.status)
            return JSONResponse(e.body(), status_code=e.status)
        created = _now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompt_lens = [len(ids) for _, ids in encoded]

        def build_full(results):
            choices, usages, stats = [], [], []
            for s in sorted(seqs, key=lambda s: s.index):
                comp = results[s.rid]
                echo = encoded[s.prompt_index][0] if req.echo else ""
                choices.append({"index": s.index, "text": echo + comp.text, "finish_reason": comp.finish_reason,
                                "logprobs": completion_logprobs(comp.logprobs[:len(comp.output_ids)], toktext.text)
                                if req.logprobs is not None else None})
                usages.append(seq_usage(s, comp))
                stats.append(engine_stats(s, comp))
            body = {"id": rid0, "object": "text_completion", "created": created, "model": req.model,
                    "system_fingerprint": fingerprint(), "choices": choices,
                    "usage": public_usage(merge_usage(usages, prompt_lens)), "engine_stats": stats}
            if req.return_prompt:
                body["prompt"] = [t for t, _ in encoded]
            return body

        async def build_stream(job: _Job, request: Request):
            def chunk(index, text, finish=None, logprobs=None):
                c = {"id": rid0, "object": "text_completion", "created": created, "model": req.model,
                     "system_fingerprint": fingerprint(),
                     "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
                if include_usage:
                    c["usage"] = None
                return _sse(c)
            by_rid = job.seqs
            offsets = {rid: 0 for rid in by_rid}
            if req.echo:
                for s in sorted(seqs, key=lambda s: s.index):
                    yield chunk(s.index, encoded[s.prompt_index][0])
            usages = []
            async for ev in job.events(request):
                s = by_rid[ev.request_id]
                if isinstance(ev, Delta):
                    if ev.text or ev.logprobs:
                        lpb = None
                        if req.logprobs is not None:
                            lpb = completion_logprobs(ev.logprobs, toktext.text, offsets[s.rid])
                        offsets[s.rid] += len(ev.text)
                        yield chunk(s.index, ev.text, None, lpb)
                elif isinstance(ev, Done):
                    usages.append(seq_usage(s, ev.completion))
                    yield chunk(s.index, "", ev.completion.finish_reason)
                else:
                    yield _error_sse(ev)
                    job.abort()
                    break
            if include_usage:
                yield _usage_sse(rid0, "text_completion", created, req.model, fingerprint(),
                                 merge_usage(usages, prompt_lens))
            yield "data: [DONE]\n\n"

        return await run_job(request, "completions", seqs, req.stream, t0, build_full, build_stream)

    return app


class _SSEResponse(StreamingResponse):
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


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _error_sse(ev) -> str:
    """An engine-side failure inside a stream, as an OpenAI error event."""
    return _sse(error_body(ev.message, "server_error" if ev.status >= 500 else "invalid_request_error"))


def _usage_sse(rid: str, obj: str, created: int, model: str, fingerprint: str, usage: dict) -> str:
    """The final usage-only chunk of a stream (stream_options.include_usage)."""
    return _sse({"id": rid, "object": obj, "created": created, "model": model,
                 "system_fingerprint": fingerprint, "choices": [], "usage": public_usage(usage)})


# ------------------------------------------------------------------------------------------------ serving

class ServerHandle:
    """A uvicorn server running in a background thread (loopback tests, the demo, the load benchmark)."""

    def __init__(self, server, thread: threading.Thread, host: str, port: int):
        self.server, self.thread, self.host, self.port = server, thread, host, port
        self.url = f"http://{host}:{port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0) -> ServerHandle:
    """Bind host:port (0 = an ephemeral port), start uvicorn in a daemon thread and wait until it serves."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dsv41-uvicorn", daemon=True)
    thread.start()
    t_end = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > t_end:
            server.should_exit = True
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port)
