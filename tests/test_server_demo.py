"""`dsv41 serve` / `dsv41 demo` command wiring, the prefix-cache flag notice, and the demo end to end with a random
tiny model (no training: `--no-train`)."""

from __future__ import annotations

import argparse
import json

from dsv41.engine.cli import engine_from_args
from dsv41.server import cli, demo
from dsv41.server.demo import RANDOM_MARKER, ensure_checkpoint, has_model


def _parser():
    p = argparse.ArgumentParser(prog="dsv41")
    cli.register(p.add_subparsers(dest="command", required=True))
    return p


def test_serve_and_demo_flags():
    a = _parser().parse_args(["serve", "--checkpoint", "x", "--port", "0", "--cache-dir", "c",
                              "--swa-pool", "redis://127.0.0.1:6379", "--max-batch", "4", "--prefill-mode", "full"])
    assert (a.checkpoint, a.host, a.port, a.cache_dir, a.swa_pool, a.max_batch, a.prefill_mode) == \
        ("x", "127.0.0.1", 0, "c", "redis://127.0.0.1:6379", 4, "full")
    assert a.func is cli.serve_main
    d = _parser().parse_args(["demo"])
    assert d.checkpoint == demo.DEMO_CHECKPOINT and d.func is demo.run_demo and d.cache_dir is None


def test_build_engine_cache_flags(tmp_path, capsys):
    from test_server_fixtures import make_checkpoint
    ckpt = make_checkpoint(tmp_path / "c")
    a = _parser().parse_args(["serve", "--checkpoint", str(ckpt), "--max-seq-len", "256"])
    eng = engine_from_args(a)
    assert eng.max_seq_len == 256 and "prefix caching" not in capsys.readouterr().err
    a = _parser().parse_args(["serve", "--checkpoint", str(ckpt), "--cache-dir", str(tmp_path / "pc"),
                              "--swa-pool", "memory"])
    eng = engine_from_args(a)
    assert eng.prefix_cache is not None                      # the flags reach the engine's prefix cache


def test_demo_end_to_end_random_tiny(tmp_path, capsys):
    ckpt = tmp_path / "demo-tiny"
    a = _parser().parse_args(["demo", "--checkpoint", str(ckpt), "--no-train", "--max-tokens", "2",
                              "--posttrained", str(tmp_path / "no-post")])
    assert a.func(a) == 0
    out = capsys.readouterr().out
    assert has_model(ckpt) and (ckpt / RANDOM_MARKER).exists()
    assert "RANDOMLY INITIALISED" in out
    for line in ("prompt starts: 'Reasoning Effort: 50'", "prompt starts: 'Reasoning Effort: 75'",
                 "prompt starts: 'Reasoning Effort: 100'", "cached 0", "KV report",
                 "global bytes == the analytic count for every request", "dsv41_kv_bytes_peak", "demo done",
                 f"no post-trained checkpoint in {tmp_path / 'no-post'}: `dsv41 posttrain all` makes one"):
        assert line in out, line
    # a second run reuses the random checkpoint instead of writing a new one
    assert ensure_checkpoint(ckpt, 0.1, allow_train=False) == (ckpt, "random")


def test_demo_serves_a_posttrained_checkpoint(tmp_path, capsys):
    """Step 5 on a post-training checkpoint (an untrained one: the answers are noise, the serving path is real)."""
    from dsv41.posttrain.model import build_model, save
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    tok = load_post_tokenizer(tmp_path / "tok")
    post = save(build_model(tok, seed=1).eval(), tok, tmp_path / "post-rl", {"stage": "rl"})
    level = {"accuracy": 0.25, "mean_length": 7.5, "n": 4, "accuracy_by_family": {"sums": 0.5, "chase": 0.0}}
    (post / "eval_csml.json").write_text(json.dumps({"temperature": 0.0, "levels": {"1": level, "50": level}}))
    a = _parser().parse_args(["demo", "--posttrained", str(post), "--max-tokens", "4"])
    demo._posttrained(a, tasks=(("sums", 3),))
    out = capsys.readouterr().out
    assert f"serving {post}" in out and "user: sum a" in out
    assert ("effort   1: accuracy 0.250 (chase 0.00, sums 0.50), mean reasoning 7.5 tokens, 4 held-out problems "
            "(eval_csml.json, greedy)") in out
    assert "effort 100: accuracy" not in out                     # no level 100 in that evaluation
    lines = [x for x in out.splitlines() if x.strip().startswith("effort") and "reasoning " in x and "tokens '" in x]
    assert [x.split(":")[0].split()[-1] for x in lines] == ["1", "100"]
    assert all("right" in x or "wrong" in x for x in lines)


def test_ensure_checkpoint_paths(tmp_path, monkeypatch):
    from test_server_fixtures import make_checkpoint

    calls = []

    def fake_train(ckpt, minutes):
        calls.append(minutes)
        make_checkpoint(ckpt)
        return True
    monkeypatch.setattr(demo, "train_available", lambda: True)
    monkeypatch.setattr(demo, "train_tiny", fake_train)
    ckpt = tmp_path / "a"
    assert demo.ensure_checkpoint(ckpt, 2.0) == (ckpt, "trained") and calls == [2.0]
    assert demo.ensure_checkpoint(ckpt, 2.0) == (ckpt, "existing") and calls == [2.0]      # reused, not retrained

    monkeypatch.setattr(demo, "train_tiny", lambda ckpt, minutes: False)                  # trainer fails
    saved = []
    monkeypatch.setattr(demo, "save_random_tiny", lambda c: saved.append(c) or c)
    b = tmp_path / "b"
    assert demo.ensure_checkpoint(b, 1.0) == (b, "random") and saved == [b]
