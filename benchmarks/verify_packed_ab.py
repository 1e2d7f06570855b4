"""Speculative-verify forward, dense path vs packed in place (`dsv41.kernels.choice.set_packed_verify`), side by
side on the same sequences: one row at each context, a plain decode step (1 token) and verifies of T tokens,
eager. Prints ms per forward (median of STEPS after a warm-up) and the largest logit difference between the two
paths; writes nothing.

    python benchmarks/verify_packed_ab.py       # CONFIG (v41-geometry on a GPU, tiny on a CPU), CONTEXTS (4096,65536),
                                                # TOKENS (5), STEPS (5), DTYPE (bfloat16 on a GPU, float32 on a CPU)
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import load_config  # noqa: E402
from dsv41.engine.bench import synthetic_batch, timed  # noqa: E402
from dsv41.kernels.choice import set_packed_verify  # noqa: E402
from dsv41.model.attention import set_tie_break  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(os.environ.get("CONFIG", "v41-geometry" if dev == "cuda" else "tiny"))
    dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16" if dev == "cuda" else "float32"))
    T, steps = int(os.environ.get("TOKENS", "5")), int(os.environ.get("STEPS", "5"))
    model = random_model(cfg, dtype=dtype, device=dev)
    set_tie_break(model, "recent")          # exact ties among index scores (FP4 keys) pick alike in both layouts
    for n in [int(x) for x in os.environ.get("CONTEXTS", "4096,65536").split(",")]:
        pool, sids, _ = synthetic_batch(model, dev, 1, n)
        row, logits = {}, {}
        for name, tokens, packed in (("decode", 1, False), ("verify dense", T, False), ("verify packed", T, True)):
            set_packed_verify(packed)
            ids = torch.zeros(1, tokens, dtype=torch.long, device=dev)
            times = []
            with torch.no_grad():
                for _ in range(steps + 1):                  # each call on a fork of the same state, freed after it
                    fork = pool.fork(sids[0])
                    view = pool.bind([fork])
                    times.append(timed(lambda: logits.__setitem__(name, model(ids, view).logits), dev))
                    pool.release(view, [fork])
                    pool.free(fork)
            row[name] = statistics.median(times[1:]) * 1e3
        set_packed_verify(False)
        diff = float((logits["verify dense"].float() - logits["verify packed"].float()).abs().max())
        print(f"context {n}, {T} tokens: " +
              ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()) + f"; max |logit diff| dense vs packed {diff:.3g}",
              flush=True)


if __name__ == "__main__":
    main()
