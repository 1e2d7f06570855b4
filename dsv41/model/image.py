"""Image preprocessing and image-span expansion of DeepSeek-V4.1 prompts (docs/model.md §8; the official
`image_processor.py`).

An image becomes an `n_vit_h x n_vit_w` grid of `p x p` patches for the ViT; the aligner's `r x r` space-to-depth
turns it into an `n_llm_h x n_llm_w` token grid (`n_llm = ceil(n_vit / r)`), which the LLM sees as the span

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

Every span position carries `cfg.image_token_id` as its input id; only the token type (0..3; text is -1) tells
the positions apart. Pixel preparation reproduces the official processor bit for bit: RGB conversion, the size
plan (upscale small images to `vision_min_pixels`, round up to whole patches, shrink with `solve_resize_ratio` when
the span would exceed `vision_max_n_token`), Pillow's `ImageOps.pad` letterbox (bicubic `contain` resize, gray
127, Python half-to-even centering), `(x/255 - 0.5)/0.5` in fp32 rounded to bf16, patches
`[n_vit_h*n_vit_w, 3, p, p]` in row-major grid order, channel-major inside a patch.

Prompt input format (docs/vision-golden.md §3): a sequence is a list whose items are token ids or
`{"image": i}` objects (i indexes the ordered image list). `expand_prompt` replaces every image item by its span and
returns the ids, the token types and one `ImageRecord` per occurrence (what `vision.merge_image_embeddings` reads).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = 0, 1, 2, 3
PAD_COLOR = (127, 127, 127)


@dataclass
class PreparedImage:
    """One image through the processor: bf16 patches [n_vit_h*n_vit_w, 3, p, p] and both grids."""

    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def span_len(self) -> int:
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


@dataclass
class ImageRecord:
    """One image occurrence in one sequence (the official `ImageInput`): its span starts at `start` and has
    `types.numel()` positions; `patches` feed the ViT."""

    start: int
    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    types: torch.Tensor
    image_index: int = -1

    @property
    def length(self) -> int:
        return int(self.types.numel())


# ------------------------------------------------------------------------------------------------ size plan

def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: one START, n_llm_h rows of n_llm_w IMAGE + one NEW_LINE, one END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(best_height: int, best_width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """Token grid of a pixel size: whole patches per side, then ceil over the aligner's ratio."""
    return (math.ceil((best_height // patch_size) / downsample_ratio),
            math.ceil((best_width // patch_size) / downsample_ratio))


def solve_resize_ratio(height, width, patch_size: int, downsample_ratio: int, max_n_token: int) -> tuple[int, int]:
    """(height, width) in pixels: the largest aspect-preserving size whose span fits max_n_token.

    With ratio q = h/w and a token grid of a x b cells, the span costs a*(b+1)+2 tokens; the continuous solution of
    q*b*(b+1) = max_n_token - 2 bounds b. Degenerate aspect ratios collapse to one column / one row. The float
    operations are those of the official code, in its order (the binding side lands exactly on an integer)."""
    q = height / width
    w_cells = math.sqrt((max_n_token - 2) / q + 0.25) - 0.5
    h_cells = w_cells * q
    cell = patch_size * downsample_ratio
    if w_cells < 1.0:
        return (max_n_token - 2) // 2 * cell, cell
    if h_cells < 1.0:
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(w_cells) * cell / width, math.floor(h_cells) * cell / height)
    return (math.floor(height * beta / patch_size) * patch_size,
            math.floor(width * beta / patch_size) * patch_size)


def plan_image_grid(width: int, height: int, cfg) -> tuple[int, int, int, int]:
    """Size plan of an image of the given original size: (n_llm_h, n_llm_w, best_height, best_width). The planned
    size shrinks (`solve_resize_ratio`) when its span is too long."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    p, r, max_n = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and width > height * ratio:
        width = height * ratio
    if 0 < width * height < cfg.vision_min_pixels:
        up = (cfg.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * up), int(height * up)
    best_height, best_width = math.ceil(height / p) * p, math.ceil(width / p) * p
    n_h, n_w = llm_grid(best_height, best_width, p, r)
    if num_image_tokens(n_h, n_w) > max_n:
        best_height, best_width = solve_resize_ratio(height, width, p, r, max_n)
        n_h, n_w = llm_grid(best_height, best_width, p, r)
        if num_image_tokens(n_h, n_w) > max_n:
            raise ValueError(f"image of {width}x{height} cannot fit vision_max_n_token={max_n}")
    return n_h, n_w, best_height, best_width


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """int64 [span]: START, then per token row n_llm_w IMAGE and one NEW_LINE, then END."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START] + row * n_llm_h + [IMAGE_END], dtype=torch.int64)


# ------------------------------------------------------------------------------------------------ pixels

def open_image(source: Any) -> Image.Image:
    """An RGB PIL image from a path, raw bytes, a file object or a PIL image. ValueError when it is not an image
    or has zero size."""
    try:
        if isinstance(source, Image.Image):
            src = source
        elif isinstance(source, (bytes, bytearray, memoryview)):
            src = Image.open(io.BytesIO(bytes(source)))
        elif isinstance(source, (str, os.PathLike)):
            src = Image.open(io.BytesIO(Path(source).read_bytes()))
        elif hasattr(source, "read"):
            src = Image.open(io.BytesIO(source.read()))
        else:
            raise ValueError(f"cannot load an image from a {type(source).__name__}")
        if src.width <= 0 or src.height <= 0:
            raise ValueError(f"image has zero size ({src.width}x{src.height})")
        return src.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, SyntaxError, EOFError) as e:
        raise ValueError(f"not a readable image: {e}") from e
    except OSError as e:
        if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
            raise
        raise ValueError(f"not a readable image: {e}") from e


def preprocess_image(source: Any, cfg) -> PreparedImage:
    """Decode, plan, letterbox, normalise and patchify one image exactly as the official `load_image`."""
    img = open_image(source)
    p = cfg.vision_patch_size
    n_llm_h, n_llm_w, best_h, best_w = plan_image_grid(img.width, img.height, cfg)
    if best_h <= 0 or best_w <= 0:
        raise ValueError(f"image of {img.width}x{img.height} plans to an empty patch grid")
    n_vit_h, n_vit_w = best_h // p, best_w // p
    ratio = cfg.vision_max_wh_ratio
    try:
        if ratio is not None and img.width >= ratio * img.height:
            # the official processor stretches over-wide images instead of letterboxing them
            img = img.resize((best_w, best_h))
        else:
            img = ImageOps.pad(img, (best_w, best_h), color=PAD_COLOR)
    except ValueError as e:
        raise ValueError(f"image of {img.width}x{img.height} cannot be resized to {best_w}x{best_h}: {e}") from e
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    # [3, H, W] -> [n_vit_h, n_vit_w, 3, p, p] -> [n_vit_h*n_vit_w, 3, p, p]
    patches = x.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
    return PreparedImage(patches.contiguous(), n_vit_h, n_vit_w, n_llm_h, n_llm_w)


# ------------------------------------------------------------------------------------------------ prompts

def _image_item_index(item: Any) -> int | None:
    if isinstance(item, dict):
        if set(item) != {"image"}:
            raise ValueError(f"prompt item {item!r}: an object item must have exactly one key, 'image'")
        i = item["image"]
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"prompt item {item!r}: the image index must be an integer")
        return i
    return None


def expand_prompt(items: Sequence[Any], images: Sequence[Any], cfg,
                  cache: dict[int, PreparedImage] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[ImageRecord]]:
    """Expand one sequence of token ids and `{"image": i}` items.

    images: the ordered image list (paths, bytes, PIL images or `PreparedImage`s); only referenced ones are
    processed, each once (pass `cache` to share the work across sequences). Returns `input_ids` int64 [T],
    `token_types` int64 [T] (-1 text, 0..3 span types) and the `ImageRecord`s in order of occurrence."""
    cache = {} if cache is None else cache
    ids, types, records = [], [], []
    for item in items:
        idx = _image_item_index(item)
        if idx is None:
            if not isinstance(item, (int, np.integer)) or isinstance(item, bool):
                raise ValueError(f"prompt item {item!r}: expected a token id or {{'image': i}}")
            t = int(item)
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary [0, {cfg.vocab_size})")
            if t == cfg.image_token_id:
                raise ValueError(f"token id {t} is the image token id; reference images with {{'image': i}}")
            ids.append(t)
            types.append(TEXT)
            continue
        if not cfg.vision_enabled:
            raise ValueError("the model config has no vision tower (vision_n_layers == 0) but the prompt has images")
        if not 0 <= idx < len(images):
            raise ValueError(f"prompt item {item!r}: image index out of range (have {len(images)} images)")
        if idx not in cache:
            src = images[idx]
            cache[idx] = src if isinstance(src, PreparedImage) else preprocess_image(src, cfg)
        prep = cache[idx]
        span_types = image_token_types(prep.n_llm_h, prep.n_llm_w)
        records.append(ImageRecord(len(ids), prep.patches, prep.n_vit_h, prep.n_vit_w, span_types, idx))
        ids.extend([cfg.image_token_id] * span_types.numel())
        types.extend(span_types.tolist())
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(types, dtype=torch.int64), records


def expand_batch(sequences: Any, images: Sequence[Any], cfg
                 ) -> tuple[torch.Tensor, torch.Tensor, list[list[ImageRecord]], list[PreparedImage | None]]:
    """Expand a prompt batch (a list of sequences, or `{"tokens": [...]}`) whose sequences all expand to one
    length T. Returns input_ids [B, T], token_types [B, T], per-row record lists, and the prepared images (None
    for images no sequence references)."""
    if isinstance(sequences, dict):
        if set(sequences) != {"tokens"}:
            raise ValueError("a prompt object must have exactly one key, 'tokens'")
        sequences = sequences["tokens"]
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise ValueError("a prompt batch must be a non-empty list of sequences")
    if all(not isinstance(s, (list, tuple)) for s in sequences):
        sequences = [sequences]  # a single sequence
    cache: dict[int, PreparedImage] = {}
    rows = [expand_prompt(seq, images, cfg, cache) for seq in sequences]
    lengths = {int(r[0].numel()) for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"sequences expand to different lengths {sorted(lengths)}; pad them to one length")
    if 0 in lengths:
        raise ValueError("empty sequence")
    input_ids, token_types, records = zip(*rows)
    prepared = [cache.get(i) for i in range(len(images))]
    return torch.stack(input_ids), torch.stack(token_types), list(records), prepared


def image_spans(records: Sequence[Sequence[ImageRecord]]) -> torch.Tensor:
    """int64 [n_occurrences, 4]: (row, start, span length, image index), as the golden `image_spans`."""
    out = [[b, r.start, r.length, r.image_index] for b, row in enumerate(records) for r in row]
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 4)
