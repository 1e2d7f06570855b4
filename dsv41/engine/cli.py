"""`dsv41 generate`, `dsv41 profile-step` and `dsv41 bench prefill|decode|kv`."""

from __future__ import annotations

import json
import sys

from dsv41.config import DTYPES, parse_dtype
from dsv41.engine.options import add_engine_args, engine_from_args


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion with the engine")
    add_engine_args(g)
    g.set_defaults(max_batch=1, func=generate_main)            # one prompt
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--json", action="store_true")

    p = sub.add_parser("profile-step", help="measure the speculative step latency T(n) for the dspark scheduler")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="default: CHECKPOINT/step_profile.json (read by generate/serve)")
    p.set_defaults(func=profile_step_main)

    b = sub.add_parser("bench", help="benchmarks: prefill modes, decode, KV store")
    bsub = b.add_subparsers(dest="bench", required=True)
    from dsv41.engine import bench
    bench.register(bsub)
    try:
        from dsv41.kv.cli import register_bench
    except ModuleNotFoundError:
        return
    register_bench(bsub)


def generate_main(args) -> int:
    from dsv41.engine.sampling import SamplingParams

    eng = engine_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.json:
        c = eng.generate([args.prompt], params)[0]
        print(json.dumps({"text": c.text, "finish_reason": c.finish_reason, **c.stats}, indent=2))
        return 0
    print(args.prompt, end="", flush=True)
    rid = None
    for out in eng.stream(args.prompt, params):
        rid = out.request_id
        print(out.new_text, end="", flush=True)
    print()
    if rid is not None and eng.drafter is not None:
        sp = eng.completion(rid).stats["speculative"]
        print(f"[speculative {sp['mode']}: {sp['accepted_tokens']} of {sp['drafted_tokens']} drafted tokens "
              f"accepted, {sp['target_forwards']} target decode forwards]", file=sys.stderr)
    return 0


def profile_step_main(args) -> int:
    from pathlib import Path

    from dsv41.engine.speculative.profile import PROFILE_FILE, profile_step
    from dsv41.model.loading import load_model

    model, _ = load_model(args.checkpoint, dtype=parse_dtype(args.dtype))
    model.to(args.device)
    prof = profile_step(model, batches=args.batches, context=args.context, repeats=args.repeats, device=args.device)
    out = Path(args.out) if args.out else Path(args.checkpoint) / PROFILE_FILE
    prof.meta["checkpoint"] = str(args.checkpoint)
    prof.save(out)
    print(f"step profile ({len(prof.n)} token counts, {prof.t[0] * 1e3:.1f} ms at {prof.n[0]} -> "
          f"{prof.t[-1] * 1e3:.1f} ms at {prof.n[-1]} tokens) written to {out}")
    return 0
