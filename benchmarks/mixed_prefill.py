"""Prompts of different lengths prefilled as one batch (`dsv41.engine.body_batch`) vs one forward per length, side
by side in one run.

N requests of random prompt lengths (uniform in input_len x [1 - r, 1 + r]) are added to one engine at once and run
to the end (greedy, `--output-len` tokens each); per mode (`mixed`: the engine's default; `by-length`:
`Engine(mixed_prefill=False)`, only prompts of one length batch): wall time to the last first token and to the end,
the requests' time to first token (median, p99), the model forwards that embed tokens (prefill pieces and decode
steps), and whether the greedy outputs are the same in both modes (in the deterministic mode they must be: the
engine's batch invariance; otherwise the GEMMs' order differs with the batch and a greedy path may part).

    python benchmarks/mixed_prefill.py                                   # CPU: the tiny preset, random weights
    python benchmarks/mixed_prefill.py --config v41-geometry --device cuda --num-prompts 32 --input-len 512
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.config import load_config  # noqa: E402
from dsv41.engine.engine import Engine  # noqa: E402
from dsv41.engine.sampling import SamplingParams  # noqa: E402
from dsv41.model.init import random_model  # noqa: E402


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, prompts, args, mixed: bool) -> dict:
    eng = Engine(model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, deterministic=args.deterministic,
                 max_step_tokens=args.max_step_tokens, mixed_prefill=mixed)
    calls, embed = [], model.embed_tokens
    model.embed_tokens = lambda ids, *a, **k: calls.append(tuple(ids.shape)) or embed(ids, *a, **k)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        sync(args.device)
        t0 = time.perf_counter()
        rids = [eng.add_request(p, params) for p in prompts]
        first_all, steps = None, 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            if first_all is None and all(r in eng.finished or any(s.request_id == r and s.output_ids
                                                                  for s in eng.running) for r in rids):
                sync(args.device)
                first_all = time.perf_counter() - t0
        sync(args.device)
        total = time.perf_counter() - t0
    finally:
        del model.embed_tokens
    comps = [eng.completion(r) for r in rids]
    ttft = sorted(c.stats["ttft_s"] for c in comps)
    prefill_calls = [c for c in calls if c[1] > 1]
    return {"mixed": mixed, "total_s": total, "all_first_tokens_s": first_all, "steps": steps,
            "ttft_median_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "forwards": len(calls), "prefill_forwards": len(prefill_calls),
            "outputs": [c.output_ids for c in comps]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=None, help="default: --num-prompts")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-step-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both modes, interleaved (the first warms up)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.max_batch = args.max_batch or args.num_prompts
    cfg = load_config(args.config)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(cfg, dtype=dtype, seed=0, device=args.device).eval()
    if args.device.startswith("cuda"):
        from dsv41.model.packed_weights import pack_weights
        pack_weights(model)
        torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(0)
    lo, hi = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
    prompts = [torch.randint(0, cfg.vocab_size, (int(torch.randint(max(2, lo), hi + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.num_prompts)]
    rows = []
    for r in range(args.rounds):
        for mixed in ((False, True) if r % 2 else (True, False)):
            row = run(model, prompts, args, mixed)
            row["round"] = r
            rows.append(row)
            print(f"round {r} {'mixed    ' if mixed else 'by-length'}: total {row['total_s']:7.2f} s, all first tokens "
                  f"{row['all_first_tokens_s']:7.2f} s, TTFT median {row['ttft_median_s']:6.2f} / p99 "
                  f"{row['ttft_p99_s']:6.2f} s, forwards {row['forwards']} (prefill {row['prefill_forwards']}), "
                  f"steps {row['steps']}", flush=True)
    last = {m: [x for x in rows if x["mixed"] == m and x["round"] > 0] or [x for x in rows if x["mixed"] == m]
            for m in (True, False)}
    med = {m: {k: statistics.median(x[k] for x in last[m]) for k in ("total_s", "all_first_tokens_s",
                                                                      "ttft_median_s")} for m in last}
    same = all(a["outputs"] == b["outputs"] for a in rows for b in rows)
    summary = {k: med[False][k] / med[True][k] for k in med[True]}
    print(f"by-length / mixed (medians of the rounds after the first): total x{summary['total_s']:.2f}, all first "
          f"tokens x{summary['all_first_tokens_s']:.2f}, TTFT median x{summary['ttft_median_s']:.2f}; "
          f"prefill forwards {last[False][0]['prefill_forwards']} vs {last[True][0]['prefill_forwards']}; "
          f"greedy outputs the same in every run: {same}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"command": " ".join(sys.argv), "commit": commit, "torch": torch.__version__,
           "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
           "args": vars(args), "prompt_lengths": [len(p) for p in prompts], "speedup_by_length_over_mixed": summary,
           "same_outputs": same, "rows": [{k: v for k, v in x.items() if k != "outputs"} for x in rows]}
    out = Path(args.out or Path(__file__).parent / "results" / f"mixed_prefill-{args.device.split(':')[0]}-"
                                                              f"{args.config}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
