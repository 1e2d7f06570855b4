"""DSpark during post-training (docs/system.md §5 and §7): the drafter keeps training on the post-training rollouts
with the gradient stopped into the backbone, and its acceptance per draft position is measured on the post-trained
model's own outputs.

The drafter (`mtp.*`) shares the embedding and the LM head with the backbone, so running its loss beside the policy
loss would move them; `backbone_frozen` turns off every other parameter's gradient while the drafter's forward
builds its graph, so the drafter loss reaches `mtp.*` alone and the backbone's gradients are those of the policy
loss, bit for bit (tested). The targets are the backbone's distributions at its current weights (the frozen
forward of `dsv41.train.dspark_stage.drafts_and_targets`), over the anchors whose drafted tokens lie in a
response: the drafter learns the post-trained traces, not the prompts.

Which anchors count: after the prefill of a prompt of P tokens the target itself samples the token at P, and the
first draft block hangs off anchor P-1 (block input: that token) and proposes P+1..P+G; so a slot counts when the
token it proposes is at a position >= P+1 inside the row (the rule of `dspark_stage.greedy_acceptance`).

Two ways to use it:
* `dsv41 posttrain dspark` (`run_dspark`): a stage after the policy is final (default on runs/post-opd): a pool of
  the policy's own sampled responses to training problems, drafter steps on minibatches of it, acceptance per draft
  position on greedy responses to held-out problems before and after (per effort level too), the backbone checked
  bit-identical at the end; resumable (drafter weights, its optimizer, the step).
* `dsv41 posttrain rl --drafter-lr X` (rl.py): one drafter step on every RL update's rollouts, after the policy
  step, with its own optimizer.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv41.posttrain import tasks as T
from dsv41.posttrain.sft import TaskMix, pad_batch
from dsv41.train.dspark_stage import (CONFIDENCE_WEIGHT, acceptance_counts, acceptance_rates, anchor_positions,
                                      drafts_and_targets, slot_positions, soft_cross_entropy)

PREFIX = "mtp."


def drafter_parameters(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.startswith(PREFIX)]


def backbone_digest(model) -> str:
    """sha256 over every parameter and buffer outside the drafter (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name.startswith(PREFIX):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@contextmanager
def backbone_frozen(model):
    """Every parameter outside the drafter without gradient inside the block (restored after)."""
    saved = [(p, p.requires_grad) for n, p in model.named_parameters() if not n.startswith(PREFIX)]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def response_drafts(model, rows: list[list[int]], starts: list[int], pad: int):
    """The drafter over right-padded rows (token lists): (draft logits [B,A,G,V], confidence [B,A,G], target
    logits [B,A,G,V], mask [B,A,G]): anchors from the earliest first draft anchor (start - 1) on, a slot counted
    when its drafted token lies in its row at a position >= starts[b] + 1 (the module docstring says why)."""
    if len(rows) != len(starts) or not rows:
        raise ValueError(f"{len(rows)} rows, {len(starts)} response starts")
    if any(not 1 <= s <= len(r) for r, s in zip(rows, starts)):
        raise ValueError("every response start must lie in 1..len(row)")
    ids = pad_batch(rows, pad)
    T_, G = ids.size(1), model.cfg.dspark_block_size
    if T_ < 2:
        raise ValueError("rows of at least 2 tokens")
    anchors = anchor_positions(T_, min(T_ - 2, max(0, min(starts) - 1)))
    logits, conf, tgt, valid, _ = drafts_and_targets(model, ids, anchors)
    pos = (slot_positions(T_, G, anchors) + 1).to(ids.device)                  # drafted token's position
    lens = torch.tensor([len(r) for r in rows], device=ids.device).view(-1, 1, 1)
    first = torch.tensor(starts, device=ids.device).view(-1, 1, 1) + 1
    mask = valid & (pos.unsqueeze(0) < lens) & (pos.unsqueeze(0) >= first)
    return logits, conf, tgt, mask


def drafter_loss(model, rows: list[list[int]], starts: list[int], pad: int) -> tuple[torch.Tensor, dict]:
    """The DSpark stage's loss (soft cross-entropy against the backbone's distribution + the confidence head's
    acceptance BCE) on response slots, with the backbone frozen (nothing but `mtp.*` gets a gradient)."""
    with backbone_frozen(model):
        logits, conf, tgt, mask = response_drafts(model, rows, starts, pad)
    n = mask.sum().clamp(min=1)
    ce = (soft_cross_entropy(logits, tgt) * mask).sum() / n
    match = (logits.argmax(-1) == tgt.argmax(-1)) & mask
    seen = torch.cumprod(torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], -1).long(), -1).bool() & mask
    bce = F.binary_cross_entropy_with_logits(conf, match.float(), reduction="none")
    conf_loss = (bce * seen).sum() / seen.sum().clamp(min=1)
    return ce + CONFIDENCE_WEIGHT * conf_loss, {"draft_ce": float(ce.detach()), "draft_match": float(match.sum() / n)}


def drafter_step(model, opt, rollouts, pad: int) -> dict:
    """One drafter update on rollouts (prompt + sampled response each); the model is left in eval mode. `opt`
    should hold the drafter's parameters only (`drafter_parameters`): the backbone gets no gradient anyway."""
    rows = [r.prompt_ids + r.output_ids for r in rollouts]
    starts = [len(r.prompt_ids) for r in rollouts]
    model.train()
    try:
        loss, stats = drafter_loss(model, rows, starts, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter_parameters(model), 1.0)
        opt.step()
    finally:
        model.eval()
    return stats


def drafter_optimizer(model, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(drafter_parameters(model), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@torch.no_grad()
def response_acceptance(model, rollouts, pad: int, batch: int = 32) -> dict:
    """Greedy-verification acceptance per draft position (`acceptance_rates`: conditional acceptance a_i, survival
    S_i, tokens per verification step) over the response tokens of rollouts, the target being the backbone's
    argmax (what a verification forward computes). Rollouts are batched by prompt length (fewer wasted anchors)."""
    counts = torch.zeros(model.cfg.dspark_block_size + 1, dtype=torch.long)
    order = sorted(rollouts, key=lambda r: (len(r.prompt_ids), len(r.output_ids)))
    for i in range(0, len(order), batch):
        rs = order[i:i + batch]
        logits, _, tgt, mask = response_drafts(model, [r.prompt_ids + r.output_ids for r in rs],
                                               [len(r.prompt_ids) for r in rs], pad)
        counts += acceptance_counts(logits.argmax(-1), tgt.argmax(-1), mask)
    return acceptance_rates(counts)


def acceptance_by_level(model, rollouts, pad: int) -> dict:
    """`response_acceptance` over all rollouts ("all") and per effort level ("by_level")."""
    levels = sorted({r.effort for r in rollouts})
    return {"all": response_acceptance(model, rollouts, pad),
            "by_level": {b: response_acceptance(model, [r for r in rollouts if r.effort == b], pad) for b in levels}}


# ------------------------------------------------------------------------------------------------ the stage

@dataclass
class DSparkConfig:
    init: str = "runs/post-opd"
    out: str = "runs/post-dspark"
    steps: int = 40
    minutes: float = 2.0             # for the drafter steps, after the sampling
    pool: int = 96                   # the policy's sampled responses to training problems (temperature 1)
    batch: int = 16                  # responses per drafter step, drawn from the pool
    held_out: int = 60               # held-out problems, one greedy response each, levels in turn
    max_tokens: int = T.MAX_TOKENS
    lr: float = 3e-3
    seed: int = 0
    quiet: bool = False
    mix: TaskMix = field(default_factory=TaskMix)

    def check(self) -> "DSparkConfig":
        self.mix.check()
        for k in ("steps", "pool", "batch", "held_out", "max_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"dspark: {k} must be >= 1, got {getattr(self, k)}")
        if self.batch > self.pool:
            raise ValueError(f"dspark: batch {self.batch} larger than the pool {self.pool}")
        if not self.lr > 0:
            raise ValueError(f"dspark: lr must be > 0, got {self.lr}")
        return self


def pool_items(cfg: DSparkConfig) -> list[tuple[T.Problem, int, int]]:
    """The training pool's requests (problem, b, seed): a pure function of cfg.seed."""
    rng = random.Random(f"dspark:{cfg.seed}")
    fam = cfg.mix.families
    return [(T.sample_problem(rng, fam[i % len(fam)], cfg.mix.lo, cfg.mix.hi), rng.choice(cfg.mix.levels),
             rng.randrange(2 ** 31)) for i in range(cfg.pool)]


def held_out_items(cfg: DSparkConfig) -> list[tuple[T.Problem, int, None]]:
    """Held-out problems (never drawn by training), greedy, the training levels in turn."""
    from dsv41.posttrain.rollout import held_out_problems
    probs = held_out_problems(cfg.mix, cfg.held_out, seed=1000 + cfg.seed)
    return [(p, cfg.mix.levels[i % len(cfg.mix.levels)], None) for i, p in enumerate(probs)]


def minibatch(cfg: DSparkConfig, step: int) -> list[int]:
    """Step `step`'s pool indices: a pure function of (seed, step), so a resumed run draws what the whole run drew."""
    return random.Random(f"dspark-batch:{cfg.seed}:{step}").sample(range(cfg.pool), cfg.batch)


def run_dspark(cfg: DSparkConfig, say=print) -> Path:
    """Train the drafter of the checkpoint cfg.init (or resume cfg.out) on the policy's own responses, the
    backbone frozen; write cfg.out (checkpoint, optimizer.pt, dspark.json, dspark.png); returns cfg.out."""
    from dsv41.posttrain.model import load, save
    from dsv41.posttrain.report import Progress, plot_dspark
    from dsv41.posttrain.rollout import make_engine, rollouts
    cfg.check()
    out = Path(cfg.out)
    resume = (out / "posttrain.json").is_file()
    src = out if resume else Path(cfg.init)
    if not (src / "posttrain.json").is_file():
        raise ValueError(f"dspark: {src} is not a post-training checkpoint; make one with `dsv41 posttrain opd` "
                         f"(or sft / rl) first, or pass --checkpoint")
    model, tok, meta = load(src)
    model.eval()
    if resume:
        if meta.get("stage") != "dspark":
            raise ValueError(f"dspark: {out} holds a {meta.get('stage')!r} checkpoint, not a dspark one; "
                             f"pass another --out")
        step, history, before, digest = int(meta["step"]), meta["history"], meta["acceptance_before"], \
            meta["backbone_sha256"]
        say(f"dspark: resuming {out} at step {step}")
    else:
        step, history, before, digest = 0, [], None, backbone_digest(model)
    if backbone_digest(model) != digest:
        raise RuntimeError(f"dspark: the backbone of {src} differs from the one the stage started on")
    opt = drafter_optimizer(model, cfg.lr)
    if resume and (out / "optimizer.pt").is_file():
        opt.load_state_dict(torch.load(out / "optimizer.pt"))
    t0 = time.time()
    eng = make_engine(model, tok, max_batch=64)
    # the backbone never changes in this stage, so the pool sampled once is on-policy for every step
    # pool (sampled) and held-out (greedy) share the engine's batches: one pass of decode steps
    train_items, held_items = pool_items(cfg), held_out_items(cfg)
    rs = rollouts(eng, tok, train_items + held_items, cfg.max_tokens,
                  temperature=[1.0] * len(train_items) + [0.0] * len(held_items))
    pool, held = rs[:len(train_items)], rs[len(train_items):]
    say(f"dspark: {len(pool)} policy responses ({sum(len(r.output_ids) for r in pool)} tokens), "
        f"{len(held)} held-out greedy responses, {time.time() - t0:.0f}s")
    if before is None:
        before = acceptance_by_level(model, held, tok.pad_id)
    bar = Progress("dspark", cfg.steps, step, cfg.quiet)
    t1 = time.time()                 # the budget is the drafter steps' (sampling and measuring are fixed costs)
    while step < cfg.steps and time.time() - t1 < cfg.minutes * 60:
        stats = drafter_step(model, opt, [pool[i] for i in minibatch(cfg, step)], tok.pad_id)
        step += 1
        history.append({"step": step, **stats, "elapsed": time.time() - t0})
        bar.update(f"ce {stats['draft_ce']:.3f} match {stats['draft_match']:.3f}")
    bar.close()
    after = acceptance_by_level(model, held, tok.pad_id)
    if backbone_digest(model) != digest:
        raise RuntimeError("dspark: the backbone changed during drafter training (it must stay frozen)")
    fmt = lambda a: " ".join(f"{x:.3f}" for x in a["acceptance"])   # noqa: E731
    say(f"dspark: {step} steps in {time.time() - t0:.0f}s; held-out acceptance per draft position "
        f"{fmt(before['all'])} -> {fmt(after['all'])}; tokens per step {before['all']['tokens_per_step']:.3f} "
        f"-> {after['all']['tokens_per_step']:.3f}")
    result = {"checkpoint": str(src if not resume else meta["init"]), "steps": step, "held_out": len(held),
              "pool": len(pool), "acceptance_before": before, "acceptance_after": after,
              "backbone_sha256": digest, "backbone_unchanged": True}
    save(model, tok, out, {"stage": "dspark", "step": step, "history": history, "init": result["checkpoint"],
                           "acceptance_before": before, "acceptance_after": after, "backbone_sha256": digest,
                           "config": asdict(cfg)})
    torch.save(opt.state_dict(), out / "optimizer.pt")
    (out / "dspark.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_dspark(result, history, out / "dspark.png")
    return out
