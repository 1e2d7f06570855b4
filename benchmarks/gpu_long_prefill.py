"""A real long prefill on one GPU, then decode: v41-geometry (random bf16 weights), ced-bounded, chunked.

For each length (LENGTHS, default 32768 and 1048576 tokens of random ids) one prefill into a fresh packed-store
sequence: wall time, the analytic FLOPs of the layers it runs (`dsv41.analysis.flops.prefill_terms`) over that time
as a share of the bf16 GEMM rate measured in the same run (8192 x 5120 x 5120), the global KV the store holds per
token (the 890 B/token design figure), and after the longest one DECODE_STEPS decode steps at that context.

    python benchmarks/gpu_long_prefill.py     # writes benchmarks/results/gpu_long_prefill_h200.json
Env: DEVICE (cuda; cpu for a check of the script), CONFIG (v41-geometry), LENGTHS (32768,1048576), CHUNK (16384), MODE (ced-bounded), DECODE_STEPS (6),
PROFILE (1: each length up to PROFILE_MAX (32768) tokens is prefilled once more into a fresh sequence under the torch
profiler: GPU busy time over wall, and the kernels by their summed time; where the prefill rate goes),
WARM (4096: before each timed prefill, an untimed one of min(n, WARM) tokens into a fresh sequence, so the timing
excludes compilation; 0: none), SHAPES (1, with PROFILE: a third prefill under the profiler with shapes and stacks: the torch ops by the GPU time of
their kernels, with input shapes and the dsv41 lines that issue them), RESULT (the result file; default
benchmarks/results/gpu_long_prefill_h200.json).

    PROFILE=1 LENGTHS=512,32768 DECODE_STEPS=0 RESULT=$OUT/prefill_profile.json python benchmarks/gpu_long_prefill.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.analysis.flops import prefill_terms  # noqa: E402
from dsv41.config import load_config  # noqa: E402
from dsv41.engine.bench import timed  # noqa: E402
from dsv41.engine.prefill import prefill  # noqa: E402
from dsv41.engine.store import make_pool  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_weights import gpu_busy  # noqa: E402


def gemm_rate(dev: str, n: int = 8192, k: int = 5120, reps: int = 20) -> float:
    a = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, k, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = statistics.median(timed(lambda: a @ b, dev) for _ in range(reps))
    return 2.0 * n * k * k / t


def profile_prefill(model, ids, mode: str, chunk: int, secs: float) -> dict:
    """A second prefill of `ids` into a fresh sequence under the profiler: kernel time, its share of the timed
    prefill's wall time `secs`, and the top kernels (name, ms, calls)."""
    pool = make_pool(model, ids.device)
    view = pool.bind([pool.new_sequence()])
    busy, top = gpu_busy(lambda: prefill(model, ids, view, mode, chunk), top=25)
    print(f"    profiled: GPU busy {busy:.3f} s of {secs:.3f} s wall ({busy / secs:.2f})", flush=True)
    for k in top:
        print(f"      {k['ms']:9.2f} ms {k['calls']:6d}x  {k['kernel'][:100]}", flush=True)
    out = {"gpu_busy_s": busy, "busy_over_wall": busy / secs, "top": top}
    if os.environ.get("SHAPES") == "1":
        out["ops"] = op_sources(lambda: prefill(model, ids, pool.bind([pool.new_sequence()]), mode, chunk))
    return out


def op_sources(fn, top: int = 30) -> list[dict]:
    """One more call of fn under the profiler with shapes and Python stacks: the torch ops by the GPU time of the
    kernels they launched, grouped by (op, input shapes, the innermost dsv41 frames), so each costly kernel names
    the line of ours that issues it."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=acts, record_shapes=True, with_stack=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    groups: dict = {}
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"      # CPU: a check of the script
    for e in prof.events():
        dev_us = getattr(e, attr, 0) or 0
        if dev_us <= 0 or not e.name.startswith("aten::"):
            continue
        frames, par = [], e.cpu_parent            # the Python frames enclosing the op (with_stack's events)
        while par is not None and len(frames) < 3:
            if "dsv41/" in par.name and "(" in par.name:
                frames.append(par.name)
            par = par.cpu_parent
        frames = frames or [f for f in (e.stack or []) if "dsv41/" in f][:3]
        key = (e.name, str(e.input_shapes)[:160], " < ".join(f.split("dsv41/")[-1] for f in frames))
        g = groups.setdefault(key, [0.0, 0])
        g[0] += dev_us / 1e3
        g[1] += 1
    rows = sorted(({"op": k[0], "shapes": k[1], "source": k[2], "ms": v[0], "calls": v[1]}
                   for k, v in groups.items()), key=lambda r: -r["ms"])[:top]
    print("    torch ops by the GPU time of their kernels (op, calls, shapes, source):", flush=True)
    for r in rows:
        print(f"      {r['ms']:9.2f} ms {r['calls']:5d}x {r['op']:28s} {r['shapes'][:70]:70s} {r['source'][:140]}",
              flush=True)
    return rows


def main() -> None:
    dev = os.environ.get("DEVICE", "cuda")
    name = os.environ.get("CONFIG", "v41-geometry")
    cfg = load_config(name)
    lengths = [int(x) for x in os.environ.get("LENGTHS", "32768,1048576").split(",")]
    chunk, mode = int(os.environ.get("CHUNK", "16384")), os.environ.get("MODE", "ced-bounded")
    rate = gemm_rate(dev)
    res = {"config": name, "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "mode": mode, "chunk": chunk,
           "bf16_gemm_flops_per_s": rate, "rows": []}
    print(f"bf16 GEMM rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    print(f"built in {time.perf_counter() - t0:.0f}s", flush=True)
    warm = int(os.environ.get("WARM", "4096"))
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
        if warm > 0:            # compile (Triton JIT, autotuning) outside the timed prefill
            wpool = make_pool(model, dev)
            with torch.no_grad():
                w_s = timed(lambda: prefill(model, ids[:, :min(n, warm)], wpool.bind([wpool.new_sequence()]), mode,
                                            chunk), dev)
            print(f"    warm-up prefill of {min(n, warm)} tokens: {w_s:.2f} s", flush=True)
            wpool = None
        pool = make_pool(model, dev)
        sid = pool.new_sequence()
        view = pool.bind([sid])
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            secs = timed(lambda: prefill(model, ids, view, mode, chunk), dev)
        pool.release(view, [sid])
        flops = sum(t.flops for t in prefill_terms(cfg, n))
        held = pool.seq_bytes(sid)
        row = {"tokens": n, "prefill_s": secs, "analytic_flops": flops, "flops_per_s": flops / secs,
               "share_of_gemm_rate": flops / secs / rate, "global_kv_bytes": held["global_entries_bytes"],
               "global_kv_bytes_per_token": held["global_entries_bytes"] / n,
               "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else 0.0}
        print(f"{n:8d} tokens: prefill {secs:7.1f} s, {row['flops_per_s'] / 1e12:6.1f} TFLOP/s = "
              f"{row['share_of_gemm_rate']:.2f} of the GEMM rate, global KV {row['global_kv_bytes_per_token']:.1f} "
              f"B/token, peak {row['peak_gb']:.1f} GB", flush=True)
        if os.environ.get("PROFILE") == "1" and n <= int(os.environ.get("PROFILE_MAX", "32768")):
            row["profile"] = profile_prefill(model, ids, mode, chunk, secs)
        if n == max(lengths) and int(os.environ.get("DECODE_STEPS", "6")) > 1:
            tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
            times = []
            with torch.no_grad():
                for _ in range(int(os.environ.get("DECODE_STEPS", "6"))):
                    v = pool.bind([sid])
                    times.append(timed(lambda: model(tok, v, last_only=True), dev))
                    pool.release(v, [sid])
            row["decode_step_s"] = statistics.median(times[1:])
            print(f"    then decode at {n} tokens: {row['decode_step_s'] * 1e3:.1f} ms per step", flush=True)
        res["rows"].append(row)
        pool = view = ids = None
        if dev == "cuda":
            torch.cuda.empty_cache()
            out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / "gpu_long_prefill_h200.json")
            out.write_text(json.dumps(res, indent=1))          # after every length: a later one may not fit
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
