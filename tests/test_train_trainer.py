"""Guards the trainer end to end on the debug preset: the loss falls over ~20 steps, a run stopped halfway and
resumed reproduces the uninterrupted run bit for bit (losses, weights, optimizer and data position), and the
checkpoint loads with `load_model` (tokenizer and Engram token map included) into the same function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsv41.train.data import stdlib_root
from dsv41.train.trainer import TrainConfig, Trainer, train


@pytest.fixture(autouse=True)
def _restore_threads():
    """The trainer runs with one thread here (steadier on a shared 2-core machine); give the rest back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def small_corpus(tmp_path: Path, n: int = 40) -> Path:
    """The first n top-level stdlib modules (sorted), copied: a small, always-present code corpus."""
    d = tmp_path / "corpus"
    d.mkdir()
    for p in sorted(stdlib_root().glob("*.py"))[:n]:
        shutil.copy(p, d / p.name)
    return d


def _cfg(tmp_path: Path, out: str, **kw) -> TrainConfig:
    base = dict(preset="debug", data=str(small_corpus(tmp_path) if not (tmp_path / "corpus").exists()
                                         else tmp_path / "corpus"),
                out=str(tmp_path / out), seq_len=32, batch_size=4, lr=1e-2, eval_windows=8, val_fraction=0.15,
                sample_tokens=8, quiet=True, seed=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()
            if '"loss"' in line]


def test_loss_decreases(tmp_path):
    s = train(_cfg(tmp_path, "run", steps=20, eval_every=20))
    losses = _losses(tmp_path / "run")
    assert len(losses) == 20
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    assert s["val_loss"] < 6.3 and s["val_bpb"] > 0 and (tmp_path / "run" / "loss_curve.png").is_file()
    assert "sample" in s


def test_exact_resume(tmp_path):
    N = 6
    train(_cfg(tmp_path, "full", steps=N, eval_every=3))
    train(_cfg(tmp_path, "split", steps=N, eval_every=3), stop_at=N // 2)
    assert len(_losses(tmp_path / "split")) == N // 2
    train(_cfg(tmp_path, "split", steps=N, eval_every=3), resume=True)
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert a == b and len(a) == N                                     # bit-identical losses, step by step
    from safetensors.torch import load_file
    wa, wb = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" /
                                                                                 "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = torch.load(tmp_path / "full" / "train_state.pt", weights_only=True)
    sb = torch.load(tmp_path / "split" / "train_state.pt", weights_only=True)
    assert sa["loader"] == sb["loader"] and sa["step"] == sb["step"] == N


def test_checkpoint_loads_for_inference(tmp_path):
    cfg = _cfg(tmp_path, "ck", steps=2, eval_every=2)
    t = Trainer(cfg)
    t.run()
    t.finish()
    from dsv41.model.cache import DenseCache
    from dsv41.model.common import set_quantization
    from dsv41.model.loading import load_model
    model, mcfg = load_model(tmp_path / "ck")
    set_quantization(model, False)
    assert mcfg.engram_compressed_vocab_size == t.model_cfg.engram_compressed_vocab_size
    ids = t.val_windows[:2, :20]
    ref = t.model.eval()(ids, DenseCache(mcfg, 2, torch.float32), 0).logits
    got = model(ids, DenseCache(mcfg, 2, torch.float32), 0).logits
    assert torch.equal(ref, got)
