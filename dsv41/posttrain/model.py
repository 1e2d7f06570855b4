"""The post-training model: the `post` preset (dsv41/presets/post.json, the debug architecture with every mechanism
kept: CSA / HCA layers, indexer, candidate pool, mHC, MoE, Engram, MTP, DSpark drafter, FP8 / FP4 weights; a
vocabulary of 128 for the post-training tokenizer) built for that tokenizer, and its checkpoints.

The preset is read by path (the named presets of dsv41/config.py are the pretraining ones). Calibrated on the tasks
(benchmarks/results/posttrain-cpu-2026-12-05c/diag): a sliding window of 64 (a whole prompt and response, so the
effort line is in every position's window; the compressed layers still run over the same tokens) and experts of
64 hidden units (the mod-10 step is a 100-entry table); 2,500 SFT steps at batch 16 take ~14 min on one core.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsv41.config import load_config
from dsv41.model.engram import build_compressed_token_map
from dsv41.model.init import init_weights
from dsv41.model.loading import load_model, save_checkpoint
from dsv41.model.transformer import Transformer
from dsv41.posttrain.tokenizer import DRAFT, IMAGE, PostTokenizer, load_post_tokenizer

PRESET = Path(__file__).resolve().parents[1] / "presets" / "post.json"


def build_model(tokenizer: PostTokenizer, seed: int = 0, preset: str | Path = PRESET) -> torch.nn.Module:
    """A fresh model of `preset` for the tokenizer's ids (Engram's compressed vocabulary, pad, image and draft
    tokens), initialised from `seed`, fp32 on the CPU, gate biases zero."""
    cfg = load_config(preset)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, the preset {preset} {cfg.vocab_size}")
    tm = build_compressed_token_map(tokenizer.tok)
    cfg = cfg.replace(engram_compressed_vocab_size=tm[1], engram_pad_id=tokenizer.pad_id,
                      image_token_id=tokenizer.tok.token_to_id(IMAGE),
                      dspark_noise_token_id=tokenizer.tok.token_to_id(DRAFT))
    model = Transformer(cfg, dtype=torch.float32, token_map=tm if cfg.engram_enabled else None)
    init_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.bias", "gate.bias_vl")):
                p.zero_()
    return model


def save(model, tokenizer: PostTokenizer, out: str | Path, meta: dict) -> Path:
    """The model in our checkpoint format with the tokenizer beside it, and `meta` as posttrain.json."""
    out = Path(out)
    save_checkpoint(model, model.cfg, out, extra_meta={"stage": meta.get("stage", "")},
                    tokenizer_json=tokenizer.path)
    (out / "posttrain.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load(path: str | Path) -> tuple[torch.nn.Module, PostTokenizer, dict]:
    """(model, tokenizer, meta) of a post-training checkpoint directory."""
    path = Path(path)
    if not (path / "posttrain.json").is_file():
        raise ValueError(f"{path}: not a post-training checkpoint (no posttrain.json)")
    model, _ = load_model(path)
    return model, load_post_tokenizer(path), json.loads((path / "posttrain.json").read_text())
