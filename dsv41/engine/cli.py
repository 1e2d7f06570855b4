"""`dsv41 generate` and `dsv41 bench prefill|decode|kv`."""

from __future__ import annotations

import json

import torch

from dsv41.engine.prefill import MODES


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion with the engine")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--prefill-mode", choices=MODES, default="ced-bounded")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--max-seq-len", type=int, default=16384)
    g.add_argument("--chunk-size", type=int, default=None)
    g.add_argument("--cache-dir", default=None, help="persistent prefix-cache tier (global KV on disk)")
    g.add_argument("--swa-pool", default=None, help="SWA snapshot pool: memory | redis://HOST:PORT[,...]")
    g.add_argument("--json", action="store_true")
    from dsv41.server.cli import add_speculative_args
    add_speculative_args(g)
    g.set_defaults(func=generate_main)

    p = sub.add_parser("profile-step", help="measure the speculative step latency T(n) for the dspark scheduler")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
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
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams
    from dsv41.engine.tokenizer import load_tokenizer
    from dsv41.model.loading import load_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, cfg = load_model(args.checkpoint, dtype=dtype)
    tok = load_tokenizer(args.checkpoint, cfg.vocab_size)
    from dsv41.server.cli import speculative_kwargs
    eng = Engine(model, tok, prefill_mode=args.prefill_mode, max_seq_len=args.max_seq_len, chunk_size=args.chunk_size,
                 cache_dir=args.cache_dir, swa_pool=args.swa_pool, max_batch=1, **speculative_kwargs(args, model))
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
        import sys
        sp = eng.completion(rid).stats["speculative"]
        print(f"[speculative {sp['mode']}: {sp['accepted_tokens']} of {sp['drafted_tokens']} drafted tokens "
              f"accepted, {sp['target_forwards']} target decode forwards]", file=sys.stderr)
    return 0


def profile_step_main(args) -> int:
    from pathlib import Path

    from dsv41.engine.speculative import PROFILE_FILE, profile_step
    from dsv41.model.loading import load_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, cfg = load_model(args.checkpoint, dtype=dtype)
    model.to(args.device)
    prof = profile_step(model, batches=args.batches, context=args.context, repeats=args.repeats, device=args.device)
    out = Path(args.out) if args.out else Path(args.checkpoint) / PROFILE_FILE
    prof.meta["checkpoint"] = str(args.checkpoint)
    prof.save(out)
    print(f"step profile ({len(prof.n)} token counts, {prof.t[0] * 1e3:.1f} ms at {prof.n[0]} -> "
          f"{prof.t[-1] * 1e3:.1f} ms at {prof.n[-1]} tokens) written to {out}")
    return 0
