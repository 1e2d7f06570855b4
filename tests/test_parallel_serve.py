"""`torchrun --nproc_per_node 2 -m dsv41 serve` on the CPU (gloo): rank 0 answers the `openai` client, the other
rank follows its engine steps (dsv41/parallel/lockstep.py), and the greedy completion equals one process's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.model.loading import load_model

PROMPT = [5, 9, 200, 17, 33, 2, 88, 41, 7, 300, 12, 61, 250]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


def test_serve_two_ranks_answers_openai_client(tmp_path):
    from openai import OpenAI
    from test_server_fixtures import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt")
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "dsv41", "serve", "--checkpoint", str(ckpt), "--port", str(port),
                             "--speculative", "off", "--max-seq-len", "256", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        scored = httpx.post(url + "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 1,
                                                           "echo": True, "logprobs": 1}, timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    model, _ = load_model(ckpt)
    want = Engine(model, speculative="off").generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    assert got.choices[0].text == want.text, out[-3000:]
    assert got.usage.completion_tokens == len(want.output_ids)
    assert scored.status_code == 400 and "several ranks" in scored.text      # prompt log-probs: refused, named


def test_prefix_caching_flags_on_several_ranks(monkeypatch):
    """serve's default tiers (auto) are off on several ranks; a tier named on the command line is refused before
    any process group is joined."""
    from dsv41.engine.cli import engine_args
    from dsv41.parallel.lockstep import _prefix_caching_off, serving_engine

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = engine_args(checkpoint="unused", cache_dir="auto", swa_pool="auto")
    _prefix_caching_off(args)
    assert (args.cache_dir, args.swa_pool) == ("none", "none")
    with pytest.raises(ValueError, match="--cache-dir /tmp/x: prefix caching"):
        serving_engine(engine_args(checkpoint="unused", cache_dir="/tmp/x"))
    with pytest.raises(ValueError, match="dspark:online"):
        serving_engine(engine_args(checkpoint="unused", speculative="dspark:online"))
