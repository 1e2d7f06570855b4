"""Greedy probe of a post-trained checkpoint (this folder's probe-post-rl.txt:
`python benchmarks/results/posttrain-pipeline-cpu-2026-12-07g/probe.py runs/p2/post-rl 30 sums`): per family and
chain length n, 30 held-out problems, the accuracy and the plan letters of free greedy decoding at b 1 and 100 and
of each plan letter forced (b 50), under the plan grammar."""
import collections
import random
import sys

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.constrain import Grammar
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import make_engine, rollouts

torch.set_num_threads(1)
ckpt = sys.argv[1]
per = int(sys.argv[2]) if len(sys.argv) > 2 else 30
fams = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sums", "chase"]
model, tok, _ = load(ckpt)
model.eval()
eng = make_engine(model, tok, 64)
for fam in fams:
    for n in range(2, 7):
        rng = random.Random(f"probe:{fam}:{n}")
        probs = [T.sample_problem(rng, fam, n, n, split="held_out") for _ in range(per)]
        row = {}
        for label, b, force in [("b1", 1, None), ("b100", 100, None), ("S", 50, "S"), ("M", 50, "M"),
                                ("L", 50, "L")]:
            def gram(p, bb, force=force):
                g = Grammar(tok, p, bb, "sml")
                if force:
                    g.head[2] = [tok.tok.token_to_id(force)]
                return g
            rs = rollouts(eng, tok, [(p, b, None) for p in probs], T.MAX_TOKENS, 0.0, grammar=gram, masked_lp=False)
            acc = sum(r.verdict.correct for r in rs) / len(rs)
            plans = collections.Counter(T.opened_plan(tok, r.output_ids) for r in rs)
            row[label] = (round(acc, 2), dict(plans))
        print(fam, n, row, flush=True)
