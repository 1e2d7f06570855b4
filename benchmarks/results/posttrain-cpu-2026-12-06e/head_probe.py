"""Does the policy read (b, n) where the length is decided? The second head form (`--echo --echo-size --plan
--merge-top-band`): the reasoning opens with b's band letter (b = 100 -> J), the chain length n as a digit, then
the plan letter S / M / L. For held-out problems at each level b, one teacher-forced forward of prompt + band
letter + size digit gives P(band letter right) at the first response position, P(size digit right) at the second,
and the distribution over S / M / L at the third (the plan position). Printed per level: those means, the expected
reasoning length under the plan distribution (each plan's full response, head included), and P(L) per (family, n);
the plan TV between the lowest and highest level (06c's plan_probe.py number, for this head).

python head_probe.py CKPT [CKPT ...] [--problems 60] [--levels 1,12,...] [--out x.json]
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
    band = tok.tok.token_to_id(T.effort_band(b, merge_top=True))
    plans = [tok.tok.token_to_id(c) for c in T.PLANS]
    rows, starts, sizes = [], [], []
    for p in problems:
        pr = T.prompt_ids(tok, p, b)
        size = tok.tok.token_to_id(str(p.difficulty))
        rows.append(pr + [band, size])
        starts.append(len(pr) - 1)
        sizes.append(size)
    L = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (L - len(r)) for r in rows])
    logits = fast_forward(model, ids, TrainCache(model.cfg, ids.size(0), model.dtype, ids.device), ForwardOptions())
    pr = torch.softmax(logits.float(), -1)
    echo = torch.stack([pr[i, s, band] for i, s in enumerate(starts)])
    size = torch.stack([pr[i, s + 1, z] for i, (s, z) in enumerate(zip(starts, sizes))])
    plan = torch.stack([pr[i, s + 2, plans] for i, s in enumerate(starts)])
    lens = torch.tensor([[len(T.response_ids(tok, p, T.plan_stride(p, c), "xxx")) - 3 for c in T.PLANS]
                         for p in problems], dtype=torch.float32)      # reasoning tokens of each plan, head included
    return echo, size, plan, lens


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
            echo, size, plan, lens = probe(model, tok, problems, b)
            mass = plan.sum(-1, keepdim=True).clamp(min=1e-9)
            plans[b] = plan / mass
            exp_len = float((plans[b] * lens).sum(-1).mean())
            cells = {}
            for f in T.FAMILIES:
                for n in range(2, 7):
                    idx = [i for i, q in enumerate(problems) if q.family == f and q.difficulty == n]
                    if idx:
                        cells[f"{f}{n}"] = round(float(plans[b][idx, 2].mean()), 3)
            per[b] = {"p_echo": float(echo.mean()), "p_size": float(size.mean()), "p_plan_mass": float(mass.mean()),
                      **{f"p_{k}": float(plans[b][:, j].mean()) for j, k in enumerate(T.PLANS)},
                      "expected_length": exp_len, "p_L_by_cell": cells}
            print(f"{c} b={b:3d} echo {per[b]['p_echo']:.3f} size {per[b]['p_size']:.3f} plan mass "
                  f"{per[b]['p_plan_mass']:.3f} S {per[b]['p_S']:.2f} M {per[b]['p_M']:.2f} L {per[b]['p_L']:.2f} "
                  f"E[len] {exp_len:.2f} | P(L) " + " ".join(f"{k} {v:.2f}" for k, v in cells.items()))
        lo, hi = min(levels), max(levels)
        tv = float((0.5 * (plans[lo] - plans[hi]).abs().sum(-1)).mean())
        res[c] = {"levels": per, "plan_tv_lo_hi": tv}
        print(f"{c}: plan TV between b={lo} and b={hi}: {tv:.4f}")
    if a.out:
        open(a.out, "w").write(json.dumps({"problems": a.problems, "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
