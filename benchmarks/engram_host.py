"""Engram tables in host memory vs on the device: decode step time side by side in one run (GPU).

v41-geometry (random bf16 weights; the Engram tables packed as the checkpoint stores them, e4m3 rows + e8m0 per
32, the rest of the model dense) decodes one token per row at a synthetic 4K context (`fill_random`), at batch 1
and 32, with the tables (a) on the device and (b) in pinned host memory, the rows of each step prefetched on a side
stream when the ids are hashed (`dsv41.model.engram.prefetch_host_rows`). The two placements alternate, ROUNDS
times, and each row reports the median step; the target is host / device <= 1.05.

    python benchmarks/engram_host.py          # writes benchmarks/results/engram_host_<device>.json
Env: CONFIG (v41-geometry), CONTEXT (4096), BATCHES (1,32), STEPS (8 per round), ROUNDS (3), PROFILE (1: a
profiler table of one step per placement).
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

from dsv41.config import load_config  # noqa: E402
from dsv41.engine.bench import synthetic_batch, timed  # noqa: E402
from dsv41.model.engram import Engram  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402
from dsv41.model.packed_weights import resident_weight_bytes  # noqa: E402


def place(model, host: bool, dev: str) -> None:
    """Move every packed Engram table to pinned host memory (host) or to the device."""
    for e in (m for m in model.modules() if isinstance(m, Engram)):
        t = e.embed
        t.host = False
        t.to("cpu" if host else dev)
        if host:
            t.host = True
            if dev == "cuda":
                t.weight, t.scale = t.weight.pin_memory(), t.scale.pin_memory()


def steps(model, pool, sids, tok, n: int, dev: str) -> list[float]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            view = pool.bind(sids)
            out.append(timed(lambda: model(tok, view, last_only=True), dev))
    return out


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(os.environ.get("CONFIG", "v41-geometry" if dev == "cuda" else "debug"))
    context = int(os.environ.get("CONTEXT", "4096"))
    batches = [int(b) for b in os.environ.get("BATCHES", "1,32").split(",")]
    n_steps, rounds = int(os.environ.get("STEPS", "8")), int(os.environ.get("ROUNDS", "3"))
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    for e in (m for m in model.modules() if isinstance(m, Engram)):
        e.pack()
    res = {"config": cfg.name if hasattr(cfg, "name") else os.environ.get("CONFIG"), "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "context": context,
           "engram_table_bytes": resident_weight_bytes(model)["engram_tables"], "build_s": time.perf_counter() - t0,
           "rows": []}
    print(f"built in {res['build_s']:.0f}s; Engram tables {res['engram_table_bytes'] / 1e9:.2f} GB", flush=True)
    for B in batches:
        pool, sids, tok = synthetic_batch(model, dev, B, context)
        times = {"device": [], "host": []}
        for _ in range(rounds):
            for where in ("device", "host"):
                place(model, where == "host", dev)
                times[where] += steps(model, pool, sids, tok, n_steps, dev)[1:]     # first step: warm-up
        if os.environ.get("PROFILE") == "1":                # where a host-table step spends its time
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            for where in ("device", "host"):
                place(model, where == "host", dev)
                steps(model, pool, sids, tok, 2, dev)
                with profile(activities=acts) as prof:
                    steps(model, pool, sids, tok, 1, dev)
                print(f"--- batch {B}, {where} tables: top ops by CPU time")
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"batch": B, "device_step_s": med["device"], "host_step_s": med["host"],
               "host_over_device": med["host"] / med["device"], "samples_s": times}
        res["rows"].append(row)
        print(f"batch {B}: device {med['device'] * 1e3:.1f} ms, host {med['host'] * 1e3:.1f} ms, "
              f"host/device {row['host_over_device']:.3f} (target <= 1.05)", flush=True)
        del pool
    out = Path(__file__).parent / "results" / f"engram_host_{'h200' if dev == 'cuda' else 'cpu'}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
