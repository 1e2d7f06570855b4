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
from dsv41.posttrain.report import Progress, plot_rl
from dsv41.posttrain.rollout import Rollout, make_engine, rollouts
from dsv41.posttrain.routing import replay_batch
from dsv41.posttrain.sft import TaskMix
from dsv41.train.logprobs import token_logprobs


@dataclass
class LengthReward:
    k0: float = 1.0               # at b_min a full trace of 20 tokens costs a whole correct answer
    c_max: float = 1.0
    l_norm: float = 20.0
    lam: float = 2.0              # tau = 2 delta_b: k(b_max) = k0 e^-2
    levels: tuple[int, ...] = (1, 25, 50, 75, 100)
    # delta_b: None = the mean spacing of the training levels; a number fixes it, so that training on a dense
    # grid of levels (1..100 less the held-out ones: spacing ~1) keeps the k(b) of the five-level set (24.75)
    delta_b: float | None = None

    @property
    def tau(self) -> float:
        if self.delta_b is not None:
            return self.lam * self.delta_b
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
    max_tokens: int = T.MAX_TOKENS
    lr: float = 2e-4                  # 1e-3 and 5e-4 lost held-out accuracy to SFT; 2e-4 gained (diag)
    clip: float = 0.2
    tis_cap: float = 2.0
    seed: int = 0
    dispatch: str = "sample"          # "sync" or a dispatcher granularity: "sample", "prompt", "batch"
    slots: int = 64                   # generation slots (the engine's max batch)
    max_staleness: int = 1            # dispatched: tokens older than this many versions are masked
    quiet: bool = False
    drafter_lr: float = 0.0           # > 0: a drafter step (dspark.py, backbone frozen) on every update's rollouts
    # levels drawn per prompt (without replacement; 0: every training level): with a dense grid of levels a group
    # is a prompt at a few of them, M samples each
    levels_per_prompt: int = 0
    adv_norm: bool = False            # divide each advantage by its (x, b) subgroup's standard deviation
    epochs: int = 1                   # optimizer steps per update on the same rollouts (ratios against the first)
    # > 0: k0 follows the sampled length (hold_length below): after each update k0 *= exp(rate (L_ema - L_0) / L_0),
    # L_ema the moving mean (0.8 / 0.2) of the updates' mean sampled reasoning length, L_0 the first update's; the
    # length term then pulls as much toward shorter (low b) as the score and the high levels toward longer, so
    # the mean length holds and what the update can still change is how the length depends on b
    k0_rate: float = 0.0
    # the same M seeds at every level of a prompt (common random numbers): while the policy ignores b, the samples
    # of (x, b) and (x, b') are the same responses, so the task score's part of the update is the same at every
    # level and what differs between the levels' pulls is the length term alone
    paired_seeds: bool = False
    # who carries which advantage (CREDITS): "all" (the default, as before the option): every response token the
    # full one (score + length term, minus the (x, b) subgroup's mean); "split": only the plan letter carries the
    # full advantage, the trace and answer tokens the score-only one (score minus the subgroup's mean score), and
    # the echo (b's band letter, its deterministic copy) is out of the loss (split_credit below); "decision": as
    # "split", and a response without a plan letter gives the full advantage to the token in the plan's place
    credit: str = "all"
    # the decoding constraint (constrain.py): "" off (the full softmax), else a plan set ("sml", "strides") whose
    # grammar every rollout is sampled under and whose mask the loss's log-probs apply (sync dispatch only)
    constrain: str = ""
    # alpha of an entropy bonus on the plan letter's (masked) distribution, constrained runs only: the update
    # ascends E[r] + alpha H(plan | x, b), whose optimum is the Boltzmann policy P(plan) ~ exp(E[r | plan] /
    # alpha) (with adv_norm off the advantages are in reward units, so alpha is too). Why: the exact optimum of
    # the reward is a step in b per chain length (5 steps over 8 adjacent levels, 2026-12-07 optimum.py); the
    # Boltzmann policy turns each step into a logistic rise, so the sampled mean length can rise between every
    # pair of levels
    plan_entropy: float = 0.0
    # constrained runs: the plan letter's weight in the loss (its surrogate term and its entropy bonus alike, so
    # the bonus's Boltzmann optimum is unchanged): the plan is one token of ~15 in the token-normalised loss, and
    # at weight 1 its bandit learns slowly (2026-12-07e: 476 updates left the plan far from that optimum); 1 is
    # the loss as before, bit for bit
    plan_weight: float = 1.0
    mix: TaskMix = field(default_factory=TaskMix)
    length: LengthReward = field(default_factory=LengthReward)


def group_advantages(rewards: list[float], keys: list, norm: bool = False, eps: float = 1e-4) -> list[float]:
    """Reward minus the mean of its own key's subgroup ((x, b): samples at other levels never enter); norm:
    divided by the subgroup's standard deviation (+ eps; a subgroup without variance keeps advantages 0)."""
    groups: dict = {}
    for r, k in zip(rewards, keys):
        groups.setdefault(k, []).append(r)
    mean = {k: sum(v) / len(v) for k, v in groups.items()}
    if not norm:
        return [r - mean[k] for r, k in zip(rewards, keys)]
    std = {k: math.sqrt(sum((x - mean[k]) ** 2 for x in v) / len(v)) for k, v in groups.items()}
    return [(r - mean[k]) / (std[k] + eps) for r, k in zip(rewards, keys)]


CREDITS = ("all", "split", "decision")


def head_positions(tok, out_ids: list[int]) -> tuple[int | None, list[int]]:
    """(index of the plan letter among a response's first tasks.HEAD_TOKENS tokens, or None; indices of the echo
    tokens before it: a band letter at token 0, and a digit at token 1 after it (SFT's --echo-size); without a
    plan letter, the same leading echo tokens)."""
    first = [tok.decode([t]) for t in out_ids[:T.HEAD_TOKENS]]
    plan = next((i for i, c in enumerate(first) if len(c) == 1 and c in T.PLANS), None)
    echo = []
    if first and len(first[0]) == 1 and first[0] in T.BANDS and plan != 0:
        echo.append(0)
        if len(first) > 1 and first[1].isdigit() and (plan is None or plan > 1):
            echo.append(1)
    if plan is not None:
        echo = [i for i in echo if i < plan]
    return plan, echo


def decision_position(tok, out_ids: list[int]) -> int | None:
    """Where a response decides its length: the plan letter, or, when it wrote none, the first token after its
    echo tokens (the token it wrote where the plan letter belongs); None for an empty response."""
    plan, echo = head_positions(tok, out_ids)
    if plan is not None:
        return plan
    k = max(echo) + 1 if echo else 0
    return k if k < len(out_ids) else None


def split_credit(tok, rs: list[Rollout], full: list[float], score: list[float], decision: bool = False
                 ) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token advantages and loss masks of credit "split": the plan letter gets the full advantage (task score +
    length term, minus its subgroup's mean), every other response token (trace, `</think>`, answer, EOS) the
    score-only one (task score minus the subgroup's mean score), and the echo tokens are masked (advantage 0, mask
    0). A response without a plan letter carries no length credit at all: every unmasked token gets its score-only
    advantage.

    decision=True (credit "decision"): a response without a plan letter gives the full advantage to the token it
    wrote in the plan letter's place (decision_position). Why: under "split" leaving the plan letter out escaped
    the length term entirely, and at b <= 20 rl5b's samples did so (37 "no plan" samples in updates 121-133, the
    long traces that made b = 1 longer than b = 12 in its held-out evaluation, 2026-12-06d)."""
    advs, masks = [], []
    for r, a_full, a_score in zip(rs, full, score):
        n = len(r.output_ids)
        plan, echo = head_positions(tok, r.output_ids)
        adv, mask = [a_score] * n, [1.0] * n
        at = decision_position(tok, r.output_ids) if decision else plan
        if at is not None:
            adv[at] = a_full
        for i in echo:
            adv[i], mask[i] = 0.0, 0.0
        advs.append(adv)
        masks.append(mask)
    return advs, masks


def advantage_mass(tok, rs: list[Rollout], full: list[float], score: list[float], token_adv: list[list[float]],
                   masks: list[list[float]], levels) -> dict:
    """Where an update's advantage sits, per level band (level_bands) and plan letter (`-`: none): n samples;
    `plan`: the sum of the full advantages (score + length term) of their samples, the plan letter's own under
    both credits, and `abs` its absolute sum; `len`: the length term's part of `plan` (full minus score-only
    advantage; with adv_norm the two are divided by different stds, so only roughly the length term's part);
    `trace`: the sum, over their tokens after the head that train, of each token's advantage (what pushes on the
    trace tokens: the full advantage times the tokens under credit "all", the score-only one under "split")."""
    out: dict = {}
    bands = level_bands(levels)
    for r, a_f, a_s, adv, m in zip(rs, full, score, token_adv, masks):
        band = next((band_label(lo, hi) for lo, hi in bands if lo <= r.effort <= hi), None)
        if band is None:
            continue
        plan, echo = head_positions(tok, r.output_ids)
        key = tok.decode([r.output_ids[plan]]) if plan is not None else "-"
        start = (plan + 1) if plan is not None else (max(echo) + 1 if echo else 0)
        cell = out.setdefault(band, {}).setdefault(key, {"n": 0, "plan": 0.0, "abs": 0.0, "len": 0.0, "trace": 0.0})
        cell["n"] += 1
        cell["plan"] += a_f
        cell["abs"] += abs(a_f)
        cell["len"] += a_f - a_s
        cell["trace"] += sum(a * k for a, k in zip(adv[start:], m[start:]))
    for cells in out.values():
        for c in cells.values():
            for k in ("plan", "abs", "len", "trace"):
                c[k] = round(c[k], 4)
    return out


def level_seeds(rng: random.Random, levels: int, samples: int, paired: bool) -> list[list[int]]:
    """Sampling seeds per level of a prompt: M fresh ones each, or (paired) one list of M shared by every level."""
    if paired:
        seeds = [rng.randrange(2 ** 31) for _ in range(samples)]
        return [list(seeds) for _ in range(levels)]
    return [[rng.randrange(2 ** 31) for _ in range(samples)] for _ in range(levels)]


def prompt_levels(rng: random.Random, levels: tuple[int, ...], k: int) -> list[int]:
    """The levels a prompt is sampled at: all of them (k = 0 or k >= their number), else one drawn from each of k
    contiguous strata of the sorted levels (every prompt is then seen at low and at high effort, so one update
    holds the same x's subgroups at both ends: what differs between their pulls is b alone)."""
    lv = sorted(levels)
    if k <= 0 or k >= len(lv):
        return list(levels)
    cuts = [round(i * len(lv) / k) for i in range(k + 1)]
    return [lv[rng.randrange(cuts[i], cuts[i + 1])] for i in range(k)]


def policy_loss(lp: torch.Tensor, lp_old: torch.Tensor, lp_mu: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float, cap: float, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level clipped surrogate with truncated importance weights; all [B, L] (adv broadcast per row).

    lp: new log-probs (differentiable); lp_old: the policy at the start of the update; lp_mu: the behaviour
    policy's (the engine's); mask: 1 for tokens that train (response tokens within the staleness bound); weight:
    an optional per-token factor on the surrogate (the normaliser stays the mask's token count)."""
    w = torch.exp(lp_old - lp_mu).clamp(max=cap)
    ratio = torch.exp(lp - lp_old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    n = mask.sum().clamp(min=1)
    loss = -(w * surr * (mask if weight is None else mask * weight)).sum() / n
    stats = {"tis_mean": float((w * mask).sum() / n), "clipped": float((((ratio - 1).abs() > clip) * mask).sum() / n)}
    return loss, stats


def rewards_of(rs: list[Rollout], length: LengthReward) -> list[float]:
    return [float(r.verdict.correct) + length(r.verdict.reasoning_tokens, r.effort) for r in rs]


def scores_of(rs: list[Rollout]) -> list[float]:
    """The task score alone (the reward without its length term)."""
    return [float(r.verdict.correct) for r in rs]


def batch_tensors(rs: list[Rollout], adv: list, pad: int, masks: list[list[float]] | None = None):
    """(ids [B, T], behaviour lp [B, T-1], advantages [B, 1] or [B, T-1], mask [B, T-1]) with each response's
    log-prob at the positions that predict its tokens; adv: one number per response (broadcast over its tokens)
    or a list per response, one per output token (credit "split"). (The decoding constraint's token mask, for
    rollouts sampled under one, is decoding_mask's.)"""
    rows = [r.prompt_ids + r.output_ids for r in rs]
    T_ = max(map(len, rows))
    ids = torch.tensor([x + [pad] * (T_ - len(x)) for x in rows])
    mu, mask = torch.zeros(len(rs), T_ - 1), torch.zeros(len(rs), T_ - 1)
    per_token = any(isinstance(a, (list, tuple)) for a in adv)
    a_t = torch.zeros(len(rs), T_ - 1) if per_token else torch.tensor(adv, dtype=torch.float32)[:, None]
    for i, r in enumerate(rs):
        a = len(r.prompt_ids) - 1
        mu[i, a:a + len(r.output_ids)] = torch.tensor(r.behaviour_lp, dtype=torch.float32)
        mask[i, a:a + len(r.output_ids)] = torch.tensor(masks[i] if masks else [1.0] * len(r.output_ids))
        if per_token:
            if len(adv[i]) != len(r.output_ids):
                raise ValueError(f"{len(adv[i])} advantages for {len(r.output_ids)} output tokens")
            a_t[i, a:a + len(r.output_ids)] = torch.tensor(adv[i], dtype=torch.float32)
    return ids, mu, a_t, mask


def decoding_mask(model, rs: list[Rollout], T_: int) -> torch.Tensor | None:
    """bool [B, T_-1, V]: the decoding constraint's token mask at every position of the training batch (the one
    each constrained rollout was sampled under, replayed by its grammar; all True elsewhere), or None when no
    rollout was constrained (the full softmax, token_logprobs)."""
    if all(r.grammar is None for r in rs):
        return None
    from dsv41.posttrain.constrain import allowed_mask
    return allowed_mask([r.grammar for r in rs], [len(r.prompt_ids) for r in rs], [r.output_ids for r in rs], T_,
                        model.cfg.vocab_size)


def train_step(model, opt, rs: list[Rollout], adv: list[float], cfg: RLConfig, pad: int,
               masks: list[list[float]] | None = None) -> dict:
    """One policy-gradient update on rollouts (model left in eval mode). Rollouts sampled under a decoding
    constraint are scored by the masked softmax (constrain.masked_token_logprobs with decoding_mask), the
    distribution they were drawn from."""
    ids, mu, a, mask = batch_tensors(rs, adv, pad, masks)
    allowed = decoding_mask(model, rs, ids.size(1))
    ent_at = weight = None
    if allowed is not None and (cfg.plan_entropy > 0 or cfg.plan_weight != 1.0):
        from dsv41.posttrain.constrain import plan_positions
        at = plan_positions(rs, ids.size(1))
        ent_at = at if cfg.plan_entropy > 0 else None
        if cfg.plan_weight != 1.0:
            weight = 1.0 + (cfg.plan_weight - 1.0) * at
    routes = None
    if all(r.routes is not None for r in rs):           # replay the generation-time routing (routing.py)
        routes = replay_batch([r.routes for r in rs], [len(r.prompt_ids) + len(r.output_ids) for r in rs],
                              ids.size(1))
    model.train()
    try:
        lp_old = None
        for _ in range(max(1, cfg.epochs)):       # epochs > 1: PPO's passes over the same rollouts, clipped
            ent = None
            if allowed is None:
                lp = token_logprobs(model, ids, routes=routes)
            elif ent_at is None:
                from dsv41.posttrain.constrain import masked_token_logprobs
                lp = masked_token_logprobs(model, ids, allowed, routes=routes)
            else:
                from dsv41.posttrain.constrain import masked_token_logprobs
                lp, ent = masked_token_logprobs(model, ids, allowed, routes=routes, entropy=True)
            if lp_old is None:
                lp_old = lp.detach()              # the policy at the start of the update
            loss, stats = policy_loss(lp, lp_old, mu, a, mask, cfg.clip, cfg.tis_cap, weight)
            if ent is not None:             # the bonus, normalised by the same token count as the surrogate
                h = (ent * ent_at).sum()
                loss = loss - cfg.plan_entropy * cfg.plan_weight * h / mask.sum().clamp(min=1)
                stats["plan_entropy"] = float(h.detach() / ent_at.sum().clamp(min=1))
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
        levels = prompt_levels(rng, cfg.mix.levels, cfg.levels_per_prompt)
        for b, seeds in zip(levels, level_seeds(rng, len(levels), cfg.samples, cfg.paired_seeds)):
            items += [(p, b, s) for s in seeds]
    return items


def hold_length(state: dict | None, mean_length: float, beta: float = 0.8) -> dict:
    """The k0 controller's state after an update whose sampled mean reasoning length is `mean_length`: the target
    is the first update's, ema the moving mean (beta on the old value)."""
    if state is None:
        return {"target": mean_length, "ema": mean_length}
    return {"target": state["target"], "ema": beta * state["ema"] + (1 - beta) * mean_length}


def next_k0(k0: float, state: dict, rate: float) -> float:
    """k0 after an update: raised while the moving mean length is above the target, lowered while below."""
    return k0 * math.exp(rate * (state["ema"] - state["target"]) / max(state["target"], 1.0))


def band_label(lo: int, hi: int) -> str:
    """A band's name in logs and histories: b<lo>-<hi>, or b<lo> for a single level."""
    return f"b{lo}" if lo == hi else f"b{lo}-{hi}"


def level_bands(levels, n: int = 5) -> list[tuple[int, int]]:
    """(lo, hi) ranges of b that group the levels for a progress line / plot: each level alone when there are at
    most 9 of them, else n bands of equal width over 1..100."""
    levels = sorted(levels)
    if len(levels) <= 9:
        return [(b, b) for b in levels]
    w = 100 / n
    return [(int(round(i * w)) + 1, int(round((i + 1) * w))) for i in range(n)]


def band_means(per_level: dict, bands: list[tuple[int, int]], key: str) -> list[tuple[tuple[int, int], float]]:
    """Sample-weighted means of per_level[b][key] within each band ({b: {key, "n"}}; levels without "n": 1)."""
    out = []
    for lo, hi in bands:
        got = [(v[key], v.get("n", 1)) for b, v in per_level.items() if lo <= int(b) <= hi]
        if got:
            out.append(((lo, hi), sum(x * n for x, n in got) / sum(n for _, n in got)))
    return out


def level_stats(rs: list[Rollout], rewards: list[float], tok=None) -> dict:
    """Per level: mean reward, accuracy, reasoning length, count; with tok, and when any response opened with a
    plan letter (tasks.opened_plan), the share of each plan."""
    out = {}
    plans = [T.opened_plan(tok, r.output_ids) for r in rs] if tok is not None else [None] * len(rs)
    for b in sorted({r.effort for r in rs}):
        idx = [i for i, r in enumerate(rs) if r.effort == b]
        out[b] = {"reward": sum(rewards[i] for i in idx) / len(idx),
                  "accuracy": sum(rs[i].verdict.correct for i in idx) / len(idx),
                  "length": sum(rs[i].verdict.reasoning_tokens for i in idx) / len(idx), "n": len(idx)}
        if any(plans):
            out[b]["plans"] = {c: sum(plans[i] == c for i in idx) / len(idx) for c in T.PLANS}
    return out


class RLRun:
    """What both RL loops share: the model from cfg.init (or resumed from cfg.out with its optimizer, step and
    history), the update on scored rollouts, the progress bar, the history, and the checkpoint with its plot."""

    def __init__(self, cfg: RLConfig, say=print):
        cfg.mix.check()
        if cfg.credit not in CREDITS:
            raise ValueError(f"unknown credit {cfg.credit!r}: one of {', '.join(CREDITS)}")
        if not cfg.constrain and cfg.plan_weight != 1.0:
            raise ValueError("plan_weight weighs the plan letter of constrained rollouts: it needs --constrain")
        if cfg.constrain:
            from dsv41.posttrain.constrain import PLAN_SETS
            if cfg.constrain not in PLAN_SETS:
                raise ValueError(f"unknown plan set {cfg.constrain!r}: one of {', '.join(PLAN_SETS)}")
            if cfg.plan_entropy < 0:
                raise ValueError(f"plan_entropy must be >= 0, got {cfg.plan_entropy}")
            if cfg.plan_weight <= 0:
                raise ValueError(f"plan_weight must be > 0, got {cfg.plan_weight}")
            if cfg.dispatch != "sync":
                raise ValueError("the decoding constraint runs with --dispatch sync only (the dispatcher's backend "
                                 "samples unconstrained)")
        cfg.length.levels = tuple(cfg.mix.levels)
        self.cfg, self.say, self.out = cfg, say, Path(cfg.out)
        resume = (self.out / "posttrain.json").is_file()
        self.model, self.tok, meta = load(self.out if resume else cfg.init)
        self.step, self.history = (int(meta["step"]), meta["history"]) if resume else (0, [])
        self.hold = None
        if resume and self.history and self.history[-1].get("hold"):      # the k0 controller's state
            self.hold = dict(self.history[-1]["hold"])
            last = self.history[-1]
            cfg.length.k0 = next_k0(last["k0"], self.hold, cfg.k0_rate)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        if resume and (self.out / "optimizer.pt").is_file():
            self.opt.load_state_dict(torch.load(self.out / "optimizer.pt"))
        self.dopt = None
        if cfg.drafter_lr > 0:
            from dsv41.posttrain.dspark import drafter_optimizer
            self.dopt = drafter_optimizer(self.model, cfg.drafter_lr)
            if resume and (self.out / "drafter_optimizer.pt").is_file():
                self.dopt.load_state_dict(torch.load(self.out / "drafter_optimizer.pt"))
        if resume:
            say(f"rl: resuming {self.out} at step {self.step}")
        self.t0 = time.time()
        self.bar = Progress(f"rl ({cfg.dispatch})", cfg.steps, self.step, cfg.quiet)

    def grammar(self):
        """(problem, b) -> the rollouts' constrain.Grammar, or None without a constraint."""
        if not self.cfg.constrain:
            return None
        from dsv41.posttrain.constrain import Grammar
        return lambda p, b: Grammar(self.tok, p, b, self.cfg.constrain)

    def running(self) -> bool:
        return self.step < self.cfg.steps and time.time() - self.t0 < self.cfg.minutes * 60

    def advantages(self, rs: list[Rollout], rewards: list[float], masks: list[list[float]] | None):
        """(advantages for train_step, masks, advantage_mass row) under cfg.credit."""
        keys = [(r.problem.content, r.effort) for r in rs]
        full = group_advantages(rewards, keys, self.cfg.adv_norm)
        score = group_advantages(scores_of(rs), keys, self.cfg.adv_norm)
        if self.cfg.credit in ("split", "decision"):
            adv, head = split_credit(self.tok, rs, full, score, decision=self.cfg.credit == "decision")
            masks = [[a * b for a, b in zip(m, h)] for m, h in zip(masks, head)] if masks else head
            token_adv = adv
        else:
            adv = full
            token_adv = [[a] * len(r.output_ids) for a, r in zip(full, rs)]
        keep = masks if masks else [[1.0] * len(r.output_ids) for r in rs]
        return adv, masks, advantage_mass(self.tok, rs, full, score, token_adv, keep, self.cfg.mix.levels)

    def update(self, rs: list[Rollout], masks: list[list[float]] | None = None, **extra) -> dict:
        """Score the rollouts, one policy-gradient step on them, a history row."""
        rewards = rewards_of(rs, self.cfg.length)
        adv, masks, mass = self.advantages(rs, rewards, masks)
        stats = train_step(self.model, self.opt, rs, adv, self.cfg, self.tok.pad_id, masks)
        if self.dopt is not None:       # the drafter on the same rollouts, against the updated backbone
            from dsv41.posttrain.dspark import drafter_step
            stats.update(drafter_step(self.model, self.dopt, rs, self.tok.pad_id))
        self.step += 1
        lv = level_stats(rs, rewards, self.tok)
        k0 = self.cfg.length.k0
        if self.cfg.k0_rate > 0:
            self.hold = hold_length(self.hold, sum(r.verdict.reasoning_tokens for r in rs) / max(1, len(rs)))
            self.cfg.length.k0 = next_k0(k0, self.hold, self.cfg.k0_rate)
        self.history.append({"step": self.step, **stats, "levels": lv, "elapsed": time.time() - self.t0,
                             "sampled_tokens": sum(len(r.output_ids) for r in rs), "k0": k0,
                             "hold": dict(self.hold) if self.hold else None, "adv_mass": mass, **extra})
        bands = level_bands(self.cfg.mix.levels)
        acc, ln = band_means(lv, bands, "accuracy"), band_means(lv, bands, "length")
        self.bar.update(" ".join(f"{band_label(lo, hi)} acc {a:.2f} len {l_:.1f}"
                                 for ((lo, hi), a), (_, l_) in zip(acc, ln)))
        return self.history[-1]

    def finish(self, **meta) -> Path:
        self.bar.close()
        self.say(f"rl: {self.step} steps in {time.time() - self.t0:.0f}s")
        save(self.model, self.tok, self.out, {"stage": "rl", "step": self.step, "history": self.history,
                                              "config": asdict(self.cfg), **meta})
        torch.save(self.opt.state_dict(), self.out / "optimizer.pt")
        if self.dopt is not None:
            torch.save(self.dopt.state_dict(), self.out / "drafter_optimizer.pt")
        if self.history:
            plot_rl(self.history, self.out / "rl_curves.png")
        return self.out


def run_rl(cfg: RLConfig, say=print) -> Path:
    """RL from cfg.init (or resume cfg.out). cfg.dispatch "sync": each step samples every group, then updates
    once; "sample" / "prompt" / "batch": the asynchronous dispatcher (rl_dispatch.py)."""
    if cfg.dispatch != "sync":
        from dsv41.posttrain.rl_dispatch import run_rl_dispatched
        return run_rl_dispatched(cfg, say)
    run = RLRun(cfg, say)
    eng = make_engine(run.model, run.tok, max_batch=cfg.slots)
    while run.running():
        run.update(rollouts(eng, run.tok, step_items(cfg, run.step), cfg.max_tokens, routes=True,
                            grammar=run.grammar()))
    return run.finish()
