"""The asynchronous RL dispatcher (dsv41/posttrain/dispatch.py) on a scripted engine: group-size dispatch, no split
groups, slot capacity and dataset caps, per-token versions and the staleness mask boundaries, stitched routing,
early-returned groups dropped, the same seed -> the same event log, and slot occupancy per granularity."""

from __future__ import annotations

import random

import pytest

from dsv41.posttrain.dispatch import DispatchConfig, Dispatcher, Emit, Group, Sample


class ScriptedBackend:
    """Each sample runs a length drawn from its seed (1..max_len; a long tail with `tail`), one token per step;
    routing per token is (sid, position). Records the peak number of running samples."""

    def __init__(self, capacity: int, max_len: int = 8, tail: int = 0):
        self.capacity, self.max_len, self.tail = capacity, max_len, tail
        self.live: dict[str, list] = {}
        self.peak = 0
        self.submitted: list[str] = []

    def length(self, seed: int) -> int:
        r = random.Random(seed)
        return r.randint(1, self.max_len) + (self.tail if r.random() < 0.1 else 0)

    def submit(self, sid, prompt, seed):
        assert sid not in self.live
        self.live[sid] = [self.length(seed), 0, seed]
        self.submitted.append(sid)
        self.peak = max(self.peak, len(self.live))
        assert len(self.live) <= self.capacity

    def step(self):
        out = []
        for sid in list(self.live):
            n, k, seed = self.live[sid]
            tok = (seed * 31 + k) % 97
            self.live[sid][1] = k + 1
            done = k + 1 == n
            out.append(Emit(sid, [tok], [-0.5], done, [(sid, k)]))
            if done:
                del self.live[sid]
        random.Random(len(out)).shuffle(out)           # the dispatcher must not depend on the emit order
        return out


def source(seed: int, group: int, datasets=("a", "b"), n: int = 10 ** 6):
    rng = random.Random(seed)
    for gid in range(n):
        ds = datasets[gid % len(datasets)]
        yield Group(gid, ds, [Sample(f"g{gid}s{j}", [1, 2], rng.randrange(10 ** 6)) for j in range(group)])


def run(cfg, capacity=12, group=4, seed=0, steps=6, tail=0, **kw):
    trained = []
    be = ScriptedBackend(capacity, tail=tail)
    d = Dispatcher(be, source(seed, group, **kw), lambda gs, ms: trained.append((gs, ms)), cfg)
    d.run(steps)
    return d, be, trained


@pytest.mark.parametrize("gran", ["sample", "prompt", "batch"])
def test_groups_are_dispatched_and_trained_whole_within_capacity(gran):
    d, be, trained = run(DispatchConfig(granularity=gran, train_groups=2, max_staleness=10))
    assert be.peak <= be.capacity and len(trained) == 6
    dispatched = [e[2] for e in d.log if e[0] == "dispatch"]
    assert dispatched == sorted(dispatched)                            # in order; none jumps the queue
    subs = be.submitted
    for gid in dispatched:                                             # a group's samples were submitted together
        i = subs.index(f"g{gid}s0")
        assert subs[i:i + 4] == [f"g{gid}s{j}" for j in range(4)]
    for groups, masks in trained:
        for g, m in zip(groups, masks):
            assert g.done and len(g.samples) == 4 and len(m) == 4
            assert [len(x) for x in m] == [len(s.tokens) for s in g.samples]


def test_group_dispatched_as_soon_as_free_slots_reach_its_size():
    d, be, _ = run(DispatchConfig(granularity="sample", train_groups=1, max_staleness=10), capacity=10, group=4)
    # replay the log: at every dispatch the slots free before it were >= 4, and whenever a step ended with
    # >= 4 free slots, the next group was dispatched at that clock (no idle wait)
    finishes = {}
    for e in d.log:
        if e[0] == "finish":
            finishes.setdefault(e[1], []).append(e[2])
    events_by_clock = {}
    for e in d.log:
        events_by_clock.setdefault(e[1], []).append(e)
    running = 0
    for clock in range(d.clock):
        for e in events_by_clock.get(clock, []):
            if e[0] == "dispatch":
                assert running + 4 <= 10
                running += 4
        assert 10 - running < 4                                        # dispatch filled the slots it could
        running -= len(finishes.get(clock, []))


def test_dataset_caps_hold():
    cfg = DispatchConfig(granularity="sample", train_groups=1, caps={"a": 4}, max_staleness=10)
    be = ScriptedBackend(16)
    peak = {"a": 0}
    submit = be.submit

    def counting(sid, prompt, seed):
        submit(sid, prompt, seed)
        live_a = sum(1 for x in be.live if int(x[1:].split("s")[0]) % 2 == 0)     # even groups are dataset a
        peak["a"] = max(peak["a"], live_a)
    be.submit = counting
    d = Dispatcher(be, source(0, 4), lambda gs, ms: None, cfg)
    d.run(8)
    assert peak["a"] == 4 and be.peak > 4                              # the cap binds a, not the slots


def test_versions_per_token_and_staleness_mask_boundaries():
    seen = []
    be = ScriptedBackend(8, max_len=3, tail=12)
    d = Dispatcher(be, source(1, 2), lambda gs, ms: seen.append((d.version, gs, ms)),
                   DispatchConfig(granularity="sample", train_groups=1, max_staleness=1))
    d.run(12)
    crossed = 0
    for V, gs, ms in seen:
        for g, m in zip(gs, ms):
            for s, mask in zip(g.samples, m):
                assert len(s.versions) == len(s.tokens) and s.versions == sorted(s.versions)
                assert all(0 <= V - v for v in s.versions)
                for v, keep in zip(s.versions, mask):
                    assert keep == (1.0 if V - v <= 1 else 0.0)      # V - v = 1 trains, 2 does not
                crossed += len(set(s.versions)) > 1
                assert s.routing == [(s.sid, k) for k in range(len(s.tokens))]   # stitched in order
    assert crossed > 0 and any(0.0 in x for _, _, ms in seen for m in ms for x in m)


def test_stale_groups_dropped_whole():
    be = ScriptedBackend(8, max_len=3, tail=12)
    trained = []
    d = Dispatcher(be, source(1, 2), lambda gs, ms: trained.append(gs),
                   DispatchConfig(granularity="sample", train_groups=1, max_staleness=0, max_stale_ratio=0.25))
    d.run(12)
    drops = [e for e in d.log if e[0] == "drop-stale"]
    assert drops
    dropped = {e[2] for e in drops}
    assert not dropped & {g.gid for gs in trained for g in gs}


def test_overtaking_groups_dropped():
    d, _, trained = run(DispatchConfig(granularity="sample", train_groups=1, drop_overtakers=1, max_staleness=10),
                        tail=20, datasets=("a",))
    drops = [e for e in d.log if e[0] == "drop-early"]
    assert drops and all(e[3] >= 1 for e in drops)
    assert not {e[2] for e in drops} & {g.gid for gs, _ in trained for g in gs}


def test_same_seed_same_event_log():
    cfg = DispatchConfig(granularity="sample", train_groups=2, max_staleness=1)
    a, b, c = run(cfg, seed=3)[0].log, run(cfg, seed=3)[0].log, run(cfg, seed=4)[0].log
    assert a == b and a != c


def test_occupancy_sample_level_beats_prompt_and_batch():
    occ = {g: run(DispatchConfig(granularity=g, train_groups=2, max_staleness=10), capacity=12, group=4,
                  steps=20, tail=20)[0].occupancy() for g in ("sample", "prompt", "batch")}
    assert occ["sample"] > occ["prompt"] and occ["sample"] > occ["batch"]


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="granularity"):
        DispatchConfig(granularity="token").check()
    with pytest.raises(ValueError, match="exceeds"):
        run(DispatchConfig(), capacity=3, group=4)
