"""The task model the studies run on: a debug-size model trained on `kv-compact` retrieval with a curriculum of
growing contexts (`dsv41 experiments train-task`), and its retrieval accuracy against context length and against
the distance from the query back to its pair (`dsv41 experiments accuracy`).

Why a curriculum: at the start the indexers are at their initialisation, so a pair beyond the sliding window
reaches a query only when its entry happens to be among the top-k, and the attention gets no gradient to learn
the key match from (the selection is not differentiable). On short documents every entry is in the window or
in the top-k, the attention learns to match keys (dense, with gradient) and the indexers learn from their KL
objective to follow it (`dsv41/train/indexer_loss.py`); each later stage lengthens the documents, so that more
and more answers lie beyond the window and only the learnt selection brings them back.

A stage is (pairs per document drawn uniformly from [lo, hi], training sequence length, steps); every document
queries all its pairs in random order, so half of its lines are answers. One learning-rate schedule runs over all
stages (one `Trainer`, its data loader replaced at each stage boundary); the tokenizer and the validation split
are those of the last stage's documents.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv41.config import PRESET_DIR
from dsv41.experiments.report import markdown_table
from dsv41.train.data import PAD_ID
from dsv41.train.tasks_longctx import TaskDoc, answer_correct, encode_tasks, kv_compact_document, task_documents

TASK = "kv-compact"
TASK_PRESET = str(PRESET_DIR / "task.json")     # the debug model with a top-k of 16 and a pool of 4 blocks


@dataclass(frozen=True)
class Stage:
    lo: int             # pairs per document, drawn uniformly from [lo, hi]
    hi: int
    seq_len: int        # training window (tokens); a kv-compact pair and its query take 8 tokens
    steps: int
    batch: int = 0      # sequences a step; 0: the run's batch size
    filler: int = 0     # filler lines after each pair (about 6 tokens each): documents past 64 pairs' 512 tokens


# about 0.3 / 0.5 / 0.8 s a step on one core of this (shared) machine
CURRICULUM = (Stage(1, 4, 64, 1500), Stage(2, 12, 128, 700), Stage(4, 24, 192, 400))
# the GPU sweep (docs/system.md §9), where a step of this small model costs about the same at any batch (launch
# bound): the same stages at twice the batch and half the steps (the same tokens), then up to 64 pairs with filler
# lines between them in windows of up to 4K tokens (documents of about 0.8K / 1.9K / 3.3K tokens at 64 pairs);
# the training prefill's memory grows with batch x window^2 (one process: about 4 GB at 1 x 4K)
LONG_CURRICULUM = tuple(Stage(s.lo, s.hi, s.seq_len, s.steps // 2, 32) for s in CURRICULUM) + (
    Stage(16, 64, 1024, 300, 8, 1), Stage(32, 64, 2048, 200, 4, 4), Stage(32, 64, 4096, 150, 2, 8))
CURRICULA = {"cpu": CURRICULUM, "long": LONG_CURRICULUM}


def study_device(name: str) -> torch.device:
    """The device `--device` names; auto = the first GPU when there is one, else the CPU."""
    from dsv41.server.device import resolve_device

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(name)


def scaled(curriculum, scale: float) -> tuple[Stage, ...]:
    """The curriculum with every stage's steps x `scale` (at least one)."""
    if scale <= 0:
        raise ValueError(f"the curriculum scale must be > 0, got {scale}")
    return tuple(dataclasses.replace(st, steps=max(1, round(st.steps * scale))) for st in curriculum)


def stage_documents(stage: Stage, n: int, seed: int) -> list[TaskDoc]:
    """n kv-compact documents with pairs ~ U[lo, hi], each querying all its pairs."""
    tag = f"{TASK}-curriculum:{seed}:{stage.lo}-{stage.hi}"
    rng = random.Random(tag + (f":{stage.filler}" if stage.filler else ""))
    out = []
    for _ in range(n):
        pairs = rng.randint(stage.lo, stage.hi)
        out.append(kv_compact_document(rng, pairs, pairs, stage.filler))
    return out


def _write(docs: list[TaskDoc], path: Path, tag: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": f"{tag}-{i}", "text": d.text}) + "\n")
    return path


def stage_tokens(stage: Stage, batch_size: int) -> int:
    """Tokens the stage trains on (documents are drawn to cover them about twice)."""
    return stage.steps * (stage.batch or batch_size) * stage.seq_len


def train_task_model(out: str | Path, preset: str = TASK_PRESET, curriculum=CURRICULUM, batch_size: int = 16,
                     lr: float = 3e-2, weight_decay: float = 0.0, seed: int = 0, threads: int = 1, quiet: bool = False,
                     **train_kw) -> dict:
    """Train the curriculum into `out` (a `dsv41 train` checkpoint directory); returns the trainer's summary."""
    from dsv41.train import data as D
    from dsv41.train.config import TrainConfig
    from dsv41.train.trainer import Trainer

    out = Path(out)
    files = []
    for i, st in enumerate(curriculum):
        mean_tokens = (4 + 3 * st.filler) * (st.lo + st.hi) + 2   # 8 tokens a pair (line + query), ~6 a filler line
        n = max(200, 2 * stage_tokens(st, batch_size) // mean_tokens)
        files.append(_write(stage_documents(st, n, seed), out / "data" / f"stage{i}.jsonl", f"stage{i}"))
    total = sum(st.steps for st in curriculum)
    # the config describes the last stage (its windows are the validation set and the first-batch probe's)
    cfg = TrainConfig(preset=preset, data=str(files[-1]), out=str(out), steps=total, seq_len=curriculum[-1].seq_len,
                      batch_size=curriculum[-1].batch or batch_size, lr=lr, weight_decay=weight_decay, seed=seed,
                      threads=threads, quiet=quiet, **train_kw)
    trainer = Trainer(cfg)
    done = 0
    for i, st in enumerate(curriculum):
        corpus = D.load_corpus(str(files[i]), cfg.val_fraction, D.min_val_chars(st.seq_len))
        tokens = D.encode_documents(trainer.tokenizer, corpus.train)
        batch = st.batch or batch_size
        trainer.loader = D.PackedLoader(tokens, st.seq_len, batch, seed)
        trainer.tokens_per_step = batch * st.seq_len * cfg.grad_accum
        trainer.say(f"curriculum stage {i}: {st.lo}-{st.hi} pairs, seq_len {st.seq_len}, batch {batch}, steps "
                    f"{done}-{done + st.steps}")
        done += st.steps
        trainer.run(stop_at=done)
    summary = trainer.finish()
    (out / "curriculum.json").write_text(json.dumps([dataclasses.asdict(s) for s in curriculum], indent=2) + "\n")
    return summary


@torch.no_grad()
def answer_records(model, tokenizer, docs: list[TaskDoc], batch: int = 4) -> list[dict]:
    """Per answer: its document, whether it is right (teacher-forced exact match), the distance in tokens from its
    pair line to its value, and the document's length in tokens."""
    from dsv41.train.qat import sequence_forward

    recs = []
    for i in range(0, len(docs), batch):
        enc = encode_tasks(tokenizer, docs[i:i + batch])
        ids = enc.ids.to(next(model.parameters()).device)
        right = answer_correct(sequence_forward(model, ids).logits, ids, enc.answers)
        for b, flags in enumerate(right):
            length = int((enc.ids[b] != PAD_ID).sum())
            for a, ok in enumerate(flags):
                recs.append({"doc": i + b, "right": bool(ok), "length": length,
                             "distance": enc.answers[b][a][0] - enc.sources[b][a]})
    return recs


def accuracy_by_length(model, tokenizer, sizes=(4, 8, 16, 32, 64), docs: int = 16, seed: int = 1,
                       fillers=(0,)) -> dict:
    """Retrieval accuracy per document size (pairs, each queried once; with each number of filler lines after a
    pair) and per distance bucket, with the share of answers whose pair lies beyond the sliding window and their
    accuracy; chance is 1/100 (two-digit values)."""
    W = model.cfg.window_size
    rows, every = [], []
    for size, filler in [(s, f) for f in fillers for s in sizes]:
        ds = task_documents(TASK, docs, seed, size, size, filler)
        recs = answer_records(model, tokenizer, ds, batch=4 if filler == 0 else 1)     # long ones alone
        far = [r for r in recs if r["distance"] > W]
        rows.append({"pairs": size, "filler": filler, "tokens": max(r["length"] for r in recs), "answers": len(recs),
                     "accuracy": sum(r["right"] for r in recs) / len(recs), "beyond_window": len(far),
                     "accuracy_beyond_window": sum(r["right"] for r in far) / len(far) if far else None})
        every += recs
    edges = [0, W]                                      # W, then doubling until every distance is covered
    while edges[-1] < max(r["distance"] for r in every):
        edges.append(2 * edges[-1])
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        part = [r for r in every if lo < r["distance"] <= hi]
        if part:
            buckets.append({"from": lo + 1, "to": hi, "answers": len(part),
                            "accuracy": sum(r["right"] for r in part) / len(part)})
    return {"window": W, "chance": 0.01, "sizes": rows, "distance": buckets, "docs": docs, "seed": seed}


def accuracy_tables(result: dict) -> str:
    a = markdown_table(["pairs", "filler lines a pair", "tokens", "answers", "accuracy", "answers beyond window",
                        "accuracy beyond window"],
                       [[r["pairs"], r.get("filler", 0), r["tokens"], r["answers"], r["accuracy"], r["beyond_window"],
                         "-" if r["accuracy_beyond_window"] is None else r["accuracy_beyond_window"]]
                        for r in result["sizes"]])
    b = markdown_table(["distance pair -> answer (tokens)", "answers", "accuracy"],
                       [[f"{r['from']}-{r['to']}", r["answers"], r["accuracy"]] for r in result["distance"]])
    return (f"{a}\nBy distance (sliding window W = {result['window']} tokens; chance {result['chance']}):\n\n{b}")
