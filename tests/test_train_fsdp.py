"""Guards FSDP2 (`--fsdp`: `fully_shard` per block, Engram and root; optimizers on full gradients, muon.py): a
2-process `torchrun` run on CPU (gloo) with batch B per process takes the update of one process with batch 2B, as
data parallelism does (tests/test_train_ddp.py, which says why one step's weights are compared rather than a loss
curve: a later step's routing can flip on the different reduction order, on some CPUs); the bounded-replay
simulation is on in both, so the per-rank slices of the replay starts are checked too. The slow test resumes an FSDP2 run (sharded optimizer state
per rank) and requires the uninterrupted run's losses bit for bit. ~15 s / ~40 s on 2 shared cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import logged_losses, small_corpus

COMMON = ["train", "--preset", "debug", "--seq-len", "32", "--steps", "6", "--lr", "2e-3", "--eval-windows", "8",
          "--val-fraction", "0.15", "--sample-tokens", "0", "--quiet", "--threads", "1", "--replay", "both"]


def _run(tmp_path: Path, *args: str, procs: int = 0) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)] \
        if procs else [sys.executable]
    r = subprocess.run([*launch, "-m", "dsv41.train.cli", *COMMON, "--data", str(tmp_path / "corpus"), *args],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


def test_two_process_fsdp2_gloo_matches_single_process(tmp_path):
    small_corpus(tmp_path)
    # FSDP2 runs the reference forward (the fast one bypasses its unshard hooks): so does the single process here;
    # fp32 Newton-Schulz on both sides, so that bf16 rounding does not amplify the gradients' reduction order;
    # the indexer objective is off under --fsdp (dsv41/train/pretrain.py), so off in the single process too
    _run(tmp_path, "--batch-size", "4", "--no-fast", "--muon-ns", "fp32", "--indexer-loss-weight", "0",
         "--steps", "1", "--out", str(tmp_path / "one"))
    _run(tmp_path, "--batch-size", "2", "--fsdp", "--muon-ns", "fp32", "--steps", "1", "--out", str(tmp_path / "fsdp"),
         procs=2)
    a, b = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "fsdp")
    assert len(a) == len(b) == 1
    assert abs(a[0] - b[0]) < 1e-5, (a, b)
    ga, gb = (json.loads((tmp_path / d / "log.jsonl").read_text().splitlines()[0])["grad_norm"] for d in ("one", "fsdp"))
    assert abs(ga - gb) / ga < 1e-5, (ga, gb)                                  # clipping sees the sharded grads
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    assert one.keys() == two.keys()
    errors = {k: float((two[k].float() - one[k].float()).norm() / one[k].float().norm().clamp_min(1e-30))
              for k in one}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-3, (worst, errors[worst])
    s = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert s["world"] == 2 and s["replay"] == "both"
    assert {p.name for p in (tmp_path / "fsdp").glob("optimizer.rank*.pt")} == {"optimizer.rank0.pt",
                                                                                 "optimizer.rank1.pt"}


@pytest.mark.slow
def test_fsdp2_resume_is_exact(tmp_path):
    small_corpus(tmp_path)
    common = ["--batch-size", "2", "--fsdp"]
    _run(tmp_path, *common, "--out", str(tmp_path / "full"), procs=2)
    _run(tmp_path, *common, "--out", str(tmp_path / "split"), "--stop-at", "3", procs=2)
    assert len(logged_losses(tmp_path / "split")) == 3
    _run(tmp_path, *common, "--out", str(tmp_path / "split"), "--resume", procs=2)
    a, b = logged_losses(tmp_path / "full"), logged_losses(tmp_path / "split")
    assert a == b and len(a) == 6, (a, b)
