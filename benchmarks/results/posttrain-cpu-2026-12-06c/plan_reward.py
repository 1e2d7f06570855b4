"""Expected RL reward of each plan letter, per (family, difficulty) and effort level, from a checkpoint's own
samples: for training problems of every (family, n), the reasoning opening (the right band letter, then the plan
letter S / M / L) is forced into the prompt and the rest sampled at T = 1 (as RL samples); the measured accuracy
and mean reasoning length (the head's two tokens included, as RL's length term counts them) per (family, n, plan)
give E[reward | plan, b] = acc - min(C_max, k(b) len / L_norm) for a length term. Printed: the optimal plan per
(family, n) at each evaluation level, the population's optimal mean length per level (families even, n uniform,
as RL draws them) and the threshold levels b* where a cell's optimum changes; with --scan, the (k0, lambda, C_max)
grid ranked by how many adjacent evaluation levels the optimum's mean length strictly increases between.

python plan_reward.py CKPT [--problems 24] [--k0 4 --lam 1.6 --cmax 1 --delta-b 24.75] [--scan] [--out x.json]
"""

import gzip
import argparse
import itertools
import json
import random

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rl import LengthReward
from dsv41.posttrain.rollout import make_engine, sampling
from dsv41.posttrain.sft import TaskMix
_open = lambda p: gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)  # large results are gzipped

EVAL_LEVELS = (1, 12, 25, 37, 50, 62, 75, 87, 100)


@torch.no_grad()
def measure(ckpt: str, problems: int, seed: int = 0) -> dict:
    """{(family, n, plan): (accuracy, mean reasoning tokens)} from forced-head samples at T = 1."""
    model, tok, _ = load(ckpt)
    model.eval()
    eng = make_engine(model, tok, max_batch=64)
    rng = random.Random(f"plan-reward:{seed}")
    levels = [b for b in range(1, 101) if b not in (12, 37, 62, 87)]
    items = []
    for fam in T.FAMILIES:
        for n in range(2, 7):
            for _ in range(problems):
                p = T.sample_problem(rng, fam, n, n)
                b = rng.choice(levels)
                for plan in T.PLANS:
                    head = [tok.tok.token_to_id(T.effort_band(b)), tok.tok.token_to_id(plan)]
                    rid = eng.add_request(T.prompt_ids(tok, p, b) + head,
                                          sampling(T.MAX_TOKENS - 2, rng.randrange(2 ** 31), 1.0))
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


def optimum(cells: dict, length: LengthReward, levels=EVAL_LEVELS) -> dict:
    """Per level: the optimal plan of every (family, n) and the population's mean length under the optima."""
    keys = sorted({(f, n) for f, n, _ in cells})
    out = {}
    for b in levels:
        best = {}
        for f, n in keys:
            r = {pl: cells[(f, n, pl)][0] + length(cells[(f, n, pl)][1], b) for pl in T.PLANS}
            best[f"{f}{n}"] = max(r, key=r.get)
        mean_len = sum(cells[(f, n, best[f"{f}{n}"])][1] for f, n in keys) / len(keys)
        out[b] = {"best": best, "mean_length": mean_len}
    return out


def increases(opt: dict) -> int:
    ls = [opt[b]["mean_length"] for b in sorted(opt)]
    return sum(b > a + 1e-9 for a, b in zip(ls, ls[1:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--k0", type=float, default=4.0)
    ap.add_argument("--lam", type=float, default=1.6)
    ap.add_argument("--cmax", type=float, default=1.0)
    ap.add_argument("--delta-b", type=float, default=24.75)
    ap.add_argument("--scan", action="store_true")
    ap.add_argument("--cells", help="read the measured cells from this json (a previous --out) instead of sampling")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.cells:
        cells = {tuple(k.split("|")[:1] + [int(k.split("|")[1]), k.split("|")[2]]): tuple(v)
                 for k, v in json.load(_open(a.cells))["cells"].items()}
    else:
        cells = measure(a.ckpt, a.problems)
    print("accuracy / mean reasoning tokens per (family, n) and plan (forced head, T = 1):")
    for f in T.FAMILIES:
        for n in range(2, 7):
            print(f"  {f:5s} n={n}: " + "  ".join(f"{pl} {cells[(f, n, pl)][0]:.2f}/{cells[(f, n, pl)][1]:5.1f}"
                                               for pl in T.PLANS))
    lv = tuple(b for b in range(1, 101) if b not in (12, 37, 62, 87))
    res = {"cells": {f"{f}|{n}|{pl}": v for (f, n, pl), v in cells.items()}}
    chosen = LengthReward(k0=a.k0, lam=a.lam, c_max=a.cmax, levels=lv, delta_b=a.delta_b)
    opt = optimum(cells, chosen)
    print(f"k0 {a.k0} lambda {a.lam} C_max {a.cmax} delta_b {a.delta_b}: optimal plan per cell and mean length")
    for b, o in opt.items():
        print(f"  b={b:3d} len {o['mean_length']:5.2f}  " + " ".join(f"{k}:{v}" for k, v in o["best"].items()))
    print(f"  adjacent evaluation levels with a strictly larger optimal mean length: {increases(opt)} / 8")
    res["chosen"] = {"k0": a.k0, "lam": a.lam, "cmax": a.cmax, "delta_b": a.delta_b,
                     "optimum": {str(b): o for b, o in opt.items()}, "increases": increases(opt)}
    if a.scan:
        rows = []
        for k0, lam, cmax in itertools.product((1, 2, 3, 4, 6, 8, 12), (0.8, 1.0, 1.2, 1.6, 2.0, 2.5, 3.0),
                                               (1.0, 1.5, 2.0, 3.0)):
            o = optimum(cells, LengthReward(k0=k0, lam=lam, c_max=cmax, levels=lv, delta_b=a.delta_b))
            ls = [o[b]["mean_length"] for b in EVAL_LEVELS]
            rows.append({"k0": k0, "lam": lam, "cmax": cmax, "increases": increases(o), "lengths": ls,
                         "range": ls[-1] - ls[0]})
        rows.sort(key=lambda r: (-r["increases"], -r["range"]))
        print("scan (best first): k0 lambda C_max | increases | optimal mean length at the evaluation levels")
        for r in rows[:15]:
            print(f"  {r['k0']:4g} {r['lam']:4g} {r['cmax']:4g} | {r['increases']} | "
                  + " ".join(f"{x:.1f}" for x in r["lengths"]))
        res["scan"] = rows
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
