"""`dsv41 bench kv --config NAME --tokens N [--json]`: fill the engine's packed store for one sequence of N tokens
(random entries, no model) and print the bytes it holds by kind, per token, beside the analytic figures.

Wiring: the module owning the `bench` command group (`dsv41.engine.cli`) calls `register_bench(bench_subparsers)`
on its sub-parser group.
"""

from __future__ import annotations

import argparse
import json

from dsv41.config import parse_tokens


def register_bench(bench_sub) -> argparse.ArgumentParser:
    """Add `kv` to an existing `bench` sub-parser group (the result of `bench.add_subparsers(...)`)."""
    p = bench_sub.add_parser("kv", help="fill the packed KV store for one sequence and report bytes by kind",
                             description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="v41-flash", help="preset name or config.json (default v41-flash)")
    p.add_argument("--tokens", type=parse_tokens, required=True, help="sequence length: 4096, 64K, 1M (= 2^20)")
    p.add_argument("--page-size", type=int, default=64, help="global-store entries per page (default 64)")
    p.add_argument("--device", default="cpu", help="where the store lives (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_kv)
    return p


def _mb(x: float) -> str:
    return f"{x / 1e6:,.3f} MB"


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from dsv41.kv.accounting import bench_kv

    if args.page_size <= 0:
        raise ValueError(f"--page-size must be positive, got {args.page_size}")
    r = bench_kv(args.config, args.tokens, page_size=args.page_size, device=args.device)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    n = r["tokens"]
    print(f"packed KV store, config {r['config']}, one sequence of {n:,} tokens (page {r['page_size']} entries)")
    print(f"  {'kind':<28}{'bytes':>16}{'per token':>14}{'analytic':>14}")
    print(f"  {'global KV (records)':<28}{r['global_bytes']:>16,}{r['measured_global_bytes_per_token']:>14,.6g}"
          f"{r['analytic_global_bytes_per_token']:>14,}")
    print(f"  {'  main KV':<28}{r['global_main_bytes']:>16,}{r['global_main_bytes'] / n:>14,.6g}")
    print(f"  {'  index K':<28}{r['global_index_bytes']:>16,}{r['global_index_bytes'] / n:>14,.6g}")
    print(f"  {'global KV (pages held)':<28}{r['allocated_global_bytes']:>16,}"
          f"{r['allocated_global_bytes_per_token']:>14,.6g}")
    print(f"  {'SWA rings':<28}{r['swa_bytes']:>16,}{'':>14}{r['analytic_swa_bytes']:>14,}")
    print(f"  {'compressor pending (fp32)':<28}{r['pending_bytes']:>16,}{'':>14}{r['analytic_pending_bytes']:>14,}")
    for layer in r["by_layer"]:
        print(f"    layer {layer['layer']:>3} m={layer['ratio']}  {layer['entries']:>10,} entries x "
              f"({layer['main_record_bytes']} + {layer['index_record_bytes']}) B = {_mb(layer['bytes'])} "
              f"in {layer['pages']:,} pages")
    print(f"  pool capacity (global pages incl. free): {_mb(r['pool_global_capacity_bytes'])}; fill "
          f"{r['fill_seconds']:.2f} s; peak RSS {r['peak_rss_mb']:,.0f} MB")
    return 0
