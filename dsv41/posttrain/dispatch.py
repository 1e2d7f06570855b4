"""Asynchronous RL dispatch (docs/system.md §7, docs/report.md §10.2): rollout and training time-share one
machine; prompts are dispatched to generation slots, finished groups are trained on, and samples keep running
across weight versions.

Granularities (`granularity`):

* `sample` (the report's): a prompt (a group of G samples: every effort level x M_b) is dispatched as soon as the
  free generation slots reach G; a slot frees the moment its sample finishes.
* `prompt`: a group's G slots stay reserved until all its samples finish (long-tail samples stall them).
* `batch`: dispatch fills the slots with whole groups only when nothing is in flight, and waits for all of them.

Invariants (tested on a scripted engine): a group is dispatched whole or not at all and trained whole or dropped
whole (never split); in-flight samples never exceed the slot capacity nor a dataset's concurrency cap; every
token carries the policy version that generated it; when a training step at version V takes a sample, its tokens
with V - v > max_staleness are masked out of the loss (the boundary itself, V - v = max_staleness, trains), and a
group whose masked share exceeds `max_stale_ratio` is dropped; with `drop_overtakers = k`, a group that finishes
while k or more older groups of its dataset are still running is dropped (early-returned, hence short, samples
bias the length). Each sample's per-token payload (the expert routing a backend reports, when it does) is stitched
in order across versions. The event log is a pure function of the backend's behaviour and the seeds.

On the real engine (`EngineBackend`) the model object is shared: a training step changes the weights in place
and the running sequences continue from their KV cache in the engine's pool, without a new prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

GRANULARITIES = ("sample", "prompt", "batch")


@dataclass
class Emit:
    sid: str
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    routing: list | None = None            # one entry per token (None when the backend does not record it)


class Backend(Protocol):
    capacity: int

    def submit(self, sid: str, prompt: list[int], seed: int) -> None: ...

    def step(self) -> list[Emit]: ...


@dataclass
class Sample:
    sid: str
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list = field(default_factory=list)
    done: bool = False


@dataclass
class Group:
    gid: int
    dataset: str
    samples: list[Sample]
    meta: object = None                     # what the trainer needs to score it (problem, levels)
    dispatched_at: int = -1

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


@dataclass
class DispatchConfig:
    granularity: str = "sample"
    train_groups: int = 2                   # groups per training step
    max_staleness: int = 1                  # versions; older tokens are masked
    max_stale_ratio: float = 1.0            # a group with a larger masked share is dropped
    caps: dict = field(default_factory=dict)   # dataset -> max in-flight samples
    drop_overtakers: int | None = None

    def check(self) -> "DispatchConfig":
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}: choose from {', '.join(GRANULARITIES)}")
        if self.train_groups < 1 or self.max_staleness < 0 or not 0 <= self.max_stale_ratio <= 1:
            raise ValueError(f"bad dispatch settings: train_groups {self.train_groups}, max_staleness "
                             f"{self.max_staleness}, max_stale_ratio {self.max_stale_ratio}")
        return self


class Dispatcher:
    """Runs prompts from `source` (an iterator of Groups, not yet dispatched) through `backend`, calling
    `train(groups, masks) ` with every `train_groups` finished groups; each call is one new policy version."""

    def __init__(self, backend: Backend, source, train: Callable, cfg: DispatchConfig):
        self.backend, self.source, self.train_fn, self.cfg = backend, source, train, cfg.check()
        self.version, self.clock = 0, 0
        self.pending: list[Group] = []          # drawn from the source, not yet dispatched
        self.running: list[Group] = []          # dispatched, not all samples finished
        self.ready: list[Group] = []            # finished, waiting for training
        self.by_sid: dict[str, Sample] = {}
        self.log: list[tuple] = []
        self.busy_slot_steps = 0
        self.engine_steps = 0

    # -------------------------------------------------------------- slots
    def _live_samples(self, dataset: str | None = None) -> int:
        return sum(1 for g in self.running if dataset in (None, g.dataset) for s in g.samples if not s.done)

    def _reserved(self) -> int:
        """Slots held: running samples (sample / batch level) or whole unfinished groups (prompt level)."""
        if self.cfg.granularity == "prompt":
            return sum(len(g.samples) for g in self.running)
        return self._live_samples()

    def _fits(self, g: Group) -> bool:
        cap = self.cfg.caps.get(g.dataset)
        if len(g.samples) > self.backend.capacity:
            raise ValueError(f"group of {len(g.samples)} samples exceeds the {self.backend.capacity} slots")
        return (self._reserved() + len(g.samples) <= self.backend.capacity
                and (cap is None or self._live_samples(g.dataset) + len(g.samples) <= cap))

    def _next_pending(self) -> Group | None:
        if not self.pending:
            g = next(self.source, None)
            if g is None:
                return None
            self.pending.append(g)
        return self.pending[0]

    def dispatch(self) -> None:
        """Dispatch pending groups in order while the next one fits (it waits for slots; none jumps the queue)."""
        if self.cfg.granularity == "batch" and self.running:
            return
        while (g := self._next_pending()) is not None and self._fits(g):
            self.pending.pop(0)
            g.dispatched_at = self.clock
            self.running.append(g)
            for s in g.samples:
                self.by_sid[s.sid] = s
                self.backend.submit(s.sid, s.prompt, s.seed)
            self.log.append(("dispatch", self.clock, g.gid, self.version))

    # -------------------------------------------------------------- generation
    def generate_step(self) -> None:
        emits = sorted(self.backend.step(), key=lambda e: e.sid)
        self.engine_steps += 1
        self.busy_slot_steps += len({e.sid for e in emits})
        for e in emits:
            s = self.by_sid[e.sid]
            s.tokens += e.tokens
            s.logprobs += e.logprobs
            s.versions += [self.version] * len(e.tokens)
            s.routing += e.routing if e.routing is not None else [None] * len(e.tokens)
            if e.finished:
                s.done = True
                self.log.append(("finish", self.clock, e.sid, len(s.tokens)))
        for g in [g for g in self.running if g.done]:
            self.running.remove(g)
            self._complete(g)
        self.clock += 1

    def _complete(self, g: Group) -> None:
        k = self.cfg.drop_overtakers
        older = sum(1 for o in self.running if o.dataset == g.dataset and o.dispatched_at < g.dispatched_at)
        if k is not None and older >= k:
            self.log.append(("drop-early", self.clock, g.gid, older))
            return
        self.ready.append(g)

    # -------------------------------------------------------------- training
    def masks(self, g: Group) -> list[list[float]]:
        return [[float(self.version - v <= self.cfg.max_staleness) for v in s.versions] for s in g.samples]

    def train_ready(self) -> bool:
        n = self.cfg.train_groups
        if len(self.ready) < n or (self.cfg.granularity == "batch" and self.running):
            return False
        take, self.ready = self.ready[:n], self.ready[n:]
        groups, masks = [], []
        for g in take:
            m = self.masks(g)
            total = sum(map(len, m))
            stale = total - sum(map(sum, m))
            if total and stale / total > self.cfg.max_stale_ratio:
                self.log.append(("drop-stale", self.clock, g.gid, stale))
                continue
            groups.append(g)
            masks.append(m)
        self.log.append(("train", self.clock, self.version, tuple(g.gid for g in groups)))
        if groups:
            switching = getattr(self.backend, "switching", None)
            if switching is not None:
                switching(self.version)             # the weights are about to change: record what they routed
            self.train_fn(groups, masks)
        self.version += 1
        return True

    def run(self, train_steps: int, max_engine_steps: int = 10 ** 9) -> None:
        """Time-share until `train_steps` training steps ran (or the source and the slots ran dry)."""
        trained = 0
        while trained < train_steps and self.engine_steps < max_engine_steps:
            self.dispatch()
            if not self.running:
                if not self.train_ready():
                    break                       # nothing runs, nothing trains: the source ran dry
                trained += 1
                continue
            self.generate_step()
            while trained < train_steps and self.train_ready():
                trained += 1

    def occupancy(self) -> float:
        """Mean share of the generation slots holding a running sample, per engine step."""
        return self.busy_slot_steps / max(1, self.engine_steps * self.backend.capacity)


class EngineBackend:
    """The project's engine as a dispatch backend: one request per sample (its own seed), tokens and the engine's
    log-probs streamed per step. It records each sample's expert routing per weight version (`records[sid]`, a
    routing.RouteRecord): for the running samples in `switching` (called before the weights change), and at a
    sample's end for its last segment, by the forward that also gives a sampled EOS its log-prob (the engine does
    not report it). max_tokens: one limit, or a function of the sample id."""

    def __init__(self, engine, tok, max_tokens):
        self.engine, self.tok, self.max_tokens = engine, tok, max_tokens
        self.capacity = engine.max_batch
        self.rows: dict[str, list[int]] = {}            # live samples: prompt + tokens so far
        self.records: dict = {}
        self.version = 0

    def submit(self, sid: str, prompt: list[int], seed: int) -> None:
        from dsv41.posttrain.rollout import sampling
        from dsv41.posttrain.routing import RouteRecord
        n = self.max_tokens(sid) if callable(self.max_tokens) else self.max_tokens
        self.engine.add_request(prompt, sampling(n, seed), request_id=sid)
        self.rows[sid], self.records[sid] = list(prompt), RouteRecord()

    def switching(self, version: int) -> None:
        from dsv41.posttrain.routing import record
        live = sorted(self.rows)
        if live:
            record(self.engine.model, [self.records[s] for s in live], [self.rows[s] for s in live], version,
                   self.tok.pad_id)
        self.version = version + 1

    def step(self) -> list[Emit]:
        from dsv41.posttrain.routing import record
        out, ended = [], []
        for o in self.engine.step():
            toks, lps = list(o.new_token_ids), [x["logprob"] for x in o.new_logprobs]
            self.rows[o.request_id] += toks
            if o.finished:
                self.engine.finished.pop(o.request_id)
                if o.finish_reason == "stop":
                    toks, lps = toks + [self.tok.eos_id], lps + [float("nan")]
                    self.rows[o.request_id].append(self.tok.eos_id)
                ended.append(len(out))
            out.append(Emit(o.request_id, toks, lps, o.finished))
        if ended:
            sids = [out[i].sid for i in ended]
            rows = [self.rows.pop(s) for s in sids]
            lp = record(self.engine.model, [self.records[s] for s in sids], rows, self.version, self.tok.pad_id)
            for j, i in enumerate(ended):
                if out[i].logprobs and out[i].logprobs[-1] != out[i].logprobs[-1]:      # the EOS's NaN
                    out[i].logprobs[-1] = float(lp[j, len(rows[j]) - 2])
        return out
