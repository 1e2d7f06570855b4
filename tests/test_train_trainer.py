"""Guards the trainer end to end on the debug preset: the loss falls over ~20 steps, a run stopped halfway and
resumed reproduces the uninterrupted run bit for bit (losses, weights, optimizer and data position), also when
resumed to a new budget (steps: a total; minutes: more time), and the checkpoint loads with `load_model`
(tokenizer and Engram token map included) into the same function."""

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


def _lrs(out: Path) -> list[float]:
    import json
    return [json.loads(x)["lr"] for x in (out / "log.jsonl").read_text().splitlines() if '"loss"' in x]


def test_exact_resume(tmp_path, capsys):
    """Stopped halfway and resumed, then resumed again with a larger step budget (a total): the losses, learning
    rates, weights and data position equal, bit for bit, those of one process that ran the first plan and
    re-planned to the new total at the same step (`Trainer.replan`). A budget already reached trains nothing."""
    N1, N2 = 4, 7
    full = Trainer(_cfg(tmp_path, "full", steps=N1, eval_every=2))
    full.run()
    full.replan(N2)
    full.run()
    full.finish()
    train(_cfg(tmp_path, "split", steps=N1, eval_every=2), stop_at=N1 // 2)
    assert len(logged_losses(tmp_path / "split")) == N1 // 2
    train(_cfg(tmp_path, "split", eval_every=2), resume=True)        # no budget given: to the planned end
    a = logged_losses(tmp_path / "full")
    assert logged_losses(tmp_path / "split") == a[:N1]                # bit-identical, step by step
    s = train(_cfg(tmp_path, "split", steps=N2, eval_every=2), resume=True)
    b = logged_losses(tmp_path / "split")
    assert a == b and len(a) == N2 and s["steps"] == s["total_steps"] == N2
    lr = _cfg(tmp_path, "x").lr                                       # the finished plan's 0.1x, held to N2
    assert _lrs(tmp_path / "full") == _lrs(tmp_path / "split") and _lrs(tmp_path / "split")[N1:] == [0.1 * lr] * 3
    from safetensors.torch import load_file
    wa, wb = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" /
                                                                                 "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = torch.load(tmp_path / "full" / "train_state.pt", weights_only=True)
    sb = torch.load(tmp_path / "split" / "train_state.pt", weights_only=True)
    assert sa["loader"] == sb["loader"] and sa["step"] == sb["step"] == N2 and sa["schedule"] == sb["schedule"]
    capsys.readouterr()
    for steps in (N2, 5, None):                                        # at or below the saved step, or none
        s = train(_cfg(tmp_path, "split", steps=steps, quiet=False), resume=True)
        assert s["trained"] is False and s["steps"] == N2
        assert "nothing to train" in capsys.readouterr().out
    assert logged_losses(tmp_path / "split") == b


def test_resume_for_more_minutes(tmp_path):
    """`minutes` on a resumed run is this command's time: the probe measures what fits and the run trains that
    many steps more (at least one), past its finished total."""
    train(_cfg(tmp_path, "run", steps=2, eval_every=2, sample_tokens=0))
    s = train(_cfg(tmp_path, "run", minutes=0.2, eval_every=2, sample_tokens=0), resume=True)
    losses = logged_losses(tmp_path / "run")
    assert s["steps"] == s["total_steps"] == len(losses) > 2 and "val_loss" in s


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
