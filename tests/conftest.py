"""Shared test setup: markers (slow, gpu), the torch warm-up, and paths to the bundled golden data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv41.model.common import warm_up_transcendentals

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("DSV41_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: use --runslow or DSV41_SLOW=1"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_sessionstart(session):
    # torch 2.13 CPU can get the first vectorised cos/sin/sqrt of a process slightly wrong (golden README s.6)
    warm_up_transcendentals()
