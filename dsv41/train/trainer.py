"""The trainer: one loop for every training stage, on one CPU, one GPU or many processes under `torchrun`
(docs/system.md §5 and §6).

One step: `grad_accum` micro-batches of [batch_size, seq_len] tokens (per process) -> the stage's training module
(its loss; bf16 autocast on GPU, fp32 on CPU) -> backward -> gradient clipping -> the routed optimizers at the
scheduled learning rate -> aux-loss-free bias update from the step's expert loads. What differs between
pretraining and the DSpark drafter stage (tokenizer and weights, what trains, the loss and its extra inputs, the
evaluation, the end-of-run report) is the stage's (stage.py, pretrain.py, dspark_stage.py); the loop asks, never
branches. Parallelism (DDP, FSDP2) is applied to the stage's module from outside (parallel.py): the loop runs
the wrapped module it is handed.

CPU threads: one by default. torch's OpenMP threads spin-wait at every barrier; when the cores are shared
(2 cores, other processes) the tiny model measured ~250 -> ~80 tokens/s with 2 threads against a steady ~180 with
one. `--threads 2` is faster on an idle machine.

Budget: `steps`, or `minutes` of wall time for the whole command (the default, 5): a probe forward/backward
measures the step time and fixes the step count, which then stays fixed (the schedule needs it). A resumed run
keeps its plan unless given a new budget: `steps` is the new total (train from the saved step up to it),
`minutes` this command's time (the probe measures the steps that fit and they are added to the saved step); the
learning-rate schedule is then re-planned at the saved step (`Schedule.replan`, schedule.py), which `replan`
does in a running process too. A total at or below the saved step trains nothing (`train` says so).

Outputs in `out`: the checkpoint (see checkpoint.py), `log.jsonl` (one line per step and per evaluation),
`loss_curve.png`, `summary.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

from dsv41.model.common import set_quantization
from dsv41.train import data as D
from dsv41.train.balance import LoadBalancer
from dsv41.train.checkpoint import load_training_checkpoint, read_train_state, save_training_checkpoint
from dsv41.train.config import DEFAULT_MINUTES, TrainConfig
from dsv41.train.dspark_stage import DSparkStage
from dsv41.train.optim.routing import build_optimizers, format_routing, route_parameters
from dsv41.train.parallel import full_tensor, parallelize, setup_distributed
from dsv41.train.pretrain import PretrainStage
from dsv41.train.report import format_eval, format_summary, plot_history
from dsv41.train.schedule import Schedule, default_warmup
from dsv41.train.stage import Validation

STAGES = {"pretrain": PretrainStage, "dspark": DSparkStage}


class Trainer:
    """Builds everything from a TrainConfig; `run(stop_at)` trains (to `stop_at` steps if given: tests of exact
    resume stop halfway), `replan(total)` moves the budget at the current step, `finish()` evaluates, saves and
    reports."""

    def __init__(self, cfg: TrainConfig, resume: bool | dict = False):
        """`resume`: True to continue the run in `cfg.out`, or its train state already read (`read_train_state`)."""
        self.t0 = time.time()
        cfg.validate()
        self.dist = setup_distributed(cfg.device)
        self.out = Path(cfg.out)
        saved = read_train_state(self.out) if resume is True else resume or None
        if saved is not None:
            cfg = resumed_config(cfg, saved)
        self.cfg, self.stage = cfg, STAGES[cfg.stage](cfg)
        if cfg.threads or self.dist.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "log.jsonl"
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world
        torch.manual_seed(cfg.seed)
        self._build_data_and_model()
        self._build_training()
        self.step, self.history = 0, []
        # before the resume: the measurement starts the optimizers afresh
        fits = None if cfg.steps is not None else self._steps_in_budget(cfg.minutes or DEFAULT_MINUTES)
        if saved is not None:
            self._resume(saved, cfg.steps or int(saved["step"]) + fits)
        else:
            if self.dist.main:
                self.log_path.unlink(missing_ok=True)
            total = cfg.steps or fits
            self._plan(Schedule(total, cfg.warmup if cfg.warmup is not None else default_warmup(total)))
        self.model.zero_grad(set_to_none=True)             # the probe's gradients

    @property
    def total_steps(self) -> int:
        return self.schedule.total

    def _plan(self, schedule: Schedule) -> None:
        """Adopt a learning-rate plan, and the evaluation and save intervals that follow from its length."""
        self.schedule = schedule
        self.eval_every = self.cfg.eval_every or max(1, schedule.total // 8)
        self.save_every = self.cfg.save_every or self.eval_every

    def replan(self, total_steps: int) -> None:
        """Extend (or shorten) the budget to `total_steps` in all, re-planning the schedule at the current step
        exactly as a run resumed here with that budget does (schedule.py)."""
        self._plan(self.schedule.replan(self.step, total_steps))

    # ---------------------------------------------------------------- set-up
    def say(self, *args) -> None:
        if self.dist.main and not self.cfg.quiet:
            print(*args, flush=True)

    def _build_data_and_model(self) -> None:
        from tokenizers import Tokenizer

        cfg, dist, stage = self.cfg, self.dist, self.stage
        self.corpus = D.load_corpus(cfg.data, cfg.val_fraction, D.min_val_chars(cfg.seq_len))
        if self.corpus.note:
            self.say(self.corpus.note)
        self.tokenizer_path, self.provenance = stage.tokenizer(self.out, self.corpus, dist, self.say)
        self.tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        model = stage.build_model(self.tokenizer)
        self.model_cfg = model.cfg
        set_quantization(model, False)
        self.model = model.to(dist.device).train()
        t = time.time()
        train, val = (D.encode_documents(self.tokenizer, docs) for docs in (self.corpus.train, self.corpus.val))
        self.say(f"data: {self.corpus.name}: {len(self.corpus.train)} train / {len(self.corpus.val)} val documents, "
                 f"{len(train):,} / {len(val):,} tokens "
                 f"({self.corpus.provenance['train_bytes'] / max(len(train), 1):.2f} bytes/token), "
                 f"encoded in {time.time() - t:.1f}s")
        self.loader = D.PackedLoader(train, cfg.seq_len, cfg.batch_size, cfg.seed, dist.rank, dist.world)
        self.val_windows = D.eval_windows(val, cfg.seq_len, cfg.eval_windows)
        token_bytes = torch.from_numpy(D.token_byte_lengths(self.tokenizer))
        self.val = Validation(self.val_windows, token_bytes, cfg.batch_size, dist, self._autocast)

    def _autocast(self):
        """bf16 autocast on a GPU; on the CPU a context that changes nothing (fp32)."""
        return torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.dist.device.type == "cuda")

    def _build_training(self) -> None:
        """The stage's module; the routes (what trains, by which optimizer); the module parallelized; the
        optimizers on the parameters it now holds (FSDP2 replaces them: clipping and the optimizers must see the
        sharded ones, or, as seen on CPU/gloo, nothing is clipped and grad_norm is wrong); the balancer."""
        cfg, model, dist = self.cfg, self.model, self.dist
        module = self.stage.train_module(model, self.say)
        trainable = {name for name, _ in model.named_parameters() if name.startswith(self.stage.prefix)}
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)
        self.routes = route_parameters(model, self.model_cfg, cfg.optimizer, trainable, self._probe(module))
        kinds = {r.name: r.kind for r in self.routes}
        for name, p in model.named_parameters():
            p.requires_grad_(kinds[name] not in ("excluded", "frozen"))
        n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.say(f"model: {self.stage.source}, {sum(p.numel() for p in model.parameters()):,} parameters, "
                 f"{n_trained:,} trained ({cfg.stage}); device {dist.device}, world {dist.world}, threads "
                 f"{torch.get_num_threads()}; forward "
                 f"{'fast (training-only, fast.py)' if getattr(module, 'fast', False) else 'reference'}, Muon "
                 f"Newton-Schulz {str(cfg.muon_ns_dtype(dist.device)).removeprefix('torch.')}")
        self.say("optimizer routing (--optimizer " + cfg.optimizer + "):\n" + format_routing(self.routes))
        self.module = parallelize(module, model, dist, cfg.fsdp)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = self._optimizers()
        self.balancer = LoadBalancer(model, cfg.balance_rate, prefix=self.stage.prefix)

    def _optimizers(self):
        return build_optimizers(self.model, self.routes, self.cfg.lr, self.cfg.weight_decay,
                                muon_ns_dtype=self.cfg.muon_ns_dtype(self.dist.device))

    def _probe(self, module) -> set[str]:
        """One forward/backward on the first batch (data position untouched): parameters that get no gradient
        have no gradient path and are frozen (routed experts excepted: a batch may just not pick them).
        Rank 0 decides for everyone. Also measures the step time for a minutes budget."""
        x, y = (t.to(self.dist.device) for t in self.loader.peek())
        times = []
        for _ in range(3 if self.cfg.steps is None else 1):
            t = time.time()
            with self._autocast():
                loss, _ = module(x, y)
            loss.backward()
            times.append(time.time() - t)
        names = {n for n, p in self.model.named_parameters()
                 if p.requires_grad and p.grad is None and ".ffn.experts." not in n}
        # the first pass pays one-time costs; of the others the fastest (noise on shared cores only adds time)
        self.probe_step_time = min(times[1:]) if len(times) > 1 else times[-1]
        return set(self.dist.broadcast(sorted(names)))

    def _steps_in_budget(self, minutes: float) -> int:
        """The steps that fit in `minutes` for the whole command, from the probe's forward/backward time and one
        optimizer step timed on the probe's gradients (then the weights are put back and the optimizers started
        afresh, so that the run is exactly as if nothing had happened)."""
        cfg = self.cfg
        saved = [p.detach().clone() for p in self.trainable]
        t = time.time()
        self.opt.step()
        opt_time = time.time() - t
        with torch.no_grad():
            for p, before in zip(self.trainable, saved):
                p.copy_(before)
        self.opt = self._optimizers()
        step_time = self.dist.broadcast((self.probe_step_time * cfg.grad_accum + opt_time) * 1.05)
        left = minutes * 60 - (time.time() - self.t0)
        # 8 evaluations (+ the final QDQ one and the sample: ~2 more; a forward ~ 0.4 of a forward/backward),
        # a checkpoint with each (~1.5 s), ~10 s at the end
        batches = math.ceil(cfg.eval_windows / cfg.batch_size / self.dist.world)
        reserve = 10 * batches * 0.4 * self.probe_step_time + 8 * 1.5 + 10
        steps = max(1, int((left - reserve) / step_time))
        self.say(f"budget: {minutes:g} min; measured step {step_time:.2f}s (forward/backward "
                 f"{self.probe_step_time:.2f}s, optimizer {opt_time:.2f}s) -> {steps} steps")
        return steps

    # ---------------------------------------------------------------- state
    def save(self) -> None:
        """Rank 0 writes the checkpoint. Under FSDP2 every rank takes part in gathering the full weights and
        writes its own optimizer state (AdamW's moments are sharded) to optimizer.rank{r}.pt."""
        weights = {k: full_tensor(v).detach().cpu() for k, v in self.model.state_dict().items()}  # FSDP2: collective
        state = {"config": dataclasses.asdict(self.cfg), "optimizer": self.opt.state_dict(),
                 "loader": self.loader.state_dict(), "history": self.history, "total_steps": self.total_steps,
                 "schedule": self.schedule.state_dict(),
                 "rng": torch.get_rng_state(), "model_config": self.model_cfg.to_dict()}
        if self.cfg.fsdp:
            torch.save(self.opt.state_dict(), self.out / f"optimizer.rank{self.dist.rank}.pt")
            state["optimizer"] = None
        if self.dist.main:
            corpus = (self.provenance or {}).get("tokenizer_of", {})
            meta = {"stage": self.cfg.stage, "corpus": corpus.get("corpus", "?"), "split": corpus.get("split", "?")}
            save_training_checkpoint(self.out, weights, self.model_cfg, self.tokenizer_path, state, self.step, meta,
                                     self.provenance)
        self.dist.barrier()

    def _resume(self, saved: dict, total_steps: int) -> None:
        """Load the run's weights, optimizer, data position, RNG and history (`saved`: its train state, already
        read) and re-plan it for `total_steps`."""
        state = load_training_checkpoint(self.out, self.model, saved)
        if self.cfg.fsdp:
            state["optimizer"] = torch.load(self.out / f"optimizer.rank{self.dist.rank}.pt", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.history, self.step = list(state["history"]), int(state["step"])
        torch.set_rng_state(state["rng"])
        old = saved_schedule(state, self.cfg)
        self._plan(old.replan(self.step, total_steps))
        if self.total_steps == old.total:
            self.say(f"resumed {self.out} at step {self.step} of {self.total_steps}")
        else:
            cap = f", capped at {self.schedule.cap:.3g}x the peak" if self.schedule.cap < 1 else ""
            self.say(f"resumed {self.out} at step {self.step}: budget {old.total} -> {self.total_steps} steps "
                     f"({self.total_steps - self.step} to train); learning-rate schedule re-planned for "
                     f"{self.total_steps} steps from step {self.step}{cap}")

    def log(self, rec: dict) -> None:
        self.history.append(rec)
        if self.dist.main:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    # ---------------------------------------------------------------- loop
    def _in_eval_mode(self, fn, *args):
        """fn(model, *args) with the model in eval mode (all ranks), back to training mode after."""
        self.model.eval()
        try:
            return fn(self.model, *args)
        finally:
            self.model.train()

    def train_step(self) -> dict:
        cfg, dist = self.cfg, self.dist
        total = torch.zeros(1, dtype=torch.float64)
        metrics: dict[str, float] = {}
        for micro, extras in enumerate(self.stage.micro_extras(self.step, dist)):
            x, y = (t.to(dist.device) for t in self.loader.next())
            sync = micro == cfg.grad_accum - 1 or not hasattr(self.module, "no_sync")
            with (contextlib.nullcontext() if sync else self.module.no_sync()):
                with self._autocast():
                    loss, m = self.module(x, y, *extras)
                (loss / cfg.grad_accum).backward()
            self.balancer.observe()
            total += float(loss.detach())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / cfg.grad_accum
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, cfg.clip if cfg.clip > 0 else float("inf")))
        lr_f = self.schedule.factor(self.step)
        self.opt.set_lr_factor(lr_f)
        self.opt.step()
        bal = self.balancer.step(dist.all_reduce if dist.world > 1 else None)
        dist.all_reduce(total)
        self.step += 1
        return {"step": self.step, "loss": float(total) / cfg.grad_accum / dist.world, "lr": cfg.lr * lr_f,
                "grad_norm": grad_norm, "tokens": self.step * self.tokens_per_step, **bal, **metrics}

    def run(self, stop_at: int | None = None) -> None:
        from tqdm import tqdm

        cfg = self.cfg
        end = self.total_steps if stop_at is None else min(stop_at, self.total_steps)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=cfg.stage, unit="step", dynamic_ncols=True,
                   disable=not self.dist.main or cfg.quiet, mininterval=1.0)
        train_time, steps_run, smooth = 0.0, 0, None
        while self.step < end:
            t = time.time()
            rec = self.train_step()
            train_time += time.time() - t
            steps_run += 1
            rec["elapsed"], rec["tok_per_s"] = time.time() - self.t0, steps_run * self.tokens_per_step / train_time
            self.log(rec)
            smooth = rec["loss"] if smooth is None else 0.9 * smooth + 0.1 * rec["loss"]
            post = f"loss {rec['loss']:.3f} (ema {smooth:.3f}) | {rec['tok_per_s']:.0f} tok/s | lr {rec['lr']:.2e}"
            bar.set_postfix_str(post + (f" | maxvio {rec['maxvio']:.2f}" if "maxvio" in rec else ""), refresh=False)
            bar.update(1)
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                ev = self._in_eval_mode(self.stage.evaluate, self.val)
                self.log({"step": self.step, "tokens": rec["tokens"], **ev})
                if self.dist.main and not cfg.quiet:
                    bar.write(format_eval(self.step, ev))
            if self.step % self.save_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        self.tok_per_s = steps_run * self.tokens_per_step / train_time if steps_run else None
        if self.step < self.total_steps:                   # stopped early on purpose: leave a checkpoint
            self.save()

    # ---------------------------------------------------------------- end
    def finish(self) -> dict:
        cfg = self.cfg
        self.save()
        summary = {"out": str(self.out), "stage": cfg.stage, "steps": self.step, "total_steps": self.total_steps,
                   "tokens": self.step * self.tokens_per_step,
                   "tok_per_s": getattr(self, "tok_per_s", None), "wall_s": time.time() - self.t0,
                   "optimizer": cfg.optimizer, "qat": cfg.qat, "replay": cfg.replay, "world": self.dist.world}
        evals = [h for h in self.history if any(k.startswith("val_") for k in h)]
        summary.update({k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("val_")})
        summary.update(self._in_eval_mode(self.stage.finish, self.val, self.corpus, self.tokenizer))
        if self.dist.main:
            summary["loss_curve"] = str(plot_history(self.history, self.out / "loss_curve.png",
                                                     f"{cfg.preset} {cfg.stage} ({cfg.optimizer})"))
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.say(format_summary(summary))
        self.dist.barrier()
        return summary


def resumed_config(cfg: TrainConfig, saved: dict) -> TrainConfig:
    """A resumed run's settings: the saved run's, with this command's output directory, verbosity, threads and
    budget (none given: the saved plan's total, i.e. continue as planned)."""
    if cfg.steps is None and cfg.minutes is None:
        budget = {"steps": int(saved["total_steps"]), "minutes": None}
    else:
        budget = {"steps": cfg.steps, "minutes": cfg.minutes}
    return TrainConfig(**{**saved["config"], "out": cfg.out, "quiet": cfg.quiet, "threads": cfg.threads, **budget})


def saved_schedule(state: dict, cfg: TrainConfig) -> Schedule:
    """The schedule a train state was planned with (states written before schedules were saved: planned once)."""
    if "schedule" in state:
        return Schedule(**state["schedule"])
    total = int(state["total_steps"])
    return Schedule(total, cfg.warmup if cfg.warmup is not None else default_warmup(total))


def nothing_to_train(cfg: TrainConfig, saved: dict) -> str | None:
    """Why resuming `saved` with `cfg`'s budget trains nothing (a total at or below the saved step), or None."""
    step, total, steps = int(saved["step"]), int(saved["total_steps"]), resumed_config(cfg, saved).steps
    if steps is None or steps > step:
        return None
    if cfg.steps is None:
        return (f"nothing to train: {cfg.out} finished its {total} steps; to train longer give --steps N above "
                f"{step} (the new total) or --minutes M (M more minutes)")
    return (f"nothing to train: {cfg.out} is at step {step} and --steps {steps} is the total budget, not more "
            f"steps; give --steps above {step} or --minutes M (M more minutes)")


def train(cfg: TrainConfig, resume: bool = False, stop_at: int | None = None) -> dict:
    """Build, train and report (the `dsv41 train` command). Resuming to a budget the run has already reached
    says so and trains nothing."""
    saved = read_train_state(cfg.out) if resume else None
    why = None if saved is None else nothing_to_train(cfg, saved)
    if why is not None:
        if not cfg.quiet and int(os.environ.get("RANK", "0")) == 0:
            print(why, flush=True)
        return {"out": str(cfg.out), "steps": int(saved["step"]), "total_steps": int(saved["total_steps"]),
                "trained": False}
    t = Trainer(cfg, resume=saved if saved is not None else False)
    t.run(stop_at)
    if stop_at is not None and t.step < t.total_steps:
        return {"out": str(t.out), "steps": t.step, "total_steps": t.total_steps, "stopped": True}
    return t.finish()
