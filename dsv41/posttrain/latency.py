"""Derived latency for agent teams (docs/system.md §7, docs/report.md §10.2): the time a team's episode would take,
derived from what it did rather than from the wall clock of the machine that happened to run it.

An episode is a DAG of execution events, each with its own duration:

* an LLM call of an agent: `prefill` tokens at `prefill_rate` tokens/s plus `decode` tokens at `decode_rate`
  tokens/s (fixed rates: a property of the deployment, not of this run's batching or queueing);
* a tool call: its measured time in seconds.

Edges are the dependencies: an agent's own events run in order, and a collaboration dependency (a message, a
tool result handed to another agent) makes one event wait for another's end. The derived latency is the length of
the DAG's critical path (the longest path, summing durations): a chain costs the sum of its events, a fan-out the
maximum of its branches. How many other sequences shared the accelerator, and how long a request queued, never
enter it, so the reward cannot be gamed (or hurt) by the load at training time. A cycle is a ValueError.

The team reward is the task score plus a collaboration bonus (the share of the team's agents whose work reaches
the final event) minus a latency penalty, capped like the length term of RL:

    R = score + bonus * contributors / agents - min(cap, penalty * latency)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rates:
    prefill: float = 4000.0           # prompt tokens per second
    decode: float = 50.0              # generated tokens per second

    def __post_init__(self):
        if self.prefill <= 0 or self.decode <= 0:
            raise ValueError(f"token rates must be positive, got prefill {self.prefill}, decode {self.decode}")


@dataclass(frozen=True)
class Event:
    name: str
    agent: str
    kind: str                         # "llm" or "tool"
    prefill: int = 0                  # llm: prompt tokens (those not already in the agent's cache)
    decode: int = 0                   # llm: generated tokens
    seconds: float = 0.0              # tool: measured time

    def duration(self, rates: Rates) -> float:
        if self.kind == "llm":
            return self.prefill / rates.prefill + self.decode / rates.decode
        if self.kind == "tool":
            return self.seconds
        raise ValueError(f"event {self.name!r}: unknown kind {self.kind!r} (llm or tool)")


@dataclass
class Trace:
    """The events of an episode in the order they were recorded and their dependencies (before -> after).
    Each agent's events are chained in recording order; `depend` adds the collaboration edges."""
    events: dict[str, Event] = field(default_factory=dict)
    edges: set[tuple[str, str]] = field(default_factory=set)
    last_of: dict[str, str] = field(default_factory=dict)

    def add(self, ev: Event, after: tuple[str, ...] = ()) -> Event:
        if ev.name in self.events:
            raise ValueError(f"event {ev.name!r} recorded twice")
        if ev.kind == "llm" and (ev.prefill < 0 or ev.decode < 0) or ev.seconds < 0:
            raise ValueError(f"event {ev.name!r}: negative tokens or time")
        self.events[ev.name] = ev
        if ev.agent in self.last_of:
            self.edges.add((self.last_of[ev.agent], ev.name))
        self.last_of[ev.agent] = ev.name
        for a in after:
            self.depend(a, ev.name)
        return ev

    def depend(self, before: str, after: str) -> None:
        for n in (before, after):
            if n not in self.events:
                raise ValueError(f"dependency on unknown event {n!r}")
        self.edges.add((before, after))


def topological(events, edges) -> list[str]:
    """Kahn's order (ties by name, so the result is a function of the graph); a cycle is a ValueError."""
    indeg = {n: 0 for n in events}
    succ: dict[str, list[str]] = {n: [] for n in events}
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = sorted(n for n, d in indeg.items() if d == 0)
    order = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in sorted(succ[n]):
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
        ready.sort()
    if len(order) != len(indeg):
        raise ValueError(f"the dependencies have a cycle through {sorted(n for n, d in indeg.items() if d > 0)}")
    return order


def critical_path(trace: Trace, rates: Rates) -> tuple[float, list[str]]:
    """(derived latency in seconds, the events of one longest path in order)."""
    pred: dict[str, list[str]] = {n: [] for n in trace.events}
    for a, b in trace.edges:
        pred[b].append(a)
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for n in topological(trace.events, trace.edges):
        start, best = 0.0, None
        for p in sorted(pred[n]):
            if finish[p] > start:
                start, best = finish[p], p
        finish[n] = start + trace.events[n].duration(rates)
        via[n] = best
    if not finish:
        return 0.0, []
    end = max(sorted(finish), key=lambda n: finish[n])
    path = [end]
    while via[path[-1]] is not None:
        path.append(via[path[-1]])
    return finish[end], path[::-1]


def contributors(trace: Trace, final: str) -> set[str]:
    """The agents with an event from which `final` is reachable (the final event's own agent included)."""
    if final not in trace.events:
        raise ValueError(f"unknown final event {final!r}")
    pred: dict[str, list[str]] = {n: [] for n in trace.events}
    for a, b in trace.edges:
        pred[b].append(a)
    seen, todo = {final}, [final]
    while todo:
        for p in pred[todo.pop()]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return {trace.events[n].agent for n in seen}


@dataclass(frozen=True)
class TeamReward:
    bonus: float = 0.2                # per unit share of agents contributing to the final event
    penalty: float = 0.1              # per second of derived latency
    cap: float = 0.5                  # the latency penalty's maximum

    def __call__(self, score: float, trace: Trace, final: str, rates: Rates) -> dict:
        latency, path = critical_path(trace, rates)
        agents = {e.agent for e in trace.events.values()}
        share = len(contributors(trace, final)) / len(agents)
        lat_pen = min(self.cap, self.penalty * latency)
        return {"reward": score + self.bonus * share - lat_pen, "score": score, "collaboration": share,
                "latency": latency, "latency_penalty": lat_pen, "critical_path": path}
