"""Kernels: torch references (`*_ref`) and their Triton twins (same signatures), one backend switch.

  ref.py         sparse_attn_ref: the model's sparse attention with sinks on dense KV (MODEL.md 3.8); rms_norm
  packed_ref.py  references over the engine's packed store: sparse_attn_packed_ref (decode: FP8 ring + FP4 pages),
                 indexer_scores_packed_ref / indexer_topk_packed_ref (decode indexer, MXFP4 keys, candidate pool)
  mhc_ref.py     mhc_fused_ref: one mHC step between sub-layers (hc_post, next hc_mixes, lagged hc_pre + RMSNorm)
  mhc_math.py    the mHC functions (hc_post, hc_mixes, hc_pre, hc_split_sinkhorn) the model and mhc_ref share
  gemm_ref.py    block_scaled_linear_ref: the fp8 / fp4-weight GEMM in the official summation order (per 32-wide K
                 block, blocks accumulated in K order)
  moe_ref.py     moe_experts_ref: a MoE layer's routed + shared experts over their weights (and the summation
                 `moe_combine`, expert_act_ref: the expert's SwiGLU middle, shared with the model's module loop)
  (codecs)       the references of qdq_fp8 and pack_swa_kv are the codecs themselves (MODEL.md 3.3)
  backend.py     set_backend("auto" | "torch" | "triton"), chosen once; auto = Triton on CUDA bf16 inputs without
                 gradients, the reference otherwise (logged once per op and choice); a requested backend that
                 cannot run raises
  triton/        the Triton kernels, imported lazily (CPU installs never need Triton)

The public ops below dispatch through the switch; the model imports them from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.codecs import pack_swa_kv as _pack_swa_kv_codec
from dsv41.codecs import qdq_fp8 as qdq_fp8_ref
from dsv41.kernels.backend import BACKENDS, get_backend, resolve, set_backend, triton_available
from dsv41.kernels.packed_ref import (
    candidate_pool,
    decode_window_rows,
    indexer_scores_packed_ref,
    indexer_select,
    indexer_topk_packed_ref,
    page_table_of,
    pool_entries,
    sparse_attn_packed_ref,
)
from dsv41.kernels.gemm_ref import block_scaled_linear_ref
from dsv41.kernels.mhc_ref import mhc_fused_ref
from dsv41.kernels.moe_ref import expert_act_ref, moe_combine, moe_experts_ref
from dsv41.kernels.ref import sparse_attn_ref

__all__ = [
    "BACKENDS", "set_backend", "get_backend", "triton_available",
    "sparse_attn", "sparse_attn_ref",
    "sparse_attn_packed", "sparse_attn_packed_ref",
    "indexer_scores_packed", "indexer_scores_packed_ref",
    "indexer_topk_packed", "indexer_topk_packed_ref",
    "decode_window_rows", "page_table_of", "pool_entries", "candidate_pool", "indexer_select",
    "mhc_fused", "mhc_fused_ref", "qdq_fp8", "qdq_fp8_ref",
    "pack_swa_kv", "pack_swa_kv_ref", "expert_act", "expert_act_ref",
    "moe_experts", "moe_experts_ref", "moe_combine", "quant_linear", "block_scaled_linear_ref",
]


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 training: bool = False) -> torch.Tensor:
    """x W^T (+ bias) for a weight of a quantized checkpoint kind (fp8 / fp4), x already FP8 QDQ'd.

    CPU: `block_scaled_linear_ref`, the official summation order (bit-identical to the official code on the same
    machine). CUDA tensors: one cuBLAS GEMM (its own order; the GPU tolerance is measured). A module in training
    mode with autograd recording: one F.linear too (the order is not part of what is learned; 2-5x faster)."""
    if x.is_cuda or (training and torch.is_grad_enabled()):
        return F.linear(x.to(weight.dtype), weight, bias)
    return block_scaled_linear_ref(x, weight, bias)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                query_chunk: int = 1024) -> torch.Tensor:
    """Sparse attention with sinks on dense KV; see `sparse_attn_ref`."""
    if resolve("sparse_attn", [q, kv, sink, idx], bf16=q) == "triton":
        from dsv41.kernels.triton import sparse_attn_triton
        return sparse_attn_triton(q, kv, sink, idx, scale, query_chunk)
    return sparse_attn_ref(q, kv, sink, idx, scale, query_chunk)


def sparse_attn_packed(q, swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx, sink, scale):
    """Decode sparse attention over the packed store; see `sparse_attn_packed_ref`."""
    args = (q, swa_ring, ring_slots, win_idx, main_pages, page_table, topk_idx, sink, scale)
    if resolve("sparse_attn_packed", [q, swa_ring, main_pages, sink], bf16=q) == "triton":
        from dsv41.kernels.triton import sparse_attn_packed_triton
        return sparse_attn_packed_triton(*args)
    return sparse_attn_packed_ref(*args)


def indexer_scores_packed(q, w, index_pages, page_table, n_vis, entries=None, n_entries=None):
    """Decode indexer scores over packed keys; see `indexer_scores_packed_ref`."""
    args = (q, w, index_pages, page_table, n_vis, entries, n_entries)
    if resolve("indexer_scores_packed", [q, w, index_pages], bf16=q) == "triton":
        from dsv41.kernels.triton import indexer_scores_packed_triton
        return indexer_scores_packed_triton(*args)
    return indexer_scores_packed_ref(*args)


def indexer_topk_packed(q, w, index_pages, page_table, n_vis, topk, cand_blocks=None, pool_blocks=0,
                        block_size=8, ties="official", n_max=None):
    """Decode indexer top-k (and candidate pool) over packed keys; see `indexer_topk_packed_ref`."""
    args = (q, w, index_pages, page_table, n_vis, topk, cand_blocks, pool_blocks, block_size, ties, n_max)
    if resolve("indexer_topk_packed", [q, w, index_pages], bf16=q) == "triton":
        from dsv41.kernels.triton import indexer_topk_packed_triton
        return indexer_topk_packed_triton(*args)
    return indexer_topk_packed_ref(*args)


def mhc_fused(f, residual, post, comb, pre_lag, fn, scale, base, norm_weight, iters, eps, norm_eps, rms_eps):
    """One fused mHC step between sub-layers; see `mhc_fused_ref`. The Triton kernel takes 4 streams."""
    args = (f, residual, post, comb, pre_lag, fn, scale, base, norm_weight, iters, eps, norm_eps, rms_eps)
    tensors = [f, residual, post, comb, pre_lag, fn, scale, base, norm_weight]
    if residual.size(-2) == 4 and resolve("mhc_fused", tensors, bf16=residual) == "triton":
        from dsv41.kernels.triton import mhc_fused_triton
        return mhc_fused_triton(*args)
    return mhc_fused_ref(*args)


_CAPABILITY: dict = {}


def _fp8_triton_ok(op: str, x: torch.Tensor, *more: torch.Tensor) -> bool:
    """The switch's choice for an FP8 quantizer: the Triton kernels convert to E4M3 in hardware (sm_89+)."""
    if resolve(op, [x, *more]) != "triton":
        return False
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    if cap >= (8, 9):
        return True
    if get_backend() == "triton":
        raise ValueError(f"kernel backend 'triton': {op} needs a GPU of compute capability 8.9 or newer")
    return False


def qdq_fp8(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 activation quantize-dequantize; see `dsv41.codecs.qdq_fp8` (bit-identical Triton twin)."""
    if _fp8_triton_ok("qdq_fp8", x):
        from dsv41.kernels.triton import qdq_fp8_triton
        return qdq_fp8_triton(x, group)
    return qdq_fp8_ref(x, group)


def pack_swa_kv_ref(x: torch.Tensor) -> torch.Tensor:
    """`dsv41.codecs.pack_swa_kv` without its finiteness check (a host sync): the store's writes."""
    return _pack_swa_kv_codec(x, check_finite=False)


def pack_swa_kv(x: torch.Tensor) -> torch.Tensor:
    """Packed SWA-KV rows of finite x [..., d]; see `pack_swa_kv_ref` (bit-identical Triton twin)."""
    if _fp8_triton_ok("pack_swa_kv", x):
        from dsv41.kernels.triton import pack_swa_kv_triton
        return pack_swa_kv_triton(x)
    return pack_swa_kv_ref(x)


def expert_act(gate, up, weights, limit, quantize, dtype):
    """See `expert_act_ref` (Triton twin: one kernel instead of ~9)."""
    more = [up] + ([weights] if weights is not None else [])
    if gate.dim() == 2 and gate.size(-1) % 32 == 0 and _fp8_triton_ok("expert_act", gate, *more):
        from dsv41.kernels.triton import expert_act_triton
        return expert_act_triton(gate, up, weights, limit, quantize, dtype)
    return expert_act_ref(gate, up, weights, limit, quantize, dtype)


def moe_experts(x, indices, weights, w1, w3, w2, limit, quant_in, quant_mid):
    """A MoE layer's routed + shared experts over their weights; see `moe_experts_ref` (Triton twin: 3 kernels and
    device-side routing, no host sync)."""
    args = (x, indices, weights, w1, w3, w2, limit, quant_in, quant_mid)
    if x.dim() == 2 and _fp8_triton_ok("moe_experts", x, weights, w1[0], w3[0], w2[0], w1[-1]) \
            and x.dtype == torch.bfloat16:
        from dsv41.kernels.triton import moe_experts_triton
        return moe_experts_triton(*args)
    return moe_experts_ref(*args)
