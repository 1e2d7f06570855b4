"""The verify journal (step 5 of `dsv41.engine.speculative`): rejected tokens leave no trace in the store."""

from __future__ import annotations

import torch

from dsv41.model.attention import carry_after


class VerifyJournal:
    """What a verify forward of T tokens per row at positions start.. changes in a bound store, kept so that
    `rollback(keep)` leaves exactly the state after each row's first keep_b tokens. Pass `.model_journal` to the
    forward (`ForwardOptions(journal=...)`): compressors record their per-token sequence there."""

    def __init__(self, model, view, start: torch.Tensor, T: int):
        cfg = model.cfg
        W = cfg.window_size
        if T > W:
            raise ValueError(f"a verify step of {T} tokens exceeds the window of {W}")
        self.start, self.T = start.clone().cpu(), T
        self.slots = (self.start.view(-1, 1) + torch.arange(T)) % W                  # [B,T] ring slots written
        self.layers = range(cfg.n_layers)                                              # the target's rings
        self.rings = {L: view.ring_rows(L, self.slots) for L in self.layers}
        h = view.engram_history
        if h is None and model.engram_hasher is not None:                             # before any token: all DEAD
            h = model.engram_hasher.init_history(self.start.numel())
        self.history = None if h is None else h.clone()
        self.model_journal: dict = {}

    def rollback(self, model, view, ids: torch.Tensor, keep: torch.Tensor) -> None:
        """ids [B,T] the tokens the forward ran; keep [B] in 1..T: tokens each row keeps."""
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        n = self.start + keep
        rejected = torch.arange(self.T).view(1, -1) >= keep.view(-1, 1)
        if bool(rejected.any()):
            for L in self.layers:
                view.set_ring_rows(L, self.slots, self.rings[L], rejected)
        view.truncate_global(n)
        for key, (seq_kv, seq_sc, carried) in self.model_journal.items():
            if key[0] == "compressor":
                L = key[1]
                m = view.specs[L].ratio
                view.set_compressor_state(L, *carry_after(seq_kv, seq_sc, carried + keep.to(carried.device), m))
        hasher = model.engram_hasher
        if hasher is not None and self.history is not None:
            k = self.history.size(1)
            ext = torch.cat([self.history.to(hasher.token_map.device).long(),
                             hasher.compress(ids.to(hasher.token_map.device))], dim=1)
            idx = keep.to(ext.device).view(-1, 1) + torch.arange(k, device=ext.device)
            view.engram_history = ext.gather(1, idx)
        view.pos = n
