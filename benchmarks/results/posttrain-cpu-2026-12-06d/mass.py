"""The advantage mass an RL run's updates put on each plan letter per level band (the history's `adv_mass`, logged
since the --credit option), over windows of updates: per band and plan, n samples, the summed full advantage at
the plan letter (`plan`), its length-term part (`len`), the summed absolute advantage (`abs`), and the summed
per-token advantage on the trace/answer tokens (`trace`).

python mass.py runs/e9/rl4/posttrain.json [window] [--json out.json]
"""

import gzip
import json
import sys
_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # large results are gzipped

args = [a for a in sys.argv[1:] if not a.startswith("--")]
hist = json.load(_open(args[0]))
hist = hist.get("history", hist) if isinstance(hist, dict) else hist
w = int(args[1]) if len(args) > 1 else 15
out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
bands = sorted({b for h in hist for b in h.get("adv_mass", {})}, key=lambda s: int(s[1:].split("-")[0]))
windows = []
for s in range(0, len(hist), w):
    rows = hist[s:s + w]
    tab = {}
    for band in bands:
        for plan in "SML-":
            cells = [h["adv_mass"][band][plan] for h in rows if plan in h.get("adv_mass", {}).get(band, {})]
            if cells:
                tab.setdefault(band, {})[plan] = {k: round(sum(c[k] for c in cells), 3)
                                                  for k in ("n", "plan", "len", "abs", "trace")}
    windows.append({"updates": [s + 1, s + len(rows)], "mass": tab})
    print(f"updates {s + 1}-{s + len(rows)}")
    for band, cells in tab.items():
        print(f"  {band:8s} " + " | ".join(
            f"{p}: n {c['n']:3d} plan {c['plan']:+7.2f} (len {c['len']:+7.2f}) abs {c['abs']:6.2f} "
            f"trace {c['trace']:+8.2f}" for p, c in cells.items()))
if out_json:
    open(out_json, "w").write(json.dumps(windows, indent=1) + "\n")
