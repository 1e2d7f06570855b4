"""Guards the bounded-replay training simulation (docs/system.md §2, §4 and §6; design in dsv41/train/qat.py):
the window floor in `window_indices`' prefill branch (exact lists), its effect on a training prefill (queries
before the replay start bit-identical, after it changed, layers outside the chosen set untouched), that it
computes what inference computes for the same truncation (a continuation over a store without SWA state, and the
engine's ced-bounded prefill for the decoder), and the trainer's `replay` mode (runs, resumes bit for bit)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsv41.config import ced_split
from dsv41.engine.prefill import prefill
from dsv41.model.attention import window_indices
from dsv41.model.cache import DenseCache
from dsv41.model.step import ForwardOptions
from dsv41.train.pretrain import replay_layers, replay_starts
from dsv41.train.trainer import train
from tests.conftest import continuous_model, rel
from tests.conftest import logged_losses
from tests.test_train_trainer import _cfg


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def tokens(cfg, B, T, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ (a) index lists

def test_window_indices_prefill_floor_exact_lists():
    start = torch.zeros(3, dtype=torch.long)
    plain = [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    got = window_indices(start, 6, 3, True, torch.tensor([3, 0, 5]))
    assert got.tolist() == [
        plain[:3] + [[-1, -1, 3], [-1, 3, 4], [3, 4, 5]],           # floor 3: queries 0..2 keep their windows
        plain,                                                      # floor 0: nothing to hide
        plain[:5] + [[-1, -1, 5]],                                  # floor 5: only the last query loses keys
    ]
    assert window_indices(start, 6, 3, True).tolist() == [plain] * 3
    # a floor beyond a short window (T < W): the list width stays min(T, W)
    assert window_indices(start[:1], 4, 8, True, torch.tensor([2])).tolist() == [
        [[0, -1, -1, -1], [0, 1, -1, -1], [-1, -1, 2, -1], [-1, -1, 2, 3]]]
    # queries at/after the floor list the same positions, in the same order, as a continuation chunk starting
    # at the floor (ring || chunk, ring slots all hidden): the prefill branch at floor f == the replay path
    W, T, f = 4, 12, 6
    pre = window_indices(start[:1], T, W, True, torch.tensor([f]))[0, f:]
    cont = window_indices(torch.tensor([f]), T - f, W, False, torch.tensor([f]))[0]
    assert torch.equal(torch.where(cont >= 0, cont - W + f, -1), pre)


def test_replay_starts_and_layers():
    a = replay_starts(0, 5, (2, 8), 8, 32)
    assert a.shape == (2, 8) and int(a.min()) >= 8 and int(a.max()) <= 31
    assert torch.equal(a, replay_starts(0, 5, (2, 8), 8, 32))                   # (seed, step) alone decide
    assert not torch.equal(a, replay_starts(0, 6, (2, 8), 8, 32))
    assert not torch.equal(a, replay_starts(1, 5, (2, 8), 8, 32))
    assert replay_starts(0, 5, (1, 4), 8, 8) is None                              # T - 1 < W: skipped
    assert int(replay_starts(0, 5, (1, 64), 8, 9).unique().numel()) == 1          # T - 1 == W: s = W only
    many = replay_starts(3, 0, (1, 4000), 8, 32)
    assert many.unique().tolist() == list(range(8, 32))                           # covers [W, T-1]
    cfg, _ = continuous_model("debug")
    split = ced_split(cfg)
    assert replay_layers(cfg, "off") is None
    assert replay_layers(cfg, "decoder") == frozenset(range(split, cfg.n_layers))
    assert replay_layers(cfg, "encoder") == frozenset(range(split))
    assert replay_layers(cfg, "both") == frozenset(range(cfg.n_layers))


# ------------------------------------------------------------------------------------------ (b) model effect

@pytest.mark.usefixtures("one_thread")
def test_floor_changes_only_queries_at_or_after_it_in_chosen_layers():
    cfg, m = continuous_model("debug")
    T, s = 40, torch.tensor([21, 30])
    ids = tokens(cfg, 2, T)
    split = ced_split(cfg)
    with torch.no_grad():
        rec0, rec1 = {}, {}
        ref = m(ids, DenseCache(cfg, 2, torch.float32), 0, ForwardOptions(record=rec0)).logits
        got = m(ids, DenseCache(cfg, 2, torch.float32), 0, ForwardOptions(window_floor=s)).logits
        dec = m(ids, DenseCache(cfg, 2, torch.float32), 0, ForwardOptions(
            window_floor=s, record=rec1, window_floor_layers=frozenset(range(split, cfg.n_layers)))).logits
        none = m(ids, DenseCache(cfg, 2, torch.float32), 0,
                 ForwardOptions(window_floor=s, window_floor_layers=frozenset())).logits
    assert torch.equal(none, ref)                                     # no layer chosen: exactly no floor
    for b in range(2):
        sb = int(s[b])
        for out in (got, dec):
            # queries before the start: the same function. Not bit for bit: the floor changes the routes of the
            # later queries, so each expert's GEMM runs over another number of rows, and the math library's
            # summation order for a row may depend on that count (a 1-ulp difference seen on an AMD EPYC)
            assert rel(out[b, :sb], ref[b, :sb]) < 1e-5
            gap = (out[b, sb:] - ref[b, sb:]).abs().amax(-1)
            assert bool((gap > 1e-3).all()), gap                      # every query from the start on changes
    for L in range(split):                                            # encoder untouched by a decoder floor
        assert torch.equal(rec1[("block_out", L)], rec0[("block_out", L)]), L
    assert not torch.equal(rec1[("block_out", split)], rec0[("block_out", split)])


# ------------------------------------------------------------------------------------------ (c) == inference

@pytest.mark.usefixtures("one_thread")
def test_training_floor_equals_continuation_over_store_without_swa():
    """One training prefill with floor s on every layer == prefill [0, s), drop the SWA state (rings filled
    with garbage that would show if read), continue [s, T) with window_floor s: positions >= s agree to the
    dataflow tolerance (fp32, no QDQ, deterministic ties), and differ clearly from the unfloored model."""
    cfg, m = continuous_model("debug")
    T, s = 40, 21                                     # s not group-aligned: the compressor carries across it
    ids = tokens(cfg, 2, T, seed=1)
    floor = torch.full((2,), s)
    with torch.no_grad():
        one = m(ids, DenseCache(cfg, 2, torch.float32), 0,
                ForwardOptions(window_floor=floor, window_floor_layers=frozenset(range(cfg.n_layers)))).logits
        plain = m(ids, DenseCache(cfg, 2, torch.float32), 0).logits
        c = DenseCache(cfg, 2, torch.float32)
        m(ids[:, :s], c, 0)
        g = torch.Generator().manual_seed(0)
        for ring in c.window.values():
            ring.copy_(torch.randn(ring.shape, generator=g) * 1e3)
        cont = m(ids[:, s:], c, s, ForwardOptions(window_floor=floor)).logits
    assert rel(cont, one[:, s:]) < 1e-5
    assert rel(plain[:, s:], one[:, s:]) > 1e-2


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("N", [24, 37])
def test_training_decoder_floor_equals_ced_bounded_prefill(N):
    """Decoder mode == the engine's ced-bounded prefill (Decoder SWA Bounded Replay): a prompt of N tokens runs
    the decoder on its last W rows with the window truncated at s = N - W; the training prefill with floor s on
    the decoder layers gives the same last-position logits (and not the full-prefill ones)."""
    cfg, m = continuous_model("debug")
    W = cfg.window_size
    ids = tokens(cfg, 2, 40, seed=2)
    s = torch.full((2,), N - W)
    with torch.no_grad():
        eng = prefill(m, ids[:, :N], DenseCache(cfg, 2, torch.float32), mode="ced-bounded").logits
        full = prefill(m, ids[:, :N], DenseCache(cfg, 2, torch.float32), mode="full").logits
        tr = m(ids, DenseCache(cfg, 2, torch.float32), 0,
               ForwardOptions(window_floor=s, window_floor_layers=replay_layers(cfg, "decoder"))).logits[:, N - 1]
    assert rel(tr, eng) < 1e-5
    assert rel(full, eng) > 1e-3


# ------------------------------------------------------------------------------------------ (d) trainer

def test_trainer_replay_runs_and_resumes_exactly(tmp_path):
    N = 4
    s = train(_cfg(tmp_path, "full", steps=N, eval_every=2, replay="both", sample_tokens=0))
    a = logged_losses(tmp_path / "full")
    assert len(a) == N and all(math.isfinite(x) for x in a) and s["replay"] == "both"
    train(_cfg(tmp_path, "split", steps=N, eval_every=2, replay="both", sample_tokens=0), stop_at=N // 2)
    train(_cfg(tmp_path, "split", steps=N, eval_every=2, sample_tokens=0), resume=True)   # mode from the checkpoint
    assert logged_losses(tmp_path / "split") == a                     # bit-identical, step by step
    from safetensors.torch import load_file
    wa, wb = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("full", "split"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    state = torch.load(tmp_path / "split" / "train_state.pt", weights_only=True)
    assert state["config"]["replay"] == "both"
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["replay"] == "both"
    train(_cfg(tmp_path, "off", steps=1, eval_every=1, sample_tokens=0))
    off = logged_losses(tmp_path / "off")[0]                          # same weights and data, no floor
    assert off != a[0] and abs(off - a[0]) < 0.5, (off, a[0])


def test_trainer_replay_validation(tmp_path):
    with pytest.raises(ValueError, match="--replay"):
        _cfg(tmp_path, "x", replay="sometimes").validate()
    with pytest.raises(ValueError, match="--replay"):
        _cfg(tmp_path, "x", stage="dspark", init=str(tmp_path), replay="decoder").validate()
