"""The log-probabilities a policy-gradient step trains on, from the training forward that on-policy RL uses
(docs/system.md §7 and §11).

That forward is the model's reference forward (`Transformer.forward` over the whole sequence from position 0,
through the dense `TrainCache`, autograd on) with the inference numerics: every FP8 / FP4 quantize-dequantize site
on, as the engine samples with (not the pretraining setting, which trains with them off, nor the fast forward of
fast.py, a different summation order). In the deterministic mode (`dsv41.model.attention.use_deterministic`) its
log-probs equal, bit for bit, those the engine reported for the sampled tokens, whatever batch, chunking,
speculation or cache resume produced them: the ratio of new to behaviour probabilities starts at exactly 1.
"""

from __future__ import annotations

import torch

from dsv41.model.step import ForwardOptions
from dsv41.train.qat import sequence_forward

__all__ = ["token_logprobs"]


def token_logprobs(model, ids: torch.Tensor, routes: dict | None = None, route_log: dict | None = None
                   ) -> torch.Tensor:
    """log p(ids[b, t+1] | ids[b, :t+1]) -> fp32 [B, T-1], differentiable. ids [B, T] (right-padded rows are
    fine: the attention is causal, a row's positions never see its padding). routes {layer: expert ids [B,T,K]}:
    the MoE layers use this routing (recorded at generation) instead of selecting again; route_log (a dict)
    receives the routing this forward used."""
    if ids.dim() != 2 or ids.size(1) < 2:
        raise ValueError(f"token_logprobs needs ids [B, T] with T >= 2, got shape {tuple(ids.shape)}")
    logits = sequence_forward(model, ids, ForwardOptions(routes=routes, route_log=route_log)).logits
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
