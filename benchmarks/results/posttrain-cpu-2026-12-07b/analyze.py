"""Tables of a sampled held-out evaluation (`dsv41 posttrain eval ... --temperature 1 --constrain sml`) from its raw
cache (eval_raw_t1_csml.json), for any number of problems per level, plus the paired tests against a baseline's
raw cache over the problems both hold.

Why a separate script: the evaluation here used more problems per level (1,000) than the SFT baseline's cached
evaluation (500). held_out_problems is a fixed sequence and the sampling seed of problem i at level b is
7919 i + b, and the engine's deterministic mode makes a response independent of its batch, so the first 500 of
the 1,000 are exactly the 500 (problem, seed) pairs of the earlier evaluation; the paired tests use those.

Printed and written (--out): per level the mean reasoning length [95% bootstrap], accuracy (overall and per
family), n; adjacent levels up / apart; the per-difficulty affine fit of the level means on b (slope, R^2), over
both families (as `eval` reports it) and per family; the same tables on the first K problems (--prefix); the sign
tests (pairs, per problem, sums only) against the baseline.

python analyze.py RAW [--base-raw BASE_RAW] [--prefix 500] [--out summary.json]
"""

import argparse
import gzip
import json

from dsv41.posttrain.rollout import affine_fit, bootstrap_ci, sign_test

_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # noqa: E731


def load_raw(path: str) -> tuple[dict, dict]:
    """(the cache's key: problems, levels, temperature, constrain; the results per level)."""
    got = json.load(_open(path))
    return got["key"], {int(b): v for b, v in got["res"].items()}


def subset(res: dict, keep) -> dict:
    """The raw results restricted to the problem indices for which keep(i, family) holds."""
    out = {}
    for b, r in res.items():
        idx = [i for i, f in enumerate(r["family"]) if keep(i, f)]
        out[b] = {k: [v[i] for i in idx] for k, v in r.items()}
    return out


def levels_table(res: dict) -> dict:
    rows = {}
    for b in sorted(res):
        r = res[b]
        fams = sorted(set(r["family"]))
        rows[b] = {"mean_length": sum(r["length"]) / len(r["length"]), "length_ci95": list(bootstrap_ci(r["length"])),
                   "accuracy": sum(r["correct"]) / len(r["correct"]), "n": len(r["length"]),
                   "accuracy_by_family": {f: sum(c for c, ff in zip(r["correct"], r["family"]) if ff == f)
                                          / r["family"].count(f) for f in fams},
                   "length_by_family": {f: sum(x for x, ff in zip(r["length"], r["family"]) if ff == f)
                                        / r["family"].count(f) for f in fams}}
    return rows


def adjacent(rows: dict) -> list[dict]:
    """Consecutive levels: the rise of the mean and whether the upper interval lies entirely above the lower."""
    lv = sorted(rows)
    out = []
    for lo, hi in zip(lv, lv[1:]):
        a, b = rows[lo], rows[hi]
        out.append({"from": lo, "to": hi, "rise": b["mean_length"] - a["mean_length"],
                    "increasing": b["mean_length"] > a["mean_length"],
                    "apart": b["length_ci95"][0] > a["length_ci95"][1]})
    return out


def fits(res: dict) -> dict:
    """Per difficulty n: the affine fit of the level means of the length on b."""
    lv = sorted(res)
    out = {}
    for d in sorted(set(res[lv[0]]["difficulty"])):
        means = []
        for b in lv:
            ls = [x for x, dd in zip(res[b]["length"], res[b]["difficulty"]) if dd == d]
            means.append(sum(ls) / len(ls))
        f = affine_fit(lv, means)
        out[d] = {"slope": f["slope"], "r2": f["r2"], "flat": f["flat"], "means": [round(m, 3) for m in means]}
    return out


def fit_text(d, f: dict) -> str:
    """One fit as printed (a fit whose level means are all equal is "flat": its R^2 is 1 by convention)."""
    return f"n={d} {f['slope']:+.3f} " + ("flat" if f["flat"] else f"R2 {f['r2']:.2f}")


def describe(name: str, res: dict) -> dict:
    rows = levels_table(res)
    adj = adjacent(rows)
    fam = sorted(set(res[min(res)]["family"]))
    rep = {"levels": rows, "adjacent": adj, "up": sum(a["increasing"] for a in adj),
           "apart": sum(a["apart"] for a in adj), "fit_by_difficulty": fits(res),
           "fit_by_family_difficulty": {f: fits(subset(res, lambda i, ff, f=f: ff == f)) for f in fam},
           "mean_accuracy": sum(r["accuracy"] for r in rows.values()) / len(rows)}
    print(f"{name}:")
    for b, r in rows.items():
        print(f"  b={b:3d} len {r['mean_length']:6.2f} [{r['length_ci95'][0]:.2f}, {r['length_ci95'][1]:.2f}] acc "
              f"{r['accuracy']:.3f} " + " ".join(f"{f} acc {r['accuracy_by_family'][f]:.3f} len "
                                                 f"{r['length_by_family'][f]:.2f}" for f in fam) + f" n {r['n']}")
    print(f"  adjacent: {rep['up']}/{len(adj)} up, {rep['apart']}/{len(adj)} apart; rises "
          + " ".join(f"{a['from']}->{a['to']} {a['rise']:+.2f}{'*' if a['apart'] else ''}" for a in adj))
    print("  fit per n (both families): " + "; ".join(fit_text(d, f)
                                                   for d, f in rep["fit_by_difficulty"].items()))
    for f, ff in rep["fit_by_family_difficulty"].items():
        print(f"  fit per n ({f}): " + "; ".join(fit_text(d, x) for d, x in ff.items()))
    print(f"  mean accuracy {rep['mean_accuracy']:.4f}")
    return rep


def paired(res: dict, base: dict, k: int) -> dict:
    """Sign tests of accuracy, checkpoint vs baseline, on the first k problems (both must hold the same ones)."""
    lv = sorted(res)
    out = {}
    for fam in (None, "sums", "chase"):
        keep = lambda i, f: i < k and (fam is None or f == fam)  # noqa: E731
        r, bb = subset(res, keep), subset(base, keep)
        flat = lambda x: [c for b in lv for c in x[b]["correct"]]  # noqa: E731
        m = len(r[lv[0]]["correct"])
        per = lambda x: [sum(x[b]["correct"][i] for b in lv) for i in range(m)]  # noqa: E731
        name = fam or "all"
        out[name] = {"checkpoint": sum(flat(r)) / len(flat(r)), "baseline": sum(flat(bb)) / len(flat(bb)),
                     "pairs": sign_test(flat(bb), flat(r)), "per_problem": sign_test(per(bb), per(r))}
        t, u = out[name]["pairs"], out[name]["per_problem"]
        print(f"paired ({name}, first {k}): {out[name]['checkpoint']:.4f} vs {out[name]['baseline']:.4f}; pairs "
              f"{t['improved']}/{t['worsened']} p {t['p_one_sided']:.3g}; per problem {u['improved']}/"
              f"{u['worsened']} p {u['p_one_sided']:.3g}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--base-raw")
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--out")
    a = ap.parse_args()
    key, res = load_raw(a.raw)
    n = len(res[min(res)]["length"])
    out = {"raw": a.raw, "problems": n, "all": describe(f"{a.raw}: all {n} problems per level", res)}
    if a.prefix and a.prefix < n:
        out[f"first{a.prefix}"] = describe(f"first {a.prefix}", subset(res, lambda i, f: i < a.prefix))
    if a.base_raw:
        bkey, base = load_raw(a.base_raw)
        bn = len(base[min(base)]["length"])
        k = min(n, bn)
        # the shared prefix must be the same problems, at the same levels, temperature and constraint
        if key["problems"][:k] != bkey["problems"][:k] or any(key.get(x) != bkey.get(x) for x in
                                                            ("levels", "temperature", "constrain")):
            raise SystemExit("the two evaluations do not share their first problems / levels / decoding")
        out["baseline"] = {"raw": a.base_raw, "problems": bn, **describe(f"baseline {a.base_raw}", base)}
        out["paired"] = {"problems": k, **paired(res, base, k)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
