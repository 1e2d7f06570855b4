"""Where an eager prefill's host time goes, and what the launch-saving paths buy: side by side in one run.

A prefill of a few hundred tokens on a GPU is host-bound (v41-geometry, 512 tokens: ~0.08 s of kernels in ~0.4-0.7 s
of wall, issue #21's TTFT target is 50 ms): its wall time follows the number of kernels it launches. Variants, each
a switch of `dsv41.kernels.choice` (the same function computed; the logits are compared with the first variant's):

  unfused      every block computes its own attention mixes (`set_fused_mhc(False)`: what CED prefill did before
               2026-12-07h: ~100 small torch kernels of Sinkhorn per block), the MoE module loop above 64 tokens
  fused        one fused mHC step between consecutive blocks (the default)
  fused+moe    and the experts op (`moe_experts`: grouped Triton kernels, device routing) for up to MOE_MAX tokens
               instead of the module loop (~10 launches per active expert)

For each length (LENGTHS, default 128,512,2048) and variant: median wall of REPEATS prefills (ced-bounded, into a
fresh packed-store sequence, after a warm-up one), then one more under the profiler: kernels launched, GPU busy time.
Then, per variant, the engine's time to first token (`Engine.add_request` to the step that emits it: the body's
prefill, then the last prompt token in the decode forward, graph-replayed on a GPU) for ENGINE_PROMPTS fresh prompts
of ENGINE_TOKENS tokens one after another, with the steps' times and the CUDA graphs captured meanwhile.

    python benchmarks/prefill_launches.py                       # GPU: v41-geometry, random bf16 weights
    DEVICE=cpu CONFIG=tiny LENGTHS=64 python benchmarks/prefill_launches.py   # a check of the script (op counts)

Env: DEVICE (cuda), CONFIG (v41-geometry), LENGTHS, REPEATS (5), MOE_MAX (4096), PACK (1: packed weights),
ENGINE_TOKENS (512; 0: no engine phase), ENGINE_PROMPTS (6), RESULT (default benchmarks/results/prefill_launches.json).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import load_config  # noqa: E402
from dsv41.engine.prefill import prefill  # noqa: E402
from dsv41.engine.store import make_pool  # noqa: E402
from dsv41.kernels.choice import FUSED_MOE_MAX_TOKENS, set_fused_mhc, set_fused_moe_max_tokens  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def one_prefill(model, pool, ids, dev: str) -> tuple[float, torch.Tensor]:
    sid = pool.new_sequence()
    view = pool.bind([sid])
    sync(dev)
    t = time.perf_counter()
    out = prefill(model, ids, view, "ced-bounded")
    sync(dev)
    dt = time.perf_counter() - t
    pool.release(view, [sid])
    pool.free(sid)
    return dt, out.logits.float()


def launches(model, pool, ids, dev: str) -> dict:
    """Kernels launched and their summed GPU time (on a CPU: the aten ops run, and their summed self time)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = dev.startswith("cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        one_prefill(model, pool, ids, dev)
    if cuda:
        ev = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        return {"kernels": sum(e.count for e in ev), "gpu_busy_s": sum(e.self_device_time_total for e in ev) / 1e6}
    ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    return {"aten_ops": sum(e.count for e in ev), "aten_self_s": sum(e.self_cpu_time_total for e in ev) / 1e6}


def engine_ttft(model, cfg, dev: str, n: int, count: int) -> list[dict]:
    """Time to first token of `count` fresh n-token prompts through one engine, one request at a time."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams
    eng = Engine(model, None, max_batch=4, max_seq_len=max(4096, 2 * n))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        caps = eng.graphs.captures if eng.graphs is not None else 0
        sync(dev)
        t = time.perf_counter()
        rid = eng.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        steps = []
        while True:
            ts = time.perf_counter()
            outs = eng.step()
            steps.append(time.perf_counter() - ts)
            if any(o.request_id == rid and o.new_token_ids for o in outs):
                break
        ttft = time.perf_counter() - t
        while eng.has_unfinished():
            eng.step()
        out.append({"ttft_s": ttft, "steps_s": steps,
                    "graph_captures": (eng.graphs.captures if eng.graphs is not None else 0) - caps})
    return out


VARIANTS = {"unfused": (False, FUSED_MOE_MAX_TOKENS), "fused": (True, FUSED_MOE_MAX_TOKENS), "fused+moe": (True, None)}


def main() -> int:
    dev = os.environ.get("DEVICE", "cuda")
    name = os.environ.get("CONFIG", "v41-geometry")
    lengths = [int(x) for x in os.environ.get("LENGTHS", "128,512,2048").split(",")]
    repeats, moe_max = int(os.environ.get("REPEATS", "5")), int(os.environ.get("MOE_MAX", "4096"))
    cfg = load_config(name)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = random_model(cfg, dtype=dtype, seed=0, device=dev).eval()
    if os.environ.get("PACK", "1") == "1":
        from dsv41.model.packed_weights import pack_weights
        pack_weights(model)
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"{name} on {dev} ({torch.cuda.get_device_name() if dev.startswith('cuda') else platform.processor()}), "
          f"built in {time.perf_counter() - t0:.0f}s", flush=True)
    pool = make_pool(model, dev)
    rows = []
    try:
        for n in lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
            ref = None
            for v, (mhc, mmax) in VARIANTS.items():
                set_fused_mhc(mhc)
                set_fused_moe_max_tokens(moe_max if mmax is None else mmax)
                with torch.no_grad():
                    one_prefill(model, pool, ids, dev)                               # warm-up (compilation)
                    times, logits = [], None
                    for _ in range(repeats):
                        dt, logits = one_prefill(model, pool, ids, dev)
                        times.append(dt)
                ref = logits if ref is None else ref
                err = float((logits - ref).norm() / ref.norm().clamp_min(1e-30))
                row = {"tokens": n, "variant": v, "wall_s": statistics.median(times), "walls_s": times,
                       "logits_rel_err_vs_first": err, **launches(model, pool, ids, dev)}
                rows.append(row)
                base = next(r for r in rows if r["tokens"] == n)
                count = row.get("kernels", row.get("aten_ops"))
                print(f"{n:>7} {v:10s} wall {row['wall_s'] * 1e3:8.1f} ms (x{row['wall_s'] / base['wall_s']:.2f}) "
                      f"launches {count:>6} (x{count / base.get('kernels', base.get('aten_ops')):.2f})"
                      + (f" GPU busy {row['gpu_busy_s'] * 1e3:7.1f} ms" if "gpu_busy_s" in row else "")
                      + f"  logits rel err {err:.1e}", flush=True)
        n_eng = int(os.environ.get("ENGINE_TOKENS", "512"))
        for v, (mhc, mmax) in VARIANTS.items() if n_eng else ():
            set_fused_mhc(mhc)
            set_fused_moe_max_tokens(moe_max if mmax is None else mmax)
            reqs = engine_ttft(model, cfg, dev, n_eng, int(os.environ.get("ENGINE_PROMPTS", "6")))
            rows.append({"engine_tokens": n_eng, "variant": v, "requests": reqs,
                         "ttft_median_s": statistics.median(r["ttft_s"] for r in reqs)})
            print(f"engine TTFT {n_eng} tokens, {v:10s}: " + " ".join(
                f"{r['ttft_s'] * 1e3:.0f}" + (f"(+{r['graph_captures']} graphs)" if r["graph_captures"] else "")
                for r in reqs) + f" ms; median {rows[-1]['ttft_median_s'] * 1e3:.0f} ms; steps of the last: "
                + " ".join(f"{x * 1e3:.0f}" for x in reqs[-1]["steps_s"]) + " ms", flush=True)
    finally:
        set_fused_mhc(True)
        set_fused_moe_max_tokens(FUSED_MOE_MAX_TOKENS)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"config": name, "device": dev, "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None,
           "torch": torch.__version__, "commit": commit, "moe_max": moe_max, "repeats": repeats, "rows": rows}
    out = Path(os.environ.get("RESULT") or Path(__file__).parent / "results" / "prefill_launches.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
