"""What one pass through the stack carries: the caller's options (`ForwardOptions`), and the per-step state handed
down the layers (`StepContext`): where each row's chunk starts, the bound store, what source layers publish for
the layers above them (`Publications`) and what every layer of the step would otherwise compute again (`memo`).

Legend: B batch, T tokens of this call, K top-k, N compressed entries visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.cache import KVStore


@dataclass
class ForwardOptions:
    """How one `Transformer.forward` call runs beyond its tokens, store and start; the defaults are a plain call.

    Each option serves one kind of caller: images (vision prompts), the official decode artifact and recording
    (golden parity, `dsv41.model.runner`), window floors and `produce_kv` (replay: prefix caching and training's
    bounded-replay simulation), the journal (speculative verification, `dsv41.engine.speculative`), routes and the
    route log (RL: the expert routing recorded at generation, replayed by the training forward instead of
    recomputed, docs/system.md §7).

    `window_floor` truncates the sliding window of every layer, or of those in `window_floor_layers` when given.
    In a prefill at position 0 only the queries at or after the floor lose keys (training's replay simulation,
    `dsv41.train.qat`); otherwise every query of the call does. `produce_kv=False` re-runs tokens whose global
    KV is already stored; `journal` (a dict) receives what a speculative verify needs to roll back rejected
    tokens. `lengths` makes the call ragged (`Ragged`): verify steps of per-row lengths."""

    token_types: torch.Tensor | None = None    # [B,T] >= 0 on image-span tokens (VL routing bias, Engram mask)
    images: list | None = None                 # the prompt's image records (first chunk only)
    official_decode_artifact: bool = False     # decode reads the stale index-key publisher (docs/model.md §4)
    record: dict | None = None                 # when a dict: per-layer streams, top-k, candidates, routes kept here
    window_floor: torch.Tensor | None = None   # [B]: window keys before this position are absent (replay start)
    window_floor_layers: frozenset | None = None   # layers window_floor applies to (None: every layer)
    produce_kv: bool = True                    # False: KV sources skip compressing (their global KV already exists)
    journal: dict | None = None                # speculative verify: compressors record their per-token sequence
    routes: dict | None = None                 # {layer: expert ids [B,T,K]}: MoE layers route by these (RL replay)
    route_log: dict | None = None              # when a dict: MoE layers keep their expert ids [B,T,K] here
    lengths: torch.Tensor | None = None        # [B] in 1..T: row b runs its first lengths_b tokens (`Ragged`)

    def floor_for(self, layer: int) -> torch.Tensor | None:
        """The window floor that applies to `layer` (None: its window is not truncated)."""
        applies = self.window_floor_layers is None or layer in self.window_floor_layers
        return self.window_floor if applies else None


class Ragged:
    """The layout of a ragged call (`ForwardOptions.lengths`): row b runs its first lengths_b of the T columns of
    input_ids; the rest of the row is padding. The stack between attentions (embedding, Engram, mHC, MoE, the
    head) runs on the N = sum_b lengths_b real tokens packed into one row [1,N,...], row after row (cu_seqlens
    order, as varlen attention kernels take them); each attention layer runs its projections on the packed tokens
    too and lays out only what it reads against each row's own store (queries, window KV, the compressor's and
    indexer's inputs) as [B,T,...] (`Attention.forward`). Those padding columns are zeros behind each row's real
    tokens: causally after them, so no real token reads them; what they write into the store (ring rows,
    compressor state, global entries, Engram history) is what a verify journal rolls back anyway
    (`dsv41.engine.speculative.rollback`, keep_b <= lengths_b)."""

    def __init__(self, lengths: torch.Tensor, T: int, device):
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.dim() != 1 or int(lengths.min()) < 1 or int(lengths.max()) > T:
            raise ValueError(f"ragged lengths must be [B] in 1..{T}, got {lengths.tolist()}")
        self.lengths, self.T = lengths, T
        self.mask = (torch.arange(T).view(1, -1) < lengths.view(-1, 1)).to(device)        # [B,T]
        self.cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])   # [B+1]
        self.n = int(self.cu_seqlens[-1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B,T,...] -> the real tokens [1,N,...], row after row."""
        return x[self.mask.to(x.device)].unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1,N,...] -> [B,T,...], zeros in the padding."""
        out = x.new_zeros(self.mask.shape + x.shape[2:])
        out[self.mask.to(x.device)] = x[0]
        return out


@dataclass
class Publications:
    """What a source layer hands the layers above it within one step, by the source's layer id."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)         # index sources: ids [B,T,K], -1 none
    cand: dict[int, torch.Tensor] = field(default_factory=dict)         # candidate sources: bool mask [B,T,N]
    topk_packed: dict[int, torch.Tensor] = field(default_factory=dict)  # packed decode: ids [B,K], -1 none
    pool: dict[int, torch.Tensor | None] = field(default_factory=dict)  # packed decode: candidate block pool


@dataclass
class StepContext:
    """Per-forward state handed down the stack. Rows may sit at different positions (continuous batching); all
    rows process `seqlen` tokens (a ragged call: up to `seqlen`, `ragged`). `memo` holds what every layer of the
    step shares and computes once (the visible-entry counts, RoPE tables, window rows of a decode step), keyed by
    what it depends on."""

    start: torch.Tensor                 # [B] long: position of each row's first token in this call
    seqlen: int
    cache: KVStore
    opts: ForwardOptions = field(default_factory=ForwardOptions)
    published: Publications = field(default_factory=Publications)
    image_mask: torch.Tensor | None = None     # [B,T] bool: image-span tokens (from opts.token_types)
    memo: dict = field(default_factory=dict)
    ragged: Ragged | None = None               # a ragged call: the stack's tensors are packed [1,N,...]

    @property
    def static(self) -> bool:
        """A step of fixed shapes (`dsv41.engine.graphs`, the graph-captured decode step): the store fixes every
        width that would depend on the context (`entry_capacity`) and nothing is read back to the host."""
        return getattr(self.cache, "static", False)

    def entry_capacity(self, ratio: int) -> int:
        """Compressed entries of ratio `ratio` a row of a static step may hold: the width its indexer scores."""
        return self.cache.entry_capacity(ratio)

    @property
    def token_mask(self) -> torch.Tensor | None:
        """[B,T] bool: text tokens (Engram gates only these), None when every token is text."""
        return None if self.image_mask is None else ~self.image_mask

    @property
    def record(self) -> dict | None:
        return self.opts.record

    @property
    def positions(self) -> torch.Tensor:
        """[B,T] absolute positions of this call's tokens."""
        return self.start.unsqueeze(1) + torch.arange(self.seqlen, device=self.start.device)

    @property
    def uniform_start(self) -> int | None:
        """The common start position when every row has the same one (the official runtime's case)."""
        lo, hi = int(self.start.min()), int(self.start.max())
        return lo if lo == hi else None

    @property
    def all_prefill(self) -> bool:
        return int(self.start.max()) == 0

    def memoized(self, key, compute):
        """memo[key], computed by `compute()` on the first ask within this step."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]
