"""Bounded load on loopback: concurrent streaming clients (the official async `openai` client), zero failed or lost
requests, and greedy outputs equal to the same requests run one at a time. The default variant is small (8 clients,
24 requests); the full one (32 clients, 200 requests) is marked slow. Both print requests/s and p50/p99 latency."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from test_server_fixtures import MODEL, make_checkpoint, running_server, wait_idle

_spec = importlib.util.spec_from_file_location(
    "server_load", Path(__file__).resolve().parents[1] / "benchmarks" / "server_load.py")
server_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_load)


def _run(tmp_path, clients: int, requests: int, max_tokens: int, max_batch: int):
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=1)
    with running_server(ckpt, exact=True, max_batch=max_batch, max_seq_len=512) as (handle, app):
        prompts = server_load.make_prompts(requests)
        results, wall = server_load.run_load(handle.url, MODEL, prompts, clients, max_tokens, stream=True)
        summary = server_load.summarize(results, wall)
        health = wait_idle(handle)
        metrics = httpx.get(handle.url + "/metrics").text
        ref = server_load.run_sequential(handle.url, MODEL, prompts, max_tokens)
    summary["mismatches_vs_sequential"] = sum(1 for a, b in zip(results, ref) if a["text"] != b["text"])
    summary.update(concurrency=clients, max_batch=max_batch, max_tokens=max_tokens)
    print("\n" + json.dumps(summary))
    assert summary["failures"] == 0, summary["errors"]
    assert all(r["ok"] and r["tokens"] is not None for r in results) and len(results) == requests
    assert all(b["ok"] for b in ref)
    assert summary["mismatches_vs_sequential"] == 0
    assert [a["tokens"] for a in results] == [b["tokens"] for b in ref]
    assert health["in_flight"] == 0 and health["running"] == 0 and health["step_failures"] == 0
    batch_sum = next(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("dsv41_batch_size_sum"))
    batch_count = next(float(ln.split()[-1]) for ln in metrics.splitlines()
                       if ln.startswith("dsv41_batch_size_count"))
    assert batch_sum / batch_count > 1.5                        # requests really shared decode steps
    return summary


def test_load_small(tmp_path):
    _run(tmp_path, clients=8, requests=24, max_tokens=8, max_batch=8)


@pytest.mark.slow
def test_load_32_clients_200_requests(tmp_path):
    _run(tmp_path, clients=32, requests=200, max_tokens=16, max_batch=32)
