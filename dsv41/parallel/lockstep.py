"""Serving on several ranks: every rank runs the same `Engine` over its shard of the model and its own KV pool;
rank 0 takes the requests and broadcasts each engine command before running it, so every rank takes the same
steps (the same batches, the same forwards, hence the same collectives in the same order).

Why commands and not forwards: the engine changes its pool between forwards (sequences bound, released, freed,
rolled back after a speculative verify); replaying the commands that cause them keeps each rank's pool the
same without mirroring each pool call. It needs every decision of the engine to be a function of its commands
and the logits, which are the same bits on every rank (`dsv41.parallel.group`): sampling seeds are fixed on
rank 0 before a request is broadcast; what depends on time or on a cache outside the process is refused on
several ranks (`dspark:online`, which times steps; prefix caching, whose SWA pool expires by time: serve's
default `auto` tiers are off, a tier named on the command line is a ValueError); prompt
log-probabilities (a forward outside the engine's steps) answer a ValueError (the server's 400).

`serving_engine(args)` is what `dsv41 serve` calls: a plain `Engine` in a plain process; under `torchrun`, on
rank 0 a `LockstepEngine` (the engine behind the same interface), while the other ranks `follow` rank 0 until it
stops them (`release_ranks`) and get None.
"""

from __future__ import annotations

import copy
import datetime
import os
import random

import torch
import torch.distributed as tdist

from dsv41.engine.engine import Engine
from dsv41.parallel.group import Group

IDLE_TIMEOUT = datetime.timedelta(days=7)        # workers wait in a broadcast while the server is idle


class RankZeroOnly:
    """The model as seen from outside the engine on rank 0: its attributes, but no forward (the other ranks
    would not join its collectives)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        raise ValueError("this forward runs outside the engine's steps, which is not served on several ranks yet "
                         "(prompt log-probabilities)")


class LockstepEngine:
    """Rank 0's engine: `add_request`, `abort` and `step` are broadcast to the other ranks, then run here;
    everything else is the engine's own (`generate` and `stream` are `Engine`'s, running through these)."""

    generate = Engine.generate
    stream = Engine.stream

    def __init__(self, engine: Engine, group: Group):
        self.engine, self.group = engine, group

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def model(self):
        return RankZeroOnly(self.engine.model)

    def add_request(self, prompt, params=None, request_id: str | None = None, images: tuple | None = None) -> str:
        from dsv41.engine.sampling import SamplingParams

        params = copy.deepcopy(params) if params is not None else SamplingParams()
        if params.seed is None:                   # every rank's generator must draw the same numbers
            params.seed = random.SystemRandom().randrange(2 ** 62)
        sent = copy.deepcopy(params)
        kw = {} if images is None else {"images": images}
        rid = self.engine.add_request(prompt, params, request_id=request_id, **kw)   # a ValueError stops here
        self.group.broadcast(("add", prompt, sent, rid, kw))
        return rid

    def abort(self, request_id: str) -> None:
        self.group.broadcast(("abort", request_id))
        self.engine.abort(request_id)

    def step(self):
        self.group.broadcast(("step",))
        return self.engine.step()

    def release(self) -> None:
        """Let the other ranks' `follow` return."""
        self.group.broadcast(("stop",))


def follow(engine: Engine, group: Group) -> None:
    """A worker rank: run rank 0's engine commands until it sends stop."""
    while True:
        cmd = group.broadcast(None)
        if cmd[0] == "stop":
            return
        if cmd[0] == "add":
            _, prompt, params, rid, kw = cmd
            engine.add_request(prompt, params, request_id=rid, **kw)
        elif cmd[0] == "abort":
            engine.abort(cmd[1])
        elif cmd[0] == "step":
            engine.step()
            engine.finished.clear()              # rank 0 answers the requests; nothing reads them here
        else:
            raise RuntimeError(f"unknown engine command {cmd[0]!r}")


def release_ranks(engine) -> None:
    """After serving: stop the other ranks (a no-op for a plain engine)."""
    if isinstance(engine, LockstepEngine):
        engine.release()


def launched() -> bool:
    """Under `torchrun` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def join() -> tuple[Group, torch.device]:
    """Join the default process group (NCCL and the local GPU when CUDA is available, else gloo on the CPU)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        tdist.init_process_group(backend="nccl" if cuda else "gloo", timeout=IDLE_TIMEOUT)
    return Group.current(), device


def _prefix_caching_off(args) -> None:
    """Prefix caching is off on several ranks: serve's default (`auto`) turns into `none`, a tier asked for by name
    is a ValueError."""
    for flag in ("cache_dir", "swa_pool"):
        value = getattr(args, flag, None)
        if value is not None and value.lower() == "auto":
            setattr(args, flag, "none")
        elif value is not None and value.lower() != "none":
            raise ValueError(f"--{flag.replace('_', '-')} {value}: prefix caching is not served on several ranks "
                             "yet")


def serving_engine(args):
    """The engine `dsv41 serve` runs for these flags (see the module docstring); None on a worker rank once rank 0
    has stopped it."""
    from dsv41.config import parse_dtype
    from dsv41.engine.cli import engine_from_args
    from dsv41.parallel.loading import load_sharded

    if not launched():
        return engine_from_args(args)
    _prefix_caching_off(args)
    if args.speculative.startswith("dspark:online"):
        raise ValueError("--speculative dspark:online times the steps, which differs between ranks: use dspark")
    group, device = join()
    model, _ = load_sharded(args.checkpoint, group, parse_dtype(args.dtype), args.storage)
    engine = engine_from_args(args, model=model.to(device))
    if group.rank == 0:
        return LockstepEngine(engine, group)
    follow(engine, group)
    return None
