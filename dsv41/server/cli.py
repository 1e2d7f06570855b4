"""`dsv41 serve` (the OpenAI-compatible server) and `dsv41 demo` (the main job). The engine's flags are the
engine's (`dsv41.engine.cli`); these add the server's own, and serve's device and weights (`dsv41.server.device`:
--device, --random-weights --config, --kernels)."""

from __future__ import annotations

from dsv41.engine.cli import add_engine_args
from dsv41.server import demo
from dsv41.server.device import add_device_args


def add_server_args(p) -> None:
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: checkpoint dir name)")
    p.add_argument("--chat-template", choices=["auto", "official", "simple"], default="auto")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* and the tokenizer "
                   "endpoints (default: the DSV41_API_KEY environment variable; unset: open)")


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve a checkpoint over the OpenAI API (chat, completions, metrics)")
    s.add_argument("--checkpoint", default=None, help="checkpoint directory (ours or the official layout); or "
                   "--random-weights --config PRESET")
    add_engine_args(s, checkpoint_required=False)
    add_device_args(s)
    add_server_args(s)
    s.set_defaults(cache_dir="auto", swa_pool="auto")         # prefix caching on (`dsv41.kv.cache_cli`)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=serve_main)

    d = sub.add_parser("demo", help="the main job: train (or reuse) the tiny model, serve it, chat with it, report KV")
    d.add_argument("--checkpoint", default=demo.DEMO_CHECKPOINT)
    d.add_argument("--train-minutes", type=float, default=5.0)
    d.add_argument("--max-tokens", type=int, default=40)
    d.add_argument("--no-train", action="store_true", help="never train: use a random tiny model if none exists")
    d.add_argument("--posttrained", default=demo.POSTTRAINED,
                   help="a post-trained checkpoint to serve and ask task problems at effort 1 and 100 (default "
                   f"{demo.POSTTRAINED}; when missing, the demo prints the command that makes one)")
    add_engine_args(d, checkpoint_required=False)
    add_server_args(d)
    d.set_defaults(func=demo.run_demo)


def serve_main(args) -> int:
    import uvicorn

    from dsv41.parallel.lockstep import release_ranks
    from dsv41.server.app import create_app
    from dsv41.server.state import ServerSettings

    engine = build_engine(args)             # under torchrun: rank 0's lockstep engine; other ranks follow, then None
    if engine is None:
        return 0
    settings = ServerSettings.from_args(args)
    app = create_app(engine, settings)
    print(f"dsv41 serve: model `{settings.model_name}` ({engine.cfg.n_layers} layers, vocab {engine.cfg.vocab_size},"
          f" prefill {engine.prefill_mode}, max batch {engine.max_batch}, context {engine.max_seq_len}, chat template"
          f" {app.state.dsv41.template.name}, speculative {engine.speculation}, {engine.device} {args.dtype}) on"
          f" http://{args.host}:{args.port}/v1",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        release_ranks(engine)
    return 0


def build_engine(args):
    """The engine for serve's flags: in one process the model on --device (`dsv41.server.device.serving_model`);
    under torchrun each rank's shard on its own GPU (`serving_engine`), where --device and --random-weights do not
    apply."""
    from dsv41.engine.cli import engine_from_args
    from dsv41.parallel.lockstep import launched, serving_engine
    from dsv41.server.device import check_weight_flags, resolve_dtype, serving_model

    if not launched():
        return engine_from_args(args, model=serving_model(args))
    if args.random_weights or args.device != "cpu":
        raise ValueError(f"under torchrun every rank loads its shard of --checkpoint on its own GPU: --device "
                         f"{args.device} / --random-weights do not apply")
    check_weight_flags(args)
    resolve_dtype(args)
    return serving_engine(args)
