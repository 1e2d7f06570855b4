"""Guards data parallelism: a 2-process `torchrun` run on CPU (gloo) with batch B per process takes the update of
one process with batch 2B (same data, averaged gradients, identical updates on both ranks).

One step, compared on the weights it writes: a longer loss curve is not a CPU-independent check, since the two
runs sum their gradients in different orders and a later step's top-k routing or balancer sign can flip on a
difference of 1e-7 (on an Intel Xeon the 6-step curves agreed to 3e-6 for 4 steps, then drifted to 9e-3 after
such a flip). Measured with this setup: every tensor within 3e-5 relative L2 of the one-process weights, while a
rank that skipped the gradient average (rank 0's half batch alone) is off by 1.0 on the gate biases.
Takes ~10-20 s (two interpreter start-ups), so it runs in the default suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import logged_losses, small_corpus


def test_two_process_gloo_takes_the_single_process_update(tmp_path):
    d = small_corpus(tmp_path)
    common = ["train", "--preset", "debug", "--data", str(d), "--seq-len", "32", "--steps", "1", "--lr", "2e-3",
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
    assert len(a) == len(b) == 1
    assert abs(a[0] - b[0]) < 1e-5, (a, b)          # same data, same weights: the ranks split the batch 2 + 2
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert one.keys() == two.keys()
    errors = {k: float((two[k].float() - one[k].float()).norm() / one[k].float().norm().clamp_min(1e-30))
              for k in one}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-3, (worst, errors[worst])
