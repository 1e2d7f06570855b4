"""Print an eval report (dsv41 posttrain eval's eval*.json) as the README's table: per level the accuracy, the mean
reasoning length with its 95% bootstrap interval, and, for adjacent levels, whether the mean increases and whether
the intervals are apart; then the paired tests against the baseline when the report has one.

python table.py EVAL.json [EVAL2.json ...]
"""

import gzip
import json
import sys
_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # large results are gzipped

HELD = {12, 37, 62, 87}

for path in sys.argv[1:]:
    r = json.load(_open(path))
    lv = sorted(r["levels"], key=float)
    print(f"\n{path} ({r['checkpoint']}, T={r.get('temperature', 0)})")
    print("| b | accuracy | mean reasoning tokens | 95% bootstrap | n | vs previous level |")
    print("|---|---|---|---|---|---|")
    prev = None
    up = apart = 0
    for b in lv:
        v = r["levels"][b]
        lo, hi = v["length_ci95"]
        cmp = ""
        if prev is not None:
            inc = v["mean_length"] > prev["mean_length"]
            sep = lo > prev["length_ci95"][1]
            up += inc
            apart += sep
            cmp = ("up" if inc else "down") + (", intervals apart" if sep else "")
        star = "*" if int(b) in HELD else ""
        print(f"| {b}{star} | {v['accuracy']:.3f} | {v['mean_length']:.2f} | [{lo:.2f}, {hi:.2f}] | {v['n']} | {cmp} |")
        prev = v
    print(f"adjacent pairs increasing: {up}/{len(lv) - 1}; increasing with intervals apart: {apart}/{len(lv) - 1}")
    fits = r.get("fit_by_difficulty", {})
    print("affine fit per difficulty (slope tokens per unit b, R^2): " + "; ".join(
        f"d={d}: {f['slope']:.4f}, {f['r2']:.2f}" for d, f in fits.items()))
    if "paired" in r:
        b = r["baseline"]
        acc = sum(x["accuracy"] for x in r["levels"].values()) / len(lv)
        bacc = sum(x["accuracy"] for x in b["levels"].values()) / len(lv)
        print(f"mean accuracy {acc:.3f} vs baseline {bacc:.3f} ({b['checkpoint']}); paired (problem, level): "
              f"{r['paired']['improved']} improved / {r['paired']['worsened']} worsened, one-sided p "
              f"{r['paired']['p_one_sided']:.3g}; per problem: {r['paired_by_problem']['improved']} / "
              f"{r['paired_by_problem']['worsened']}, p {r['paired_by_problem']['p_one_sided']:.3g}")
