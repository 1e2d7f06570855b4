"""The deterministic mode's figures (docs/system.md §10), side by side in one run:

1. Is the official GEMM order batch-invariant? A row's bits of `block_scaled_linear_ref` (the fidelity order),
   of F.linear and of the mode's `exact_block_linear` / `tiled_linear`, computed alone and inside batches of
   2..512 rows: the count of (batch size, row) pairs whose bits differ.
2. What does it change for the engine? The same requests (prompts of several windows, quantization on, greedy
   with log-probs) run alone, as one batch, with chunked prefill and with speculative decoding, with the mode off
   (the `recent` tie rule only) and on: tokens and log-probs that differ from the alone run.
3. What does it cost? Prefill and decode tokens/s of the same batch with the mode off and on.

    python benchmarks/deterministic.py                                  # CPU, tiny preset, random weights
    python benchmarks/deterministic.py --device cuda --dtype bfloat16   # the same on a GPU
    python benchmarks/deterministic.py --checkpoint runs/train-tiny

Prints tables and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import DTYPES, load_config, parse_dtype  # noqa: E402
from dsv41.engine.engine import Engine  # noqa: E402
from dsv41.engine.sampling import SamplingParams  # noqa: E402
from dsv41.kernels import block_scaled_linear_ref, set_deterministic  # noqa: E402
from dsv41.kernels.invariant import exact_block_linear, tiled_linear  # noqa: E402
from dsv41.codecs import qdq_fp8  # noqa: E402
from dsv41.model.attention import set_tie_break  # noqa: E402


def gemm_invariance(device, dtype, K=1024, N=512, rows=8) -> dict:
    """(batch size, row) pairs whose result differs from the row computed alone, per GEMM form."""
    g = torch.Generator().manual_seed(0)
    x = qdq_fp8(torch.randn(512, K, generator=g)).to(device, dtype)
    w = qdq_fp8(torch.randn(N, K, generator=g)).to(device, dtype)
    forms = {"official block order": block_scaled_linear_ref, "F.linear": lambda a, b: F.linear(a, b),
             "exact_block_linear": exact_block_linear, "tiled_linear": tiled_linear}
    out = {}
    for name, fn in forms.items():
        alone = torch.cat([fn(x[i:i + 1], w) for i in range(rows)])
        bad = sum(int((fn(x[:M], w)[:rows] != alone[:min(M, rows)]).any(-1).sum())
                  for M in (2, 3, 5, 8, 16, 33, 64, 128, 512))
        out[name] = bad
    return out


def outputs(cs):
    return [(c.output_ids, [lp["logprob"] for lp in c.logprobs]) for c in cs]


def diff(a, b) -> tuple[int, int]:
    """(tokens, log-probs) that differ between two runs of the same requests."""
    t = sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra[0], rb[0]))
    lp = sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra[1], rb[1]))
    return t, lp


def engine_runs(model, prompts, params, det: bool, device) -> dict:
    set_deterministic(False)
    set_tie_break(model, "recent")

    def run(batch, **kw):
        eng = Engine(model, max_seq_len=2048, max_batch=len(batch), device=device, deterministic=det, **kw)
        return outputs(eng.generate(batch, params))
    alone = [run([p], prefill_mode="full")[0] for p in prompts]
    res = {"batch": diff(alone, run(prompts, prefill_mode="full")),
           "chunked (17)": diff(alone, run(prompts, prefill_mode="full", chunk_size=17)),
           "fixed:3": diff(alone, run(prompts, prefill_mode="full", speculative="fixed:3"))}
    res["n_tokens"] = sum(len(a[0]) for a in alone)
    return res


def throughput(model, prompts, det: bool, device, max_tokens: int) -> dict:
    set_deterministic(False)
    eng = Engine(model, max_seq_len=2048, max_batch=len(prompts), device=device, prefill_mode="full",
                 deterministic=det)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    t0 = time.perf_counter()
    eng.step()                                             # admits (prefills) every request
    t1 = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    t2 = time.perf_counter()
    n_prompt = sum(map(len, prompts))
    return {"prefill_tok_s": n_prompt / (t1 - t0), "decode_tok_s": steps * len(prompts) / (t2 - t1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = parse_dtype(args.dtype)
    if args.checkpoint:
        from dsv41.model.loading import load_model
        model, cfg = load_model(args.checkpoint, dtype=dtype)
    else:
        from dsv41.model.init import random_model
        cfg = load_config(args.config)
        model = random_model(cfg, seed=0, dtype=dtype)
    model.to(args.device)
    W, V = cfg.window_size, cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (int(W * (1.5 + i % 4)),), generator=g).tolist() for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)

    res = {"device": args.device, "dtype": args.dtype, "config": args.checkpoint or args.config,
           "torch": torch.__version__, "batch": args.batch, "prompt_lens": [len(p) for p in prompts]}
    res["gemm_rows_differing"] = gemm_invariance(args.device, dtype)
    print("GEMM forms: (batch size, row) pairs whose bits differ from the row alone (9 batch sizes x 8 rows)")
    for k, v in res["gemm_rows_differing"].items():
        print(f"  {k:<22} {v}")
    for det in (False, True):
        key = "deterministic" if det else "default (recent ties)"
        res[key] = {"vs_alone": engine_runs(model, prompts, params, det, args.device),
                    **throughput(model, prompts, det, args.device, args.max_tokens)}
        set_deterministic(False)
    print(f"\nengine, quantization on, {args.batch} prompts of {min(res['prompt_lens'])}-{max(res['prompt_lens'])} "
          f"tokens (window {W}), greedy: tokens / log-probs differing from each request run alone")
    print(f"  {'mode':<22} {'batch':>12} {'chunked':>12} {'fixed:3':>12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for key in ("default (recent ties)", "deterministic"):
        r = res[key]
        cells = [f"{r['vs_alone'][k][0]}/{r['vs_alone'][k][1]}" for k in ("batch", "chunked (17)", "fixed:3")]
        print(f"  {key:<22} {cells[0]:>12} {cells[1]:>12} {cells[2]:>12} {r['prefill_tok_s']:>14.1f} "
              f"{r['decode_tok_s']:>13.1f}")
    d, o = res["deterministic"], res["default (recent ties)"]
    res["cost"] = {"prefill": o["prefill_tok_s"] / d["prefill_tok_s"], "decode": o["decode_tok_s"] / d["decode_tok_s"]}
    print(f"  cost of the mode: prefill x{res['cost']['prefill']:.2f} slower, decode x{res['cost']['decode']:.2f} "
          f"slower (of {res['deterministic']['vs_alone']['n_tokens']} tokens)")
    line = json.dumps(res)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
