"""`dsv41 analyze memory`'s parallel plan against the plan itself: the bytes a rank's model holds (built by
`dsv41.parallel.loading` on the meta device and cut, packed storage, bfloat16) are the report's per-GPU weight
bytes, for every rank; the fit rows for 4 and 8 H200s; the data-parallel attention cross-over."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dsv41.analysis.memory import kv_memory, parallel_plan
from dsv41.cli import main
from dsv41.config import load_config
from dsv41.parallel.group import Group
from dsv41.parallel.loading import build_rank_model


def held_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, without the Engram tables (host memory in the plan) and the hasher's tables."""
    return sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if "engram.embed." not in n and not n.startswith("engram_hasher."))


@pytest.mark.parametrize("world", [1, 2])
def test_rank_model_bytes_are_the_plan_weights(world):
    cfg = load_config("debug")
    held = [held_bytes(build_rank_model(cfg, Group(r, world), torch.bfloat16, "packed")) for r in range(world)]
    plan = parallel_plan(cfg, world)
    assert max(held) == plan["tensor_parallel_attention"]["weights"]


def test_four_ranks_bytes_with_four_heads():
    cfg = dataclasses.replace(load_config("debug"), n_heads=4, o_groups=4, dim=128)
    held = [held_bytes(build_rank_model(cfg, Group(r, 4), torch.bfloat16, "packed")) for r in range(4)]
    assert max(held) == parallel_plan(cfg, 4)["tensor_parallel_attention"]["weights"]


def test_flash_on_h200s():
    cfg = load_config("v41-flash")
    p = parallel_plan(cfg, 8)
    kv = kv_memory(cfg, 1 << 20, 1)["bytes"]
    assert p["kv_bytes_per_sequence"] == kv
    tp, dp = p["tensor_parallel_attention"], p["data_parallel_attention"]
    # splitting the heads saves 7/8 of the split tensors; data-parallel attention holds them whole
    assert dp["weights"] - tp["weights"] == pytest.approx(p["attention_split_bytes"] * 7 / 8, abs=64)
    assert p["crossover_batch"] == pytest.approx(p["attention_split_bytes"] / kv, rel=1e-9)
    assert p["fits"][8]["fits"] and p["fits"][4]["fits"]
    assert p["fits"][4]["weights"] > p["fits"][8]["weights"]
    assert not parallel_plan(cfg, 3)["splits"]


def test_cli_reports_the_plan(capsys):
    assert main(["analyze", "memory", "--config", "v41-flash", "--gpus", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parallel_plan"]["fits"]["8"]["fits"]
    assert main(["analyze", "memory", "--config", "v41-flash", "--gpus", "8"]) == 0
    assert "Parallel plan (dsv41/parallel), 8 device(s)" in capsys.readouterr().out
