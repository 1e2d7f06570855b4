"""Per-band plan-letter shares, accuracy and length of an RL run's history (posttrain.json or a copied history
json), over windows of updates: python plans.py runs/e8/rl1/posttrain.json [window]"""

import gzip
import json
import sys

from dsv41.posttrain.rl import level_bands
_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # large results are gzipped

hist = json.load(_open(sys.argv[1]))
hist = hist.get("history", hist) if isinstance(hist, dict) else hist
w = int(sys.argv[2]) if len(sys.argv) > 2 else 10
levels = sorted({int(b) for h in hist for b in h["levels"]})
bands = level_bands(levels)
for s in range(0, len(hist), w):
    rows = hist[s:s + w]
    out = []
    for lo, hi in bands:
        got = [v for h in rows for b, v in h["levels"].items() if lo <= int(b) <= hi]
        n = sum(v["n"] for v in got)
        if not n:
            continue
        sh = {c: sum(v.get("plans", {}).get(c, 0) * v["n"] for v in got) / n for c in "SML"}
        ln = sum(v["length"] * v["n"] for v in got) / n
        acc = sum(v["accuracy"] * v["n"] for v in got) / n
        out.append(f"b{lo}-{hi}: S {sh['S']:.2f} M {sh['M']:.2f} L {sh['L']:.2f} len {ln:4.1f} acc {acc:.2f}")
    print(f"updates {s + 1}-{s + len(rows)}: " + " | ".join(out))
