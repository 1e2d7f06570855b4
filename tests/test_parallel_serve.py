"""`torchrun --nproc_per_node 2 -m dsv41 serve` on the CPU (gloo): rank 0 answers the `openai` client, the other
rank follows its engine commands (dsv41/parallel/lockstep.py): the greedy completion and the prompt
log-probabilities equal one process's, and a repeated prompt is served from the prefix tiers each rank keeps."""

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
LONG = [(7 * i + 3) % 400 + 2 for i in range(160)]      # long enough for a cached unit of the debug config


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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "DSV41_CACHE_DIR": str(tmp_path / "cache")}
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
        cold, warm = (client.completions.create(model=name, prompt=LONG, max_tokens=6, temperature=0)
                      for _ in range(2))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    model, _ = load_model(ckpt)
    engine = Engine(model, speculative="off")
    want, want_long = (engine.generate([p], SamplingParams(max_tokens=8, temperature=0))[0] for p in (PROMPT, LONG))
    assert got.choices[0].text == want.text, out[-3000:]
    assert got.usage.completion_tokens == len(want.output_ids)
    assert scored.status_code == 200, scored.text
    lp = scored.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(PROMPT)]
    one = [e["logprob"] for e in engine.score_prompt(PROMPT, 1)[1:]]
    assert lp == pytest.approx(one, abs=1e-5)
    assert cold.choices[0].text == warm.choices[0].text
    assert want_long.text.startswith(cold.choices[0].text)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 0, warm.usage
    ranks = sorted(p.name for p in (tmp_path / "cache").rglob("rank*-of-2"))
    assert ranks == ["rank0-of-2", "rank1-of-2"], ranks


def test_rank_flags_refused_before_joining(monkeypatch):
    """A Redis SWA pool (its own clock) is refused on several ranks before any process group is joined."""
    from dsv41.engine.cli import engine_args
    from dsv41.parallel.lockstep import serving_engine

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--swa-pool redis://h:1: a Redis pool"):
        serving_engine(engine_args(checkpoint="unused", swa_pool="redis://h:1"))


def test_dspark_online_cost_follows_rank_zero():
    """dspark:online on several ranks: a follower's step-cost model ignores its own step times and replays rank
    0's, so both price every verify length the same (and so choose the same)."""
    from dsv41.parallel.lockstep import FollowerCost, RankZeroCost

    profile = lambda n: 0.01 * (1 + n / 64)                     # noqa: E731
    lead, follow = RankZeroCost(profile), FollowerCost(profile)
    for n, dt in [(8, 0.5), (8, 0.021), (16, 0.7), (16, 0.03), (8, 0.019)]:
        lead.record(n, dt)
        follow.record(n, dt * 3)                                # this rank's own (slower) clock: ignored
    follow.replay(lead.take())
    assert lead.take() == []
    assert all(follow(n) == lead(n) for n in (1, 8, 16, 40))
    assert lead(8) == pytest.approx(0.02)
    for B, n, dt, plain in [(4, 12, 0.2, False), (4, 12, 0.05, False), (4, 4, 0.3, True), (4, 4, 0.01, True)]:
        lead.record(n, dt, batch=B, plain=plain)                # as the engine records (issue 28: with the batch
        follow.record(n, dt * 3, batch=B, plain=plain)          # and kind; this signature used to raise here)
    follow.replay(lead.take())
    assert follow.spec(4, 12) == lead.spec(4, 12) == pytest.approx(0.05)
    assert follow.plain(4) == lead.plain(4) == pytest.approx(0.01)


def test_lockstep_clock_drives_every_tier(tmp_path):
    """Each rank's tiers get their own disk subdirectory, and the cache, its disk store and the SWA pool read the
    lockstep clock (a TTL expires at the same command on every rank)."""
    from dsv41.engine.cli import engine_args
    from dsv41.model.init import random_model
    from dsv41.config import load_config
    from dsv41.parallel.group import Group
    from dsv41.parallel.lockstep import LockstepClock, per_rank_tiers, use_clock

    model = random_model(load_config("debug"), seed=0)
    args = engine_args(checkpoint="unused", cache_dir=str(tmp_path), swa_pool="auto")
    per_rank_tiers(args, model, Group(1, 2))
    assert (args.cache_dir, args.swa_pool) == (str(tmp_path / "rank1-of-2"), "memory")
    engine = Engine(model, speculative="off", cache_dir=args.cache_dir, swa_pool=args.swa_pool)
    clock = LockstepClock()
    use_clock(engine, clock)
    pc = engine.prefix_cache
    assert pc.clock is clock and pc.disk.clock is clock and pc.swa.clock is clock
    pc.swa.put("k", b"x", ttl_s=5.0)
    clock.now += 4.0
    assert pc.swa.get("k") == b"x"
    clock.now += 2.0
    assert pc.swa.get("k") is None
