"""`dsv41 serve` (the OpenAI-compatible server) and `dsv41 demo` (the main job)."""

from __future__ import annotations

from pathlib import Path

PREFILL_MODES = ("full", "ced-exact", "ced-bounded")
DEMO_CHECKPOINT = "runs/demo-tiny"


def add_engine_args(p, checkpoint_required: bool = True) -> None:
    if checkpoint_required:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory (ours or the official layout)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default="ced-bounded")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (continuous batching)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length: prompt + completion tokens")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one shot)")
    p.add_argument("--cache-dir", default=None, help="prefix cache: persistent global-KV tier on disk")
    p.add_argument("--swa-pool", default=None, help="prefix cache: SWA snapshot pool, memory or redis://HOST:PORT")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: checkpoint dir name)")
    p.add_argument("--chat-template", choices=["auto", "official", "simple"], default="auto")
    p.add_argument("--default-max-tokens", type=int, default=256)
    add_speculative_args(p)
    p.add_argument("--tie-break", choices=["official", "recent"], default="official",
                   help="indexer top-k tie rule: official (torch.topk, parity with the official code) or recent "
                        "(deterministic: greedy outputs then do not depend on which requests share a batch)")


def add_speculative_args(p) -> None:
    p.add_argument("--speculative", default="auto",
                   help="speculative decoding with the DSpark drafter: off | fixed:N (verify N drafts per step) | "
                        "dspark (the confidence scheduler) | dspark:online (its acceptance estimates and T(n) "
                        "corrected by the engine's measurements) | auto (dspark when the checkpoint has a trained "
                        "drafter, else off); outputs keep the target distribution exactly")
    p.add_argument("--step-profile", default=None,
                   help="T(n) profile for the dspark scheduler (default: CHECKPOINT/step_profile.json)")


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve a checkpoint over the OpenAI API (chat, completions, metrics)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=serve_main)

    d = sub.add_parser("demo", help="the main job: train (or reuse) the tiny model, serve it, chat with it, report KV")
    d.add_argument("--checkpoint", default=DEMO_CHECKPOINT)
    d.add_argument("--train-minutes", type=float, default=5.0)
    d.add_argument("--max-tokens", type=int, default=40)
    d.add_argument("--no-train", action="store_true", help="never train: use a random tiny model if none exists")
    add_engine_args(d, checkpoint_required=False)
    d.set_defaults(func=demo_main)


def engine_kwargs(args) -> dict:
    return {"prefill_mode": args.prefill_mode, "max_batch": args.max_batch, "max_seq_len": args.max_seq_len,
            "chunk_size": args.chunk_size}


def build_engine(args, model=None, tokenizer=None):
    """The engine the server runs, from the CLI flags (prefix caching with --cache-dir / --swa-pool)."""
    import torch

    from dsv41.engine.engine import Engine
    from dsv41.engine.tokenizer import load_tokenizer
    from dsv41.model.loading import load_model

    if model is None:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model, cfg = load_model(args.checkpoint, dtype=dtype)
    if getattr(args, "tie_break", "official") == "recent":
        from dsv41.model.attention import set_tie_break
        set_tie_break(model, "recent")
    if tokenizer is None:
        tokenizer = load_tokenizer(getattr(args, "checkpoint", None), model.cfg.vocab_size)
    kwargs = engine_kwargs(args)
    kwargs.update({k: v for k, v in (("cache_dir", getattr(args, "cache_dir", None)),
                                     ("swa_pool", getattr(args, "swa_pool", None))) if v is not None})
    kwargs.update(speculative_kwargs(args, model))
    return Engine(model, tokenizer, **kwargs)


def speculative_kwargs(args, model) -> dict:
    from dsv41.engine.speculative import resolve_speculation

    spec, profile = resolve_speculation(model, getattr(args, "checkpoint", None),
                                        getattr(args, "speculative", "off") or "off",
                                        getattr(args, "step_profile", None), getattr(args, "max_batch", 8))
    return {"speculative": spec, "step_profile": profile}


def settings_from(args, engine):
    from dsv41.server.app import ServerSettings

    ckpt = getattr(args, "checkpoint", None)
    name = args.served_model_name or (Path(ckpt).resolve().name if ckpt else "dsv41")
    aliases = tuple(a for a in {str(ckpt), "dsv41"} if ckpt and a != name)
    return ServerSettings(model_name=name, aliases=aliases, chat_template=args.chat_template,
                          default_max_tokens=args.default_max_tokens, checkpoint=str(ckpt) if ckpt else None)


def serve_main(args) -> int:
    import uvicorn

    from dsv41.server.app import create_app

    engine = build_engine(args)
    settings = settings_from(args, engine)
    app = create_app(engine, settings)
    tpl = app.state.dsv41.template.name
    print(f"dsv41 serve: model `{settings.model_name}` ({engine.cfg.n_layers} layers, vocab {engine.cfg.vocab_size},"
          f" prefill {engine.prefill_mode}, max batch {engine.max_batch}, context {engine.max_seq_len}, chat template"
          f" {tpl}, speculative {engine.speculation}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def demo_main(args) -> int:
    from dsv41.server.demo import run_demo

    return run_demo(args)
