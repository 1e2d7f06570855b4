"""The pretraining stage (docs/system.md §6): a V4.1-architecture model from scratch, with its own byte-level BPE
tokenizer, next-token cross-entropy, and optionally the bounded-replay simulation (qat.py).

The training forward is a training prefill at position 0 through `TrainCache` (FP8/FP4 QDQ off), the fast one of
fast.py by default (the same function as the model's: dense masked attention, batched experts, matmul mHC;
`--no-fast` and FSDP2 take the reference). With `replay` (decoder | encoder | both) the sliding windows of those
layers are truncated at a replay start drawn per sequence and step. Evaluation (validation loss and bits per byte),
the QDQ evaluation at the end and the greedy sample run the model's own forward on the plain model.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv41.config import ced_split, load_config
from dsv41.model.common import set_quantization
from dsv41.model.engram import build_compressed_token_map
from dsv41.model.init import init_weights
from dsv41.model.step import ForwardOptions
from dsv41.model.transformer import Transformer
from dsv41.train import data as D
from dsv41.train.fast import fast_applies, fast_forward
from dsv41.train.indexer_loss import IndexerTap, indexer_kl
from dsv41.train.qat import TrainCache, sequence_forward
from dsv41.train.stage import Stage, Validation, greedy_continue

_REPLAY_STREAM = 0x7265706C                 # tags the replay-start seed (seed, step, tag): its own random stream


class LMTrainModule(nn.Module):
    """forward(ids [B,T], targets [B,T], floor [B] or None) -> (loss, metrics): a training prefill at position 0;
    the mean cross-entropy, plus `indexer_loss_weight` x the indexer objective (indexer_loss.py: the indexers
    learn from it alone, the rest of the model does not see it; metric `indexer_kl`). With `floor`, the sliding
    windows of `replay_layers` are truncated at each row's replay start for the queries at or after it (the
    bounded-replay simulation, qat.py)."""

    def __init__(self, model, kv_qat: bool = False, replay_layers: frozenset | None = None, fast: bool = False,
                 indexer_loss_weight: float = 0.0):
        super().__init__()
        self.model, self.kv_qat, self.replay_layers, self.fast = model, kv_qat, replay_layers, fast
        self.indexer_loss_weight = indexer_loss_weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, floor: torch.Tensor | None = None):
        m = self.model
        cache = TrainCache(m.cfg, ids.size(0), m.dtype, ids.device, kv_qat=self.kv_qat)
        opts = ForwardOptions(window_floor=floor, window_floor_layers=self.replay_layers)
        with IndexerTap(m) if self.indexer_loss_weight else contextlib.nullcontext() as tap:
            # the fast forward is the same function, faster (fast.py)
            logits = (fast_forward(m, ids, cache, opts) if self.fast and fast_applies(m)
                      else m(ids, cache, 0, opts).logits)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if tap is None:
            return loss, {}
        kl = indexer_kl(m, tap)
        return loss + self.indexer_loss_weight * kl, {"indexer_kl": float(kl.detach())}


def replay_layers(mcfg, mode: str) -> frozenset | None:
    """The layers whose sliding windows the bounded-replay simulation truncates (None for `off`): the decoder is
    the layers from the CED split (`dsv41.config.ced_split`) up, the encoder the layers below it."""
    if mode == "off":
        return None
    if mode == "both":
        return frozenset(range(mcfg.n_layers))
    split = ced_split(mcfg)
    if split is None:
        raise ValueError(f"--replay {mode}: the model has no KV-source layer, hence no encoder/decoder split; "
                         "use --replay both or off")
    return frozenset(range(split, mcfg.n_layers)) if mode == "decoder" else frozenset(range(split))


def replay_starts(seed: int, step: int, shape: tuple[int, ...], window: int, seq_len: int) -> torch.Tensor | None:
    """One optimizer step's replay starts, int64 of `shape` (micro-batches x global batch), uniform over
    [window, seq_len - 1], from a generator seeded by (seed, step) alone: a resumed run draws what the
    uninterrupted run drew, and n ranks of batch B draw what one process of batch n*B draws (rank r takes
    columns r*B..). None when seq_len - 1 < window (no start in range: the simulation is skipped)."""
    if seq_len - 1 < window:
        return None
    state = np.random.SeedSequence([seed, step, _REPLAY_STREAM]).generate_state(1, np.uint64)[0]
    return torch.randint(window, seq_len, shape, generator=torch.Generator().manual_seed(int(state)))


@torch.no_grad()
def evaluate_lm(model, val: Validation) -> dict:
    """Validation loss (nats per token, all targets) and bits per byte (targets that stand for bytes: special
    tokens excluded from both sums) over the fixed windows [N, T+1]; ranks take windows i % world == rank."""
    dist, windows = val.dist, val.windows
    sums = torch.zeros(4, dtype=torch.float64)                  # loss sum, tokens, byte-token loss sum, bytes
    n = max(dist.world, windows.size(0) // dist.world * dist.world)   # equal counts: FSDP2 forwards are collective
    mine = windows[:n][dist.rank::dist.world]
    for i in range(0, mine.size(0), val.batch_size):
        w = mine[i:i + val.batch_size].to(dist.device)
        with val.autocast():
            out = sequence_forward(model, w[:, :-1])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="none").double()
        nbytes = val.token_bytes.to(w.device)[w[:, 1:].flatten()].double()
        sums += torch.tensor([ce.sum(), ce.numel(), (ce * (nbytes > 0)).sum(), nbytes.sum()], dtype=torch.float64)
    dist.all_reduce(sums)
    return {"val_loss": float(sums[0] / sums[1]), "val_bpb": float(sums[2] / sums[3] / math.log(2))}


class PretrainStage(Stage):
    """A model of `--preset` from scratch, with its own tokenizer; next-token cross-entropy, optionally with the
    bounded-replay simulation."""

    def tokenizer(self, out, corpus, dist, say):
        """A BPE tokenizer trained on the training split (rank 0), reused when `out` holds one trained on the same
        corpus at the same vocabulary size."""
        tok_path, prov_path = out / "tokenizer.json", out / "tokenizer_provenance.json"
        want = {**corpus.provenance, "vocab_size": load_config(self.cfg.preset).vocab_size}
        fresh = not (tok_path.is_file() and prov_path.is_file()
                     and json.loads(prov_path.read_text()).get("tokenizer_of") == want)
        if fresh and dist.main:
            t = time.time()
            tok = D.train_tokenizer(corpus.train, want["vocab_size"])
            tok.save(str(tok_path))
            prov_path.write_text(json.dumps({"tokenizer_of": want}, indent=2) + "\n")
            say(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} ids, trained on {len(corpus.train)} documents "
                f"in {time.time() - t:.1f}s -> {tok_path}")
        dist.barrier()
        return tok_path, {"tokenizer_of": want}

    def build_model(self, tokenizer):
        """The preset's model with the tokenizer's ids (Engram's compressed vocabulary, pad, image and draft
        tokens), initialised from the seed."""
        mcfg = load_config(self.cfg.preset)
        if tokenizer.get_vocab_size() > mcfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {mcfg.vocab_size}")
        token_map, n_comp = build_compressed_token_map(tokenizer)
        ids = D.special_ids(tokenizer)
        mcfg = mcfg.replace(engram_compressed_vocab_size=n_comp, engram_pad_id=D.PAD_ID,
                            image_token_id=ids["<|image|>"], dspark_noise_token_id=ids["<|draft|>"])
        model = Transformer(mcfg, dtype=torch.float32, token_map=(token_map, n_comp) if mcfg.engram_enabled else None)
        init_weights(model, self.cfg.seed)
        with torch.no_grad():                      # aux-loss-free balancing starts from unbiased selection
            for name, p in model.named_parameters():
                if name.endswith(("gate.bias", "gate.bias_vl")):
                    p.zero_()
        return model

    def train_module(self, model, say):
        cfg, self.window = self.cfg, model.cfg.window_size
        self.replay_layers = replay_layers(model.cfg, cfg.replay)
        if self.replay_layers is not None:
            say(f"bounded-replay simulation ({cfg.replay}): layers {sorted(self.replay_layers)}, one start per "
                f"sequence uniform over [{self.window}, {cfg.seq_len - 1}]" if cfg.seq_len - 1 >= self.window else
                f"bounded-replay simulation ({cfg.replay}): skipped, --seq-len {cfg.seq_len} leaves no start in "
                f"[W={self.window}, seq_len-1]")
        weight = cfg.indexer_loss_weight
        if weight and cfg.fsdp:
            weight = 0.0
            say("indexer objective: off under --fsdp (it recomputes from the modules outside their forwards, "
                "where FSDP2 holds the parameters sharded)")
        return LMTrainModule(model, kv_qat=cfg.qat, replay_layers=self.replay_layers, fast=cfg.fast and not cfg.fsdp,
                             indexer_loss_weight=weight)

    def micro_extras(self, step, dist):
        """The replay starts of this rank's rows, one [B] tensor per micro-batch (none without replay)."""
        cfg, B = self.cfg, self.cfg.batch_size
        starts = None if self.replay_layers is None else replay_starts(
            cfg.seed, step, (cfg.grad_accum, B * dist.world), self.window, cfg.seq_len)
        if starts is None:
            return super().micro_extras(step, dist)
        return [(s[dist.rank * B:(dist.rank + 1) * B],) for s in starts]

    def evaluate(self, model, val):
        return evaluate_lm(model, val)

    def finish(self, model, val, corpus, tokenizer):
        """The validation loss with the inference numerics (FP8/FP4 QDQ on) and a greedy sample."""
        set_quantization(model, True)
        try:
            out = {"val_loss_qdq": evaluate_lm(model, val)["val_loss"]}
        finally:
            set_quantization(model, False)
        if self.cfg.sample_tokens > 0:
            doc = corpus.val[0].text
            prompt = doc[:doc.find("\n", 80) + 1 or 120]
            ids = torch.tensor([[D.BOS_ID] + tokenizer.encode(prompt).ids], device=val.dist.device)
            seq = greedy_continue(model, ids, self.cfg.sample_tokens)
            out.update(sample_prompt=prompt, sample=tokenizer.decode(seq[0, ids.size(1):].tolist()))
        return out
