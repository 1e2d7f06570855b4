"""SFT: supervised fine-tuning on rendered task samples, the first post-training stage (docs/system.md §7).

Each example is a problem of a family drawn uniformly, an effort level b drawn uniformly from the levels and,
independently of b, a trace stride: 1 (the full trace) with probability `full_trace`, else uniform in 1..n. The
reasoning length does not depend on b before RL (the effort line is in the prompt, but nothing in the data ties it
to the length; RL's length term does that). Most examples at stride 1 (every example then teaches every step) and
sums drawn 7 times in 10 are what let the `post` preset learn both families within the budget (the diag of
benchmarks/results/posttrain-cpu-2026-12-05c: with families drawn evenly the mod-10 step was often not learned in
2,500 steps); the other strides cover the lengths RL can choose from. The loss is the mean cross-entropy over the
response tokens (trace, `</think>`, answer, EOS), the prompt masked, plus `indexer_loss` x the indexer objective (`dsv41.train.indexer_loss`, as pretraining has it):
the top-k selection gives the indexers no gradient from the cross-entropy, and a model trained from scratch with
frozen random indexers picks random compressed entries in every sparse layer.
The forward is the pretraining one (`dsv41.train.fast.fast_forward`, FP8 / FP4 QDQ off); the schedule is the
pretraining recipe's (`dsv41.train.schedule.lr_factor`). A batch is a pure function of (seed, step), so a
resumed run draws what the uninterrupted run drew; the checkpoint holds the weights, the optimizer and the step.

`workers` > 1 trains data-parallel in that many spawned processes (gloo on the CPU): each builds the whole batch,
takes its contiguous rows and weights its loss by its share of the batch's response tokens (the indexer term by
its share of the rows), so the summed gradients are the whole batch's up to the order of float sums; the ranks
step identically. The step is bound by per-op overhead on a CPU (a batch of 8 costs ~0.8 of a batch of 16 on one
core), so two workers on two cores take only ~1.1-1.2 x the steps of one in the same time (`benchmarks/sft_step.py`).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv41.model.common import set_quantization
from dsv41.model.step import ForwardOptions
from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import build_model, load, save
from dsv41.posttrain.report import Progress
from dsv41.posttrain.tokenizer import PostTokenizer, load_post_tokenizer
from dsv41.train.fast import fast_forward
from dsv41.train.indexer_loss import IndexerTap, indexer_kl
from dsv41.train.qat import TrainCache
from dsv41.train.schedule import default_warmup, lr_factor

IGNORE = -100
FULL_TRACE = 0.8                  # SFT's share of stride-1 examples (the OPD solver's prior too)


@dataclass
class TaskMix:
    """Which problems a stage draws: families, chain lengths [lo, hi] and the training effort levels."""
    families: tuple[str, ...] = T.FAMILIES
    lo: int = 2
    hi: int = 6
    levels: tuple[int, ...] = (1, 25, 50, 75, 100)

    def check(self) -> "TaskMix":
        for f in self.families:
            T.check_family(f)
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"chain lengths need 1 <= lo <= hi, got [{self.lo}, {self.hi}]")
        if not self.levels or any(not 1 <= b <= 100 for b in self.levels):
            raise ValueError(f"effort levels must be integers in [1, 100], got {self.levels}")
        return self


@dataclass
class SFTConfig:
    out: str = "runs/post-sft"
    steps: int = 2500
    minutes: float = 16.0
    batch: int = 16
    lr: float = 3e-3
    full_trace: float = FULL_TRACE    # probability of stride 1; else uniform in 1..n
    # the last `late_steps` steps draw stride 1 with probability `late_full_trace` instead (a diverse phase after
    # the stride-1-heavy one that teaches the steps: RL then sees length variance in its (x, b) subgroups)
    late_steps: int = 0
    late_full_trace: float = FULL_TRACE
    indexer_loss: float = 1.0         # weight of the indexer objective (0: the indexers stay as initialised)
    # how often each family is drawn (a family not named: 1); sums' mod-10 step needs the larger share
    family_weights: dict = field(default_factory=lambda: {"sums": 0.7, "chase": 0.3})
    seed: int = 0
    quiet: bool = False
    # the reasoning's opening (tasks.plan_head; off by default): echo writes b's band letter first, plan a plan
    # letter that fixes the stride (L with the stride-1 share, else S or M evenly; drawn independently of b)
    echo: bool = False
    plan: bool = False
    # echo_size: the chain length n as a digit after the band letter; merge_top: b = 100 writes J, not K
    # (tasks.plan_head; both off by default)
    echo_size: bool = False
    merge_top: bool = False
    workers: int = 1                  # data-parallel processes (module docstring); the batch is split by rows
    mix: TaskMix = field(default_factory=TaskMix)


def sft_example(rng: random.Random, tok: PostTokenizer, mix: TaskMix, full_trace: float = 0.0,
                weights: tuple[float, ...] | None = None, echo: bool = False,
                plan: bool = False, echo_size: bool = False, merge_top: bool = False) -> tuple[list[int], list[int]]:
    """(ids, targets): one rendered example, the prompt's targets masked; the family drawn with `weights` (one
    per mix family; None: uniform); echo / plan / echo_size / merge_top: the reasoning's opening (SFTConfig)."""
    fam = rng.choices(mix.families, weights)[0] if weights else rng.choice(mix.families)
    p = T.sample_problem(rng, fam, mix.lo, mix.hi)
    b = rng.choice(mix.levels)
    letter = None
    if plan:
        letter = "L" if rng.random() < full_trace else rng.choice("SM")
        stride = T.plan_stride(p, letter)
    else:
        stride = 1 if rng.random() < full_trace else rng.randint(1, p.difficulty)
    prompt = T.prompt_ids(tok, p, b)
    resp = T.response_ids(tok, p, stride, T.plan_head(b, letter, echo, p.difficulty if echo_size else None,
                                                       merge_top))
    ids = prompt + resp
    return ids[:-1], [IGNORE] * (len(prompt) - 1) + resp


def pad_batch(rows: list[list[int]], fill: int) -> torch.Tensor:
    T_ = max(map(len, rows))
    return torch.tensor([r + [fill] * (T_ - len(r)) for r in rows])


def sft_batch(seed: int, step: int, tok: PostTokenizer, mix: TaskMix, batch: int, full_trace: float = 0.0,
              weights: tuple[float, ...] | None = None, echo: bool = False, plan: bool = False,
              echo_size: bool = False, merge_top: bool = False):
    rng = random.Random(f"sft:{seed}:{step}")
    ex = [sft_example(rng, tok, mix, full_trace, weights, echo, plan, echo_size, merge_top) for _ in range(batch)]
    return pad_batch([e[0] for e in ex], tok.pad_id), pad_batch([e[1] for e in ex], IGNORE)


def sft_loss(model, ids: torch.Tensor, targets: torch.Tensor, indexer_loss: float = 0.0, token_share: float = 1.0,
             row_share: float = 1.0):
    """(the cross-entropy over the unmasked targets, the loss to minimise: plus the weighted indexer objective).
    A data-parallel rank's part of a batch: the loss to minimise weights the cross-entropy by `token_share` (its
    share of the batch's targets) and the indexer term by `row_share` (its share of the rows)."""
    with IndexerTap(model) if indexer_loss else contextlib.nullcontext() as tap:
        logits = fast_forward(model, ids, TrainCache(model.cfg, ids.size(0), model.dtype, ids.device),
                              ForwardOptions())
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    total = ce * token_share
    return ce, (total + indexer_loss * row_share * indexer_kl(model, tap) if indexer_loss else total)


def rank_part(ids: torch.Tensor, targets: torch.Tensor, rank: int, world: int):
    """A data-parallel rank's part of a batch: (its contiguous rows of ids and targets, its share of the batch's
    response tokens, its share of the rows): the `sft_loss` weights under which the ranks' gradients sum to the
    whole batch's."""
    B = ids.size(0)
    lo, hi = B * rank // world, B * (rank + 1) // world
    mine = targets[lo:hi]
    return ids[lo:hi], mine, int((mine != IGNORE).sum()) / int((targets != IGNORE).sum()), (hi - lo) / B


def stride_share(cfg: SFTConfig, step: int) -> float:
    """The probability of stride 1 at `step` (else uniform in 1..n): `late_full_trace` in the last `late_steps`."""
    return cfg.late_full_trace if step >= cfg.steps - cfg.late_steps else cfg.full_trace


def run_sft(cfg: SFTConfig, say=print) -> Path:
    """Train (or resume) the SFT checkpoint in cfg.out; returns its directory. cfg.workers > 1: data-parallel in
    that many spawned processes (the module docstring), rank 0 reporting and saving."""
    cfg.mix.check()
    if not (0 <= cfg.full_trace <= 1 and 0 <= cfg.late_full_trace <= 1 and 0 <= cfg.late_steps <= cfg.steps):
        raise ValueError(f"SFT needs stride-1 shares in [0, 1] and 0 <= late_steps <= steps, got "
                         f"{cfg.full_trace}, {cfg.late_full_trace}, {cfg.late_steps} of {cfg.steps}")
    weights = tuple(float(cfg.family_weights.get(f, 1.0)) for f in cfg.mix.families)
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"family weights must be >= 0 with a positive sum, got {cfg.family_weights}")
    if not 1 <= cfg.workers <= cfg.batch:
        raise ValueError(f"SFT workers must be in [1, batch = {cfg.batch}], got {cfg.workers}")
    if cfg.workers == 1:
        return _train(cfg, weights, 0, 1, say)
    load_post_tokenizer(cfg.out)                  # written once, before the ranks read it
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(cfg, weights, os.path.join(d, "rendezvous"), torch.get_num_threads()),
                 nprocs=cfg.workers, join=True)
    say(f"sft: {cfg.workers} data-parallel workers done")
    return Path(cfg.out)


def _rank_main(rank: int, cfg: SFTConfig, weights, rendezvous: str, threads: int) -> None:
    torch.set_num_threads(max(1, threads // cfg.workers))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cfg.workers)
    try:
        _train(cfg, weights, rank, cfg.workers, print)
    finally:
        dist.destroy_process_group()


def _allreduce_grads(params: list, extra: list[float]) -> list[float]:
    """Sum every parameter's gradient over the ranks (a parameter without one on a rank counts zero there; it gets
    none only where no rank gave it one, as an unused expert in a one-process batch) and the floats `extra`."""
    has = [float(p.grad is not None) for p in params]
    buf = torch.cat([p.grad.flatten() if p.grad is not None else p.new_zeros(p.numel()) for p in params]
                    + [torch.tensor(has + list(extra))])
    dist.all_reduce(buf)
    grads = buf[:-len(has) - len(extra)].split([p.numel() for p in params])
    for p, g, h in zip(params, grads, buf[-len(has) - len(extra):-len(extra)].tolist()):
        p.grad = g.view_as(p).clone() if h else None
    return buf[-len(extra):].tolist()


def _train(cfg: SFTConfig, weights, rank: int, world: int, say) -> Path:
    out = Path(cfg.out)
    lead = rank == 0
    tok = load_post_tokenizer(out)
    model, step, opt_state, losses = build_model(tok, cfg.seed), 0, None, []
    if (out / "posttrain.json").is_file():
        model, tok, meta = load(out)
        step, losses = int(meta.get("step", 0)), list(meta.get("losses", []))
        opt_state = torch.load(out / "optimizer.pt") if (out / "optimizer.pt").is_file() else None
        if lead:
            say(f"sft: resuming {out} at step {step}")
    model.train()
    set_quantization(model, False)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    t0, warm = time.time(), default_warmup(cfg.steps)
    bar = Progress("sft", cfg.steps, step, cfg.quiet or not lead)
    stop = cfg.minutes <= 0
    while step < cfg.steps and not stop:
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(step, cfg.steps, warm)
        ids, tg = sft_batch(cfg.seed, step, tok, cfg.mix, cfg.batch, stride_share(cfg, step), weights, cfg.echo,
                            cfg.plan, cfg.echo_size, cfg.merge_top)
        ids, tg, share, rows = rank_part(ids, tg, rank, world)
        loss, total = sft_loss(model, ids, tg, cfg.indexer_loss, share, rows)
        opt.zero_grad(set_to_none=True)
        total.backward()
        stop = time.time() - t0 >= cfg.minutes * 60
        if world > 1:                             # the ranks stop together: any rank past the budget stops all
            loss_sum, late = _allreduce_grads(params, [float(loss.detach()) * share, float(stop)])
            stop = late > 0
        else:
            loss_sum = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(loss_sum)
        bar.update(f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f} (mean of the last 20)")
    bar.close()
    if not lead:
        return out
    say(f"sft: {step} steps, loss {sum(losses[-20:]) / max(1, len(losses[-20:])):.4f}, {time.time() - t0:.0f}s"
        + (f", {world} workers" if world > 1 else ""))
    model.eval()
    set_quantization(model, True)
    meta = {"stage": "sft", "step": step, "config": asdict(cfg), "losses": losses}
    save(model, tok, out, meta)
    torch.save(opt.state_dict(), out / "optimizer.pt")
    return out
