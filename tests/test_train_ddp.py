"""Guards data parallelism: a 2-process `torchrun` run on CPU (gloo) with batch B per process follows the loss
curve of one process with batch 2B (same data, averaged gradients, identical updates on both ranks).
Takes ~10-30 s (two interpreter start-ups), so it runs in the default suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import logged_losses, small_corpus


def test_two_process_gloo_matches_single_process(tmp_path):
    d = small_corpus(tmp_path)
    common = ["train", "--preset", "debug", "--data", str(d), "--seq-len", "32", "--steps", "6", "--lr", "2e-3",
              "--eval-windows", "8", "--val-fraction", "0.15", "--sample-tokens", "0", "--quiet", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    single = subprocess.run([sys.executable, "-m", "dsv41.train.cli", *common, "--batch-size", "4", "--out",
                             str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "dsv41.train.cli", *common, "--batch-size", "2", "--out", str(tmp_path / "two")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-2000:]
    a, b = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-3, (a, b)
