"""Expert routing recorded at generation time and replayed in the RL training forward (docs/system.md §7 and §10).

Why: a policy-gradient step scores the sampled tokens with the training forward. If that forward selected its
experts again at the new weights, a token sampled through experts {1, 3} could be scored through {0, 2}: the ratio
to the behaviour policy would measure a different computation, and with a sample that ran across weight versions
the mismatch grows with every switch. So each position keeps the experts that generated it, and the training
forward routes by them (`ForwardOptions.routes`; the gate's weights are still the current scores at those experts,
so the gate trains).

How it is recorded: the engine does not report routing per token, so the routing of a segment (the positions
forwarded while one weight version was live) is recomputed by the reference forward with `route_log`, at that
version's weights, before they change: at a weight switch for the sequences still running, at the end of a sample
for its last segment. Position t's routing is the one that produced token t+1's logits, so a sample of prompt P
and n output tokens has P + n - 1 routed positions (the last token is never fed back). In the deterministic mode
(`Engine(..., deterministic=True)`) the forward's routing for a sequence generated entirely at one version is the
engine's, bit for bit (tested against the gates' outputs during generation). For a later segment of a sample that
crossed a switch, the engine's positions read a KV cache written at earlier weights, which no single-weights
forward reproduces; the record is then the new version's own routing of the same prefix, at that version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.train.logprobs import token_logprobs


@dataclass
class RouteRecord:
    """A sample's routing as segments (first position, version, {layer: expert ids [n, K]}), in position order."""
    segments: list[tuple[int, int, dict]] = field(default_factory=list)
    upto: int = 0                               # positions recorded so far

    def stitched(self) -> dict[int, torch.Tensor]:
        """{layer: expert ids [upto, K]} over every recorded position."""
        if not self.segments:
            return {}
        return {layer: torch.cat([seg[layer] for _, _, seg in self.segments]) for layer in self.segments[0][2]}

    def versions(self) -> list[int]:
        """The version each recorded position was routed at."""
        out = []
        for _, v, seg in self.segments:
            out += [v] * next(iter(seg.values())).size(0)
        return out


@torch.no_grad()
def record(model, records: list[RouteRecord], rows: list[list[int]], version: int, pad: int) -> torch.Tensor:
    """Append to each record the routing of its row's positions [record.upto, len(row) - 1) at the current weights
    (rows: prompt + tokens generated so far). Returns the forward's log-probs [B, T-1] (the behaviour log-probs of
    tokens the engine did not report, such as a sampled EOS)."""
    T_ = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (T_ - len(r)) for r in rows])
    log: dict = {}
    lp = token_logprobs(model, ids, route_log=log)
    for i, (rec, row) in enumerate(zip(records, rows)):
        end = len(row) - 1
        if end > rec.upto:
            rec.segments.append((rec.upto, version, {layer: x[i, rec.upto:end].clone() for layer, x in log.items()}))
            rec.upto = end
    return lp


def replay_batch(records: list[RouteRecord], lengths: list[int], T_: int) -> dict[int, torch.Tensor]:
    """{layer: expert ids [B, T_, K]} for a right-padded training batch whose row i holds lengths[i] tokens: each
    row's recorded routing at its first lengths[i] - 1 positions (all of them must be recorded); the positions that
    predict nothing (the last token, the padding) take experts 0..K-1 (causal: they never reach a scored one)."""
    out = {}
    for i, (rec, n) in enumerate(zip(records, lengths)):
        if rec.upto < n - 1:
            raise ValueError(f"row {i}: routing recorded for {rec.upto} positions, the row needs {n - 1}")
        for layer, x in rec.stitched().items():
            if layer not in out:
                out[layer] = torch.arange(x.size(1)).repeat(len(records), T_, 1)
            out[layer][i, :n - 1] = x[:n - 1]
    return out
