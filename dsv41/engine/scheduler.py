"""The engine's scheduler: which sequences a step runs, with how many tokens, within a token budget and a KV page
budget (docs/system.md §3).

Token budget. A step feeds at most `max_step_tokens` tokens to the model: first one per decoding sequence (1 + V
with speculative decoding, V capped so the rows fit), then chunks of the admitted prompts still prefilling, oldest
first, so a long prompt spreads over steps and the running streams get a token on every step (chunked prefill).
Prompts admitted together form one group that prefills as one batch: of one length in one forward (rows at their
own positions), of different lengths in few (`dsv41.engine.body_batch`: a row leaves the group when its body is
fed). The model's forward runs the same number of tokens on every row, so a step is one forward per
prefill unit plus one decode forward; a prompt's last token, a one-token row, joins the decode forward.
An image prompt's body is one forward (its spans must be in the first chunk): it runs whole, alone in its step
when it is larger than what the budget leaves.

Pages. The global store grows by pages of `page_size` entries per KV-source layer (`dsv41.kv.pages`); a sequence of
t positions holds `pages_at(ratios, page_size, t)` of them. With a page budget (`kv_pages`) a prefilling sequence
reserves the pages of everything it will feed, a decoding one those it holds after this step. A request waits
while its pages do not fit (admission in arrival order: a waiting request is never overtaken); when the running
sequences' growth does not fit, the youngest is preempted: its pages are freed and it waits again, to be
recomputed from its prompt and its generated tokens, and continues with the same output (bit for bit in the
deterministic mode). A request whose prompt plus max_tokens can never fit is refused at `add_request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.kv.pages import pages_at
from dsv41.model.cache import cache_spec

DEFAULT_STEP_TOKENS = 2048              # tokens one step feeds (at least max_batch)


@dataclass
class Group:
    """Sequences admitted together whose prompt bodies (all tokens but the last) prefill as one batch."""

    seqs: list
    job: object | None = None           # the body's `PrefillJob` until it is finished (None: no body left)
    vision: bool = False


@dataclass
class StepPlan:
    decode: list                                               # decoding sequences (one forward with `join`)
    bodies: list[tuple[Group, int]] = field(default_factory=list)   # (group, tokens per row) of prompt bodies
    tails: list[tuple[object, int]] = field(default_factory=list)   # (sequence, tokens) after the body
    join: list = field(default_factory=list)                   # sequences whose last fed token joins the decode
    drafts: int = 0                                            # most drafts a verify row may take this step
    preempted: list = field(default_factory=list)

    def tokens(self) -> int:
        """Tokens this step feeds to the model."""
        return (len(self.decode) * (1 + self.drafts) + len(self.join) + sum(n for _, n in self.tails)
                + sum(n * len(g.seqs) for g, n in self.bodies))


def target(seq) -> int:
    """Tokens a sequence must have fed before it decodes: the prompt, and when it resumes after a preemption its
    generated tokens but the pending one."""
    return len(seq.prompt_ids) + max(0, len(seq.output_ids) - 1)


def body_left(g: Group, seq) -> int:
    """Body tokens this sequence still has to feed in its group's job (`BodyBatch`: its own; else the group's)."""
    left = getattr(g.job, "remaining_of", None)
    return g.job.remaining if left is None else left(seq.sid)


def decoding(seq) -> bool:
    return seq.pending is not None and seq.fed == target(seq)


class Scheduler:
    """The policy of one engine: `plan` picks a step's work (admitting and preempting through the engine's
    `admit(list of sequences) -> Group` and `preempt(sequence)`)."""

    def __init__(self, cfg, max_batch: int, max_step_tokens: int | None, page_size: int, kv_pages: int | None,
                 max_drafts: int = 0, group_prompts: bool = True, mixed_lengths: bool = True):
        max_step_tokens = max(DEFAULT_STEP_TOKENS, max_batch) if max_step_tokens is None else max_step_tokens
        if max_step_tokens < max_batch:
            raise ValueError(f"max_step_tokens {max_step_tokens} is below max_batch {max_batch}: every running "
                             "sequence needs a token per step")
        if page_size <= 0 or (kv_pages is not None and kv_pages <= 0):
            raise ValueError(f"kv_page_size ({page_size}) and kv_pages ({kv_pages}) must be positive")
        self.max_batch, self.max_step_tokens, self.max_drafts = max_batch, max_step_tokens, max_drafts
        self.page_size, self.kv_pages, self.group_prompts = page_size, kv_pages, group_prompts
        self.mixed_lengths = mixed_lengths
        self.ratios = [s.ratio for s in cache_spec(cfg) if s.ratio > 0]
        self.retained = None        # the prefix device tier (`pages_held`, `evict_lru`): evicted before preempting

    def _held(self) -> int:
        return 0 if self.retained is None else self.retained.pages_held()

    def _evict(self) -> bool:
        return self.retained is not None and self.retained.evict_lru()

    def pages(self, tokens: int) -> int:
        return pages_at(self.ratios, self.page_size, tokens)

    def check_fits(self, tokens: int) -> None:
        """ValueError when a sequence of `tokens` positions can never fit the page budget."""
        if self.kv_pages is not None and self.pages(tokens) > self.kv_pages:
            raise ValueError(f"a request of {tokens} tokens (prompt plus max_tokens) needs {self.pages(tokens)} KV "
                             f"pages; the pool holds {self.kv_pages}")

    def _need(self, seq, per_row: int) -> int:
        """Pages a sequence reserves in this step (never beyond its prompt plus max_tokens: drafts past it are not
        verified, and a request that fits alone must never be preempted by its own reservation)."""
        most = len(seq.prompt_ids) + seq.params.max_tokens
        return self.pages(min(seq.fed + per_row, most) if decoding(seq) else target(seq))

    def plan(self, running: list, waiting: list, admit, preempt, can_join: bool) -> StepPlan:
        """This step's work; `running` (admission order kept) and `waiting` (arrival order) change in place.
        can_join: a one-token last feed may join the decode forward (not while speculating: that forward is a
        verify)."""
        plan = StepPlan([])
        while True:
            dec = [s for s in running if decoding(s)]
            pre = [s for s in running if not decoding(s)]
            reserve = len(pre[0].group.seqs) if pre and pre[0].group else (1 if pre or waiting else 0)
            per_row = 1 + self._drafts(len(dec), reserve)
            if self.kv_pages is None or sum(self._need(s, per_row) for s in running) + self._held() <= self.kv_pages:
                break
            if self._evict():                                           # a retained prefix goes first
                continue
            victim = max(running, key=lambda s: s.arrival)           # the youngest
            for s in victim.group.seqs if victim.group and victim.group.job else [victim]:
                running.remove(s)
                preempt(s)
                plan.preempted.append(s)
        plan.decode, plan.drafts = dec, per_row - 1
        left = self.max_step_tokens - len(dec) * per_row
        used = sum(self._need(s, per_row) for s in running)
        left = self._feed(plan, pre, left, can_join)
        while waiting and left > 0 and len(running) < self.max_batch:
            batch = self._admissible(waiting, used + self._held(), len(running))
            if not batch:
                if self._evict():
                    continue
                break
            group = admit(batch)
            for s in batch:
                waiting.remove(s)
                running.append(s)
                used += self._need(s, per_row)
            left = self._feed(plan, group.seqs, left, can_join)
        return plan

    def _drafts(self, rows: int, reserve: int) -> int:
        """Drafts per verify row: the speculation's, fewer when the rows would exceed the budget."""
        if not rows or not self.max_drafts:
            return 0
        return max(0, min(self.max_drafts, (self.max_step_tokens - reserve) // rows - 1))

    def _admissible(self, waiting: list, used: int, n_running: int) -> list:
        """The head of the queue and those after it that prefill with it (fresh text prompts: of its length, or
        of any length when they and the head have a body, `dsv41.engine.body_batch`), as far as slots and pages
        allow; [] when the head does not fit."""
        head, batch = waiting[0], []
        groupable = self.group_prompts and not head.output_ids and head.vision is None

        def with_head(s) -> bool:
            n, h = len(s.prompt_ids), len(head.prompt_ids)
            return (groupable and not s.output_ids and s.vision is None
                    and (n == h or self.mixed_lengths and min(n, h) > 1))
        for s in waiting:
            if s is not head and not with_head(s):
                break
            if len(batch) + n_running + 1 > self.max_batch:
                break
            if self.kv_pages is not None and used + self.pages(target(s)) > self.kv_pages:
                break
            used += self.pages(target(s))
            batch.append(s)
        return batch

    def _feed(self, plan: StepPlan, seqs: list, left: int, can_join: bool) -> int:
        """Add the prefill work of these sequences (oldest first) within `left` tokens; returns what is left.
        First the last prompt tokens of rows whose bodies are fed (one token each, and their first sampled token:
        never held back behind a long body), then bodies and what follows them; a body that finishes in this step
        lets its rows' last tokens follow in the same step."""
        planned: dict[int, int] = {}
        if can_join:
            for s in seqs:
                if (s.group is None or s.group.job is None) and target(s) - s.fed == 1 and left >= 1:
                    plan.join.append(s)
                    left -= 1
        for s in seqs:
            if s in plan.join:
                continue
            g, fed = s.group, s.fed
            if g is not None and g.job is not None:
                if id(g) not in planned:
                    n = self._body_tokens(plan, g, left)
                    planned[id(g)] = n
                    if n:
                        plan.bodies.append((g, n))
                        left -= sum(min(n, body_left(g, o)) for o in g.seqs)
                if planned[id(g)] < body_left(g, s):
                    continue
                fed = len(s.prompt_ids) - 1
            todo = target(s) - fed
            if todo == 1 and can_join and left >= 1:
                plan.join.append(s)
                left -= 1
            elif todo > 0 and left > 0:
                n = min(todo, left)
                plan.tails.append((s, n))
                left -= n
        return max(left, 0)

    @staticmethod
    def _body_tokens(plan: StepPlan, g: Group, left: int) -> int:
        """Tokens per row of this group's body in this step: as many as the budget leaves, an image body whole
        (alone in its step when larger than what is left)."""
        todo = g.job.remaining
        if g.vision:
            return todo if left >= todo or not (plan.bodies or plan.tails or plan.join) else 0
        rest = sorted(body_left(g, s) for s in g.seqs)
        n, used = 0, 0                     # the most tokens per row whose sum over the rows fits `left`
        for k, r in enumerate(rest):       # (rows of shorter bodies take only what they have left)
            rows = len(rest) - k
            n = min(r, n + (left - used) // rows)
            used = sum(min(n, x) for x in rest)
            if n < r:
                break
        return n
