"""Serving on several ranks: every rank runs the same `Engine` over its shard of the model and its own KV pool;
rank 0 takes the requests and broadcasts each engine command before running it, so every rank takes the same
steps (the same batches, the same forwards, hence the same collectives in the same order).

Why commands and not forwards: the engine changes its pool between forwards (sequences bound, released, freed,
rolled back after a speculative verify); replaying the commands that cause them keeps each rank's pool the
same without mirroring each pool call. It needs every decision of the engine to be a function of its commands
and the logits, which are the same bits on every rank (`dsv41.parallel.group`): sampling seeds are fixed on
rank 0 before a request is broadcast, and every command carries rank 0's clock (`LockstepClock`), which the
prefix tiers read (the SWA pool's TTL, the disk store's ages), so an entry expires at the same command on every
rank. Prefix caching runs on every rank over that rank's own tiers (the latent KV is whole on every rank, so the
tiers hold the same entries): the disk tier in a per-rank subdirectory `rank{r}-of-{N}`; a Redis SWA pool (its
TTL runs on the Redis server's clock) is refused. Prompt log-probabilities are a command too (`score`).
`dspark:online` corrects its step-cost model by measured step times, which differ between ranks: rank 0's
measurements travel with its step commands and every rank's scheduler reads those (`RankZeroCost` /
`FollowerCost`), so all choose the same verify lengths.

`serving_engine(args)` is what `dsv41 serve` calls: a plain `Engine` in a plain process; under `torchrun`, on
rank 0 a `LockstepEngine` (the engine behind the same interface), while the other ranks `follow` rank 0 until it
stops them (`release_ranks`) and get None.
"""

from __future__ import annotations

import copy
import datetime
import os
import random
import time

import torch
import torch.distributed as tdist

from dsv41.engine.engine import Engine
from dsv41.engine.speculative.scheduler import MeasuredCost
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
        raise ValueError("a forward outside the engine's commands would run on rank 0 alone (the other ranks "
                         "would not join its collectives): make it an engine command (see `score_prompt`)")


class LockstepClock:
    """The time every rank's engine reads: rank 0's wall clock as of the current command (never backwards)."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def tick(self) -> float:
        """Rank 0: advance to the present (never backwards) and return it, to send with a command."""
        self.now = max(self.now, time.time())
        return self.now


class RankZeroCost(MeasuredCost):
    """Rank 0's step-cost model (`dspark:online`): its measurements, kept to be sent with the next command."""

    def __init__(self, profile):
        super().__init__(profile)
        self.unsent: list[tuple] = []

    def record(self, n: int, seconds: float, batch: int | None = None, plain: bool = False,
               vmax: int | None = None) -> None:
        super().record(n, seconds, batch=batch, plain=plain, vmax=vmax)
        self.unsent.append((n, seconds, batch, plain, vmax))

    def take(self) -> list[tuple]:
        out, self.unsent = self.unsent, []
        return out


class FollowerCost(MeasuredCost):
    """A worker's step-cost model: its own step times are ignored; rank 0's arrive with its commands."""

    def record(self, n: int, seconds: float, batch: int | None = None, plain: bool = False,
               vmax: int | None = None) -> None:
        pass

    def replay(self, records: list[tuple]) -> None:
        """Rank 0's (tokens, seconds[, batch, plain[, vmax]]) records, in order."""
        for n, seconds, *rest in records:
            MeasuredCost.record(self, n, seconds, *rest)


def share_step_cost(engine: Engine, leader: bool) -> None:
    """`dspark:online`: give the engine rank 0's (leader) or a follower's step-cost model; otherwise nothing."""
    if isinstance(engine.step_cost, MeasuredCost):
        engine.step_cost = (RankZeroCost if leader else FollowerCost)(engine.step_cost.profile)


class LockstepEngine:
    """Rank 0's engine: `add_request`, `abort`, `step` and `score_prompt` are broadcast to the other ranks with
    rank 0's clock, then run here; everything else is the engine's own (`generate` and `stream` are `Engine`'s,
    running through these)."""

    generate = Engine.generate
    stream = Engine.stream

    def __init__(self, engine: Engine, group: Group, clock: LockstepClock | None = None):
        self.engine, self.group, self.clock = engine, group, clock or LockstepClock()

    def _send(self, *cmd) -> None:
        """Broadcast a command with the clock as this rank runs it (each command ticks it once, first)."""
        self.group.broadcast((*cmd, self.clock.now))

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
        self.clock.tick()
        rid = self.engine.add_request(prompt, params, request_id=request_id, **kw)   # a ValueError stops here
        self._send("add", prompt, sent, rid, kw)
        return rid

    def abort(self, request_id: str) -> None:
        self.clock.tick()
        self._send("abort", request_id)
        self.engine.abort(request_id)

    def step(self):
        self.clock.tick()
        cost = self.engine.step_cost
        self._send("step", cost.take() if isinstance(cost, RankZeroCost) else [])
        return self.engine.step()

    def score_prompt(self, ids: list[int], top_n: int) -> list[dict | None]:
        self.clock.tick()
        self._send("score", list(ids), top_n)
        return self.engine.score_prompt(ids, top_n)

    def release(self) -> None:
        """Let the other ranks' `follow` return."""
        self._send("stop")


def follow(engine: Engine, group: Group, clock: LockstepClock | None = None) -> None:
    """A worker rank: run rank 0's engine commands, at rank 0's clock, until it sends stop."""
    clock = clock or LockstepClock()
    while True:
        *cmd, clock.now = group.broadcast(None)
        if cmd[0] == "stop":
            return
        if cmd[0] == "add":
            _, prompt, params, rid, kw = cmd
            engine.add_request(prompt, params, request_id=rid, **kw)
        elif cmd[0] == "abort":
            engine.abort(cmd[1])
        elif cmd[0] == "step":
            if isinstance(engine.step_cost, FollowerCost):
                engine.step_cost.replay(cmd[1])
            engine.step()
            engine.finished.clear()              # rank 0 answers the requests; nothing reads them here
        elif cmd[0] == "score":
            engine.score_prompt(cmd[1], cmd[2])
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


def check_rank_flags(args) -> None:
    """What several ranks refuse, checked before any process group is joined."""
    pool = getattr(args, "swa_pool", None)
    if pool is not None and pool.lower().startswith("redis"):
        raise ValueError(f"--swa-pool {pool}: a Redis pool expires entries by its own clock, not the ranks' "
                         "lockstep clock; use the in-process pool (auto / memory) on several ranks")


def per_rank_tiers(args, model, group: Group) -> None:
    """Resolve --cache-dir / --swa-pool as one process would, then give each rank its own disk subdirectory."""
    from dsv41.engine.engine import weights_fingerprint
    from dsv41.kv.cache_cli import resolve_prefix_flags
    from dsv41.model.common import QuantSite

    packed = all(m.quant for m in model.modules() if isinstance(m, QuantSite))
    cache_dir, swa_pool = resolve_prefix_flags(args.cache_dir, args.swa_pool, packed,
                                               lambda: weights_fingerprint(model))
    args.cache_dir = "none" if cache_dir is None else os.path.join(cache_dir, f"rank{group.rank}-of-{group.world}")
    args.swa_pool = "none" if swa_pool is None else swa_pool


def use_clock(engine: Engine, clock: LockstepClock) -> None:
    """Every clock of the engine's prefix tiers (the cache's refresh, the disk store's ages, the in-process SWA
    pool's TTL) reads the lockstep clock."""
    cache = engine.prefix_cache
    if cache is not None:
        for part in (cache, cache.disk, cache.swa):
            if part is not None and hasattr(part, "clock"):
                part.clock = clock


def serving_engine(args):
    """The engine `dsv41 serve` runs for these flags (see the module docstring); None on a worker rank once rank 0
    has stopped it."""
    from dsv41.config import parse_dtype
    from dsv41.engine.cli import engine_from_args
    from dsv41.parallel.loading import load_sharded

    if not launched():
        return engine_from_args(args)
    check_rank_flags(args)
    group, device = join()
    model, _ = load_sharded(args.checkpoint, group, parse_dtype(args.dtype), args.storage,
                            getattr(args, "engram_tables", "auto"), device)
    per_rank_tiers(args, model, group)
    engine = engine_from_args(args, model=model)
    clock = LockstepClock()
    use_clock(engine, clock)
    share_step_cost(engine, group.rank == 0)
    if group.rank == 0:
        return LockstepEngine(engine, group, clock)
    follow(engine, group, clock)
    return None
