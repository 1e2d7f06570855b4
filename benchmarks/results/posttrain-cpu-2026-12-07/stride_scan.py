"""Accuracy and reasoning length per (family, n, stride) of a checkpoint under the decoding constraint
(dsv41/posttrain/constrain.py): the head `<band><n><letter>` is forced, then the trace of stride j with its states
left to the model, `</think>`, the answer, EOS; sampled at T = 1 (as RL samples) or greedy. The letter is the
plan letter written before the trace: --carrier picks it per stride ("sml": S for stride n, L for stride 1, M for
the others, the SFT head's letters; "strides": the "strides" plan set's own letter; or one fixed letter for all).
Reasoning tokens count the 3 head tokens (as the RL length term does).

python stride_scan.py CKPT [--problems 32] [--families sums] [--carrier sml|strides|M|L] [--greedy] [--out x.json]
"""

import argparse
import json
import random
import time

import torch

from dsv41.posttrain import constrain as C
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import make_engine, rollouts

TRAIN_LEVELS = tuple(b for b in range(1, 101) if b not in (12, 37, 62, 87))


def carrier_letter(carrier: str, n: int, j: int) -> str:
    if carrier == "sml":
        return "S" if j == n else ("L" if j == 1 else "M")
    if carrier == "strides":
        return "S" if j == n else C.STRIDE_LETTERS[j - 1]
    return carrier


def forced(tok, p, b, letter, j):
    """A Grammar whose plan position allows only `letter` and whose trace after it is stride j's."""
    g = C.Grammar(tok, p, b, "sml")
    cid = tok.tok.token_to_id(letter)
    holes = [tok.tok.token_to_id(c) for c in C.STATE_CHARS[p.family]]
    g.head[2] = [cid]
    g.tails = {cid: [holes if s is C.HOLE else [tok.tok.token_to_id(s)] for s in C.template(p, j)]
               + [[tok.think_end_id], holes, [tok.eos_id]]}
    return g


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--families", default="sums")
    ap.add_argument("--carrier", default="sml")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    model, tok, _ = load(a.ckpt)
    eng = make_engine(model, tok, max_batch=128)
    rng = random.Random("stride-scan:0")
    items, keys = [], []
    for fam in a.families.split(","):
        for n in range(2, 7):
            for _ in range(a.problems):
                p = T.sample_problem(rng, fam, n, n)
                b = rng.choice(TRAIN_LEVELS)
                for j in range(1, n + 1):
                    items.append((p, b, None if a.greedy else rng.randrange(2 ** 31)))
                    keys.append((fam, n, j, carrier_letter(a.carrier, n, j)))
    # rollouts takes (problem, b) -> Grammar: one call per stride, so (problem, b) names one forced grammar
    cells = {}
    for j in range(1, 7):
        idx = [i for i, k in enumerate(keys) if k[2] == j]
        if not idx:
            continue
        sub = [items[i] for i in idx]
        lookup = {(items[i][0].content, items[i][1]): forced(tok, items[i][0], items[i][1], keys[i][3], j)
                  for i in idx}
        rs = rollouts(eng, tok, sub, T.MAX_TOKENS, temperature=0.0 if a.greedy else 1.0,
                      grammar=lambda p, b: lookup[(p.content, b)], masked_lp=False)
        for i, r in zip(idx, rs):
            cells.setdefault(keys[i], []).append((int(r.verdict.correct), r.verdict.reasoning_tokens))
    out = {}
    for (fam, n, j, letter), v in sorted(cells.items()):
        acc, ln = sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v)
        out[f"{fam}|{n}|{j}"] = {"letter": letter, "accuracy": acc, "length": ln, "count": len(v)}
        print(f"{fam:5s} n={n} stride {j} ({letter}): acc {acc:.2f} len {ln:5.1f} ({len(v)})")
    print(f"{time.time() - t0:.0f}s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ckpt": a.ckpt, "carrier": a.carrier, "greedy": a.greedy, "cells": out}, f, indent=1)


if __name__ == "__main__":
    main()
