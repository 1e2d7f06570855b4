"""v41-geometry weights on the GPU as dense bf16 vs packed (the checkpoint formats): memory measured vs analytic,
and the decode step at batch 1 and 32 before and after, each against its weight-read limit computed in this run:
wall time (eager, host-bound) and GPU busy time (the kernels' sum, torch.profiler).

The limit of a step is `dsv41.analysis.memory.decode_read_bytes` (dense weights + the experts a batch is expected
to touch, in the holding the model has) over the device-to-device copy bandwidth measured here (a 2 GB copy). The
model is random (bf16), the KV a synthetic 4K context per row (`fill_random`); the Engram tables stay on the device
(benchmarks/engram_host.py compares the placements). Order: build dense, time, pack in place (the same weights
rounded to the checkpoint formats), measure memory, time again.

    python benchmarks/gpu_weights.py           # writes benchmarks/results/gpu_weights_h200.json
Env: CONFIG (v41-geometry), CONTEXT (4096), BATCHES (1,32), STEPS (6), DENSE_ROWS (1: time the dense holding too;
0 builds it only to pack it), RESULT (the result file; default by GPU: gpu_weights_h200.json / gpu_weights_h100.json),
TUNING (a `benchmarks/packed_gemm.py --sweep*` result whose decode kernels and tiles to use), BASELINE (1: time the
packed model first on the bf16-decode kernels alone (the tensor-core decode kernel at every row count, the MoE's
bf16-decode path: the kernels before fp8_decode), then with the default kernels or TUNING's, side by side).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.analysis.memory import decode_read_bytes, memory_report  # noqa: E402
from dsv41.config import load_config  # noqa: E402
from dsv41.engine.bench import synthetic_batch, timed  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402
from dsv41.model.packed_weights import pack_weights, resident_weight_bytes  # noqa: E402


def copy_bandwidth(dev: str, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate in bytes/s (read + write counted once: the bytes moved)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    times = [timed(lambda: b.copy_(a), dev) for _ in range(reps)]
    a = b = None
    return 2 * nbytes / statistics.median(times)


def gpu_busy(fn, top: int = 12) -> tuple[float, list[dict]]:
    """Seconds of kernel time in one call of fn (torch.profiler: the sum of kernel durations): what the step costs
    the GPU, apart from the host's launching (the eager step is host-bound; graph capture removes that part); and
    the `top` kernels by their summed time (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    ops = [{"kernel": e.key[:120], "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in events[:top]]
    return sum(e.self_device_time_total for e in events) / 1e6, ops


def decode_rows(model, cfg, dev: str, holding: str, bw: float, context: int, batches, n_steps: int) -> list[dict]:
    rows = []
    for B in batches:
        pool, sids, tok = synthetic_batch(model, dev, B, context)
        times = []
        with torch.no_grad():
            for _ in range(n_steps):
                view = pool.bind(sids)
                times.append(timed(lambda: model(tok, view, last_only=True), dev))
        step = statistics.median(times[1:])
        busy, ops = gpu_busy(lambda: model(tok, pool.bind(sids), last_only=True))
        limit = decode_read_bytes(cfg, B, holding)["bytes"] / bw
        rows.append({"holding": holding, "batch": B, "step_s": step, "gpu_busy_s": busy, "limit_s": limit,
                     "step_over_limit": step / limit, "busy_over_limit": busy / limit, "top_kernels": ops})
        print(f"{holding:9s} batch {B:3d}: step {step * 1e3:8.1f} ms (GPU busy {busy * 1e3:6.1f} ms), weight-read "
              f"limit {limit * 1e3:6.2f} ms: wall x{step / limit:.1f}, busy x{busy / limit:.1f}", flush=True)
        for op in ops:
            print(f"    {op['ms']:8.2f} ms {op['calls']:5d} x  {op['kernel']}", flush=True)
        pool = None
        gc.collect()
    return rows


def apply_tuning(path: str) -> dict:
    """The decode tiles a `benchmarks/packed_gemm.py --sweep` (or --sweep-fp8-decode) result picked (its
    decode_configs, fp8_decode_config / fp8_decode_from and moe_config), set in this process."""
    from dsv41.kernels.triton import fp8_decode, moe_kernel, packed_gemm
    tuned = json.loads(Path(path).read_text())
    for rows, cfg in tuned.get("decode_configs", {}).items():
        packed_gemm.DECODE_CONFIGS[int(rows)].update(cfg)
    fp8_decode.FP8_DECODE_CONFIG.update(tuned.get("fp8_decode_config", {}))
    if isinstance(tuned.get("fp8_decode_from"), dict):
        fp8_decode.FP8_DECODE_FROM.update(tuned["fp8_decode_from"])
    moe_kernel.CONFIG.update(tuned.get("moe_config", {}))
    return {"decode_configs": {str(k): dict(v) for k, v in packed_gemm.DECODE_CONFIGS.items()},
            "fp8_decode_config": dict(fp8_decode.FP8_DECODE_CONFIG),
            "fp8_decode_from": dict(fp8_decode.FP8_DECODE_FROM),
            "moe_config": dict(moe_kernel.CONFIG)}


def main() -> None:
    dev = "cuda"
    name = os.environ.get("CONFIG", "v41-geometry")
    cfg = load_config(name)
    context = int(os.environ.get("CONTEXT", "4096"))
    batches = [int(b) for b in os.environ.get("BATCHES", "1,32").split(",")]
    n_steps = int(os.environ.get("STEPS", "6"))
    bw = copy_bandwidth(dev)
    res = {"config": name, "gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "context": context,
           "commit": os.environ.get("COMMIT", "")}
    if os.environ.get("TUNING") and os.environ.get("BASELINE") != "1":
        res["tuning"] = apply_tuning(os.environ["TUNING"])
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    res["dense_weight_bytes_measured"] = torch.cuda.memory_allocated() - base
    res["build_s"] = time.perf_counter() - t0
    res["rows"] = []
    if os.environ.get("DENSE_ROWS", "1") == "1":
        res["rows"] = decode_rows(model, cfg, dev, "bfloat16", bw, context, batches, n_steps)
    pack_weights(model)
    gc.collect()
    torch.cuda.empty_cache()
    measured = torch.cuda.memory_allocated() - base
    held = resident_weight_bytes(model)
    analytic = memory_report(cfg, gpus=1, engram_on_device=True)
    res.update({"packed_bytes_measured": measured, "packed_resident": held,
                "analytic_weight_bytes": analytic["weights"]["bytes"],
                "analytic_engram_bytes": analytic["engram_tables"]["bytes"]})
    total_analytic = analytic["weights"]["bytes"] + analytic["engram_tables"]["bytes"]
    res["measured_over_analytic"] = measured / total_analytic
    print(f"GPU memory for weights: dense bf16 {res['dense_weight_bytes_measured'] / 1e9:.1f} GB, packed "
          f"{measured / 1e9:.1f} GB (weights {held['weights'] / 1e9:.1f} + Engram tables "
          f"{held['engram_tables'] / 1e9:.1f}); analytic {total_analytic / 1e9:.1f} GB; measured / analytic "
          f"{res['measured_over_analytic']:.3f}", flush=True)
    if os.environ.get("BASELINE") == "1":             # the bf16-decode kernels first, then the defaults (or TUNING's)
        from dsv41.kernels.triton import fp8_decode, moe_kernel
        saved = dict(fp8_decode.FP8_DECODE_FROM), moe_kernel.CONFIG["packed_fp8_mma"]
        fp8_decode.FP8_DECODE_FROM.update(fp8=65, fp4=65)
        moe_kernel.CONFIG["packed_fp8_mma"] = 0
        for row in decode_rows(model, cfg, dev, "packed", bw, context, batches, n_steps):   # bf16-decode kernels only
            res["rows"].append({**row, "kernels": "bf16-decode"})
        fp8_decode.FP8_DECODE_FROM.update(saved[0])
        moe_kernel.CONFIG["packed_fp8_mma"] = saved[1]
        if os.environ.get("TUNING"):
            res["tuning"] = apply_tuning(os.environ["TUNING"])
            print(f"tuned: {res['tuning']}", flush=True)
    for row in decode_rows(model, cfg, dev, "packed", bw, context, batches, n_steps):
        res["rows"].append({**row, "kernels": "tuned" if os.environ.get("TUNING") else "default"})
    gpu = "h100" if "H100" in res["gpu"] else "h200"
    out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / f"gpu_weights_{gpu}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
