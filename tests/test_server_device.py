"""`dsv41 serve`'s device and weight flags (`dsv41.server.device`, `dsv41.server.cli.build_engine`) on a CPU: the flag
errors, the dtype each device gets, a random-weights model of a preset served end to end, and vLLM's
`return_tokens_as_token_ids` on completions (what benchmarks/server_load.py counts tokens with)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from fastapi.testclient import TestClient

from dsv41.config import load_config
from dsv41.kernels import get_backend, set_backend
from dsv41.model.init import random_model
from dsv41.server import cli
from dsv41.server.app import create_app
from dsv41.server.device import check_weight_flags, resolve_device, resolve_dtype, serving_model
from dsv41.server.state import ServerSettings
from test_server_fixtures import make_checkpoint

PROMPT = [5, 70, 111, 33, 9, 200, 47]


def serve_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv41")
    cli.register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["serve", "--cache-dir", "none", "--swa-pool", "none", "--max-seq-len", "128", *flags])


@pytest.fixture(scope="module")
def random_app():
    """`dsv41 serve --random-weights --config debug` as an app (the smallest preset), its args, and a second engine
    of the same flags (the served one's runner thread owns the first) for reference completions."""
    flags = ("--random-weights", "--config", "debug", "--seed", "3")
    args = serve_args(*flags)
    engine = cli.build_engine(args)
    with TestClient(create_app(engine, ServerSettings.from_args(args))) as client:
        yield client, engine, args, cli.build_engine(serve_args(*flags))


@pytest.mark.parametrize("flags, message", [
    (("--random-weights",), "--random-weights needs --config"),
    (("--random-weights", "--config", "debug", "--checkpoint", "x"), "give one of them"),
    (("--config", "debug", "--checkpoint", "x"), "only applies with --random-weights"),
    ((), "give --checkpoint DIR, or --random-weights --config PRESET"),
])
def test_weight_flag_errors(flags, message):
    args = serve_args(*flags)
    with pytest.raises(ValueError, match=message):
        check_weight_flags(args)
    with pytest.raises(ValueError, match=message):
        cli.build_engine(args)                  # checked before anything is loaded
    check_weight_flags(serve_args("--random-weights", "--config", "debug"))         # the valid pair passes
    check_weight_flags(serve_args("--checkpoint", "x"))


def test_device_errors(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA is not available here.*serve on --device cpu"):
            resolve_device(name)
    with pytest.raises(ValueError, match="CUDA is not available"):
        serving_model(serve_args("--random-weights", "--config", "debug", "--device", "cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="this machine has 1 CUDA device"):
        resolve_device("cuda:1")


def test_torchrun_refuses_device_flags(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for flags in (("--random-weights", "--config", "debug"), ("--checkpoint", "x", "--device", "cuda:0")):
        with pytest.raises(ValueError, match="under torchrun every rank loads its shard"):
            cli.build_engine(serve_args(*flags))


def test_dtype_resolution():
    assert resolve_dtype(serve_args("--checkpoint", "x")) == "float32"                       # cpu default
    args = serve_args("--checkpoint", "x", "--device", "cuda")
    assert args.dtype is None and resolve_dtype(args) == "bfloat16" and args.dtype == "bfloat16"
    assert resolve_dtype(serve_args("--checkpoint", "x", "--dtype", "bfloat16")) == "bfloat16"      # kept on cpu
    assert resolve_dtype(serve_args("--checkpoint", "x", "--device", "cuda", "--dtype", "float32")) == "float32"
    model = serving_model(serve_args("--random-weights", "--config", "debug", "--dtype", "bfloat16"))
    assert model.dtype == torch.bfloat16 and model.embed.weight.dtype == torch.bfloat16    # (mHC, sinks: fp32)


def test_kernels_flag():
    before = get_backend()
    try:
        set_backend("auto")
        serving_model(serve_args("--random-weights", "--config", "debug"))
        assert get_backend() == "auto"                          # no --kernels: left as it is
        serving_model(serve_args("--random-weights", "--config", "debug", "--kernels", "torch"))
        assert get_backend() == "torch"
    finally:
        set_backend(before)


def test_random_weights_model(random_app):
    _, engine, args, _ = random_app
    assert args.dtype == "float32" and engine.device == torch.device("cpu")
    want = random_model(load_config("debug"), seed=3)
    got = dict(engine.model.named_parameters())
    for name, p in want.named_parameters():                     # the seed's weights, not another draw
        assert torch.equal(got[name], p), name
    other = serving_model(serve_args("--random-weights", "--config", "debug", "--seed", "4"))
    assert not torch.equal(next(other.parameters()), next(want.parameters()))


def test_random_weights_serve_completion(random_app):
    client, engine, _, ref = random_app
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["debug-random"]
    body = {"model": "debug-random", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "debug-random" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {**out["usage"], "prompt_tokens": len(PROMPT), "completion_tokens": 6}
    want = ref.generate([PROMPT], engine_params(6))[0]          # the engine's own greedy completion
    assert out["choices"][0]["text"] == want.text and len(want.output_ids) == 6


def test_checkpoint_name_and_flags(tmp_path):
    ckpt = make_checkpoint(tmp_path / "my-ckpt", seed=2)
    args = serve_args("--checkpoint", str(ckpt))
    engine = cli.build_engine(args)
    assert ServerSettings.from_args(args).model_name == "my-ckpt" and args.dtype == "float32"
    assert engine.model.cfg.vocab_size == load_config("debug").vocab_size


def engine_params(max_tokens: int):
    from dsv41.engine.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_return_tokens_as_token_ids(random_app):
    client, engine, _, ref = random_app
    body = {"model": "debug-random", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    named = client.post("/v1/completions", json=body).json()["choices"][0]
    by_id = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = ref.generate([PROMPT], engine_params(5))[0].output_ids
    assert by_id["text"] == named["text"]
    lp, lp_named = by_id["logprobs"], named["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    assert [engine.tokenizer.decode([i]) for i in ids] == lp_named["tokens"]
    assert lp["token_logprobs"] == lp_named["token_logprobs"]
    assert lp["text_offset"] == lp_named["text_offset"]          # offsets still count the text's characters
    for top in lp["top_logprobs"]:
        assert len(top) == 2 and all(k.startswith("token_id:") and int(k[9:]) < engine.cfg.vocab_size for k in top)
    assert [max(t, key=t.get) for t in lp["top_logprobs"]] == lp["tokens"]                        # greedy
    # streamed: one chunk per token, each naming its id
    lines = client.post("/v1/completions", json={**body, "stream": True, "return_tokens_as_token_ids": True})
    chunks = [json.loads(x[6:]) for x in lines.text.splitlines() if x.startswith("data: {")]
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    # without the flag (and by default) the tokens are texts
    assert client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()[
        "choices"][0]["logprobs"]["tokens"] == lp_named["tokens"]
