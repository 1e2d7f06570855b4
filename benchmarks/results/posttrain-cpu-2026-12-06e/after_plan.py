"""Does the plan letter still fix the length? Sampled (T = 1) responses to held-out problems at a few levels,
grouped by the plan letter they opened with and the chain length n: count, mean reasoning tokens (head included)
and accuracy. After SFT, S is the empty trace (3 tokens with the (b, n) head); a policy that writes S and then a
trace anyway has moved the length decision past the plan letter.

python after_plan.py CKPT [--problems 100] [--levels 1,50,100] [--families sums] [--out x.json]
"""

import argparse
import json

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import held_out_problems, make_engine, rollouts
from dsv41.posttrain.sft import TaskMix


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--levels", default="1,50,100")
    ap.add_argument("--families", default="sums")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load(a.ckpt)
    model.eval()
    eng = make_engine(model, tok, max_batch=128)
    problems = held_out_problems(TaskMix(families=tuple(a.families.split(","))), a.problems)
    out = {}
    for b in (int(x) for x in a.levels.split(",")):
        rs = rollouts(eng, tok, [(p, b, 1000 + i) for i, p in enumerate(problems)], T.MAX_TOKENS, temperature=1.0)
        cells: dict = {}
        for r in rs:
            key = f"{T.opened_plan(tok, r.output_ids) or '-'}{r.problem.difficulty}"
            cells.setdefault(key, []).append((r.verdict.reasoning_tokens, int(r.verdict.correct)))
        out[b] = {k: {"n": len(v), "length": sum(x for x, _ in v) / len(v), "accuracy": sum(c for _, c in v) / len(v)}
                  for k, v in sorted(cells.items())}
        print(f"b={b:3d} " + " ".join(f"{k}:{c['n']}/{c['length']:.1f}/{c['accuracy']:.2f}" for k, c in out[b].items()))
    if a.out:
        open(a.out, "w").write(json.dumps({"checkpoint": a.ckpt, "problems": a.problems, "levels": out}, indent=1)
                               + "\n")


if __name__ == "__main__":
    main()
