"""Does the policy read b where the length is decided? For held-out problems at each level b, one teacher-forced
forward of the prompt + the reasoning's opening gives (1) the first response token's distribution: the share of
its mass on the right band letter (the echo), and (2) at the position after the echo (the right band letter fed
in), the distribution over the plan letters S / M / L. Printed per level: mean P(echo right), P(S), P(M), P(L),
and the expected reasoning length under the plan distribution (each plan's full-length response, + the head),
and the (normalised) plan shares S/M/L per family.
The total-variation distance of the plan distributions at b = 1 and b = 100 is the number to compare with the
first-token TV of 2026-12-06b's b_sensitivity.py.

python plan_probe.py CKPT [CKPT ...] [--problems 60] [--levels 1,12,...] [--out x.json]
"""

import argparse
import json

import torch

from dsv41.model.step import ForwardOptions
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import held_out_problems
from dsv41.posttrain.sft import TaskMix
from dsv41.train.fast import fast_forward
from dsv41.train.qat import TrainCache


@torch.no_grad()
def probe(model, tok, problems, b):
    band = tok.tok.token_to_id(T.effort_band(b))
    plans = [tok.tok.token_to_id(c) for c in T.PLANS]
    rows, starts = [], []
    for p in problems:
        pr = T.prompt_ids(tok, p, b)
        rows.append(pr + [band])
        starts.append(len(pr) - 1)
    L = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (L - len(r)) for r in rows])
    logits = fast_forward(model, ids, TrainCache(model.cfg, ids.size(0), model.dtype, ids.device), ForwardOptions())
    pr = torch.softmax(logits.float(), -1)
    echo = torch.stack([pr[i, s, band] for i, s in enumerate(starts)])
    plan = torch.stack([pr[i, s + 1, plans] for i, s in enumerate(starts)])
    lens = torch.tensor([[len(T.response_ids(tok, p, T.plan_stride(p, c), "xx")) - 3 for c in T.PLANS]
                         for p in problems], dtype=torch.float32)      # reasoning tokens of each plan
    return echo, plan, lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--problems", type=int, default=60)
    ap.add_argument("--levels", default="1,12,25,37,50,62,75,87,100")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    levels = [int(x) for x in a.levels.split(",")]
    problems = held_out_problems(TaskMix(), a.problems)
    res = {}
    for c in a.ckpts:
        model, tok, _ = load(c)
        model.eval()
        per, plans = {}, {}
        for b in levels:
            echo, plan, lens = probe(model, tok, problems, b)
            mass = plan.sum(-1, keepdim=True).clamp(min=1e-9)
            exp_len = float(((plan / mass) * lens).sum(-1).mean())
            per[b] = {"p_echo": float(echo.mean()), "p_plan_mass": float(mass.mean()),
                      **{f"p_{k}": float(plan[:, j].mean()) for j, k in enumerate(T.PLANS)},
                      "expected_length": exp_len}
            plans[b] = plan / mass
            fams = [q.family for q in problems]
            per[b]["by_family"] = {f: {k: float(plans[b][[i for i, g in enumerate(fams) if g == f], j].mean())
                                       for j, k in enumerate(T.PLANS)} for f in sorted(set(fams))}
            print(f"{c} b={b:3d} echo {per[b]['p_echo']:.3f} plan mass {per[b]['p_plan_mass']:.3f} "
                  f"S {per[b]['p_S']:.3f} M {per[b]['p_M']:.3f} L {per[b]['p_L']:.3f} E[len] {exp_len:.2f} | " + " ".join(
                      f"{f} " + "/".join(f"{v:.2f}" for v in d.values()) for f, d in per[b]["by_family"].items()))
        lo, hi = min(levels), max(levels)
        tv = float((0.5 * (plans[lo] - plans[hi]).abs().sum(-1)).mean())
        res[c] = {"levels": per, "plan_tv_lo_hi": tv}
        print(f"{c}: plan TV between b={lo} and b={hi}: {tv:.4f}")
    if a.out:
        open(a.out, "w").write(json.dumps({"problems": a.problems, "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
