"""How much does the effort level change the policy? For held-out problems, the next-token distributions along the
full (stride 1) response are computed with the prompt at b = 1 and at b = 100 (teacher-forced, the reference
forward with quantization, as RL scores), and compared position by position: mean total-variation distance, the
largest one, and the same at the first response token (where the empty trace is chosen) alone.

python b_sensitivity.py CKPT [CKPT ...] [--problems 100] [--levels 1,100] [--out x.json]
"""

import argparse
import json

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import held_out_problems
from dsv41.posttrain.sft import TaskMix
from dsv41.train.logprobs import token_logprobs  # noqa: F401  (the same forward family as RL)
from dsv41.train.fast import fast_forward
from dsv41.train.qat import TrainCache
from dsv41.model.step import ForwardOptions


@torch.no_grad()
def dists(model, tok, problems, b):
    out = []
    for p in problems:
        pr, resp = T.prompt_ids(tok, p, b), T.response_ids(tok, p, 1)
        ids = torch.tensor([pr + resp[:-1]])
        logits = fast_forward(model, ids, TrainCache(model.cfg, 1, model.dtype, ids.device), ForwardOptions())
        out.append(torch.softmax(logits[0, len(pr) - 1:].float(), -1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--levels", default="1,100")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lo, hi = (int(x) for x in a.levels.split(","))
    problems = held_out_problems(TaskMix(), a.problems)
    res = {}
    for c in a.ckpts:
        model, tok, _ = load(c)
        model.eval()
        d_lo, d_hi = dists(model, tok, problems, lo), dists(model, tok, problems, hi)
        tv = [0.5 * (x - y).abs().sum(-1) for x, y in zip(d_lo, d_hi)]
        allp = torch.cat(tv)
        first = torch.stack([t[0] for t in tv])
        end = tok.think_end_id
        p_empty = [(x[0, end].item(), y[0, end].item()) for x, y in zip(d_lo, d_hi)]
        res[c] = {"tv_mean": float(allp.mean()), "tv_max": float(allp.max()), "tv_first_mean": float(first.mean()),
                  "tv_first_max": float(first.max()),
                  "p_empty_first_mean": [sum(p[0] for p in p_empty) / len(p_empty),
                                         sum(p[1] for p in p_empty) / len(p_empty)]}
        print(c, json.dumps(res[c]))
    if a.out:
        open(a.out, "w").write(json.dumps({"levels": [lo, hi], "problems": a.problems, "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
