"""Kernels: torch references (`*_ref`) and their Triton twins (same signatures), one backend switch.

  ref.py         sparse_attn_ref: the model's sparse attention with sinks on dense KV (docs/model.md §3.8);
                 rms_norm_ref, apply_rope_ref (the row ops every layer runs)
  packed_ref.py  references over the engine's packed store: sparse_attn_packed_ref (decode: FP8 ring + FP4 pages),
                 indexer_scores_packed_ref / indexer_topk_packed_ref (decode indexer, MXFP4 keys, candidate pool)
  mhc_ref.py     mhc_fused_ref: one mHC step between sub-layers (hc_post, next hc_mixes, lagged hc_pre + RMSNorm)
  mhc_math.py    the mHC functions (hc_post, hc_mixes, hc_pre, hc_split_sinkhorn) the model and mhc_ref share
  gemm_ref.py    block_scaled_linear_ref: the fp8 / fp4-weight GEMM in the official summation order (per 32-wide K
                 block, blocks accumulated in K order); packed_linear_ref: a packed weight's GEMM on a GPU
  moe_ref.py     moe_experts_ref: a MoE layer's routed + shared experts over their weights (and the summation
                 `moe_combine`, expert_act_ref: the expert's SwiGLU middle, shared with the model's module loop)
  (codecs)       the references of qdq_fp8 and pack_swa_kv are the codecs themselves (docs/model.md §3.3)
  backend.py     set_backend("auto" | "torch" | "triton"), chosen once; auto = Triton on CUDA bf16 inputs without
                 gradients, the reference otherwise (logged once per op and choice); a requested backend that
                 cannot run raises
  triton/        the Triton kernels, imported lazily (CPU installs never need Triton)

The public ops below dispatch through the switch; the model imports them from here.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from dsv41.codecs import pack_swa_kv as _pack_swa_kv_codec
from dsv41.codecs import qdq_fp8 as qdq_fp8_ref
from dsv41.codecs import qdq_index_k as qdq_index_k_ref
from dsv41.kernels.backend import BACKENDS, get_backend, resolve, set_backend, triton_available
from dsv41.kernels.packed_ref import (candidate_pool, decode_window_rows, indexer_scores_packed_ref, indexer_select,
                                      indexer_topk_packed_ref, pool_entries, sparse_attn_packed_ref)
from dsv41.kernels.gemm_ref import block_scaled_linear_ref, packed_linear_ref
from dsv41.kernels.invariant import deterministic, exact_block_linear, is_deterministic, set_deterministic
from dsv41.kernels.mhc_math import hc_mixes as hc_mixes_ref
from dsv41.kernels.mhc_math import hc_post as hc_post_ref
from dsv41.kernels.mhc_ref import mhc_fused_ref
from dsv41.kernels.moe_ref import expert_act_ref, moe_combine, moe_experts_ref, moe_gate_ref
from dsv41.kernels.ref import apply_rope_ref, rms_norm_ref, sparse_attn_ref

__all__ = [
    "BACKENDS", "set_backend", "get_backend", "triton_available",
    "sparse_attn", "sparse_attn_ref",
    "sparse_attn_packed", "sparse_attn_packed_ref",
    "indexer_scores_packed", "indexer_scores_packed_ref",
    "indexer_topk_packed", "indexer_topk_packed_ref",
    "decode_window_rows", "pool_entries", "candidate_pool", "indexer_select",
    "mhc_fused", "mhc_fused_ref", "hc_mixes", "hc_mixes_ref", "hc_post", "hc_post_ref", "qdq_fp8", "qdq_fp8_ref",
    "qdq_index_k", "qdq_index_k_ref",
    "pack_swa_kv", "pack_swa_kv_ref", "expert_act", "expert_act_ref",
    "moe_experts", "moe_experts_ref", "moe_combine", "moe_gate", "moe_gate_ref", "quant_linear", "block_scaled_linear_ref",
    "packed_linear", "packed_linear_ref", "rms_norm", "rms_norm_ref", "rope", "apply_rope_ref",
    "set_deterministic", "is_deterministic", "deterministic",
]


_capability = functools.cache(torch.cuda.get_device_capability)         # (major, minor) of a CUDA device index


def _dispatch(op: str, ref, args: tuple, tensors: list, bf16: torch.Tensor | None = None, fp8: bool = False,
              fits: bool = True):
    """ref(*args), or its Triton twin `dsv41.kernels.triton.<op>_triton` (same arguments) when the inputs fit the
    kernel's shapes and the switch picks Triton for `tensors` (bf16: the activation it needs in bfloat16); always
    the reference in the deterministic mode (its row-invariant forms, `dsv41.kernels.invariant`). fp8: the
    twin converts to E4M3 in hardware, which needs sm_89+ (an explicit Triton backend on an older GPU is an
    error, auto takes the reference)."""
    if fits and not is_deterministic() and resolve(op, tensors, bf16=bf16) == "triton":
        if not fp8 or _capability(tensors[0].device.index) >= (8, 9):     # a CUDA tensor's device has an index
            from dsv41.kernels import triton as twins
            return getattr(twins, f"{op}_triton")(*args)
        if get_backend() == "triton":
            raise ValueError(f"kernel backend 'triton': {op} needs a GPU of compute capability 8.9 or newer")
    return ref(*args)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 training: bool = False) -> torch.Tensor:
    """x W^T (+ bias) for a weight of a quantized checkpoint kind (fp8 / fp4), x already FP8 QDQ'd.

    CPU, and fp32 weights on any device: `block_scaled_linear_ref`, the official summation order (bit-identical to
    the official code on the same machine; fp32 is the parity dtype: on a GPU this order gives the CPU's bits where
    the block sums are exact, e.g. golden case A's layer-10 `wq_a`, whose output feeds an FP8 QDQ at a rounding
    midpoint; gate 1 there still fails through the RMSNorm after it, docs/golden.md §4). CUDA tensors in bf16: one
    cuBLAS GEMM (its own order; the GPU tolerance is measured). A module in training mode with autograd recording:
    one F.linear too (the order is not part of what is learned; 2-5x faster). Deterministic mode, any device,
    training or not: `exact_block_linear` (exact 32-wide block sums)."""
    if is_deterministic():
        return exact_block_linear(x, weight, bias)
    if training and torch.is_grad_enabled():
        return F.linear(x.to(weight.dtype), weight, bias)
    if x.is_cuda and weight.dtype != torch.float32:
        return F.linear(x.to(weight.dtype), weight, bias)
    return block_scaled_linear_ref(x, weight, bias)


def packed_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for a `PackedWeight` on a GPU, x already FP8 QDQ'd; see `packed_linear_ref` (Triton twin:
    the bytes decoded in registers, bf16 tensor cores, fp32 accumulation). An fp32 weight (the parity dtype) takes
    the official order, read block by block (`block_scaled_linear_ref`, as `quant_linear`)."""
    if weight.dtype == torch.float32:
        return block_scaled_linear_ref(x, weight, bias)
    return _dispatch("packed_linear", packed_linear_ref, (x, weight, bias), [x, weight.codes, weight.scale], x,
                     fits=x.size(-1) % 32 == 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm; see `rms_norm_ref` (Triton twin: one program per row, bf16 activations)."""
    return _dispatch("rms_norm", rms_norm_ref, (x, weight, eps), [x, weight], x,
                     fits=x.size(-1) <= 16384 and weight.numel() == x.size(-1))


def rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last R dims of x; see `apply_rope_ref` (Triton twin: one launch, bf16 activations)."""
    fits = (x.dim() in (3, 4) and freqs.dim() == 3 and freqs.dtype == torch.complex64 and freqs.size(1) == x.size(1)
            and freqs.size(0) in (1, x.size(0)) and x.size(-1) <= 16384)
    return _dispatch("rope", apply_rope_ref, (x, freqs, inverse), [x, freqs], x, fits=fits)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                query_chunk: int = 1024) -> torch.Tensor:
    """Sparse attention with sinks on dense KV; see `sparse_attn_ref`."""
    return _dispatch("sparse_attn", sparse_attn_ref, (q, kv, sink, idx, scale, query_chunk), [q, kv, sink, idx], q)


def sparse_attn_packed(q, swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx, sink, scale):
    """Decode sparse attention over the packed store; see `sparse_attn_packed_ref`."""
    return _dispatch("sparse_attn_packed", sparse_attn_packed_ref,
                     (q, swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx, sink, scale),
                     [q, swa_ring, main_pages, sink], q)


def indexer_scores_packed(q, w, index_pages, page_table, n_vis, entries=None, n_entries=None):
    """Decode indexer scores over packed keys; see `indexer_scores_packed_ref`."""
    return _dispatch("indexer_scores_packed", indexer_scores_packed_ref,
                     (q, w, index_pages, page_table, n_vis, entries, n_entries), [q, w, index_pages], q)


def indexer_topk_packed(q, w, index_pages, page_table, n_vis, topk, cand_blocks=None, pool_blocks=0,
                        block_size=8, ties="official", n_max=None):
    """Decode indexer top-k (and candidate pool) over packed keys; see `indexer_topk_packed_ref`."""
    args = (q, w, index_pages, page_table, n_vis, topk, cand_blocks, pool_blocks, block_size, ties, n_max)
    return _dispatch("indexer_topk_packed", indexer_topk_packed_ref, args, [q, w, index_pages], q)


# The mixes kernel is opt-in (DSV41_HC_MIXES_KERNEL=1): on an H100 it parts the engine's greedy tokens between eager
# steps and CUDA-graph replays (shares 0.82 / 0.94 over model seeds 3 / 4, against 1.00 / 1.00 with the torch mixes;
# `benchmarks/graph_eager_share.py`, results/graph_eager_share_h100-2026-12-07.log), with aligned_rows in place, so
# pointer alignment is not the cause; cause not found. It saves 3 x ~130 small kernels per step, yet the
# graph-replayed step is no faster with it (21.95 vs 21.90 ms at batch 1, 37.40 vs 37.66 at 32:
# results/decode_step_ab_h100-2026-12-07.log).
HC_MIXES_KERNEL = os.environ.get("DSV41_HC_MIXES_KERNEL") == "1"


def hc_post(f, residual, post, comb):
    """A block's residual update alone (no fused step follows it); see `mhc_math.hc_post`. The Triton kernel
    (bf16 f and residual, 4 streams) gives the same bits."""
    return _dispatch("hc_post", hc_post_ref, (f, residual, post, comb), [f, residual, post, comb], f,
                     fits=residual.size(-2) == 4 and f.dtype == residual.dtype == torch.bfloat16)


def hc_mixes(x, fn, scale, base, S, iters, eps, norm_eps):
    """A sub-layer's mHC mixes (pre, post, comb) from its input stream; see `mhc_math.hc_mixes`. The Triton kernel
    (opt-in, HC_MIXES_KERNEL) takes 4 streams and decode sizes (a program per token)."""
    args = (x, fn, scale, base, S, iters, eps, norm_eps)
    return _dispatch("hc_mixes", hc_mixes_ref, args, [x, fn, scale, base], x,
                     fits=HC_MIXES_KERNEL and S == 4 and x.size(-2) == 4 and x[..., 0, 0].numel() <= 256)


def moe_gate(x, weight, bias, topk, score_func, gate_temp, norm_topk_prob, route_scale):
    """The MoE gate's routing; see `moe_gate_ref`. The Triton kernel: a program per token, decode sizes."""
    args = (x, weight, bias, topk, score_func, gate_temp, norm_topk_prob, route_scale)
    return _dispatch("moe_gate", moe_gate_ref, args, [x, weight, bias], x,
                     fits=x.dim() == 2 and x.size(0) <= 256 and weight.size(0) <= 1024)


def mhc_fused(f, residual, post, comb, pre_lag, fn, scale, base, norm_weight, iters, eps, norm_eps, rms_eps):
    """One fused mHC step between sub-layers; see `mhc_fused_ref`. The Triton kernel takes 4 streams."""
    args = (f, residual, post, comb, pre_lag, fn, scale, base, norm_weight, iters, eps, norm_eps, rms_eps)
    return _dispatch("mhc_fused", mhc_fused_ref, args, list(args[:9]), residual, fits=residual.size(-2) == 4)


def qdq_fp8(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 activation quantize-dequantize; see `dsv41.codecs.qdq_fp8` (bit-identical Triton twin)."""
    return _dispatch("qdq_fp8", qdq_fp8_ref, (x, group), [x], fp8=True)


def qdq_index_k(x: torch.Tensor) -> torch.Tensor:
    """The indexer's MXFP4 QDQ of keys and queries; see `dsv41.codecs.qdq_index_k` (bit-identical Triton twin on
    finite inputs)."""
    return _dispatch("qdq_index_k", qdq_index_k_ref, (x,), [x], fits=x.dim() > 0 and x.shape[-1] % 32 == 0)


def pack_swa_kv_ref(x: torch.Tensor) -> torch.Tensor:
    """`dsv41.codecs.pack_swa_kv` without its finiteness check (a host sync): the store's writes."""
    return _pack_swa_kv_codec(x, check_finite=False)


def pack_swa_kv(x: torch.Tensor) -> torch.Tensor:
    """Packed SWA-KV rows of finite x [..., d]; see `pack_swa_kv_ref` (bit-identical Triton twin)."""
    return _dispatch("pack_swa_kv", pack_swa_kv_ref, (x,), [x], fp8=True)


def expert_act(gate, up, weights, limit, quantize, dtype):
    """See `expert_act_ref` (Triton twin: one kernel instead of ~9)."""
    tensors = [gate, up] + ([weights] if weights is not None else [])
    return _dispatch("expert_act", expert_act_ref, (gate, up, weights, limit, quantize, dtype), tensors, fp8=True,
                     fits=gate.dim() == 2 and gate.size(-1) % 32 == 0)


def moe_experts(x, indices, weights, w1, w3, w2, limit, quant_in, quant_mid):
    """A MoE layer's routed + shared experts over their weights (dense or packed); see `moe_experts_ref` (Triton
    twin: 3 kernels and device-side routing, no host sync; bf16 x and weights only: fp32 master weights under bf16 autocast, as in the
    DSpark training stage, take the reference)."""
    ts = [getattr(w, "codes", w) for w in (w1[0], w3[0], w2[0], w1[-1])]       # a PackedWeight: its code bytes
    return _dispatch("moe_experts", moe_experts_ref, (x, indices, weights, w1, w3, w2, limit, quant_in, quant_mid),
                     [x, weights, *ts], fp8=True,
                     fits=x.dim() == 2 and x.dtype == torch.bfloat16 and w1[0].dtype == torch.bfloat16)
