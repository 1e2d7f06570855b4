"""A small multi-agent task scored with derived latency (dsv41/posttrain/latency.py, docs/system.md §7).

The task is a `sums` problem (running sum mod 10 of n digits). A team answers it in one of two plans:

* `solo`: one agent gets the whole problem and reasons through the whole chain (one long LLM call);
* `split`: k worker agents each get a contiguous chunk of the digits (their calls are independent, a fan-out),
  and a coordinator adds the workers' answers mod 10 with a tool (measured), then states the answer (an LLM call
  whose prompt holds the workers' messages: collaboration dependencies on every worker).

The split plan's derived latency is max(worker) + tool + final call instead of the whole chain's decode, and its
collaboration share is 1 instead of 1 / (k + 1); whether it also scores depends on the workers being right, which
is the point of scoring the team with one reward.

An agent is anything with `answer(problems, effort) -> [(prompt_tokens, output_tokens, answer_text)]` for a batch
of problems: `SolverAgent` (the exact task writer: the stride-`stride` response) or `ModelAgent` (a post-training
checkpoint on the deterministic engine, greedy). How an agent batches or queues its calls changes nothing in the
trace: tokens are per call.
"""

from __future__ import annotations

import time

from dsv41.posttrain import tasks as T
from dsv41.posttrain.latency import Event, Rates, TeamReward, Trace

PLANS = ("solo", "split")


def chunks(p: T.Problem, k: int) -> list[T.Problem]:
    """The `sums` problem's digits cut into k contiguous sub-problems (as equal as possible, each labelled from
    `a`)."""
    if p.family != "sums":
        raise ValueError(f"the team task splits sums problems, got {p.family!r}")
    if not 1 <= k <= p.difficulty:
        raise ValueError(f"cannot split {p.difficulty} digits among {k} workers")
    digits = T.sums_digits(p)
    cut = [round(i * len(digits) / k) for i in range(k + 1)]
    return [T.sums_problem(digits[a:b]) for a, b in zip(cut, cut[1:])]


class SolverAgent:
    """The exact writer of the task's responses at a fixed trace stride (clipped to the problem's length)."""

    def __init__(self, tok, stride: int = 1):
        self.tok, self.stride = tok, stride

    def answer(self, problems, effort: int):
        return [(len(T.prompt_ids(self.tok, p, effort)),
                 len(T.response_ids(self.tok, p, min(self.stride, p.difficulty))), p.answer) for p in problems]


class ModelAgent:
    """A post-training checkpoint answering greedily on the deterministic engine (a batch of calls at once)."""

    def __init__(self, model, tok, max_tokens: int = T.MAX_TOKENS, max_batch: int = 16):
        from dsv41.posttrain.rollout import make_engine
        self.tok, self.max_tokens = tok, max_tokens
        self.engine = make_engine(model, tok, max_batch=max_batch)

    def answer(self, problems, effort: int):
        from dsv41.posttrain.rollout import rollouts
        rs = rollouts(self.engine, self.tok, [(p, effort, None) for p in problems], self.max_tokens, temperature=0.0)
        return [(len(r.prompt_ids), len(r.output_ids), r.verdict.answer) for r in rs]


def merge_tool(answers: list[str]) -> tuple[str, float]:
    """The coordinator's tool: the sum mod 10 of the workers' answers, and its measured time in seconds."""
    t0 = time.perf_counter()
    try:
        out = str(sum(int(a) for a in answers) % 10)
    except ValueError:
        out = ""                                         # a worker answered something that is not a digit
    return out, time.perf_counter() - t0


def team_episode(p: T.Problem, agent, plan: str, workers: int = 2, effort: int = 50) -> tuple[Trace, str, str]:
    """Run one plan on problem p; (trace, the final event's name, the team's answer)."""
    tr = Trace()
    if plan == "solo":
        (pre, dec, ans), = agent.answer([p], effort)
        tr.add(Event("solo", "solver", "llm", pre, dec))
        return tr, "solo", ans
    if plan != "split":
        raise ValueError(f"unknown plan {plan!r}: choose from {', '.join(PLANS)}")
    subs = chunks(p, workers)
    outs = agent.answer(subs, effort)
    for i, (pre, dec, _) in enumerate(outs):
        tr.add(Event(f"work{i}", f"worker{i}", "llm", pre, dec))
    merged, secs = merge_tool([a for _, _, a in outs])
    tr.add(Event("merge", "coordinator", "tool", seconds=secs), after=tuple(f"work{i}" for i in range(workers)))
    # the coordinator states the merged answer: its prompt holds the workers' messages, its output the answer
    pre = sum(len(a) + 1 for _, _, a in outs)
    tr.add(Event("final", "coordinator", "llm", pre, len(merged) + 2))
    return tr, "final", merged


def score_team(problems, agent, plan: str, workers: int = 2, effort: int = 50, rates: Rates = Rates(),
               reward: TeamReward = TeamReward()) -> dict:
    """Mean team reward, score, collaboration share and derived latency of a plan over problems."""
    rows = []
    for p in problems:
        tr, final, ans = team_episode(p, agent, plan, workers, effort)
        rows.append(reward(float(ans == p.answer), tr, final, rates))
    keys = ("reward", "score", "collaboration", "latency")
    return {"plan": plan, "n": len(rows), **{k: sum(r[k] for r in rows) / len(rows) for k in keys}}
