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


# Parity and exactness tests: the README's test command runs them a second time under another CPU dispatch
# (`-m dispatch` with ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2), so that an assertion that only
# holds on one machine's math library fails in CI instead of on a user's CPU.
DISPATCH_MODULES = {"test_golden", "test_vision", "test_gemm_order", "test_model", "test_engram", "test_train_fast",
                    "test_train_replay", "test_train_qat", "test_kernels_moe", "test_codecs", "test_speculative",
                    "test_engine", "test_deterministic"}


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("DSV41_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        if item.module.__name__.rpartition(".")[2] in DISPATCH_MODULES:
            item.add_marker(pytest.mark.dispatch)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: use --runslow or DSV41_SLOW=1"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_sessionstart(session):
    # torch 2.13 CPU can get the first vectorised cos/sin/sqrt of a process slightly wrong (docs/golden.md §6)
    warm_up_transcendentals()


@pytest.fixture(autouse=True, scope="session")
def _prefix_cache_root_in_tmp(tmp_path_factory):
    """`dsv41 serve` caches prefixes by default under $DSV41_CACHE_DIR: a temp dir here (subprocesses inherit it)."""
    os.environ["DSV41_CACHE_DIR"] = str(tmp_path_factory.mktemp("dsv41-cache-root"))


@pytest.fixture(autouse=True)
def _deterministic_mode_off():
    """The deterministic mode is process-wide (an Engine(deterministic=True) switches it on): off after each test."""
    yield
    from dsv41.kernels import set_deterministic
    set_deterministic(False)


@pytest.fixture
def restore_backend():
    """Put the kernel backend switch's state back after a test that changes it."""
    from dsv41.kernels import backend as kb
    saved = dict(kb._state)
    yield
    kb._state.clear()
    kb._state.update(saved)


def continuous_model(name: str = "debug", seed: int = 1):
    """A random model made continuous (FP8/FP4 QDQs off) with the deterministic top-k tie rule: the setting in
    which dataflow equalities (decode == prefill, chunked == one-shot, batched == alone) hold to ~1e-5."""
    from dsv41.config import load_config
    from dsv41.model.attention import set_tie_break
    from dsv41.model.common import set_quantization
    from dsv41.model.init import random_model

    cfg = load_config(name)
    m = random_model(cfg, seed=seed)
    set_quantization(m, False)
    set_tie_break(m, "recent")
    return cfg, m


def small_corpus(tmp_path: Path, n: int = 40) -> Path:
    """The first n top-level stdlib modules (sorted), copied to tmp_path/corpus: a small, always-present code
    corpus for training tests."""
    import shutil

    from dsv41.train.data import stdlib_root
    d = tmp_path / "corpus"
    d.mkdir()
    for p in sorted(stdlib_root().glob("*.py"))[:n]:
        shutil.copy(p, d / p.name)
    return d


def logged_losses(out: Path) -> list[float]:
    """Per-step training losses from a run's log.jsonl."""
    import json
    return [json.loads(x)["loss"] for x in (out / "log.jsonl").read_text().splitlines() if '"loss"' in x]


def rel(a, b) -> float:
    """Max over rows of the relative L2 error along the last axis."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (restored afterwards): on a shared 2-core machine the debug model's MoE
    index_add is ~10x slower with 2 threads; results are only compared within one thread setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
