"""Study: retrieval of a needle (one pair of a kv-compact document, queried at the end) bucketed by the pair's
depth in the document and by whether its entries fell into the hierarchical indexer's candidate pool, with the
pool's recall of the needle and of the attention's own top-k; then the retrieval accuracy per depth with each
approximation alone and all stacked (`counterparts.py`), docs/system.md §9 study 3.

Documents: `size` pairs (each followed by `filler` lines of words, for contexts past 512 tokens), then `queries`
of them asked in random order, so every answer lies at the end and its pair
at depth (pair index / pairs) in [0, 1). The needle's entries are those holding the pair's key and value tokens
(`needle_tokens`; entry n of a ratio-m layer covers tokens [n m, (n+1) m)); the row that predicts the value is the
query key's.

Pool membership (exact forward, one training prefill): the candidate source's pool mask (the blocks the Reindex
layers' indexers may score) at that row, over the visible entries; "in top-k" is the Reindex indexer's own
selection. Pool recall of the attention's top-k: of the K entries a Reindex layer's attention weighs most over
every visible entry (`indexer_loss.attention_target`, its exact counterpart), the share inside the pool, over the
rows that see more than K entries. Accuracy per variant: the prompt prefilled up to the first answer, the rest
decoded teacher-forced (`counterparts.run_variant`).
"""

from __future__ import annotations

import torch

from dsv41.experiments.approximations import variants
from dsv41.experiments.counterparts import run_variant
from dsv41.experiments.report import markdown_table
from dsv41.model.step import ForwardOptions
from dsv41.train.fast import index_mask
from dsv41.train.indexer_loss import IndexerTap, attention_target, support_mask
from dsv41.train.qat import TrainCache
from dsv41.train.tasks_longctx import answer_correct, encode_tasks, task_documents

DEPTHS = 4                      # depth buckets over [0, 1)
TASK = "kv-compact"


def _depth_bucket(depth: float) -> int:
    return min(int(depth * DEPTHS), DEPTHS - 1)


def _pool_layers(model) -> tuple[int, list[int]]:
    """(candidate source, the Reindex layers that score inside its pool)."""
    roles = [b.attn.role for b in model.layers]
    src = [r.layer for r in roles if r.is_candidate_source]
    users = [r.layer for r in roles if r.uses_candidates]
    if not src or not users:
        raise ValueError("the model has no candidate pool (no candidate source / Reindex layer)")
    return src[0], users


def needle_tokens(tokenizer, doc, a: int) -> list[int]:
    """Token positions (after <|bos|>, as `encode_tasks` numbers them) of answer a's pair: the tokens that overlap
    its pair line after the line's marker (": key value" -> the key and the value)."""
    s = doc.sources[a]
    end = doc.text.index("\n", s)
    offsets = tokenizer.encode(doc.text, add_special_tokens=False).offsets
    return [i + 1 for i, (lo, hi) in enumerate(offsets) if lo < end and hi > s + 1]


@torch.no_grad()
def pool_records(model, tokenizer, docs) -> tuple[list[dict], dict]:
    """Per answer of `docs` (exact forward): right, depth, distance, in_pool, in_topk; and the pool's recall of
    the Reindex layers' attention top-k over all rows that see more than K entries."""
    src, users = _pool_layers(model)
    device = next(model.parameters()).device
    recs, hits, total = [], 0, 0
    for doc in docs:
        enc = encode_tasks(tokenizer, [doc])
        ids = enc.ids.to(device)
        record: dict = {}
        with IndexerTap(model) as tap:
            out = model(ids, TrainCache(model.cfg, 1, model.dtype, device), 0, ForwardOptions(record=record))
        pool = record[("cand", src)][0].cpu()                                       # [T,N]
        m = model.layers[src].attn.role.ratio
        topk = {L: index_mask(record[("topk", L)], pool.size(-1))[0].cpu() for L in users}
        right = answer_correct(out.logits, ids, enc.answers)[0]
        pair_chars = doc.text.index("\n?") + 1                                     # the pair lines
        for a, ok in enumerate(right):
            row, s = enc.answers[0][a][0] - 1, enc.sources[0][a]
            entries = sorted({p // m for p in needle_tokens(tokenizer, doc, a)})
            recs.append({"right": bool(ok), "depth": doc.sources[a] / pair_chars, "distance": row + 1 - s,
                         "entries": entries,
                         "in_pool": any(bool(pool[row, n]) for n in entries),
                         "in_topk": {L: any(bool(t[row, n]) for n in entries) for L, t in topk.items()}})
        for L in users:
            u, _qr, freqs, ctx, _ = tap.calls[L]
            attn = model.layers[L].attn
            N, K = pool.size(-1), attn.topk
            sup = support_mask(attn, ctx, N, None, u.device)
            rows = sup.sum(-1) > K
            if bool(rows.any()):
                top = attention_target(attn, u, freqs, ctx, sup).masked_fill(~sup, -1.0).topk(K, dim=-1).indices
                h = record[("cand", src)].gather(-1, top)[rows]
                hits, total = hits + int(h.sum()), total + h.numel()
    return recs, {"pool_recall_of_attention_topk": hits / total if total else float("nan"), "entries": total}


def _accuracy(recs: list[dict]):
    return sum(r["right"] for r in recs) / len(recs) if recs else None


@torch.no_grad()
def variant_accuracy(model, tokenizer, docs) -> dict[str, list[list[bool]]]:
    """Per variant (`approximations.variants`): per document, per answer, right or not."""
    out: dict[str, list] = {}
    for doc in docs:
        enc = encode_tasks(tokenizer, [doc])
        answers = enc.answers[0]
        P, end = min(a[0] for a in answers), max(a[-1] for a in answers) + 1
        ids = enc.ids[:, :end].to(next(model.parameters()).device)
        for name, _, v in variants():
            logits = run_variant(model, ids, P, v)
            out.setdefault(name, []).append(answer_correct(logits, ids, enc.answers, offset=P - 1)[0])
    return out


def needle_study(model, tokenizer, sizes=(16, 32, 64), docs: int = 8, queries: int = 8, seed: int = 1,
                 with_variants: bool = True, fillers=(0,)) -> dict:
    """The module docstring's tables over `docs` documents of each size (pairs) and number of filler lines a pair;
    with_variants False skips the accuracy per approximation (the decode-step part, most of the study's time)."""
    rows, var_rows = [], []
    for size, filler in [(s, f) for f in fillers for s in sizes]:
        ds = task_documents(TASK, docs, seed, size, queries, filler)
        tokens = sum(len(tokenizer.encode(d.text).ids) for d in ds) / len(ds)
        recs, pool = pool_records(model, tokenizer, ds)
        W = model.cfg.window_size
        far = [r for r in recs if r["distance"] > W]
        for b in range(DEPTHS):
            part = [r for r in far if _depth_bucket(r["depth"]) == b]
            inp = [r for r in part if r["in_pool"]]
            out = [r for r in part if not r["in_pool"]]
            rows.append({"pairs": size, "filler": filler, "tokens": tokens,
                         "depth": f"{b / DEPTHS:.2f}-{(b + 1) / DEPTHS:.2f}", "answers": len(part),
                         "accuracy": _accuracy(part), "in_pool": len(inp) / len(part) if part else None,
                         "accuracy_in_pool": _accuracy(inp), "accuracy_out_of_pool": _accuracy(out)})
        flags = variant_accuracy(model, tokenizer, ds) if with_variants else {}
        depth = [_depth_bucket(r["depth"]) for r in recs]
        for name, per_doc in flags.items():
            flat = [f for d in per_doc for f in d]
            by = [[f for f, k in zip(flat, depth) if k == b] for b in range(DEPTHS)]
            var_rows.append({"pairs": size, "filler": filler, "tokens": tokens, "variant": name,
                             "accuracy": sum(flat) / len(flat),
                             "by_depth": [sum(x) / len(x) if x else None for x in by]})
        rows[-DEPTHS]["pool_recall_of_attention_topk"] = pool["pool_recall_of_attention_topk"]
        rows[-DEPTHS]["needle_pool_recall"] = sum(r["in_pool"] for r in far) / len(far) if far else None
        rows[-DEPTHS]["needle_topk_recall"] = (sum(any(r["in_topk"].values()) for r in far) / len(far) if far
                                               else None)
    return {"rows": rows, "variants": var_rows, "docs": docs, "queries": queries, "chance": 0.01}


def _cell(v):
    return "-" if v is None else v


def table(result: dict) -> str:
    a = markdown_table(["pairs", "filler", "tokens", "needle depth", "answers (beyond window)", "accuracy",
                        "needle in pool", "accuracy in pool", "accuracy out of pool"],
                       [[r["pairs"], r.get("filler", 0), round(r.get("tokens", 0)), r["depth"], r["answers"],
                         _cell(r["accuracy"]), _cell(r["in_pool"]), _cell(r["accuracy_in_pool"]),
                         _cell(r["accuracy_out_of_pool"])] for r in result["rows"]])
    recall = markdown_table(["pairs", "filler", "pool recall of the needle", "Reindex top-k recall of the needle",
                             "pool recall of the attention's top-k"],
                            [[r["pairs"], r.get("filler", 0), _cell(r["needle_pool_recall"]),
                              _cell(r["needle_topk_recall"]), r["pool_recall_of_attention_topk"]]
                             for r in result["rows"] if "needle_pool_recall" in r])
    heads = [f"depth {b / DEPTHS:.2f}-{(b + 1) / DEPTHS:.2f}" for b in range(DEPTHS)]
    b = markdown_table(["pairs", "filler", "variant", "accuracy"] + heads,
                       [[r["pairs"], r.get("filler", 0), r["variant"], r["accuracy"]]
                        + [_cell(x) for x in r["by_depth"]]
                        for r in result["variants"]])
    return f"{a}\n{recall}\nAccuracy with each approximation (all answers; chance {result['chance']}):\n\n{b}"


def plot(result: dict):
    def draw(ax):
        names = list(dict.fromkeys(r["variant"] for r in result["variants"]))
        for name in names:
            mine = sorted((r.get("tokens", r["pairs"] * 8), r["accuracy"]) for r in result["variants"]
                          if r["variant"] == name)
            ax.plot([t for t, _ in mine], [a for _, a in mine], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the document (mean)")
        ax.set_ylabel("retrieval accuracy")
        ax.legend(fontsize=7)
    return draw
