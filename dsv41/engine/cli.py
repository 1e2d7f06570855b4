"""The engine's command line: its flags and the factory that builds an `Engine` from a checkpoint and those flags,
and the commands `dsv41 generate`, `dsv41 profile-step` and `dsv41 bench prefill|decode|kv`.

`dsv41 generate`, `dsv41 serve` and `dsv41 demo` all take the engine flags (`add_engine_args`) and build their
engine with `engine_from_args`, so the three commands agree on every default. `--max-seq-len` (default
`DEFAULT_MAX_SEQ_LEN` = 4096, the engine's own default) is a limit on prompt + completion tokens per request:
the stores allocate pages as sequences grow, nothing is preallocated for it.
"""

from __future__ import annotations

import argparse
import json
import sys

from dsv41.config import DTYPES, parse_dtype
from dsv41.engine.engine import DEFAULT_MAX_SEQ_LEN, Engine
from dsv41.engine.prefill import MODES


def add_engine_args(p: argparse.ArgumentParser, checkpoint_required: bool = True) -> None:
    if checkpoint_required:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory (ours or the official layout)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--storage", choices=["dense", "packed"], default="dense",
                   help="quantized weights held dequantized (dense) or as the checkpoint stores them (packed: FP8 "
                        "codes + e8m0 tile scales, FP4 experts, e4m3 Engram tables; loading needs about the model's "
                        "own bytes; the GPU dequantizes per call until its kernels read the bytes). Same outputs on "
                        "an official-layout checkpoint; a dsv41 training checkpoint holds master weights, which "
                        "packed rounds to the checkpoint formats as the official writer does")
    p.add_argument("--engram-tables", choices=["auto", "host", "device"], default="auto",
                   help="packed storage: Engram tables in host memory, each step's rows prefetched to the GPU "
                        "(host), or on the device (device); auto: host on a GPU when they exceed 1 GiB")
    p.add_argument("--prefill-mode", choices=MODES, default="ced-bounded")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (continuous batching)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN,
                   help=f"context length: prompt + completion tokens (default {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one shot)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="tokens one engine step feeds: decode rows first, then chunks of waiting prompts (default "
                        "max(2048, --max-batch))")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="global-KV pages all sequences may hold together (default: unbounded); requests wait while "
                        "theirs do not fit, the youngest is preempted and recomputed when the pool runs out")
    p.add_argument("--kv-page-size", type=int, default=64, help="entries per KV page")
    p.add_argument("--cache-dir", default=None, help="prefix cache: persistent global-KV tier on disk: DIR, auto "
                   "(serve's default: ~/.cache/dsv41/prefix/<weights fingerprint>, `dsv41 cache clear` empties it) "
                   "or none (generate's default)")
    p.add_argument("--swa-pool", default=None, help="prefix cache: SWA snapshot pool: memory, redis://HOST:PORT, "
                   "auto (serve's default: memory) or none (generate's default)")
    p.add_argument("--speculative", default="auto",
                   help="speculative decoding with the DSpark drafter: off | fixed:N (verify N drafts per step) | "
                        "dspark (the confidence scheduler) | dspark:online (its acceptance estimates and T(n) "
                        "corrected by the engine's measurements) | auto (dspark:online when the checkpoint has a "
                        "trained drafter, else off); outputs keep the target distribution exactly")
    p.add_argument("--step-profile", default=None,
                   help="T(n) profile for the dspark scheduler (default: CHECKPOINT/step_profile.json)")
    p.add_argument("--tie-break", choices=["official", "official-cpu", "recent"], default="official",
                   help="indexer top-k tie rule: official (torch.topk on the model's device: parity with the official "
                        "code on a CPU), official-cpu (the CPU's tie order and row-statistics order on any device: "
                        "parity runs, slow) or recent "
                        "(deterministic: greedy outputs then do not depend on which requests share a batch)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics (implies --tie-break recent): a request's tokens and log-probs do "
                        "not depend on its batch, chunking, speculation or a cache resume, and equal the training "
                        "forward's bit for bit (docs/system.md §10); slower")
    p.add_argument("--no-cuda-graphs", "--eager", dest="cuda_graphs", action="store_false", default=None,
                   help="decode steps run eagerly on a GPU (default: replayed from CUDA graphs where the model "
                        "supports them, dsv41.engine.graphs)")


def engine_args(**overrides) -> argparse.Namespace:
    """The engine flags' defaults with `overrides` set on top: for callers that build an engine without a command
    line (tests, benchmarks)."""
    p = argparse.ArgumentParser()
    add_engine_args(p, checkpoint_required=False)
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise ValueError(f"engine_args: unknown flag {k!r}")
        setattr(args, k, v)
    return args


def engine_from_args(args: argparse.Namespace, model=None, tokenizer=None) -> Engine:
    """The engine for these flags: the checkpoint's model (unless `model` is given) and tokenizer, prefix caching
    with --cache-dir / --swa-pool (none, auto or as given: `dsv41.kv.cache_cli.resolve_prefix_flags`), speculative
    decoding as `resolve_speculation` reads --speculative."""
    from dsv41.engine.speculative.policy import resolve_speculation
    from dsv41.engine.engine import weights_fingerprint
    from dsv41.engine.tokenizer import load_tokenizer
    from dsv41.kv.cache_cli import resolve_prefix_flags
    from dsv41.model.attention import set_tie_break, use_official_cpu
    from dsv41.model.common import QuantSite
    from dsv41.model.loading import load_model

    if model is None:
        model, _ = load_model(args.checkpoint, dtype=parse_dtype(args.dtype or "float32"), storage=args.storage,
                              engram_tables=args.engram_tables)
    if args.tie_break == "official-cpu":
        use_official_cpu(model)
    elif args.tie_break != "official":
        set_tie_break(model, args.tie_break)
    tokenizer = tokenizer or load_tokenizer(args.checkpoint, model.cfg.vocab_size)
    spec, profile = resolve_speculation(model, args.checkpoint, args.speculative, args.step_profile, args.max_batch,
                                         device=next(model.parameters()).device)
    packed = all(m.quant for m in model.modules() if isinstance(m, QuantSite))      # the engine's packed store
    cache_dir, swa_pool = resolve_prefix_flags(args.cache_dir, args.swa_pool, packed,
                                               lambda: weights_fingerprint(model))
    return Engine(model, tokenizer, prefill_mode=args.prefill_mode, max_batch=args.max_batch,
                  max_seq_len=args.max_seq_len, chunk_size=args.chunk_size, cache_dir=cache_dir,
                  swa_pool=swa_pool, speculative=spec, step_profile=profile, deterministic=args.deterministic,
                  max_step_tokens=args.max_step_tokens, kv_pages=args.kv_pages, kv_page_size=args.kv_page_size,
                  cuda_graphs=args.cuda_graphs)


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion with the engine")
    add_engine_args(g)
    g.set_defaults(max_batch=1, func=generate_main)            # one prompt
    g.add_argument("--prompt", required=True)
    for flag, kind, default in (("--max-tokens", int, 64), ("--temperature", float, 0.0), ("--top-p", float, 1.0),
                                ("--top-k", int, 0), ("--seed", int, None)):
        g.add_argument(flag, type=kind, default=default)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--json", action="store_true")

    p = sub.add_parser("profile-step", help="measure the speculative step latency T(n) for the dspark scheduler")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="default: CHECKPOINT/step_profile.json (read by generate/serve)")
    p.set_defaults(func=profile_step_main)

    b = sub.add_parser("bench", help="benchmarks: prefill modes, decode, KV store")
    bsub = b.add_subparsers(dest="bench", required=True)
    from dsv41.engine import bench
    from dsv41.kv.cli import register_bench
    bench.register(bsub)
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

    from dsv41.engine.tokenizer import load_tokenizer

    model, cfg = load_model(args.checkpoint, dtype=parse_dtype(args.dtype))
    model.to(args.device)
    prof = profile_step(model, batches=args.batches, context=args.context, repeats=args.repeats, device=args.device,
                        tokenizer=load_tokenizer(args.checkpoint, cfg.vocab_size))
    out = Path(args.out) if args.out else Path(args.checkpoint) / PROFILE_FILE
    prof.meta["checkpoint"] = str(args.checkpoint)
    prof.save(out)
    print(f"step profile ({len(prof.n)} token counts, {prof.t[0] * 1e3:.1f} ms at {prof.n[0]} -> "
          f"{prof.t[-1] * 1e3:.1f} ms at {prof.n[-1]} tokens) written to {out}")
    return 0
