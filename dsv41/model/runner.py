"""Drive the model the way the official generate loop and the golden oracle do, and capture what they capture
(docs/golden.md §3 and §4): one full prefill, K greedy decode steps with the DSpark drafter, and the
teacher-forced per-block mode (gate 1) that feeds every block its golden input stream.

Tensor names and layouts are those of the golden files, so `check.py` compares our output directly.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from dsv41.model.cache import DenseCache
from dsv41.model.step import ForwardOptions, StepContext


def _collect_prefill(model, rec: dict, out: dict) -> None:
    for r in model.roles:
        if r.is_index_source and ("topk", r.layer) in rec:
            out[f"topk.{r.layer}"] = rec[("topk", r.layer)]
        if ("cand", r.layer) in rec:
            out[f"candidates.{r.layer}"] = rec[("cand", r.layer)]
        idx, w = rec[("experts", r.layer)]
        out[f"experts.{r.layer}"] = idx.int()
        out[f"expert_weights.{r.layer}"] = w.float()


@torch.no_grad()
def run_logits(model, tokens: torch.Tensor, decode_steps: int = 0, official_decode_artifact: bool = False,
               token_types: torch.Tensor | None = None, images=None) -> dict[str, torch.Tensor]:
    """Prefill `tokens` [B,T] in one call, then `decode_steps` greedy steps (DSpark drafts each step when the
    model has it). Returns the golden tensor set."""
    cfg = model.cfg
    B, T = tokens.shape
    cache = DenseCache(cfg, B, model.dtype, tokens.device)
    rec: dict = {}
    res = model(tokens, cache, opts=ForwardOptions(token_types=token_types, images=images, record=rec,
                                                   official_decode_artifact=official_decode_artifact))
    out: dict[str, torch.Tensor] = {"tokens": tokens, "prefill_logits": res.logits.float()}
    _collect_prefill(model, rec, out)
    if "embed_out" in rec and images is not None:
        out["embed_out"] = rec["embed_out"].float()
    if cfg.dspark_enabled:
        model.draft(None, res.main_hidden, cache, 0)
    steps: dict[str, list[torch.Tensor]] = {}            # capture name -> its tensor of each decode step
    nxt = res.logits[:, -1].argmax(-1)
    for k in range(decode_steps):
        rec = {}
        r = model(nxt.unsqueeze(1), cache,
                  opts=ForwardOptions(record=rec, official_decode_artifact=official_decode_artifact))
        new = {"decode_tokens": nxt, "decode_logits": r.logits[:, -1].float()}
        new.update({f"decode_topk.{ro.layer}": rec[("topk", ro.layer)][:, 0] for ro in model.roles
                    if ro.is_index_source and ("topk", ro.layer) in rec})
        nxt = r.logits[:, -1].argmax(-1)
        if cfg.dspark_enabled:
            ids, lg, conf = model.draft(nxt, r.main_hidden, cache, T + k)
            new.update(dspark_tokens=ids, dspark_logits=lg.float(), dspark_confidence=conf.float())
        for name, t in new.items():
            steps.setdefault(name, []).append(t)
    out.update({name: _pad_stack(ts) if name.startswith("decode_topk.") else torch.stack(ts, 1)
                for name, ts in steps.items()})
    return out


def _pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.size(-1) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.size(-1)), value=-1) for r in rows], 1)


@torch.no_grad()
def run_teacher_forced(model, golden: dict[str, torch.Tensor], official_decode_artifact: bool = False,
                       prompt_chunks: list[int] | None = None, token_types: torch.Tensor | None = None,
                       images=None) -> dict[str, torch.Tensor]:
    """Gate 1 of docs/golden.md §4: every block L >= 1 gets the golden input stream
    (`engram_out.L` for Engram layers, else `block_out.{L-1}`) and pre_mix `block_pre_out.{L-1}`; each Engram
    module gets `block_out.{L-1}`. Caches, indices and selections are our own. The prompt runs in one call (or
    in `prompt_chunks` pieces: chunked prefill checked block by block), then one decode step per golden
    `decode_tokens` column. Returns our block outputs under the capture names.

    Image prompts (docs/vision-golden.md §5, gate 1): block 0 gets the golden `embed_out`; our own merged
    embedding is saved as `embed_out`, and routing / Engram use our own image mask from `token_types`."""
    cfg = model.cfg
    tokens = golden["tokens"]
    B, T = tokens.shape
    cache = DenseCache(cfg, B, model.dtype, tokens.device)
    dec = golden.get("decode_tokens")
    chunks = prompt_chunks or [T]
    if sum(chunks) != T:
        raise ValueError(f"prompt_chunks {chunks} do not add up to the prompt length {T}")
    bounds = list(accumulate(chunks, initial=0))      # steps: (token ids, capture prefix, slice of the golden tensors)
    steps = [(tokens[:, lo:hi], "", slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    steps += [(dec[:, k:k + 1], "decode_", slice(k, k + 1)) for k in range(0 if dec is None else dec.size(1))]
    outs: dict[str, list[torch.Tensor]] = {}
    dt = model.dtype

    def gold(name: str, prefix: str, sl: slice) -> torch.Tensor:
        return golden[prefix + name][:, sl].to(dt)

    def keep(name: str, t: torch.Tensor) -> None:
        outs.setdefault(name, []).append(t.float())

    for ids, prefix, sl in steps:
        P, Tn = cache.pos, ids.size(1)
        image_mask = token_types[:, sl] >= 0 if token_types is not None and not prefix else None
        ctx = StepContext(P.clone(), Tn, cache, ForwardOptions(official_decode_artifact=official_decode_artifact),
                          image_mask=image_mask)
        hashes = model.engram_hashes(ids, cache, ctx.token_mask)
        emb = model.embed_tokens(ids, images if (images is not None and not prefix) else None)
        if "embed_out" in golden:
            keep(f"{prefix}embed_out", emb)
            emb = gold("embed_out", prefix, sl)
        for L, layer in enumerate(model.layers):
            if L == 0:
                x, pre = model.streams_in(emb)
            else:
                x = gold(f"block_out.{L - 1}", prefix, sl)
                pre = gold(f"block_pre_out.{L - 1}", prefix, sl).float()
            if layer.engram is not None:
                keep(f"{prefix}engram_out.{L}", model.block_input(layer, x, ctx, hashes))
                x = gold(f"engram_out.{L}", prefix, sl)
            y, pre_out = layer(x, pre, ctx)
            keep(f"{prefix}block_out.{L}", y)
            keep(f"{prefix}block_pre_out.{L}", pre_out)
        last = len(model.layers) - 1
        logits, hidden = model.logits_from(gold(f"block_out.{last}", prefix, sl),
                                           gold(f"block_pre_out.{last}", prefix, sl).float())
        keep(f"{prefix}final_hidden", hidden)
        keep("decode_logits" if prefix else "prefill_logits", logits)
        cache.pos = P + Tn
    res = {name: torch.cat(v, dim=1) for name, v in outs.items()}
    res["tokens"] = tokens
    if dec is not None:
        res["decode_tokens"] = dec
    return res


def captures_from_record(rec: dict, model, tokens: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Turn a `record` of our own forward into the golden capture layout (to teacher-force against ourselves)."""
    out = {"tokens": tokens, "prefill_logits": logits.float()}
    for L in range(len(model.layers)):
        out[f"block_out.{L}"] = rec[("block_out", L)].float()
        out[f"block_pre_out.{L}"] = rec[("block_pre_out", L)].float()
        if ("engram_out", L) in rec:
            out[f"engram_out.{L}"] = rec[("engram_out", L)].float()
    return out


def rel_rows(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row (rows = all leading dims but the batch and position axes flattened after)."""
    a = ours.float().flatten(2)
    b = ref.float().flatten(2)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def first_divergent(ours: torch.Tensor, ref: torch.Tensor, threshold: float = 1e-5) -> list[int]:
    """Per sequence, the first position whose row differs by more than `threshold` (T when none does)."""
    r = rel_rows(ours, ref)
    out = []
    for b in range(r.size(0)):
        idx = (r[b] > threshold).nonzero()
        out.append(int(idx[0]) if len(idx) else r.size(1))
    return out


def compare_captures(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], threshold: float = 1e-5,
                     max_outliers: int = 1) -> dict[str, dict]:
    """Gate-1 style report: per capture tensor, max / median relative error per row and rows above threshold."""
    report = {}
    for name, t in ours.items():
        captured = name.startswith(("block_out", "block_pre_out", "engram_out", "final_hidden", "decode_"))
        if not captured or name in ("decode_tokens", "decode_logits") or name not in ref:
            continue
        r = rel_rows(t, ref[name])
        report[name] = {"max": r.max().item(), "median": r.median().item(),
                        "outliers": int((r > threshold).sum()), "ok": int((r > threshold).sum()) <= max_outliers}
    return report
