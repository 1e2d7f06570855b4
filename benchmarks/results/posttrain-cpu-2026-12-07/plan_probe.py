"""The policy's plan distribution under the plan grammar, exactly (no sampling): for held-out problems of each
(family, n) at each evaluation level, the prompt + the forced head (band letter, n digit) is scored and the plan
position's softmax restricted to the plan set's letters valid at n (the distribution the engine samples the plan
from under the constraint). Printed per level: P(letter) per n, and the expected reasoning length E[l | b] =
sum_n sum_letter P(letter | b, n) l(n, letter) / 5 (l: the grammar's exact response length, head included).

python plan_probe.py CKPT [--problems 20] [--plans sml] [--families sums] [--out x.json]
"""

import argparse
import json
import random

import torch

from dsv41.posttrain import constrain as C
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load

EVAL_LEVELS = (1, 12, 25, 37, 50, 62, 75, 87, 100)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--plans", default="sml")
    ap.add_argument("--families", default="sums")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load(a.ckpt)
    model.eval()
    rng = random.Random("plan-probe:0")
    out = {}
    for fam in a.families.split(","):
        probs = {n: [T.sample_problem(rng, fam, n, n, split="held_out") for _ in range(a.problems)] for n in range(2, 7)}
        for b in EVAL_LEVELS:
            row, exp_len = {}, 0.0
            for n, ps in probs.items():
                letters = C.plan_letters(a.plans, n)
                lids = [tok.tok.token_to_id(c) for c in letters]
                seqs = [T.prompt_ids(tok, p, b) + [tok.tok.token_to_id(c) for c in T.effort_band(b, True) + str(n)]
                        for p in ps]
                L = max(map(len, seqs))
                ids = torch.tensor([s + [tok.pad_id] * (L - len(s)) for s in seqs])
                from dsv41.train.qat import sequence_forward
                from dsv41.model.step import ForwardOptions
                logits = sequence_forward(model, ids, ForwardOptions()).logits.float()
                last = torch.stack([logits[i, len(s) - 1, lids] for i, s in enumerate(seqs)])
                pr = torch.softmax(last, -1)                          # per problem
                lens = torch.tensor([[float(C.response_length(p, C.stride_of(a.plans, c, n))) for c in letters]
                                     for p in ps])
                mean_p = pr.mean(0)
                row[n] = {c: round(float(x), 4) for c, x in zip(letters, mean_p)}
                row[n]["E_len"] = round(float((pr * lens).sum(1).mean()), 3)
                exp_len += row[n]["E_len"] / len(probs)
            out[f"{fam}|{b}"] = {"per_n": row, "expected_length": round(exp_len, 3)}
            print(f"{fam} b={b:3d} E[len] {exp_len:5.2f}  " + "  ".join(
                f"n{n}:" + "/".join(f"{c}{v:.2f}" for c, v in r.items() if c != "E_len") for n, r in row.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ckpt": a.ckpt, "plans": a.plans, "cells": out}, f, indent=1)


if __name__ == "__main__":
    main()
