"""The OpenAI-compatible server through the official `openai` client, against a random debug-preset model served on
127.0.0.1: chat, completions, streaming, usage fields, reasoning effort in the prompt, stop sequences, seeded
determinism, n > 1, logprobs, errors, client disconnects freeing their slot, an engine failure not stopping the
server, and the packed-KV figures the demo's KV report uses."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from test_server_fixtures import MODEL, make_checkpoint, openai_client, running_server, wait_idle

SYSTEM = "You are terse."
USER = "Say something about the sea."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dbg-ckpt"), seed=0)


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt, exact=True, max_batch=8, max_seq_len=512) as (handle, app):
        yield handle, app


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0])


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kw)


# ------------------------------------------------------------------------------------------------ basics

def test_models_health_metrics(server, client):
    handle, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(handle.url + "/health").json()
    assert h["status"] == "ok"
    chat(client, max_tokens=2)
    text = httpx.get(handle.url + "/metrics").text
    for name in ("dsv41_requests_total", "dsv41_request_latency_seconds_bucket", "dsv41_batch_size_bucket",
                 "dsv41_prompt_tokens_total", "dsv41_generation_tokens_total", "dsv41_prefix_cache_queries_total",
                 "dsv41_prefix_cache_requests_total", "dsv41_prefix_cache_replays_total", "dsv41_kv_bytes_in_use",
                 "dsv41_kv_bytes_peak",
                 "dsv41_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert 'dsv41_requests_total{endpoint="chat",status="200"}' in text


def test_chat_and_usage(client):
    r = chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "chat.completion" and c.index == 0 and c.message.role == "assistant"
    assert c.finish_reason == "length" and isinstance(c.message.content, str)
    u = r.usage
    assert u.completion_tokens == 10 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + 10
    assert u.prompt_tokens_details.cached_tokens == 0
    extra = u.prompt_tokens_details.model_extra
    assert extra["cache_path"] == "cold" and extra["cached_tokens_by_tier"] == {}
    stats = r.model_extra["engine_stats"]
    assert stats[0]["prefill_mode"] == "ced-bounded" and stats[0]["kv_bytes"]["tokens"] == u.prompt_tokens + 9


def test_completion_text_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens_details.cached_tokens == 0
    ids = [0] + [3 + b for b in b"def f(x):"]                     # the byte tokenizer's encoding, with BOS
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text and r2.usage.prompt_tokens == r.usage.prompt_tokens
    r3 = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3, temperature=0)
    assert sorted(c.index for c in r3.choices) == [0, 1, 2, 3]
    e = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert e.choices[0].text == "def f(x):" + r.choices[0].text


def test_chat_streaming_equals_full(client):
    full = chat(client, max_tokens=14)
    parts, finish, usage, n_chunks = [], None, None, 0
    for ch in chat(client, max_tokens=14, stream=True, stream_options={"include_usage": True}):
        n_chunks += 1
        assert ch.object == "chat.completion.chunk"
        if ch.choices:
            assert ch.usage is None
            if ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens == 0


def test_completion_streaming_and_raw_sse(server, client):
    handle, _ = server
    full = client.completions.create(model=MODEL, prompt="hello", max_tokens=10, temperature=0)
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="hello", max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert text == full.choices[0].text
    with httpx.stream("POST", handle.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


# ------------------------------------------------------------------------------------------------ features

def test_reasoning_effort_reaches_prompt(client):
    for effort, b in (("low", 50), ("high", 75), ("max", 100)):
        r = chat(client, max_tokens=2, reasoning_effort=effort, extra_body={"return_prompt": True})
        prompt = r.model_extra["prompt"]
        lines = prompt.split("\n")
        assert lines[0] == f"Reasoning Effort: {b}" and lines[1] == SYSTEM, prompt
    r = chat(client, max_tokens=2, extra_body={"return_prompt": True})
    assert "Reasoning Effort" not in r.model_extra["prompt"]
    r = chat(client, max_tokens=2, extra_body={"return_prompt": True, "reasoning_effort": 33})
    assert r.model_extra["prompt"].startswith("Reasoning Effort: 33\n")
    for bad in ("medium", "MAX", "", 0, 101, True, 2.5):
        with pytest.raises(openai.BadRequestError) as ei:
            chat(client, max_tokens=2, extra_body={"reasoning_effort": bad})
        assert ei.value.status_code == 400
        assert ei.value.body["param"] == "reasoning_effort" or ei.value.body["code"] == "invalid_type"


def test_stop_sequences(client):
    full = chat(client, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
    k = next((i for i in range(1, len(full)) if full.find(full[i]) == i), None)
    assert k is not None, f"greedy text too uniform to pick a stop string: {full!r}"
    stop = full[k]
    r = chat(client, max_tokens=40, stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == full[:k] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       chat(client, max_tokens=40, stop=[stop, "\x00never"], stream=True,
                            extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == full[:k]


def _tokens(r):
    return [(e.token, round(e.logprob, 5)) for e in r.choices[0].logprobs.content]


def test_seeded_determinism(client):
    kw = dict(max_tokens=12, temperature=1.0, logprobs=True, extra_body={"ignore_eos": True})
    a, b = chat(client, seed=1234, **kw), chat(client, seed=1234, **kw)
    assert _tokens(a) == _tokens(b) and a.choices[0].message.content == b.choices[0].message.content
    others = [_tokens(chat(client, seed=s, **kw)) for s in (1, 2, 3)]
    assert any(o != _tokens(a) for o in others)


def test_n_choices(client):
    kw = dict(max_tokens=8, temperature=1.0, seed=77, logprobs=True, extra_body={"ignore_eos": True})
    r = chat(client, n=3, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    one = chat(client, n=1, **kw)
    first = next(c for c in r.choices if c.index == 0)
    assert [e.token for e in first.logprobs.content] == [e.token for e in one.choices[0].logprobs.content]
    seqs = [tuple(e.token for e in c.logprobs.content) for c in r.choices]
    assert len(set(seqs)) > 1                                  # derived seeds: the choices differ
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == one.usage.prompt_tokens
    streamed: dict[int, str] = {}
    finishes = set()
    for ch in chat(client, n=2, stream=True, max_tokens=5, temperature=0):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes.add(c.index)
    assert finishes == {0, 1} and streamed[0] == streamed[1]


def test_logprobs(client):
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6          # greedy = the most likely token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert chat(client, max_tokens=3).choices[0].logprobs is None
    c = client.completions.create(model=MODEL, prompt="x = ", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    chunks = [ch for ch in chat(client, max_tokens=6, logprobs=True, top_logprobs=1, stream=True,
                                extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks) == 6


def test_official_template_server(ckpt):
    with running_server(ckpt, exact=True, chat_template="official") as (handle, app):
        client = openai_client(handle)
        r = chat(client, max_tokens=4, reasoning_effort="max", extra_body={"return_prompt": True})
        p = r.model_extra["prompt"]
        assert p.startswith("<｜System｜>Reasoning Effort: 100 (range 1-100") and p.endswith("<｜Assistant｜><think>")
        assert "reasoning_content" in r.choices[0].message.model_extra                # thinking mode: split output
        r = chat(client, max_tokens=4, extra_body={"return_prompt": True})             # default: thinking, high
        assert r.model_extra["prompt"] == (f"<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the "
                                           f"more thorough the reasoning)\n\n{SYSTEM}<｜User｜>{USER}<｜Assistant｜><think>")
        for kw in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}}):     # chat mode
            r = chat(client, max_tokens=4, extra_body={"return_prompt": True, **kw})
            assert r.model_extra["prompt"] == f"<｜System｜>{SYSTEM}<｜User｜>{USER}<｜Assistant｜></think>"
            assert "reasoning_content" not in r.choices[0].message.model_extra


# ------------------------------------------------------------------------------------------------ errors

def test_errors_have_openai_shape(server, client):
    handle, _ = server
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["code"] == "model_not_found"
    for kw in (dict(n=0), dict(n=1000), dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=5),
               dict(top_p=0), dict(extra_body={"top_logprobs": 3}), dict(stop=[""])):
        with pytest.raises(openai.BadRequestError):
            chat(client, **kw)
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=10, messages=[{"role": "user", "content": "x" * 600}])
    assert ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=500)
    assert ei.value.body["code"] == "context_length_exceeded" and ei.value.body["param"] == "max_tokens"
    r = httpx.post(handle.url + "/v1/chat/completions", content=b'{"model": ', timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(handle.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


# ------------------------------------------------------------------------------------------------ robustness

def test_disconnect_mid_stream_frees_slot(server):
    handle, _ = server
    wait_idle(handle)
    aborted0 = httpx.get(handle.url + "/health").json()["aborted"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with httpx.stream("POST", handle.url + "/v1/chat/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break                                           # leave the with-block: the connection closes
    h = wait_idle(handle, timeout=20)
    assert h["running"] == 0 and h["in_flight"] == 0 and h["aborted"] >= aborted0 + 1
    assert time.monotonic() - t0 < 20                           # 400 tokens would take far longer


def test_disconnect_while_waiting_non_streamed(server):
    handle, _ = server
    wait_idle(handle)
    aborted0 = httpx.get(handle.url + "/health").json()["aborted"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    h = wait_idle(handle, timeout=20)
    assert h["running"] == 0 and h["in_flight"] == 0 and h["aborted"] >= aborted0 + 1


def test_engine_failure_does_not_stop_server(server, client):
    handle, app = server
    wait_idle(handle)
    engine = app.state.dsv41.engine
    ref = chat(client, max_tokens=6).choices[0].message.content
    real = engine.step
    fired = threading.Event()

    def broken():
        if not fired.is_set():
            fired.set()
            raise RuntimeError("injected failure")
        return real()
    engine.step = broken
    try:
        with pytest.raises(openai.InternalServerError):
            chat(client, max_tokens=6)
    finally:
        del engine.step                                          # back to the class method
    assert fired.is_set()
    assert httpx.get(handle.url + "/health").json()["status"] == "ok"
    assert chat(client, max_tokens=6).choices[0].message.content == ref


def test_packed_kv_stats_match_analytic(ckpt):
    """Quantized model -> packed store: the per-request global KV bytes the demo's KV report prints equal the
    analytic count (complete blocks of every KV-source layer x entry bytes)."""
    from dsv41.analysis.kv_bytes import global_entry_bytes, kv_source_layers
    from dsv41.config import load_config
    cfg = load_config("debug")
    with running_server(ckpt, exact=False) as (handle, app):
        r = chat(openai_client(handle), max_tokens=9, extra_body={"ignore_eos": True})
        kv = r.model_extra["engine_stats"][0]["kv_bytes"]
    n = kv["tokens"]
    assert n == r.usage.prompt_tokens + 8
    assert kv["global_entries_bytes"] == sum(int(global_entry_bytes(cfg) * (n // m)) for _, m in kv_source_layers(cfg))
    assert kv["swa_bytes"] > 0


def test_cached_tokens_on_repeat(ckpt, tmp_path):
    """Lights up with the prefix cache: the same chat twice -> cached_tokens > 0 on the repeat."""
    from dsv41.engine.cli import engine_args, engine_from_args
    from dsv41.server.app import create_app, serve_in_thread
    from dsv41.server.state import ServerSettings
    ns = engine_args(checkpoint=str(ckpt), max_batch=4, max_seq_len=512, cache_dir=str(tmp_path / "pc"),
                     swa_pool="memory", speculative="off")
    handle = serve_in_thread(create_app(engine_from_args(ns), ServerSettings(model_name=MODEL)))
    try:
        client = openai_client(handle)
        long_user = "Tell me everything about the sea, the waves and the tides. " * 4
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": long_user}]
        first = chat(client, messages=msgs, max_tokens=4)
        second = chat(client, messages=msgs, max_tokens=4)
    finally:
        handle.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    d = second.usage.prompt_tokens_details
    assert d.cached_tokens > 0 and d.model_extra["cache_path"] in ("swa-hit", "replay")
