"""Guards the DSpark drafter stage (docs/system.md §5): the all-anchor training forward equals the model's own
drafter (`forward_spec`, decode path) anchor by anchor, acceptance is counted as greedy verification does, the
greedy pool holds the backbone's own greedy continuations and is what the stage trains on, and a drafter-stage
run trains `mtp.*` while leaving every backbone tensor bit-identical."""

from __future__ import annotations


import pytest
import torch

from dsv41.config import load_config
from dsv41.model.cache import DenseCache
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.train.config import TrainConfig
from dsv41.train.dspark_stage import (DSparkStage, DSparkTrainModule, acceptance_counts, acceptance_rates,
                                      anchor_ids, anchor_positions, draft_forward, greedy_pool, greedy_prompts,
                                      pool_rows)
from dsv41.train.parallel import Dist
from dsv41.train.trainer import train
from tests.conftest import small_corpus


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_training_forward_equals_forward_spec():
    torch.manual_seed(0)
    cfg = load_config("debug")
    m = random_model(cfg)
    set_quantization(m, False)
    B, T, G = 2, 20, cfg.dspark_block_size
    ids = torch.randint(3, cfg.vocab_size - 2, (B, T))
    out = m(ids, DenseCache(cfg, B, torch.float32), 0)
    markov, _ = anchor_ids(ids, G, 2)
    for p in (0, 3, cfg.window_size + 1, T - 2 - G):            # before, at and past a full window
        cache = DenseCache(cfg, B, torch.float32)
        if p > 0:
            m.draft(None, out.main_hidden[:, :p], cache, 0)
        toks, logits, conf = m.draft(ids[:, p + 1], out.main_hidden[:, p:p + 1], cache, p)
        mk = markov.clone()
        mk[:, p] = toks[:, :G]                                   # the drafts forward_spec fed its Markov head
        got, got_conf = draft_forward(m, out.main_hidden, mk)
        torch.testing.assert_close(got[:, p], logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got_conf[:, p], conf, atol=2e-5, rtol=1e-5)
    # a subset of anchors (what the training step uses) gives the same rows
    sub = anchor_positions(T, 11)
    full, _ = draft_forward(m, out.main_hidden, markov)
    part, _ = draft_forward(m, out.main_hidden, markov[:, sub], sub)
    torch.testing.assert_close(part, full[:, sub], atol=2e-5, rtol=1e-5)


def test_acceptance_counting():
    target = torch.tensor([[[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]]])
    draft = torch.tensor([[[1, 2, 3], [1, 0, 3], [0, 2, 3], [1, 2, 0]]])
    valid = torch.ones(1, 4, 3, dtype=torch.bool)
    c = acceptance_counts(draft, target, valid)
    assert c.tolist() == [4, 3, 2, 1]
    r = acceptance_rates(c)
    assert r["acceptance"] == [0.75, 2 / 3, 0.5] and r["survival"] == [0.75, 0.5, 0.25]
    assert r["tokens_per_step"] == 2.5
    valid[0, 3, 2] = False                                       # incomplete anchors are not counted
    assert acceptance_counts(draft, target, valid).tolist() == [3, 2, 1, 1]


def test_dspark_stage_freezes_backbone(tmp_path):
    d = small_corpus(tmp_path)
    common = dict(preset="debug", data=str(d), seq_len=24, batch_size=2, eval_windows=2, val_fraction=0.15,
                  quiet=True, sample_tokens=0, threads=1)
    train(TrainConfig(out=str(tmp_path / "base"), steps=2, **common))
    s = train(TrainConfig(out=str(tmp_path / "draft"), stage="dspark", init=str(tmp_path / "base"), steps=3,
                          lr=1e-2, dspark_pool=8, **common))
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "base" / "model.safetensors"))
    b = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    backbone = [k for k in a if not k.startswith("mtp.")]
    assert all(torch.equal(a[k], b[k]) for k in backbone)
    changed = [k for k in a if k.startswith("mtp.") and not torch.equal(a[k], b[k])]
    assert any("main_proj" in k for k in changed) and any("markov_head" in k for k in changed)
    assert any(k.endswith("gate.bias") for k in changed)          # the drafter's own balancing ran
    assert len(s["val_acceptance"]) == load_config("debug").dspark_block_size
    assert len(s["greedy_acceptance"]) == load_config("debug").dspark_block_size
    assert s["dspark_data"] == "greedy" and s["dspark_pool"] == 8


def test_greedy_pool_is_the_backbones_own_greedy_text():
    torch.manual_seed(0)
    cfg = load_config("debug")
    m = random_model(cfg)
    set_quantization(m, False)
    prompts = torch.randint(3, cfg.vocab_size - 2, (3, 9))
    seq = greedy_pool(m, prompts, 6, batch=2)                 # two batches: the pool is their concatenation
    assert seq.shape == (3, 15) and torch.equal(seq[:, :9], prompts)
    logits = m(seq, DenseCache(cfg, 3, torch.float32), 0).logits
    assert torch.equal(logits[:, 8:-1].argmax(-1), seq[:, 9:])   # each new token is the argmax after its prefix


def test_greedy_prompts_and_pool_order():
    class Tok:                                                 # one token per character
        def encode_batch(self, texts, add_special_tokens=False):
            return [type("E", (), {"ids": [3 + ord(c) % 50 for c in t]})() for t in texts]
    docs = [type("D", (), {"text": c * n})() for c, n in zip("abcde", (30, 2, 30, 30, 30))]
    p = greedy_prompts(Tok(), docs, 6, 10, seed=0)
    assert p.shape == (6, 10) and bool((p[:, 0] == 0).all())   # <|bos|> first
    firsts = [int(x) for x in p[:4, 1]]
    assert len(set(firsts)) == 4 and 3 + ord("b") % 50 not in firsts   # distinct documents, the short one skipped
    with pytest.raises(ValueError, match="no document"):
        greedy_prompts(Tok(), docs[1:2], 2, 10, seed=0)
    rows = pool_rows(5, 0, 0, 10)
    assert sorted(rows[:5].tolist()) == list(range(5)) and sorted(rows[5:].tolist()) == list(range(5))
    assert torch.equal(pool_rows(5, 0, 3, 4), rows[3:7])      # a slice of the same order (ranks, resume)


def test_greedy_rows_replace_the_corpus_window():
    torch.manual_seed(0)
    cfg = load_config("debug")
    m = random_model(cfg)
    set_quantization(m, False)
    seq = torch.randint(3, cfg.vocab_size - 2, (2, 16))
    mod = DSparkTrainModule(m, anchors=4, greedy_first=9)
    with torch.no_grad():
        loss = float(mod(torch.zeros(2, 16, dtype=torch.long), None, seq)[0])
        assert float(mod(seq.clone(), None, seq)[0]) == pytest.approx(loss, rel=1e-6)   # ids are not read
        assert float(mod(seq, None, None)[0]) != pytest.approx(loss, rel=1e-6)          # corpus anchors differ
    with pytest.raises(ValueError, match="greedy_first"):
        DSparkTrainModule(m, anchors=4)(seq, None, seq)


def test_stage_micro_extras_cover_the_pool():
    stage = DSparkStage(TrainConfig(stage="dspark", init="x", batch_size=3, grad_accum=2))
    stage.pool = torch.arange(10).view(10, 1).expand(10, 4)
    rows = [int(r) for step in range(5) for (x,) in stage.micro_extras(step, Dist()) for r in x[:, 0]]
    assert len(rows) == 30 and sorted(rows[:10]) == list(range(10))    # one pass before any row repeats
