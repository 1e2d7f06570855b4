"""The V4.1 stack: embedding -> S hyper-connection streams -> blocks (Engram before some) -> collapse -> head
(MODEL.md 2), plus the DSpark drafter stages (`dsv41.model.dspark`) and the vision tower when enabled.

Legend: B batch, T tokens of this call, S streams, D width, V vocabulary.

Numerics: `dtype` float32 (parity/tests; the golden float32 mode) or bfloat16 (the official numerics). Parameters
the official code keeps in fp32 stay fp32 in both (hc_*, attn_sink, gate biases, head, ratio-2 compressor,
confidence head, Markov head). Caches are bound from outside (`dsv41.model.cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv41.config import LayerRole, ModelConfig, layer_roles
from dsv41.kernels import mhc_fused
from dsv41.model.attention import Attention, StepContext
from dsv41.model.common import RMSNorm, warm_up_transcendentals
from dsv41.model.mhc import hc_mixes, hc_post, hc_pre, identity_pre_mix
from dsv41.model.moe import MoE


class Block(nn.Module):
    """One block: attention and MoE, each between a lagged collapse and an expansion of the S streams."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, dtype: torch.dtype, attention: nn.Module | None = None):
        super().__init__()
        self.cfg, self.layer = cfg, role.layer
        S, D = cfg.hc_mult, cfg.dim
        M = (2 + S) * S
        self.attn = attention if attention is not None else Attention(cfg, role, dtype)
        self.ffn = MoE(cfg, role.layer, dtype)
        self.attn_norm = RMSNorm(D, cfg.norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.norm_eps, dtype)
        f32 = torch.float32
        self.hc_attn_fn = nn.Parameter(torch.zeros(M, S * D, dtype=f32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(M, S * D, dtype=f32))
        self.hc_attn_base = nn.Parameter(torch.zeros(M, dtype=f32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(M, dtype=f32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=f32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=f32))
        self.engram = None
        if role.has_engram:
            from dsv41.model.engram import Engram
            self.engram = Engram(cfg, role.layer, dtype)

    def mixes(self, x: torch.Tensor, which: str):
        cfg = self.cfg
        fn, scale, base = (getattr(self, f"hc_{which}_{k}") for k in ("fn", "scale", "base"))
        return hc_mixes(x, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def head(self, x: torch.Tensor, pre_mix: torch.Tensor):
        """The attention side's mHC step on its own: (normed attention input [B,T,D], (pre, post, comb))."""
        return self.attn_norm(hc_pre(x, pre_mix)), self.mixes(x, "attn")

    def body(self, x: torch.Tensor, h: torch.Tensor, a_mix, ctx, image_mask: torch.Tensor | None = None,
             attn_extra=None, nxt: "Block | None" = None):
        """Attention and MoE from the block's input stream x, its normed attention input h and attention mixes
        a_mix (from `head`) -> (x', this block's FFN pre, nxt's head or None).

        Each mHC step between two sub-layers is one `dsv41.kernels.mhc_fused` call (the model's own functions on
        CPU, the fused Triton kernel on a GPU): the residual update, the next sub-layer's mixes and its lagged,
        normed input in one pass. The attention -> FFN step always is; with `nxt` (the next block, when nothing
        runs between the two) the FFN -> next attention step is too, and the third item is nxt's `head`."""
        cfg = self.cfg
        residual = x
        a_pre, a_post, a_comb = a_mix
        h = self.attn(h, ctx) if attn_extra is None else self.attn(h, ctx, attn_extra)
        x, h, f_pre, f_post, f_comb = mhc_fused(h, residual, a_post, a_comb, a_pre, self.hc_ffn_fn, self.hc_ffn_scale,
                                                self.hc_ffn_base, self.ffn_norm.weight, cfg.hc_sinkhorn_iters,
                                                cfg.hc_eps, cfg.norm_eps, self.ffn_norm.eps)
        residual = x
        h = self.ffn(h, image_mask)
        if nxt is None:
            return hc_post(h, residual, f_post, f_comb), f_pre, None
        x, h, n_pre, n_post, n_comb = mhc_fused(h, residual, f_post, f_comb, f_pre, nxt.hc_attn_fn,
                                                nxt.hc_attn_scale, nxt.hc_attn_base, nxt.attn_norm.weight,
                                                cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, nxt.attn_norm.eps)
        return x, f_pre, (h, (n_pre, n_post, n_comb))

    def forward(self, x: torch.Tensor, pre_mix: torch.Tensor, ctx, image_mask: torch.Tensor | None = None,
                attn_extra=None):
        """x [B,T,S,D], pre_mix [B,T,S] (the previous block's FFN pre) -> (x', this block's FFN pre)."""
        x, pre, _ = self.body(x, *self.head(x, pre_mix), ctx, image_mask, attn_extra)
        return x, pre


def _hooked(m: nn.Module) -> bool:
    """A module with forward hooks must be entered through its __call__ (its parameters may only be valid there),
    so the model does not fuse across its boundary."""
    return bool(m._forward_pre_hooks or m._forward_hooks)


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
        self.mtp = nn.ModuleList()
        if cfg.dspark_enabled:
            from dsv41.model.dspark import DSparkBlock
            for k in range(cfg.n_mtp_layers):
                self.mtp.append(DSparkBlock(cfg, k, dtype))
        self.engram_hasher = None
        if cfg.engram_enabled:
            from dsv41.model.engram import NgramHasher, identity_token_map
            if token_map is None:
                token_map = identity_token_map(cfg.vocab_size)
            self.engram_hasher = NgramHasher(cfg, token_map)
        if cfg.vision_enabled:
            from dsv41.model.vision import Aligner, ViT
            self.vision = ViT(cfg, dtype)
            self.aligner = Aligner(cfg, dtype)
            self.image_start = nn.Parameter(torch.zeros(D, dtype=dtype))
            self.image_end = nn.Parameter(torch.zeros(D, dtype=dtype))
            self.image_newline = nn.Parameter(torch.zeros(D, dtype=dtype))
        self.engram_index = {L: i for i, L in enumerate(cfg.engram_layer_ids)}

    # ---------------------------------------------------------------- pieces (also used by teacher forcing)
    def engram_hashes(self, input_ids: torch.Tensor, cache, token_mask: torch.Tensor | None):
        if self.engram_hasher is None:
            return None
        if any(b.device != input_ids.device for b in self.engram_hasher.buffers()):
            self.engram_hasher.to(input_ids.device)           # its tables are built on the host
        if cache.engram_history is None:
            cache.engram_history = self.engram_hasher.init_history(input_ids.size(0)).to(input_ids.device)
        hashes, cache.engram_history = self.engram_hasher(input_ids, cache.engram_history.to(input_ids.device),
                                                          token_mask)
        return hashes

    def embed_tokens(self, input_ids: torch.Tensor, images=None) -> torch.Tensor:
        h = self.embed(input_ids)
        if images is not None:
            from dsv41.model.vision import merge_model_images
            h = merge_model_images(self, h, images)
        return h

    def apply_engram(self, L: int, h: torch.Tensor, hashes, token_mask) -> torch.Tensor:
        return self.layers[L].engram(h, hashes[:, :, self.engram_index[L]], token_mask)

    def logits_from(self, h: torch.Tensor, pre_mix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final collapse with the last block's FFN pre, RMSNorm, fp32 head."""
        hidden = self.norm(hc_pre(h, pre_mix))
        return self.head(hidden.float()), hidden

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache, start_pos: int | torch.Tensor | None = None, *,
                token_types: torch.Tensor | None = None, images=None, last_only: bool = False,
                official_decode_artifact: bool = False, record: dict | None = None,
                window_floor: torch.Tensor | None = None, produce_kv: bool = True,
                journal: dict | None = None, window_floor_layers: frozenset | None = None) -> ForwardOut:
        """Run T tokens per row at positions start_pos.. (default: where the cache stands) and advance the cache.

        Prefill (P = 0, any T), decode (T = 1) and chunked prefill (any P, T) share this one path; rows may
        sit at different positions (continuous batching). `window_floor` truncates every layer's sliding window
        (replay), or only those in `window_floor_layers` when given (training's replay simulation passes both
        with a prefill at position 0: there only queries at or after the floor lose keys); `produce_kv=False`
        re-runs tokens whose global KV is already stored (replay); `journal` (a dict) records what a speculative
        verify needs to roll back rejected tokens (`dsv41.engine.speculative`)."""
        B, T = input_ids.shape
        start = cache.pos.clone()
        if start_pos is not None:
            want = torch.as_tensor(start_pos, dtype=torch.long).expand(B)
            if not torch.equal(want, start):
                raise ValueError(f"start_pos {want.tolist()} does not continue the cache, which holds "
                                 f"{start.tolist()} tokens per row")
        if images is not None and int(start.max()) != 0:
            raise ValueError("image spans must be prefilled in the first chunk (start_pos 0)")
        image_mask = None if token_types is None else token_types >= 0
        token_mask = None if image_mask is None else ~image_mask
        hashes = self.engram_hashes(input_ids, cache, token_mask)
        ctx = StepContext(start, T, cache, official_decode_artifact, record=record, window_floor=window_floor,
                          produce_kv=produce_kv, journal=journal, window_floor_layers=window_floor_layers)
        h = self.embed_tokens(input_ids, images)
        if record is not None:
            record["embed_out"] = h
        h = h.unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        pre_mix = identity_pre_mix(B, T, self.cfg.hc_mult, h.device)
        taps = []
        head = None                      # this block's attention input, when the previous block computed it
        n = len(self.layers)
        for L, layer in enumerate(self.layers):
            if layer.engram is not None:
                h = self.apply_engram(L, h, hashes, token_mask)
                if record is not None:
                    record[("engram_out", L)] = h
            if self.cfg.dspark_enabled and L in self.cfg.dspark_target_layer_ids:
                taps.append(h.mean(dim=2))
            if _hooked(layer):             # e.g. FSDP2 unshards a block's parameters in its forward hooks
                h, pre_mix = layer(h, pre_mix, ctx, image_mask)
            else:
                if head is None:
                    head = layer.head(h, pre_mix)
                nxt = self.layers[L + 1] if L + 1 < n else None
                nxt = nxt if nxt is not None and nxt.engram is None and not _hooked(nxt) else None
                h, pre_mix, head = layer.body(h, *head, ctx, image_mask, nxt=nxt)
            if record is not None:
                record[("block_out", L)] = h
                record[("block_pre_out", L)] = pre_mix
                record[("experts", L)] = layer.ffn.last_route
        if last_only:
            h, pre_mix = h[:, -1:], pre_mix[:, -1:]
        logits, hidden = self.logits_from(h, pre_mix)
        cache.pos = start + T
        return ForwardOut(logits, hidden, torch.cat(taps, dim=-1) if taps else None)

    # ---------------------------------------------------------------- DSpark
    def draft(self, token: torch.Tensor | None, main_hidden: torch.Tensor, cache, start, temperature: float = 0.0,
              generator: torch.Generator | None = None):
        """The DSpark drafter (MODEL.md 7). `main_hidden` [B,T,taps*D] are the target's taps of the tokens at
        positions start_b..start_b+T-1. With `token` None (prefill) it only seeds the drafter windows and
        returns None; otherwise `token` [B] is the token the target just produced (position start_b + T) and
        it returns (ids [B, G+1], logits [B,G,V], confidence [B,G]) for positions start_b+T+1...
        The official code drafts only after a one-token decode step (T = 1)."""
        from dsv41.model.dspark import forward_spec
        return forward_spec(self, token, main_hidden, cache, start, temperature, generator)

    # ---------------------------------------------------------------- misc
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
