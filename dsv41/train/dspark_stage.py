"""The DSpark drafter stage (docs/system.md §5): train only the drafter (`mtp.*`) on a frozen backbone, and measure
its per-position acceptance rate.

What the drafter computes at inference (docs/model.md §7, `dsv41.model.dspark.forward_spec`): after the target has
processed the token at position p, the drafter's window ring holds `main_x` (stage 0's projection of the
target's taps) for positions <= p; its block input is [token p+1 (just sampled by the target), noise x (G-1)]
at positions p+1..p+G, attending bidirectionally within the block and to the ring rows p-W+1..p; the logits of
block slot i, plus the Markov bias of the token in slot i (the sampled token for i = 0, the previous draft
after), propose the token at position p+2+i. G = `dspark_block_size`.

Training forward (`draft_forward`), every anchor p of a sequence at once: anchors become batch rows
[B*A, G]; the window part of each stage's attention is computed against all main-KV rows with a band mask
(keys p-W+1..p of anchor p) plus the anchor's own G draft keys and the sink, which is the same softmax as the
inference kernel's index list. The Markov input of slot i is teacher-forced with the real token at position
p+1+i: when drafts 1..i were accepted they equal the target's tokens, which is the condition under which
draft i+1 is ever verified. The stage's Block composition (mHC mixes, norms, MoE) is the model's own
`Block.forward` with this attention in place of the ring attention; `test_train_dspark.py` checks it against
`forward_spec` anchor by anchor.

Loss: the target's distribution at position p+1+i (the frozen backbone's softmax, which is what verification
compares against) as a soft target for draft slot i (cross-entropy = KL + const), averaged over the valid
(anchor, slot) pairs; plus a binary cross-entropy that trains the confidence head to predict the conditional
acceptance (slot i's greedy draft equals the target's greedy token, counted only where slots < i matched; its
inputs are detached so this loss trains the confidence head alone). Nothing reaches the backbone: its forward
runs under `no_grad` and its parameters (the tied embedding and LM head included) are frozen.

Data (`--dspark-data`): `greedy` (the default) trains on the backbone's own greedy continuations, self-
distillation as EAGLE-style drafters do: before the first step a pool of `--dspark-pool` prompts (each
[<|bos|>] + seq_len - GREEDY_NEW tokens from a random place of a distinct training document, as the speculative
benchmark's prompts are cut) is continued greedily by GREEDY_NEW tokens (`greedy_pool`), and each micro-batch draws
rows of it (`micro_extras`: a seeded permutation per pass); the loss counts only the anchors whose drafted tokens lie
in the continuation. There the teacher-forced Markov input is exactly what greedy decoding feeds the drafter (the
target's argmax, the token an accepted draft equals) and the ring holds the target's taps of its own text, so
training sees the distribution that inference sees, and the confidence head is fitted to the acceptance it will
predict. `corpus` trains on corpus windows (ground-truth context): on the 12-minute tiny backbone its 7-minute
drafter reached greedy acceptance 0.46 / 0.36 / 0.41 / 0.53 per position, and its confidence head, fitted to
corpus text, predicted 808 tokens where 376 were emitted at batch 8 (benchmarks/results/speculative-cpu-tiny-
2026-12-06b-trained.json).

Acceptance (greedy verification: draft i is accepted iff it equals the target's argmax, given drafts < i
accepted): a_i = #(slots 1..i all match) / #(slots 1..i-1 all match). Measured two ways:
  `teacher_forced`: on validation windows (ground-truth context);
  `greedy`: on sequences the backbone generated greedily from validation prompts, where the context is the
            target's own greedy output, i.e. exactly what speculative greedy decoding sees.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv41.kernels.mhc_math import hc_post, hc_pre
from dsv41.model.loading import load_model
from dsv41.train.qat import sequence_forward
from dsv41.train.stage import Stage, greedy_continue

CONFIDENCE_WEIGHT = 0.1
DEFAULT_ANCHORS = 32
GREEDY_NEW = 48        # tokens each pool prompt is continued by (the speculative benchmark generates 48 a request;
                       # the drafter's 64-token window then holds prompt and continuation, as at inference)


# ------------------------------------------------------------------------------------------------ forward

def _draft_attention(attn, u: torch.Tensor, main_x: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """DSparkAttention for many anchors. u [B*A,G,D] block inputs (row b*A + a: anchor p = anchors[a], at
    positions p+1..p+G), main_x [B,T,D]. Returns [B*A,G,D]."""
    B, T = main_x.shape[:2]
    G, H, dev = u.size(1), attn.n_heads, u.device
    p = anchors.to(dev)
    A = p.numel()
    mf = attn.window_kv(main_x, attn.rope.freqs(torch.arange(T).unsqueeze(0)).to(dev)).float()   # [B,T,C]
    freqs = attn.rope.freqs(slot_positions(T, G, anchors).repeat(B, 1)).to(dev)           # rows [B*A,G]
    _, q = attn.queries(u, freqs)                                                           # [B*A,G,H,C]
    kv = attn.window_kv(u, freqs)                                                           # [B*A,G,C]
    qf = q.float().view(B, A, G, H, -1)
    kvf = kv.float().view(B, A, G, -1)
    s_main = torch.einsum("baghc,btc->baght", qf, mf) * attn.softmax_scale                  # [B,A,G,H,T]
    t = torch.arange(T, device=dev)
    band = (t.view(1, T) <= p.view(A, 1)) & (t.view(1, T) > p.view(A, 1) - attn.window)     # [A,T]
    s_main = s_main.masked_fill(~band.view(1, A, 1, 1, T), -torch.inf)
    s_draft = torch.einsum("baghc,bakc->baghk", qf, kvf) * attn.softmax_scale               # [B,A,G,H,G]
    sink = attn.attn_sink.float().view(1, 1, 1, H, 1).expand(B, A, G, H, 1)
    probs = torch.softmax(torch.cat([s_main, s_draft, sink], dim=-1), dim=-1)
    o = (torch.einsum("baght,btc->baghc", probs[..., :T], mf)
         + torch.einsum("baghk,bakc->baghc", probs[..., T:T + G], kvf))
    return attn.output(o.reshape(B * A, G, H, -1).to(q.dtype), freqs)


def _stage(st, x: torch.Tensor, pre_mix: torch.Tensor, main_x: torch.Tensor, anchors: torch.Tensor):
    """`Block.forward` of one drafter stage with the many-anchor attention."""
    a_pre, a_post, a_comb = st.mixes(x, "attn")
    h = st.attn_norm(hc_pre(x, pre_mix))
    x = hc_post(_draft_attention(st.attn, h, main_x, anchors), x, a_post, a_comb)
    f_pre, f_post, f_comb = st.mixes(x, "ffn")
    h = st.ffn_norm(hc_pre(x, a_pre))
    return hc_post(st.ffn(h, None), x, f_post, f_comb), f_pre


def anchor_positions(T: int, first: int = 0) -> torch.Tensor:
    """Anchors first..T-2 of a window of T tokens (the last position has no next token to draft from)."""
    if not 0 <= first <= T - 2:
        raise ValueError(f"first anchor {first} outside 0..{T - 2} for {T} tokens")
    return torch.arange(first, T - 1)


def slot_positions(T: int, G: int, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """The positions p+1..p+G of the draft slots of anchors p (default 0..T-2), [A,G] on the CPU (past the end
    for the last anchors)."""
    anchors = anchor_positions(T) if anchors is None else anchors.cpu()
    return anchors.view(-1, 1) + 1 + torch.arange(G)


def anchor_ids(ids: torch.Tensor, G: int, fill: int, anchors: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """For anchors p (default 0..T-2): the tokens at p+1..p+G [B,A,G] (`fill` past the end), their validity."""
    B, T = ids.shape
    pos = slot_positions(T, G, anchors)                                                       # [A,G]
    valid = pos <= T - 1
    out = ids[:, pos.clamp(max=T - 1)]
    return torch.where(valid, out, torch.full_like(out, fill)), valid.expand(B, *pos.shape)


def draft_forward(model, main_hidden: torch.Tensor, markov_ids: torch.Tensor, anchors: torch.Tensor | None = None):
    """The drafter at anchors p (default 0..A-1) of a sequence.

    main_hidden [B,T,taps*D]: the target's taps of positions 0..T-1; markov_ids [B,A,G]: slot i's Markov input
    at each anchor (slot 0: the token at p+1, which is also the block's first input). Returns (logits
    [B,A,G,V] for the tokens at p+2..p+G+1, confidence logits [B,A,G])."""
    first, last = model.mtp[0], model.mtp[-1]
    B, A, G = markov_ids.shape
    anchors = torch.arange(A) if anchors is None else anchors
    main_x = first.main_norm(first.main_proj(main_hidden))                                  # [B,T,D]
    block = torch.full((B * A, G), model.cfg.dspark_noise_token_id, dtype=torch.long, device=markov_ids.device)
    block[:, 0] = markov_ids[:, :, 0].reshape(-1)
    h, pre_mix = model.streams_in(model.embed(block))                                         # [B*A,G,S,D]
    for st in model.mtp:
        h, pre_mix = _stage(st, h, pre_mix, main_x, anchors)
    x = hc_pre(h, pre_mix)                                                                   # [B*A,G,D]
    logits = model.head(last.norm(x).float())                                                # [B*A,G,V]
    bias, e = last.markov_head(markov_ids.reshape(B * A, G))
    logits = logits + bias
    confidence = last.confidence_head(x.detach(), e.detach())              # trains the confidence head alone
    return logits.view(B, A, G, -1), confidence.view(B, A, G)


# ------------------------------------------------------------------------------------------------ acceptance

def acceptance_counts(draft: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Greedy verification of [B,A,G] drafts against target tokens: counts[i] = anchors whose slots 0..i all
    match (anchors whose slots are all valid only). Returns [G+1] with counts[0] the number of anchors first."""
    full = valid.all(dim=-1)
    prefix = torch.cumprod((draft == target).long(), dim=-1)[full]                          # [N,G]
    return torch.cat([torch.tensor([prefix.size(0)]), prefix.sum(dim=0).cpu()])


def acceptance_rates(counts: torch.Tensor) -> dict:
    """Conditional acceptance a_i, prefix survival S_i and expected tokens per verification step
    (1 + sum_i S_i) from `acceptance_counts` summed over batches."""
    c = counts.double()
    n = float(c[0])
    rates = [float(c[i] / c[i - 1]) if c[i - 1] > 0 else 0.0 for i in range(1, len(c))]
    survival = [float(c[i] / n) if n else 0.0 for i in range(1, len(c))]
    return {"anchors": int(n), "acceptance": rates, "survival": survival, "tokens_per_step": 1 + sum(survival)}


# ------------------------------------------------------------------------------------------------ training

def drafts_and_targets(model, ids: torch.Tensor, anchors: torch.Tensor | None = None):
    """The frozen backbone's training prefill of ids [B,T] (no gradient), then the drafter at `anchors` (default
    0..T-2): (draft logits [B,A,G,V], confidence logits [B,A,G], the target's logits for each slot [B,A,G,V]: row
    p+1+i for slot i of anchor p, clamped at the end, slot validity [B,A,G], backbone logits [B,T,V] fp32)."""
    T, G = ids.size(1), model.cfg.dspark_block_size
    with torch.no_grad():
        out = sequence_forward(model, ids)
    target_logits = out.logits.float()
    markov, valid = anchor_ids(ids, G, model.cfg.engram_pad_id, anchors)
    logits, conf = draft_forward(model, out.main_hidden, markov.to(ids.device), anchors)
    rows = target_logits[:, slot_positions(T, G, anchors).clamp(max=T - 1).to(ids.device)]
    return logits, conf, rows, valid.to(ids.device), target_logits


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the drafts against the target's distribution, per slot: [..., V] -> [...]."""
    return -(torch.softmax(target_logits, -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


class DSparkTrainModule(nn.Module):
    """forward(ids [B,T], _, greedy=None) -> (loss, metrics): frozen backbone forward, then the drafter loss over
    the anchors of the last `anchors` positions (default: all). Every anchor costs G drafter tokens while the
    backbone costs one token per position, so training on the last quarter or so of each window keeps the step
    cheap, and those anchors have a full window of context when T - anchors >= W.

    greedy [B,T']: rows of the greedy pool (`greedy_pool`) to train on instead of ids; their anchors are those from
    `greedy_first` on (the last prompt position: its block's drafts are the continuation's tokens 2..)."""

    def __init__(self, model, anchors: int | None = None, greedy_first: int | None = None):
        super().__init__()
        self.model, self.anchors, self.greedy_first = model, anchors, greedy_first

    def forward(self, ids: torch.Tensor, _targets: torch.Tensor | None = None, greedy: torch.Tensor | None = None):
        if greedy is not None:
            if self.greedy_first is None:
                raise ValueError("greedy rows given to a DSparkTrainModule built without greedy_first")
            ids = greedy.to(ids.device)
            anchors = anchor_positions(ids.size(1), self.greedy_first)
        else:
            T = ids.size(1)
            anchors = anchor_positions(T, max(0, T - 1 - self.anchors) if self.anchors else 0)
        logits, conf, tl, valid, _ = drafts_and_targets(self.model, ids, anchors)
        n = valid.sum().clamp(min=1)
        loss = (soft_cross_entropy(logits, tl) * valid).sum() / n
        match = (logits.argmax(-1) == tl.argmax(-1)) & valid
        # the confidence target of slot i counts where slots < i all matched (where it is ever verified)
        w = torch.cumprod(torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], -1).long(), -1).bool() & valid
        bce = F.binary_cross_entropy_with_logits(conf, match.float(), reduction="none")
        conf_loss = (bce * w).sum() / w.sum().clamp(min=1)
        metrics = {"draft_ce": float(loss.detach()), "conf_bce": float(conf_loss.detach()),
                   "match": float((match.sum() / n).detach())}
        return loss + CONFIDENCE_WEIGHT * conf_loss, metrics


@torch.no_grad()
def evaluate_drafter(model, windows: torch.Tensor, batch_size: int) -> dict:
    """Teacher-forced drafter loss and acceptance on validation windows [N, T+1] (their first T tokens)."""
    counts = torch.zeros(model.cfg.dspark_block_size + 1, dtype=torch.long)
    losses = []
    dev = next(model.parameters()).device
    for i in range(0, windows.size(0), batch_size):
        logits, _, tgt, valid, _ = drafts_and_targets(model, windows[i:i + batch_size, :-1].to(dev))
        losses.append(float((soft_cross_entropy(logits, tgt) * valid).sum() / valid.sum()))
        counts += acceptance_counts(logits.argmax(-1), tgt.argmax(-1), valid)
    return {**acceptance_rates(counts), "draft_ce": sum(losses) / len(losses)}


@torch.no_grad()
def greedy_acceptance(model, prompts: torch.Tensor, n_new: int) -> dict:
    """Acceptance on the backbone's own greedy continuations of `prompts` [B,P] (`acceptance_rates`, its keys as
    greedy_*): anchors whose drafted tokens all lie in the generated part, target = the backbone's argmax on the
    whole sequence (what a verification forward computes)."""
    seq = greedy_continue(model, prompts, n_new)
    logits, _, tgt, valid, tl = drafts_and_targets(model, seq)
    A, P = seq.size(1) - 1, prompts.size(1)
    in_gen = (torch.arange(A) >= P - 1).view(1, A, 1).to(valid.device)
    rates = acceptance_rates(acceptance_counts(logits.argmax(-1), tgt.argmax(-1), valid & in_gen))
    return {**{f"greedy_{k}": v for k, v in rates.items()},
            "target_agrees_with_decode": float((tl[:, P - 1:-1].argmax(-1) == seq[:, P:]).float().mean())}


def greedy_prompts(tok, docs: list, n: int, length: int, seed: int) -> torch.Tensor:
    """n prompts [n, length] int64: [<|bos|>] + length - 1 tokens from a seeded random place of a document, each
    from a different document while there are enough of them (then again, at other places), documents shorter than
    that skipped."""
    from dsv41.train.data import BOS_ID
    rng = np.random.default_rng([seed, 28])
    order = rng.permutation(len(docs))
    cache: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for k in itertools.count():
        i = int(order[k % len(docs)])
        if i not in cache:                                     # encode the next 64 documents of the order at once
            nxt = [int(order[j % len(docs)]) for j in range(k, k + 64)]
            nxt = list(dict.fromkeys(j for j in nxt if j not in cache))
            cache.update(zip(nxt, (e.ids for e in tok.encode_batch([docs[j].text for j in nxt],
                                                                   add_special_tokens=False))))
        ids = cache[i]
        if len(ids) >= length - 1:
            a = int(rng.integers(0, len(ids) - (length - 1) + 1))
            out.append([BOS_ID] + ids[a:a + length - 1])
            if len(out) == n:
                return torch.tensor(out, dtype=torch.long)
        if k + 1 >= len(docs) and not out:
            raise ValueError(f"no document of the corpus has the {length - 1} tokens a greedy-pool prompt takes; "
                             "use --seq-len shorter or --dspark-data corpus")
    raise AssertionError("unreachable")


@torch.no_grad()
def greedy_pool(model, prompts: torch.Tensor, n_new: int, batch: int = 64) -> torch.Tensor:
    """The backbone's greedy continuations of prompts [N,P] by n_new tokens: [N, P + n_new] (the model in eval
    mode meanwhile). On the tiny preset with one CPU thread a batch of 64 rows costs ~0.4 s a token."""
    was = model.training
    model.eval()
    try:
        dev = next(model.parameters()).device
        return torch.cat([greedy_continue(model, prompts[i:i + batch].to(dev), n_new).cpu()
                          for i in range(0, prompts.size(0), batch)])
    finally:
        model.train(was)


def pool_rows(n: int, seed: int, start: int, count: int) -> torch.Tensor:
    """Rows start..start+count-1 of the pool's training order: pass e is a permutation of the n rows drawn from
    `numpy.random.default_rng([seed, e])`."""
    perms: dict[int, np.ndarray] = {}
    idx = [int(perms.setdefault(k // n, np.random.default_rng([seed, k // n]).permutation(n))[k % n])
           for k in range(start, start + count)]
    return torch.tensor(idx, dtype=torch.long)


class DSparkStage(Stage):
    """The drafter (`mtp.*`) trained on the frozen backbone of `--init`, with that checkpoint's tokenizer; only
    the drafter's MoEs are balanced. With `--dspark-data greedy` on a pool of the backbone's own greedy
    continuations (module docstring)."""
    prefix = "mtp."
    pool: torch.Tensor | None = None

    @property
    def source(self) -> str:
        return self.cfg.init

    def tokenizer(self, out, corpus, dist, say):
        init = Path(self.cfg.init)
        if not (init / "tokenizer.json").is_file():
            raise ValueError(f"--init {self.cfg.init}: no tokenizer.json (train with `dsv41 train` first)")
        prov = init / "tokenizer_provenance.json"
        self.corpus = corpus
        return init / "tokenizer.json", json.loads(prov.read_text()) if prov.is_file() else None

    def build_model(self, tokenizer):
        """The pretrained model of `--init` (its tokenizer.json, the one `tokenizer` was read from, gives Engram's
        token map)."""
        self.tok = tokenizer
        return load_model(self.cfg.init)[0]

    def train_module(self, model, say):
        cfg = self.cfg
        if cfg.dspark_data != "greedy":
            return DSparkTrainModule(model, DEFAULT_ANCHORS)
        n_new = min(GREEDY_NEW, cfg.seq_len // 2)
        P = cfg.seq_len - n_new
        t = time.time()
        self.pool = greedy_pool(model, greedy_prompts(self.tok, self.corpus.train, cfg.dspark_pool, P, cfg.seed),
                                n_new)
        self.pool_s = time.time() - t
        say(f"dspark data: greedy pool of {cfg.dspark_pool} prompts of {P} tokens continued by {n_new} "
            f"({self.pool_s:.1f}s)")
        return DSparkTrainModule(model, DEFAULT_ANCHORS, greedy_first=P - 1)

    def micro_extras(self, step, dist):
        """With the greedy pool: this rank's pool rows of each of step's micro-batches."""
        if self.pool is None:
            return super().micro_extras(step, dist)
        cfg, B = self.cfg, self.cfg.batch_size
        glob = B * dist.world
        return [(self.pool[pool_rows(self.pool.size(0), cfg.seed, (step * cfg.grad_accum + m) * glob + dist.rank * B,
                                     B)],) for m in range(cfg.grad_accum)]

    def evaluate(self, model, val):
        """Rank 0 measures, every rank gets the result."""
        res = val.dist.broadcast(evaluate_drafter(model, val.windows, val.batch_size) if val.dist.main else {})
        return {f"val_{k}": res[k] for k in ("draft_ce", "acceptance", "tokens_per_step")}

    def finish(self, model, val, corpus, tokenizer):
        """Acceptance on the backbone's own greedy continuations of validation prompts."""
        out = greedy_acceptance(model, val.windows[:8, :32].to(val.dist.device), min(96, self.cfg.seq_len))
        out["dspark_data"] = self.cfg.dspark_data
        if self.pool is not None:
            out.update(dspark_pool=self.pool.size(0), dspark_pool_s=self.pool_s)
        return out
