"""`dsv41 experiments`: the studies docs/system.md §9 asks for, on a trained task model, each writing
runs/experiments/NAME/{report.md, report.json, plot.png}; the task data they need; the indexer's recall.

Examples
    dsv41 experiments train-task --out runs/experiments/task-kv-compact     # the task model (curriculum, ~20 min)
    dsv41 experiments accuracy --checkpoint runs/experiments/task-kv-compact
    dsv41 experiments run needle --checkpoint runs/experiments/task-kv-compact --task kv-compact
    dsv41 experiments run budget --scale 0.5                                # trains one task model per KV split
    dsv41 experiments run all --checkpoint runs/experiments/task-kv-compact --task kv-compact --size 32 --scale 0.5
    dsv41 experiments task kv-retrieval --out runs/experiments/data/kv-retrieval-60.jsonl --docs 3000 --size 60
    dsv41 train --preset tiny --data runs/experiments/data/kv-retrieval-60.jsonl --seq-len 512 --batch-size 4 \\
        --out runs/experiments/task-kv-tiny
    dsv41 experiments recall --checkpoint runs/experiments/task-kv-tiny
    dsv41 experiments run approximations --checkpoint runs/experiments/task-kv-tiny
    dsv41 experiments run replay --checkpoint runs/experiments/task-kv-tiny
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

STUDIES = ("approximations", "replay", "needle", "budget")


def register(subparsers) -> None:
    p = subparsers.add_parser("experiments", help="the docs/system.md §9 studies, task data, indexer recall",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="experiments_command", required=True)
    run = sub.add_parser("run", help="run a study and write its report under --out/NAME")
    run.add_argument("name", choices=STUDIES + ("all",))
    _model_args(run)
    run.add_argument("--out", default="runs/experiments")
    run.add_argument("--scale", type=float, default=1.0, help="budget: the curriculum's steps x SCALE per model")
    run.add_argument("--splits", default=None, help="budget: the KV splits to train, comma-separated (default all: "
                     "preset, swapped, three m=2, six m=4, m=1 4 4, m=4 4 1)")
    run.add_argument("--curriculum", choices=("cpu", "long"), default="cpu", help="budget: the task models' "
                     "curriculum (long: on to 4K-token windows, the GPU sweep)")
    run.add_argument("--train-seed", type=int, default=0, help="budget: the task models' training seed")
    run.add_argument("--lr", type=float, default=None, help="budget: its task models' peak learning rate "
                     "(default train-task's)")
    run.add_argument("--sizes", default=None, help="needle / budget: document sizes (pairs per document), "
                     "comma-separated (default: needle 16,32,64; budget 8,16,32)")
    run.set_defaults(func=_run)
    task = sub.add_parser("task", help="write a long-context task's training documents as JSONL")
    task.add_argument("name", help="kv-retrieval | kv-compact | needle")
    task.add_argument("--out", required=True)
    task.add_argument("--docs", type=int, default=3000)
    task.add_argument("--size", type=int, default=60, help="pairs (kv-retrieval) or filler lines (needle)")
    task.add_argument("--seed", type=int, default=0)
    task.set_defaults(func=_task)
    rec = sub.add_parser("recall", help="the indexers' recall of the attention's top-k, and the task accuracy")
    _model_args(rec)
    rec.set_defaults(func=_recall)
    tt = sub.add_parser("train-task", help="train the kv-compact task model (curriculum of growing contexts)")
    tt.add_argument("--out", default="runs/experiments/task-kv-compact")
    tt.add_argument("--scale", type=float, default=1.0, help="the curriculum's steps x SCALE")
    tt.add_argument("--lr", type=float, default=3e-2)
    tt.add_argument("--curriculum", choices=("cpu", "long"), default="cpu",
                    help="cpu: documents of up to 24 pairs (192 tokens); long: on to 64 pairs with filler "
                         "(4K-token windows, a GPU)")
    tt.add_argument("--seed", type=int, default=0)
    tt.add_argument("--threads", type=int, default=1)
    tt.add_argument("--device", default="auto")
    tt.add_argument("--sizes", default="4,8,16,32,64", help="the accuracy afterwards: pairs per document")
    tt.add_argument("--docs", type=int, default=16, help="the accuracy afterwards: documents a size")
    tt.add_argument("--filler", default="0", help="the accuracy afterwards: filler lines a pair, comma-separated")
    tt.set_defaults(func=_train_task)
    acc = sub.add_parser("accuracy", help="a kv-compact model's retrieval accuracy against context and distance")
    acc.add_argument("--checkpoint", required=True)
    acc.add_argument("--sizes", default="4,8,16,32,64", help="pairs per document, comma-separated")
    acc.add_argument("--docs", type=int, default=16)
    acc.add_argument("--seed", type=int, default=1)
    acc.add_argument("--threads", type=int, default=1)
    acc.add_argument("--filler", default="0", help="filler lines after each pair, comma-separated (each evaluated)")
    acc.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:N")
    acc.set_defaults(func=_accuracy, task="kv-compact", size=0)


def _model_args(p) -> None:
    p.add_argument("--checkpoint", help="a `dsv41 train` output directory (all studies but budget)")
    p.add_argument("--task", default="kv-retrieval")
    p.add_argument("--size", type=int, default=60, help="the task size the model was trained on")
    p.add_argument("--docs", type=int, default=16, help="evaluation documents")
    p.add_argument("--seed", type=int, default=1, help="evaluation seed (training data used 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--filler", default="0", help="kv-compact: filler lines after each pair, comma-separated "
                   "(needle / budget / accuracy: each; approximations: the last), for documents past 512 tokens")
    p.add_argument("--device", default="auto", help="where the model runs (budget: where its task models train "
                   "and are evaluated): auto (cuda when there is one), cpu, cuda, cuda:N")


def _load(args):
    from tokenizers import Tokenizer

    from dsv41.experiments.taskmodel import study_device
    from dsv41.model.loading import load_model
    from dsv41.train.tasks_longctx import task_documents

    torch.set_num_threads(args.threads)
    if not args.checkpoint:
        raise ValueError("--checkpoint DIR is required (a `dsv41 train` or `experiments train-task` directory)")
    tok_path = Path(args.checkpoint) / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"--checkpoint {args.checkpoint}: no tokenizer.json (a `dsv41 train` directory?)")
    model, _ = load_model(args.checkpoint, device=study_device(args.device))
    return model.eval(), Tokenizer.from_file(str(tok_path)), task_documents(args.task, args.docs, args.seed,
                                                                            args.size, filler=fillers(args)[-1])


def fillers(args) -> tuple[int, ...]:
    """--filler as numbers."""
    try:
        out = tuple(int(f) for f in args.filler.split(","))
    except ValueError:
        raise ValueError(f"--filler: comma-separated numbers of lines, got {args.filler!r}") from None
    if any(f < 0 for f in out):
        raise ValueError(f"--filler: lines must be >= 0, got {args.filler!r}")
    return out


def _command(args, name: str) -> str:
    """The command that reruns study `name` alone."""
    sizes = f" --sizes {args.sizes}" if args.sizes and name in ("needle", "budget") else ""
    sizes += f" --filler {args.filler}" if args.filler != "0" and name != "replay" else ""
    if name == "budget":
        splits = f" --splits '{args.splits}'" if args.splits else ""
        splits += f" --lr {args.lr:g}" if args.lr is not None else ""
        splits += f" --curriculum {args.curriculum}" if args.curriculum != "cpu" else ""
        splits += f" --train-seed {args.train_seed}" if args.train_seed else ""
        return (f"dsv41 experiments run budget --scale {args.scale:g}{splits}{sizes} --docs {args.docs} "
                f"--seed {args.seed} --threads {args.threads}")
    return (f"dsv41 experiments run {name} --checkpoint {args.checkpoint} --task {args.task} --size {args.size}"
            f"{sizes} --docs {args.docs} --seed {args.seed} --threads {args.threads}")


def _train_task(args) -> int:
    from dsv41.experiments.taskmodel import CURRICULA, scaled, train_task_model

    train_task_model(args.out, curriculum=scaled(CURRICULA[args.curriculum], args.scale), lr=args.lr, seed=args.seed,
                     threads=args.threads, device=args.device)
    args.checkpoint, args.seed = args.out, 1                  # evaluation seed (training documents used --seed)
    return _accuracy(args)


def _accuracy(args) -> int:
    from tokenizers import Tokenizer

    from dsv41.experiments.report import write_report
    from dsv41.experiments.taskmodel import accuracy_by_length, accuracy_tables, study_device
    from dsv41.model.loading import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.checkpoint, device=study_device(args.device))
    tok = Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json"))
    t = time.time()
    result = accuracy_by_length(model.eval(), tok, tuple(int(s) for s in args.sizes.split(",")), args.docs, args.seed,
                                fillers(args))
    result["seconds"] = time.time() - t
    title = (f"retrieval accuracy of {args.checkpoint} on kv-compact (teacher-forced exact match, {args.docs} "
             f"documents a size, each pair queried once; seed {args.seed})")
    command = (f"dsv41 experiments accuracy --checkpoint {args.checkpoint} --sizes {args.sizes} --docs {args.docs} "
               f"--seed {args.seed}" + (f" --filler {args.filler}" if args.filler != "0" else ""))
    out = write_report(Path(args.checkpoint) / "accuracy", title, command, accuracy_by_length.__doc__,
                       accuracy_tables(result), result)
    print(f"{title}:\n")
    print(accuracy_tables(result))
    print(f"-> {out}/report.md")
    return 0


def _run(args) -> int:
    from dsv41.experiments.report import write_report

    # all: every study; needle only on kv-compact documents (the task its pool bookkeeping reads)
    names = (args.name,)
    if args.name == "all":
        names = tuple(n for n in STUDIES if n != "needle" or args.task == "kv-compact")
        if "needle" not in names:
            print(f"all: the needle study runs on kv-compact models (--task kv-compact), skipped for {args.task}")
    model, tok, docs = _load(args) if names != ("budget",) else (None, None, None)
    for name in names:
        t = time.time()
        mod, result = _study(name, args, model, tok, docs)
        result["seconds"] = time.time() - t
        command = _command(args, name)
        out = write_report(Path(args.out) / name, f"{name} ({args.checkpoint or 'task preset'})", command,
                           mod.__doc__, mod.table(result), result, mod.plot(result))
        print(mod.table(result))
        print(f"-> {out}/report.md ({result['seconds']:.0f} s)")
    return 0


def _study(name, args, model, tok, docs):
    """(the study's module, its result)."""
    from dsv41.experiments import approximations, budget, needle, replay
    from dsv41.train.tasks_longctx import encode_tasks

    sizes = {"sizes": tuple(int(s) for s in args.sizes.split(","))} if args.sizes else {}
    if name == "budget":
        names = tuple(n.strip() for n in args.splits.split(",")) if args.splits else tuple(budget.SPLITS)
        for n in names:
            if n not in budget.SPLITS:
                raise ValueError(f"--splits: unknown split {n!r}; choose from {', '.join(budget.SPLITS)}")
        return budget, budget.budget_study(Path(args.out) / "budget", args.scale, names, **sizes, docs=args.docs,
                                           seed=args.seed, curriculum=args.curriculum, threads=args.threads,
                                           device=args.device, train_seed=args.train_seed, fillers=fillers(args),
                                           **({"lr": args.lr} if args.lr is not None else {}))
    if name == "needle":
        if args.task != "kv-compact":
            raise ValueError(f"the needle study runs on kv-compact documents (a train-task model), got --task "
                             f"{args.task}")
        return needle, needle.needle_study(model, tok, **sizes, docs=min(args.docs, 8), seed=args.seed,
                                           fillers=fillers(args))
    if name == "approximations":
        return approximations, approximations.approximation_study(model, tok, docs)
    L, W = model.cfg.n_layers, model.cfg.window_size
    stream = torch.cat([encode_tasks(tok, [d]).ids[0] for d in docs])
    n = W + L * W
    rows = min(2, stream.numel() // n)
    if rows == 0:
        raise ValueError(f"the {args.docs} documents hold {stream.numel()} tokens, the replay study needs {n}")
    device = next(model.parameters()).device
    return replay, replay.replay_study(model, stream[:rows * n].view(rows, n).to(device))


def _task(args) -> int:
    from dsv41.train.tasks_longctx import task_documents, write_jsonl

    path = write_jsonl(task_documents(args.name, args.docs, args.seed, args.size), args.out, args.name)
    print(f"{args.docs} {args.name} documents -> {path}")
    return 0


@torch.no_grad()
def _recall(args) -> int:
    from dsv41.train.indexer_loss import IndexerTap, indexer_recall
    from dsv41.train.qat import TrainCache
    from dsv41.train.tasks_longctx import encode_tasks, retrieval_accuracy

    model, tok, docs = _load(args)
    ids = encode_tasks(tok, docs).ids
    with IndexerTap(model) as tap:
        model(ids, TrainCache(model.cfg, ids.size(0), model.dtype), 0)
        rec = indexer_recall(model, tap)
    acc = retrieval_accuracy(model, tok, docs)
    layers = ", ".join(f"{k}: {v:.3f}" for k, v in rec["layers"].items())
    print(f"indexer recall of the attention's top-{rec['k']}: {rec['recall']:.3f} (chance {rec['chance']:.3f}, "
          f"{rec['rows']} rows; by layer {layers}); retrieval accuracy {acc:.3f} on {args.docs} {args.task} "
          f"documents")
    return 0
