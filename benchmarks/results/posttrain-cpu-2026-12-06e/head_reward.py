"""Expected RL reward of each plan letter per (family, n) and level, for the second head form (band letter with
b = 100 -> J, size digit, plan letter): for training problems of every (family, n) the head is forced into the
prompt and the rest sampled at T = 1, as RL samples; accuracy and mean reasoning tokens (the head's three tokens
included, as RL's length term counts them) per (family, n, plan) give E[r | plan, b] = acc - min(C_max, k(b) len /
L_norm). Printed: the cells, the optimal plan per (family, n) at the evaluation levels and the population's
optimal mean length (n uniform; --families picks the families averaged, RL's: sums), and with --scan the
(k0, lambda, C_max) grid ranked by how many adjacent evaluation levels the optimal mean length rises between by
at least --gap tokens (a step a 95% interval of ~200-500 samples can resolve), then by the smallest such rise.

python head_reward.py CKPT [--problems 24] [--k0 .. --lam .. --cmax ..] [--scan] [--cells x.json] [--out x.json]
"""

import argparse
import gzip
import itertools
import json
import random

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rl import LengthReward
from dsv41.posttrain.rollout import make_engine, sampling

EVAL_LEVELS = (1, 12, 25, 37, 50, 62, 75, 87, 100)
TRAIN_LEVELS = tuple(b for b in range(1, 101) if b not in (12, 37, 62, 87))


@torch.no_grad()
def measure(ckpt: str, problems: int, seed: int = 0) -> dict:
    """{(family, n, plan): (accuracy, mean reasoning tokens)} from forced-head samples at T = 1."""
    model, tok, _ = load(ckpt)
    model.eval()
    eng = make_engine(model, tok, max_batch=64)
    rng = random.Random(f"head-reward:{seed}")
    items = []
    for fam in T.FAMILIES:
        for n in range(2, 7):
            for _ in range(problems):
                p = T.sample_problem(rng, fam, n, n)
                b = rng.choice(TRAIN_LEVELS)
                for plan in T.PLANS:
                    head = [tok.tok.token_to_id(c) for c in T.plan_head(b, plan, True, n, merge_top=True)]
                    rid = eng.add_request(T.prompt_ids(tok, p, b) + head,
                                          sampling(T.MAX_TOKENS - len(head), rng.randrange(2 ** 31), 1.0))
                    items.append((fam, n, plan, p, head, rid))
    while eng.has_unfinished():
        eng.step()
    cells: dict = {}
    for fam, n, plan, p, head, rid in items:
        c = eng.completion(rid)
        ids = head + c.output_ids + ([tok.eos_id] if c.finish_reason == "stop" else [])
        v = T.check(tok, p, ids)
        cells.setdefault((fam, n, plan), []).append((int(v.correct), v.reasoning_tokens))
    return {k: (sum(a for a, _ in v) / len(v), sum(l_ for _, l_ in v) / len(v)) for k, v in cells.items()}


def optimum(cells: dict, length: LengthReward, families, levels=EVAL_LEVELS) -> dict:
    """Per level: the optimal plan of every (family, n) of `families` and the mean length under the optima."""
    keys = sorted({(f, n) for f, n, _ in cells if f in families})
    out = {}
    for b in levels:
        best = {}
        for f, n in keys:
            r = {pl: cells[(f, n, pl)][0] + length(cells[(f, n, pl)][1], b) for pl in T.PLANS}
            best[f"{f}{n}"] = max(r, key=r.get)
        out[b] = {"best": best, "mean_length": sum(cells[(f, n, best[f"{f}{n}"])][1] for f, n in keys) / len(keys),
                  "accuracy": sum(cells[(f, n, best[f"{f}{n}"])][0] for f, n in keys) / len(keys)}
    return out


def rises(opt: dict, gap: float) -> tuple[int, float]:
    ls = [opt[b]["mean_length"] for b in sorted(opt)]
    d = [y - x for x, y in zip(ls, ls[1:])]
    return sum(x >= gap for x in d), min(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--k0", type=float, default=2.3)
    ap.add_argument("--lam", type=float, default=2.0)
    ap.add_argument("--cmax", type=float, default=2.0)
    ap.add_argument("--delta-b", type=float, default=24.75)
    ap.add_argument("--families", default="sums")
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--scan", action="store_true")
    ap.add_argument("--cells", help="read the cells from a previous --out instead of sampling")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    fams = tuple(a.families.split(","))
    if a.cells:
        cells = {(k.split("|")[0], int(k.split("|")[1]), k.split("|")[2]): tuple(v)
                 for k, v in json.load(gzip.open(a.cells, "rt") if a.cells.endswith(".gz") else open(a.cells))
                 ["cells"].items()}
    else:
        cells = measure(a.ckpt, a.problems)
    print("accuracy / mean reasoning tokens per (family, n) and plan (forced head, T = 1):")
    for f in T.FAMILIES:
        for n in range(2, 7):
            print(f"  {f:5s} n={n}: " + "  ".join(f"{pl} {cells[(f, n, pl)][0]:.2f}/{cells[(f, n, pl)][1]:5.1f}"
                                               for pl in T.PLANS))
    res = {"cells": {f"{f}|{n}|{pl}": v for (f, n, pl), v in cells.items()}, "families": fams}
    chosen = LengthReward(k0=a.k0, lam=a.lam, c_max=a.cmax, levels=TRAIN_LEVELS, delta_b=a.delta_b)
    opt = optimum(cells, chosen, fams)
    print(f"k0 {a.k0} lambda {a.lam} C_max {a.cmax} delta_b {a.delta_b} ({','.join(fams)}): optimum per level")
    for b, o in opt.items():
        print(f"  b={b:3d} len {o['mean_length']:5.2f} acc {o['accuracy']:.2f}  "
              + " ".join(f"{k}:{v}" for k, v in o["best"].items()))
    k, m = rises(opt, a.gap)
    print(f"  adjacent evaluation levels rising by >= {a.gap} tokens: {k} / 8 (smallest rise {m:.2f})")
    res["chosen"] = {"k0": a.k0, "lam": a.lam, "cmax": a.cmax, "delta_b": a.delta_b, "rises": k,
                     "optimum": {str(b): o for b, o in opt.items()}}
    if a.scan:
        rows = []
        for k0, lam, cmax in itertools.product((1, 1.5, 2, 2.5, 3, 4, 6, 8), (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
                                               (1.0, 1.5, 2.0, 3.0)):
            o = optimum(cells, LengthReward(k0=k0, lam=lam, c_max=cmax, levels=TRAIN_LEVELS, delta_b=a.delta_b),
                        fams)
            k, m = rises(o, a.gap)
            rows.append({"k0": k0, "lam": lam, "cmax": cmax, "rises": k, "smallest": m,
                         "lengths": [o[b]["mean_length"] for b in EVAL_LEVELS],
                         "accuracy": [o[b]["accuracy"] for b in EVAL_LEVELS]})
        rows.sort(key=lambda r: (-r["rises"], -r["smallest"]))
        print("scan (best first): k0 lambda C_max | rises | optimal mean length / accuracy at the evaluation levels")
        for r in rows[:15]:
            print(f"  {r['k0']:4g} {r['lam']:4g} {r['cmax']:4g} | {r['rises']} | "
                  + " ".join(f"{x:.1f}" for x in r["lengths"]) + " | " + " ".join(f"{x:.2f}" for x in r["accuracy"]))
        res["scan"] = rows
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
