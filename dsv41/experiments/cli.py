"""`dsv41 experiments`: the studies docs/system.md §9 asks for, on a trained task model, each writing
runs/experiments/NAME/{report.md, report.json, plot.png}; the task data they need; the indexer's recall.

Examples
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

STUDIES = ("approximations", "replay")


def register(subparsers) -> None:
    p = subparsers.add_parser("experiments", help="the docs/system.md §9 studies, task data, indexer recall",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="experiments_command", required=True)
    run = sub.add_parser("run", help="run a study and write its report under --out/NAME")
    run.add_argument("name", choices=STUDIES + ("all",))
    _model_args(run)
    run.add_argument("--out", default="runs/experiments")
    run.set_defaults(func=_run)
    task = sub.add_parser("task", help="write a long-context task's training documents as JSONL")
    task.add_argument("name", help="kv-retrieval | needle")
    task.add_argument("--out", required=True)
    task.add_argument("--docs", type=int, default=3000)
    task.add_argument("--size", type=int, default=60, help="pairs (kv-retrieval) or filler lines (needle)")
    task.add_argument("--seed", type=int, default=0)
    task.set_defaults(func=_task)
    rec = sub.add_parser("recall", help="the indexers' recall of the attention's top-k, and the task accuracy")
    _model_args(rec)
    rec.set_defaults(func=_recall)


def _model_args(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a `dsv41 train` output directory")
    p.add_argument("--task", default="kv-retrieval")
    p.add_argument("--size", type=int, default=60, help="the task size the model was trained on")
    p.add_argument("--docs", type=int, default=16, help="evaluation documents")
    p.add_argument("--seed", type=int, default=1, help="evaluation seed (training data used 0)")
    p.add_argument("--threads", type=int, default=1)


def _load(args):
    from tokenizers import Tokenizer

    from dsv41.model.loading import load_model
    from dsv41.train.tasks_longctx import task_documents

    torch.set_num_threads(args.threads)
    tok_path = Path(args.checkpoint) / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"--checkpoint {args.checkpoint}: no tokenizer.json (a `dsv41 train` directory?)")
    model, _ = load_model(args.checkpoint)
    return model.eval(), Tokenizer.from_file(str(tok_path)), task_documents(args.task, args.docs, args.seed,
                                                                            args.size)


def _command(args) -> str:
    return (f"dsv41 experiments run {args.name} --checkpoint {args.checkpoint} --task {args.task} --size {args.size} "
            f"--docs {args.docs} --seed {args.seed}")


def _run(args) -> int:
    from dsv41.experiments import approximations, replay
    from dsv41.experiments.report import write_report
    from dsv41.train.tasks_longctx import encode_tasks

    model, tok, docs = _load(args)
    for name in STUDIES if args.name == "all" else (args.name,):
        t = time.time()
        if name == "approximations":
            mod, result = approximations, approximations.approximation_study(model, tok, docs)
        else:
            L, W = model.cfg.n_layers, model.cfg.window_size
            stream = torch.cat([encode_tasks(tok, [d]).ids[0] for d in docs])
            n = W + L * W
            rows = min(2, stream.numel() // n)
            if rows == 0:
                raise ValueError(f"the {args.docs} documents hold {stream.numel()} tokens, the replay study needs {n}")
            mod, result = replay, replay.replay_study(model, stream[:rows * n].view(rows, n))
        result["seconds"] = time.time() - t
        out = write_report(Path(args.out) / name, f"{name} ({args.checkpoint})", _command(args).replace(f" {args.name} ", f" {name} "),
                           mod.__doc__, mod.table(result), result, mod.plot(result))
        print(mod.table(result))
        print(f"-> {out}/report.md ({result['seconds']:.0f} s)")
    return 0


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
