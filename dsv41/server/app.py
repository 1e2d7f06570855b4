"""The OpenAI-compatible HTTP API (FastAPI): `create_app(engine, ...)`, and `serve_in_thread` to run it on loopback.

Endpoints: POST /v1/chat/completions (`serving_chat`) and POST /v1/completions (`serving_completion`), GET
/v1/models and /v1/models/{id} (the one model this server serves; its aliases answer too), vLLM's POST /tokenize,
POST /detokenize and GET /tokenizer_info (`tokenize`), GET /health, GET /metrics.

With an API key (`--api-key` or the DSV41_API_KEY environment variable) every route but /health and /metrics
needs `Authorization: Bearer <key>` (401 otherwise), as vLLM does.

One engine loop thread (`EngineRunner`) owns the engine; each HTTP request becomes one engine request per choice
(`n` choices, and for completions one per prompt of a batch), whose events come back on an asyncio queue
(`jobs`). A client that disconnects (mid-stream or while waiting for a non-streamed answer) has its engine
requests aborted, which frees their batch slots. Every failure is answered in OpenAI's error shape; nothing a
client sends can stop the engine loop or the server.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41.server.chat import pick_template
from dsv41.server.grammar import Grammars
from dsv41.server.logprobs import TokenText
from dsv41.server.metrics import ServerMetrics
from dsv41.server.protocol import APIError, error_body
from dsv41.server.runner import EngineRunner
from dsv41.server.serving_chat import ServingChat
from dsv41.server.serving_completion import ServingCompletion
from dsv41.server.state import ServerSettings, ServerState
from dsv41.server.tokenize import add_tokenizer_routes
from dsv41.server.validation import check_model

OPEN_PATHS = ("/health", "/metrics")

log = logging.getLogger("dsv41.server")


def create_app(engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics, tokenizer = ServerMetrics(), engine.tokenizer
    runner = EngineRunner(engine, metrics)
    state = ServerState(engine, tokenizer, runner, metrics, settings, pick_template(tokenizer, settings.chat_template),
                        TokenText(tokenizer), Grammars(tokenizer, engine.cfg.vocab_size))

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
    _error_handlers(app)
    if settings.api_key:
        _require_key(app, settings.api_key)

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
                "root": settings.checkpoint, "max_model_len": engine.max_seq_len, "chat_template": state.template.name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(settings, model_id)
        return model_card()

    app.post("/v1/chat/completions")(ServingChat.handle)
    app.post("/v1/completions")(ServingCompletion.handle)
    add_tokenizer_routes(app)
    return app


def _require_key(app: FastAPI, key: str) -> None:
    """Every route but /health and /metrics answers 401 without `Authorization: Bearer <key>`."""
    want = f"Bearer {key}".encode()

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if request.url.path in OPEN_PATHS or request.method == "OPTIONS":
            return await call_next(request)
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), want):
            return JSONResponse(error_body("invalid or missing API key: send Authorization: Bearer <key>",
                                           "authentication_error", code="invalid_api_key"), status_code=401)
        return await call_next(request)


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (`APIError`), routing's (404, 405) and any crash (500)."""

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
        return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}").body(), status_code=500)


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
