"""Load benchmark for the OpenAI-compatible server: C concurrent streaming chat clients (the official `openai`
async client) send R requests in total to a server on 127.0.0.1; prints requests/s, p50/p99 latency, TTFT and
tokens/s, then one JSON line. "first text" is when the first non-empty content delta reached the client (a random
model's first tokens often decode to nothing); the engine's own time to first token is read from /metrics
(`server_mean_ttft_s`, mean over the run).

    PYTHONPATH=. python benchmarks/server_load.py                       # random debug model, 200 req, 32 clients
    PYTHONPATH=. python benchmarks/server_load.py --checkpoint runs/demo-tiny --requests 64 --concurrency 16
    PYTHONPATH=. python benchmarks/server_load.py --url http://127.0.0.1:8000 --model demo-tiny   # a running server

`--check` also runs every request alone, one at a time, and counts greedy outputs that differ (the exact-mode
model — quantization off, deterministic tie rule — makes batched decoding equal to single decoding). The
functions `run_load` and `summarize` are used by tests/test_server_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


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
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="bench", max_retries=0, timeout=timeout)
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


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


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


def server_ttft(url: str) -> tuple[float, float] | None:
    """(sum, count) of the server's time-to-first-token histogram, from /metrics."""
    import httpx
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    except Exception:
        return None
    vals = {}
    for ln in text.splitlines():
        for k in ("dsv41_time_to_first_token_seconds_sum", "dsv41_time_to_first_token_seconds_count"):
            if ln.startswith(k + " "):
                vals[k] = float(ln.split()[-1])
    if len(vals) != 2:
        return None
    return vals["dsv41_time_to_first_token_seconds_sum"], vals["dsv41_time_to_first_token_seconds_count"]


def _r(x):
    return None if x is None else round(x, 4)


def start_local_server(checkpoint: str | None, preset: str, max_batch: int, max_seq_len: int, exact: bool,
                       seed: int = 0):
    """Serve a checkpoint (or a random model of `preset`) in this process; -> (handle, model name, tmpdir)."""
    from dsv41.config import load_config
    from dsv41.model.attention import set_tie_break
    from dsv41.model.common import set_quantization
    from dsv41.model.init import random_model
    from dsv41.model.loading import load_model, save_checkpoint
    from dsv41.engine.cli import engine_args, engine_from_args
    from dsv41.server.app import create_app, serve_in_thread
    from dsv41.server.state import ServerSettings

    tmp = None
    if checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv41-bench-")
        cfg = load_config(preset)
        save_checkpoint(random_model(cfg, seed=seed), cfg, tmp.name)
        checkpoint = tmp.name
    model, _ = load_model(checkpoint)
    if exact:
        set_quantization(model, False)
        set_tie_break(model, "recent")
    ns = engine_args(checkpoint=checkpoint, max_batch=max_batch, max_seq_len=max_seq_len, speculative="off")
    engine = engine_from_args(ns, model=model)
    name = "bench"
    app = create_app(engine, ServerSettings(model_name=name, checkpoint=checkpoint))
    return serve_in_thread(app), name, tmp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="an already running server (default: start one in-process)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--quantized", action="store_true", help="keep the FP8/FP4 QDQs on (default: exact mode)")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare with the requests run one at a time")
    args = ap.parse_args(argv)

    handle, tmp = None, None
    if args.url:
        url, model = args.url, args.model
        if model is None:
            import httpx
            model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    else:
        handle, model, tmp = start_local_server(args.checkpoint, args.preset, args.max_batch, args.max_seq_len,
                                                exact=not args.quantized)
        url = handle.url
    try:
        prompts = make_prompts(args.requests)
        before = server_ttft(url)
        results, wall = run_load(url, model, prompts, args.concurrency, args.max_tokens, stream=not args.no_stream)
        after = server_ttft(url)
        summary = summarize(results, wall)
        if before and after and after[1] > before[1]:
            summary["server_mean_ttft_s"] = _r((after[0] - before[0]) / (after[1] - before[1]))
        summary.update({"concurrency": args.concurrency, "max_tokens": args.max_tokens, "stream": not args.no_stream,
                        "model": model, "max_batch": args.max_batch if handle else None})
        if args.check:
            ref = run_sequential(url, model, prompts, args.max_tokens)
            summary["mismatches_vs_sequential"] = sum(1 for a, b in zip(results, ref)
                                                      if a["ok"] and b["ok"] and a["text"] != b["text"])
    finally:
        if handle is not None:
            handle.stop()
        if tmp is not None:
            tmp.cleanup()
    print(f"{summary['requests']} requests, {summary['concurrency']} concurrent clients, {summary['failures']} failed; "
          f"{summary['requests_per_s']} req/s; latency p50 {summary['p50_latency_s']} s, p99 "
          f"{summary['p99_latency_s']} s; first text p50 {summary['p50_first_text_s']} s; server TTFT mean "
          f"{summary.get('server_mean_ttft_s')} s; {summary['tokens_per_s']} tokens/s")
    if "mismatches_vs_sequential" in summary:
        print(f"greedy outputs differing from one-at-a-time runs: {summary['mismatches_vs_sequential']}")
    print(json.dumps(summary))
    return 0 if summary["failures"] == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
