"""Engram tables in host memory vs on the device: decode step time side by side in one run (GPU).

v41-geometry (random bf16 weights; the Engram tables packed as the checkpoint stores them, e4m3 rows + e8m0 per
32) decodes one token per row at a synthetic 4K context (`fill_random`), at batch 1
and 32, with the tables (a) on the device and (b) in pinned host memory, the rows of each step prefetched on a side
stream when the ids are hashed. The two placements alternate, ROUNDS times, and each row reports the median step;
the target is host / device <= 1.05.

With GRAPHS=1 (the default on a GPU) the steps are replayed from CUDA graphs (`dsv41.engine.graphs`, captured again
for each placement): the host tables' rows are then hashed and gathered on the host and copied into the graph's
buffers before each replay. GRAPHS=0 times the eager step (host-bound on a GPU), where the rows are prefetched on a
side stream when the ids are hashed (`dsv41.model.engram.prefetch_host_rows`). PACK=1 (the default on a GPU) holds
every weight as the checkpoint stores it (`pack_weights`), else the rest of the model stays dense.

    python benchmarks/engram_host.py          # writes benchmarks/results/engram_host_<device>.json
Env: CONFIG (v41-geometry), CONTEXT (4096), BATCHES (1,32), STEPS (8 per round), ROUNDS (3), GRAPHS, PACK,
PROFILE (1: a profiler table of one step per placement), RESULT (the result file).
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
from dsv41.model.packed_weights import pack_weights, resident_weight_bytes  # noqa: E402


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


def steps(step, pool, sids, tok, n: int, dev: str) -> list[float]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            view = pool.bind(sids)
            out.append(timed(lambda: step(tok, view), dev))
    return out


def stepper(model, pool, graphs: bool, max_seq_len: int):
    """The decode step to time: the graph runner's (built after the placement: it stages host tables' rows) or the
    eager forward."""
    if graphs:
        from dsv41.engine.graphs import DecodeGraphs
        g = DecodeGraphs(model, pool, max_seq_len)
        return lambda tok, view: g.forward(tok, view)
    return lambda tok, view: model(tok, view, last_only=True)


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(os.environ.get("CONFIG", "v41-geometry" if dev == "cuda" else "debug"))
    context = int(os.environ.get("CONTEXT", "4096"))
    batches = [int(b) for b in os.environ.get("BATCHES", "1,32").split(",")]
    n_steps, rounds = int(os.environ.get("STEPS", "8")), int(os.environ.get("ROUNDS", "3"))
    graphs = os.environ.get("GRAPHS", "1" if dev == "cuda" else "0") == "1"
    packed = os.environ.get("PACK", "1" if dev == "cuda" else "0") == "1"
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    if packed:
        pack_weights(model)
    for e in (m for m in model.modules() if isinstance(m, Engram)):
        e.pack()
    res = {"config": cfg.name if hasattr(cfg, "name") else os.environ.get("CONFIG"), "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "context": context,
           "graphs": graphs, "packed_weights": packed, "engram_table_bytes": resident_weight_bytes(model)["engram_tables"], "build_s": time.perf_counter() - t0,
           "rows": []}
    print(f"built in {res['build_s']:.0f}s; Engram tables {res['engram_table_bytes'] / 1e9:.2f} GB", flush=True)
    for B in batches:
        pool, sids, tok = synthetic_batch(model, dev, B, context)
        times = {"device": [], "host": []}
        for _ in range(rounds):
            for where in ("device", "host"):
                place(model, where == "host", dev)
                step = stepper(model, pool, graphs, context + rounds * 2 * (n_steps + 2) + 8)
                times[where] += steps(step, pool, sids, tok, n_steps, dev)[1:]     # first step: warm-up (capture)
        if os.environ.get("PROFILE") == "1":                # where a host-table step spends its time
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            for where in ("device", "host"):
                place(model, where == "host", dev)
                step = stepper(model, pool, graphs, context + 4 * (rounds * (n_steps + 2) + 8))
                steps(step, pool, sids, tok, 2, dev)
                with profile(activities=acts) as prof:
                    steps(step, pool, sids, tok, 1, dev)
                print(f"--- batch {B}, {where} tables: top ops by CPU time")
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"batch": B, "device_step_s": med["device"], "host_step_s": med["host"],
               "host_over_device": med["host"] / med["device"], "samples_s": times}
        res["rows"].append(row)
        print(f"batch {B}: device {med['device'] * 1e3:.1f} ms, host {med['host'] * 1e3:.1f} ms, "
              f"host/device {row['host_over_device']:.3f} (target <= 1.05)", flush=True)
        del pool
    gpu = (torch.cuda.get_device_name() if dev == "cuda" else "cpu").lower()
    name = "h200" if "h200" in gpu else "h100" if "h100" in gpu else "cpu" if dev == "cpu" else "gpu"
    out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / f"engram_host_{name}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
