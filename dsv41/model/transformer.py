"""The V4.1 stack: embedding -> S hyper-connection streams -> blocks (Engram before some) -> collapse -> head
(docs/model.md §2), plus the DSpark drafter stages (`dsv41.model.dspark`) and the vision tower when enabled.

Legend: B batch, T tokens of this call, S streams, D width, V vocabulary.

Numerics: `dtype` float32 (parity/tests; the golden float32 mode) or bfloat16 (the official numerics). Parameters
the official code keeps in fp32 stay fp32 in both (hc_*, attn_sink, gate biases, head, ratio-2 compressor,
confidence head, Markov head). Caches are bound from outside (`dsv41.model.cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv41.config import ModelConfig, layer_roles
from dsv41.kernels.choice import fused_mhc_across
from dsv41.kernels.invariant import is_deterministic, linear
from dsv41.kernels.mhc_math import hc_pre
from dsv41.model.block import Block
from dsv41.model.cache import KVStore
from dsv41.model.common import RMSNorm, warm_up_transcendentals
from dsv41.model.dspark import DSparkBlock, forward_spec
from dsv41.model.engram import NgramHasher, identity_token_map, prefetch_host_rows
from dsv41.model.step import ForwardOptions, Ragged, StepContext


@dataclass
class ForwardOut:
    logits: torch.Tensor                 # [B,T,V] fp32 (or [B,1,V] with last_only)
    hidden: torch.Tensor                 # final-norm output [B,T,D]
    main_hidden: torch.Tensor | None     # DSpark taps [B,T,n_taps*D]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, token_map: torch.Tensor | None = None):
        super().__init__()
        warm_up_transcendentals()
        self.cfg, self.dtype = cfg, dtype
        self.roles = layer_roles(cfg)
        D, V = cfg.dim, cfg.vocab_size
        self.embed = nn.Embedding(V, D, dtype=dtype)
        self.layers = nn.ModuleList([Block(cfg, r, dtype) for r in self.roles])
        self.norm = RMSNorm(D, cfg.norm_eps, dtype)
        self.head = nn.Linear(D, V, bias=False, dtype=torch.float32)
        n_stages = cfg.n_mtp_layers if cfg.dspark_enabled else 0
        self.mtp = nn.ModuleList([DSparkBlock(cfg, k, dtype) for k in range(n_stages)])
        self.engram_hasher = None
        if cfg.engram_enabled:
            token_map = identity_token_map(cfg.vocab_size) if token_map is None else token_map
            self.engram_hasher = NgramHasher(cfg, token_map)
        if cfg.vision_enabled:
            from dsv41.model.vision import add_vision_members
            add_vision_members(self, cfg, dtype)

    # ---------------------------------------------------------------- pieces (also used by teacher forcing)
    def engram_hashes(self, input_ids: torch.Tensor, cache: KVStore, token_mask: torch.Tensor | None):
        if self.engram_hasher is None:
            return None
        if any(b.device != input_ids.device for b in self.engram_hasher.buffers()):
            self.engram_hasher.to(input_ids.device)           # its tables are built on the host
        if cache.engram_history is None:
            cache.engram_history = self.engram_hasher.init_history(input_ids.size(0)).to(input_ids.device)
        hashes, cache.engram_history = self.engram_hasher(input_ids, cache.engram_history.to(input_ids.device),
                                                          token_mask)
        prefetch_host_rows([b.engram for b in self.layers if b.engram is not None], hashes)
        return hashes

    def embed_tokens(self, input_ids: torch.Tensor, images=None) -> torch.Tensor:
        h = self.embed(input_ids)
        if images is not None:
            from dsv41.model.vision import merge_image_embeddings
            h = merge_image_embeddings(self, h, images)
        return h

    def streams_in(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings [B,T,D] -> block 0's input: the S streams (copies) [B,T,S,D] and its collapse weights, one-hot
        on stream 0 [B,T,S]."""
        B, T = emb.shape[:2]
        S = self.cfg.hc_mult
        pre = torch.zeros(B, T, S, dtype=torch.float32, device=emb.device)
        pre[..., 0] = 1.0
        return emb.unsqueeze(2).repeat(1, 1, S, 1), pre

    def block_input(self, layer: Block, h: torch.Tensor, ctx: StepContext, hashes: torch.Tensor | None,
                    taps: dict | None = None) -> torch.Tensor:
        """A block's input stream from the previous block's output: its Engram applied (hashes from
        `engram_hashes`), then the DSpark tap of a target layer taken into `taps` (layer -> [B,T,D]) when given."""
        L = layer.layer
        if layer.engram is not None:
            h = layer.engram(h, hashes[:, :, layer.engram.layer_index], ctx.token_mask)
            if ctx.record is not None:
                ctx.record[("engram_out", L)] = h
        if taps is not None and L in self.cfg.dspark_target_layer_ids:
            taps[L] = h.mean(dim=2)
        return h

    def run_layers(self, h: torch.Tensor, pre_mix: torch.Tensor, ctx: StepContext, layers, hashes=None,
                   taps: dict | None = None, step=None,
                   entered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks `layers`, in order, from the stream h [B,T,S,D] and collapse weights pre_mix [B,T,S] ->
        (the last block's output stream, its FFN pre).

        Each block's input goes through `block_input` first (`entered`: the first block's input already has).
        The block itself is `step(block, h, pre_mix, ctx)` when given (the fast training forward, the drafter),
        else the model's own: consecutive blocks share one fused mHC step (`Block.attn_and_ffn` with `nxt`)
        unless an Engram runs between them or the kernels refuse (`fused_mhc_across`: hooked blocks run through
        their __call__, or `set_fused_mhc(False)`: every block on its own, `Block.forward`). On a CPU both give the
        same bits; on a GPU the fused step saves a block's separate mixes (~100 small kernels). With ctx.record,
        each block's output stream and FFN pre are kept."""
        attn_in = None                   # this block's attention input, when the previous block computed it
        for i, layer in enumerate(layers):
            if i or not entered:
                h = self.block_input(layer, h, ctx, hashes, taps)
            if step is not None:
                h, pre_mix = step(layer, h, pre_mix, ctx)
            elif not fused_mhc_across(layer):
                h, pre_mix = layer(h, pre_mix, ctx)
            else:
                if attn_in is None:
                    attn_in = layer.attn_input(h, pre_mix)
                nxt = layers[i + 1] if i + 1 < len(layers) else None
                nxt = nxt if nxt is not None and nxt.engram is None and fused_mhc_across(nxt) else None
                h, pre_mix, attn_in = layer.attn_and_ffn(h, *attn_in, ctx, nxt=nxt)
            if ctx.record is not None:
                ctx.record[("block_out", layer.layer)] = h
                ctx.record[("block_pre_out", layer.layer)] = pre_mix
        return h, pre_mix

    def logits_from(self, h: torch.Tensor, pre_mix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final collapse with the last block's FFN pre, RMSNorm, fp32 head."""
        hidden = self.norm(hc_pre(h, pre_mix))
        if is_deterministic():
            return linear(hidden.float(), self.head.weight), hidden
        return self.head(hidden.float()), hidden

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache: KVStore, start_pos: int | torch.Tensor | None = None,
                opts: ForwardOptions | None = None, *, last_only: bool = False) -> ForwardOut:
        """Run T tokens per row at positions start_pos.. (default: where the cache stands) and advance the cache;
        `last_only`: logits of the last position only.

        Prefill (P = 0, any T), decode (T = 1) and chunked prefill (any P, T) share this one path; rows may
        sit at different positions (continuous batching). `opts` (`ForwardOptions`): images, parity recording,
        replay (window floors, no KV production) and speculative verification (the journal; per-row lengths: a
        ragged call, `dsv41.model.step.Ragged`, whose logits and taps are [B,T,...] with zeros past each row's
        length)."""
        opts = opts or ForwardOptions()
        B, T = input_ids.shape
        start = cache.pos.clone()
        if start_pos is not None:
            want = torch.as_tensor(start_pos, dtype=torch.long).expand(B)
            if not torch.equal(want, start):
                raise ValueError(f"start_pos {want.tolist()} does not continue the cache, which holds "
                                 f"{start.tolist()} tokens per row")
        if opts.images is not None and int(start.max()) != 0:
            raise ValueError("image spans must be prefilled in the first chunk (start_pos 0)")
        image_mask = None if opts.token_types is None else opts.token_types >= 0
        ragged = self._ragged(opts, B, T, input_ids.device, last_only)
        ctx = StepContext(start, T, cache, opts, image_mask=image_mask, ragged=ragged)
        hashes = self.engram_hashes(input_ids, cache, ctx.token_mask)
        if ragged is not None:                   # the stack runs on the real tokens only, packed [1,N]
            input_ids, hashes = ragged.pack(input_ids), None if hashes is None else ragged.pack(hashes)
        h = self.embed_tokens(input_ids, opts.images)
        if opts.record is not None:
            opts.record["embed_out"] = h
        taps = {} if self.cfg.dspark_enabled else None
        h, pre_mix = self.run_layers(*self.streams_in(h), ctx, self.layers, hashes, taps)
        if last_only:
            h, pre_mix = h[:, -1:], pre_mix[:, -1:]
        logits, hidden = self.logits_from(h, pre_mix)
        main_hidden = torch.cat(list(taps.values()), dim=-1) if taps else None
        if ragged is not None:                   # back to [B,T,...], zeros in the padding
            logits, hidden = ragged.unpack(logits), ragged.unpack(hidden)
            main_hidden = None if main_hidden is None else ragged.unpack(main_hidden)
        cache.pos = start + T
        return ForwardOut(logits, hidden, main_hidden)

    @staticmethod
    def _ragged(opts: ForwardOptions, B: int, T: int, device, last_only: bool) -> Ragged | None:
        """The layout of a call with per-row lengths (`ForwardOptions.lengths`); None when every row runs all T
        tokens (no padding: the ordinary call)."""
        if opts.lengths is None:
            return None
        lengths = torch.as_tensor(opts.lengths, dtype=torch.long).cpu()
        if lengths.shape != (B,):
            raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
        if bool((lengths == T).all()):
            return None
        if last_only or opts.images is not None or opts.token_types is not None or opts.record is not None \
                or opts.routes is not None or opts.window_floor is not None:
            raise ValueError("a ragged call (lengths) is a verify step: no last_only, images, token types, "
                             "recording, replayed routes or window floors")
        return Ragged(lengths, T, device)

    # ---------------------------------------------------------------- DSpark
    def draft(self, token: torch.Tensor | None, main_hidden: torch.Tensor, cache, start, temperature: float = 0.0,
              generator: torch.Generator | None = None):
        """The DSpark drafter (docs/model.md §7). `main_hidden` [B,T,taps*D] are the target's taps of the tokens at
        positions start_b..start_b+T-1. With `token` None (prefill) it only seeds the drafter windows and
        returns None; otherwise `token` [B] is the token the target just produced (position start_b + T) and
        it returns (ids [B, G+1], logits [B,G,V], confidence [B,G]) for positions start_b+T+1...
        The official code drafts only after a one-token decode step (T = 1)."""
        return forward_spec(self, token, main_hidden, cache, start, temperature, generator)
