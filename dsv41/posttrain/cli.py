"""`dsv41 posttrain`: the post-training stages on the `post` preset (docs/system.md §7).

Examples
    dsv41 posttrain sft                                 # -> runs/post-sft (2,500 steps, ~15 minutes)
    dsv41 posttrain rl --minutes 8                      # runs/post-sft -> runs/post-rl
    dsv41 posttrain opd --minutes 4                     # runs/post-rl -> runs/post-opd
    dsv41 posttrain dspark --minutes 2                  # runs/post-opd -> runs/post-dspark (drafter only)
    dsv41 posttrain eval --checkpoint runs/post-rl --baseline runs/post-sft --problems 500
    dsv41 posttrain all                                 # sft, rl, opd, dspark, eval in a row, ~20 minutes on 2 cores
    dsv41 posttrain rl --drafter-lr 3e-3                # RL that also trains the drafter on every update's rollouts
    dsv41 posttrain rl --dispatch batch --out runs/post-rl-batch   # another dispatch granularity, to compare
    dsv41 posttrain team --checkpoint runs/post-rl      # the multi-agent task: solo vs split, derived latency
    dsv41 posttrain report --out DIR                    # the closing numbers of runs/post-* -> DIR/closing.{json,md}

A stage run again on its output directory resumes (SFT, RL and DSpark: weights, optimizer, step).
The DSpark stage trains only the drafter (`mtp.*`) on the checkpoint's own sampled responses, the backbone frozen
(checked bit-identical), and writes the acceptance per draft position on held-out greedy responses, before and
after, to <out>/dspark.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dsv41.posttrain.sft import SFTConfig, TaskMix, run_sft
from dsv41.posttrain.tasks import FAMILIES

STAGES = ("sft", "rl", "opd", "dspark", "eval", "team", "all", "report")

# `posttrain all`: the whole pipeline in about 20 minutes on 2 cores, with a budget per stage (minutes; the
# evaluation's is its problem count: 200 per level, two processes), on the controllable-effort recipe of
# benchmarks/results/posttrain-cpu-2026-12-07e / -07f: SFT writes the plan head (band letter, size digit, plan
# letter) over dense levels with four held out, RL trains the plan letter under the plan grammar (sums, split
# credit, an entropy bonus on the plan, the plan letter weighted 8x), and the evaluation decodes under the same
# grammar. `--minutes` of `all` is the pipeline's total (each stage's budget scales with it); a flag given a value
# other than its default overrides the recipe's.
# SFT's 1,500 steps take 470-520 s with 2 workers (2 cores); OPD: + ~100 s of its dense teacher and ~70 s of its evaluation
PIPELINE_MINUTES = {"sft": 9.5, "rl": 3.0, "opd": 1.0, "dspark": 0.75}
PIPELINE_OPD_EVAL = 50              # OPD's student-vs-teacher problems per level in the pipeline (default 100)
PIPELINE_TOTAL = 20.0
PIPELINE_SFT_STEPS, PIPELINE_SFT_LATE = 1500, 300   # 0.31-0.34 s a step with 2 workers (2 cores)
PIPELINE = {"levels": "1-100", "hold_out": "12,37,62,87", "echo": True, "plan": True, "echo_size": True,
            "merge_top_band": True, "late_full_trace": 0.4, "constrain": "sml", "dispatch": "sync",
            "credit": "split", "plan_entropy": 0.1, "plan_weight": 8.0, "k0": 1.0, "lam": 6.0, "cmax": 2.0,
            "levels_per_prompt": 4, "delta_b": 24.75, "samples": 4, "prompts": 4, "paired_seeds": True,
            "eval_workers": 2, "workers": 2, "problems": 100}
PIPELINE_RL = {"families": "sums", "lr": 1e-3}       # the RL stage's own (the other stages keep theirs)
_DEFAULTS: dict = {}                                 # the parser's defaults: a flag left at its default


def register(subparsers) -> None:
    p = subparsers.add_parser("posttrain", help="post-training: SFT, RL with controllable effort, OPD, evaluation",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--runs", default="runs", help="directory of the post-* checkpoints (default runs)")
    p.add_argument("--minutes", type=float, help="time budget of the stage (default: its own; all: the pipeline's "
                   "total, 20, shared out as PIPELINE_MINUTES)")
    p.add_argument("--steps", type=int, help="step budget of the stage (default: its own)")
    p.add_argument("--checkpoint", help="eval: the checkpoint to evaluate (default runs/post-rl); dspark: the "
                   "post-trained checkpoint whose drafter trains (default runs/post-opd)")
    p.add_argument("--baseline", help="eval: a checkpoint to compare with, paired (default runs/post-sft)")
    p.add_argument("--problems", type=int, default=200, help="eval: held-out problems per level (default 200)")
    p.add_argument("--levels", default="1,25,50,75,100",
                   help="training effort levels, comma-separated, ranges allowed (1-100)")
    p.add_argument("--hold-out", default="",
                   help="effort levels removed from --levels (e.g. 12,37,62,87 with --levels 1-100)")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="task families the stage draws, comma-separated (default: all, " + ",".join(FAMILIES) + ")")
    p.add_argument("--full-trace", type=float, help="sft: the share of stride-1 (full trace) examples (default 0.8)")
    p.add_argument("--late-steps", type=int, help="sft: the last steps draw strides with --late-full-trace (default 0)")
    p.add_argument("--late-full-trace", type=float, help="sft: the stride-1 share of the late steps")
    p.add_argument("--echo", action="store_true",
                   help="sft: the reasoning opens with the effort band letter (b // 10 as A..K; a reading of b "
                   "that does not change the length)")
    p.add_argument("--plan", action="store_true",
                   help="sft: the reasoning opens with a plan letter S / M / L (empty / two chunks / full trace) "
                   "that fixes the stride, drawn independently of b (L with the stride-1 share)")
    p.add_argument("--echo-size", action="store_true",
                   help="sft: after the band letter the reasoning writes the chain length n as a digit (the plan "
                   "letter's position then sees b's band and n)")
    p.add_argument("--merge-top-band", action="store_true",
                   help="sft: b = 100 echoes J like 90-99 (default: K, a letter of its own)")
    p.add_argument("--eval-levels", default="1,12,25,37,50,62,75,87,100",
                   help="eval: effort levels, the training ones and held-out ones between them")
    p.add_argument("--eval-batch", type=int, default=32,
                   help="eval: the engine's slots (default 32; deterministic mode: the responses do not depend on it)")
    p.add_argument("--workers", type=int, default=1,
                   help="sft: data-parallel processes, each on a contiguous part of every batch (gloo on the CPU; "
                   "the machine's threads shared out among them; default 1)")
    p.add_argument("--eval-workers", type=int, default=1,
                   help="eval: processes, each on a contiguous slice of the problems with its own engine (the "
                   "seeds follow the problem's index, so the result does not depend on it; default 1)")
    p.add_argument("--dispatch", default="sample", choices=("sync", "sample", "prompt", "batch"),
                   help="rl: synchronous steps or the dispatcher's granularity (default sample)")
    p.add_argument("--drafter-lr", type=float, default=0.0,
                   help="rl: also train the drafter on every update's rollouts at this learning rate (default 0: "
                   "off); dspark: its learning rate (default 3e-3)")
    p.add_argument("--lr", type=float, help="the stage's learning rate (default: its own)")
    p.add_argument("--k0", type=float, help="rl: the length term's k0 (default: LengthReward's)")
    p.add_argument("--lam", type=float, help="rl: the length term's lambda, tau = lambda delta_b (default: its own)")
    p.add_argument("--cmax", type=float, help="rl: the length term's cap C_max (default: its own)")
    p.add_argument("--samples", type=int, help="rl: M_b, samples per (x, b) (default: RLConfig's)")
    p.add_argument("--prompts", type=int, help="rl: prompts (groups) per update (default: RLConfig's)")
    p.add_argument("--levels-per-prompt", type=int,
                   help="rl: levels each prompt is sampled at, drawn from --levels (default 0: all of them)")
    p.add_argument("--delta-b", type=float, help="rl: delta_b of tau = lambda delta_b (default: the levels' mean "
                   "spacing; 24.75 keeps the five-level k(b) on a dense grid)")
    p.add_argument("--k0-rate", type=float, help="rl: > 0 lets k0 follow the sampled length so the mean length "
                   "holds at the first update's (k0 *= exp(rate (L_ema - L_0) / L_0); default 0: fixed k0)")
    p.add_argument("--epochs", type=int, help="rl: optimizer steps per update on the same rollouts (default 1)")
    p.add_argument("--paired-seeds", action="store_true",
                   help="rl: the same M sampling seeds at every level of a prompt (common random numbers)")
    p.add_argument("--adv-norm", action="store_true", help="rl: divide advantages by their (x, b) subgroup's std")
    p.add_argument("--credit", default="all", choices=("all", "split", "decision"),
                   help="rl: which tokens carry which advantage: all (default) every response token the full one "
                   "(score + length term); split: the plan letter the full one, the trace and answer the score-only "
                   "one, the echo (band letter, size digit) out of the loss; decision: as split, and a response "
                   "without a plan letter gives the full one to the token in the plan letter's place")
    p.add_argument("--constrain", default="", choices=("", "sml", "strides"),
                   help="rl / eval: sample (and, rl, score) every response under the plan grammar of this plan set "
                        "(posttrain/constrain.py: the plan letter fixes the trace; rl needs --dispatch sync; eval "
                        "applies it to the checkpoint and the baseline alike); default off")
    p.add_argument("--plan-entropy", type=float,
                   help="rl with --constrain: alpha of the entropy bonus on the plan letter (default 0)")
    p.add_argument("--plan-weight", type=float,
                   help="rl with --constrain: the plan letter's weight in the loss (surrogate and entropy bonus; "
                        "default 1)")
    p.add_argument("--init", help="rl: the checkpoint RL starts from (default <runs>/post-sft)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="eval: 0 greedy (default); > 0 sampled at that temperature, one seed per (problem, level)")
    p.add_argument("--out", help="the stage's output directory (default runs/post-<stage>)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
    _DEFAULTS.update({a.dest: a.default for a in p._actions})


def apply_pipeline(args) -> float:
    """`all`: the recipe's values for every flag left at its default (PIPELINE); -> the budget scale (the total
    `--minutes` over PIPELINE_TOTAL, 1 without it)."""
    for k, v in PIPELINE.items():
        if getattr(args, k) == _DEFAULTS.get(k):
            setattr(args, k, v)
    return 1.0 if args.minutes is None else args.minutes / PIPELINE_TOTAL


def parse_levels(text: str, hold_out: str = "") -> tuple[int, ...]:
    """`1,25,50` or ranges `1-100` (inclusive), sorted, without the levels of `hold_out`."""
    got = set()
    for part in (x.strip() for x in text.split(",") if x.strip()):
        if "-" in part:
            a, b = (int(y) for y in part.split("-", 1))
            got.update(range(a, b + 1))
        else:
            got.add(int(part))
    got -= {int(x) for x in hold_out.split(",") if x.strip()}
    return tuple(sorted(got))


def parse_families(text: str) -> tuple[str, ...]:
    """`sums,chase` -> ("sums", "chase"), in the order given, without repeats; at least one."""
    got = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not got:
        raise ValueError("no task family given")
    return got


def _budget(cfg, args):
    if args.minutes is not None:
        cfg.minutes = args.minutes
    if args.steps is not None:
        cfg.steps = args.steps
    if getattr(args, "lr", None) is not None and hasattr(cfg, "lr"):
        cfg.lr = args.lr
    return cfg


def main(args) -> int:
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pipeline = args.stage == "all"
    scale = apply_pipeline(args) if pipeline else 1.0
    levels = parse_levels(args.levels, args.hold_out)
    mix = TaskMix(families=parse_families(args.families), levels=levels).check()
    runs = Path(args.runs)
    stages = ("sft", "rl", "opd", "dspark", "eval") if pipeline else (args.stage,)
    if args.drafter_lr < 0:
        raise SystemExit(f"--drafter-lr must be >= 0, got {args.drafter_lr}")
    t_all = time.time()
    for st in stages:
        out = args.out if args.out and not pipeline else str(runs / f"post-{st}")
        t0 = time.time()
        if pipeline and st in PIPELINE_MINUTES:          # the stage's share of the pipeline's budget
            args.minutes = PIPELINE_MINUTES[st] * scale
        if st == "sft":
            cfg = _budget(SFTConfig(out=out, seed=args.seed, mix=mix, quiet=args.quiet), args)
            if pipeline and args.steps is None:
                cfg.steps, cfg.late_steps = PIPELINE_SFT_STEPS, PIPELINE_SFT_LATE
            for name in ("full_trace", "late_steps", "late_full_trace"):
                if getattr(args, name) is not None:
                    setattr(cfg, name, getattr(args, name))
            cfg.echo, cfg.plan = args.echo, args.plan
            cfg.echo_size, cfg.merge_top = args.echo_size, args.merge_top_band
            cfg.workers = args.workers
            run_sft(cfg)
        elif st == "rl":
            from dsv41.posttrain.rl import RLConfig, run_rl
            init = args.init if args.init and not pipeline else str(runs / "post-sft")
            rl_mix = mix
            if pipeline:
                rl_mix = TaskMix(families=parse_families(PIPELINE_RL["families"]), levels=levels).check()
            cfg = _budget(RLConfig(init=init, out=out, seed=args.seed, mix=rl_mix, dispatch=args.dispatch,
                                   quiet=args.quiet, drafter_lr=args.drafter_lr, adv_norm=args.adv_norm,
                                   paired_seeds=args.paired_seeds, credit=args.credit,
                                   constrain=args.constrain), args)
            for name in ("samples", "prompts", "levels_per_prompt", "epochs", "k0_rate", "plan_entropy",
                         "plan_weight"):
                if getattr(args, name) is not None:
                    setattr(cfg, name, getattr(args, name))
            for name, field in (("k0", "k0"), ("lam", "lam"), ("cmax", "c_max"), ("delta_b", "delta_b")):
                if getattr(args, name) is not None:
                    setattr(cfg.length, field, getattr(args, name))
            if pipeline:                                 # the budget ends the stage, not a step count
                cfg.lr = PIPELINE_RL["lr"] if args.lr is None else args.lr
                cfg.steps = 10_000 if args.steps is None else args.steps
            run_rl(cfg)
        elif st == "opd":
            from dsv41.posttrain.opd import OPDConfig, run_opd
            cfg = _budget(OPDConfig(init=str(runs / "post-rl"), out=out, seed=args.seed, mix=mix), args)
            if pipeline:
                cfg.eval_problems = PIPELINE_OPD_EVAL
            run_opd(cfg)
        elif st == "dspark":
            from dsv41.posttrain.dspark import DSparkConfig, run_dspark
            cfg = DSparkConfig(init=args.checkpoint if args.checkpoint and args.stage != "all" else
                               str(runs / "post-opd"), out=out, seed=args.seed, mix=mix, quiet=args.quiet)
            if args.drafter_lr:
                cfg.lr = args.drafter_lr
            run_dspark(_budget(cfg, args))
        elif st == "report":
            from dsv41.posttrain.report import closing, closing_markdown
            c = closing(runs)
            md = closing_markdown(c)
            if args.out:
                import shutil
                dest = Path(args.out)
                dest.mkdir(parents=True, exist_ok=True)
                (dest / "closing.json").write_text(json.dumps(c, indent=2) + "\n")
                (dest / "closing.md").write_text(md + "\n")
                for png in sorted(runs.glob("post-*/*.png")):
                    shutil.copy(png, dest / f"{png.parent.name}-{png.name}")
            print(md)
        elif st == "team":
            print(json.dumps(run_team(args.checkpoint or str(runs / "post-rl"), args.problems), indent=2))
        else:
            eval_mix = TaskMix(mix.families, mix.lo, mix.hi, tuple(int(x) for x in args.eval_levels.split(",")))
            report = run_eval(args.checkpoint or str(runs / "post-rl"), args.baseline or str(runs / "post-sft"),
                              args.problems, eval_mix.check(), args.temperature, args.eval_batch, args.constrain,
                              args.eval_workers)
            print(json.dumps(report, indent=2))
        print(f"posttrain {st}: {time.time() - t0:.0f}s wall")
    if pipeline:
        print(f"posttrain all: {time.time() - t_all:.0f}s wall (budget {PIPELINE_TOTAL * scale:.0f} minutes)")
    return 0


def run_team(checkpoint: str, n: int, workers: int = 2) -> dict:
    """The multi-agent task (team.py) with the checkpoint's agents: solo and split plans on n held-out sums."""
    from dsv41.posttrain.model import load
    from dsv41.posttrain.rollout import held_out_problems
    from dsv41.posttrain.team import ModelAgent, score_team
    model, tok, _ = load(checkpoint)
    problems = held_out_problems(TaskMix(families=("sums",), lo=4, hi=6), n)
    agent = ModelAgent(model, tok)
    return {plan: score_team(problems, agent, plan, workers) for plan in ("solo", "split")}


def _suffix(temperature: float, constrain: str) -> str:
    """The file-name suffix of an evaluation: "" greedy, "_t<T>" sampled, then "_c<plan set>" when constrained."""
    return ("" if temperature == 0 else f"_t{temperature:g}") + (f"_c{constrain}" if constrain else "")


def _evaluate_slice(checkpoint: str, problems, first: int, levels, temperature: float, batch: int, constrain: str,
                    threads: int = 0) -> dict:
    """evaluate() of the checkpoint on problems[first:] of the held-out list (its own engine; threads > 0 sets
    torch's intra-op threads, for a worker process)."""
    import torch
    from dsv41.posttrain import tasks as T
    from dsv41.posttrain.model import load
    from dsv41.posttrain.rollout import evaluate
    if threads > 0:
        torch.set_num_threads(threads)
    model, tok, _ = load(checkpoint)
    grammar = None
    if constrain:
        from dsv41.posttrain.constrain import Grammar
        grammar = lambda p, b: Grammar(tok, p, b, constrain)   # noqa: E731
    return evaluate(model, tok, problems, levels, max_tokens=T.MAX_TOKENS, temperature=temperature, batch=batch,
                    grammar=grammar, first=first)


def _evaluate_sharded(checkpoint: str, problems, levels, temperature: float, batch: int, constrain: str,
                      workers: int) -> dict:
    """The problems cut into `workers` contiguous slices, each evaluated in a spawned process with an equal share
    of torch's threads; the slices' lists joined in order (equal to one process's result: the seeds follow the
    problem's index and the engine's deterministic mode makes a response independent of its batch)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    import torch
    workers = max(1, min(workers, len(problems)))
    cuts = [len(problems) * k // workers for k in range(workers + 1)]
    threads = max(1, torch.get_num_threads() // workers)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        parts = [pool.submit(_evaluate_slice, checkpoint, problems[a:z], a, tuple(levels), temperature, batch,
                             constrain, threads) for a, z in zip(cuts, cuts[1:])]
        parts = [f.result() for f in parts]
    return {b: {k: [x for part in parts for x in part[b][k]] for k in parts[0][b]} for b in levels}


def _evaluate_cached(checkpoint: str, problems, mix: TaskMix, temperature: float = 0.0, batch: int = 32,
                     constrain: str = "", workers: int = 1) -> dict:
    """evaluate() of the checkpoint, reusing <checkpoint>/eval_raw.json when it holds the same problems and levels
    and the checkpoint's weights are not newer (a checkpoint is then evaluated once, whatever it is paired with).
    workers > 1: in that many processes (`_evaluate_sharded`), the same result."""
    raw = Path(checkpoint) / f"eval_raw{_suffix(temperature, constrain)}.json"
    key = {"problems": [p.content for p in problems], "levels": list(mix.levels), "temperature": temperature}
    if constrain:
        key["constrain"] = constrain
    newest = max((f.stat().st_mtime for f in Path(checkpoint).iterdir() if not f.name.startswith("eval_raw")
                  and f.suffix in (".pt", ".safetensors", ".json") and not f.name.startswith("eval")), default=0.0)
    if raw.is_file() and raw.stat().st_mtime >= newest:
        got = json.loads(raw.read_text())
        if got.get("key") == key:
            return {int(b): v for b, v in got["res"].items()}
    if workers > 1:
        res = _evaluate_sharded(checkpoint, problems, mix.levels, temperature, batch, constrain, workers)
    else:
        res = _evaluate_slice(checkpoint, problems, 0, mix.levels, temperature, batch, constrain)
    raw.write_text(json.dumps({"key": key, "res": res}) + "\n")
    return res


def run_eval(checkpoint: str, baseline: str | None, n: int, mix: TaskMix, temperature: float = 0.0,
             batch: int = 32, constrain: str = "", workers: int = 1) -> dict:
    """Greedy (or, temperature > 0, sampled) accuracy and reasoning length per level on n held-out problems, the
    affine fit per difficulty, and, against the baseline, the paired sign test of accuracy (written to
    <checkpoint>/eval.json; a sampled evaluation to eval_t<T>.json)."""
    from dsv41.posttrain.rollout import held_out_problems, sign_test, summarize
    problems = held_out_problems(mix, n)
    res = _evaluate_cached(checkpoint, problems, mix, temperature, batch, constrain, workers)
    report = {"checkpoint": checkpoint, "temperature": temperature, "constrain": constrain, **summarize(res)}
    if baseline and Path(baseline).is_dir():
        bres = _evaluate_cached(baseline, problems, mix, temperature, batch, constrain, workers)
        flat = lambda r: [c for b in mix.levels for c in r[b]["correct"]]   # noqa: E731
        report["baseline"] = {"checkpoint": baseline, **summarize(bres)}
        report["paired"] = sign_test(flat(bres), flat(res))
        # the (problem, level) pairs share problems: the per-problem test counts each problem once (correct
        # answers summed over the levels, improved / worsened / tied)
        per = lambda r: [sum(r[b]["correct"][i] for b in mix.levels) for i in range(len(problems))]   # noqa: E731
        report["paired_by_problem"] = sign_test(per(bres), per(res))
        report["paired_by_level"] = {b: sign_test(bres[b]["correct"], res[b]["correct"]) for b in mix.levels}
    name = "eval" + _suffix(temperature, constrain)
    (Path(checkpoint) / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    from dsv41.posttrain.report import plot_eval
    plot_eval(report, Path(checkpoint) / f"{name}.png")
    return report
