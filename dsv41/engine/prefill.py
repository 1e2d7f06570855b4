"""Prefill modes of the causal encoder-decoder (CED) dataflow (docs/system.md §2).

  full         every layer on every prompt token: what the official code computes; the speed baseline.
  ced-exact    encoder (layers below the split) on every token; the decoder's KV source produces its global KV
               on every token; decoder layers run only on the rows the layers above still need (a dependency
               halo growing by W-1 per layer: W + (D-1-k)(W-1) rows for decoder layer k of D). Equals `full` up
               to floating-point order (the oracle for the approximation).
  ced-bounded  the design: decoder layers run only on the last n_win = W prompt tokens, their sliding window
               truncated at the replay start (Decoder SWA Bounded Replay). An approximation, measured.

Legend: B batch, N prompt tokens of this call, S streams, D width, R rows a decoder layer runs on.

Chunked prefill: the encoder (and the split layer's KV production) runs chunk by chunk; the encoder output of
the tail rows the decoder needs is buffered and the decoder runs once at the end, so every chunking gives the
one-shot result of the same mode.

Continuation and replay (prefix caching, docs/system.md §4): a prefill may start where a restored store stands.
With the SWA state restored too (an exact resume) the windows of earlier positions are valid and are used.
Without it, `replay` tokens before the restored position are run again through the layers to regenerate
window KV only (their global KV is reused, never recomputed or overwritten) and every sliding window is
truncated at the replay start: Encoder SWA Bounded Replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.config import ced_split, layer_roles
from dsv41.kernels.mhc_math import hc_pre
from dsv41.model.step import ForwardOptions, Publications, StepContext

MODES = ("full", "ced-exact", "ced-bounded")


@dataclass
class PrefillOut:
    logits: torch.Tensor                       # [B,V] fp32 logits of the last prompt position
    main_hidden: torch.Tensor | None           # DSpark taps of the last rows [B,Rt,taps*D] (to seed the drafter)
    tap_start: torch.Tensor | None             # [B] position of main_hidden's first row
    rows: dict[int, int] = field(default_factory=dict)   # layer -> prompt rows it ran on (this call)


def check_ced(cfg) -> int:
    """The split layer, or ValueError when this config admits no CED skip: every layer from the split up must
    read global KV, top-k and candidates produced at or above the split (docs/system.md §2)."""
    split = ced_split(cfg)
    if split is None:
        raise ValueError("config has no KV source layers, so no causal encoder-decoder split: use prefill mode 'full'")
    for r in layer_roles(cfg)[split:]:
        for src in (r.kv_from, r.topk_from, r.candidates_from):
            if src is not None and src < split:
                raise ValueError(f"layer {r.layer} reads state of layer {src} below the CED split {split}: "
                                 "this config has no valid CED skip; use prefill mode 'full'")
    return split


def decoder_rows(cfg, mode: str, n_prompt: int) -> list[int]:
    """Rows each decoder layer (split..L-1) runs on for a prompt of n_prompt tokens."""
    split, W = check_ced(cfg), cfg.window_size
    D = cfg.n_layers - split
    if mode == "ced-bounded":
        return [min(W, n_prompt)] * D
    if mode == "ced-exact":
        return [min(n_prompt, W + (D - 1 - k) * (W - 1)) for k in range(D)]
    raise ValueError(f"prefill mode {mode!r} has no decoder segment")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, mode: str = "ced-bounded", chunk_size: int | None = None,
            replay: int = 0) -> PrefillOut:
    """Prefill `input_ids` [B,N] from where `cache` stands, in `mode`, optionally in chunks.

    replay > 0: the first `replay` tokens of input_ids are the last tokens of the restored prefix (positions
    cache.pos - replay ..): re-run for window KV only, with every window truncated at their start."""
    job = PrefillJob(model, input_ids, cache, mode, replay)
    job.feed(cache, input_ids.size(1), chunk_size)
    return job.finish(cache)


class PrefillJob:
    """One prefill fed in parts across calls (the engine's scheduler interleaves a long prompt's chunks with decode
    steps): `feed` runs the next tokens, `finish` the rest of the mode's dataflow once all are fed. Between calls
    the state lives in the store (global KV, rings, position; bind it again for each call) and here (the tail rows
    the CED decoder needs, the drafter taps), so every split into parts gives the result of one `prefill` call."""

    def __init__(self, model, input_ids: torch.Tensor, cache, mode: str = "ced-bounded", replay: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; choose one of {', '.join(MODES)}")
        N = input_ids.size(1)
        if N == 0:
            raise ValueError("empty prompt")
        if not 0 <= replay <= N or replay > int(cache.pos.min()):
            raise ValueError(f"replay of {replay} tokens needs a restored prefix at least that long")
        self.model, self.ids, self.mode, self.replay, self.fed = model, input_ids, mode, replay, 0
        self.floor = None
        if replay:
            cache.pos = cache.pos - replay
            self.floor = cache.pos.clone()
        self.rings_valid = replay == 0 and int(cache.pos.min()) > 0
        self.tail: dict[str, list[torch.Tensor]] = {"x": [], "pre": [], "hash": []}
        self.taps: dict[int, list[torch.Tensor]] = {}
        self.full_taps: list[torch.Tensor] = []
        self.tap_start, self.out = None, None

    @property
    def remaining(self) -> int:
        return self.ids.size(1) - self.fed

    @torch.no_grad()
    def feed(self, cache, n: int, chunk_size: int | None = None) -> None:
        """Run the next n tokens (pieces of at most chunk_size) into `cache`."""
        chunk = chunk_size or n
        if chunk <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk_size}")
        if not 0 < n <= self.remaining:
            raise ValueError(f"feed of {n} tokens: {self.remaining} remain")
        pieces = _chunks(self.fed, self.fed + n, chunk, self.replay, self.floor)
        self.fed += n
        if self.mode == "full":
            _feed_full(self, cache, pieces)
        else:
            split = check_ced(self.model.cfg)
            _encode(self.model, self.ids, cache, split, decoder_rows(self.model.cfg, self.mode, self.ids.size(1))[0],
                    pieces, self.tail, self.taps)

    @torch.no_grad()
    def finish(self, cache) -> PrefillOut:
        if self.remaining:
            raise ValueError(f"prefill not fed to the end: {self.remaining} tokens remain")
        if self.mode == "full":
            return _finish_full(self)
        return _prefill_ced(self.model, self.ids.size(1), cache, self.mode, *self.decoder_inputs(), self.rings_valid)

    def decoder_inputs(self) -> tuple:
        """What the CED decoder segment starts from: the encoder's tail rows x [B,R0,S,D], their lagged pre
        [B,R0,S] and Engram hashes (or None), and the encoder-side drafter taps {layer: [B,<=W,D]}."""
        W = self.model.cfg.window_size
        tail = self.tail
        return (torch.cat(tail["x"], 1), torch.cat(tail["pre"], 1),
                torch.cat(tail["hash"], 1) if tail["hash"] else None,
                {L: torch.cat(v, 1)[:, -W:] for L, v in self.taps.items()})


def _chunks(lo: int, hi: int, chunk: int, replay: int, floor) -> list[tuple[int, int, ForwardOptions]]:
    """(lo, hi, options) pieces of positions lo..hi of the call: replayed rows never produce global KV, so they
    form their own chunks."""
    return [(a0, min(b, a0 + chunk), ForwardOptions(window_floor=floor, produce_kv=produce))
            for a, b, produce in ((lo, min(hi, replay), False), (max(lo, replay), hi, True))
            for a0 in range(a, b, chunk)]


def _feed_full(job: PrefillJob, cache, pieces) -> None:
    for lo, hi, opts in pieces:
        start = cache.pos.clone()
        job.out = job.model(job.ids[:, lo:hi], cache, opts=opts, last_only=True)
        if job.out.main_hidden is not None:
            job.full_taps.append(job.out.main_hidden)
            job.tap_start = start if job.tap_start is None else job.tap_start


def _finish_full(job: PrefillJob) -> PrefillOut:
    N, W = job.ids.size(1), job.model.cfg.window_size
    main_hidden, tap_start = (torch.cat(job.full_taps, 1) if job.full_taps else None), job.tap_start
    if main_hidden is not None and main_hidden.size(1) > W:                 # the drafter's ring holds W rows
        tap_start = tap_start + main_hidden.size(1) - W
        main_hidden = main_hidden[:, -W:]
    return PrefillOut(job.out.logits[:, -1], main_hidden, tap_start, {L: N for L in range(job.model.cfg.n_layers)})


def _prefill_ced(model, N: int, cache, mode, x, pre, hashes, taps, rings_valid) -> PrefillOut:
    """The decoder segment of a CED prefill of N-token prompts whose encoder has run (`_encode`) on every row, from
    its inputs (`PrefillJob.decoder_inputs`). Rows may stand at different positions when their decoder segments
    have the same rows (`dsv41.engine.body_batch`: prompts of different lengths, fresh, so no valid rings)."""
    cfg = model.cfg
    split = check_ced(cfg)
    seg_rows = decoder_rows(cfg, mode, N)
    end = cache.pos.clone()
    published = Publications()
    rows = {L: N for L in range(split)}
    k = 0
    while k < len(seg_rows):
        R = seg_rows[k]
        run = next((j for j in range(k, len(seg_rows)) if seg_rows[j] != R), len(seg_rows))   # layers of R rows
        x, pre = x[:, -R:], pre[:, -R:]
        seg_start = end - R
        # earlier positions' windows are valid only on an exact continuation whose rows all run here
        seg_floor = None if (rings_valid and R == N) else seg_start
        opts = ForwardOptions(window_floor=seg_floor, produce_kv=False)
        ctx = StepContext(seg_start, R, cache, opts, published=published)
        # consecutive layers of one row count run as one stack (ced-bounded: all of them), so their mHC steps fuse
        # across blocks; the split layer's input was completed by the encoder (its Engram and tap included)
        L0, L1 = split + k, split + run
        x, pre = model.run_layers(x, pre, ctx, model.layers[L0:L1], None if hashes is None else hashes[:, -R:],
                                  taps if cfg.dspark_enabled else None, entered=L0 == split)
        rows.update({L: R for L in range(L0, L1)})
        k = run
    logits, _ = model.logits_from(x[:, -1:], pre[:, -1:])
    main_hidden = tap_start = None
    if taps:
        Rt = min(t.size(1) for t in taps.values())
        main_hidden = torch.cat([taps[L][:, -Rt:] for L in cfg.dspark_target_layer_ids], dim=-1)
        tap_start = end - Rt
    return PrefillOut(logits[:, -1], main_hidden, tap_start, rows)


def _encode(model, ids, cache, split, R0, pieces, tail, enc_taps) -> None:
    """The encoder chunk by chunk (`_encode_piece`) over prompts ids [B,N] of one length: appends the tail rows the
    decoder needs (its first layer's R0) to `tail` and the encoder-side drafter taps to `enc_taps`."""
    N = ids.size(1)
    for lo, hi, opts in pieces:
        T = hi - lo
        keep = min(T, max(0, R0 - (N - lo - T)))                             # rows of this chunk the decoder needs
        _encode_piece(model, ids[:, lo:hi], cache, split, opts, [(slice(None), keep, tail, enc_taps)])


def _encode_piece(model, part, cache, split, opts, outs) -> None:
    """One encoder forward of part [B,T], each row at its store's position: layers below the split on every row,
    then the split layer's block input (its Engram and tap) and its global-KV production. outs: (rows, keep, tail,
    enc_taps) per set of batch rows (a slice, so the batch axis stays): the piece's last `keep` rows of those go to
    `tail` ({"x", "pre", "hash"}: lists of pieces), their encoder-side drafter taps to `enc_taps` (layer -> list
    of pieces)."""
    cfg = model.cfg
    below, at = model.layers[:split], model.layers[split]
    T = part.size(1)
    start = cache.pos.clone()
    hashes = model.engram_hashes(part, cache, None)
    ctx = StepContext(start, T, cache, opts)
    chunk_taps = {} if cfg.dspark_enabled else None
    h, pre = model.run_layers(*model.streams_in(model.embed_tokens(part)), ctx, below, hashes, chunk_taps)
    # the split layer's block input on every prompt row, then its global-KV production from that input and the
    # lagged pre
    h = model.block_input(at, h, ctx, hashes, chunk_taps)
    if opts.produce_kv:
        at.attn.produce_global_kv(at.attn_norm(hc_pre(h, pre)), ctx)
    cache.pos = start + T
    for rows, keep, tail, enc_taps in outs:
        if keep:
            tail["x"].append(h[rows, T - keep:])
            tail["pre"].append(pre[rows, T - keep:])
            if hashes is not None:
                tail["hash"].append(hashes[rows, T - keep:])
        for L, t in (chunk_taps or {}).items():                              # encoder-side drafter taps
            enc_taps.setdefault(L, []).append(t[rows, -cfg.window_size:])
