"""`dsv41 posttrain`: the post-training stages on the `post` preset (docs/system.md §7).

Examples
    dsv41 posttrain sft --minutes 4                     # -> runs/post-sft
    dsv41 posttrain rl --minutes 8                      # runs/post-sft -> runs/post-rl
    dsv41 posttrain opd --minutes 4                     # runs/post-rl -> runs/post-opd
    dsv41 posttrain eval --checkpoint runs/post-rl --baseline runs/post-sft --problems 500
    dsv41 posttrain all                                 # the four in a row, ~20 minutes on 2 CPU cores

A stage run again on its output directory resumes (SFT and RL: weights, optimizer, step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv41.posttrain.sft import SFTConfig, TaskMix, run_sft

STAGES = ("sft", "rl", "opd", "eval", "all")


def register(subparsers) -> None:
    p = subparsers.add_parser("posttrain", help="post-training: SFT, RL with controllable effort, OPD, evaluation",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--runs", default="runs", help="directory of the post-* checkpoints (default runs)")
    p.add_argument("--minutes", type=float, help="time budget of the stage (default: its own)")
    p.add_argument("--steps", type=int, help="step budget of the stage (default: its own)")
    p.add_argument("--checkpoint", help="eval: the checkpoint to evaluate (default runs/post-rl)")
    p.add_argument("--baseline", help="eval: a checkpoint to compare with, paired (default runs/post-sft)")
    p.add_argument("--problems", type=int, default=200, help="eval: held-out problems per level (default 200)")
    p.add_argument("--levels", default="1,25,50,75,100", help="effort levels, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def _budget(cfg, args):
    if args.minutes is not None:
        cfg.minutes = args.minutes
    if args.steps is not None:
        cfg.steps = args.steps
    return cfg


def main(args) -> int:
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    levels = tuple(int(x) for x in args.levels.split(","))
    mix = TaskMix(levels=levels).check()
    runs = Path(args.runs)
    stages = ("sft", "rl", "opd", "eval") if args.stage == "all" else (args.stage,)
    for st in stages:
        if st == "sft":
            run_sft(_budget(SFTConfig(out=str(runs / "post-sft"), seed=args.seed, mix=mix), args))
        elif st == "rl":
            from dsv41.posttrain.rl import RLConfig, run_rl
            run_rl(_budget(RLConfig(init=str(runs / "post-sft"), out=str(runs / "post-rl"), seed=args.seed,
                                    mix=mix), args))
        elif st == "opd":
            from dsv41.posttrain.opd import OPDConfig, run_opd
            run_opd(_budget(OPDConfig(init=str(runs / "post-rl"), out=str(runs / "post-opd"), seed=args.seed,
                                      mix=mix), args))
        else:
            report = run_eval(args.checkpoint or str(runs / "post-rl"), args.baseline or str(runs / "post-sft"),
                              args.problems, mix)
            print(json.dumps(report, indent=2))
    return 0


def run_eval(checkpoint: str, baseline: str | None, n: int, mix: TaskMix) -> dict:
    """Greedy accuracy and reasoning length per level on n held-out problems, the affine fit per difficulty,
    and, against the baseline, the paired sign test of accuracy (written to <checkpoint>/eval.json)."""
    from dsv41.posttrain.model import load
    from dsv41.posttrain.rollout import evaluate, held_out_problems, sign_test, summarize
    problems = held_out_problems(mix, n)
    model, tok, _ = load(checkpoint)
    res = evaluate(model, tok, problems, mix.levels, max_tokens=32)
    report = {"checkpoint": checkpoint, **summarize(res)}
    if baseline and Path(baseline).is_dir():
        bmodel, btok, _ = load(baseline)
        bres = evaluate(bmodel, btok, problems, mix.levels, max_tokens=32)
        flat = lambda r: [c for b in mix.levels for c in r[b]["correct"]]   # noqa: E731
        report["baseline"] = {"checkpoint": baseline, **summarize(bres)}
        report["paired"] = sign_test(flat(bres), flat(res))
    (Path(checkpoint) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
