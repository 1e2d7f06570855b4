"""KV bytes by kind, measured in the engine's packed store, beside the analytic figures (docs/system.md §1 and §3).

`bench_kv(cfg, tokens)` is `dsv41 bench kv`: it allocates the real `PackedKVPool` for one sequence of N tokens
and fills it without running the model: the global store of every KV-source layer with N // m entries, the SWA
rings with their last W rows, the compressor carry with the N % m tokens of the open group. Global entries are
real codec records (`pack_main_kv` / `pack_index_k` of random normal latents): a bank of them is packed once per
layer and written in chunks through the pool's page allocator, cycling through the bank (packing a million
entries per layer would take minutes on a CPU and measure the codec, not the store). Ring rows go through the
same `write_window` the model calls.

The measured global bytes per token is what the sequence's pages hold in records (entries x 356 B for the
released geometry) over N; it equals the analytic figure exactly whenever N is a multiple of every ratio (890 B/token
for v41-flash and v41-geometry). The analytic figures here count the codecs' record sizes over the config's layer
roles; `dsv41 analyze kv` (`dsv41.analysis.kv_bytes`) derives the same ones from the formats' bit widths, and the
tests hold the three equal.
"""

from __future__ import annotations

import resource
import time
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F

from dsv41.codecs import index_k_bytes, main_kv_bytes, pack_index_k, pack_main_kv, qdq_fp8, swa_kv_bytes
from dsv41.config import ModelConfig, load_config, layer_roles
from dsv41.kv.pages import KINDS
from dsv41.kv.pool import PackedKVPool


def as_number(x: Fraction | int) -> int | float:
    """An exact int when the fraction is one, else a float (JSON friendly)."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def analytic_global_bytes_per_token(cfg: ModelConfig) -> Fraction:
    """Sum over the KV sources of (main + index record bytes) / m (docs/system.md §1): 890 for V4.1-Flash."""
    entry = main_kv_bytes(cfg.head_dim) + index_k_bytes(cfg.index_head_dim)
    return sum((Fraction(entry, r.ratio) for r in layer_roles(cfg) if r.is_kv_source), Fraction(0))


def analytic_swa_bytes(cfg: ModelConfig) -> int:
    """SWA rings one sequence holds: W packed rows per backbone layer and per DSpark stage."""
    return cfg.total_layers * cfg.window_size * swa_kv_bytes(cfg.head_dim)


def analytic_pending_bytes(pool: PackedKVPool) -> int:
    """Compressor carry one sequence holds: fp32 kv + score of m x C per layer with pending rows."""
    return sum(2 * s.pending_rows * s.width * 4 for s in pool.specs.values())


def kv_bytes_report(pool: PackedKVPool, sid: int) -> dict[str, Any]:
    """Bytes one sequence holds by kind, per token, and the analytic figures beside them."""
    cfg = pool.cfg
    b = pool.seq_bytes(sid)
    n = b["tokens"]
    s = pool.seqs[sid]
    by_layer = [{"layer": L, "ratio": pl.spec.ratio, "entries": s.rows[(L, "main")],
                 "main_record_bytes": pl.record_bytes["main"], "index_record_bytes": pl.record_bytes["index"],
                 "bytes": sum(s.rows[(L, k)] * pl.record_bytes[k] for k in KINDS), "pages": len(s.pages[L])}
                for L, pl in pool.global_layers.items()]
    return {"tokens": n, "global_bytes": b["global_entries_bytes"], "global_main_bytes": b["global_main_bytes"],
            "global_index_bytes": b["global_index_bytes"], "allocated_global_bytes": b["global_allocated_bytes"],
            "global_pages": b["global_pages"], "page_size": pool.page_size,
            "measured_global_bytes_per_token": as_number(Fraction(b["global_entries_bytes"], n)) if n else None,
            "analytic_global_bytes_per_token": as_number(analytic_global_bytes_per_token(cfg)),
            "allocated_global_bytes_per_token": float(b["global_allocated_bytes"] / n) if n else None,
            "swa_bytes": b["swa_bytes"], "analytic_swa_bytes": analytic_swa_bytes(cfg),
            "pending_bytes": b["pending_bytes"], "analytic_pending_bytes": analytic_pending_bytes(pool),
            "by_layer": by_layer}


@torch.no_grad()
def fill_random(pool: PackedKVPool, sid: int, tokens: int, chunk: int = 1 << 16, seed: int = 0,
                bank: int = 1024) -> dict[str, float]:
    """Fill sequence `sid` (empty) as if `tokens` tokens had been run, with random codec records (see the module
    doc). Returns {'seconds': fill time, 'checked_entries': entries read back and compared}."""
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    s = pool.seqs[sid]
    if s.pos:
        raise ValueError(f"sequence {sid} is not empty (position {s.pos})")
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    view = pool.bind([sid])
    checked = 0
    for L, pl in pool.global_layers.items():
        m = pl.spec.ratio
        n = tokens // m
        recs = {"main": pack_main_kv(torch.randn(bank, pl.spec.width, generator=gen), check_finite=False),
                "index": pack_index_k(torch.randn(bank, pl.spec.index_width, generator=gen), check_finite=False)}
        recs = {k: v.to(pool.device) for k, v in recs.items()}
        off = int(torch.randint(bank, (1,), generator=gen))
        for r in range(0, n, chunk):
            c = min(chunk, n - r)
            idx = (torch.arange(r, r + c) + off) % bank
            for kind in ("index", "main"):                      # the model's order: keys, then the entry
                view.write_records(L, kind, torch.tensor([r]), recs[kind][idx.to(pool.device)].unsqueeze(0),
                                   torch.tensor([c]))
        for e0, e1 in sorted({(0, min(n, pool.page_size)), (max(0, n - pool.page_size), n)}):
            if e1 <= e0:                                        # read the first and the last page back
                continue
            for kind in KINDS:
                got, valid = view.read_records(L, kind, torch.tensor([e1]), start=e0)
                want = recs[kind][((torch.arange(e0, e1) + off) % bank).to(pool.device)]
                if not (bool(valid.all()) and torch.equal(got[0], want)):
                    raise RuntimeError(f"layer {L} {kind}: records read back differ from those written")
                checked += e1 - e0
    # SWA rings: the last W positions of every layer (backbone and DSpark), through the model's write path
    for L, spec in pool.specs.items():
        W = spec.window_rows
        first = max(0, tokens - W)
        kv = qdq_fp8(torch.randn(1, tokens - first, spec.width, generator=gen))
        view.write_window(L, torch.tensor([first]), kv.to(pool.device))
    # compressor carry: the r tokens of the open group in the last r of the m slots (empty slots: kv 0, score -inf)
    for L, spec in pool.specs.items():
        if spec.pending_rows:
            m, r = spec.pending_rows, tokens % spec.pending_rows
            kv, sc = (F.pad(torch.randn(1, r, spec.width, generator=gen), (0, 0, m - r, 0), value=empty)
                      for empty in (0.0, -torch.inf))
            view.set_compressor_state(L, kv.to(pool.device), sc.to(pool.device))
    view.pos = torch.tensor([tokens])
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    return {"seconds": time.perf_counter() - t0, "checked_entries": checked}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024          # Linux: KiB


def bench_kv(config: str | ModelConfig, tokens: int, page_size: int = 64, device: str = "cpu",
             chunk: int = 1 << 16, seed: int = 0) -> dict[str, Any]:
    """`dsv41 bench kv`: one sequence of `tokens` tokens in a fresh pool; bytes by kind and the analytic figures."""
    cfg = load_config(config) if isinstance(config, str) else config
    rss0 = _peak_rss_mb()
    pool = PackedKVPool(cfg, device=device, page_size=page_size)
    sid = pool.new_sequence()
    fill = fill_random(pool, sid, tokens, chunk=chunk, seed=seed)
    out = {"config": config if isinstance(config, str) else "custom", **kv_bytes_report(pool, sid),
           "pool_global_capacity_bytes": pool.pool_bytes()["global_capacity_bytes"],
           "fill_seconds": round(fill["seconds"], 3), "checked_entries": fill["checked_entries"],
           "peak_rss_mb_before": round(rss0, 1), "peak_rss_mb": round(_peak_rss_mb(), 1), "device": str(pool.device)}
    if pool.device.type == "cuda":
        out["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated(pool.device) / 2**20, 1)
    return out
