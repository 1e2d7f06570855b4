"""Helpers (no tests) shared by tests/test_server*.py: a random debug-preset checkpoint in a temp dir, served on
127.0.0.1 by a uvicorn thread, and the official `openai` client pointed at it."""

from __future__ import annotations

import contextlib
import time

import httpx

from dsv41.config import load_config
from dsv41.model.attention import set_tie_break
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.model.loading import load_model, save_checkpoint
from dsv41.engine.cli import engine_args, engine_from_args
from dsv41.server.app import create_app, serve_in_thread
from dsv41.server.state import ServerSettings

MODEL = "dbg"


def make_checkpoint(path, preset: str = "debug", seed: int = 0):
    cfg = load_config(preset)
    save_checkpoint(random_model(cfg, seed=seed), cfg, path)
    return path


@contextlib.contextmanager
def running_server(ckpt, exact: bool = True, max_batch: int = 8, max_seq_len: int = 512, speculative: str = "off",
                   **settings):
    """Serve `ckpt`. exact=True switches the FP8/FP4 QDQs off and uses the deterministic tie rule, so batched
    decoding equals one-at-a-time decoding (the engine's own equality tests use the same setting)."""
    model, _ = load_model(ckpt)
    if exact:
        set_quantization(model, False)
        set_tie_break(model, "recent")
    ns = engine_args(checkpoint=str(ckpt), max_batch=max_batch, max_seq_len=max_seq_len, speculative=speculative)
    engine = engine_from_args(ns, model=model)
    settings.setdefault("model_name", MODEL)
    app = create_app(engine, ServerSettings(**settings))
    handle = serve_in_thread(app)
    try:
        yield handle, app
    finally:
        handle.stop()


def openai_client(handle, timeout: float = 120.0):
    from openai import OpenAI
    return OpenAI(base_url=handle.url + "/v1", api_key="test", max_retries=0, timeout=timeout)


def wait_idle(handle, timeout: float = 30.0) -> dict:
    """Poll /health until nothing runs or waits; -> the last health body."""
    t_end = time.monotonic() + timeout
    body = {}
    while time.monotonic() < t_end:
        body = httpx.get(handle.url + "/health", timeout=10).json()
        if body["running"] == 0 and body["waiting"] == 0 and body["in_flight"] == 0:
            return body
        time.sleep(0.1)
    return body
