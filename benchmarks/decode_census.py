"""Where a decode step's host work goes, counted on the CPU (the GPU decode step is host-bound).

Runs one-token decode steps of a v41-geometry-shaped model (the preset's 40 layer roles, CSA2 sources, candidate
pool, Engram layers, 16 experts / 6 active; widths shrunk so it runs on a CPU) over a synthetically filled packed
store, and counts the torch ops that each source line of dsv41 dispatches in one step. The kernel ops of
`dsv41.kernels` (one or a few Triton launches each on a GPU) count as one call at their call site: here their torch
references run, and the ops inside them are not counted. The MoE takes the experts op as it does on a GPU. Every op
that is not a view is about one kernel launch on the GPU; H2D copies there also cost a stream sync unless they go
through `dsv41.devices.h2d`.

    python benchmarks/decode_census.py [--context 8192] [--top 30]

Prints the ops per line (top lines) and the kernel-op calls, then a JSON line.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPS = {"view", "_unsafe_view", "as_strided", "reshape", "unsqueeze", "squeeze", "expand", "permute",
            "transpose", "t", "select", "slice", "alias", "detach", "unflatten", "flatten", "view_as_real",
            "view_as_complex", "_reshape_alias", "split", "chunk", "unbind", "narrow", "diagonal", "_conj",
            "resolve_conj", "resolve_neg", "lift_fresh"}
# the kernel ops as the model's modules import them: module -> names
KERNEL_OPS = {"dsv41.model.common": ["qdq_fp8", "rms_norm", "rope"], "dsv41.model.attention": ["qdq_fp8", "qdq_index_k", "sparse_attn"],
              "dsv41.model.moe": ["qdq_fp8", "expert_act", "moe_experts", "moe_gate"],
              "dsv41.model.packed_decode": ["sparse_attn_packed", "indexer_topk_packed"],
              "dsv41.model.block": ["mhc_fused", "hc_mixes"], "dsv41.model.dspark": ["sparse_attn"],
              "dsv41.kv.batch_view": ["pack_swa_rows"]}


def geometry_config(shrink: bool = True):
    """v41-geometry with its layer structure kept and its widths shrunk (Engram tables resized to match)."""
    from dsv41.config import load_config
    from dsv41.model.engram import engram_primes
    cfg = load_config("v41-geometry")
    if not shrink:
        return cfg
    cfg = dataclasses.replace(
        cfg, vocab_size=2048, dim=256, moe_inter_dim=64, n_heads=8, q_lora_rank=64, head_dim=64, rope_head_dim=16,
        o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=64, candidate_topk_blocks=32,
        engram_vocab_size=3000, engram_compressed_vocab_size=2048, engram_n_heads=2, engram_head_dim=32,
        dspark_noise_token_id=2000, dspark_markov_rank=16, vision_n_layers=1, vision_dim=64, vision_n_heads=1,
        vision_inter_dim=64, vision_max_n_token=64, vision_min_pixels=1764, image_token_id=2040)
    sizes = [sum(sum(h) for h in layer) for layer in engram_primes(cfg)]
    return dataclasses.replace(cfg, engram_num_embeddings=sizes)


class Census(TorchDispatchMode):
    """Counts dispatched ops by (innermost dsv41 source line, op); ops inside a kernel op are skipped."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside = threading.local()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(self.inside, "depth", 0):
            f = sys._getframe(1)
            while f is not None and "/dsv41/" not in f.f_code.co_filename:
                f = f.f_back
            loc = "?" if f is None else f"{f.f_code.co_filename.split('/dsv41/')[-1]}:{f.f_lineno}"
            self.ops[(loc, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def patch_kernel_ops(census: Census) -> collections.Counter:
    """Wrap the kernel ops the model calls: one count per call (op name, call site), their inner ops skipped."""
    import importlib
    calls: collections.Counter = collections.Counter()

    def wrap(name, fn):
        def op(*a, **k):
            f = sys._getframe(1)
            calls[(name, f"{f.f_code.co_filename.split('/dsv41/')[-1]}:{f.f_lineno}")] += 1
            census.inside.depth = getattr(census.inside, "depth", 0) + 1
            try:
                return fn(*a, **k)
            finally:
                census.inside.depth -= 1
        return op

    for mod_name, names in KERNEL_OPS.items():
        mod = importlib.import_module(mod_name)
        for n in names:
            setattr(mod, n, wrap(n, getattr(mod, n)))
    from dsv41.kernels.choice import FUSED_MOE_MAX_TOKENS
    from dsv41.model import moe
    moe.fused_moe = lambda x: x.size(0) <= FUSED_MOE_MAX_TOKENS             # as on a GPU
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="tokens of synthetic packed history")
    ap.add_argument("--top", type=int, default=30, help="source lines to list")
    args = ap.parse_args()
    from dsv41.engine.store import make_pool
    from dsv41.kv.accounting import fill_random
    from dsv41.model.init import random_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = geometry_config()
    census = Census()
    calls = patch_kernel_ops(census)
    model = random_model(cfg, dtype=torch.bfloat16, device="cpu")
    pool = make_pool(model, "cpu")
    sid = pool.new_sequence()
    fill_random(pool, sid, args.context)
    tok = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(2):                                        # warm-up steps (memos, first-call work)
            model(tok, pool.bind([sid]), last_only=True)
        calls.clear()
        t0 = time.perf_counter()
        view = pool.bind([sid])
        with census:
            model(tok, view, last_only=True)
        wall = time.perf_counter() - t0
    per_line: dict = collections.defaultdict(collections.Counter)
    for (loc, op), n in census.ops.items():
        per_line[loc][op] += n
    launches = {loc: sum(n for op, n in c.items() if op not in VIEW_OPS) for loc, c in per_line.items()}
    total_ops = sum(launches.values())
    n_calls = sum(calls.values())
    by_op = collections.Counter()
    for (name, _), n in calls.items():
        by_op[name] += n
    print(f"decode step, {cfg.n_layers} layers, context {args.context}: {total_ops} non-view torch ops outside the "
          f"kernel ops + {n_calls} kernel-op calls ({dict(by_op)}); census wall {wall:.2f} s")
    print(f"{'ops':>6}  {'source line':42s} ops by kind")
    for loc, n in sorted(launches.items(), key=lambda kv: -kv[1])[:args.top]:
        kinds = ", ".join(f"{op} x{c}" for op, c in per_line[loc].most_common() if op not in VIEW_OPS)
        print(f"{n:6d}  {loc:42s} {kinds[:120]}")
    top = sorted(launches.items(), key=lambda kv: -kv[1])[:args.top]
    print(json.dumps({"benchmark": "decode_census", "context": args.context, "layers": cfg.n_layers,
                      "non_view_ops": total_ops, "kernel_op_calls": dict(by_op), "top_lines": top}))


if __name__ == "__main__":
    main()
