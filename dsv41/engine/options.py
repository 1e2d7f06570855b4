"""The engine's command-line flags and the factory that builds an `Engine` from a checkpoint and those flags.

`dsv41 generate`, `dsv41 serve` and `dsv41 demo` all take these flags (`add_engine_args`) and build their engine
with `engine_from_args`, so the three commands agree on every default. `--max-seq-len` (default
`DEFAULT_MAX_SEQ_LEN` = 4096, the engine's own default) is a limit on prompt + completion tokens per request:
the stores allocate pages as sequences grow, nothing is preallocated for it.
"""

from __future__ import annotations

import argparse

from dsv41.config import DTYPES, parse_dtype
from dsv41.engine.engine import DEFAULT_MAX_SEQ_LEN, Engine
from dsv41.engine.prefill import MODES


def add_engine_args(p: argparse.ArgumentParser, checkpoint_required: bool = True) -> None:
    if checkpoint_required:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory (ours or the official layout)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--prefill-mode", choices=MODES, default="ced-bounded")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (continuous batching)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN,
                   help=f"context length: prompt + completion tokens (default {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one shot)")
    p.add_argument("--cache-dir", default=None, help="prefix cache: persistent global-KV tier on disk")
    p.add_argument("--swa-pool", default=None, help="prefix cache: SWA snapshot pool, memory or redis://HOST:PORT")
    p.add_argument("--speculative", default="auto",
                   help="speculative decoding with the DSpark drafter: off | fixed:N (verify N drafts per step) | "
                        "dspark (the confidence scheduler) | dspark:online (its acceptance estimates and T(n) "
                        "corrected by the engine's measurements) | auto (dspark when the checkpoint has a trained "
                        "drafter, else off); outputs keep the target distribution exactly")
    p.add_argument("--step-profile", default=None,
                   help="T(n) profile for the dspark scheduler (default: CHECKPOINT/step_profile.json)")
    p.add_argument("--tie-break", choices=["official", "recent"], default="official",
                   help="indexer top-k tie rule: official (torch.topk, parity with the official code) or recent "
                        "(deterministic: greedy outputs then do not depend on which requests share a batch)")


def engine_args(argv: list[str] | None = None, **overrides) -> argparse.Namespace:
    """The engine flags as parsed from `argv` (defaults for the rest), with `overrides` set on top: for callers
    that build an engine without a command line (tests, benchmarks)."""
    p = argparse.ArgumentParser()
    add_engine_args(p, checkpoint_required=False)
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args(argv or [])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise ValueError(f"engine_args: unknown flag {k!r}")
        setattr(args, k, v)
    return args


def engine_from_args(args: argparse.Namespace, model=None, tokenizer=None) -> Engine:
    """The engine for these flags: the checkpoint's model (unless `model` is given) and tokenizer, prefix caching
    with --cache-dir / --swa-pool, speculative decoding as `resolve_speculation` reads --speculative."""
    from dsv41.engine.speculative.policy import resolve_speculation
    from dsv41.engine.tokenizer import load_tokenizer
    from dsv41.model.attention import set_tie_break
    from dsv41.model.loading import load_model

    if model is None:
        model, _ = load_model(args.checkpoint, dtype=parse_dtype(args.dtype))
    if args.tie_break == "recent":
        set_tie_break(model, "recent")
    tokenizer = tokenizer or load_tokenizer(args.checkpoint, model.cfg.vocab_size)
    spec, profile = resolve_speculation(model, args.checkpoint, args.speculative, args.step_profile, args.max_batch)
    return Engine(model, tokenizer, prefill_mode=args.prefill_mode, max_batch=args.max_batch,
                  max_seq_len=args.max_seq_len, chunk_size=args.chunk_size, cache_dir=args.cache_dir,
                  swa_pool=args.swa_pool, speculative=spec, step_profile=profile)
