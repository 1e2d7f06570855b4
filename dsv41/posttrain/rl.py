"""RL with controllable reasoning effort (docs/system.md §7, docs/report.md §10.1).

For each prompt x, M samples at each training level b; the reward is the task score plus the length term

    r_len = -min(C_max, k(b) l / L_norm),   k(b) = k0 exp(-(b - b_min) / tau),   tau = lambda delta_b

(l = reasoning tokens, delta_b = the mean spacing of the levels); the advantage subtracts the mean of the (x, b)
subgroup only, never across levels. The loss is token-level normalised (the sum over every response token of the
batch divided by their count, so long responses are not down-weighted per token), PPO-clipped against the policy
at the start of the update, and weighted by the truncated importance weight min(C, pi_old / mu) against the
behaviour log-probs mu the engine reported (1 exactly for an on-policy sample in the deterministic mode; below or
above 1 for samples the asynchronous dispatcher let run across weight versions). There is no reference KL term.
Samples are drawn from the full softmax at temperature 1, the distribution the training forward scores, so the
sampling mask is the training mask. New log-probs come from `dsv41.train.logprobs.token_logprobs` (the reference
forward, quantization on), the pair that makes the ratio start at exactly 1.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load, save
from dsv41.posttrain.rollout import Rollout, make_engine, rollouts
from dsv41.posttrain.sft import TaskMix
from dsv41.train.logprobs import token_logprobs


@dataclass
class LengthReward:
    k0: float = 0.5
    c_max: float = 0.5
    l_norm: float = 20.0
    lam: float = 1.0
    levels: tuple[int, ...] = (1, 25, 50, 75, 100)

    @property
    def tau(self) -> float:
        lv = sorted(self.levels)
        delta = (lv[-1] - lv[0]) / (len(lv) - 1) if len(lv) > 1 else 1.0
        return self.lam * delta

    def k(self, b: float) -> float:
        return self.k0 * math.exp(-(b - min(self.levels)) / self.tau)

    def __call__(self, length: int, b: float) -> float:
        return -min(self.c_max, self.k(b) * length / self.l_norm)


@dataclass
class RLConfig:
    init: str = "runs/post-sft"
    out: str = "runs/post-rl"
    steps: int = 40
    minutes: float = 8.0
    prompts: int = 4                  # prompts per step
    samples: int = 4                  # M_b: samples per (x, b)
    max_tokens: int = 32
    lr: float = 1e-3
    clip: float = 0.2
    tis_cap: float = 2.0
    seed: int = 0
    mix: TaskMix = field(default_factory=TaskMix)
    length: LengthReward = field(default_factory=LengthReward)


def group_advantages(rewards: list[float], keys: list) -> list[float]:
    """Reward minus the mean of its own key's subgroup ((x, b): samples at other levels never enter)."""
    sums: dict = {}
    for r, k in zip(rewards, keys):
        s = sums.setdefault(k, [0.0, 0])
        s[0] += r
        s[1] += 1
    return [r - sums[k][0] / sums[k][1] for r, k in zip(rewards, keys)]


def policy_loss(lp: torch.Tensor, lp_old: torch.Tensor, lp_mu: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float, cap: float) -> tuple[torch.Tensor, dict]:
    """Token-level clipped surrogate with truncated importance weights; all [B, L] (adv broadcast per row).

    lp: new log-probs (differentiable); lp_old: the policy at the start of the update; lp_mu: the behaviour
    policy's (the engine's); mask: 1 for tokens that train (response tokens within the staleness bound)."""
    w = torch.exp(lp_old - lp_mu).clamp(max=cap)
    ratio = torch.exp(lp - lp_old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    n = mask.sum().clamp(min=1)
    loss = -(w * surr * mask).sum() / n
    stats = {"tis_mean": float((w * mask).sum() / n), "clipped": float((((ratio - 1).abs() > clip) * mask).sum() / n)}
    return loss, stats


def rewards_of(rs: list[Rollout], length: LengthReward) -> list[float]:
    return [float(r.verdict.correct) + length(r.verdict.reasoning_tokens, r.effort) for r in rs]


def batch_tensors(rs: list[Rollout], adv: list[float], pad: int, masks: list[list[float]] | None = None):
    """(ids [B, T], behaviour lp [B, T-1], advantages [B, 1], mask [B, T-1]) with each response's log-prob at
    the positions that predict its tokens."""
    rows = [r.prompt_ids + r.output_ids for r in rs]
    T_ = max(map(len, rows))
    ids = torch.tensor([x + [pad] * (T_ - len(x)) for x in rows])
    mu, mask = torch.zeros(len(rs), T_ - 1), torch.zeros(len(rs), T_ - 1)
    for i, r in enumerate(rs):
        a = len(r.prompt_ids) - 1
        mu[i, a:a + len(r.output_ids)] = torch.tensor(r.behaviour_lp, dtype=torch.float32)
        mask[i, a:a + len(r.output_ids)] = torch.tensor(masks[i] if masks else [1.0] * len(r.output_ids))
    return ids, mu, torch.tensor(adv, dtype=torch.float32)[:, None], mask


def train_step(model, opt, rs: list[Rollout], adv: list[float], cfg: RLConfig, pad: int,
               masks: list[list[float]] | None = None) -> dict:
    """One policy-gradient update on rollouts (model left in eval mode)."""
    ids, mu, a, mask = batch_tensors(rs, adv, pad, masks)
    model.train()
    try:
        lp = token_logprobs(model, ids)
        loss, stats = policy_loss(lp, lp.detach(), mu, a, mask, cfg.clip, cfg.tis_cap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    finally:
        model.eval()
    return {"loss": float(loss.detach()), **stats}


def step_items(cfg: RLConfig, step: int) -> list[tuple[T.Problem, int, int]]:
    """Step `step`'s (problem, b, seed) requests: `prompts` training problems x every level x M samples."""
    rng = random.Random(f"rl:{cfg.seed}:{step}")
    items = []
    for i in range(cfg.prompts):
        p = T.sample_problem(rng, cfg.mix.families[i % len(cfg.mix.families)], cfg.mix.lo, cfg.mix.hi)
        for b in cfg.mix.levels:
            items += [(p, b, rng.randrange(2 ** 31)) for _ in range(cfg.samples)]
    return items


def level_stats(rs: list[Rollout], rewards: list[float]) -> dict:
    out = {}
    for b in sorted({r.effort for r in rs}):
        idx = [i for i, r in enumerate(rs) if r.effort == b]
        out[b] = {"reward": sum(rewards[i] for i in idx) / len(idx),
                  "accuracy": sum(rs[i].verdict.correct for i in idx) / len(idx),
                  "length": sum(rs[i].verdict.reasoning_tokens for i in idx) / len(idx)}
    return out


def run_rl(cfg: RLConfig, say=print) -> Path:
    """Synchronous RL from cfg.init (or resume cfg.out): each step samples every group, then updates once."""
    cfg.mix.check()
    cfg.length.levels = tuple(cfg.mix.levels)
    out = Path(cfg.out)
    resume = (out / "posttrain.json").is_file()
    model, tok, meta = load(out if resume else cfg.init)
    step, history = (int(meta["step"]), meta["history"]) if resume else (0, [])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    if resume and (out / "optimizer.pt").is_file():
        opt.load_state_dict(torch.load(out / "optimizer.pt"))
    eng = make_engine(model, tok, max_batch=64)
    t0 = time.time()
    while step < cfg.steps and time.time() - t0 < cfg.minutes * 60:
        rs = rollouts(eng, tok, step_items(cfg, step), cfg.max_tokens)
        rewards = rewards_of(rs, cfg.length)
        adv = group_advantages(rewards, [(r.problem.content, r.effort) for r in rs])
        stats = train_step(model, opt, rs, adv, cfg, tok.pad_id)
        step += 1
        lv = level_stats(rs, rewards)
        history.append({"step": step, **stats, "levels": lv, "sampled_tokens": sum(len(r.output_ids) for r in rs)})
        say(f"rl step {step}/{cfg.steps} " + " ".join(
            f"b{b}: acc {v['accuracy']:.2f} len {v['length']:.1f}" for b, v in lv.items()) + f" ({time.time() - t0:.0f}s)")
    save(model, tok, out, {"stage": "rl", "step": step, "history": history, "config": asdict(cfg)})
    torch.save(opt.state_dict(), out / "optimizer.pt")
    return out
