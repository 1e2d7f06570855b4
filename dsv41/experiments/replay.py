"""Study: Bounded Replay's error against the exact state as a function of the distance from the recovery point,
for decoder replay (ced-bounded prefill) and encoder replay (a prefix hit without SWA state), docs/system.md §2/§4.

One training-style prefill per sequence computes it at every distance at once (`dsv41.train.qat`): with the
sliding windows of the replaying layers truncated at the recovery point s (`ForwardOptions.window_floor`), the
logits at position s + d are those of a replay that started d tokens earlier; the exact counterpart is the same
prefill without the floor. Decoder replay matches the engine's ced-bounded prefill (tests/test_train_replay.py);
for the encoder the simulation recomputes the global KV of the replayed rows from truncated windows where the
engine reuses the cached one, so it bounds the engine's error from above. The decoder's error must vanish once
d >= D x (W - 1) (D decoder layers: the dependency halo of ced-exact), the encoder's need not (its KV sources
write truncated states into the global KV that every later query reads).
"""

from __future__ import annotations

import torch

from dsv41.experiments.counterparts import compare
from dsv41.experiments.report import markdown_table
from dsv41.model.step import ForwardOptions
from dsv41.train.pretrain import replay_layers
from dsv41.train.qat import sequence_forward

SIDES = ("decoder", "encoder")


@torch.no_grad()
def replay_errors(model, ids: torch.Tensor, start: int, side: str) -> list[dict]:
    """Per distance d = 0 .. T-1-start from the recovery point `start`: KL(exact || replay) and top-1 agreement
    (over the batch rows) for `side`'s layers replaying from `start`. ids [B,T]."""
    if side not in SIDES:
        raise ValueError(f"replay side must be one of {SIDES}, got {side!r}")
    B, T = ids.shape
    if not model.cfg.window_size <= start < T:
        raise ValueError(f"recovery point {start} must lie in [W={model.cfg.window_size}, {T - 1}]")
    floor = torch.full((B,), start, dtype=torch.long, device=ids.device)
    opts = ForwardOptions(window_floor=floor, window_floor_layers=replay_layers(model.cfg, side))
    exact = sequence_forward(model, ids).logits[:, start:].float()
    approx = sequence_forward(model, ids, opts).logits[:, start:].float()
    return [{"distance": d, **compare(exact[:, d:d + 1], approx[:, d:d + 1])} for d in range(T - start)]


def bucketed(errors: list[dict], width: int) -> list[dict]:
    """Mean KL / top-1 over distance buckets [k*width, (k+1)*width)."""
    out = []
    for lo in range(0, len(errors), width):
        part = errors[lo:lo + width]
        out.append({"from": lo, "to": lo + len(part) - 1, "kl": sum(e["kl"] for e in part) / len(part),
                    "kl_max": max(e["kl_max"] for e in part), "top1": sum(e["top1"] for e in part) / len(part)})
    return out


def replay_study(model, ids: torch.Tensor) -> dict:
    """Both sides from the recovery point W over ids [B, W + L x W]; buckets of W tokens."""
    W = model.cfg.window_size
    return {side: bucketed(replay_errors(model, ids, W, side), W) for side in SIDES} | {"window": W}


def table(result: dict) -> str:
    rows = [[f"{a['from']}-{a['to']}", a["kl"], a["top1"], b["kl"], b["top1"]]
            for a, b in zip(result["decoder"], result["encoder"])]
    return markdown_table(["distance from recovery (tokens)", "decoder KL", "decoder top-1", "encoder KL",
                           "encoder top-1"], rows)


def plot(result: dict):
    def draw(ax):
        for side in SIDES:
            xs = [(b["from"] + b["to"]) / 2 for b in result[side]]
            ax.plot(xs, [max(b["kl"], 1e-12) for b in result[side]], marker="o", label=f"{side} replay")
        ax.set_yscale("log")
        ax.set_xlabel(f"distance from the recovery point (tokens; W = {result['window']})")
        ax.set_ylabel("mean KL(exact || replay), nats")
        ax.legend()
    return draw
