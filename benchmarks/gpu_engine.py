"""GPU figures for the engine and the long-context decode table, one run on one GPU.

1. smoke: the debug preset on the GPU through the engine (packed pool), all prefill modes.
2. prefill ratio: v41-geometry (random weights, bf16, quantization on): full / ced-exact / ced-bounded prefill
   time at each prompt length, measured side by side, with the analytic row-count ratio (PREFILL_CHUNK: every
   mode prefills in chunks of that many tokens, for prompts whose one-shot activations do not fit).
3. decode vs context: v41-geometry, one sequence whose packed store is filled with SYNTHETIC entries
   (`dsv41.kv.accounting.fill_random`: random codec records, not a real prefill) at each context; the measured
   global-KV bytes and the decode step time of the full 40-layer stack (reference torch path + the Triton
   dense sparse-attention kernel that `auto` picks on CUDA).
4. eager vs CUDA graphs (`dsv41.engine.graphs`), side by side: v41-geometry decode steps at GRAPH_CONTEXT (4096)
   for each of GRAPH_BATCHES (1,32) rows (synthetic stores), eager and replayed alternately on the same sequences:
   wall per step, GPU busy (torch.profiler's kernel sum) and CUDA-event time, against the weight-read limit of
   benchmarks/gpu_weights.py (`decode_read_bytes` over the copy bandwidth measured in this run), for each holding
   in GRAPH_HOLDINGS (bfloat16,packed: the weights packed in place after the bf16 rows); "" skips the part.
Prints a table per part and a final JSON line; writes the JSON to $OUT/gpu_engine.json when OUT is set, and the
graph part also to benchmarks/results/gpu_graphs.json (and $OUT/gpu_graphs.json).

    PREFILL_LENGTHS= DECODE_CONTEXTS= python benchmarks/gpu_engine.py      # the smoke test and part 4 only
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def launch_profile(model, pool, sid, tok) -> dict:
    """One more decode step under torch.profiler: kernel launches, and the GPU's busy time (sum of kernel
    durations) against the step's wall time; busy << wall means the step is bound by launching, not by the GPU."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a = time.perf_counter()
        model(tok, pool.bind([sid]), last_only=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - a
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                    "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ka if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    busy = sum(e.self_device_time_total for e in ka) / 1e6
    top = sorted(ka, key=lambda e: -e.self_device_time_total)[:8]
    top_cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:10]
    return {"profiled_step_s": wall, "kernel_launches": launches, "host_syncs": syncs, "gpu_busy_s": busy,
            "top_gpu_ms": [(e.key[:60], round(e.self_device_time_total / 1e3, 2), e.count) for e in top],
            "top_self_cpu_ms": [(e.key[:60], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top_cpu],
            "top_aten_counts": [(e.key[:60], e.count) for e in sorted(ka, key=lambda e: -e.count)
                                if e.key.startswith("aten::")][:25],
            "profiled_cpu_ms": round(sum(e.self_cpu_time_total for e in ka) / 1e3, 1)}


def _smoke(dev: str) -> str:
    """The debug preset through every prefill mode and one decode step: "ok" or the traceback's end."""
    from dsv41.config import load_config
    from dsv41.engine.prefill import prefill
    from dsv41.engine.store import make_pool
    from dsv41.model.init import random_model
    try:
        cfg = load_config("debug")
        m = random_model(cfg, dtype=torch.bfloat16, device=dev)
        ids = torch.randint(0, cfg.vocab_size, (1, 100), device=dev)
        for mode in ("full", "ced-exact", "ced-bounded"):
            pool = make_pool(m, dev)
            v = pool.bind([pool.new_sequence()])
            out = prefill(m, ids, v, mode)
            m(ids[:, :1], v)
            assert torch.isfinite(out.logits).all()
        return "ok"
    except Exception:
        print(traceback.format_exc()[-1500:], flush=True)
        return traceback.format_exc()[-1500:]


def _prefill_row(model, cfg, dev: str, n: int, modes: list[str], chunk: int | None) -> dict:
    from dsv41.engine.bench import analytic_ratio, time_prefill
    ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev)
    t = {}
    for mode in modes:
        t[mode] = time_prefill(model, ids, mode, chunk)
        torch.cuda.empty_cache()
    ratio = {m: t[m] / t["full"] if m in t else None for m in ("ced-bounded", "ced-exact")}
    return {"tokens": n, "chunk": chunk, "full_s": t["full"], "ced_exact_s": t.get("ced-exact"),
            "ced_bounded_s": t.get("ced-bounded"), "ratio_bounded": ratio["ced-bounded"],
            "ratio_exact": ratio["ced-exact"], "analytic_ratio": analytic_ratio(cfg, "ced-bounded", n),
            "peak_gb": (torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else 0)}


def _decode_row(model, dev: str, n: int) -> dict:
    from dsv41.engine.bench import timed
    from dsv41.engine.store import make_pool
    from dsv41.kv.accounting import fill_random
    pool = make_pool(model, dev)
    sid = pool.new_sequence()
    fill = fill_random(pool, sid, n)
    gbytes = pool.seq_bytes(sid)["global_entries_bytes"]
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    times = []
    with torch.no_grad():
        for _ in range(int(os.environ.get("DECODE_STEPS", "4"))):
            v = pool.bind([sid])
            times.append(timed(lambda: model(tok, v, last_only=True), dev))
    row = {"context": n, "global_kv_bytes": gbytes, "bytes_per_token": gbytes / n,
           "step_s": statistics.median(times[1:]), "steps_s": times, "fill_s": fill["seconds"]}
    if dev == "cuda":
        row.update(launch_profile(model, pool, sid, tok))
    return row


def _event_s(fn) -> float:
    """Seconds between CUDA events around fn() (the stream's time: kernels and the gaps between them)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def _graph_row(model, cfg, dev: str, holding: str, bw: float, context: int, batch: int, steps: int) -> dict:
    """One batch size: eager and graph-replayed decode steps alternately on the same synthetic sequences."""
    from gpu_weights import gpu_busy

    from dsv41.analysis.memory import decode_read_bytes
    from dsv41.engine.bench import synthetic_batch, timed
    from dsv41.engine.graphs import DecodeGraphs
    pool, sids, tok = synthetic_batch(model, dev, batch, context)
    graphs = DecodeGraphs(model, pool, max_seq_len=context + 4 * steps + 16)
    paths = {"eager": lambda: model(tok, pool.bind(sids), last_only=True),
             "graph": lambda: graphs.forward(tok, pool.bind(sids))}
    with torch.no_grad():
        t0 = time.perf_counter()
        paths["graph"]()                                       # the capture (and the warm-up steps)
        _sync(dev)
        capture_s = time.perf_counter() - t0
        paths["eager"]()
        times: dict = {k: [] for k in paths}
        for _ in range(steps):
            for k, fn in paths.items():
                times[k].append(timed(fn, dev))
        profiled = {k: gpu_busy(fn) for k, fn in paths.items()}           # (seconds, top kernels)
        busy = {k: v[0] for k, v in profiled.items()}
        event = {k: statistics.median(_event_s(fn) for _ in range(3)) for k, fn in paths.items()}
    limit = decode_read_bytes(cfg, batch, holding)["bytes"] / bw
    row = {"holding": holding, "batch": batch, "context": context, "limit_s": limit, "capture_s": capture_s,
           "captures": graphs.captures, "capture_failure": graphs.failure}
    for k in paths:
        step = statistics.median(times[k])
        row.update({f"{k}_step_s": step, f"{k}_steps_s": times[k], f"{k}_gpu_busy_s": busy[k], f"{k}_top_kernels": profiled[k][1],
                    f"{k}_event_s": event[k], f"{k}_step_over_limit": step / limit})
    row["graph_speedup"] = row["eager_step_s"] / row["graph_step_s"]
    print(f"{holding:9s} batch {batch:3d}: eager {row['eager_step_s'] * 1e3:7.1f} ms (busy "
          f"{busy['eager'] * 1e3:6.1f}), graphs {row['graph_step_s'] * 1e3:7.1f} ms (busy {busy['graph'] * 1e3:6.1f}, "
          f"events {event['graph'] * 1e3:6.1f}); limit {limit * 1e3:5.2f} ms: graphs x{row['graph_step_over_limit']:.1f}"
          f", eager x{row['eager_step_over_limit']:.1f}", flush=True)
    return row


def _graph_part(model, cfg, dev: str, out_of_time) -> dict:
    """Part 4 for every holding in GRAPH_HOLDINGS (packing the weights in place for `packed`)."""
    from gpu_weights import copy_bandwidth

    from dsv41.model.packed_weights import pack_weights
    batches = [int(x) for x in os.environ.get("GRAPH_BATCHES", "1,32").split(",") if x]
    context = int(os.environ.get("GRAPH_CONTEXT", "4096"))
    steps = int(os.environ.get("GRAPH_STEPS", "8"))
    bw = copy_bandwidth(dev)
    part: dict = {"copy_bandwidth": bw, "context": context, "rows": []}
    for holding in [h for h in os.environ.get("GRAPH_HOLDINGS", "bfloat16,packed").split(",") if h]:
        if holding == "packed":
            pack_weights(model)
            torch.cuda.empty_cache()
        part["rows"] += [dict(r, holding=holding) for r in _rows(
            batches, "batch", lambda b: _graph_row(model, cfg, dev, holding, bw, context, b, steps), out_of_time)]
    return part


def _rows(items: list[int], key: str, measure, out_of_time) -> list[dict]:
    """measure(item) for each item, printed; an error or the time budget gives a row saying so."""
    rows = []
    for n in items:
        if out_of_time():
            rows.append({key: n, "skipped": "time budget"})
            continue
        try:
            rows.append(measure(n))
        except Exception:
            rows.append({key: n, "error": traceback.format_exc()[-800:]})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def _decode_ratio(drows: list[dict]) -> dict | None:
    """Largest vs smallest context, pooling the steps of repeated contexts (run order noise)."""
    by_ctx: dict = {}
    for r in drows:
        if "step_s" in r:
            by_ctx.setdefault(r["context"], []).append(r)
    if len(by_ctx) < 2:
        return None
    lo, hi = min(by_ctx), max(by_ctx)

    def med(rs, key):
        return statistics.median(x for r in rs for x in (r["steps_s"][1:] if key == "steps_s" else [r[key]])
                                 if key in r)
    out = {"contexts": [lo, hi], "wall": med(by_ctx[hi], "steps_s") / med(by_ctx[lo], "steps_s")}
    if all("gpu_busy_s" in r for r in by_ctx[lo] + by_ctx[hi]):
        out["gpu_busy"] = med(by_ctx[hi], "gpu_busy_s") / med(by_ctx[lo], "gpu_busy_s")
    return out


def main() -> None:
    dev = os.environ.get("DEVICE", "cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                 "commit": os.environ.get("DSV41_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                        text=True).stdout.strip(),
                 "command": " ".join(sys.argv)}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    t_start = time.perf_counter()
    budget = float(os.environ.get("BUDGET_S", "1e9"))

    def out_of_time() -> bool:
        return time.perf_counter() - t_start > budget

    lengths = [int(x) for x in os.environ.get("PREFILL_LENGTHS", "8192,32768").split(",") if x]   # "" = none
    chunk = int(os.environ["PREFILL_CHUNK"]) if os.environ.get("PREFILL_CHUNK") else None   # same chunks every mode
    modes = os.environ.get("PREFILL_MODES", "ced-bounded,ced-exact,full").split(",")   # full is required (the ratio)
    contexts = [int(x) for x in os.environ.get("DECODE_CONTEXTS", "4096,65536,262144,1048576").split(",") if x]
    from dsv41.config import load_config
    from dsv41.model.init import random_model

    # 1. smoke
    res["smoke"] = _smoke(dev)
    print("smoke:", res["smoke"], flush=True)

    # 2. prefill ratio on v41-geometry
    cfg = load_config(os.environ.get("CONFIG", "v41-geometry"))
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    _sync(dev)
    res["model_build_s"] = time.perf_counter() - t0
    res["model_params"] = sum(p.numel() for p in model.parameters())
    res["gpu_mem_weights_gb"] = torch.cuda.memory_allocated() / 1e9 if dev == "cuda" else 0
    print(f"{os.environ.get('CONFIG', 'v41-geometry')} built in {res['model_build_s']:.1f}s, {res['model_params']/1e9:.1f}B params", flush=True)
    res["prefill"] = _rows(lengths, "tokens", lambda n: _prefill_row(model, cfg, dev, n, modes, chunk), out_of_time)

    # 3. decode step vs context, synthetic store
    drows = _rows(contexts, "context", lambda n: _decode_row(model, dev, n), out_of_time)
    ratio = _decode_ratio(drows)
    if ratio is not None:
        res["decode_ratio"] = ratio
        print("decode ratio", ratio, flush=True)
    res["decode"] = drows

    # 4. eager vs CUDA graphs
    if os.environ.get("GRAPH_HOLDINGS", "bfloat16,packed") and dev == "cuda":
        res["graphs"] = _graph_part(model, cfg, dev, out_of_time)
        part = json.dumps({k: res[k] for k in ("gpu", "torch", "triton", "commit", "command", "graphs")}, indent=1)
        for folder in [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")] + \
                [os.environ["OUT"]] * bool(os.environ.get("OUT")):
            with open(os.path.join(folder, "gpu_graphs.json"), "w") as f:
                f.write(part + "\n")
    line = json.dumps(res)
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_engine.json"), "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
