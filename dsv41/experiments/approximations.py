"""Study: every approximation of the inference path alone and all stacked, each against its exact counterpart
(`counterparts.py`), on a task model's retrieval documents: logit KL(exact || approx), top-1 agreement and the
task's retrieval accuracy, over the positions from the first answer to the document's last answer.

Each document is one sequence: the prompt runs up to the first answer's value (prefilled in the variant's mode),
the rest is decoded teacher-forced one token at a time, so every answer is predicted by a decode step.
"""

from __future__ import annotations

import torch

from dsv41.experiments.counterparts import (APPROXIMATIONS, COUNTERPARTS, EXACT, STACKED, alone, compare,
                                            run_variant)
from dsv41.experiments.report import markdown_table
from dsv41.train.tasks_longctx import answer_correct, encode_tasks


def variants() -> list[tuple[str, str, object]]:
    """(name, exact counterpart, variant): the reference, each approximation alone, all stacked."""
    rows = [("exact (all counterparts)", "-", EXACT)]
    rows += [(APPROXIMATIONS[k], COUNTERPARTS[k], alone(k)) for k in APPROXIMATIONS]
    return rows + [("all stacked", "exact (all counterparts)", STACKED)]


@torch.no_grad()
def approximation_study(model, tokenizer, docs) -> dict:
    """Per variant: mean KL, max KL, top-1 agreement (against EXACT) and retrieval accuracy over `docs`."""
    sums: dict[str, dict] = {}
    for doc in docs:
        enc = encode_tasks(tokenizer, [doc])
        answers = enc.answers[0]
        P, end = min(a[0] for a in answers), max(a[-1] for a in answers) + 1
        ids = enc.ids[:, :end].to(next(model.parameters()).device)
        exact = None
        for name, _, v in variants():
            logits = run_variant(model, ids, P, v)
            exact = logits if exact is None else exact
            right = answer_correct(logits, ids, enc.answers, offset=P - 1)[0]
            s = sums.setdefault(name, {"kl": 0.0, "kl_max": 0.0, "top1": 0.0, "right": 0, "answers": 0, "n": 0})
            c = compare(exact, logits)
            s["kl"] += c["kl"]
            s["top1"] += c["top1"]
            s["kl_max"] = max(s["kl_max"], c["kl_max"])
            s["right"] += sum(right)
            s["answers"] += len(right)
            s["n"] += 1
    rows = []
    for name, counterpart, v in variants():
        s = sums[name]
        rows.append({"approximation": name, "counterpart": counterpart, "variant": vars(v),
                     "kl": s["kl"] / s["n"], "kl_max": s["kl_max"], "top1": s["top1"] / s["n"],
                     "accuracy": s["right"] / max(s["answers"], 1), "answers": s["answers"]})
    return {"rows": rows, "documents": len(docs)}


def table(result: dict) -> str:
    return markdown_table(["approximation", "exact counterpart", "KL (nats)", "max KL", "top-1 agreement",
                           "retrieval accuracy"],
                          [[r["approximation"], r["counterpart"], r["kl"], r["kl_max"], r["top1"], r["accuracy"]]
                           for r in result["rows"]])


def plot(result: dict):
    def draw(ax):
        rows = result["rows"][1:]
        ax.barh([r["approximation"] for r in rows], [r["kl"] for r in rows])
        ax.set_xscale("log")
        ax.set_xlabel("mean KL(exact || approximation), nats")
        ax.invert_yaxis()
    return draw
