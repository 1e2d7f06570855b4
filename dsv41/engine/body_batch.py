"""Prompt bodies of different lengths prefilled together (docs/system.md §3).

The model's forward runs the same number of tokens T on every row, the rows at their own positions. Prompts of one
length prefill as one batch (`PrefillJob` over [B,N]); prompts of different lengths each had a forward of their
own, so B waiting prompts cost B forwards, and an eager forward's cost on a GPU is mostly its kernel launches,
whatever its T. Here each row keeps its own `PrefillJob` (its own tail rows and drafter taps) and a step's tokens
are fed in few forwards over several rows each: with a_b tokens for row b in this step,

  aligned   every row's first min(a) tokens in one forward, then the rows still short of their a_b the next
            distinct amount, and so on: as many forwards as distinct amounts;
  binary    min(a) in one forward, then each row's remainder a_b - min(a) by its binary digits, largest first:
            one forward per digit that some row has (at most 1 + log2(max a - min a) forwards, any number of rows);

whichever takes fewer forwards (a single amount: one forward, as a batch of one length). Each row's pieces stay in
its position order, so every row sees what a prefill of its own chunks sees (chunked prefill gives the one-shot
result, docs/model.md §1): in the deterministic mode the same bits as the prompt alone; otherwise the same
function, in the GEMMs' order for that batch.

A row whose body is fed finishes as soon as it is (the CED decoder segment: rows of one decoder shape in one
forward), and leaves the batch; the others go on.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv41.engine.prefill import (MODES, PrefillJob, _encode_piece, _finish_full, _prefill_ced,
                                  check_ced, decoder_rows)
from dsv41.model.step import ForwardOptions


def forward_plan(amounts: list[int]) -> list[tuple[int, list[int]]]:
    """(T, rows) forwards that feed row b exactly amounts[b] tokens (rows with 0 take none), each row's pieces in
    order; the fewer of the aligned and the binary plan (module docstring)."""
    live = [b for b, a in enumerate(amounts) if a > 0]
    if not live:
        return []
    lo = min(amounts[b] for b in live)
    aligned, done = [], 0
    for a in sorted({amounts[b] for b in live}):
        aligned.append((a - done, [b for b in live if amounts[b] >= a]))
        done = a
    binary = [(lo, live)]
    rest = {b: amounts[b] - lo for b in live}
    top = max(rest.values()).bit_length()
    for bit in range(top - 1, -1, -1):
        rows = [b for b in live if rest[b] >> bit & 1]
        if rows:
            binary.append((1 << bit, rows))
    return aligned if len(aligned) <= len(binary) else binary


class BodyBatch:
    """The bodies (all prompt tokens but the last) of fresh text prompts of different lengths, keyed by their
    sequence ids in the pool: `feed` runs the next tokens of each, `finish` the rows whose bodies are fed."""

    def __init__(self, model, bodies: dict[int, torch.Tensor], pool, mode: str = "ced-bounded"):
        if mode not in MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; choose one of {', '.join(MODES)}")
        self.model, self.pool, self.mode = model, pool, mode
        self.jobs: dict[int, PrefillJob] = {}
        for sid, ids in bodies.items():
            view = pool.bind([sid])
            if int(view.pos.max()) != 0:
                pool.release(view, [sid])
                raise ValueError("a body batch holds fresh sequences only")
            self.jobs[sid] = PrefillJob(model, ids.view(1, -1), view, mode)
            pool.release(view, [sid])

    @property
    def remaining(self) -> int:
        """Tokens the longest unfinished body still has to feed."""
        return max((j.remaining for j in self.jobs.values()), default=0)

    def remaining_of(self, sid: int) -> int:
        return self.jobs[sid].remaining

    @torch.no_grad()
    def feed(self, n: int, chunk_size: int | None = None) -> list[int]:
        """Each body's next min(n, what it has left) tokens, in the forwards `forward_plan` picks (pieces of at most
        chunk_size); returns the sequence ids whose bodies are now fed."""
        sids = list(self.jobs)
        for T, rows in forward_plan([min(n, self.jobs[s].remaining) for s in sids]):
            for t0 in range(0, T, chunk_size or T):
                self._forward([sids[b] for b in rows], min(T - t0, chunk_size or T))
        return [s for s in sids if not self.jobs[s].remaining]

    def _forward(self, sids: list[int], T: int) -> None:
        jobs = [self.jobs[s] for s in sids]
        part = torch.cat([j.ids[:, j.fed:j.fed + T] for j in jobs])
        view = self.pool.bind(sids)
        if self.mode == "full":
            start = view.pos.clone()
            out = self.model(part, view, last_only=True)
            for b, j in enumerate(jobs):
                j.out = dataclasses.replace(out, logits=out.logits[b:b + 1])
                if out.main_hidden is not None:
                    j.full_taps.append(out.main_hidden[b:b + 1])
                    j.tap_start = start[b:b + 1] if j.tap_start is None else j.tap_start
        else:
            split = check_ced(self.model.cfg)
            outs = []
            for b, j in enumerate(jobs):
                N = j.ids.size(1)
                R0 = decoder_rows(self.model.cfg, self.mode, N)[0]
                outs.append((slice(b, b + 1), min(T, max(0, R0 - (N - j.fed - T))), j.tail, j.taps))
            _encode_piece(self.model, part, view, split, ForwardOptions(), outs)
        self.pool.release(view, sids)
        for j in jobs:
            j.fed += T

    @torch.no_grad()
    def finish(self, sids: list[int], seed=None) -> None:
        """The rest of the mode's dataflow for these fed bodies, which leave the batch (CED: one decoder segment per
        set of rows of one decoder shape; full: nothing to run). seed(view, PrefillOut): called for each such set
        while its rows are bound (the drafter's seeding; the PrefillOut's `rows` are those of its first row)."""
        if self.mode == "full":
            for s in sids:
                pf = _finish_full(self.jobs.pop(s))
                if seed is not None:
                    view = self.pool.bind([s])
                    seed(view, pf)
                    self.pool.release(view, [s])
            return
        shapes: dict[tuple, list[int]] = {}
        for s in sids:
            shapes.setdefault(tuple(decoder_rows(self.model.cfg, self.mode, self.jobs[s].ids.size(1))), []).append(s)
        for group in shapes.values():
            jobs = [self.jobs.pop(s) for s in group]
            parts = [j.decoder_inputs() for j in jobs]
            x, pre = (torch.cat([p[i] for p in parts]) for i in (0, 1))
            hashes = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
            taps = {L: torch.cat([p[3][L] for p in parts]) for L in parts[0][3]}
            view = self.pool.bind(group)
            pf = _prefill_ced(self.model, jobs[0].ids.size(1), view, self.mode, x, pre, hashes, taps, False)
            if seed is not None:
                seed(view, pf)
            self.pool.release(view, group)
