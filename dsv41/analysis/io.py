"""Image I/O versus compute, and the ViT token arithmetic (docs/system.md §1; docs/report.md §9).

Long, image-dense training sequences are split across context-parallel ranks, each image read once. Loading a
sequence of N tokens is hidden behind its compute when

    N * rho / B_IO  <  N * C / B_GPU   <=>   rho  <  (B_IO / B_GPU) * C,

with rho the raw bytes read per token, C the FLOPs per token, B_IO the storage bandwidth and B_GPU the achieved
compute rate available to that data (same scope for both, e.g. per GPU). N cancels: the criterion does not depend
on sequence length (nor on cluster size when both bandwidths scale together), which is why the report concludes
storage throughput only binds for small-model ablations (small C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv41.config import ModelConfig


@dataclass(frozen=True)
class IOVerdict:
    hidden: bool                 # image I/O is hidden behind compute
    rho: float                   # raw bytes per token
    threshold: float             # (B_IO / B_GPU) * C, bytes per token
    margin: float                # threshold - rho (bytes/token; > 0 means hidden)
    headroom: float              # threshold / rho (> 1 means hidden)


def io_time(n_tokens: float, rho: float, io_bandwidth: float) -> float:
    """Seconds to read n tokens' raw data: N * rho / B_IO."""
    return n_tokens * rho / io_bandwidth


def compute_time(n_tokens: float, flops_per_token: float, gpu_flops: float) -> float:
    """Seconds to compute n tokens: N * C / B_GPU."""
    return n_tokens * flops_per_token / gpu_flops


def io_overlap(rho: float, flops_per_token: float, io_bandwidth: float, gpu_flops: float) -> IOVerdict:
    """The criterion rho < (B_IO / B_GPU) * C, with its margin. All inputs must be positive."""
    for name, v in (("rho", rho), ("flops_per_token", flops_per_token), ("io_bandwidth", io_bandwidth),
                    ("gpu_flops", gpu_flops)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    thr = io_bandwidth / gpu_flops * flops_per_token
    return IOVerdict(hidden=rho < thr, rho=float(rho), threshold=thr, margin=thr - rho, headroom=thr / rho)


def vit_tokens(cfg: ModelConfig, height: int = 1344, width: int = 1344) -> dict[str, int | bool]:
    """ViT arithmetic for an image already at a multiple of the patch size (report: 1344 x 1344 ->
    (1344/14)^2 = 9216 patches -> 1024 LLM tokens after the 3x3 pixel-unshuffle).

    `span_tokens` adds the layout tokens (one IMAGE_NEW_LINE per row, IMAGE_START, IMAGE_END; docs/model.md §8):
    n_h * (n_w + 1) + 2. The official preprocessor shrinks an image whose span would exceed vision_max_n_token,
    so `fits_max_n_token` says whether this size passes unchanged (1344^2 gives 1058 > 1024: it is shrunk)."""
    if not cfg.vision_enabled:
        raise ValueError("this config has no vision tower (vision_n_layers = 0)")
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    ph, pw = math.ceil(height / p), math.ceil(width / p)
    lh, lw = math.ceil(ph / r), math.ceil(pw / r)
    span = lh * (lw + 1) + 2
    return {"height": height, "width": width, "patch": p, "patches_h": ph, "patches_w": pw, "patches": ph * pw,
            "unshuffle": r, "tokens_h": lh, "tokens_w": lw, "image_tokens": lh * lw, "span_tokens": span,
            "fits_max_n_token": span <= cfg.vision_max_n_token}


def raw_bytes_per_image_token(cfg: ModelConfig, channels: int = 3, bytes_per_channel: int = 1) -> int:
    """rho of pure image content: pixels behind one LLM token (patch^2 * r^2 = 14*14*9 = 1764) times bytes per
    pixel (8-bit RGB: 3) = 5292 B/token."""
    return cfg.vision_patch_size ** 2 * cfg.vision_downsample_ratio ** 2 * channels * bytes_per_channel


def training_flops_per_token(cfg: ModelConfig) -> int:
    """C for training: 6 * activated parameters per token (forward 2, backward 4). Training runs every layer on
    every token (the CED prefill skip is inference-only), so the decode activation count applies."""
    from dsv41.analysis.params import activated_decode

    return 6 * activated_decode(cfg)["total"]
