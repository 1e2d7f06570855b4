"""Study: a fixed global-KV budget split differently (docs/system.md §9 study 1): task models whose KV sources
differ in number and compression ratio (encoder below the CED split, decoder above it) but store the same global
KV bytes per token (`dsv41.analysis.kv_bytes.global_kv_bytes_per_token`: sum over KV sources of entry / m), each
trained with the same curriculum (same tokens, `taskmodel.train_task_model`), reported as validation loss and
retrieval accuracy against bytes per token.

The splits are edits of the task preset (8 layers: 2 window-only, then 6 with compressed attention; the sliding
window, top-k and everything else unchanged), all at 1.5 entries per token:
  preset            encoder: KV source 2 at m = 2 (+ Reuse 3); decoder: KV source 4 at m = 1 (Reuse 5, Reindex 6
                    in its candidate pool, Reuse 7)
  swapped           encoder at m = 1, decoder at m = 2 (the same layers)
  three m=2         KV sources 2, 4, 6 at m = 2 (each followed by a Reuse layer)
  six m=4           every compressed layer its own KV source at m = 4
  m=1 4 4           KV source 2 at m = 1, 4 and 6 at m = 4 (each followed by a Reuse layer; encoder 2-5,
                    decoder 6-7)
  m=4 4 1           encoder: KV sources 2 and 3 at m = 4; decoder: KV source 4 at m = 1 with the preset's Reuse 5,
                    Reindex 6 and Reuse 7
The CED split is `dsv41.config.ced_split`: the decoder starts at the last KV source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenizers import Tokenizer

from dsv41.analysis.kv_bytes import global_kv_bytes_per_token
from dsv41.config import ModelConfig, ced_split
from dsv41.experiments.report import markdown_table
from dsv41.model.loading import load_model
from dsv41.experiments.taskmodel import (CURRICULA, TASK_PRESET, accuracy_by_length, scaled, study_device,
                                         train_task_model)

SPLITS = {   # name: (compress ratios of the 8 layers, KV sources, index sources, candidate source)
    "preset": ((0, 0, 2, 2, 1, 1, 1, 1), (2, 4), (2, 4, 6), 4),
    "swapped": ((0, 0, 1, 1, 2, 2, 2, 2), (2, 4), (2, 4, 6), 4),
    "three m=2": ((0, 0, 2, 2, 2, 2, 2, 2), (2, 4, 6), (2, 4, 6), -1),
    "six m=4": ((0, 0, 4, 4, 4, 4, 4, 4), (2, 3, 4, 5, 6, 7), (2, 3, 4, 5, 6, 7), -1),
    "m=1 4 4": ((0, 0, 1, 1, 4, 4, 4, 4), (2, 4, 6), (2, 4, 6), -1),
    "m=4 4 1": ((0, 0, 4, 4, 1, 1, 1, 1), (2, 3, 4), (2, 3, 4, 6), 4),
}


def split_config(base: ModelConfig, name: str) -> ModelConfig:
    """The task preset with split `name`'s KV sources (the MTP layers keep their ratios)."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
    ratios, kv, idx, cand = SPLITS[name]
    if len(ratios) != base.n_layers:
        raise ValueError(f"the splits are written for {len(ratios)} layers, the base config has {base.n_layers}")
    return base.replace(compress_ratios=tuple(ratios) + tuple(base.compress_ratios[base.n_layers:]),
                        kv_source_layers=kv, index_source_layers=idx, candidate_source_layer=cand)


def budget_study(out: str | Path, scale: float = 1.0, names=tuple(SPLITS), sizes=(8, 16, 32), docs: int = 16,
                 seed: int = 1, curriculum: str = "cpu", train_seed: int = 0, fillers=(0,), **train_kw) -> dict:
    """Train one task model per split under `out`/NAME (the curriculum's steps x `scale`; `train_kw` to
    `train_task_model`: threads, device, ...; `curriculum` a name of `taskmodel.CURRICULA`, `train_seed` the
    training seed; a seed other than 0 trains into NAME-seedS) and evaluate it on `docs` documents of each size
    drawn with `seed`. A split whose model was already trained there with the same settings (its `trained.json`,
    written after training) is not trained again, nor evaluated again at the same evaluation settings (its
    `evaluated.json`), so splits can be trained by separate processes (`--splits`) and one run of all of them then
    writes the whole report."""
    base = ModelConfig.from_json(TASK_PRESET)
    stages = scaled(CURRICULA[curriculum], scale)
    device = study_device(train_kw.get("device", "auto"))
    rows = []
    for name in names:
        cfg = split_config(base, name)
        d = Path(out) / (name.replace(" ", "-").replace("=", "") + (f"-seed{train_seed}" if train_seed else ""))
        d.mkdir(parents=True, exist_ok=True)
        (d / "preset.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        kw = train_kw | ({"seed": train_seed} if train_seed else {})
        settings = {"preset": cfg.to_dict(), "curriculum": [vars(st) for st in stages],
                    "train": {k: v for k, v in sorted(kw.items()) if k not in ("threads", "device")}}
        done = d / "trained.json"
        previous = json.loads(done.read_text()) if done.is_file() else None
        trained = previous is not None and previous["settings"] == json.loads(json.dumps(settings))
        if trained:
            summary, train_s = previous["summary"], previous["train_s"]
        else:
            t = time.time()
            summary = train_task_model(d / "model", preset=str(d / "preset.json"), curriculum=stages, quiet=True,
                                       **kw)
            train_s = time.time() - t
            done.write_text(json.dumps({"settings": settings, "summary": summary, "train_s": train_s}, indent=1,
                                       default=float) + "\n")
        evaluated = d / "evaluated.json"         # this model's accuracy at these evaluation settings, if measured
        at = {"sizes": list(sizes), "docs": docs, "seed": seed, "fillers": list(fillers)}
        before = json.loads(evaluated.read_text()) if trained and evaluated.is_file() else None
        if before is not None and before["at"] == at:
            acc = before["accuracy"]
        else:
            model, _ = load_model(d / "model", device=device)
            acc = accuracy_by_length(model.eval(), Tokenizer.from_file(str(d / "model" / "tokenizer.json")), sizes,
                                     docs, seed, fillers)
            evaluated.write_text(json.dumps({"at": at, "accuracy": acc}, indent=1) + "\n")
        far = [r["accuracy_beyond_window"] for r in acc["sizes"]]
        rows.append({"split": name, "ratios": list(SPLITS[name][0]), "kv_sources": list(SPLITS[name][1]),
                     "ced_split": ced_split(cfg), "bytes_per_token": float(global_kv_bytes_per_token(cfg)),
                     "val_loss": summary.get("val_loss"), "accuracy": [r["accuracy"] for r in acc["sizes"]],
                     "accuracy_beyond_window": far, "tokens": [r["tokens"] for r in acc["sizes"]],
                     "train_s": train_s})
    return {"rows": rows, "sizes": list(sizes), "fillers": list(fillers), "scale": scale, "chance": 0.01,
            "train_seed": train_seed, "curriculum": [vars(st) for st in stages], "device": str(device)}


def table(result: dict) -> str:
    heads = [f"acc. {s} pairs{f' + {f} filler' if f else ''} (beyond window)"
             for f in result.get("fillers", [0]) for s in result["sizes"]]
    return markdown_table(["split", "ratios (layers 0-7)", "KV sources", "global KV B/token", "val loss"] + heads
                          + ["train s"],
                          [[r["split"], " ".join(map(str, r["ratios"])), " ".join(map(str, r["kv_sources"])),
                            r["bytes_per_token"], r["val_loss"]]
                           + [("-" if a is None else a) for a in r["accuracy_beyond_window"]] + [round(r["train_s"])]
                           for r in result["rows"]])


def plot(result: dict):
    def draw(ax):
        for r in result["rows"]:
            pts = sorted(zip(r.get("tokens", result["sizes"]), [a or 0.0 for a in r["accuracy_beyond_window"]]))
            ax.plot([t for t, _ in pts], [a for _, a in pts], marker="o",
                    label=f"{r['split']} ({r['bytes_per_token']:.0f} B/token, val {r['val_loss']:.3f})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the document (longest)")
        ax.set_ylabel("retrieval accuracy (pair beyond the window)")
        ax.legend(fontsize=7)
    return draw
