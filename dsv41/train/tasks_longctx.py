"""Long-context retrieval tasks a tiny model learns in CPU minutes: training documents for `dsv41 train --data`
(written as JSONL by `dsv41 experiments task NAME`) and their retrieval accuracy.

  kv-retrieval  a document of `pairs` lines "key value" (3-letter keys, all distinct; 3-digit values), then
                `queries` lines "? key value" for keys drawn from the list: each answer is a copy from far back
                (up to the whole document), through the sliding window only when the pair is recent, otherwise
                through the compressed KV the indexer selects.
  kv-compact    the same retrieval in a form a debug-size model learns in CPU minutes: every line ": key value"
                (`size` pairs, keys drawn without repetition from a fixed set of `COMPACT_KEYS` 2-letter keys,
                2-digit values), then `queries` lines "? key value"; a BPE at the debug vocabulary spells each key
                and each value as one token, the same token in the pair line and the query, so an answer is one
                token copied from the position after the matching key (chance 1/100).
  needle        filler lines of words, one line "key value" (the needle) at a random depth, then "? key value":
                one long-distance copy per document, at a recorded depth (the candidate-pool study buckets by it).

Accuracy is teacher-forced exact match: an answer is right when the model's argmax at every token of its value
(the tokens whose characters overlap the value's) is that token, given the true text before it. That is what a
greedy continuation of the prompt up to the query key produces, whenever the tokenizer would spell the value the
same way (a BPE trained on these documents does). The documents' randomness comes from one seed, so an
evaluation set is fixed by (task, seed, size).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.train.data import BOS_ID, EOS_ID, PAD_ID

TASKS = ("kv-retrieval", "kv-compact", "needle")
COMPACT_KEYS = 64
WORDS = ("the", "of", "and", "a", "in", "is", "it", "for", "on", "with", "as", "was", "at", "by", "this", "from",
         "or", "be", "are", "an", "but", "not", "all", "were", "when", "we", "there", "can", "which", "their")


@dataclass
class TaskDoc:
    text: str
    answers: list[tuple[int, int]]                 # character spans of the values to retrieve
    sources: list[int] = field(default_factory=list)   # character offset of each answer's "key value" line


def _keys(rng: random.Random, n: int, letters: int = 3) -> list[str]:
    keys: set[str] = set()
    while len(keys) < n:
        keys.add("".join(rng.choices(string.ascii_lowercase, k=letters)))
    return sorted(sorted(keys), key=lambda _: rng.random())     # a set's order changes with PYTHONHASHSEED


def kv_document(rng: random.Random, pairs: int, queries: int) -> TaskDoc:
    keys = _keys(rng, pairs)
    values = [f"{rng.randrange(1000):03d}" for _ in keys]
    text, where = "", {}
    for k, v in zip(keys, values):
        where[k] = len(text)
        text += f"{k} {v}\n"
    answers, sources = [], []
    for i in rng.sample(range(pairs), min(queries, pairs)):
        line = f"? {keys[i]} "
        answers.append((len(text) + len(line), len(text) + len(line) + 3))
        sources.append(where[keys[i]])
        text += line + values[i] + "\n"
    return TaskDoc(text, answers, sources)


def compact_keys() -> list[str]:
    """The fixed key set of kv-compact (the same for every seed: the model learns its tokens once)."""
    return _keys(random.Random("kv-compact:keys"), COMPACT_KEYS, 2)


def kv_compact_document(rng: random.Random, pairs: int, queries: int, filler: int = 0) -> TaskDoc:
    """`pairs` lines ": key value", each followed by `filler` lines of random words (the haystack that stretches a
    document past the 64 keys' 512 tokens), then `queries` lines "? key value" in random order."""
    if pairs > COMPACT_KEYS:
        raise ValueError(f"kv-compact holds at most {COMPACT_KEYS} pairs per document, got {pairs}")
    if filler < 0:
        raise ValueError(f"filler lines per pair must be >= 0, got {filler}")
    keys = rng.sample(compact_keys(), pairs)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    text, where = "", []
    for k, v in zip(keys, values):
        where.append(len(text))
        text += f": {k} {v}\n" + "".join(" ".join(rng.choices(WORDS, k=4)) + "\n" for _ in range(filler))
    answers, sources = [], []
    for i in rng.sample(range(pairs), min(queries, pairs)):
        line = f"? {keys[i]} "
        answers.append((len(text) + len(line), len(text) + len(line) + 2))
        sources.append(where[i])
        text += line + values[i] + "\n"
    return TaskDoc(text, answers, sources)


def needle_document(rng: random.Random, lines: int, words: int = 8) -> TaskDoc:
    key, value = _keys(rng, 1)[0], f"{rng.randrange(1000):03d}"
    depth = rng.randrange(lines + 1)
    body = [" ".join(rng.choices(WORDS, k=words)) + "\n" for _ in range(lines)]
    text = "".join(body[:depth])
    source = len(text)
    text += f"{key} {value}\n" + "".join(body[depth:])
    line = f"? {key} "
    return TaskDoc(text + line + value + "\n", [(len(text) + len(line), len(text) + len(line) + 3)], [source])


def task_documents(task: str, n: int, seed: int, size: int, queries: int = 4, filler: int = 0) -> list[TaskDoc]:
    """n documents of `task`; size: pairs (kv-retrieval, kv-compact) or filler lines (needle); filler: kv-compact's
    filler lines after each pair."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if size < 1 or n < 1:
        raise ValueError(f"task size and document count must be >= 1, got {size}, {n}")
    if filler and task != "kv-compact":
        raise ValueError(f"filler lines are a kv-compact option, got task {task!r}")
    rng = random.Random(f"{task}:{seed}" + (f":filler{filler}" if filler else ""))
    if task == "kv-retrieval":
        return [kv_document(rng, size, queries) for _ in range(n)]
    if task == "kv-compact":
        return [kv_compact_document(rng, size, queries, filler) for _ in range(n)]
    return [needle_document(rng, size) for _ in range(n)]


def write_jsonl(docs: list[TaskDoc], path: str | Path, task: str) -> Path:
    """The documents as `dsv41 train --data PATH.jsonl` reads them (a "text" field per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": f"{task}-{i}", "text": d.text}) + "\n")
    return path


@dataclass
class Encoded:
    ids: torch.Tensor                   # [B,T] <|bos|> doc <|eos|>, right-padded with <|pad|>
    answers: list[list[list[int]]]      # per document, per answer: the token positions of its value
    sources: list[list[int]]            # per document, per answer: the token position where its pair line starts


def encode_tasks(tokenizer, docs: list[TaskDoc]) -> Encoded:
    rows, answers, sources = [], [], []
    for d in docs:
        enc = tokenizer.encode(d.text, add_special_tokens=False)
        offs = enc.offsets
        rows.append([BOS_ID] + enc.ids + [EOS_ID])
        answers.append([[i + 1 for i, (a, b) in enumerate(offs) if a < hi and b > lo] for lo, hi in d.answers])
        sources.append([1 + next(i for i, (a, b) in enumerate(offs) if b > s) for s in d.sources])
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return Encoded(ids, answers, sources)


def answer_correct(logits: torch.Tensor, ids: torch.Tensor, answers: list[list[list[int]]],
                   offset: int = 0) -> list[list[bool]]:
    """Per document and answer, whether the argmax predicts every value token. logits [B,T',V] hold the
    predictions for positions offset+1 .. offset+T' (the logits at position p predict token p+1)."""
    pred, ids = logits.argmax(dim=-1).cpu(), ids.cpu()          # one copy, not one sync per token
    out = []
    for b, doc in enumerate(answers):
        out.append([all(0 <= p - 1 - offset < pred.size(1) and int(pred[b, p - 1 - offset]) == int(ids[b, p])
                        for p in toks) for toks in doc])
    return out


@torch.no_grad()
def retrieval_accuracy(model, tokenizer, docs: list[TaskDoc], batch: int = 4) -> float:
    """The share of answers the model retrieves (teacher-forced exact match, module docstring), one training
    prefill per batch of documents through the reference forward."""
    from dsv41.train.qat import sequence_forward

    right = total = 0
    for i in range(0, len(docs), batch):
        enc = encode_tasks(tokenizer, docs[i:i + batch])
        ids = enc.ids.to(next(model.parameters()).device)
        logits = sequence_forward(model, ids).logits
        flags = [f for doc in answer_correct(logits, ids, enc.answers) for f in doc]
        right, total = right + sum(flags), total + len(flags)
    return right / max(total, 1)
