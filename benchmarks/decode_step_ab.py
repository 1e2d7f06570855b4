"""The graph-replayed decode step with a kernel choice on and off, side by side in one run (GPU), against the
step's weight-read limit measured in the same run.

v41-geometry, random bf16 weights held packed as the checkpoint stores them (`pack_weights`), a synthetic 4K
context (`fill_random`), steps replayed from CUDA graphs (`dsv41.engine.graphs`, captured again for each variant).
The variants alternate ROUNDS times; each row reports the median step and step / limit, where the limit is
`dsv41.analysis.memory.decode_read_bytes` over the copy bandwidth (issue #21's decode target: at most 1.5 x at
batch 1, 2 x at batch 32).

Variants (VARIANTS, comma-separated, '+' joins settings; the first is the baseline of the ratios):
  default        the shipped choices
  torch-routing  the MoE op's routing as ~14 torch kernels (moe_kernel.ROUTE_MAX_PAIRS = 0), not the one-program
                 kernel
  torch-row-ops  RMSNorm and RoPE as their torch references (5-9 kernels each), not one Triton launch each
  torch-index-qdq  the indexer's MXFP4 QDQ as the codec's torch ops (~19 kernels), not one launch
  torch-gate     the MoE gate as torch ops (~11 kernels: fp32 GEMM, scores, top-k, gather, normalisation)
  torch-mixes    the unfused mHC mixes (blocks no fused step precedes) as the torch functions (~130 kernels; the
                 default unless DSV41_HC_MIXES_KERNEL=1)
  bf16-decode    decode GEMMs and MoE experts on the bf16-decode kernels (no FP8 tensor-core routes)

    python benchmarks/decode_step_ab.py      # writes benchmarks/results/decode_step_ab_<gpu>.json
Env: CONFIG (v41-geometry), CONTEXT (4096; a comma list runs each), BATCHES (1,32), CASES (overrides both:
"4096:1,4096:32,1048576:1" = context:batch pairs, e.g. issue #21's 1M / 4K step ratio), STEPS (8 per round), ROUNDS (3),
VARIANTS (default,torch-routing+torch-row-ops+torch-mixes+torch-gate+torch-index-qdq), RESULT,
PROFILE (1: after the timing, one replayed step of the first variant under the torch profiler: its kernels grouped
by name, GPU time and launches, the largest first, in the JSON under "profile").
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.analysis.memory import decode_read_bytes  # noqa: E402
from dsv41.config import load_config  # noqa: E402
from dsv41.engine.bench import synthetic_batch, timed  # noqa: E402
from dsv41.engine.graphs import DecodeGraphs  # noqa: E402
from dsv41.kernels import set_backend  # noqa: E402
from dsv41.kernels.ref import apply_rope_ref, rms_norm_ref  # noqa: E402
from dsv41.kernels.triton import fp8_decode, moe_kernel  # noqa: E402
from dsv41.kernels.mhc_math import hc_mixes as hc_mixes_ref  # noqa: E402
from dsv41.kernels.moe_ref import moe_gate_ref  # noqa: E402
from dsv41.codecs import qdq_index_k as qdq_index_k_ref  # noqa: E402
from dsv41.model import attention, block, common, moe  # noqa: E402
from dsv41.model.engram import Engram  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402
from dsv41.model.packed_weights import pack_weights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_weights import copy_bandwidth  # noqa: E402


@contextlib.contextmanager
def variant(name: str):
    """The module settings of one variant ('+' joins several), restored after."""
    route, gemm, mma = moe_kernel.ROUTE_MAX_PAIRS, dict(fp8_decode.FP8_DECODE_FROM), moe_kernel.CONFIG["packed_fp8_mma"]
    norm, rot, mixes, gate, iq = common.rms_norm, common.rope, block.hc_mixes, moe.moe_gate, attention.qdq_index_k
    for part in name.split("+"):
        if part == "torch-routing":
            moe_kernel.ROUTE_MAX_PAIRS = 0
        elif part == "torch-row-ops":
            common.rms_norm, common.rope = rms_norm_ref, apply_rope_ref
        elif part == "torch-index-qdq":
            attention.qdq_index_k = qdq_index_k_ref
        elif part == "torch-gate":
            moe.moe_gate = moe_gate_ref
        elif part == "torch-mixes":
            block.hc_mixes = hc_mixes_ref
        elif part == "bf16-decode":
            fp8_decode.FP8_DECODE_FROM.update({k: 65 for k in gemm})
            moe_kernel.CONFIG["packed_fp8_mma"] = 0
        elif part != "default":
            raise ValueError(f"unknown variant {part!r}")
    try:
        yield
    finally:
        moe_kernel.ROUTE_MAX_PAIRS = route
        fp8_decode.FP8_DECODE_FROM.update(gemm)
        moe_kernel.CONFIG["packed_fp8_mma"] = mma
        common.rms_norm, common.rope, block.hc_mixes, moe.moe_gate, attention.qdq_index_k = norm, rot, mixes, gate, iq


def profile_step(model, pool, sids, tok, context: int, name: str) -> dict:
    """One graph-replayed step under the torch profiler: kernels grouped by name (GPU time, launches)."""
    from torch.profiler import ProfilerActivity, profile
    with variant(name):
        g = DecodeGraphs(model, pool, context + 64)
        for _ in range(3):                                   # capture, then warm replays
            g.forward(tok, pool.bind(sids))
        torch.cuda.synchronize()
        view = pool.bind(sids)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            g.forward(tok, view)
            torch.cuda.synchronize()
        g = None
    kernels: dict[str, list] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time_total * 1e-6 if hasattr(e, "device_time_total") else e.cuda_time_total * 1e-6
            k[1] += 1
    top = sorted(({"name": n, "gpu_s": v[0], "launches": v[1]} for n, v in kernels.items()), key=lambda r: -r["gpu_s"])
    return {"kernels": sum(v[1] for v in kernels.values()), "gpu_s": sum(v[0] for v in kernels.values()), "top": top}


def main() -> None:
    dev = "cuda"
    cfg = load_config(os.environ.get("CONFIG", "v41-geometry"))
    contexts = [int(c) for c in os.environ.get("CONTEXT", "4096").split(",")]
    batches = [int(b) for b in os.environ.get("BATCHES", "1,32").split(",")]
    cases = ([tuple(int(v) for v in c.split(":")) for c in os.environ["CASES"].split(",")] if os.environ.get("CASES")
             else [(c, b) for c in contexts for b in batches])
    n_steps, rounds = int(os.environ.get("STEPS", "8")), int(os.environ.get("ROUNDS", "3"))
    names = os.environ.get("VARIANTS", "default,torch-routing+torch-row-ops+torch-mixes+torch-gate+torch-index-qdq").split(",")
    set_backend("triton")
    bw = copy_bandwidth(dev)
    model = random_model(cfg, dtype=torch.bfloat16, device=dev)
    pack_weights(model)
    for e in (m for m in model.modules() if isinstance(m, Engram)):
        e.pack()                                      # the tables as the checkpoint stores them, on the device
    res = {"config": os.environ.get("CONFIG", "v41-geometry"), "gpu": torch.cuda.get_device_name(),
           "cases": cases, "copy_bandwidth": bw, "variants": names, "command": " ".join(["python"] + sys.argv),
           "commit": os.environ.get("COMMIT", ""), "rows": []}
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    for context, B in cases:
        pool, sids, tok = synthetic_batch(model, dev, B, context)
        limit = decode_read_bytes(cfg, B, "packed")["bytes"] / bw
        times = {n: [] for n in names}
        with torch.no_grad():
            for _ in range(rounds):
                for n in names:
                    with variant(n):
                        g = DecodeGraphs(model, pool, context + rounds * len(names) * (n_steps + 2) + 8)
                        for i in range(n_steps + 1):
                            view = pool.bind(sids)
                            t = timed(lambda: g.forward(tok, view), dev)
                            if i:                                               # the first call captures
                                times[n].append(t)
                        g = None                            # its graphs freed before the next capture
            prof = profile_step(model, pool, sids, tok, context, names[0]) if os.environ.get("PROFILE") == "1" else None
        med = {n: statistics.median(v) for n, v in times.items()}
        row = {"context": context, "batch": B, "limit_s": limit, "step_s": med,
               "step_over_limit": {n: v / limit for n, v in med.items()},
               "over_baseline": {n: v / med[names[0]] for n, v in med.items()}, "samples_s": times}
        if prof is not None:
            row["profile"] = prof
            print(f"context {context}, batch {B}, {names[0]}: {prof['kernels']} kernels, {prof['gpu_s'] * 1e3:.2f} ms GPU time")
            for k in prof["top"][:30]:
                print(f"    {k['gpu_s'] * 1e6:9.1f} us  {k['launches']:5d} x  {k['name'][:110]}")
        res["rows"].append(row)
        print(f"context {context}, batch {B}: limit {limit * 1e3:.2f} ms; " + "; ".join(
            f"{n} {med[n] * 1e3:.2f} ms (x{med[n] / limit:.2f} limit, {med[n] / med[names[0]]:.3f} of {names[0]})"
            for n in names), flush=True)
        del pool
    gpu = torch.cuda.get_device_name().lower()
    name = "h200" if "h200" in gpu else "h100" if "h100" in gpu else "gpu"
    out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / f"decode_step_ab_{name}.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
