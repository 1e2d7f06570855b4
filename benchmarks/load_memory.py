"""Host memory while loading an official-layout checkpoint (docs/model.md §9): peak RSS during `load_model` minus
the RSS before it, against the resident weight bytes (`dsv41 analyze memory`'s analytic figure and the loaded
model's own count), for the packed storage (the checkpoint's bytes held as they are) and the dense one
(dequantized, today's training / GPU holding), side by side in one run.

The checkpoint (>= 2 GB by default) is written by the project's official-layout writer from a config scaled up
from the tiny preset (more experts, wider); its quantized weights are random valid codes and scales, written from
a model built packed, so writing never needs a dequantized copy either. Each load runs in a fresh process; the
peak is the kernel's high-water mark (VmHWM), reset just before the load (`/proc/self/clear_refs`). Linux only.

    python benchmarks/load_memory.py [--dir /tmp/dsv41-load-memory] [--experts 200] [--dim 1024] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def big_config(experts: int, dim: int):
    from dsv41.config import load_config

    cfg = load_config("tiny")
    return dataclasses.replace(cfg, dim=dim, n_routed_experts=experts, moe_inter_dim=dim // 2, q_lora_rank=dim // 4,
                               n_heads=8)


@torch.no_grad()
def write_checkpoint(path: Path, experts: int, dim: int) -> None:
    """A random official-layout checkpoint of `big_config`, written from a model built packed."""
    from dsv41.model.common import weight_storage
    from dsv41.model.init import init_weights
    from dsv41.model.loading import write_official
    from dsv41.model.transformer import Transformer

    cfg = big_config(experts, dim)
    with weight_storage("packed"):
        model = Transformer(cfg, dtype=torch.bfloat16)
    init_weights(model, seed=0)                                   # the dense parameters
    g = torch.Generator().manual_seed(0)
    for name, buf in model.named_buffers():
        if name.endswith(".scale"):                               # e8m0 scales around 2^-6
            buf.copy_(torch.randint(118, 124, buf.shape, generator=g, dtype=torch.uint8))
        elif buf.dtype == torch.uint8:                            # codes: any byte but the e4m3 NaN
            buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.int32).to(torch.uint8))
            buf[(buf & 0x7F) == 0x7F] -= 1
    write_official(model, cfg, path, shards=4)


def _status(*keys: str) -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) * 1024
    return out


def measure(path: str, storage: str) -> dict:
    """Runs in the child process: load once with `storage` and report the RSS figures."""
    from dsv41.analysis.memory import memory_report
    from dsv41.model.loading import load_model
    from dsv41.model.packed_weights import resident_weight_bytes

    before = _status("VmRSS")["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")                 # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    model, cfg = load_model(path, dtype=torch.bfloat16, storage=storage)
    seconds = time.perf_counter() - t0
    st = _status("VmRSS", "VmHWM")
    held = resident_weight_bytes(model)
    rep = memory_report(cfg)
    analytic = rep["weights"]["bytes"] + rep["engram_tables"]["bytes"]
    if storage == "dense":
        analytic = rep["today"]["bytes"]
    return {"storage": storage, "seconds": round(seconds, 1), "rss_before": before, "rss_after": st["VmRSS"],
            "peak_rss": st["VmHWM"], "peak_minus_before": st["VmHWM"] - before,
            "resident_weight_bytes": sum(held.values()), "analytic_resident_bytes": analytic,
            "ratio_peak_to_resident": round((st["VmHWM"] - before) / sum(held.values()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/dsv41-load-memory", help="where the checkpoint is written (reused)")
    ap.add_argument("--experts", type=int, default=200, help="routed experts per layer (200: a 2.09 GB checkpoint)")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--storages", default="packed,dense")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "STORAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(path, args.experts, args.dim)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint: {file_bytes / 1e9:.3f} GB in {len(list(path.glob('*.safetensors')))} shards")
    rows = []
    for storage in args.storages.split(","):
        r = subprocess.run([sys.executable, __file__, "--child", str(path), storage], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    gb = 1e9
    print(f"{'storage':8} {'resident GB':>12} {'analytic GB':>12} {'RSS before':>11} {'peak':>8} {'peak-before':>12} "
          f"{'ratio':>6} {'s':>6}")
    for r in rows:
        print(f"{r['storage']:8} {r['resident_weight_bytes'] / gb:12.3f} {r['analytic_resident_bytes'] / gb:12.3f} "
              f"{r['rss_before'] / gb:11.3f} {r['peak_rss'] / gb:8.3f} {r['peak_minus_before'] / gb:12.3f} "
              f"{r['ratio_peak_to_resident']:6.3f} {r['seconds']:6.1f}")
    print(json.dumps({"checkpoint_bytes": file_bytes, "rows": rows}))
    if not args.keep:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
