"""`dsv41 train`: pretrain a model from scratch, or train its DSpark drafter on a frozen pretrained backbone.

Examples
    dsv41 train --preset tiny                           # ~5 minutes on 2 CPU cores, Python stdlib as data
    dsv41 train --preset tiny --steps 400 --out runs/t  # a fixed step budget
    dsv41 train --preset tiny --resume --out runs/t     # continue exactly where a run stopped
    dsv41 train --preset tiny --resume --out runs/t --steps 800    # train on to step 800 in all
    dsv41 train --preset tiny --resume --out runs/t --minutes 10   # train about 10 minutes more
    dsv41 train --stage dspark --init runs/train-tiny --out runs/train-tiny-dspark --minutes 3
    torchrun --nproc_per_node 2 -m dsv41.train.cli train --preset tiny --steps 200 --batch-size 4  # CPU, gloo
    torchrun --nproc_per_node 8 -m dsv41.train.cli train --preset tiny --fsdp --device cuda ...   # GPU node (FSDP2)
"""

from __future__ import annotations

import argparse
import dataclasses

from dsv41.train.config import (DEFAULT_MINUTES, DEVICES, DSPARK_DATA, MUON_NS, OPTIMIZERS, REPLAY_MODES,
                                STAGES, TrainConfig)
from dsv41.train.trainer import train


def register(subparsers) -> None:
    d = TrainConfig()
    p = subparsers.add_parser("train", help="train a model (pretraining or the DSpark drafter stage)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=d.preset, help="model preset (tiny, debug, ...) or config.json")
    p.add_argument("--stage", choices=STAGES, default=d.stage)
    p.add_argument("--init", help="dspark stage: the pretrained checkpoint directory")
    p.add_argument("--dspark-data", choices=DSPARK_DATA, default=d.dspark_data,
                   help="dspark stage: train on the backbone's own greedy continuations of corpus prompts "
                        "(greedy: what greedy speculative decoding feeds the drafter) or on corpus windows")
    p.add_argument("--dspark-pool", type=int, default=d.dspark_pool,
                   help="dspark stage, greedy data: prompts continued before training (their rows are reused "
                        "over passes)")
    p.add_argument("--data", help="text file, directory or JSONL ('text' field); default: the Python standard library")
    p.add_argument("--out", help="output / checkpoint directory (default runs/train-<preset>[-dspark])")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="share of documents (by name hash) held out for validation; a corpus too small for that "
                        "(a dozen files, one file) gives this share of every document's tail instead")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out exactly: to its planned end, or to a new budget (--steps N: the "
                        "new total, --minutes M: about M more minutes; the learning-rate schedule is re-planned at "
                        "the saved step, never rising)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps in all (with --resume: the step to train up to)")
    budget.add_argument("--minutes", type=float, help=f"wall-time budget of this command (default "
                                                      f"{DEFAULT_MINUTES:g} when --steps is not given; with "
                                                      f"--resume: that much more training)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per process and micro-batch")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (shared by all routes)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup", type=int, help="warmup steps (default 5%% of the run)")
    p.add_argument("--clip", type=float, default=d.clip, help="gradient-norm clip (0: off)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                   help="muon: head-wise Muon + Muon + Sinkhorn + AdamW by route; adamw: AdamW for everything")
    p.add_argument("--muon-ns", choices=MUON_NS, default=d.muon_ns,
                   help="Newton-Schulz dtype of the Muon routes (auto: bf16 on GPUs and on CPUs with AMX, else fp32)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=d.fast,
                   help="the training-only fast forward (same function as the model's, dense masked attention, "
                        "batched experts; dsv41/train/fast.py); --no-fast: the reference forward")
    p.add_argument("--indexer-loss-weight", type=float, default=d.indexer_loss_weight,
                   help="weight of the indexers' KL objective against the attention (the only gradient the "
                        "indexers get; the rest of the model does not see it); 0: indexers stay at their init")
    p.add_argument("--qat", action="store_true", help="fake-quantize the FP4 main KV (straight-through)")
    p.add_argument("--replay", choices=REPLAY_MODES, default=d.replay,
                   help="simulate bounded replay: truncate the sliding windows of the decoder / encoder / all "
                        "layers at a random replay start per sequence (docs/system.md §2 and §4)")
    p.add_argument("--balance-rate", type=float, default=d.balance_rate, help="aux-loss-free bias step u")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="validation windows per evaluation")
    p.add_argument("--threads", type=int, help="torch CPU threads (default on CPU: 1, steady on shared cores)")
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 instead of DDP (under torchrun; NCCL on GPUs, gloo on CPU)")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="greedy sample length at the end")
    p.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    out = args.out or f"runs/train-{args.preset}" + ("-dspark" if args.stage == "dspark" else "")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    train(TrainConfig(**{**given, "out": out}), resume=args.resume, stop_at=args.stop_at)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dsv41.train.cli train ...` (what `torchrun -m` needs: a module with a main). Only the train
    command is registered: training never imports the server layer."""
    from dsv41.cli import run                   # the entry point's runner (it imports no command module)

    parser = argparse.ArgumentParser(prog="dsv41")
    register(parser.add_subparsers(dest="command", required=True))
    return run(parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
