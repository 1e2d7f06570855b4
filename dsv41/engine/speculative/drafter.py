"""The DSpark drafter (steps 1 and 6 of `dsv41.engine.speculative`): it proposes drafts from its rings and is
seeded with the target's taps of the kept positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.engine.sampling import target_probs
from dsv41.engine.speculative.scheduler import AcceptanceCalibration
from dsv41.model.dspark import forward_spec


@dataclass
class Proposal:
    tokens: torch.Tensor              # [B, G] drafts for positions P_r+1..P_r+G
    q: list                           # per row: [G, V] proposal distributions (CPU), or None (point masses)
    accept: torch.Tensor              # [B, G] a_r,k = sigmoid(confidence), CPU float

    def survival(self, calibration: AcceptanceCalibration | None = None) -> torch.Tensor:
        """S_r,k = prod_{i<=k} a_r,i  [B, G] (a_r,k calibrated first when given)."""
        a = self.accept if calibration is None else calibration.apply(self.accept)
        return torch.cumprod(a, dim=1)


class DSparkDrafter:
    """The model's DSpark stages (`model.mtp`) as the engine's drafter."""

    def __init__(self, model):
        if not model.cfg.dspark_enabled or len(model.mtp) == 0:
            raise ValueError("speculative decoding needs a model with the DSpark drafter (dspark_enabled)")
        self.model = model

    def seed(self, view, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """Write the target's taps main_hidden [B,T,taps*D] of positions start_b.. (first count_b) to the rings."""
        forward_spec(self.model, None, main_hidden, view, start, count=count)

    def propose(self, view, seqs: list, pos: torch.Tensor) -> Proposal:
        """Drafts for the rows of `view`: seqs[b] (the engine's Sequence: .pending at position pos_b, .params,
        .gen) -> `Proposal`. Any object with `seed` and `propose` can serve as the engine's drafter (tests inject
        oracle and adversarial ones); exactness never depends on it."""
        model = self.model
        B = len(seqs)
        pending = torch.tensor([s.pending for s in seqs])
        dev = model.embed.weight.device
        taps = len(model.cfg.dspark_target_layer_ids) * model.cfg.dim
        q_rows: list[list] = [[] for _ in range(B)]

        def sampler(i: int, logits: torch.Tensor) -> torch.Tensor:
            out = torch.empty(B, dtype=torch.long)
            for b, s in enumerate(seqs):
                if s.params.temperature == 0:
                    out[b] = int(logits[b].argmax())
                    q_rows[b].append(None)
                else:
                    q = target_probs(logits[b].float().cpu(), s.params)
                    out[b] = int(torch.multinomial(q, 1, generator=s.gen))
                    q_rows[b].append(q)
            return out.to(logits.device)

        empty = torch.zeros(B, 0, taps, dtype=model.dtype, device=dev)
        ids, _, confidence = forward_spec(model, pending.to(dev), empty, view, pos, sampler=sampler)
        q = [None if r[0] is None else torch.stack(r) for r in q_rows]
        return Proposal(ids[:, 1:].cpu(), q, torch.sigmoid(confidence.float()).cpu())
