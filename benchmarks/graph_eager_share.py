"""How often the engine's CUDA-graph decode and its eager decode give the same greedy tokens (GPU, bf16, random tiny
model), over several model seeds, in one process: the share `tests/test_graph_decode.py`'s long-run test asserts
(>= 0.95) for seed 3 alone. The two paths sum attention over lists of different widths (capacity-wide in the graph),
so bf16 roundings may part a row's greedy path at a near tie; the share over seeds says whether a kernel choice
parts them more often than chance.

    python benchmarks/graph_eager_share.py [--seeds 3 4 5 6] [--tokens 160]

Env DSV41_HC_MIXES_KERNEL=1 runs with the opt-in mHC mixes kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import load_config  # noqa: E402
from dsv41.engine.engine import Engine  # noqa: E402
from dsv41.engine.sampling import SamplingParams  # noqa: E402
from dsv41.kernels import HC_MIXES_KERNEL  # noqa: E402
from dsv41.model.attention import set_tie_break  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402

PROMPTS = ["hello world", "x" * 100, "def f(x):\n  return x" * 5, "abc", "the quick brown fox " * 10]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5, 6])
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    cfg = load_config("tiny")
    rows = []
    for seed in args.seeds:
        model = random_model(cfg, dtype=torch.bfloat16, seed=seed, device="cuda")
        set_tie_break(model, "recent")
        runs = []
        for g in (False, None):
            eng = Engine(model, max_batch=4, cuda_graphs=g)
            params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True) for _ in PROMPTS]
            runs.append([c.output_ids for c in eng.generate(PROMPTS, params)])
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*runs)]
        same = sum(x == y for a, b in zip(*runs) for x, y in zip(a, b)) / sum(len(a) for a in runs[0])
        rows.append({"seed": seed, "share_equal": same, "first_differing_token_per_prompt": first})
        print(f"seed {seed}: share equal {same:.4f}, first differing token per prompt {first}", flush=True)
    print(json.dumps({"hc_mixes_kernel": HC_MIXES_KERNEL, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
