"""The inference engine: requests in, tokens out, with continuous batching.

Each `step()` runs what the scheduler (`dsv41.engine.scheduler`) plans within its token and KV page budgets:
chunks of admitted prompts (chunked prefill in the configured CED mode; prompts admitted together prefill as one
batch: of one length in one forward, of different lengths in few, `dsv41.engine.body_batch`), then ONE batched
decode step for every running sequence (rows at different positions, prompts' last tokens joining), samples,
applies stop conditions, and returns what each request produced. Sequences join and leave between steps; when the
pages run out the youngest is preempted and recomputed later.
With speculative decoding (`speculative="fixed:N"` or `"dspark"`, `dsv41.engine.speculative`) that step is one
draft-verify step instead: each row may emit several tokens, with exactly the target's distribution (each row
verifying its own number of drafts in one ragged forward).
Bad requests are rejected at `add_request` with a ValueError and never reach the batch.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from dsv41.engine.body_batch import BodyBatch
from dsv41.engine.graphs import decode_graphs
from dsv41.engine.prefill import MODES, PrefillJob, check_ced
from dsv41.engine.prefix_hit import prefix_hit
from dsv41.engine.sampling import SamplingParams, make_generator, sample_token, top_logprobs
from dsv41.engine.scheduler import Group, Scheduler, StepPlan, target
from dsv41.engine.speculative.drafter import DSparkDrafter
from dsv41.engine.speculative.policy import Speculation
from dsv41.engine.speculative.rejection import accept_drafts
from dsv41.engine.speculative.rollback import VerifyJournal
from dsv41.engine.speculative.scheduler import (AcceptanceCalibration, MeasuredCost, choose_verify_lengths,
                                                closed_batch_lengths, closed_batch_times, plain_cost,
                                                row_acceptance, shrinkage_strength, spec_cost)
from dsv41.engine.store import SequencePool, make_pool
from dsv41.engine.tokenizer import ByteTokenizer
from dsv41.kv.device_tier import DeviceTier
from dsv41.model.attention import use_deterministic
from dsv41.model.step import ForwardOptions

DEFAULT_MAX_SEQ_LEN = 4096                   # prompt + completion tokens per request (a limit: nothing is preallocated)
MIN_EVIDENCE = 16      # verified first drafts before the dspark scheduler may skip drafting (`Engine._drafting_pays`)
PROBE_EVERY = 16       # while drafting does not pay, draft anyway on every 16th step
CLOSED_EVIDENCE = 128  # verified first drafts before a closed batch may stop drafting for good (`_drafting_pays`)
SEED_SHARE = 0.05      # keeping the drafter seeded while drafting does not pay: stop above this share of a step
SEED_EVIDENCE = 4      # seeded plain steps timed before that share is trusted


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    gen: torch.Generator
    vision: tuple | None = None              # images: (ImageRecords, token types int64 [T]) of the prompt
    sid: int | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text: str = ""
    emitted: int = 0                         # characters of `text` already streamed
    finish_reason: str | None = None
    pending: int | None = None               # sampled token not yet fed through the model
    prefill_s: float = 0.0
    decode_s: float = 0.0
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    kv: dict | None = None
    cache_path: str = "cold"                 # cold / swa-hit / replay (prefix caching)
    cached_tokens: int = 0
    cached_tiers: dict = field(default_factory=dict)
    drafted: int = 0                         # speculative decoding: drafts verified / accepted, target forwards
    accepted: int = 0
    target_steps: int = 0
    verify_lengths: dict = field(default_factory=dict)   # speculative: row-steps by verify length (0: no drafts)
    predicted_tokens: float = 0.0            # speculative: tokens predicted per row-step (1 + S summed over the
    realised_tokens: int = 0                 # verified drafts; 1 without drafts) and the tokens those steps emitted
    draft_reached: list = field(default_factory=list)    # speculative: this row's drafts verified per position (with
    draft_accepted: list = field(default_factory=list)   # drafts < k accepted) and accepted (`_drafting_pays`)
    drafter_off: bool = False                # speculative: a closed batch found drafting not to pay; never again
    arrival: int = 0                         # scheduling: arrival order (the youngest is preempted first)
    fed: int = 0                             # tokens run into the store
    group: Group | None = None               # set while admitted (its body job until the body is done)
    preemptions: int = 0


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict] = field(default_factory=list)   # per new token, when the request asked for them


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    logprobs: list[dict]


class Engine:
    def __init__(self, model, tokenizer=None, prefill_mode: str = "ced-bounded", max_batch: int = 8,
                 max_seq_len: int = DEFAULT_MAX_SEQ_LEN, chunk_size: int | None = None, device=None,
                 cache_dir=None, swa_pool=None, cache_interval: int = 4096, speculative="off", step_profile=None,
                 deterministic: bool = False, max_step_tokens: int | None = None, kv_pages: int | None = None,
                 kv_page_size: int = 64, device_tier: int = 64, cuda_graphs: bool | None = None,
                 mixed_prefill: bool = True):
        """max_step_tokens: tokens one step feeds (decode rows, prompt chunks; default max(2048, max_batch));
        kv_pages: the global-store pages all sequences may hold together (None: unbounded), of kv_page_size entries
        (docs/system.md §3, `dsv41.engine.scheduler`). device_tier: with prefix caching, finished sequences kept
        in the pool for prefix sharing, at most this many (0: off; `dsv41.kv.device_tier`).

        cuda_graphs: decode steps of fixed shapes replayed from CUDA graphs (`dsv41.engine.graphs`); None: on for a
        CUDA device when the model supports them, True: required (on a CPU the same static step runs eagerly).

        mixed_prefill: prompts of different lengths admitted together prefill as one batch in few forwards
        (`dsv41.engine.body_batch`); False: only prompts of one length batch (comparisons).

        deterministic: switch on the deterministic mode (process-wide) and the `recent` tie rule: a request's
        tokens and log-probs then do not depend on its batch, the chunking, speculation or a cache resume
        (`dsv41.model.attention.use_deterministic`, docs/system.md §10). Its prefill is exact: `ced-bounded` runs
        as `ced-exact`, and a prefix-cache hit without its SWA snapshot is not replayed (bounded replay is an
        approximation) but prefilled from the start."""
        if prefill_mode not in MODES:
            raise ValueError(f"unknown prefill mode {prefill_mode!r}; choose one of {', '.join(MODES)}")
        if deterministic and prefill_mode == "ced-bounded":
            prefill_mode = "ced-exact"
        self.deterministic = deterministic
        if prefill_mode != "full":
            try:
                check_ced(model.cfg)
            except ValueError:
                prefill_mode = "full"                    # this config has no CED skip: say so in stats
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.cfg = model.eval(), model.cfg
        if deterministic:
            use_deterministic(model)
        self.tokenizer = tokenizer or ByteTokenizer(model.cfg.vocab_size)
        self.prefill_mode, self.max_batch, self.chunk_size = prefill_mode, max_batch, chunk_size
        self.max_seq_len = max_seq_len
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.pool: SequencePool = make_pool(model, self.device, kv_page_size, kv_pages)
        self.graphs = decode_graphs(model, self.pool, max_seq_len, cuda_graphs)
        self.prefix_cache = self.device_tier = None
        if cache_dir is not None or swa_pool is not None:
            if not self.pool.packed:
                raise ValueError("prefix caching stores packed KV: it needs a quantized model (the packed store)")
            from dsv41.kv.manager import PrefixCache
            self.prefix_cache = PrefixCache.from_config(self.cfg, weights_fingerprint(model),
                                                        tokenizer_fingerprint(self.tokenizer), cache_dir=cache_dir,
                                                        swa_pool=swa_pool, interval=cache_interval,
                                                        hasher=model.engram_hasher)
            if device_tier:
                self.device_tier = DeviceTier(self.pool, self.prefix_cache.align, self.cfg.window_size, device_tier)
                self.prefix_cache.device = self.device_tier
        self.speculation = Speculation.parse(speculative)
        self.drafter = None if self.speculation.mode == "off" else DSparkDrafter(model)
        G = model.cfg.dspark_block_size
        # engine-wide speculative counters: per draft position k, rows that verified it with drafts < k accepted
        # ("reached") and rows that accepted it; target forwards and rows decoded; with a cost model (dspark),
        # decode steps timed and the seconds the model predicted for their shapes vs those they took
        self.spec_counts = {"reached": [0] * G, "accepted": [0] * G, "forwards": 0, "row_steps": 0, "tokens": 0,
                            "timed_steps": 0, "predicted_s": 0.0, "realised_s": 0.0, "closed_plain": 0,
                            "closed_spec": 0, "seeded_steps": 0, "seeded_s": 0.0, "seed_s": 0.0,
                            "stopped_never_pays": 0, "stopped_seeding_cost": 0}
        self.last_step_cost: tuple[float, float] | None = None   # (predicted, realised) s of the last timed step
        self._skipped = 0                      # dspark steps in a row decoded without drafting (`_drafting_pays`)
        if self.speculation.mode == "dspark" and step_profile is None:
            raise ValueError("the dspark scheduler needs the step latency profile T(n): run `dsv41 profile-step` "
                             "on the checkpoint, or choose --speculative fixed:N")
        # dspark:online: the scheduler's inputs corrected online by what this engine measures
        online = self.speculation.mode == "dspark" and self.speculation.online
        self.calibration = AcceptanceCalibration(G) if online else None
        self.step_cost = MeasuredCost(step_profile) if online else step_profile
        max_drafts = 0 if self.drafter is None else (self.speculation.n if self.speculation.mode == "fixed" else G)
        self.scheduler = Scheduler(self.cfg, max_batch, max_step_tokens, kv_page_size, kv_pages, max_drafts,
                                   group_prompts=self.prefix_cache is None, mixed_lengths=mixed_prefill)
        self.scheduler.retained = self.device_tier          # retained prefixes are evicted before preempting
        self.last_plan: StepPlan | None = None
        self.waiting: list[Sequence] = []            # arrival order
        self.running: list[Sequence] = []            # admitted (prefilling or decoding), admission order
        self.finished: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images: tuple | None = None) -> str:
        """images: (records, token types) of a prompt expanded by `dsv41.model.image.expand_prompt`; such a prompt
        is prefilled in one full-mode chunk and stays out of the prefix cache (its keys do not see pixels)."""
        params = params or SamplingParams()
        params.validate(self.cfg.vocab_size)
        text, bos = isinstance(prompt, str), self.tokenizer.bos_id
        ids = ([] if bos is None else [bos]) + self.tokenizer.encode(prompt) if text else list(prompt)
        if not ids or (text and not prompt):
            raise ValueError("empty prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt holds token ids outside [0, {self.cfg.vocab_size})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds the "
                             f"maximum context of {self.max_seq_len} tokens")
        self.scheduler.check_fits(len(ids) + params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.finished or any(s.request_id == rid for s in self.waiting + self.running):
            raise ValueError(f"duplicate request id {rid!r}")
        if self.drafter is not None and params.processed():
            raise ValueError("logit bias, penalties and grammar constraints need speculative decoding off")
        if images is not None and (len(images) != 2 or images[1].numel() != len(ids)):
            raise ValueError("images: (records, token types) with one type per prompt token")
        self.waiting.append(Sequence(rid, ids, params.for_prompt(ids), make_generator(params.seed), images,
                                     arrival=next(self._arrivals)))
        return rid

    def abort(self, request_id: str) -> None:
        for lst in (self.waiting, self.running):
            for s in [s for s in lst if s.request_id == request_id]:
                lst.remove(s)
                s.finish_reason = "abort"
                if s.group is not None and s.group.job is not None:     # its batch-mates prefill again without it
                    for o in [o for o in s.group.seqs if o is not s]:
                        self.running.remove(o)
                        self._preempt(o)
                self._release(s)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def score_prompt(self, ids: list[int], top_n: int) -> list[dict | None]:
        """The prompt's log-probabilities (`dsv41.engine.scoring.prompt_logprobs`), between steps."""
        from dsv41.engine.scoring import prompt_logprobs
        return prompt_logprobs(self, ids, top_n)

    # ---------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        self.last_step_cost = None
        plan = self.scheduler.plan(self.running, self.waiting, self._admit, self._preempt,
                                   can_join=self.drafter is None)
        self.last_plan = plan
        for g, n in plan.bodies:
            self._feed_body(g, n)
        for s, n in plan.tails:
            self._feed_tail(s, n, outs)
        self._decode(plan.decode, plan.join, plan.drafts, outs)
        for s in [s for s in self.running if s.finish_reason]:
            self.running.remove(s)
            self._release(s)
            self.finished[s.request_id] = s
        return outs

    def _admit(self, seqs: list[Sequence]) -> Group:
        """Give these sequences (one prompt length; several only without prefix caching) their store and their
        body's prefill job: all prompt tokens but the last, in the configured mode, fed over the next steps. The
        last token runs as a decode row (all layers) and yields the first sampled token; the state after N-1
        tokens is the end-of-prompt unit that prefix caching stores, so a repeated prompt resumes exactly there.

        With prefix caching (docs/system.md §4): the longest persistent hit U is restored; with its SWA snapshot the
        prefill continues exactly (swa-hit), without it the last n_win cached tokens are replayed through the
        layers for window KV only (replay)."""
        g, seq = Group(list(seqs), vision=seqs[0].vision is not None), seqs[0]
        ids, start, replay = seq.prompt_ids, 0, 0
        for s in seqs:
            s.sid, s.group = self.pool.new_sequence(), g
        if len({len(s.prompt_ids) for s in seqs}) > 1:    # fresh text prompts of different lengths (grouped only
            for s in seqs:                                 # without prefix caching, so no hit to look up)
                s.fed = 0
            g.job = BodyBatch(self.model, {s.sid: torch.tensor(s.prompt_ids[:-1], device=self.device) for s in seqs},
                              self.pool, self.prefill_mode)
            return g
        hit = prefix_hit(self, seq)
        if hit is not None:
            start = hit.boundary
            hit.restore(seq.sid)
            if hit.swa_state is not None:
                self.pool.import_swa(seq.sid, hit.swa_state)
            else:
                replay = min(self.cfg.window_size, start)
            seq.cache_path, seq.cached_tokens, seq.cached_tiers = hit.path, hit.boundary, dict(hit.tiers)
        sids = [s.sid for s in seqs]
        view = self.pool.bind(sids)
        if replay and self.model.engram_hasher is not None:
            from dsv41.kv.prefix import engram_history_at
            view.engram_history = engram_history_at(self.model.engram_hasher, ids, start - replay).view(1, -1)
        if len(ids) > 1 + start:
            body = torch.tensor([s.prompt_ids[start - replay:-1] for s in seqs], device=self.device)
            g.job = (ImageBody(self.model, body, seq.vision) if g.vision else
                     PrefillJob(self.model, body, view, self.prefill_mode, replay=replay))
        self.pool.release(view, sids)
        for s in seqs:
            s.fed = start
        return g

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's store; it waits again (in arrival order) and is recomputed from its prompt and its
        generated tokens when admitted again (its sampled tokens are kept, so it continues with the same output)."""
        self.pool.free(seq.sid)
        if self.device_tier is not None:
            self.device_tier.forget(seq.sid)
        seq.sid, seq.group, seq.fed = None, None, 0
        seq.preemptions += 1
        self.waiting.insert(sum(1 for w in self.waiting if w.arrival < seq.arrival), seq)

    def _feed_body(self, g: Group, n: int) -> None:
        """The next n tokens of each row's prompt body; at its end the mode's remaining dataflow, the drafter
        seeded with its taps, the end-of-prompt unit saved."""
        t0 = time.perf_counter()
        sids = [s.sid for s in g.seqs]
        if isinstance(g.job, BodyBatch):
            self._feed_body_batch(g, n, t0)
            return
        view = self.pool.bind(sids)
        g.job.feed(view, n, self.chunk_size)
        if not g.job.remaining:
            pf = g.job.finish(view)
            if self.drafter is not None and pf is not None and pf.main_hidden is not None:
                self.drafter.seed(view, pf.main_hidden, pf.tap_start)
            g.job = None
        self.pool.release(view, sids)
        for s in g.seqs:
            if g.job is None:
                s.fed = len(s.prompt_ids) - 1
                self._save_unit(s, s.prompt_ids[:-1])
            s.prefill_s += time.perf_counter() - t0

    def _feed_body_batch(self, g: Group, n: int, t0: float) -> None:
        """`_feed_body` for prompts of different lengths (`BodyBatch`): a row whose body is fed finishes at once
        and leaves the group for a group of its own, so it decodes while the longer bodies go on."""
        done = g.job.feed(n, self.chunk_size)
        if done:
            seed = None
            if self.drafter is not None:
                def seed(view, pf):
                    if pf.main_hidden is not None:
                        self.drafter.seed(view, pf.main_hidden, pf.tap_start)
            g.job.finish(done, seed)
        dt = time.perf_counter() - t0
        for s in list(g.seqs):
            s.prefill_s += dt
            if s.sid in done:
                s.fed = len(s.prompt_ids) - 1
                self._save_unit(s, s.prompt_ids[:-1])
                g.seqs.remove(s)
                s.group = Group([s])
        if not g.seqs:
            g.job = None

    def _feed_tail(self, seq: Sequence, n: int, outs: list[StepOutput]) -> None:
        """The next n tokens after the body (all layers): the prompt's last token and, when the sequence resumes
        after a preemption, its generated tokens; the last of a fresh prompt's yields its first sampled token."""
        t0 = time.perf_counter()
        ids = (seq.prompt_ids + seq.output_ids)[seq.fed:seq.fed + n]
        view = self.pool.bind([seq.sid])
        for lo in range(0, n, self.chunk_size or n):
            start = view.pos.clone()
            out = self.model(torch.tensor([ids[lo:lo + (self.chunk_size or n)]], device=self.device), view,
                             last_only=True)
            if self.drafter is not None and out.main_hidden is not None:
                self.drafter.seed(view, out.main_hidden[:, -self.cfg.window_size:],
                                  start + max(0, out.main_hidden.size(1) - self.cfg.window_size))
        self.pool.release(view, [seq.sid])
        seq.fed += n
        if seq.fed == target(seq) and seq.pending is None:
            self._first_token(seq, out.logits[0, -1], outs)
        seq.prefill_s += time.perf_counter() - t0

    def _first_token(self, seq: Sequence, logits: torch.Tensor, outs: list[StepOutput]) -> None:
        seq.pending = sample_token(logits, seq.params, seq.gen)
        seq.t_first_token = time.perf_counter()
        outs.append(self._emit(seq, [seq.pending], logits.view(1, -1)))

    def _save_unit(self, seq: Sequence, fed: list[int]) -> None:
        """Persist the sequence's state after `fed` tokens (end of prompt / end of output); never fails a request."""
        if self.prefix_cache is None or seq.vision is not None or len(fed) <= self.cfg.window_size:
            return
        try:
            salt = seq.params.cache_salt
            g = self.pool.export_global(seq.sid, len(fed), start=self.prefix_cache.export_start(fed, len(fed), salt))
            self.prefix_cache.save(fed, len(fed), g, self.pool.export_swa(seq.sid), salt=salt)
            if self.device_tier is not None:                  # what resuming here from the pool's pages needs
                self.device_tier.note(seq.sid, len(fed), {ls.layer: (ls.carry_kv, ls.carry_score)
                                                          for ls in g.layers if ls.carry_kv.size(0)},
                                      g.engram_history)
        except (ValueError, OSError) as e:                    # storage problems are misses, not failures
            self.prefix_cache._log_once("save", "prefix cache save skipped: %s", e)

    def _decode(self, seqs: list[Sequence], join: list[Sequence], drafts: int, outs: list[StepOutput]) -> None:
        """One batched decode step for the running rows, or one draft-verify step (at most `drafts` drafts a row)
        with speculative decoding; `join`: rows feeding their last prompt (or recomputed) token in the same
        forward (without speculation)."""
        live = [s for s in seqs if not s.finish_reason]
        rows = live + join
        if not rows:
            return
        t0 = time.perf_counter()
        seed_s = None
        sids = [s.sid for s in rows]
        view = self.pool.bind(sids)
        spec_step = self.drafter is not None and self._drafting_pays(live, drafts)
        if not spec_step:
            n_tokens, vmax = len(rows), None
            ids = torch.tensor([[(s.prompt_ids + s.output_ids)[s.fed]] for s in rows], device=self.device)
            pos = view.pos.clone()
            g = self.graphs
            out = g.forward(ids, view) if g is not None and g.applies(view) else self.model(ids, view, last_only=True)
            logits = out.logits[:, -1]
            for b, s in enumerate(live):
                s.pending = sample_token(logits[b], s.params, s.gen)
                before = len(s.output_ids)
                outs.append(self._emit(s, [s.pending], logits[b:b + 1]))
                if self.drafter is not None:                      # a step decoded without drafts: length 0
                    s.verify_lengths[0] = s.verify_lengths.get(0, 0) + 1
                    s.predicted_tokens += 1.0
                    s.realised_tokens += len(s.output_ids) - before
            for b, s in enumerate(join, len(live)):
                s.fed += 1
                if s.pending is None:
                    self._first_token(s, logits[b], outs)
            if (self.drafter is not None and out.main_hidden is not None     # a step without drafts: the drafter
                    and not all(s.drafter_off for s in rows)):                 # still sees its taps (unless no row
                t_seed = time.perf_counter()                                   # drafts again: its cost skipped),
                self.drafter.seed(view, out.main_hidden, pos)                  # timed after sampling synchronised
                seed_s = time.perf_counter() - t_seed                          # the device (its launches, on a GPU)
        else:
            n_tokens, vmax = self._verify(view, live, outs, drafts)
        self.pool.release(view, sids)
        dt = time.perf_counter() - t0
        if seed_s is not None and live and not join:        # what keeping the drafter seeded costs a plain step
            sc = self.spec_counts
            sc["seeded_steps"] += 1
            sc["seeded_s"] += dt
            sc["seed_s"] += seed_s
        if self.step_cost is not None and live and not join:     # the cost model's prediction vs this step
            B = len(live)
            pred = spec_cost(self.step_cost, B)(n_tokens, vmax) if spec_step else plain_cost(self.step_cost, B)
            sc = self.spec_counts
            sc["timed_steps"] += 1
            sc["predicted_s"] += pred
            sc["realised_s"] += dt
            self.last_step_cost = (pred, dt)
        if isinstance(self.step_cost, MeasuredCost) and live and not join:
            self.step_cost.record(n_tokens, dt, batch=len(live), plain=not spec_step,
                                  vmax=vmax if spec_step else None)
        for s in live:
            s.fed = target(s)
            s.decode_s += dt
            s.target_steps += 1
        for s in join:
            s.prefill_s += dt

    def _drafting_pays(self, live: list[Sequence], drafts: int) -> bool:
        """Whether this step drafts (proposes and verifies) or decodes plainly (one token a row, the drafter's cost
        skipped: never slower than no speculation). Fixed lengths always draft (fixed:0 never). The dspark scheduler
        compares, with its cost model (`spec_cost` / `plain_cost` at this batch: the profile, or what the engine
        measured with dspark:online), B / T_plain(B) against the best verify length: first at acceptance 1 (when
        even drafts that are always accepted do not pay, as at loaded batches where the forward's cost grows with
        its tokens or on a GPU whose plain steps replay CUDA graphs while verifies run eagerly, it does not draft;
        when not even a whole block would pay, the rows stop drafting for good), then, once `MIN_EVIDENCE` first
        drafts were verified, at the acceptance measured so far per draft position; while that says no, it drafts
        again every `PROBE_EVERY`-th such step so that a drafter doing better is noticed, as long as keeping the
        drafter seeded for those probes costs at most `SEED_SHARE` of a plain step (measured over `SEED_EVIDENCE`
        seeded steps: on a GPU the eager seeding doubled a graph-replayed step, 2026-12-08); above it the rows
        stop drafting for good (issue 28: never slower than off). A closed batch (nobody waiting, every row's end
        known: `_closed_remaining`) is judged by when its last row is done instead (`closed_batch_times`, each row
        at its own measured acceptance, `row_acceptance`), once `CLOSED_EVIDENCE` first drafts were verified: it
        drafts only while some verify length is predicted to end the batch sooner than plain decoding; when none
        is, its rows stop drafting for good (`Sequence.drafter_off`: no proposal, no probe, and no seeding once
        every row of a step is off; issue 28: at batch 32 the per-step objective verified, the low-acceptance
        rows straggled, and the batch ended later than off's)."""
        if drafts == 0 or self.speculation.mode == "fixed" and self.speculation.n == 0 \
                or all(s.drafter_off for s in live):
            return False
        if self.speculation.mode != "dspark":
            return True
        B = len(live)
        room = [0 if s.drafter_off else max(0, s.params.max_tokens - len(s.output_ids) - 1) for s in live]
        caps = [min(drafts, r) for r in room]
        cost, plain = spec_cost(self.step_cost, B), plain_cost(self.step_cost, B)
        G = self.cfg.dspark_block_size
        sc = self.spec_counts
        if max(choose_verify_lengths(torch.ones(B, G), cost, caps, ragged=True, plain=plain, by_longest=True)) == 0:
            full = [min(G, r) for r in room]                   # the step's budget aside: a whole block a row
            if max(choose_verify_lengths(torch.ones(B, G), cost, full, ragged=True, plain=plain, by_longest=True)) == 0:
                self._stop_drafting(live, "stopped_never_pays")   # not even a whole block, always accepted, pays
            return False                                   # no acceptance could make a verify pay here
        if sc["reached"][0] < MIN_EVIDENCE:
            return True
        rates = [a / r if r else 0.0 for a, r in zip(sc["accepted"], sc["reached"])]
        remaining = self._closed_remaining(live) if sc["reached"][0] >= CLOSED_EVIDENCE else None
        if remaining is not None:                          # nobody waits: the batch ends with its slowest row
            m = self._shrinkage(live)
            acc = torch.tensor([row_acceptance(s.draft_reached, s.draft_accepted, rates, m) for s in live])
            times = closed_batch_times(remaining, acc, lambda b: plain_cost(self.step_cost, b),
                                       lambda b, v: spec_cost(self.step_cost, b)(b * (1 + v), v), min(drafts, G))
            best = min(range(1, len(times)), key=times.__getitem__, default=0)
            pays = len(times) > 1 and times[best] < times[0]
            sc["closed_spec" if pays else "closed_plain"] += 1
            if not pays:                                   # nothing changes while it decodes plainly (its rows'
                for s in live:                             # ends come closer alike): the rows stop drafting and
                    s.drafter_off = True                   # seeding for good (a row admitted later drafts)
            return pays
        S = torch.tensor(rates).cumprod(0).expand(B, -1)
        if max(choose_verify_lengths(S, cost, caps, ragged=True, plain=plain, by_longest=True)) > 0:
            self._skipped = 0
            return True
        if sc["seeded_steps"] >= SEED_EVIDENCE and sc["seed_s"] > SEED_SHARE * sc["seeded_s"]:
            self._stop_drafting(live, "stopped_seeding_cost")     # staying ready to probe costs more than SEED_SHARE
            return False
        self._skipped += 1
        return self._skipped % PROBE_EVERY == 0

    def _stop_drafting(self, live: list[Sequence], why: str) -> None:
        """The rows stop drafting for good (`Sequence.drafter_off`: no proposal, no probe, no seeding once every row
        of a step is off; a row admitted later drafts), counted under `why` in `spec_counts`."""
        for s in live:
            s.drafter_off = True
        self.spec_counts[why] += 1

    def _shrinkage(self, live: list[Sequence]) -> float:
        """How strongly each row's measured acceptance is pulled to the batch's (`shrinkage_strength` over the
        rows' first drafts)."""
        first = [(s.draft_reached[0], s.draft_accepted[0]) for s in live if s.draft_reached]
        return shrinkage_strength([n for n, _ in first], [a for _, a in first])

    def _closed_remaining(self, live: list[Sequence]) -> list[int] | None:
        """Each row's remaining tokens when this batch is closed and its lengths known: no request waits for a
        row's place, and every row ends at its max_tokens (ignore_eos or no EOS, no stop strings or ids); else None
        (a finished row is replaced, or ends at a stop nobody can predict: the per-step objective holds there)."""
        if self.waiting:
            return None
        eos = self.tokenizer.eos_id
        if any(s.params.stop or s.params.stop_token_ids or (eos is not None and not s.params.ignore_eos)
               for s in live):
            return None
        return [s.params.max_tokens - len(s.output_ids) for s in live]

    def _verify_lengths(self, S: torch.Tensor, live: list[Sequence], caps: list[int]) -> list[int]:
        """Each row's verify length: fixed:N's N (fewer where its cap allows fewer), or the confidence scheduler's
        per-row lengths on the prefix survivals S, priced by the step's tokens and its longest row (`profile_step`
        sets this on an engine to force a shape)."""
        if self.speculation.mode == "fixed":
            return [min(self.speculation.n, c) for c in caps]
        B = len(live)
        step = spec_cost(self.step_cost, B)
        v = choose_verify_lengths(S, step, caps, ragged=True, by_longest=True)
        remaining = self._closed_remaining(live)
        if remaining is None or max(caps, default=0) == 0:
            return v
        sc, G = self.spec_counts, S.size(1)          # a closed batch: the lengths that end it soonest
        head = (S[:, :G] / torch.cat([torch.ones(B, 1, dtype=S.dtype), S[:, :G - 1]], 1).clamp_min(1e-12)).mean(0)
        prior = [a / r if r else float(h) for a, r, h in zip(sc["accepted"], sc["reached"], head)]
        m = self._shrinkage(live)
        acc = torch.tensor([row_acceptance(s.draft_reached, s.draft_accepted, prior, m) for s in live])
        uniform = [[min(u, c) for c in caps] for u in range(1, max(caps) + 1)]
        return closed_batch_lengths(S, remaining, acc, step, lambda b: plain_cost(self.step_cost, b),
                                    lambda b, u: spec_cost(self.step_cost, b)(b * (1 + u), u), [v] + uniform)

    def _verify(self, view, live: list[Sequence], outs: list[StepOutput], drafts: int) -> tuple[int, int]:
        """One draft-verify step for every row of `view` (`dsv41.engine.speculative`): each row r verifies its own
        v_r drafts (`_verify_lengths`) in ONE ragged forward over the rows' 1 + v_r tokens, no row padded to the
        longest (`ForwardOptions.lengths`); -> (tokens the forward ran, the longest row's drafts)."""
        pos = view.pos.clone()
        prop = self.drafter.propose(view, live, pos)
        G = prop.tokens.size(1)
        # drafts that could be emitted: the step's budget, the proposal, the request's remaining tokens
        caps = [0 if s.drafter_off else max(0, min(drafts, G, s.params.max_tokens - len(s.output_ids) - 1))
                for s in live]
        S = prop.survival(self.calibration)
        vs = self._verify_lengths(S, live, caps)
        V = max(vs)
        lengths = torch.tensor([1 + v for v in vs])
        ids = torch.cat([torch.tensor([[s.pending] for s in live]), prop.tokens[:, :V]], dim=1)
        ids = ids.masked_fill(torch.arange(1 + V).view(1, -1) >= lengths.view(-1, 1), 0).to(self.device)
        journal = VerifyJournal(self.model, view, pos, 1 + V)
        out = self.model(ids, view, opts=ForwardOptions(journal=journal.model_journal, lengths=lengths))
        keep, sc = [], self.spec_counts
        for b, s in enumerate(live):
            v = vs[b]
            q = None if prop.q[b] is None else prop.q[b][:v]
            n, nxt = accept_drafts(out.logits[b, :v + 1], prop.tokens[b, :v].tolist(), q, s.params, s.gen)
            toks = prop.tokens[b, :n].tolist() + [nxt]
            before = len(s.output_ids)
            outs.append(self._emit(s, toks, out.logits[b]))
            keep.append(1 + min(n, len(s.output_ids) - before))      # fed tokens whose output was emitted
            s.pending, s.drafted, s.accepted = nxt, s.drafted + v, s.accepted + n
            s.verify_lengths[v] = s.verify_lengths.get(v, 0) + 1
            s.predicted_tokens += 1.0 + float(S[b, :v].sum())
            s.realised_tokens += len(s.output_ids) - before
            if len(s.draft_reached) < G:
                s.draft_reached += [0] * (G - len(s.draft_reached))
                s.draft_accepted += [0] * (G - len(s.draft_accepted))
            for k in range(min(v, n + 1)):
                sc["reached"][k] += 1
                sc["accepted"][k] += int(k < n)
                s.draft_reached[k] += 1
                s.draft_accepted[k] += int(k < n)
                if self.calibration is not None:
                    self.calibration.update(k, float(prop.accept[b, k]), k < n)
            sc["row_steps"] += 1
            sc["tokens"] += len(s.output_ids) - before
        sc["forwards"] += 1
        keep_t = torch.tensor(keep)
        journal.rollback(self.model, view, ids, keep_t)
        if out.main_hidden is not None:
            self.drafter.seed(view, out.main_hidden, pos, keep_t)
        return int(lengths.sum()), V

    def _emit(self, seq: Sequence, new_ids: list[int], logits: torch.Tensor) -> StepOutput:
        """Account the tokens of this step in order, applying stop conditions (tokens after a stop are dropped),
        and return the new text (held back while it ends in an incomplete UTF-8 sequence or could still become
        a stop string); logits[k] is the distribution new_ids[k] was drawn from (for the top log-probabilities
        when the request asked for them)."""
        p = seq.params
        eos = self.tokenizer.eos_id
        stop_ids = set(p.stop_token_ids) | ({eos} if eos is not None and not p.ignore_eos else set())
        emitted = []
        for tok in new_ids:
            if tok in stop_ids:
                seq.finish_reason = "stop"
                break
            seq.output_ids.append(tok)
            emitted.append(tok)
            seq.text = self.tokenizer.decode(seq.output_ids)
            for st in p.stop:
                i = seq.text.find(st)
                if i >= 0:
                    seq.text = seq.text[:i]
                    seq.finish_reason = "stop"
            if not seq.finish_reason and len(seq.output_ids) >= p.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        n = p.logprobs
        emitted_lps = [] if n is None else [top_logprobs(logits[k], t, n) for k, t in enumerate(emitted)]
        seq.logprobs.extend(emitted_lps)
        tails = [int(seq.text.endswith("\ufffd"))] + [partial_suffix(seq.text, st) for st in p.stop]
        upto = len(seq.text) - (0 if seq.finish_reason else max(tails))     # a partial stop string may complete
        delta = seq.text[seq.emitted:upto]
        seq.emitted = max(seq.emitted, upto)
        return StepOutput(seq.request_id, emitted, delta, seq.finish_reason is not None, seq.finish_reason,
                          emitted_lps)

    def _release(self, seq: Sequence) -> None:
        if seq.sid is not None and seq.finish_reason in ("stop", "length") and self.prefix_cache is not None:
            fed = int(self.pool.seq_bytes(seq.sid)["tokens"])          # tokens run through the model so far
            self._save_unit(seq, (seq.prompt_ids + seq.output_ids)[:fed])
        if seq.sid is not None:
            seq.kv = self.pool.seq_bytes(seq.sid)
            if self.device_tier is not None and seq.finish_reason in ("stop", "length") and seq.vision is None:
                fed = int(seq.kv["tokens"])
                self.device_tier.retain(seq.sid, (seq.prompt_ids + seq.output_ids)[:fed], seq.params.cache_salt)
            else:
                self.pool.free(seq.sid)
                if self.device_tier is not None:
                    self.device_tier.forget(seq.sid)
            seq.sid = None

    # ---------------------------------------------------------------- conveniences
    def completion(self, request_id: str) -> Completion:
        s = self.finished[request_id]
        stats = {"prompt_tokens": len(s.prompt_ids), "generated_tokens": len(s.output_ids),
                 "prefill_mode": self.prefill_mode, "prefill_s": s.prefill_s, "decode_s": s.decode_s,
                 "ttft_s": (s.t_first_token or s.t_arrival) - s.t_arrival, "kv_bytes": s.kv,
                 "cache_path": s.cache_path, "cached_tokens": s.cached_tokens, "cached_tokens_by_tier": s.cached_tiers,
                 "preemptions": s.preemptions,
                 "speculative": {"mode": str(self.speculation), "drafted_tokens": s.drafted,
                                 "accepted_tokens": s.accepted, "target_forwards": s.target_steps,
                                 "verify_lengths": dict(sorted(s.verify_lengths.items())),
                                 "predicted_tokens": s.predicted_tokens, "realised_tokens": s.realised_tokens}}
        return Completion(s.request_id, s.prompt_ids, s.output_ids, s.text, s.finish_reason, stats, s.logprobs)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, copy.deepcopy(sp)) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [self.completion(r) for r in rids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        rid = self.add_request(prompt, params)
        while True:                                     # the step that finishes the request emits its last output
            for o in self.step():
                if o.request_id == rid:
                    yield o
                    if o.finished:
                        return


class ImageBody:
    """An image prompt's body as a prefill job: one full-mode forward with its image records (the spans must be in
    the first chunk, so it is never split)."""

    def __init__(self, model, body: torch.Tensor, vision: tuple):
        self.model, self.body, self.vision, self.remaining = model, body, vision, body.size(1)

    def feed(self, view, n: int, chunk_size: int | None = None) -> None:
        assert n == self.remaining, "an image body runs whole"
        types = self.vision[1][None, :n].to(self.body.device)
        self.model(self.body, view, opts=ForwardOptions(images=[self.vision[0]], token_types=types), last_only=True)
        self.remaining = 0

    def finish(self, view) -> None:
        return None


def partial_suffix(text: str, s: str) -> int:
    """Characters at the end of `text` that could still grow into `s`: the longest proper prefix of s it ends
    with (streamed text holds them back)."""
    return next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)


def weights_fingerprint(model) -> str:
    """A content hash of the weights (a strided sample of every parameter), so caches of different checkpoints
    with the same config never mix."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu().contiguous()
        h.update(name.encode() + sample.numpy().tobytes())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tok) -> str:
    probe = "The quick brown fox 0123 { } \u00e9\u4e2d"
    return hashlib.sha256(f"{type(tok).__name__}:{tok.vocab_size}:{tok.encode(probe)}".encode()).hexdigest()[:32]

