"""The engine's KV store (SYSTEM.md 3): packed, paged storage bound into the model through the `DenseCache`
interface, and its byte accounting.

    pool = PackedKVPool(cfg, device, dtype=model.dtype)      # one per engine
    sid = pool.new_sequence()                                # per request; pool.free(sid) when it leaves
    model(ids, pool.bind([sid, ...]))                        # any batch of sequences, rows at any positions
    pool.seq_bytes(sid), pool.global_bytes_per_token(sid)    # bytes by kind

Only for quantized models (the packed formats round unquantized values); see `dsv41.kv.paged`.
"""

from dsv41.kv.paged import BatchView, PackedKVPool, pack_main_kv_exact

__all__ = ["BatchView", "PackedKVPool", "pack_main_kv_exact"]
