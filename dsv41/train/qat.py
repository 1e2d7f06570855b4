"""Quantization-aware training of the FP4 main KV (docs/system.md §6) and the training cache it runs through.

Training runs with the model's QDQ sites switched off (`set_quantization(model, False)`): the FP8/FP4 quantizers
are piecewise constant, so their true gradient is zero almost everywhere. QAT puts back the one quantizer that
the inference cache applies to what it stores for the long context, the main-KV record (E2M1 codes with one
E4M3 scale per 16 channels, `dsv41.codecs.qdq_main_kv`), with a straight-through estimator:
    forward  y = qdq(x)                      (the values attention will read at inference)
    backward dy/dx = I                       (the gradient passes as if the quantizer were the identity)
written y = x + (qdq(x) - x).detach().

Where: the compressed entries reach the store through `cache.append_compressed(layer, row0, kv, ...)`, exactly
where the model applies `qdq_main_kv` when its QDQ is on (after RoPE, docs/model.md §3.4). `TrainCache` (a
`DenseCache`) applies the STE there when `kv_qat` is set, so QAT needs no change to the model.

Bounded-replay simulation (`TrainConfig.replay` / `--replay decoder|encoder|both`, in pretrain.py). At inference
the decoder runs only the last n_win prompt tokens, with its sliding window truncated at the replay start s
(docs/system.md §2); on a prefix hit the encoder replays the last n_win cached tokens the same way
(docs/system.md §4). To let the model adapt, a training step draws one replay start s per sequence (uniform
over [W, T - 1], from a generator seeded by (seed, step) alone, so that resume stays exact and n ranks of batch B draw what one process of batch
n*B draws: `replay_starts`) and, in the decoder layers (mode `decoder`: from `dsv41.config.ced_split` up), the
encoder layers (`encoder`: below it) or both, hides every window key at a position < s from the queries at
positions >= s; the global (compressed) KV stays complete, as it is in the cache, and queries before s are
unchanged. It is one training prefill: `Transformer.forward` with `ForwardOptions(window_floor=[B],
window_floor_layers=...)`, where `window_indices`' prefill branch applies the floor to the queries at or after it
and `window_floor_layers` restricts it to the chosen layers. What it equals (tests/test_train_replay.py):
with the decoder floored at s = N - W, the engine's ced-bounded prefill of the first N tokens at position N - 1;
with every layer floored, a continuation from s over a store without SWA state. It is a simulation, not the
inference path in every detail: on a prefix hit the engine reuses the cached global KV of the replayed tokens
(computed with full windows) where training recomputes it from the truncated windows, and inference truncates the
encoder and the decoder at different starts (hit - n_win, prompt end - n_win) where training uses one s.
Evaluation (`val_loss`) measures the plain model.
"""

from __future__ import annotations

import torch

from dsv41.codecs import qdq_main_kv
from dsv41.model.cache import DenseCache


def straight_through(x: torch.Tensor, fn) -> torch.Tensor:
    """fn(x) in the forward pass, the identity in the backward pass."""
    return x + (fn(x) - x).detach()


def qdq_main_kv_ste(x: torch.Tensor) -> torch.Tensor:
    """The FP4 main-KV fake quantizer with a straight-through gradient."""
    return straight_through(x, qdq_main_kv)


class TrainCache(DenseCache):
    """The dense reference store for a training prefill (autograd flows through its slice writes and reads),
    with the main-KV QAT switch of the module docstring."""

    def __init__(self, cfg, batch: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_qat: bool = False):
        super().__init__(cfg, batch, dtype, device)
        self.kv_qat = kv_qat

    def append_compressed(self, layer: int, row0, kv: torch.Tensor, *args, **kwargs) -> None:
        if self.kv_qat:
            kv = qdq_main_kv_ste(kv)
        super().append_compressed(layer, row0, kv, *args, **kwargs)


def sequence_forward(model, ids: torch.Tensor, opts=None, kv_qat: bool = False):
    """The model's forward over whole sequences ids [B,T] from position 0 through a fresh `TrainCache`: the
    training prefill every evaluation, experiment and log-prob computation runs."""
    cache = TrainCache(model.cfg, ids.size(0), model.dtype, ids.device, kv_qat=kv_qat)
    return model(ids, cache, 0) if opts is None else model(ids, cache, 0, opts)
