"""Guards the trainer end to end on the debug preset: the loss falls over ~20 steps, a run stopped halfway and
resumed reproduces the uninterrupted run bit for bit (losses, weights, optimizer and data position), and the
checkpoint loads with `load_model` (tokenizer and Engram token map included) into the same function."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.train.config import TrainConfig
from dsv41.train.trainer import Trainer, train
from tests.conftest import logged_losses, small_corpus


@pytest.fixture(autouse=True)
def _restore_threads():
    """The trainer runs with one thread here (steadier on a shared 2-core machine); give the rest back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cfg(tmp_path: Path, out: str, **kw) -> TrainConfig:
    base = dict(preset="debug", data=str(small_corpus(tmp_path) if not (tmp_path / "corpus").exists()
                                         else tmp_path / "corpus"),
                out=str(tmp_path / out), seq_len=32, batch_size=4, lr=1e-2, eval_windows=8, val_fraction=0.15,
                sample_tokens=8, quiet=True, seed=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_decreases(tmp_path):
    s = train(_cfg(tmp_path, "run", steps=20, eval_every=20))
    losses = logged_losses(tmp_path / "run")
    assert len(losses) == 20
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    assert s["val_loss"] < 6.3 and s["val_bpb"] > 0 and (tmp_path / "run" / "loss_curve.png").is_file()
    assert "sample" in s


def test_exact_resume(tmp_path):
    N = 6
    train(_cfg(tmp_path, "full", steps=N, eval_every=3))
    train(_cfg(tmp_path, "split", steps=N, eval_every=3), stop_at=N // 2)
    assert len(logged_losses(tmp_path / "split")) == N // 2
    train(_cfg(tmp_path, "split", steps=N, eval_every=3), resume=True)
    a, b = logged_losses(tmp_path / "full"), logged_losses(tmp_path / "split")
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
