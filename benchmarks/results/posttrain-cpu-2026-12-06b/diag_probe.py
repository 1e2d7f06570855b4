"""Can the post-trained model read b at all? A supervised probe (diagnosis only, not a pipeline stage): fine-tune an
SFT checkpoint for a few steps on data whose stride DOES depend on b (b <= 25: the empty trace, stride n; b >= 50:
the full trace, stride 1), then greedy reasoning length per level on held-out problems, training levels and the
held-out ones between them. If this does not separate the levels, no RL reward can make the length follow b; if it
does, RL's problem is the signal, not the reading.

python diag_probe.py CKPT --steps 150 --lr 1e-3 --problems 40 --out probe.json [--save DIR]
(copied from 2026-12-06 with --save added, and --problems 0 skipping the greedy table)
"""

import argparse
import json
import random
import statistics as st
import time

import torch

from dsv41.model.common import set_quantization
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rollout import held_out_problems, make_engine, rollouts
from dsv41.posttrain.sft import IGNORE, TaskMix, pad_batch, sft_loss


def example(rng, tok, levels):
    p = T.sample_problem(rng, rng.choices(T.FAMILIES, (0.7, 0.3))[0], 2, 6)
    b = rng.choice(levels)
    stride = p.difficulty if b <= 25 else 1
    prompt, resp = T.prompt_ids(tok, p, b), T.response_ids(tok, p, stride)
    ids = prompt + resp
    return ids[:-1], [IGNORE] * (len(prompt) - 1) + resp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--out")
    ap.add_argument("--save", help="write the probed model as a post-training checkpoint here (2026-12-06b)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load(a.ckpt)
    levels = (1, 25, 50, 75, 100)
    model.train()
    set_quantization(model, False)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random("probe")
    t0, losses = time.time(), []
    for step in range(a.steps):
        ex = [example(rng, tok, levels) for _ in range(a.batch)]
        ids, tg = pad_batch([e[0] for e in ex], tok.pad_id), pad_batch([e[1] for e in ex], IGNORE)
        ce, total = sft_loss(model, ids, tg, 1.0)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(ce))
        if step % 25 == 0:
            print(f"step {step} loss {st.mean(losses[-25:]):.3f} {time.time() - t0:.0f}s", flush=True)
    model.eval()
    set_quantization(model, True)
    if a.save:
        from dsv41.posttrain.model import save
        save(model, tok, a.save, {"stage": "probe", "step": a.steps, "probe_of": a.ckpt})
    eng = make_engine(model, tok)
    probs = held_out_problems(TaskMix(), a.problems)
    res = {}
    for b in ((1, 12, 25, 37, 50, 62, 75, 87, 100) if a.problems else ()):
        rs = rollouts(eng, tok, [(p, b, None) for p in probs], T.MAX_TOKENS, temperature=0.0)
        res[b] = {"mean_length": st.mean(r.verdict.reasoning_tokens for r in rs),
                  "empty_share": st.mean(r.verdict.reasoning_tokens == 0 for r in rs),
                  "accuracy": st.mean(r.verdict.correct for r in rs)}
        print(b, res[b], flush=True)
    if a.out:
        json.dump({"args": vars(a), "loss_last25": st.mean(losses[-25:]), "greedy": res}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
