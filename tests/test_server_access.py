"""Access and isolation through the real `openai` client: `--api-key` (or DSV41_API_KEY) requires `Authorization:
Bearer` on /v1/* and the tokenizer endpoints (401 otherwise) while /health and /metrics stay open; a request's
`cache_salt` keeps it from sharing prefix-cache entries (disk and SWA pool) with requests of another salt."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from dsv41.engine.cli import engine_args, engine_from_args
from dsv41.kv.prefix import prefix_key
from dsv41.server.app import create_app, serve_in_thread
from dsv41.server.state import API_KEY_ENV, ServerSettings
from test_server_fixtures import MODEL, make_checkpoint, running_server


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dbg-access"), seed=7)


def test_api_key(ckpt, monkeypatch):
    with running_server(ckpt, api_key="s3cret") as (handle, app):
        def client(key):
            return openai.OpenAI(base_url=handle.url + "/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as ei:
            client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client("wrong").models.list()
        assert client("s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        assert [m.id for m in client("s3cret").models.list()] == [MODEL]
        for path in ("/health", "/metrics"):
            assert httpx.get(handle.url + path, timeout=30).status_code == 200
        assert httpx.post(handle.url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
        assert httpx.post(handle.url + "/tokenize", json={"prompt": "x"}, timeout=30,
                          headers={"Authorization": "Bearer s3cret"}).status_code == 200
    ns = argparse.Namespace(checkpoint=None, served_model_name=None, chat_template="auto", default_max_tokens=8,
                            api_key=None)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerSettings.from_args(ns).api_key == "from-env"
    ns.api_key = "flag"
    assert ServerSettings.from_args(ns).api_key == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    ns.api_key = None
    assert ServerSettings.from_args(ns).api_key is None


def test_cache_salt_isolates_prefix_cache(ckpt, tmp_path):
    fp = "ab" * 32
    ids = list(range(50))
    assert prefix_key(fp, ids, 40, 16) != prefix_key(fp, ids, 40, 16, salt="a") != prefix_key(fp, ids, 40, 16, "b")
    assert prefix_key(fp, ids, 40, 16, salt="a") == prefix_key(fp, ids, 40, 16, salt="a")
    ns = engine_args(checkpoint=str(ckpt), max_batch=4, max_seq_len=512, cache_dir=str(tmp_path / "pc"),
                     swa_pool="memory", speculative="off")
    handle = serve_in_thread(create_app(engine_from_args(ns), ServerSettings(model_name=MODEL)))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompt = "The sea, the waves and the tides, told at length. " * 4

        def cached(**extra):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens
        assert cached(cache_salt="alice") == 0
        assert cached(cache_salt="alice") > 0                      # same salt: shared
        assert cached(cache_salt="bob") == 0                       # another salt: nothing of alice's
        assert cached() == 0                                       # no salt: its own namespace too
        assert cached() > 0 and cached(cache_salt="bob") > 0
    finally:
        handle.stop()
