"""`dsv41 <command>`: one entry point; each command's parser and handler live beside the code they drive."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute): each module defines `register(subparsers)` adding its command(s).
COMMANDS = [
    "dsv41.analysis.cli",
    "dsv41.model.cli",
    "dsv41.engine.cli",
    "dsv41.train.cli",
    "dsv41.server.cli",
    "dsv41.kv.cache_cli",
    "dsv41.posttrain.cli",
    "dsv41.experiments.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash end to end")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse argv and run the chosen command; a ValueError (a user mistake) is printed, exit status 2."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"dsv41 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
