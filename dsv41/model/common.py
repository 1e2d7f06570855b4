"""Shared building blocks: RMSNorm, the quantization-aware Linear, RoPE with YaRN (docs/model.md §2, §3.2, §9).

Legend: B batch, T tokens, H heads, D width, R rope dims.

Numerics switches. A model runs in one of two precisions (`float32` for parity and tests, `bfloat16` for the
official numerics) and with its FP8/FP4 quantize-dequantize steps on (official) or off (identities, which makes
the model a continuous function of its inputs: dataflow equalities such as chunked == one-shot then hold to
~1e-5, see docs/golden.md §4). `set_quantization(model, False)` flips every QDQ site at once.
"""

from __future__ import annotations

import contextlib
import math
from functools import cache, lru_cache

import torch
from torch import nn

from dsv41.codecs.weights import PackedWeight, pack_weight, stored_shapes
from dsv41.kernels import packed_linear, qdq_fp8, quant_linear, rms_norm, rope
from dsv41.kernels.invariant import is_deterministic, linear

# Checkpoint storage kinds of a Linear weight (docs/model.md §9). Quantized kinds quantize their activation to FP8
# (per 32 along K, ue8m0 scales) before the matmul; the weight itself is held dequantized (exact in bf16, "dense",
# what training updates) or as the checkpoint stores it ("packed": codes + e8m0 scales, for serving).
QUANT_KINDS = ("fp8", "fp4")
WEIGHT_KINDS = ("fp8", "fp4", "bf16", "fp32")
STORAGES = ("dense", "packed")
_construction = {"storage": "dense"}


@contextlib.contextmanager
def weight_storage(storage: str):
    """Modules built inside `with weight_storage("packed"):` allocate their quantized weights (fp8 / fp4 Linears,
    Engram tables) in the checkpoint storage directly (uninitialised), so that no dequantized copy ever exists."""
    if storage not in STORAGES:
        raise ValueError(f"weight storage {storage!r}: expected one of {', '.join(STORAGES)}")
    prev = _construction["storage"]
    _construction["storage"] = storage
    try:
        yield
    finally:
        _construction["storage"] = prev


def building_packed() -> bool:
    """Whether modules constructed now hold their quantized weights packed (see `weight_storage`)."""
    return _construction["storage"] == "packed"


def lin_kind(cfg) -> str:
    """Storage kind of the ordinary Linear weights: 'fp8' (activation-quantized) or plain 'bf16'."""
    return "fp8" if cfg.dtype == "fp8" else "bf16"


class QuantSite(nn.Module):
    """A module with a QDQ step that `set_quantization` can switch off."""

    quant: bool = True


def set_quantization(model: nn.Module, enabled: bool) -> None:
    """Turn every FP8/FP4 quantize-dequantize step of `model` on (official numerics) or into an identity."""
    for m in model.modules():
        if isinstance(m, QuantSite):
            m.quant = enabled


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in fp32, cast back to the input dtype (docs/model.md §2)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(QuantSite):
    """y = x W^T. `kind` is the checkpoint storage (fp8 / fp4 / bf16 / fp32).

    Quantized kinds compute (QDQ_fp8 a) . (dequant W)^T with fp32 accumulation in the official block-scaled
    GEMM's summation order (`dsv41.kernels.quant_linear`, docs/model.md §9); bf16 / fp32 kinds (and quantized kinds with
    the QDQ switched off) are one plain matmul.

    Storage of a quantized kind: `weight` a float Parameter [out, in] holding the dequantized values (dense), or,
    after `pack()` (or built under `weight_storage("packed")`), the checkpoint's own tensors as uint8 buffers under
    the checkpoint's names: `weight` the codes (fp8 [out, in] e4m3, fp4 [out, in/2] two e2m1 a byte) and `scale`
    the e8m0 scales (per 32 x 32 tile / per row and 32 inputs). The CPU GEMMs read the packed bytes block by block
    and give the dense twin's bits (`dsv41/kernels/gemm_ref.py`); on a GPU `dsv41.kernels.packed_linear` reads the
    bytes (a Triton kernel for bf16 activations); autograd and the deterministic mode dequantize the whole weight
    per call."""

    def __init__(self, in_features: int, out_features: int, kind: str = "fp8", dtype: torch.dtype | None = None,
                 bias: bool = False):
        super().__init__()
        assert kind in WEIGHT_KINDS, kind
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.held_dtype = dtype or torch.get_default_dtype()      # the dequantized weight's dtype
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if building_packed() and self.packable:
            codes, scales = stored_shapes(kind, out_features, in_features)
            self.register_buffer("weight", torch.empty(codes, dtype=torch.uint8))
            self.register_buffer("scale", torch.empty(scales, dtype=torch.uint8))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    @property
    def packable(self) -> bool:
        """A quantized kind without a bias: the weights the checkpoint stores quantized (docs/model.md §9)."""
        return self.kind in QUANT_KINDS and self.bias is None

    @property
    def packed(self) -> bool:
        return "scale" in self._buffers

    @property
    def quantizes_input(self) -> bool:
        return self.quant and self.kind in QUANT_KINDS

    def stored_weight(self) -> torch.Tensor | PackedWeight:
        """The weight as held: the dense Parameter, or a `PackedWeight` view of the packed buffers."""
        if not self.packed:
            return self.weight
        return PackedWeight(self.weight, self.scale, self.kind, (self.out_features, self.in_features),
                            self.held_dtype)

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (the Parameter itself when dense; a new tensor when packed)."""
        return self.stored_weight().dequant() if self.packed else self.weight

    @torch.no_grad()
    def pack(self) -> None:
        """Hold the weight as the checkpoint stores it (quantizing it: exact for checkpoint-representable values,
        else the release's rounding, e.g. for a trained model's master weights)."""
        if self.packed or not self.packable:
            return
        codes, scale = pack_weight(self.weight, self.kind)
        self.held_dtype = self.weight.dtype
        del self.weight
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale)

    @torch.no_grad()
    def unpack(self) -> None:
        """Back to a dense Parameter holding the dequantized values (e.g. to train from a packed model)."""
        if self.packed:
            dense = self.dense_weight()
            del self.weight, self.scale
            self.weight = nn.Parameter(dense)

    def forward(self, x: torch.Tensor, input_quantized: bool = False) -> torch.Tensor:
        """input_quantized: x is already `qdq_fp8`'d (a caller feeding one input to several Linears)."""
        if not self.quantizes_input:
            return linear(x, self.dense_weight(), self.bias)
        w = self.stored_weight()
        xq = x if input_quantized else qdq_fp8(x)
        autograd = self.training and torch.is_grad_enabled()
        if self.packed and x.is_cuda and not autograd and not is_deterministic():
            return packed_linear(xq, w, self.bias)          # the GPU kernel reads the bytes
        if self.packed and (x.is_cuda or autograd):
            w = w.dequant()                  # autograd and the deterministic mode's GPU GEMM take the dense twin
        return quant_linear(xq, w, self.bias, self.training)


# ------------------------------------------------------------------------------------------------ RoPE

@lru_cache(maxsize=16)
def rope_inv_freq(rope_dim: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
                  beta_slow: int) -> torch.Tensor:
    """omega_i = base^(-2i/R), with the YaRN ramp when original_seq_len > 0 (docs/model.md §3.2). fp32 [R/2]."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


class Rope:
    """One RoPE table family (a layer's theta / YaRN setting); angles are computed for the positions asked.

    Angle p * omega_i is one fp32 product, so computing it on demand equals the official precomputed table
    row for row, and nothing of size max_seq_len is ever allocated."""

    def __init__(self, cfg, ratio: int):
        """Window-only layers (ratio 0): theta rope_theta, no YaRN; compressed layers: compress_rope_theta with
        YaRN."""
        orig, theta = (cfg.original_seq_len, cfg.compress_rope_theta) if ratio else (0, cfg.rope_theta)
        self.inv_freq = rope_inv_freq(cfg.rope_head_dim, orig, float(theta), float(cfg.rope_factor), cfg.beta_fast,
                                      cfg.beta_slow)
        # what the table depends on: layers with equal keys share a step's angles (StepContext.memoized)
        self.key = (cfg.rope_head_dim, orig, float(theta), float(cfg.rope_factor), cfg.beta_fast, cfg.beta_slow)

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 [..., R/2] for integer positions of any shape."""
        inv = self.inv_freq.to(positions.device)
        angle = positions.to(torch.float32).unsqueeze(-1) * inv
        return torch.polar(torch.ones_like(angle), angle)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST R dims of x by adjacent (even, odd) pairs. x [B, T, (H,) *], freqs [B or 1, T, R/2]:
    `dsv41.kernels.ref.apply_rope_ref` (fp32 arithmetic, rounded to x's dtype, a new tensor), one Triton launch on
    a GPU."""
    return rope(x, freqs, inverse)


@cache
def warm_up_transcendentals() -> None:
    """torch 2.13 CPU can compute the first vectorised cos/sin/sqrt/log of a process slightly wrong
    (docs/golden.md §6); one small call of each first makes later calls exact (once per process)."""
    t = torch.linspace(0.5, 40.0, 4096, dtype=torch.float32)
    for fn in (torch.cos, torch.sin, torch.sqrt, torch.log, torch.exp, torch.rsqrt):
        fn(t)
    torch.polar(torch.ones_like(t), t)
