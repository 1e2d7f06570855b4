"""The engine's KV store (docs/system.md §3): packed, paged storage bound into the model through the `DenseCache`
interface, and its byte accounting.

    pool = PackedKVPool(cfg, device, dtype=model.dtype)      # one per engine
    sid = pool.new_sequence()                                # per request; pool.free(sid) when it leaves
    model(ids, pool.bind([sid, ...]))                        # any batch of sequences, rows at any positions
    pool.seq_bytes(sid), pool.global_bytes_per_token(sid)    # bytes by kind

Only for quantized models (the packed formats round unquantized values); see `dsv41.kv.pool`.
"""

from dsv41.kv.batch_view import BatchView
from dsv41.kv.pool import PackedKVPool
from dsv41.kv.state_format import GlobalState, SwaState

__all__ = ["BatchView", "GlobalState", "PackedKVPool", "SwaState"]
