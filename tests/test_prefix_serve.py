"""Prefix caching as `dsv41 serve` sets it up by default (docs/system.md §4): the in-process SWA pool and a disk tier
in the default cache directory ($DSV41_CACHE_DIR/prefix/<weights fingerprint> here, a temp dir), so a repeated
prompt in one server process resumes exactly (`swa-hit`, the same answer) and its usage names the cached tokens per
tier; `--cache-dir none` / `--swa-pool none` turn the tiers off; `generate` keeps them opt-in; `dsv41 cache clear`
without a directory empties the default location."""

from __future__ import annotations

import pytest

from dsv41.cli import build_parser
from dsv41.engine.cli import engine_from_args
from dsv41.engine.engine import weights_fingerprint
from test_server_fixtures import make_checkpoint, openai_client

USER = "Tell me everything about the sea, the waves and the tides. " * 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dbg-ckpt"), seed=0)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "root"))
    return tmp_path / "root"


def test_serve_defaults_take_swa_hit_on_a_repeated_prompt(ckpt, root):
    from dsv41.server.app import create_app, serve_in_thread
    from dsv41.server.state import ServerSettings

    args = build_parser().parse_args(["serve", "--checkpoint", str(ckpt), "--max-seq-len", "512"])
    engine = engine_from_args(args)
    where = root / "prefix" / weights_fingerprint(engine.model)
    assert engine.prefix_cache.disk.dir == where and engine.prefix_cache.swa is not None
    handle = serve_in_thread(create_app(engine, ServerSettings.from_args(args)))
    try:
        client = openai_client(handle)
        name = client.models.list().data[0].id
        ask = lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": USER}],
                                                     max_tokens=6, temperature=0)
        first, second = ask(), ask()
    finally:
        handle.stop()
    d1, d2 = first.usage.prompt_tokens_details, second.usage.prompt_tokens_details
    assert d1.cached_tokens == 0 and d1.model_extra["cache_path"] == "cold"
    assert d2.model_extra["cache_path"] == "swa-hit" and d2.cached_tokens == second.usage.prompt_tokens - 1
    # the first request's pages are still in the pool: the device tier serves them, the SWA pool the window
    assert d2.model_extra["cached_tokens_by_tier"] == {"device": d2.cached_tokens, "swa": d2.cached_tokens}
    assert second.usage.completion_tokens == first.usage.completion_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    assert any(where.glob("*.kv"))


def test_serve_tiers_turn_off_and_generate_is_opt_in(ckpt, root):
    p = build_parser()
    eng = engine_from_args(p.parse_args(["serve", "--checkpoint", str(ckpt), "--swa-pool", "none"]))
    assert eng.prefix_cache.swa is None and eng.prefix_cache.disk is not None
    eng = engine_from_args(p.parse_args(["serve", "--checkpoint", str(ckpt), "--cache-dir", "none"]))
    assert eng.prefix_cache.disk is None and eng.prefix_cache.swa is not None
    eng = engine_from_args(p.parse_args(["serve", "--checkpoint", str(ckpt), "--cache-dir", "none",
                                         "--swa-pool", "none"]))
    assert eng.prefix_cache is None
    g = p.parse_args(["generate", "--checkpoint", str(ckpt), "--prompt", "x"])
    assert engine_from_args(g).prefix_cache is None
    g = p.parse_args(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--cache-dir", "auto"])
    assert engine_from_args(g).prefix_cache.disk.dir.parent == root / "prefix"
    assert not (root / "prefix").exists() or len(list((root / "prefix").iterdir())) == 1


def test_serve_defaults_off_for_a_model_without_the_packed_store(ckpt, root):
    from dsv41.model.common import set_quantization
    from dsv41.model.loading import load_model

    model, _ = load_model(ckpt)
    set_quantization(model, False)                               # the dense reference store: nothing to cache
    eng = engine_from_args(build_parser().parse_args(["serve", "--checkpoint", str(ckpt)]), model=model)
    assert eng.prefix_cache is None and not root.exists()


def test_cache_clear_without_a_directory_empties_the_default_location(ckpt, root, capsys):
    from dsv41.engine.sampling import SamplingParams

    eng = engine_from_args(build_parser().parse_args(["serve", "--checkpoint", str(ckpt)]))
    eng.generate([USER], SamplingParams(max_tokens=2))
    where = eng.prefix_cache.disk.dir
    assert any(where.glob("*.kv"))
    args = build_parser().parse_args(["cache", "stats"])
    assert args.func(args) == 0
    assert str(where) in capsys.readouterr().out
    args = build_parser().parse_args(["cache", "clear"])
    assert args.func(args) == 0
    assert f"from {where}" in capsys.readouterr().out and not any(where.glob("*.kv"))
