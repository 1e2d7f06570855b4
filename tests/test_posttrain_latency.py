"""Derived latency for agent teams (dsv41/posttrain/latency.py, team.py): chain = sum, fan-out = max, independence
from simulated batching and queueing, cycles rejected; the team reward and the small multi-agent task."""

from __future__ import annotations

import heapq
import random

import pytest

from dsv41.posttrain import tasks as T
from dsv41.posttrain.latency import Event, Rates, TeamReward, Trace, critical_path, contributors
from dsv41.posttrain.team import ModelAgent, SolverAgent, chunks, score_team, team_episode

R = Rates(prefill=1000.0, decode=10.0)


def llm(name, agent, pre, dec):
    return Event(name, agent, "llm", pre, dec)


def test_chain_is_the_sum():
    tr = Trace()
    tr.add(llm("a", "x", 500, 20))                       # 0.5 + 2
    tr.add(Event("t", "x", "tool", seconds=0.25))        # chained by agent order
    tr.add(llm("b", "y", 0, 5), after=("t",))            # 0.5, a collaboration edge
    lat, path = critical_path(tr, R)
    assert lat == pytest.approx(0.5 + 2 + 0.25 + 0.5) and path == ["a", "t", "b"]


def test_fan_out_is_the_max():
    tr = Trace()
    tr.add(llm("root", "c", 100, 0))                     # 0.1
    for i, dec in enumerate([3, 17, 9]):
        tr.add(llm(f"w{i}", f"w{i}", 0, dec), after=("root",))
    tr.add(Event("join", "c", "tool", seconds=0.05), after=("w0", "w1", "w2"))
    lat, path = critical_path(tr, R)
    assert lat == pytest.approx(0.1 + 1.7 + 0.05) and path == ["root", "w1", "join"]
    assert contributors(tr, "join") == {"c", "w0", "w1", "w2"} and contributors(tr, "w0") == {"c", "w0"}


def test_cycles_and_bad_events_rejected():
    tr = Trace()
    tr.add(llm("a", "x", 1, 1))
    tr.add(llm("b", "y", 1, 1), after=("a",))
    tr.add(llm("c", "z", 1, 1), after=("b",))
    tr.depend("c", "a")
    with pytest.raises(ValueError, match="cycle"):
        critical_path(tr, R)
    with pytest.raises(ValueError, match="twice"):
        tr.add(llm("a", "x", 1, 1))
    with pytest.raises(ValueError, match="unknown"):
        tr.depend("a", "nope")
    with pytest.raises(ValueError, match="kind"):
        Event("q", "x", "sleep").duration(R)
    with pytest.raises(ValueError, match="positive"):
        Rates(prefill=0)


def simulate(calls, deps, slots, step_cost, seed):
    """A queueing, batching server: at most `slots` calls run at once, FIFO among the ready ones (ties shuffled by
    seed); a decode step costs step_cost(batch size); returns a trace recorded in completion order, and the wall
    time the simulation took."""
    rng = random.Random(seed)
    waiting = {n for n in calls}
    done, running, clock, order = set(), {}, 0.0, []
    while waiting or running:
        ready = [n for n in sorted(waiting) if all(d in done for d in deps.get(n, ()))]
        rng.shuffle(ready)
        for n in ready[:slots - len(running)]:
            waiting.discard(n)
            running[n] = calls[n][2]                     # decode tokens left
            clock += calls[n][1] / 5000.0                # its prefill, on the shared server
        clock += step_cost(len(running))
        for n in list(running):
            running[n] -= 1
            if running[n] <= 0:
                del running[n]
                done.add(n)
                order.append(n)
    tr = Trace()
    for n in order:                                      # recorded in completion order: differs by schedule
        agent, pre, dec = calls[n]
        tr.add(llm(n, agent, pre, dec), after=tuple(d for d in deps.get(n, ()) if d in tr.events))
    for n, ds in deps.items():
        for d in ds:
            tr.depend(d, n)
    return tr, clock


def test_independent_of_simulated_batching_and_queueing():
    calls = {"plan": ("lead", 300, 8), "a": ("wa", 120, 14), "b": ("wb", 90, 30), "c": ("wc", 200, 6),
             "d": ("wa2", 60, 11), "sum": ("lead2", 400, 5)}
    deps = {"a": ("plan",), "b": ("plan",), "c": ("plan",), "d": ("a",), "sum": ("b", "c", "d")}
    lats, walls = set(), set()
    for slots, cost, seed in [(1, lambda b: 0.1, 0), (4, lambda b: 0.1 + 0.02 * b, 1), (2, lambda b: 0.3, 2),
                              (8, lambda b: 0.05 * b, 3)]:
        tr, wall = simulate(calls, deps, slots, cost, seed)
        lats.add(round(critical_path(tr, R)[0], 12))
        walls.add(round(wall, 6))
    assert len(lats) == 1 and len(walls) == 4            # the wall clock moved, the derived latency did not
    assert lats.pop() == pytest.approx(0.3 + 0.8 + max(0.12 + 1.4 + 0.06 + 1.1, 0.09 + 3.0, 0.2 + 0.6) + 0.4 + 0.5)


def test_team_reward_terms():
    tr = Trace()
    tr.add(llm("w0", "w0", 0, 10))
    tr.add(llm("w1", "w1", 0, 40))
    tr.add(llm("idle", "w2", 0, 1))                      # contributes nothing to the final event
    tr.add(Event("m", "c", "tool", seconds=0.5), after=("w0", "w1"))
    rw = TeamReward(bonus=0.3, penalty=0.1, cap=10.0)(1.0, tr, "m", R)
    assert rw["latency"] == pytest.approx(4.5) and rw["collaboration"] == pytest.approx(3 / 4)
    assert rw["reward"] == pytest.approx(1.0 + 0.3 * 0.75 - 0.45)
    assert TeamReward(penalty=1.0, cap=0.5)(0.0, tr, "m", R)["latency_penalty"] == 0.5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from dsv41.posttrain.tokenizer import load_post_tokenizer
    return load_post_tokenizer(tmp_path_factory.mktemp("tok"))


def test_team_task_with_the_exact_agent(tok):
    rng = random.Random(0)
    probs = [T.make_sums(rng, 6) for _ in range(10)]
    for p in probs:
        parts = chunks(p, 3)
        assert sum((T.sums_digits(q) for q in parts), []) == T.sums_digits(p)
        assert all(q.content.startswith("sum a") for q in parts)        # each part labelled from `a`
        assert sum(int(q.answer) for q in parts) % 10 == int(p.answer)
    agent = SolverAgent(tok, stride=1)
    solo, split = score_team(probs, agent, "solo", rates=R), score_team(probs, agent, "split", 3, rates=R)
    assert solo["score"] == split["score"] == 1.0
    assert split["collaboration"] == 1.0 and solo["collaboration"] == 1.0
    assert split["latency"] < solo["latency"]             # the fan-out decodes 2 digits' trace, not 6
    tr, final, _ = team_episode(probs[0], agent, "split", 3)
    assert critical_path(tr, R)[1][-2:] == ["merge", "final"]


def test_team_trace_does_not_depend_on_the_engine_batch(tok):
    from dsv41.posttrain.model import build_model
    model = build_model(tok, seed=1).eval()
    p = T.make_sums(random.Random(4), 6)
    a, b = ModelAgent(model, tok, max_tokens=12, max_batch=1), ModelAgent(model, tok, max_tokens=12, max_batch=8)
    ta, tb = team_episode(p, a, "split", 3)[0], team_episode(p, b, "split", 3)[0]
    strip = lambda t: {n: (e.prefill, e.decode) for n, e in t.events.items() if e.kind == "llm"}   # noqa: E731
    assert strip(ta) == strip(tb)
    assert critical_path(ta, R)[0] == pytest.approx(critical_path(tb, R)[0], abs=1e-3)   # tool times are measured
