"""Measured versus analytic KV bytes per token in the engine's packed store, for every preset at a few lengths.

    PYTHONPATH=. python benchmarks/kv_bytes.py [--tokens 1000,4096,65536] [--configs debug,tiny,...]

Each (preset, N) fills a fresh `PackedKVPool` for one sequence of N tokens with random codec records
(`dsv41.kv.accounting.bench_kv`, the `dsv41 bench kv` path) and reads back what it holds. Measured global bytes per
token equal the analytic figure exactly when N is a multiple of every compression ratio; otherwise the open group
(N mod m tokens) is pending state, not global bytes, and the figure is slightly below. Prints a table, then one
JSON line with every row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.kv.accounting import bench_kv  # noqa: E402

PRESETS = ["debug", "tiny", "v41-flash", "v41-geometry"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="1001,4096,65536", help="comma-separated sequence lengths")
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",")]
    rows = []
    hdr = (f"{'config':<14}{'tokens':>10}{'measured B/tok':>16}{'analytic B/tok':>16}{'equal':>7}"
           f"{'pages B/tok':>13}{'SWA B':>12}{'pending B':>11}{'fill s':>9}")
    print(hdr)
    print("-" * len(hdr))
    for name in args.configs.split(","):
        for n in lengths:
            r = bench_kv(name, n, page_size=args.page_size)
            exact = r["measured_global_bytes_per_token"] == r["analytic_global_bytes_per_token"]
            rows.append({k: r[k] for k in ("config", "tokens", "measured_global_bytes_per_token",
                                           "analytic_global_bytes_per_token", "global_bytes",
                                           "allocated_global_bytes", "swa_bytes", "pending_bytes",
                                           "fill_seconds")} | {"exact": exact})
            print(f"{name:<14}{n:>10,}{r['measured_global_bytes_per_token']:>16,.6g}"
                  f"{r['analytic_global_bytes_per_token']:>16,}{'yes' if exact else 'no':>7}"
                  f"{r['allocated_global_bytes_per_token']:>13,.6g}{r['swa_bytes']:>12,}{r['pending_bytes']:>11,}"
                  f"{r['fill_seconds']:>9.2f}")
    print(json.dumps({"benchmark": "kv_bytes", "page_size": args.page_size, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
