"""The RL reward's optimum per (n, b) from a stride scan (stride_scan.py's cells: sums accuracy and reasoning
tokens per (n, stride) under the plan grammar), for a plan set: per evaluation level the optimal plan of every n,
the population's mean length under the optima (n uniform in 2..6), the number of adjacent evaluation levels whose
optimal mean length rises by >= --gap tokens, and each n's switching level b*(n) (where the best plan changes).
--scan ranks (k0, lambda) by how evenly the switching levels spread over 1..100 (the largest gap between
consecutive switching levels, the ends 1 and 100 included). --alpha: also the optimum of the entropy-regularised
objective E[r] + alpha H(plan), the Boltzmann policy P(c | b, n) ~ exp(E[r | c, b, n] / alpha): its expected
length and accuracy per evaluation level (a sampled evaluation of that policy).

python optimum.py CELLS.json [--plans sml|strides] [--k0 2.4 --lam 2.75 --cmax 2] [--scan]
"""

import argparse
import itertools
import math
import json

from dsv41.posttrain import constrain as C
from dsv41.posttrain.rl import LengthReward

EVAL_LEVELS = (1, 12, 25, 37, 50, 62, 75, 87, 100)
TRAIN_LEVELS = tuple(b for b in range(1, 101) if b not in (12, 37, 62, 87))


def plan_cells(cells: dict, plans: str, fam: str = "sums") -> dict:
    """{n: {letter: (accuracy, length)}} for the plan set's letters valid at n."""
    out = {}
    for n in range(2, 7):
        out[n] = {}
        for c in C.plan_letters(plans, n):
            v = cells[f"{fam}|{n}|{C.stride_of(plans, c, n)}"]
            out[n][c] = (v["accuracy"], v["length"])
    return out


def best(pc: dict, length: LengthReward, b: int) -> dict:
    return {n: max(ps, key=lambda c: ps[c][0] + length(ps[c][1], b)) for n, ps in pc.items()}


def switches(pc: dict, length: LengthReward) -> dict:
    """{n: [levels 1..100 where the optimal plan differs from the one at the level below]}."""
    out = {n: [] for n in pc}
    prev = best(pc, length, 1)
    for b in range(2, 101):
        cur = best(pc, length, b)
        for n in pc:
            if pc[n][cur[n]][1] != pc[n][prev[n]][1]:
                out[n].append(b)
        prev = cur
    return out


def boltzmann(pc: dict, length: LengthReward, alpha: float) -> tuple[list[float], list[float]]:
    """Expected length and accuracy per evaluation level (n uniform) of P(c | b, n) ~ exp(E[r | c, b, n] / alpha)."""
    ls, accs = [], []
    for b in EVAL_LEVELS:
        el = ea = 0.0
        for n, ps in pc.items():
            r = {c: acc + length(ln, b) for c, (acc, ln) in ps.items()}
            m = max(r.values())
            w = {c: math.exp((x - m) / alpha) for c, x in r.items()}
            z = sum(w.values())
            el += sum(w[c] / z * ps[c][1] for c in ps) / len(pc)
            ea += sum(w[c] / z * ps[c][0] for c in ps) / len(pc)
        ls.append(el)
        accs.append(ea)
    return ls, accs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cells")
    ap.add_argument("--plans", default="sml")
    ap.add_argument("--k0", type=float, default=2.4)
    ap.add_argument("--lam", type=float, default=2.75)
    ap.add_argument("--cmax", type=float, default=2.0)
    ap.add_argument("--delta-b", type=float, default=24.75)
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--scan-grid", action="store_true", dest="scan")
    ap.add_argument("--alpha", type=float, action="append", default=[])
    ap.add_argument("--alpha-scan", type=float, metavar="MIN_ACC",
                    help="scan (k0, lambda, alpha) for Boltzmann policies with mean accuracy >= MIN_ACC, ranked by "
                         "their smallest adjacent rise of the expected length")
    a = ap.parse_args()
    pc = plan_cells(json.load(open(a.cells))["cells"], a.plans)
    for n, ps in pc.items():
        print(f"n={n}: " + "  ".join(f"{c} {acc:.2f}/{ln:4.1f}" for c, (acc, ln) in ps.items()))
    L = LengthReward(k0=a.k0, lam=a.lam, c_max=a.cmax, levels=TRAIN_LEVELS, delta_b=a.delta_b)
    means = []
    for b in EVAL_LEVELS:
        o = best(pc, L, b)
        m = sum(pc[n][o[n]][1] for n in pc) / len(pc)
        acc = sum(pc[n][o[n]][0] for n in pc) / len(pc)
        means.append(m)
        print(f"b={b:3d}: mean length {m:5.1f} accuracy {acc:.2f}  " + " ".join(f"n{n}:{c}" for n, c in o.items()))
    d = [y - x for x, y in zip(means, means[1:])]
    print(f"k0 {a.k0} lambda {a.lam} C_max {a.cmax}: rises >= {a.gap}: {sum(x >= a.gap for x in d)} / 8; "
          f"switching levels {switches(pc, L)}")
    for alpha in a.alpha:
        ls, accs = boltzmann(pc, LengthReward(k0=a.k0, lam=a.lam, c_max=a.cmax, levels=TRAIN_LEVELS,
                                              delta_b=a.delta_b), alpha)
        d = [y - x for x, y in zip(ls, ls[1:])]
        print(f"alpha {alpha}: E[len] " + " ".join(f"{x:.1f}" for x in ls) + f"; smallest rise {min(d):.2f}; "
              f"accuracy " + " ".join(f"{x:.2f}" for x in accs) + f" (mean {sum(accs) / len(accs):.3f})")
    if a.alpha_scan is not None:
        rows = []
        for k0, lam, alpha in itertools.product([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4], [2.5, 3, 3.5, 4, 5, 6],
                                                [0.08, 0.1, 0.12, 0.15]):
            ls, accs = boltzmann(pc, LengthReward(k0=k0, lam=lam, c_max=a.cmax, levels=TRAIN_LEVELS,
                                                  delta_b=a.delta_b), alpha)
            if sum(accs) / len(accs) >= a.alpha_scan:
                rows.append((min(y - x for x, y in zip(ls, ls[1:])), sum(accs) / len(accs), k0, lam, alpha, ls))
        for r in sorted(rows, key=lambda r: (-r[0], -r[1]))[:8]:
            print(f"  smallest rise {r[0]:.2f} accuracy {r[1]:.3f}: k0 {r[2]} lambda {r[3]} alpha {r[4]}  E[len] "
                  + " ".join(f"{x:.1f}" for x in r[5]))
    if a.scan:
        rows = []
        for k0, lam in itertools.product([x / 10 for x in range(10, 61, 2)], [x / 4 for x in range(4, 25)]):
            L = LengthReward(k0=k0, lam=lam, c_max=a.cmax, levels=TRAIN_LEVELS, delta_b=a.delta_b)
            sw = sorted(b for v in switches(pc, L).values() for b in v)
            pts = [1] + sw + [100]
            rows.append((max(y - x for x, y in zip(pts, pts[1:])), k0, lam, sw))
        rows.sort()
        for r in rows[:8]:
            print(f"  largest gap {r[0]:3d}: k0 {r[1]} lambda {r[2]} switches {r[3]}")


if __name__ == "__main__":
    main()
