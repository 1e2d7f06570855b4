"""The pieces of the task-model studies: the kv-compact task (generator, tokens, checker), the curriculum, the
fixed-budget splits (bytes per token against the entries a prefill actually stores), the needle study's pool
bookkeeping on a model whose candidate pool the test sets, the accuracy tables, and `dsv41 experiments
train-task | accuracy | run needle | run budget` end to end at a tiny scale."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest
import torch

from dsv41.config import Mode, ModelConfig, ced_split, layer_roles
from dsv41.experiments import budget, needle
from dsv41.experiments.report import write_report
from dsv41.experiments.taskmodel import (CURRICULUM, TASK_PRESET, Stage, accuracy_by_length, accuracy_tables,
                                         scaled, stage_documents)
from dsv41.model.init import init_weights
from dsv41.model.transformer import Transformer
from dsv41.train.data import Document, train_tokenizer
from dsv41.train.qat import TrainCache
from dsv41.train.tasks_longctx import (COMPACT_KEYS, answer_correct, compact_keys, encode_tasks,
                                       kv_compact_document, task_documents)

pytestmark = pytest.mark.usefixtures("one_thread")         # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    docs = stage_documents(Stage(8, 24, 0, 0), 300, 0)
    return train_tokenizer([Document(str(i), d.text) for i, d in enumerate(docs)], 512)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_json(TASK_PRESET)
    m = Transformer(cfg, dtype=torch.float32)
    init_weights(m, 0)
    return m.eval()


# ------------------------------------------------------------------------------------------ kv-compact task
def test_kv_compact_documents():
    keys = compact_keys()
    assert len(set(keys)) == COMPACT_KEYS and all(len(k) == 2 and k.isalpha() for k in keys)
    assert compact_keys() == keys                                        # the same set for every seed
    docs = task_documents("kv-compact", 6, 3, 12, 5)
    for d in docs:
        lines = d.text.splitlines()
        pairs = [ln.split() for ln in lines if ln.startswith(":")]
        queries = [ln.split() for ln in lines if ln.startswith("?")]
        assert len(pairs) == 12 and len(queries) == 5 and len(lines) == 17
        assert lines[:12] == [f": {k} {v}" for _, k, v in pairs]        # pairs first, then the queries
        assert len({k for _, k, _ in pairs}) == 12 and {k for _, k, _ in pairs} <= set(keys)
        assert all(len(v) == 2 and v.isdigit() for _, _, v in pairs)
        table = {k: v for _, k, v in pairs}
        assert len({k for _, k, _ in queries}) == 5
        for (lo, hi), src, (_, qk, qv) in zip(d.answers, d.sources, queries):
            assert d.text[lo:hi] == qv == table[qk]                       # the span is the queried value
            assert d.text[src:d.text.index("\n", src)] == f": {qk} {qv}"  # the source is its pair line
            assert d.text[lo - 5:lo] == f"? {qk} "
    assert task_documents("kv-compact", 6, 3, 12, 5)[2].text == docs[2].text
    assert task_documents("kv-compact", 1, 4, 12, 5)[0].text != docs[0].text
    one = kv_compact_document(random.Random(0), COMPACT_KEYS, COMPACT_KEYS)   # every key once
    assert len(one.answers) == COMPACT_KEYS
    with pytest.raises(ValueError, match="at most"):
        kv_compact_document(random.Random(0), COMPACT_KEYS + 1, 1)


def test_kv_compact_filler_stretches_the_haystack():
    """Filler lines of words after each pair lengthen a document past 64 pairs' 512 tokens; the answers still
    point at their values and their pair lines; filler is a kv-compact option only."""
    plain = task_documents("kv-compact", 3, 5, 10, 4)
    docs = task_documents("kv-compact", 3, 5, 10, 4, filler=3)
    for d, p in zip(docs, plain):
        lines = d.text.splitlines()
        assert len(lines) == 10 * 4 + 4 and len(d.text) > 3 * len(p.text)
        for i in range(10):
            assert lines[4 * i].startswith(": ") and all(not ln.startswith((":", "?")) and len(ln.split()) == 4
                                                         for ln in lines[4 * i + 1:4 * i + 4])
        for (lo, hi), src in zip(d.answers, d.sources):
            key, value = d.text[src:d.text.index("\n", src)].split()[1:]
            assert d.text[lo:hi] == value and d.text[lo - 5:lo] == f"? {key} "
    assert task_documents("kv-compact", 3, 5, 10, 4, filler=3)[1].text == docs[1].text
    with pytest.raises(ValueError, match="kv-compact option"):
        task_documents("kv-retrieval", 1, 0, 4, filler=1)
    with pytest.raises(ValueError, match=">= 0"):
        kv_compact_document(random.Random(0), 4, 4, -1)


def test_kv_compact_tokens_and_checker(tok):
    """Each key and value is one token, the same in the pair line and the query; the checker accepts exactly the
    predictions of the true next tokens."""
    docs = task_documents("kv-compact", 3, 1, 10, 4)
    enc = encode_tasks(tok, docs)
    for b, d in enumerate(docs):
        for a, (toks, src) in enumerate(zip(enc.answers[b], enc.sources[b])):
            value = d.text[d.answers[a][0]:d.answers[a][1]]
            assert len(toks) == 1 and tok.decode([int(enc.ids[b, toks[0]])]).strip() == value
            pair = needle.needle_tokens(tok, d, a)                        # the key and the value of the pair
            key = d.text[d.answers[a][0] - 3:d.answers[a][0] - 1]
            assert [tok.decode([int(enc.ids[b, p])]).strip() for p in pair] == [key, value]
            assert pair == [src + 1, src + 2]                              # ": key value": marker, key, value
            assert int(enc.ids[b, pair[1]]) == int(enc.ids[b, toks[0]])  # copied token for token
            assert int(enc.ids[b, pair[0]]) == int(enc.ids[b, toks[0] - 1])
    B, T = enc.ids.shape
    logits = torch.full((B, T, 512), -1.0)
    logits[:, :-1].scatter_(-1, enc.ids[:, 1:].unsqueeze(-1), 1.0)       # predicts every next token
    assert all(all(doc) for doc in answer_correct(logits, enc.ids, enc.answers))
    p = enc.answers[1][2][0] - 1
    logits[1, p] = logits[1, p].roll(1)                                    # one wrong prediction
    flags = answer_correct(logits, enc.ids, enc.answers)
    assert flags[1][2] is False and sum(not f for doc in flags for f in doc) == 1
    # logits starting at an offset predict the same positions
    P = 20
    assert answer_correct(logits[:, P - 1:], enc.ids, enc.answers, offset=P - 1) == [
        [f if enc.answers[b][a][0] >= P else False for a, f in enumerate(doc)] for b, doc in enumerate(flags)]


def test_curriculum_documents_and_scale():
    st = Stage(3, 7, 64, 10)
    docs = stage_documents(st, 50, 0)
    counts = [sum(ln.startswith(":") for ln in d.text.splitlines()) for d in docs]
    assert all(3 <= c <= 7 for c in counts) and len(set(counts)) > 1
    assert all(len(d.answers) == c for d, c in zip(docs, counts))       # every pair queried
    half = scaled(CURRICULUM, 0.5)
    assert [s.steps for s in half] == [round(s.steps / 2) for s in CURRICULUM]
    assert [(s.lo, s.hi, s.seq_len) for s in half] == [(s.lo, s.hi, s.seq_len) for s in CURRICULUM]
    assert all(s.steps == 1 for s in scaled(CURRICULUM, 1e-6))
    with pytest.raises(ValueError, match="scale"):
        scaled(CURRICULUM, 0)


def test_task_documents_do_not_depend_on_the_hash_seed():
    """The documents of a seed are the same in every process: the keys were once drawn into a set and shuffled in
    its iteration order, which PYTHONHASHSEED changes, so two processes evaluated a model on different documents."""
    import os
    import subprocess
    import sys
    code = ("import hashlib, json; from dsv41.train.tasks_longctx import task_documents, TASKS; "
            "print(hashlib.sha256(json.dumps([[d.text, d.answers] for t in TASKS "
            "for d in task_documents(t, 4, 3, 8)]).encode()).hexdigest())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2, 3)}
    assert len(runs) == 1, runs


# ------------------------------------------------------------------------------------------ fixed KV budget
def _stored_bytes_per_token(cfg: ModelConfig, T: int = 32) -> Fraction:
    """Global-KV bytes per token of what a prefill of T tokens stores, counted in the cache: every KV source's
    entries, each its main KV (FP4 codes + a 1-byte scale per 16) and its index key (FP4 + a scale per 32)."""
    m = Transformer(cfg, dtype=torch.float32)
    init_weights(m, 0)
    cache = TrainCache(cfg, 1, m.dtype)
    with torch.no_grad():
        m(torch.randint(3, 400, (1, T), generator=torch.Generator().manual_seed(0)), cache, 0)
    total = Fraction(0)
    for L, n in cache.rows.items():
        main, index = cache.ckv[L].size(-1), cache.kidx[L].size(-1)
        total += int(n[0]) * (Fraction(main, 2) + Fraction(main, 16) + Fraction(index, 2) + Fraction(index, 32))
    return total / T


def test_budget_splits_store_the_same_bytes():
    base = ModelConfig.from_json(TASK_PRESET)
    got = {}
    for name, (ratios, kv, _, _) in budget.SPLITS.items():
        cfg = budget.split_config(base, name)
        roles = layer_roles(cfg)                                         # a valid layout
        assert [r.layer for r in roles if r.mode == Mode.FULL] == list(kv)
        assert list(cfg.compress_ratios[:8]) == list(ratios) and ced_split(cfg) == kv[-1]
        analytic = Fraction(budget.global_kv_bytes_per_token(cfg))
        assert analytic == _stored_bytes_per_token(cfg)
        got[name] = analytic
    # head_dim 32 and index_head_dim 32: 18 + 17 B an entry, 1.5 entries a token in every split
    assert set(got.values()) == {Fraction(105, 2)}
    with pytest.raises(ValueError, match="unknown split"):
        budget.split_config(base, "two m=3")


# ------------------------------------------------------------------------------------------ needle
def _set_pool(model, pool_fn):
    """Replace the candidate source's pool by pool_fn(T, N) -> bool [T,N] (the Reindex layers then score in it)."""
    src, _ = needle._pool_layers(model)
    indexer = model.layers[src].attn.indexer

    def hook(_mod, args, out):
        ctx = args[3]
        T, N = ctx.seqlen, int(ctx.published.cand[src].size(-1))
        B = ctx.published.cand[src].size(0)
        ctx.published.cand[src] = pool_fn(T, N).unsqueeze(0).expand(B, T, N).clone()
    return indexer.register_forward_hook(hook)


def test_needle_in_pool_follows_the_pool(model, tok):
    """A pool of the entries before the middle pair: the first half's needles are in it, the second half's not, the
    Reindex layer selects only inside it; a pool of everything holds every needle and the attention's top-k."""
    size = 16
    docs = task_documents("kv-compact", 3, 2, size, 8)
    cut = 1 + 4 * (size // 2)                                             # token where pair size/2 starts
    h = _set_pool(model, lambda T, N: torch.arange(N) < cut)
    try:
        recs, pool = needle.pool_records(model, tok, docs)
    finally:
        h.remove()
    assert len(recs) == 3 * 8
    for r in recs:
        first_half = r["depth"] < 0.5
        assert r["in_pool"] == first_half == all(e < cut for e in r["entries"])
        assert all(not t or r["in_pool"] for t in r["in_topk"].values())  # top-k inside the pool
    assert 0.0 < pool["pool_recall_of_attention_topk"] < 1.0
    h = _set_pool(model, lambda T, N: torch.ones(N, dtype=torch.bool))
    try:
        recs, pool = needle.pool_records(model, tok, docs)
        res = needle.needle_study(model, tok, sizes=(size,), docs=3, queries=8, seed=2, with_variants=False)
    finally:
        h.remove()
    assert all(r["in_pool"] for r in recs) and pool["pool_recall_of_attention_topk"] == 1.0
    assert res["rows"][0]["needle_pool_recall"] == 1.0 and res["variants"] == []


def test_needle_study_buckets(model, tok, tmp_path):
    size, docs, q = 16, 2, 4
    cut = 1 + 4 * (size // 2)
    h = _set_pool(model, lambda T, N: torch.arange(N) < cut)
    try:
        res = needle.needle_study(model, tok, sizes=(size,), docs=docs, queries=q, seed=2)
    finally:
        h.remove()
    rows = res["rows"]
    assert [r["depth"] for r in rows] == ["0.00-0.25", "0.25-0.50", "0.50-0.75", "0.75-1.00"]
    assert sum(r["answers"] for r in rows) == docs * q                   # every answer is beyond the window
    assert all(r["in_pool"] == (1.0 if i < 2 else 0.0) for i, r in enumerate(rows) if r["answers"])
    assert sum(r["answers"] for r in rows[:2]) and sum(r["answers"] for r in rows[2:])
    for r in rows:
        if r["answers"]:
            want = r["accuracy_in_pool"] if r["in_pool"] == 1.0 else r["accuracy_out_of_pool"]
            assert r["accuracy"] == want
    names = [r["variant"] for r in res["variants"]]
    assert names[0].startswith("exact") and names[-1] == "all stacked" and len(names) == 7
    for r in res["variants"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["by_depth"]) == needle.DEPTHS
    md = needle.table(res)
    assert "pool recall of the needle" in md and "all stacked" in md
    out = write_report(tmp_path / "needle", "needle", "cmd", needle.__doc__, md, res, needle.plot(res))
    assert (out / "plot.png").stat().st_size > 0 and json.loads((out / "report.json").read_text())["rows"]


def test_accuracy_by_length_tables(model, tok):
    res = accuracy_by_length(model, tok, sizes=(4, 12), docs=2, seed=0)
    W = model.cfg.window_size
    assert [r["answers"] for r in res["sizes"]] == [8, 24]               # each pair queried once
    assert [r["tokens"] for r in res["sizes"]] == [2 + 8 * 4, 2 + 8 * 12]
    assert sum(b["answers"] for b in res["distance"]) == 32              # every answer in one bucket
    assert res["distance"][0]["from"] == 1 and res["distance"][0]["to"] == W
    assert res["distance"][-1]["to"] >= 8 * 12 - 2                        # the farthest pair is covered
    for r in res["sizes"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["beyond_window"] <= r["answers"]
    assert "accuracy beyond window" in accuracy_tables(res)


# ------------------------------------------------------------------------------------------ CLI end to end
def test_cli_train_task_accuracy_and_needle(tmp_path):
    from dsv41.cli import main
    ck = tmp_path / "task"
    assert main(["experiments", "train-task", "--out", str(ck), "--scale", "0.002", "--sizes", "4", "--docs",
                 "2"]) == 0
    assert (ck / "tokenizer.json").is_file() and (ck / "curriculum.json").is_file()
    acc = json.loads((ck / "accuracy" / "report.json").read_text())
    assert acc["sizes"][0]["pairs"] == 4 and acc["sizes"][0]["answers"] == 8
    assert [s["steps"] for s in json.loads((ck / "curriculum.json").read_text())] == [3, 1, 1]
    out = tmp_path / "exp"
    assert main(["experiments", "run", "needle", "--checkpoint", str(ck), "--task", "kv-compact", "--docs", "1",
                 "--sizes", "8", "--out", str(out)]) == 0
    rep = json.loads((out / "needle" / "report.json").read_text())
    assert "run needle" in rep["command"] and "--sizes 8" in rep["command"]
    assert {r["pairs"] for r in rep["rows"]} == {8}
    assert (out / "needle" / "report.md").read_text().startswith("# needle")
    assert (out / "needle" / "plot.png").is_file()
    assert main(["experiments", "run", "needle", "--checkpoint", str(ck), "--task", "kv-retrieval",
                 "--out", str(out)]) == 2                                  # needle reads kv-compact documents


def test_cli_budget(tmp_path):
    from dsv41.cli import main
    out = tmp_path / "exp"
    assert main(["experiments", "run", "budget", "--scale", "0.002", "--splits", "six m=4", "--sizes", "4",
                 "--docs", "2", "--out", str(out)]) == 0
    rep = json.loads((out / "budget" / "report.json").read_text())
    (row,) = rep["rows"]
    assert row["split"] == "six m=4" and row["bytes_per_token"] == 52.5 and row["kv_sources"] == [2, 3, 4, 5, 6, 7]
    assert row["val_loss"] > 0 and len(row["accuracy"]) == 1
    assert (out / "budget" / "six-m4" / "model" / "tokenizer.json").is_file()
    assert (out / "budget" / "plot.png").is_file() and "--splits 'six m=4'" in rep["command"]
    assert main(["experiments", "run", "budget", "--splits", "nine m=5", "--out", str(out)]) == 2
    # a second run with the same settings evaluates the trained model again without training it (splits trained
    # by separate processes, then one report); other settings train again
    weights = out / "budget" / "six-m4" / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert main(["experiments", "run", "budget", "--scale", "0.002", "--splits", "six m=4", "--sizes", "4",
                 "--docs", "2", "--out", str(out)]) == 0
    again = json.loads((out / "budget" / "report.json").read_text())["rows"][0]
    assert weights.stat().st_mtime_ns == stamp
    assert again["val_loss"] == row["val_loss"] and again["train_s"] == row["train_s"]
    assert again["accuracy"] == row["accuracy"]
    ev = json.loads((out / "budget" / "six-m4" / "evaluated.json").read_text())
    assert ev["at"] == {"sizes": [4], "docs": 2, "seed": 1, "fillers": [0]} and ev["accuracy"]["sizes"][0]["pairs"] == 4
    assert main(["experiments", "run", "budget", "--scale", "0.002", "--lr", "1e-3", "--splits", "six m=4",
                 "--sizes", "4", "--docs", "2", "--out", str(out)]) == 0
    assert weights.stat().st_mtime_ns != stamp


def test_cli_budget_train_seed_trains_its_own_model(tmp_path):
    """--train-seed S trains into NAME-seedS with that seed (another model than seed 0's), the rerun command keeps
    it, and --device names a device or fails clearly."""
    from dsv41.cli import main
    out = tmp_path / "exp"
    args = ["experiments", "run", "budget", "--scale", "0.002", "--splits", "m=4 4 1", "--sizes", "4", "--docs", "1",
            "--out", str(out)]
    assert main(args) == 0 and main(args + ["--train-seed", "3"]) == 0
    rep = json.loads((out / "budget" / "report.json").read_text())
    assert rep["train_seed"] == 3 and "--train-seed 3" in rep["command"] and rep["device"] == "cpu"
    a, b = (out / "budget" / d / "model" / "model.safetensors" for d in ("m4-4-1", "m4-4-1-seed3"))
    assert a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes()
    assert main(args + ["--device", "cuda:99"]) == 2


def test_stage_batch_and_the_long_curriculum(tmp_path):
    """A stage's own batch size sets its loader's rows (the long curriculum's long stages use fewer sequences a
    step); the long curriculum starts with the CPU one's tokens (twice the batch, half the steps) and reaches 4K-token
    windows."""
    from dsv41.experiments.taskmodel import CURRICULA, Stage, train_task_model
    long = CURRICULA["long"]
    assert [(s.seq_len, s.steps * s.batch) for s in long[:3]] == [(s.seq_len, s.steps * 16) for s in CURRICULA["cpu"]]
    assert long[-1].seq_len == 4096 and long[-1].batch == 2 and long[-1].filler > 0
    seen = []
    from dsv41.train import data as D
    real = D.PackedLoader

    class Spy(real):
        def __init__(self, tokens, seq_len, batch, *a, **k):
            seen.append((seq_len, batch))
            super().__init__(tokens, seq_len, batch, *a, **k)

    D.PackedLoader = Spy
    try:
        train_task_model(tmp_path / "m", curriculum=(Stage(1, 4, 64, 1), Stage(2, 6, 96, 1, 3)), batch_size=4,
                         quiet=True)
    finally:
        D.PackedLoader = real
    assert seen[-2:] == [(64, 4), (96, 3)]
