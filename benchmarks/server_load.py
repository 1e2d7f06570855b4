"""Serving benchmark for the OpenAI-compatible server, measured at the client as vLLM's serving benchmark measures.

Modes (one per run):

  serving (default)  N streaming completion requests (the official `openai` async client) from a seeded random
                     dataset (token-id prompts of input_len x [1 - r, 1 + r] tokens, outputs of output_len x
                     [1 - r, 1 + r] tokens with ignore_eos, as vLLM's random dataset), sent at --request-rate (inf:
                     all at once; else Poisson arrivals), at most --max-concurrency in flight. Reports completed /
                     failed, request throughput, output tokens/s, TTFT, TPOT, inter-token latency (the gaps between
                     stream chunks) and end-to-end latency (mean, p50, p99), then the TTFT of a --idle-ttft-len
                     token prompt on the idle server (fresh random prompts, so no prefix-cache hit).
  overload           --num-prompts requests at once against a KV-page pool (--kv-pages) that holds half of them at
                     their full length, in the deterministic mode (--deterministic; --max-batch defaults to
                     --num-prompts so that the pool binds): the scheduler must queue and preempt (small
                     --kv-page-size: the sequences outgrow their admission pages sooner). Then the same requests one
                     at a time. Reports completed / errors / preemptions / the share of greedy outputs (token ids)
                     equal to the one-at-a-time run (tests/test_server_overload.py asserts all complete and equal).
  chat               C concurrent streaming chat clients, R requests: requests/s, latency, first text, tokens/s
                     (`--check`: also every request alone, counting greedy outputs that differ; test_server_load.py).

The server: an already running one (--url), or `dsv41 serve` started in this process from the serve flags this
script does not know itself (every flag after the script's own goes to `dsv41 serve`; defaults added here:
--cache-dir none --swa-pool none --speculative off, and --random-weights --config tiny when neither --checkpoint
nor --random-weights is given). Starting one needs fastapi / uvicorn / pydantic; a GPU machine without them installs
the wheels carried in benchmarks/wheels/py312 (`pip download` them here; the folder is not committed):

    python -m pip install -q --no-index --find-links benchmarks/wheels/py312 fastapi uvicorn openai httpx \\
        prometheus_client pillow

Each token streams as its own chunk with its id (`logprobs: 0` with vLLM's `return_tokens_as_token_ids`), so
tokens that decode to no text still count. Results: printed, one JSON line, and --out (default
benchmarks/results/server_bench-<mode>-<device>-<model>.json), with the command, the commit and the machine.

    PYTHONPATH=. python benchmarks/server_load.py --num-prompts 32 --input-len 128 --output-len 32 --max-batch 16
    PYTHONPATH=. python benchmarks/server_load.py --mode overload --num-prompts 12 --input-len 32 --output-len 24 \
        --kv-page-size 8 --max-seq-len 256
    PYTHONPATH=. python benchmarks/server_load.py --mode chat --num-prompts 24 --max-concurrency 8 --output-len 16 \
        --check --deterministic
    PYTHONPATH=. python benchmarks/server_load.py --num-prompts 128 --request-rate 4 --random-weights \\
        --config v41-geometry --device cuda --max-batch 32 --max-seq-len 4096
    PYTHONPATH=. python benchmarks/server_load.py --url http://127.0.0.1:8000 --mode serving   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_DEPS = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
CLIENT_DEPS = ("openai", "httpx")
WHEELS = "benchmarks/wheels/py312"
SERVE_DEFAULTS = ["--cache-dir", "none", "--swa-pool", "none", "--speculative", "off"]
FIRST_ID = 3                             # prompt ids from here on (the byte tokenizer's 0..2 are BOS / EOS / PAD)


# ------------------------------------------------------------------------------------------------ dataset

def request_lengths(n: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int = 0) -> list[tuple[int, int]]:
    """n (prompt tokens, output tokens): each uniform in len x [1 - r, 1 + r] (at least 1)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio))))
    return [(length(input_len), length(output_len)) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output tokens) pairs of `request_lengths` (which do not depend on the vocabulary),
    the ids uniform in [FIRST_ID, vocab_size)."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids to sample")
    rng = random.Random(f"ids:{seed}")
    return [([rng.randrange(FIRST_ID, vocab_size) for _ in range(n_in)], n_out)
            for n_in, n_out in request_lengths(n, input_len, output_len, range_ratio, seed)]


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for rate inf, else a Poisson process."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive or inf, got {rate}")
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ------------------------------------------------------------------------------------------------ client

def _chunk_ids(choice) -> list[int]:
    lp = choice.logprobs
    return [int(t.rpartition(":")[2]) for t in (lp.tokens or [])] if lp is not None else []


async def stream_completion(client, model: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed completion; per chunk its arrival time and token ids. Never raises (an error is a result)."""
    t0 = time.perf_counter()
    res = {"ok": False, "prompt_tokens": len(ids), "ids": [], "chunks": [], "ttft": None, "latency": None,
           "output_tokens": None, "finish": None, "error": None}
    try:
        s = await client.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True, logprobs=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        async for ch in s:
            now = time.perf_counter() - t0
            for c in ch.choices or []:
                got = _chunk_ids(c)
                if got:
                    res["ttft"] = now if res["ttft"] is None else res["ttft"]
                    res["chunks"].append((now, len(got)))
                    res["ids"] += got
                res["finish"] = c.finish_reason or res["finish"]
            if ch.usage is not None:
                res["output_tokens"] = ch.usage.completion_tokens
        res["latency"] = time.perf_counter() - t0
        res["ok"] = res["finish"] in ("stop", "length") and res["output_tokens"] == len(res["ids"])
        if not res["ok"]:
            res["error"] = f"finish={res['finish']} usage={res['output_tokens']} streamed={len(res['ids'])}"
    except Exception as e:                                   # counted as a failure, never raised
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def _client(url: str, timeout: float = 1800.0):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=os.environ.get("DSV41_API_KEY", "bench"),
                       max_retries=0, timeout=timeout)


async def _send_all(url: str, model: str, requests: list[tuple[list[int], int]], offsets: list[float],
                    max_concurrency: int | None) -> tuple[list[dict], float]:
    client = _client(url)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(k: int) -> dict:
        await asyncio.sleep(max(0.0, t0 + offsets[k] - time.perf_counter()))
        if sem is None:
            return await stream_completion(client, model, *requests[k])
        async with sem:
            return await stream_completion(client, model, *requests[k])
    try:
        results = await asyncio.gather(*(one(k) for k in range(len(requests))))
    finally:
        await client.close()
    return list(results), time.perf_counter() - t0


def send_requests(url: str, model: str, requests: list[tuple[list[int], int]], rate: float = float("inf"),
                  max_concurrency: int | None = None, seed: int = 0) -> tuple[list[dict], float]:
    """The requests at `rate` (Poisson; inf: all at once), at most max_concurrency in flight -> (results, wall s)."""
    return asyncio.run(_send_all(url, model, requests, arrival_offsets(len(requests), rate, seed), max_concurrency))


def one_at_a_time(url: str, model: str, requests: list[tuple[list[int], int]]) -> list[dict]:
    """The same requests, each sent when the previous one has finished."""
    return send_requests(url, model, requests, max_concurrency=1)[0]


# ------------------------------------------------------------------------------------------------ metrics

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


def _r(x):
    return None if x is None else round(x, 4)


def _ms(xs: list[float]) -> dict:
    """mean / p50 / p99 of seconds, in milliseconds."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": round(statistics.fmean(xs) * 1e3, 2), "p50": round(_pct(xs, 50) * 1e3, 2),
            "p99": round(_pct(xs, 99) * 1e3, 2)}


def serving_summary(results: list[dict], wall_s: float) -> dict:
    """vLLM's serving metrics over the completed requests: throughputs over the whole run's wall time, TTFT,
    TPOT ((latency - TTFT) / (tokens - 1)), ITL (gaps between a request's successive chunks) and E2E latency."""
    ok = [r for r in results if r["ok"]]
    out_toks = sum(r["output_tokens"] for r in ok)
    in_toks = sum(r["prompt_tokens"] for r in ok)
    itl = [b[0] - a[0] for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(wall_s, 3),
            "total_input_tokens": in_toks, "total_output_tokens": out_toks,
            "request_throughput": round(len(ok) / wall_s, 4), "output_throughput": round(out_toks / wall_s, 2),
            "total_token_throughput": round((in_toks + out_toks) / wall_s, 2),
            "ttft_ms": _ms([r["ttft"] for r in ok]), "tpot_ms": _ms(tpot), "itl_ms": _ms(itl),
            "e2el_ms": _ms([r["latency"] for r in ok]),
            "tokens_per_chunk": round(out_toks / max(1, sum(len(r["chunks"]) for r in ok)), 3),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    """Poll /health until nothing runs, waits or is in flight; -> the last health body."""
    import httpx
    t_end, body = time.monotonic() + timeout, {}
    while time.monotonic() < t_end:
        body = httpx.get(url.rstrip("/") + "/health", timeout=30).json()
        if body.get("running") == 0 and body.get("waiting") == 0 and body.get("in_flight") == 0:
            break
        time.sleep(0.1)
    return body


def idle_ttft(url: str, model: str, length: int, repeats: int, vocab_size: int, seed: int) -> dict:
    """TTFT at the client of `repeats` fresh random prompts of `length` tokens (one output token), each sent alone
    to the idle server."""
    wait_idle(url)
    reqs = random_requests(repeats, length, 1, 0.0, vocab_size, seed + 7919)
    res = one_at_a_time(url, model, reqs)
    ttft = [r["ttft"] for r in res if r["ok"]]
    return {"prompt_tokens": length, "repeats": repeats, "failed": repeats - len(ttft),
            "ttft_ms": [round(t * 1e3, 2) for t in ttft], "p50_ms": _ms(ttft)["p50"],
            "min_ms": round(min(ttft) * 1e3, 2) if ttft else None}


# ------------------------------------------------------------------------------------------------ server

def missing(mods) -> list[str]:
    return [m for m in mods if importlib.util.find_spec(m) is None]


def serve_args(flags: list[str]) -> argparse.Namespace:
    """`dsv41 serve`'s namespace for these flags (the script's defaults first, so the flags override them)."""
    from dsv41.server.cli import register
    p = argparse.ArgumentParser(prog="dsv41")
    register(p.add_subparsers(dest="cmd"))
    defaults = list(SERVE_DEFAULTS)
    if "--checkpoint" not in flags and "--random-weights" not in flags:
        defaults += ["--random-weights", "--config", "tiny"]
    return p.parse_args(["serve", *defaults, *flags])


class LocalServer:
    """`dsv41 serve` in this process (`dsv41.server.cli.build_engine`'s one-process path): the model on its device,
    the engine, the app on an ephemeral loopback port. `kv_pages(cfg, page_size)`: the page budget to set, from the
    model's config (the overload mode's pool)."""

    def __init__(self, flags: list[str], kv_pages=None):
        if missing(SERVER_DEPS):
            raise SystemExit(f"starting a server needs {', '.join(missing(SERVER_DEPS))}: python -m pip install "
                             f"--no-index --find-links {WHEELS} fastapi uvicorn openai httpx prometheus_client pillow")
        from dsv41.engine.cli import engine_from_args
        from dsv41.server.app import create_app, serve_in_thread
        from dsv41.server.device import serving_model
        from dsv41.server.state import ServerSettings

        self.args = serve_args(flags)
        t0 = time.perf_counter()
        model = serving_model(self.args)
        if kv_pages is not None:
            self.args.kv_pages = kv_pages(model.cfg, self.args.kv_page_size)
        self.engine = engine_from_args(self.args, model=model)
        self.preemptions = 0          # the scheduler's preemptions, as they happen (/metrics counts them at finish)
        preempt = self.engine._preempt

        def counted(seq) -> None:
            self.preemptions += 1
            preempt(seq)
        self.engine._preempt = counted
        self.load_s = time.perf_counter() - t0
        settings = ServerSettings.from_args(self.args)
        self.model = settings.model_name
        self.handle = serve_in_thread(create_app(self.engine, settings))
        self.url = self.handle.url

    def describe(self) -> dict:
        import torch

        from dsv41.kernels import get_backend
        a, e = self.args, self.engine
        gpu = torch.cuda.get_device_name(e.device) if e.device.type == "cuda" else None
        return {"device": str(e.device), "gpu": gpu, "dtype": a.dtype, "storage": a.storage, "kernels": get_backend(),
                "weights": a.checkpoint or f"random {a.config}", "n_layers": e.cfg.n_layers,
                "packed_kv": type(e.pool).__name__, "max_batch": e.max_batch, "max_seq_len": e.max_seq_len,
                "max_step_tokens": a.max_step_tokens, "kv_pages": a.kv_pages, "kv_page_size": a.kv_page_size,
                "deterministic": a.deterministic, "cuda_graphs": a.cuda_graphs, "prefill_mode": e.prefill_mode,
                "load_s": round(self.load_s, 2), "torch": torch.__version__}

    def stop(self) -> None:
        self.handle.stop()


def remote_model(url: str) -> tuple[str, int]:
    import httpx
    model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    vocab = httpx.get(url.rstrip("/") + "/tokenizer_info", timeout=30).json()["vocab_size"]
    return model, vocab


# ------------------------------------------------------------------------------------------------ overload

def pool_for_half(lengths: list[tuple[int, int]]):
    """kv_pages(cfg, page_size) for `LocalServer`: the pages of half of the requests (prompt, output tokens) at
    their full length (at least the largest one's, so that none is refused): all at once they need twice the pool."""
    def kv_pages(cfg, page_size: int) -> int:
        from dsv41.kv.pages import pages_at
        from dsv41.model.cache import cache_spec
        ratios = [s.ratio for s in cache_spec(cfg) if s.ratio > 0]
        need = [pages_at(ratios, page_size, n_in + n_out) for n_in, n_out in lengths]
        return max(sum(need) // 2, max(need))
    return kv_pages


def overload(url: str, model: str, requests: list[tuple[list[int], int]], preemptions=None) -> dict:
    """All requests at once, then each alone: completed, errors, and the share of equal greedy token ids.
    preemptions: a local server's count of them (`LocalServer.preemptions`), read after the run at once."""
    together, wall = send_requests(url, model, requests)
    wait_idle(url)
    preempted = preemptions() if preemptions else None
    alone = one_at_a_time(url, model, requests)
    pairs = [(a, b) for a, b in zip(together, alone) if a["ok"] and b["ok"]]
    equal = sum(a["ids"] == b["ids"] for a, b in pairs)
    return {"requests": len(requests), "completed": sum(r["ok"] for r in together),
            "errors": sorted({r["error"] for r in together + alone if r["error"]})[:5],
            "completed_alone": sum(r["ok"] for r in alone), "equal": equal,
            "equal_share": round(equal / len(requests), 4), "wall_s": round(wall, 3), "preemptions": preempted,
            "ids_together": [r["ids"] for r in together], "ids_alone": [r["ids"] for r in alone]}


# ------------------------------------------------------------------------------------------------ chat mode

def make_prompts(n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    return [f"Request {i}: tell me about {words[i % len(words)]} and {words[(i * 3 + 1) % len(words)]}."
            + " please" * (i % 4) for i in range(n)]


async def _one(client, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    t0 = time.perf_counter()
    ttft = None
    try:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            parts, finish, usage = [], None, None
            s = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            async for ch in s:
                if ch.choices:
                    c = ch.choices[0]
                    if c.delta.content:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(c.delta.content)
                    if c.finish_reason:
                        finish = c.finish_reason
                if ch.usage is not None:
                    usage = ch.usage
            text = "".join(parts)
            tokens = usage.completion_tokens if usage else None
        else:
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                     temperature=0)
            text, finish, tokens = r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        ok = finish in ("stop", "length") and tokens is not None
        return {"ok": ok, "text": text, "finish": finish, "tokens": tokens, "latency": time.perf_counter() - t0,
                "ttft": ttft, "error": None if ok else f"finish={finish} tokens={tokens}"}
    except Exception as e:                                   # counted as a failure, never raised
        return {"ok": False, "text": None, "finish": None, "tokens": None, "latency": time.perf_counter() - t0,
                "ttft": ttft, "error": f"{type(e).__name__}: {e}"[:300]}


async def run_load_async(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                         stream: bool = True, timeout: float = 600.0) -> tuple[list[dict], float]:
    client = _client(base_url, timeout)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)

    async def worker(i: int):
        async with sem:
            results[i] = await _one(client, model, prompts[i], max_tokens, stream)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(len(prompts))))
    finally:
        await client.close()
    return results, time.perf_counter() - t0


def run_load(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
             stream: bool = True) -> tuple[list[dict], float]:
    return asyncio.run(run_load_async(base_url, model, prompts, concurrency, max_tokens, stream))


def run_sequential(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """The same requests one at a time (non-streamed): the reference for greedy equality."""
    return run_load(base_url, model, prompts, 1, max_tokens, stream=False)[0]


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    toks = sum(r["tokens"] or 0 for r in ok)
    return {"requests": len(results), "failures": len(results) - len(ok), "wall_s": round(wall_s, 3),
            "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
            "p50_latency_s": _r(_pct(lat, 50)), "p99_latency_s": _r(_pct(lat, 99)),
            "mean_latency_s": _r(statistics.fmean(lat) if lat else None),
            "p50_first_text_s": _r(_pct(ttft, 50)), "p99_first_text_s": _r(_pct(ttft, 99)),
            "completion_tokens": toks, "tokens_per_s": round(toks / wall_s, 2) if wall_s > 0 else None,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def chat_load(url: str, model: str, a: argparse.Namespace) -> dict:
    prompts = make_prompts(a.num_prompts)
    results, wall = run_load(url, model, prompts, a.max_concurrency or a.num_prompts, a.output_len)
    summary = summarize(results, wall)
    if a.check:
        ref = run_sequential(url, model, prompts, a.output_len)
        summary["mismatches_vs_sequential"] = sum(1 for x, y in zip(results, ref)
                                                  if x["ok"] and y["ok"] and x["text"] != y["text"])
    return summary


# ------------------------------------------------------------------------------------------------ main

def bench_args(argv) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="any other flag goes to `dsv41 serve` (e.g. --device cuda --max-batch 32)")
    ap.add_argument("--mode", choices=["serving", "overload", "chat"], default="serving")
    ap.add_argument("--url", default=None, help="an already running server (default: start one in-process)")
    ap.add_argument("--model", default=None, help="model name on --url (default: its first)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len x [1 - r, 1 + r]")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default inf)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    ap.add_argument("--dataset-seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent (one at a time) before the measurement")
    ap.add_argument("--idle-ttft-len", type=int, default=512, help="prompt tokens of the idle-server TTFT (0: skip)")
    ap.add_argument("--idle-ttft-repeats", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="chat mode: compare with the requests run one at a time")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/server_bench-<...>.json)")
    return ap.parse_known_args(argv)


def machine() -> dict:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"usable_cpus": cpus, "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}


def _commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return os.environ.get("DSV41_GIT_COMMIT") or r.stdout.strip() or None


def run_mode(a: argparse.Namespace, url: str, model: str, vocab: int,
             requests: list[tuple[list[int], int]], server: LocalServer | None = None) -> dict:
    if a.mode == "chat":
        return chat_load(url, model, a)
    if a.mode == "overload":
        return overload(url, model, requests, (lambda: server.preemptions) if server else None)
    if a.warmup:
        one_at_a_time(url, model, random_requests(a.warmup, a.input_len, 4, 0.0, vocab, a.dataset_seed + 1))
    results, wall = send_requests(url, model, requests, a.request_rate, a.max_concurrency, a.dataset_seed)
    summary = serving_summary(results, wall)
    if a.idle_ttft_len:
        summary["idle_ttft"] = idle_ttft(url, model, a.idle_ttft_len, a.idle_ttft_repeats, vocab, a.dataset_seed)
    return summary


def run(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a, flags = bench_args(argv)
    if missing(CLIENT_DEPS):
        raise SystemExit(f"the client needs {', '.join(missing(CLIENT_DEPS))}: python -m pip install --no-index "
                         f"--find-links {WHEELS} openai httpx")
    if a.mode == "overload" and a.url is None:         # the page pool, not the batch size, is what must bind
        flags = [*flags, *([] if "--deterministic" in flags else ["--deterministic"]),
                 *([] if "--max-batch" in flags else ["--max-batch", str(a.num_prompts)])]
    server, setup = None, {}
    if a.url:
        if flags:
            raise SystemExit(f"unknown flags with --url (they configure a local server): {' '.join(flags)}")
        url, (model, vocab) = a.url, remote_model(a.url)
        model = a.model or model
    else:
        pool = None
        if a.mode == "overload" and "--kv-pages" not in flags:
            pool = pool_for_half(request_lengths(a.num_prompts, a.input_len, a.output_len, a.range_ratio,
                                                 a.dataset_seed))
        server = LocalServer(flags, kv_pages=pool)
        url, model, setup = server.url, server.model, server.describe()
        vocab = min(server.engine.cfg.vocab_size, server.engine.tokenizer.vocab_size)
    requests = random_requests(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab, a.dataset_seed)
    try:
        summary = run_mode(a, url, model, vocab, requests, server)
    finally:
        if server is not None:
            server.stop()
    name = f"{a.mode}-{setup.get('device', 'remote')}-{model}".replace(":", "").replace("/", "_")
    out = a.out or str(ROOT / "benchmarks" / "results" / f"server_bench-{name}.json")
    return {"mode": a.mode, "model": model, "url": a.url, "result_file": out, "num_prompts": a.num_prompts,
            "input_len": a.input_len, "output_len": a.output_len, "range_ratio": a.range_ratio,
            "request_rate": str(a.request_rate), "max_concurrency": a.max_concurrency, "dataset_seed": a.dataset_seed,
            "serve_flags": flags,
            "server": setup, "commit": _commit(), "command": shlex.join(["python", "benchmarks/server_load.py", *argv]),
            "machine": machine(), **summary}


def report(res: dict) -> None:
    if res["mode"] == "serving":
        idle = res.get("idle_ttft")
        print(f"{res['completed']} completed, {res['failed']} failed in {res['duration_s']} s: "
              f"{res['request_throughput']} req/s, {res['output_throughput']} output tokens/s; TTFT p50 "
              f"{res['ttft_ms']['p50']} / p99 {res['ttft_ms']['p99']} ms; ITL p50 {res['itl_ms']['p50']} / p99 "
              f"{res['itl_ms']['p99']} ms; TPOT p50 {res['tpot_ms']['p50']} ms"
              + (f"; idle TTFT of {idle['prompt_tokens']} tokens p50 {idle['p50_ms']} ms" if idle else ""))
    elif res["mode"] == "overload":
        print(f"overload: {res['completed']} of {res['requests']} completed at once (kv_pages "
              f"{res['server'].get('kv_pages')}, max batch {res['server'].get('max_batch')}, {res['preemptions']} "
              f"preemptions), errors {res['errors']}; greedy outputs equal to one at a time: "
              f"{res['equal']} of {res['requests']} ({res['equal_share']:.0%})")
    else:
        print(f"{res['requests']} chat requests, {res['failures']} failed; {res['requests_per_s']} req/s; latency "
              f"p50 {res['p50_latency_s']} s, p99 {res['p99_latency_s']} s; {res['tokens_per_s']} tokens/s"
              + (f"; greedy texts unlike one at a time: {res['mismatches_vs_sequential']}"
                 if "mismatches_vs_sequential" in res else ""))


def main(argv=None) -> int:
    res = run(argv)
    report(res)
    out = res.pop("ids_together", None), res.pop("ids_alone", None)
    path = Path(res["result_file"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    print(f"written to {path}")
    failed = res.get("failed", res.get("failures", 0)) or (res["mode"] == "overload" and
                                                           (res["completed"] < res["requests"] or out[0] != out[1]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
