"""Why RL does not learn to read the effort line: measured on a post-training checkpoint (one thread).

1. How b is tokenized in the effort line (ids of the line for each level).
2. Sampled (T = 1) responses to training problems at every level, M per (x, b): the share of (x, b) subgroups with
   any length variance (the length term's advantage is zero in the others), length / accuracy per trace length,
   and the expected reward of each length bucket at every b under the configured LengthReward (is the optimum
   different at different b at all?).
3. The share of the update from the length term: gradient norms of the policy loss with the task-score advantages
   only, with the length-term advantages only, and with both (the RL stage's loss, one batch).
4. Greedy vs sampled mean length per level.

python diag_effort.py CKPT [--prompts 24] [--samples 8] [--k0 1] [--lam 2] [--cmax 1] [--lnorm 20] [--out x.json]
"""

import argparse
import json
import random
import statistics as st
import time

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load
from dsv41.posttrain.rl import LengthReward, group_advantages, policy_loss, batch_tensors
from dsv41.posttrain.rollout import make_engine, rollouts
from dsv41.posttrain.sft import TaskMix
from dsv41.train.logprobs import token_logprobs


def grad_norm(model, rs, adv, pad):
    ids, mu, a, mask = batch_tensors(rs, adv, pad)
    model.train()
    lp = token_logprobs(model, ids)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), a, mask, 0.2, 2.0)
    model.zero_grad(set_to_none=True)
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.eval()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--levels", default="1,25,50,75,100")
    ap.add_argument("--k0", type=float, default=1.0)
    ap.add_argument("--lam", type=float, default=2.0)
    ap.add_argument("--cmax", type=float, default=1.0)
    ap.add_argument("--lnorm", type=float, default=20.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--greedy", type=int, default=60, help="held-out problems for the greedy vs sampled lengths")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    levels = tuple(int(x) for x in a.levels.split(","))
    model, tok, _ = load(a.ckpt)
    out = {"ckpt": a.ckpt, "args": vars(a)}

    # 1. tokenization of the effort line
    p0 = T.make_sums(random.Random(0), 3)
    tk = {}
    for b in (1, 12, 25, 37, 50, 62, 75, 87, 100):
        ids = T.prompt_ids(tok, p0, b)
        tk[b] = [tok.tok.id_to_token(i) for i in ids[:8]]
    out["effort_tokens"] = tk
    print("effort line tokens:", json.dumps(tk, ensure_ascii=False))

    # 2. sampled responses at every level
    lr = LengthReward(k0=a.k0, c_max=a.cmax, l_norm=a.lnorm, lam=a.lam, levels=levels)
    rng = random.Random("diag-effort")
    items = []
    for i in range(a.prompts):
        p = T.sample_problem(rng, T.FAMILIES[i % 2], 2, 6)
        for b in levels:
            items += [(p, b, rng.randrange(2 ** 31)) for _ in range(a.samples)]
    eng = make_engine(model, tok, max_batch=64)
    t0 = time.time()
    rs = rollouts(eng, tok, items, T.MAX_TOKENS, temperature=a.temperature)
    print(f"sampled {len(rs)} responses in {time.time() - t0:.0f}s")
    groups = {}
    for r in rs:
        groups.setdefault((r.problem.content, r.effort), []).append(r)
    var = [len({r.verdict.reasoning_tokens for r in g}) > 1 for g in groups.values()]
    out["subgroups"] = len(groups)
    out["subgroups_with_length_variance"] = sum(var) / len(var)
    full = [r.verdict.reasoning_tokens == len(T.encode_prompt(tok, T.trace(r.problem, 1))) for r in rs]
    out["share_full_trace"] = sum(full) / len(full)
    out["share_empty_trace"] = sum(r.verdict.reasoning_tokens == 0 for r in rs) / len(rs)
    out["sampled_by_level"] = {b: {"mean_length": st.mean(r.verdict.reasoning_tokens for r in rs if r.effort == b),
                                   "accuracy": st.mean(r.verdict.correct for r in rs if r.effort == b),
                                   "full_trace": st.mean(f for f, r in zip(full, rs) if r.effort == b)}
                               for b in levels}
    # which stride did each sample write? (its length matched against the strides' trace lengths)
    by_stride = {}
    for r in rs:
        n = r.problem.difficulty
        lens = {s: len(T.encode_prompt(tok, T.trace(r.problem, s))) if s < n else 0 for s in range(1, n + 1)}
        s = min((s for s, l in lens.items() if l == r.verdict.reasoning_tokens), default=None)
        key = "other" if s is None else ("1" if s == 1 else ("n" if s == n else "2..n-1"))
        by_stride.setdefault(key, []).append(r)
    out["by_stride"] = {k: {"share": len(v) / len(rs), "accuracy": st.mean(r.verdict.correct for r in v),
                            "mean_length": st.mean(r.verdict.reasoning_tokens for r in v)}
                        for k, v in by_stride.items()}
    # expected reward of each stride class at each b, with the class's measured accuracy and mean length
    out["expected_reward"] = {b: {k: v["accuracy"] - min(lr.c_max, lr.k(b) * v["mean_length"] / lr.l_norm)
                                  for k, v in out["by_stride"].items()} for b in levels}
    # the same under other length terms (the lengths and accuracies as sampled; only the reward changes)
    out["expected_reward_alt"] = {}
    for k0, lam in ((2.0, 2.0), (3.0, 1.0), (4.0, 1.0), (5.0, 1.0)):
        alt = LengthReward(k0=k0, c_max=a.cmax, l_norm=a.lnorm, lam=lam, levels=levels)
        out["expected_reward_alt"][f"k0={k0},lam={lam}"] = {
            b: {k: round(v["accuracy"] - min(alt.c_max, alt.k(b) * v["mean_length"] / alt.l_norm), 3)
                for k, v in out["by_stride"].items()} for b in levels}
    # per family and difficulty: accuracy and length of the full and the empty trace classes
    fd = {}
    for k, v in by_stride.items():
        for r in v:
            fd.setdefault(f"{r.problem.family}{r.problem.difficulty}", {}).setdefault(k, []).append(r)
    out["by_family_difficulty"] = {fdk: {k: [len(v), round(st.mean(r.verdict.correct for r in v), 2),
                                             round(st.mean(r.verdict.reasoning_tokens for r in v), 1)]
                                         for k, v in d.items()} for fdk, d in sorted(fd.items())}
    print(json.dumps({k: out[k] for k in ("subgroups_with_length_variance", "expected_reward_alt", "by_family_difficulty", "share_full_trace", "share_empty_trace",
                                          "sampled_by_level", "by_stride", "expected_reward")}, indent=1))

    # 3. gradient share of the length term
    score = [float(r.verdict.correct) for r in rs]
    lterm = [lr(r.verdict.reasoning_tokens, r.effort) for r in rs]
    keys = [(r.problem.content, r.effort) for r in rs]
    adv_s, adv_l = group_advantages(score, keys), group_advantages(lterm, keys)
    adv = group_advantages([s + l for s, l in zip(score, lterm)], keys)
    out["adv_abs_mean"] = {"score": st.mean(map(abs, adv_s)), "length": st.mean(map(abs, adv_l)),
                           "both": st.mean(map(abs, adv))}
    sub = rs[: min(len(rs), 160)]
    n = len(sub)
    gs, gl, gb = (grad_norm(model, sub, x[:n], tok.pad_id) for x in (adv_s, adv_l, adv))
    out["grad_norm"] = {"score": float(gs.norm()), "length": float(gl.norm()), "both": float(gb.norm()),
                        "cos_score_length": float(torch.nn.functional.cosine_similarity(gs, gl, dim=0))}
    # how much of the length gradient depends on b: the length-term gradient of the same samples minus its mean
    # over levels would need per-level splits; reported instead per level
    per_b = {}
    for b in levels:
        idx = [i for i, r in enumerate(sub) if r.effort == b]
        if idx:
            g = grad_norm(model, [sub[i] for i in idx], [adv_l[i] for i in idx], tok.pad_id)
            per_b[b] = g
    ref = torch.stack(list(per_b.values())).mean(0)
    out["length_grad_per_level_cos_to_mean"] = {b: float(torch.nn.functional.cosine_similarity(g, ref, dim=0))
                                                 for b, g in per_b.items()}
    print(json.dumps({k: out[k] for k in ("adv_abs_mean", "grad_norm", "length_grad_per_level_cos_to_mean")},
                     indent=1))

    # 4. greedy vs sampled on held-out problems
    if a.greedy:
        from dsv41.posttrain.rollout import held_out_problems
        hp = held_out_problems(TaskMix(), a.greedy)
        g = {}
        for b in (1, 50, 100):
            gr = rollouts(eng, tok, [(p, b, None) for p in hp], T.MAX_TOKENS, temperature=0.0)
            sm = rollouts(eng, tok, [(p, b, 1000 + i) for i, p in enumerate(hp)], T.MAX_TOKENS, temperature=1.0)
            g[b] = {"greedy_length": st.mean(r.verdict.reasoning_tokens for r in gr),
                    "greedy_accuracy": st.mean(r.verdict.correct for r in gr),
                    "sampled_length": st.mean(r.verdict.reasoning_tokens for r in sm),
                    "sampled_accuracy": st.mean(r.verdict.correct for r in sm)}
        out["heldout_greedy_vs_sampled"] = g
        print(json.dumps(g, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
