"""The tables of an evaluation (`dsv41 posttrain eval`): per level, the mean reasoning length [95% bootstrap] and
accuracy per family, for the checkpoint and its baseline; adjacent levels whose length intervals are apart; the
per-difficulty affine fit of length on b (slope, R^2); the paired sign tests. Reads the eval report (eval.json /
eval_t1.json, possibly .gz) and, for the per-family length, the two raw files (eval_raw*.json in each checkpoint).
(06e's summary.py, plus: with --family and both raw files, the paired sign tests restricted to that family, over
all levels and per level; --levels restricts those tests to a subset of the levels.)

python summary.py REPORT [--raw CKPT_RAW --base-raw BASE_RAW] [--family sums]
"""

import argparse
import gzip
import json

from dsv41.posttrain.report import adjacent_levels
from dsv41.posttrain.rollout import bootstrap_ci, sign_test, summarize

_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # noqa: E731


def only(res: dict, family: str) -> dict:
    """The raw results restricted to one family."""
    out = {}
    for b, r in res.items():
        keep = [i for i, f in enumerate(r["family"]) if f == family]
        out[int(b)] = {k: [v[i] for i in keep] for k, v in r.items()}
    return out


def table(name: str, rep: dict) -> None:
    lv = sorted(rep["levels"], key=float)
    print(f"{name}:")
    for b in lv:
        v = rep["levels"][b]
        fam = v.get("accuracy_by_family", {})
        print(f"  b={float(b):5.0f} len {v['mean_length']:6.2f} [{v['length_ci95'][0]:.2f}, {v['length_ci95'][1]:.2f}]"
              f" acc {v['accuracy']:.3f} " + " ".join(f"{k} {x:.3f}" for k, x in fam.items()) + f" n {v['n']}")
    adj = adjacent_levels(rep)
    print(f"  adjacent: {sum(a['increasing'] for a in adj)}/8 up, {sum(a['ci_apart'] for a in adj)}/8 apart "
          + " ".join(f"{a['from']:.0f}->{a['to']:.0f}:{'A' if a['ci_apart'] else ('u' if a['increasing'] else '-')}"
                     for a in adj))
    print("  fit per n: " + "; ".join(f"n={d} slope {f['slope']:+.3f} " + ("flat" if f.get("flat") else
                                                                            f"R2 {f['r2']:.2f}")
                                      for d, f in rep["fit_by_difficulty"].items()))
    print(f"  mean accuracy over the levels {sum(rep['levels'][b]['accuracy'] for b in lv) / len(lv):.3f}, "
          f"mean length {sum(rep['levels'][b]['mean_length'] for b in lv) / len(lv):.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--raw")
    ap.add_argument("--base-raw")
    ap.add_argument("--family", action="append", default=[])
    ap.add_argument("--levels", help="comma-separated levels for the family's paired tests (default: all)")
    a = ap.parse_args()
    rep = json.load(_open(a.report))
    table(f"checkpoint {rep['checkpoint']} (T = {rep['temperature']})", rep)
    if "baseline" in rep:
        table(f"baseline {rep['baseline']['checkpoint']}", rep["baseline"])
        for k in ("paired", "paired_by_problem"):
            p = rep[k]
            print(f"{k}: {p['improved']} improved / {p['worsened']} worsened, one-sided p {p['p_one_sided']:.3g}")
        print("per level: " + " ".join(f"b{b} {v['improved']}/{v['worsened']} p {v['p_one_sided']:.2g}"
                                        for b, v in rep["paired_by_level"].items()))
    for fam in a.family:
        got = {}
        for name, path in (("checkpoint", a.raw), ("baseline", a.base_raw)):
            if path:
                got[name] = only({int(b): v for b, v in json.load(_open(path))["res"].items()}, fam)
                table(f"{name} {fam} only", summarize(got[name]))
        if len(got) == 2:
            res, bres = got["checkpoint"], got["baseline"]
            lv = [int(x) for x in a.levels.split(",")] if a.levels else sorted(res)
            flat = lambda r: [c for b in lv for c in r[b]["correct"]]   # noqa: E731
            k = len(res[lv[0]]["correct"])
            per = lambda r: [sum(r[b]["correct"][i] for b in lv) for i in range(k)]   # noqa: E731
            for nm, t in (("paired", sign_test(flat(bres), flat(res))), ("by problem", sign_test(per(bres), per(res)))):
                print(f"{fam} {nm} (levels {','.join(map(str, lv))}): checkpoint {sum(flat(res)) / len(flat(res)):.3f}"
                      f" vs baseline {sum(flat(bres)) / len(flat(bres)):.3f}: {t['improved']} improved / "
                      f"{t['worsened']} worsened, one-sided p {t['p_one_sided']:.3g}")
            print(f"{fam} per level: " + " ".join(
                f"b{b} {sum(res[b]['correct']) / k:.2f}/{sum(bres[b]['correct']) / k:.2f} p "
                f"{sign_test(bres[b]['correct'], res[b]['correct'])['p_one_sided']:.2g}" for b in lv))


if __name__ == "__main__":
    main()
