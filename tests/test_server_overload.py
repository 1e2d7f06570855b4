"""Overload (issue 21's target): twice as many concurrent streaming requests as the engine's KV-page pool holds at
their full lengths (the batch admits them all, so the pool is what binds), in the deterministic mode on a CPU.
Every request completes without an error, the scheduler really preempted, and the greedy token ids equal those of
the same requests run one at a time. Through benchmarks/server_load.py's overload mode (its in-process `dsv41 serve`, the
`openai` async client streaming token ids)."""

from __future__ import annotations

import importlib.util
import urllib.request
from pathlib import Path

import pytest

from test_server_fixtures import make_checkpoint

pytest.importorskip("openai")

_spec = importlib.util.spec_from_file_location(
    "server_load", Path(__file__).resolve().parents[1] / "benchmarks" / "server_load.py")
server_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_load)

N, INPUT_LEN, OUTPUT_LEN, RANGE = 8, 16, 24, 0.25        # outputs longer than prompts: decoding outgrows the pool


def test_overload_completes_and_equals_one_at_a_time(tmp_path):
    from dsv41.kv.pages import pages_at
    from dsv41.model.cache import cache_spec

    ckpt = make_checkpoint(tmp_path / "ckpt", seed=1)
    lengths = server_load.request_lengths(N, INPUT_LEN, OUTPUT_LEN, RANGE, seed=0)
    server = server_load.LocalServer(["--checkpoint", str(ckpt), "--deterministic", "--max-batch", str(N),
                                      "--kv-page-size", "4", "--max-seq-len", "128"],
                                     kv_pages=server_load.pool_for_half(lengths))
    try:
        engine = server.engine
        waiting_seen = []
        plan = engine.scheduler.plan

        def watched(running, waiting, *a, **k):          # how many requests queued at once (none changed)
            waiting_seen.append(len(waiting))
            return plan(running, waiting, *a, **k)
        engine.scheduler.plan = watched
        vocab = min(engine.cfg.vocab_size, engine.tokenizer.vocab_size)
        requests = server_load.random_requests(N, INPUT_LEN, OUTPUT_LEN, RANGE, vocab, seed=0)
        res = server_load.overload(server.url, server.model, requests, lambda: server.preemptions)
        health = server_load.wait_idle(server.url)
        metrics = urllib.request.urlopen(server.url.rstrip("/") + "/metrics").read().decode()
    finally:
        server.stop()

    ratios = [s.ratio for s in cache_spec(engine.cfg) if s.ratio > 0]
    full = [pages_at(ratios, 4, n_in + n_out) for n_in, n_out in lengths]
    assert engine.scheduler.kv_pages == server.args.kv_pages and 2 * server.args.kv_pages <= sum(full)
    assert max(full) <= server.args.kv_pages                         # each one fits alone: none is refused
    assert [(len(ids), n) for ids, n in requests] == lengths

    assert res["errors"] == [] and res["completed"] == N and res["completed_alone"] == N, res["errors"]
    assert [len(ids) for ids in res["ids_together"]] == [n for _, n in lengths]       # ignore_eos: full lengths
    assert res["ids_together"] == res["ids_alone"] and res["equal"] == N
    assert res["preemptions"] > 0 and max(waiting_seen) > 0           # the pool really overflowed
    assert f"dsv41_preemptions_total {float(res['preemptions'])}" in metrics     # the server counts them too
    assert health["step_failures"] == 0 and health["running"] == 0 and health["in_flight"] == 0
