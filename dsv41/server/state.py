"""What every handler of one app shares: the settings (`ServerSettings`, from the command line or the caller) and
the live state (`ServerState`: the engine, its loop thread, metrics, chat template, requests in flight)."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv41.engine.tokenizer import Tokenizer
from dsv41.server.logprobs import TokenText
from dsv41.server.metrics import ServerMetrics
from dsv41.server.runner import EngineRunner


API_KEY_ENV = "DSV41_API_KEY"


@dataclass
class ServerSettings:
    model_name: str = "dsv41"
    aliases: tuple[str, ...] = ()
    chat_template: str = "auto"              # auto | official | simple
    default_max_tokens: int = 256            # when a request gives none (capped by the context left)
    max_body_bytes: int = 8 << 20
    max_in_flight: int = 1024                # engine requests queued or running; beyond: 429
    disconnect_poll_s: float = 0.5
    checkpoint: str | None = None
    api_key: str | None = None               # when set, /v1/* and the tokenizer endpoints need it as a bearer token

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        """The settings `dsv41 serve` / `dsv41 demo` flags give: the model is named after its checkpoint
        directory (random weights: `<config>-random`) unless --served-model-name says otherwise; the checkpoint path
        and "dsv41" are aliases."""
        ckpt = args.checkpoint
        random_name = f"{Path(args.config).stem}-random" if getattr(args, "random_weights", False) else "dsv41"
        name = args.served_model_name or (Path(ckpt).resolve().name if ckpt else random_name)
        aliases = tuple(a for a in {str(ckpt), "dsv41"} if ckpt and a != name)
        return cls(model_name=name, aliases=aliases, chat_template=args.chat_template,
                   default_max_tokens=args.default_max_tokens, checkpoint=str(ckpt) if ckpt else None,
                   api_key=getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None)


@dataclass
class ServerState:
    engine: Any
    tokenizer: Tokenizer
    runner: EngineRunner
    metrics: ServerMetrics
    settings: ServerSettings
    template: Any                            # the chat template (`dsv41.server.chat.pick_template`)
    token_text: TokenText
    grammars: Any = None                     # `dsv41.server.grammar.Grammars`: structured output, forced calls
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0                       # engine requests submitted and not yet released
