"""The DeepSeek-V4.1 vision tower: ViT with 2D RoPE, the 3x3 pixel-unshuffle aligner, and the image-span merge
(docs/model.md §8; official `vision.py` and `model.py: Transformer.merge_image_embeddings`).

Legend: N patches (n_vit_h * n_vit_w), H heads, Dh head dim, C vision width, D model width, r downsample ratio.

Plain float math (the vision tower has no quantization: its Linears are the model's `Linear` of storage kind
bf16, no activation QDQ). Linears compute in the dtype they were built with (`dtype=`: float32 for parity,
bfloat16 for the published numerics); the RMSNorm weights are always float32 and the norms compute in fp32,
casting back to the activation dtype. Patches arrive as the processor's bf16 and are
converted (exactly) to the tower dtype.

Checkpoint names: registered on the top-level model as `vision` (`ViT`), `aligner` (`Aligner`) and the three
`[D]` parameters `image_start`, `image_end`, `image_newline`, the module paths below give exactly the official
names (`vision.patch_embed.proj.weight`, `vision.blocks.{i}.attn.wqkv.bias`, `aligner.w1.weight`, ...).
`VisionTower` bundles the five for standalone use with the same names.
"""

from __future__ import annotations

from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model.common import Linear, RMSNorm, warm_up_transcendentals
from dsv41.model.image import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

VISION_NORM_EPS = 1e-6     # the tower's RMSNorms: the model's, with an fp32 weight (fp32 math, cast back)


# ------------------------------------------------------------------------------------------------ 2D RoPE

@lru_cache(maxsize=32)
def _rope_table_cpu(n_h: int, n_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    warm_up_transcendentals()
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))  # [rope_dim/2]
    pos = torch.cartesian_prod(torch.arange(n_h), torch.arange(n_w)).reshape(-1, 2, 1).to(torch.float32)  # [N, 2, 1]
    ang = (pos * inv).flatten(1)  # [N, rope_dim]: rope_dim/2 row angles, then rope_dim/2 column angles
    return ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)


def vision_rope_table(n_h: int, n_w: int, rope_dim: int, theta: float,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [N, 1, rope_dim] for the patch grid in row-major order; rope_dim = Dh/2.

    inv_f_i = theta^(-2i/rope_dim), i < rope_dim/2; the angle vector of patch (r, c) is [r*inv_f, c*inv_f]."""
    cos, sin = _rope_table_cpu(int(n_h), int(n_w), int(rope_dim), float(theta))
    return cos.to(device), sin.to(device)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of [N, H, Dh]: dims d and d + Dh/2 form a pair, rotated by angle d (fp32 math)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ------------------------------------------------------------------------------------------------ ViT

class VisionAttention(nn.Module):
    """wqkv (bias) -> 2D RoPE on q, k -> full bidirectional SDPA (scale Dh^-0.5) -> wo (bias)."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        C = cfg.vision_dim
        self.n_heads = cfg.vision_n_heads
        self.head_dim = C // self.n_heads
        self.wqkv = Linear(C, 3 * C, "bf16", dtype, bias=True)
        self.wo = Linear(C, C, "bf16", dtype, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = (apply_rope_2d(t, cos, sin) for t in (q, k))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """[g|u] = w1 x; w2(silu(g) * u); no biases."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(cfg.vision_dim, 2 * cfg.vision_inter_dim, "bf16", dtype)
        self.w2 = Linear(cfg.vision_inter_dim, cfg.vision_dim, "bf16", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class VisionBlock(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, torch.float32)
        self.attn = VisionAttention(cfg, dtype)
        self.norm2 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, torch.float32)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """patches [N, 3, p, p] (row-major grid) -> hidden [N, C]. No class token, no absolute position embedding."""

    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        C, H = cfg.vision_dim, cfg.vision_n_heads
        if C % H or (C // H) % 4:
            raise ValueError(f"vision head dim {C}/{H} must be an integer divisible by 4 (2D RoPE half-split)")
        self.rope_dim = C // H // 2
        self.rope_theta = float(cfg.vision_rope_theta)
        self.patch_size = p = cfg.vision_patch_size
        # flattened patch -> C (the official `patch_embed.proj`)
        self.patch_embed = nn.ModuleDict({"proj": Linear(3 * p * p, C, "bf16", dtype, bias=True)})
        self.blocks = nn.ModuleList([VisionBlock(cfg, dtype) for _ in range(cfg.vision_n_layers)])
        self.norm = RMSNorm(C, VISION_NORM_EPS, torch.float32)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        p = self.patch_size
        if patches.dim() != 4 or tuple(patches.shape[1:]) != (3, p, p) or patches.size(0) != n_vit_h * n_vit_w:
            raise ValueError(f"patches {tuple(patches.shape)} do not match a {n_vit_h}x{n_vit_w} grid of 3x{p}x{p}")
        proj = self.patch_embed.proj
        x = proj(patches.to(device=proj.weight.device, dtype=proj.weight.dtype).flatten(1))
        cos, sin = vision_rope_table(n_vit_h, n_vit_w, self.rope_dim, self.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


# ------------------------------------------------------------------------------------------------ aligner

def pixel_unshuffle(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h*n_w, C] -> [ceil(n_h/r)*ceil(n_w/r), C*r*r]: zero-pad bottom/right to multiples of r, r x r cells in
    row-major order, features in (channel, kernel row, kernel col) order."""
    g = F.pad(x.view(n_h, n_w, x.size(-1)).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
    return F.unfold(g.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)


class Aligner(nn.Module):
    """ViT hidden [N, C] -> LLM rows [n_llm_h*n_llm_w, D]: pixel-unshuffle, w1 (bias), exact GELU, w2 (bias)."""

    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.downsample_ratio = cfg.vision_downsample_ratio
        self.w1 = Linear(cfg.vision_dim * self.downsample_ratio ** 2, cfg.dim, "bf16", dtype, bias=True)
        self.w2 = Linear(cfg.dim, cfg.dim, "bf16", dtype, bias=True)

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(pixel_unshuffle(x, n_vit_h, n_vit_w, self.downsample_ratio))))


def encode_image(model: nn.Module, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
    """ViT + aligner (`model.vision`, `model.aligner`) of one image: [n_llm_h*n_llm_w, D] in the tower dtype."""
    return model.aligner(model.vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)


# ------------------------------------------------------------------------------------------------ span merge

EncodeFn = Callable[[torch.Tensor, int, int], torch.Tensor]


def merge_image_embeddings(model: nn.Module | None, h: torch.Tensor, images: Sequence | None,
                           encode: EncodeFn | None = None) -> torch.Tensor:
    """Overwrite every image span of the token embeddings h [B, T, D] in place (and return h), with the vision
    members of `model` (a VisionTower, or a model that registers `vision`, `aligner`, `image_start`, `image_end`,
    `image_newline` on itself: the official top-level layout).

    images: one entry per batch row, each None or a list of records with `start`, `patches`, `n_vit_h`,
    `n_vit_w` and `types` (image.ImageRecord / the official ImageInput). In each span START / END / NEW_LINE rows
    take model.image_start / image_end / image_newline, and the IMAGE rows take encode(patches, n_vit_h, n_vit_w)
    rows in order (default: `encode_image` with the model's ViT and aligner). An image whose patches tensor occurs
    several times in the batch is encoded once."""
    if images is None:
        return h
    encode = partial(encode_image, model) if encode is None else encode
    if len(images) > h.size(0):
        raise ValueError(f"images for {len(images)} rows, embeddings have {h.size(0)}")
    encoded: dict[int, torch.Tensor] = {}
    for b, row in enumerate(images):
        for img in row or ():
            types = img.types.to(h.device)
            start, length = int(img.start), int(types.numel())
            if start < 0 or start + length > h.size(1):
                raise ValueError(f"image span [{start}, {start + length}) outside the sequence of {h.size(1)}")
            key = id(img.patches)
            if key not in encoded:
                encoded[key] = encode(img.patches, img.n_vit_h, img.n_vit_w)
            embeds = encoded[key]
            is_img = types == IMAGE
            if int(is_img.sum()) != embeds.size(0):
                raise ValueError(f"image span has {int(is_img.sum())} IMAGE slots, "
                                 f"the aligner gave {embeds.size(0)} rows")
            span = h[b, start:start + length]
            for kind, name in zip((IMAGE_START, IMAGE_END, IMAGE_NEW_LINE), VISION_NAMES):
                span[types == kind] = getattr(model, name).to(h.dtype)
            span[is_img] = embeds.to(device=h.device, dtype=h.dtype)
    return h


# ------------------------------------------------------------------------------------------------ standalone

class VisionTower(nn.Module):
    """ViT + aligner + span delimiters with the official top-level names (`vision.*`, `aligner.*`,
    `image_start`, `image_end`, `image_newline`) for standalone use; a full model registers the same five
    members on itself instead."""

    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        add_vision_members(self, cfg, dtype)

    def encode(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        return encode_image(self, patches, n_vit_h, n_vit_w)

    def merge(self, h: torch.Tensor, images: Sequence | None) -> torch.Tensor:
        return merge_image_embeddings(self, h, images)


VISION_NAMES = ("image_start", "image_end", "image_newline")


def add_vision_members(module: nn.Module, cfg, dtype: torch.dtype) -> None:
    """Register the five vision members on `module` under their official top-level names: `vision`, `aligner`
    and the span delimiters `image_start`, `image_end`, `image_newline` ([D] each)."""
    module.vision = ViT(cfg, dtype)
    module.aligner = Aligner(cfg, dtype)
    for name in VISION_NAMES:
        setattr(module, name, nn.Parameter(torch.zeros(cfg.dim, dtype=dtype)))


def is_vision_tensor(name: str) -> bool:
    return name.startswith(("vision.", "aligner.")) or name in VISION_NAMES


def load_vision_weights(module: nn.Module, checkpoint: str | Path, strict: bool = True) -> list[str]:
    """Copy the checkpoint's vision tensors (`vision.*`, `aligner.*`, `image_*`) into `module`, whose parameter
    names must be those official names (a VisionTower, or a full model). `checkpoint` is a directory of
    `*.safetensors` shards or one file. Each tensor is converted to the parameter's dtype. Returns the names
    loaded; with strict, every vision parameter of `module` must be found and shapes must agree."""
    from safetensors import safe_open

    ckpt = Path(checkpoint)
    params = {n: p for n, p in module.named_parameters() if is_vision_tensor(n)}
    loaded = []
    with torch.no_grad():
        for f in sorted(ckpt.glob("*.safetensors")) if ckpt.is_dir() else [ckpt]:
            with safe_open(str(f), framework="pt") as g:
                for name in sorted(params.keys() & set(g.keys())):
                    t, p = g.get_tensor(name), params[name]
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != parameter {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))
                    loaded.append(name)
    missing = sorted(set(params) - set(loaded))
    if strict and missing:
        raise ValueError(f"vision tensors missing from {checkpoint}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return loaded
