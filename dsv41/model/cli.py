"""`dsv41 logits`: run a checkpoint the way the golden oracle does and write the golden tensor set."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsv41.config import DTYPES, parse_dtype


def register(sub) -> None:
    p = sub.add_parser("logits", help="prefill + greedy decode of a token batch; write golden-format tensors")
    p.add_argument("--checkpoint", required=True, help="official-layout or dsv41 checkpoint directory")
    p.add_argument("--tokens", required=True, help="JSON list of equal-length token-id lists (a batch)")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--decode-steps", type=int, default=0)
    p.add_argument("--official-decode-artifact", action="store_true",
                   help="reproduce the official stale index-key pointer on decode steps (docs/model.md §4)")
    p.add_argument("--teacher-force", metavar="BLOCKS.safetensors",
                   help="gate 1: feed every block its golden input stream from this capture file")
    p.add_argument("--images", help="comma-separated image files for {\"image\": i} items in the tokens file")
    p.add_argument("--storage", choices=["dense", "packed"], default="dense",
                   help="quantized weights dequantized (dense) or in their checkpoint formats (packed): the same "
                        "logits on an official-layout checkpoint (a training checkpoint's master weights get rounded)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics (docs/system.md §10): each row's logits independent of the batch")
    p.set_defaults(func=main)


def main(args) -> int:
    from dsv41.model.loading import load_model
    from dsv41.model.runner import run_logits, run_teacher_forced

    if args.decode_steps < 0:
        raise ValueError(f"--decode-steps must be >= 0, got {args.decode_steps}")
    t0 = time.perf_counter()
    model, cfg = load_model(args.checkpoint, dtype=parse_dtype(args.dtype), storage=args.storage)
    model.eval()
    if args.deterministic:
        from dsv41.model.attention import use_deterministic
        use_deterministic(model)
    seqs = json.loads(Path(args.tokens).read_text())
    images = [s for s in args.images.split(",") if s] if args.images else []
    extra: dict[str, torch.Tensor] = {}
    token_types = records = None
    if images or _has_image_items(seqs):
        from dsv41.model.image import expand_batch, image_spans
        tokens, token_types, records, prepared = expand_batch(seqs, images, cfg)
        extra = {"input_ids": tokens, "token_types": token_types, "image_spans": image_spans(records)}
        grid = []
        for i, im in enumerate(prepared):
            if im is None:
                continue
            extra[f"pixel_values.{i}"] = im.patches
            grid.append([im.n_vit_h, im.n_vit_w, im.n_llm_h, im.n_llm_w])
            with torch.no_grad():
                vit = model.vision(im.patches, im.n_vit_h, im.n_vit_w)
                extra[f"image_embeds.{i}"] = model.aligner(vit, im.n_vit_h, im.n_vit_w).float()
            if args.teacher_force:
                extra[f"vit_hidden.{i}"] = vit.float()
        extra["image_grid"] = torch.tensor(grid, dtype=torch.int64)
    else:
        tokens = _token_batch(seqs.get("tokens", seqs) if isinstance(seqs, dict) else seqs, cfg.vocab_size)
    t1 = time.perf_counter()
    if args.teacher_force:
        golden = load_file(args.teacher_force)
        gB = golden["tokens"].size(0)      # capture files hold the first row(s) of the batch
        if golden["tokens"].shape[1:] != tokens.shape[1:] or not torch.equal(golden["tokens"], tokens[:gB]):
            raise ValueError(f"--teacher-force file's tokens are not the first rows of {args.tokens}")
        tokens = tokens[:gB]
        if token_types is not None:
            token_types, records = token_types[:gB], records[:gB]
        if args.decode_steps == 0:
            golden.pop("decode_tokens", None)
        out = run_teacher_forced(model, golden, args.official_decode_artifact, token_types=token_types,
                                 images=records)
    else:
        out = run_logits(model, tokens, args.decode_steps, args.official_decode_artifact,
                         token_types=token_types, images=records)
    out.update(extra)
    t2 = time.perf_counter()
    meta = {"dsv41": json.dumps({"checkpoint": str(args.checkpoint), "dtype": args.dtype,
                                 "official_decode_artifact": args.official_decode_artifact,
                                 "teacher_force": bool(args.teacher_force), "load_s": round(t1 - t0, 3),
                                 "run_s": round(t2 - t1, 3)})}
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, args.out, metadata=meta)
    print(f"wrote {len(out)} tensors to {args.out} (load {t1 - t0:.2f}s, run {t2 - t1:.2f}s)")
    return 0


def _has_image_items(seqs) -> bool:
    return isinstance(seqs, list) and any(isinstance(x, dict) for s in seqs if isinstance(s, list) for x in s)


def _token_batch(seqs, vocab: int) -> torch.Tensor:
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and s for s in seqs):
        raise ValueError("tokens file must hold a non-empty JSON list of non-empty token-id lists")
    if len({len(s) for s in seqs}) != 1:
        raise ValueError(f"sequences have different lengths {sorted({len(s) for s in seqs})}")
    for s in seqs:
        for t in s:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token {t!r} is not an id in [0, {vocab})")
    return torch.tensor(seqs, dtype=torch.int64)
