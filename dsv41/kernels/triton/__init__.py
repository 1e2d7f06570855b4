"""Triton kernels (GPU fast paths). Importing this package imports `triton`: only `dsv41.kernels` does, lazily,
once the backend switch (`dsv41.kernels.backend`) has chosen Triton for a call.

  sparse_attn_kernel.py  sparse_attn_triton (sparse attention with sinks on dense KV: prefill and decode)
  packed_staged.py       sparse_attn_packed_triton (decode over the packed store: entries decoded to bf16 rows, then
                         the dense kernel)
  indexer_kernel.py      indexer_scores_packed_triton, indexer_topk_packed_triton (decode, packed MXFP4 keys)
  mhc_kernel.py          mhc_fused_triton (the fused mHC step between two sub-layers), hc_mixes_triton (the mixes
                         alone, where no fused step precedes a sub-layer), hc_post_triton (the residual update
                         alone, where no fused step follows a block)
  packed_gemm.py         packed_linear_triton (x W^T over a weight's checkpoint bytes, decoded in registers)
  fp8_decode.py          fp8_decode_triton (decode sizes of bf16 models on the FP8 tensor cores, swap AB)
  fp8_gemm.py            fp8_linear_triton (prefill sizes on the FP8 tensor cores, per-32 promotion; opt in)
  splitk.py              the split-K sum inside the decode kernels (last part to finish adds the parts in order)
  moe_kernel.py          moe_experts_triton (a MoE layer's routed + shared experts: grouped GEMMs, no host sync),
                         moe_gate_triton (the gate's scores, top-K and weights: a program per token)
  quant_kernel.py        qdq_fp8_triton (the FP8 activation QDQ in front of every quantized Linear), qdq_index_k_triton
                         (the indexer's MXFP4 QDQ),
                         pack_swa_kv_triton (the packed sliding-window KV row), expert_act_triton (SwiGLU + QDQ)
  norm_rope.py           rms_norm_triton, rope_triton (the per-layer row ops in one launch each)
  decoders.py            the E4M3 / UE8M0 / E2M1 decoders (arithmetic and PTX) of the packed-store kernels
  common.py              the interpreter switches, the last compiled kernel per launcher, the SM count
"""

from dsv41.kernels.triton.indexer_kernel import indexer_scores_packed_triton, indexer_topk_packed_triton
from dsv41.kernels.triton.mhc_kernel import hc_mixes_triton, hc_post_triton, mhc_fused_triton
from dsv41.kernels.triton.norm_rope import rms_norm_triton, rope_triton
from dsv41.kernels.triton.moe_kernel import moe_experts_triton, moe_gate_triton
from dsv41.kernels.triton.packed_gemm import packed_linear_triton
from dsv41.kernels.triton.packed_staged import sparse_attn_packed_triton
from dsv41.kernels.triton.quant_kernel import expert_act_triton, pack_swa_kv_triton, qdq_fp8_triton, qdq_index_k_triton
from dsv41.kernels.triton.sparse_attn_kernel import sparse_attn_triton

__all__ = ["sparse_attn_packed_triton", "sparse_attn_triton", "indexer_scores_packed_triton",
           "indexer_topk_packed_triton", "mhc_fused_triton", "qdq_fp8_triton",
           "pack_swa_kv_triton", "expert_act_triton", "moe_experts_triton", "packed_linear_triton",
           "rms_norm_triton", "rope_triton", "hc_mixes_triton", "hc_post_triton", "moe_gate_triton",
           "qdq_index_k_triton"]
