"""Time to first token of one prompt: cold vs swa-hit vs replay warm starts, measured side by side in one run
Random `tiny` weights (quantized, packed store), CPU by default.

    python benchmarks/prefix_ttft.py [--tokens 8192] [--config tiny] [--mode ced-bounded]

Also reports the persistent tier's bytes per cached token next to the analytic global KV bytes/token.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--mode", default="ced-bounded")
    args = ap.parse_args()
    from dsv41.config import load_config
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams
    from dsv41.analysis.kv_bytes import global_kv_bytes_per_token
    from dsv41.model.init import random_model

    cfg = load_config(args.config)
    model = random_model(cfg, seed=0)
    prompt = torch.randint(3, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    p = SamplingParams(max_tokens=1, ignore_eos=True)
    cache = Path(tempfile.mkdtemp(prefix="dsv41-ttft-"))
    eng = Engine(model, prefill_mode=args.mode, cache_dir=cache, swa_pool="memory", max_seq_len=args.tokens + 8)
    rows = {}
    for label in ("cold", "swa-hit"):
        t0 = time.perf_counter()
        c = eng.generate([prompt], p)[0]
        rows[label] = {"ttft_s": c.stats["ttft_s"], "wall_s": time.perf_counter() - t0, "path": c.stats["cache_path"],
                       "cached_tokens": c.stats["cached_tokens"]}
    eng2 = Engine(model, prefill_mode=args.mode, cache_dir=cache, max_seq_len=args.tokens + 8)  # no SWA pool
    t0 = time.perf_counter()
    c = eng2.generate([prompt], p)[0]
    rows["replay"] = {"ttft_s": c.stats["ttft_s"], "wall_s": time.perf_counter() - t0, "path": c.stats["cache_path"],
                      "cached_tokens": c.stats["cached_tokens"]}
    disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    cold = rows["cold"]["ttft_s"]
    print(f"TTFT, config {args.config}, {args.tokens}-token prompt, prefill {args.mode}")
    print(f"{'path':>8} {'ttft s':>9} {'vs cold':>8} {'cached':>7}")
    for k, r in rows.items():
        r["ratio_vs_cold"] = r["ttft_s"] / cold
        print(f"{r['path']:>8} {r['ttft_s']:>9.3f} {r['ratio_vs_cold']:>8.3f} {r['cached_tokens']:>7}")
    per_tok = disk / rows["swa-hit"]["cached_tokens"] if rows["swa-hit"]["cached_tokens"] else None
    analytic = float(global_kv_bytes_per_token(cfg))
    print(f"persistent tier on disk: {disk} B for {rows['swa-hit']['cached_tokens']} cached tokens = "
          f"{per_tok:.1f} B/token (analytic global KV {analytic:.1f} B/token; disk also holds headers, the "
          "compressor carry of the end-of-prompt unit and the end-of-output unit)")
    print(json.dumps({"bench": "prefix_ttft", "config": args.config, "tokens": args.tokens, "mode": args.mode,
                      "rows": rows, "disk_bytes": disk, "disk_bytes_per_cached_token": per_tok,
                      "analytic_global_bytes_per_token": analytic}))


if __name__ == "__main__":
    main()
