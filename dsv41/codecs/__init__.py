"""Packed KV codecs and their fake-quant (QDQ) twins for DeepSeek-V4.1-Flash (docs/model.md §3.3-3.6, §9, §10).

Three packed records (uint8, last dim = bytes), each with a QDQ twin that returns the same values in the
input dtype without packing (for the model forward; never raises, never syncs with the host):

=================  =========================  ==============================  ===========================
format             pack / unpack              QDQ twin                        bytes for d channels
=================  =========================  ==============================  ===========================
SWA KV (3.3)       pack_swa_kv / unpack_...   qdq_fp8(x, group=32)            d + d/32   (528 for 512)
main KV (3.4)      pack_main_kv / unpack_...  qdq_main_kv(x)                  d/2 + d/16 (288 for 512)
index K (3.6)      pack_index_k / unpack_...  qdq_index_k(x) == qdq_index_q   d/2 + d/32 (68 for 128)
=================  =========================  ==============================  ===========================

``qdq_fp8`` is also the activation quantization before every fp8/fp4 Linear; ``qdq_index_k`` is also the
indexer query quantization. Element primitives for the checkpoint loader: ``e4m3_to_float``,
``float_to_e4m3``, ``e8m0_to_float``, ``float_to_e8m0``, ``e2m1_to_float``, ``float_to_e2m1``,
``pack_nibbles``, ``unpack_nibbles``; the same decoders by table (one gather over a 256-entry table per device,
the same bits), which the record and weight readers use: ``e4m3_values``, ``e8m0_values``, ``e2m1_pair_values``.
``pack_main_kv_exact`` writes the main-KV record so that it decodes to a
QDQ value exactly even where the codec's re-derived scale would not (the packed KV store's writer). See fp8.py and
fp4.py for the bit layouts.
"""

from .fp4 import (E2M1_MAX, FP4_MAX_INV, INDEX_K_AMAX_FLOOR, INDEX_K_GROUP, MAIN_KV_AMAX_FLOOR, MAIN_KV_GROUP,
                  e2m1_pair_values, e2m1_to_float, float_to_e2m1, index_k_bytes, main_kv_bytes, pack_index_k,
                  pack_main_kv, pack_main_kv_exact, pack_nibbles, qdq_index_k, qdq_index_q, qdq_main_kv,
                  round_to_e2m1, unpack_index_k, unpack_main_kv, unpack_nibbles)
from .fp8 import (E4M3_MAX, FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX_INV, e4m3_to_float, e4m3_values, e8m0_to_float,
                  e8m0_values, float_to_e4m3, float_to_e8m0, pack_swa_kv, qdq_fp8, round_to_e4m3, swa_kv_bytes,
                  ue8m0_scale_byte, unpack_swa_kv)

__all__ = ["E2M1_MAX", "E4M3_MAX", "FP4_MAX_INV", "FP8_AMAX_FLOOR", "FP8_GROUP", "FP8_MAX_INV", "INDEX_K_AMAX_FLOOR",
           "INDEX_K_GROUP", "MAIN_KV_AMAX_FLOOR", "MAIN_KV_GROUP", "e2m1_pair_values", "e2m1_to_float", "e4m3_to_float",
           "e4m3_values", "e8m0_to_float", "e8m0_values",
           "float_to_e2m1", "float_to_e4m3", "float_to_e8m0", "index_k_bytes", "main_kv_bytes", "pack_index_k",
           "pack_main_kv", "pack_main_kv_exact", "pack_nibbles", "pack_swa_kv", "qdq_fp8", "qdq_index_k",
           "qdq_index_q", "qdq_main_kv", "round_to_e2m1", "round_to_e4m3", "swa_kv_bytes", "ue8m0_scale_byte",
           "unpack_index_k", "unpack_main_kv", "unpack_nibbles", "unpack_swa_kv"]
